/* CPython binding: word operations (sum128, the BF16 cast, apply, compose, gather, diff). */
#include "module.h"
#include "rp_cast.h"

/* sum128(data, w0, nwords) -> (a, b) */
PyObject *py_sum128(PyObject *self, PyObject *args) {
    Py_buffer d = {0};
    unsigned long long w0, nw;
    if (!PyArg_ParseTuple(args, "y*KK", &d, &w0, &nw)) return NULL;
    uint64_t out[2];
    uint64_t words = ((uint64_t)d.len + 7) / 8;
    if (w0 > words || nw > words - w0) {
        PyBuffer_Release(&d);
        PyErr_SetString(PyExc_ValueError, "word range out of bounds");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rp_sum128(d.buf, (size_t)d.len, w0, nw, out);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&d);
    return Py_BuildValue("(KK)", (unsigned long long)out[0], (unsigned long long)out[1]);
}

/* sum128_at(data, j0, row_words, j_stride) -> (a, b): data's whole words as rows of
 * row_words words (0: one row of all), row r at the tensor's word j0 + r * j_stride. */
PyObject *py_sum128_at(PyObject *self, PyObject *args) {
    Py_buffer d = {0};
    unsigned long long j0, row_words, stride;
    if (!PyArg_ParseTuple(args, "y*KKK", &d, &j0, &row_words, &stride)) return NULL;
    uint64_t words = (uint64_t)d.len / 8, rows;
    if ((uint64_t)d.len % 8 || (row_words && words % row_words)) {
        PyBuffer_Release(&d);
        PyErr_SetString(PyExc_ValueError, "data is not whole rows of whole words");
        return NULL;
    }
    if (!row_words) row_words = words, rows = words ? 1 : 0;
    else rows = words / row_words;
    uint64_t out[2];
    Py_BEGIN_ALLOW_THREADS
    rp_sum128_at(d.buf, rows, row_words, j0, stride, out);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&d);
    return Py_BuildValue("(KK)", (unsigned long long)out[0], (unsigned long long)out[1]);
}

static int overlaps(const Py_buffer *x, const Py_buffer *y) {
    const uint8_t *a = x->buf, *b = y->buf;
    return x->len && y->len && a < b + y->len && b < a + x->len;
}

/* Whether any of the m buffers (m - 1 of them written) overlaps another. */
static int any_overlap(const Py_buffer *const *b, int m) {
    for (int i = 0; i < m; i++)
        for (int j = i + 1; j < m; j++)
            if (overlaps(b[i], b[j])) return 1;
    return 0;
}

/* cast_bf16(src float32 bits, dst writable uint16) -> NaN count: rp_cast_bf16 (rp_cast.h) */
PyObject *py_cast_bf16(PyObject *self, PyObject *args) {
    Py_buffer s = {0}, d = {0};
    if (!PyArg_ParseTuple(args, "y*w*", &s, &d)) return NULL;
    PyObject *res = NULL;
    int64_t nans;
    if (s.len % 4 || d.len != s.len / 2) {
        PyErr_SetString(PyExc_ValueError, "dst must hold one uint16 per float32 of src");
    } else if (overlaps(&s, &d)) {
        PyErr_SetString(PyExc_ValueError, "src and dst overlap");
    } else {
        Py_BEGIN_ALLOW_THREADS
        nans = rp_cast_bf16(s.buf, d.buf, (int64_t)(s.len / 4));
        Py_END_ALLOW_THREADS
        res = PyLong_FromLongLong((long long)nans);
    }
    PyBuffer_Release(&s);
    PyBuffer_Release(&d);
    return res;
}

/* cast_bf16_diff(src, prev uint16, dst, pos int64 (w), old uint16 (w), new uint16 (w))
 *     -> (differences, NaN count): rp_cast_bf16_diff; cap = len(pos) */
PyObject *py_cast_bf16_diff(PyObject *self, PyObject *args) {
    Py_buffer s = {0}, p = {0}, d = {0}, pos = {0}, ov = {0}, nv = {0};
    if (!PyArg_ParseTuple(args, "y*y*w*w*w*w*", &s, &p, &d, &pos, &ov, &nv)) return NULL;
    PyObject *res = NULL;
    int64_t k, nans, cap = (int64_t)(pos.len / 8);
    if (s.len % 4 || d.len != s.len / 2 || p.len != d.len) {
        PyErr_SetString(PyExc_ValueError, "dst and prev must hold one uint16 per float32 of src");
    } else if (pos.len % 8 || ov.len != cap * 2 || nv.len != cap * 2) {
        PyErr_SetString(PyExc_ValueError, "pos (int64), old and new (uint16) must be as long");
    } else if (any_overlap((const Py_buffer *[]){&s, &p, &d, &pos, &ov, &nv}, 6)) {
        PyErr_SetString(PyExc_ValueError, "buffers overlap");
    } else {
        Py_BEGIN_ALLOW_THREADS
        k = rp_cast_bf16_diff(s.buf, p.buf, d.buf, (int64_t)(s.len / 4), pos.buf, ov.buf,
                              nv.buf, cap, &nans);
        Py_END_ALLOW_THREADS
        res = Py_BuildValue("(LL)", (long long)k, (long long)nans);
    }
    PyBuffer_Release(&s); PyBuffer_Release(&p); PyBuffer_Release(&d);
    PyBuffer_Release(&pos); PyBuffer_Release(&ov); PyBuffer_Release(&nv);
    return res;
}

/* apply(kind, data, pos:int64, old, new[, dry[, readback[, j0, row_words, j_skip]]]) ->
 * (da, db); old/new in element width; data writable unless dry (checked, the change summed,
 * nothing written); readback: the written elements read back as it goes (a difference: all
 * put back, CorruptError); j0, row_words, j_skip: where data's words sit in the tensor the
 * change is summed for (rp_jmap; all 0: the same words) */
PyObject *py_apply(PyObject *self, PyObject *args) {
    PyObject *kt, *obj, *res = NULL;
    Py_buffer d = {0}, pos = {0}, ov = {0}, nv = {0};
    int dry = 0, readback = 0;
    unsigned long long j0 = 0, row_words = 0, j_skip = 0;
    rp_kind k;
    if (!PyArg_ParseTuple(args, "OOy*y*y*|ppKKK", &kt, &obj, &pos, &ov, &nv, &dry, &readback,
                          &j0, &row_words, &j_skip))
        return NULL;
    const rp_jmap jm = {j0, row_words, j_skip};
    /* a dry call only reads the words: any C-contiguous buffer; else a writable one */
    if (PyObject_GetBuffer(obj, &d, PyBUF_SIMPLE)) goto out;
    if (!dry && d.readonly) {
        PyErr_SetString(PyExc_TypeError, "apply: the words are read-only (a writing apply)");
        goto out;
    }
    if (kind_arg(kt, &k)) goto out;
    Py_ssize_t cnt = pos.len / 8;
    int iw = k.bits == 4 ? 1 : k.bits / 8;
    if (pos.len % 8 || ov.len != cnt * iw || nv.len != cnt * iw) {
        PyErr_SetString(PyExc_ValueError, "positions/old/new lengths differ");
        goto out;
    }
    uint64_t delta[2] = {0, 0};
    const char *err = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_apply(&k, d.buf, (size_t)d.len, pos.buf, ov.buf, nv.buf, cnt, iw, dry, readback,
                  j0 || row_words || j_skip ? &jm : NULL, delta, &err);
    Py_END_ALLOW_THREADS
    if (rc) { raise_rc(rc, err); goto out; }
    res = Py_BuildValue("(KK)", (unsigned long long)delta[0], (unsigned long long)delta[1]);
out:
    if (d.obj) PyBuffer_Release(&d);
    PyBuffer_Release(&pos); PyBuffer_Release(&ov); PyBuffer_Release(&nv);
    return res;
}

/* copy_apply(width, src, dst, pos:int64, old, new): dst = src with the words at pos checked
 * against old, replaced by new and read back (rp_copy_apply); raises with the change at fault */
PyObject *py_copy_apply(PyObject *self, PyObject *args) {
    int w;
    Py_buffer s = {0}, d = {0}, pos = {0}, ov = {0}, nv = {0};
    PyObject *res = NULL;
    if (!PyArg_ParseTuple(args, "iy*w*y*y*y*", &w, &s, &d, &pos, &ov, &nv)) return NULL;
    Py_ssize_t cnt = pos.len / 8;
    if ((w != 1 && w != 2 && w != 4 && w != 8) || s.len != d.len || s.len % w || pos.len % 8
        || ov.len != cnt * w || nv.len != cnt * w || ((uintptr_t)pos.buf & 7)) {
        PyErr_SetString(PyExc_ValueError, "copy_apply: width, buffer or array lengths");
        goto out;
    }
    const uintptr_t sb = (uintptr_t)s.buf, db = (uintptr_t)d.buf; /* a copy into its own */
    if (s.len && sb < db + (uintptr_t)d.len && db < sb + (uintptr_t)s.len) { /* source: none */
        PyErr_SetString(PyExc_ValueError, "copy_apply: src and dst overlap");
        goto out;
    }
    int64_t bad = -1;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_copy_apply(w, s.buf, d.buf, (size_t)s.len, pos.buf, ov.buf, nv.buf, cnt, &bad);
    Py_END_ALLOW_THREADS
    if (rc) {
        char msg[96];
        snprintf(msg, sizeof msg, "%s at change %lld",
                 rc == RP_EBASE ? "word differs from the update's old word"
                 : rc == RP_ECORRUPT ? "read-back differs"
                                     : "position out of range or order",
                 (long long)bad);
        raise_rc(rc, msg);
        goto out;
    }
    res = Py_None;
    Py_INCREF(res);
out:
    PyBuffer_Release(&s); PyBuffer_Release(&d); PyBuffer_Release(&pos);
    PyBuffer_Release(&ov); PyBuffer_Release(&nv);
    return res;
}

/* compose(width, pp, po, pn, qp, qo, qn, rp, ro, rn) -> count, or -1 when the patches
 * disagree on an intermediate element (the caller raises its own error) */
PyObject *py_compose(PyObject *self, PyObject *args) {
    int w;
    Py_buffer b[9];
    memset(b, 0, sizeof b);
    PyObject *res = NULL;
    if (!PyArg_ParseTuple(args, "iy*y*y*y*y*y*w*w*w*", &w, &b[0], &b[1], &b[2], &b[3], &b[4],
                          &b[5], &b[6], &b[7], &b[8]))
        return NULL;
    Py_ssize_t np_ = b[0].len / 8, nq = b[3].len / 8;
    if ((w != 1 && w != 2 && w != 4 && w != 8) || b[0].len % 8 || b[3].len % 8
        || b[1].len != np_ * w || b[2].len != np_ * w || b[4].len != nq * w
        || b[5].len != nq * w || b[6].len < (np_ + nq) * 8 || b[7].len < (np_ + nq) * w
        || b[8].len < (np_ + nq) * w) {
        PyErr_SetString(PyExc_ValueError, "compose: array lengths or width");
        goto out;
    }
    int64_t n = 0;
    const char *err = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_compose(w, b[0].buf, b[1].buf, b[2].buf, np_, b[3].buf, b[4].buf, b[5].buf, nq,
                    b[6].buf, b[7].buf, b[8].buf, &n, &err);
    Py_END_ALLOW_THREADS
    if (rc == RP_EBASE) res = PyLong_FromLong(-1);
    else if (rc) PyErr_SetString(PyExc_ValueError, err);
    else res = PyLong_FromLongLong(n);
out:
    for (int i = 0; i < 9; i++) PyBuffer_Release(&b[i]);
    return res;
}

/* gather(kind, data, pos:int64, out(writable, element width)) */
PyObject *py_gather(PyObject *self, PyObject *args) {
    PyObject *kt, *res = NULL;
    Py_buffer d = {0}, pos = {0}, o = {0};
    rp_kind k;
    int64_t n;
    if (!PyArg_ParseTuple(args, "Oy*y*w*", &kt, &d, &pos, &o)) return NULL;
    if (kind_arg(kt, &k) || elem_count(&k, d.len, &n)) goto out;
    int ow = k.bits == 4 ? 1 : k.bits / 8;
    Py_ssize_t cnt = pos.len / 8;
    if (pos.len % 8 || o.len != cnt * ow) { PyErr_SetString(PyExc_ValueError, "bad output size"); goto out; }
    const char *err = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_gather(&k, d.buf, n, pos.buf, cnt, o.buf, ow, &err);
    Py_END_ALLOW_THREADS
    if (rc) { raise_rc(rc, err); goto out; }
    res = Py_None;
    Py_INCREF(res);
out:
    PyBuffer_Release(&d); PyBuffer_Release(&pos); PyBuffer_Release(&o);
    return res;
}

/* diff(kind, a, b, start, n[, reserve[, out[, olds, news]]]) -> bytes of the int64 positions in
 * [start, start + n) where a and b differ; with `out` (a writable buffer of at least n int64
 * positions: a caller's arena, whose untouched pages are never faulted in) the positions are
 * written there and their count is returned; with `olds` and `news` too (room for n words
 * each; kinds of 8 bits and more) the differing words of a and of b are written there, taken
 * in the compare's pass.
 * Up to `reserve` elements (default 2^28): the worst case (n positions) reserved once as the
 * bytes returned and shrunk once to what was found (glibc shrinks in place or by mremap:
 * nothing is copied; untouched pages are never faulted in). Before, the bytes grew before
 * each range of 2^20 elements to its worst case; glibc serves a block under its mmap threshold
 * (raised to the largest block freed, up to 32 MiB) from the heap, where a realloc that cannot
 * grow in place copies the whole block, so by the process's history a tensor cost up to
 * ~1.25 x n x 8 bytes copied and faulted: the vLLM worker's 5-step catch-up compare at 103M
 * took 125 ms (29 in the bench's process, 17 now); 4M BF16 words at 0.2% changed 3.9 ms, now
 * 0.7. Above `reserve` (a virtual reservation of n x 8 bytes could be refused): one pass in
 * ranges of 2^20 elements into an rp_obuf (its own mapping, grown by mremap before each range
 * so that the range's positions fit: never copied), then copied out once (O(found)). */
/* diff's `out` form: the positions into `into`, and the words into `olds` and `news` when they
 * are given (checked by the caller: both or neither); returns the count found. */
static PyObject *diff_into(const rp_kind *k, const Py_buffer *a, const Py_buffer *b,
                           long long start, long long n, PyObject *into, PyObject *olds,
                           PyObject *news) {
    Py_buffer o = {0}, ob = {0}, nb = {0};
    PyObject *res = NULL;
    int64_t found = 0;
    if (PyObject_GetBuffer(into, &o, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)) return NULL;
    if (o.len / 8 < n || ((uintptr_t)o.buf & 7)) {
        PyErr_SetString(PyExc_ValueError, "out: room for n aligned int64 positions");
        goto out;
    }
    if (olds != Py_None) {
        if (k->bits < 8) {
            PyErr_SetString(PyExc_ValueError, "olds/news: kinds of 8 bits and more");
            goto out;
        }
        if (PyObject_GetBuffer(olds, &ob, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)) goto out;
        if (PyObject_GetBuffer(news, &nb, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)) goto out;
        if (ob.len / (k->bits / 8) < n || nb.len / (k->bits / 8) < n) {
            PyErr_SetString(PyExc_ValueError, "olds/news: room for n words each");
            goto out;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    rp_diff_words(k, a->buf, b->buf, start, n, (int64_t *)o.buf, ob.buf, nb.buf, n, &found);
    Py_END_ALLOW_THREADS
    res = PyLong_FromLongLong(found);
out:
    PyBuffer_Release(&o);
    if (ob.obj) PyBuffer_Release(&ob);
    if (nb.obj) PyBuffer_Release(&nb);
    return res;
}

PyObject *py_diff(PyObject *self, PyObject *args) {
    PyObject *kt, *into = Py_None, *olds = Py_None, *news = Py_None, *res = NULL;
    Py_buffer a = {0}, b = {0};
    long long start, n, reserve = (long long)1 << 28;
    rp_kind k;
    int64_t total;
    if (!PyArg_ParseTuple(args, "Oy*y*LL|LOOO", &kt, &a, &b, &start, &n, &reserve, &into, &olds,
                          &news))
        return NULL;
    if (kind_arg(kt, &k) || elem_count(&k, a.len, &total)) goto out;
    if (a.len != b.len || start < 0 || n < 0 || start + n > total) {
        PyErr_SetString(PyExc_ValueError, "bad diff range");
        goto out;
    }
    if ((olds == Py_None) != (news == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "olds and news: both or neither");
        goto out;
    }
    if (olds != Py_None && into == Py_None) {
        PyErr_SetString(PyExc_ValueError, "olds/news: with out only");
        goto out;
    }
    if (into != Py_None) {
        res = diff_into(&k, &a, &b, start, n, into, olds, news);
        goto out;
    }
    const int64_t range = (int64_t)1 << 20;
    int64_t cap = n / 32 + 1024, found = 0;
    if (n <= reserve) { /* the worst case reserved once, shrunk once: never copied */
        if (!(res = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(n ? n : 1) * 8))) goto out;
        Py_BEGIN_ALLOW_THREADS
        rp_diff(&k, a.buf, b.buf, start, n, (int64_t *)PyBytes_AS_STRING(res), n, &found);
        Py_END_ALLOW_THREADS
        _PyBytes_Resize(&res, (Py_ssize_t)found * 8); /* NULL on failure */
        goto out;
    }
    rp_obuf ob = {0};
    for (int64_t s = start; s < start + n; s += range) {
        int64_t len = start + n - s < range ? start + n - s : range, got = 0;
        if (found + len > cap) {
            cap = cap * 2 > found + len ? cap * 2 : found + len;
            cap = cap < n ? cap : n;
        }
        if (rp_obuf_reserve(&ob, (size_t)cap * 8 - ob.len)) {
            rp_obuf_free(&ob);
            PyErr_NoMemory();
            goto out;
        }
        Py_BEGIN_ALLOW_THREADS
        rp_diff(&k, a.buf, b.buf, s, len, (int64_t *)ob.b + found, cap - found, &got);
        Py_END_ALLOW_THREADS
        found += got;
        ob.len = (size_t)found * 8;
    }
    res = PyBytes_FromStringAndSize((const char *)ob.b, (Py_ssize_t)found * 8);
    rp_obuf_free(&ob);
out:
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return res;
}
