/* CPython binding: the decoder's entry points (table, decode_range, join_release,
 * decode_apply_view). */
#include "module.h"

/* table(kind, payload, n_elements) -> list of changed counts per chunk (validated params) */
PyObject *py_table(PyObject *self, PyObject *args) {
    PyObject *kt, *res = NULL;
    Py_buffer pl = {0};
    long long n;
    rp_kind k;
    if (!PyArg_ParseTuple(args, "Oy*L", &kt, &pl, &n)) return NULL;
    size_t *offs = NULL, *lens = NULL;
    if (kind_arg(kt, &k)) goto out;
    if (n < 0 || n >= (1LL << 48)) { PyErr_SetString(PyExc_ValueError, "bad element count"); goto out; }
    int64_t nch = (n + RP_CHUNK - 1) / RP_CHUNK; /* none for an empty tensor: an empty payload */
    if (nch > (int64_t)pl.len) { raise_rc(RP_ECORRUPT, "payload shorter than its chunk table"); goto out; }
    offs = malloc((nch + 1) * sizeof *offs);
    lens = malloc((nch + 1) * sizeof *lens);
    if (!offs || !lens) { PyErr_NoMemory(); goto out; }
    if (rp_parse_table(pl.buf, (size_t)pl.len, nch, offs, lens)) {
        raise_rc(RP_ECORRUPT, "corrupt chunk table");
        goto out;
    }
    res = PyList_New(nch);
    for (int64_t i = 0; res && i < nch; i++) {
        int64_t cnt;
        const char *err = NULL;
        int64_t len = n - i * RP_CHUNK < RP_CHUNK ? n - i * RP_CHUNK : RP_CHUNK;
        int rc = rp_chunk_count(&k, (const uint8_t *)pl.buf + offs[i], lens[i], len, &cnt, &err);
        if (rc) { Py_CLEAR(res); raise_rc(rc, err); break; }
        PyList_SET_ITEM(res, i, PyLong_FromLongLong(cnt));
    }
out:
    free(offs); free(lens);
    PyBuffer_Release(&pl);
    return res;
}

/* decode_range(kind, base, payload, first, last, counts, offsets, pos_out, old_out, new_out
 *              [, write]) decodes chunks [first, last) writing chunk i's outputs at
 * offsets[i - first]. With write, each chunk's new elements are also written into base
 * (writable) right after it is decoded, and the rp.sum128 change (a, b) is returned; on an
 * error the chunks written by this call are put back first. With write and hash, also the
 * rp.sum128 state of the range's words as read before the writes: (a, b, s0, s1). */
PyObject *py_decode_range(PyObject *self, PyObject *args) {
    PyObject *kt, *offl, *cntl;
    Py_buffer base = {0}, pl = {0}, po = {0}, oo = {0}, no = {0};
    Py_ssize_t c0, c1;
    rp_kind k;
    int64_t n;
    PyObject *res = NULL;
    int write = 0, hash = 0;
    if (!PyArg_ParseTuple(args, "Oy*y*nnOOw*w*w*|pp", &kt, &base, &pl, &c0, &c1, &cntl, &offl,
                          &po, &oo, &no, &write, &hash))
        return NULL;
    if (write && base.readonly) {
        PyErr_SetString(PyExc_ValueError, "write=True needs a writable base");
        PyBuffer_Release(&base); PyBuffer_Release(&pl); PyBuffer_Release(&po);
        PyBuffer_Release(&oo); PyBuffer_Release(&no);
        return NULL;
    }
    size_t *offs = NULL, *lens = NULL;
    int64_t *cnt = NULL, *oo_ = NULL;
    if (kind_arg(kt, &k) || elem_count(&k, base.len, &n)) goto out;
    int64_t nch = (n + RP_CHUNK - 1) / RP_CHUNK;
    Py_ssize_t m = c1 - c0;
    int ow = k.bits == 4 ? 1 : k.bits / 8;
    if (c0 < 0 || m <= 0 || c1 > nch || !PyList_Check(offl) || !PyList_Check(cntl)
        || PyList_GET_SIZE(offl) != m || PyList_GET_SIZE(cntl) != m) {
        PyErr_SetString(PyExc_ValueError, "bad chunk range");
        goto out;
    }
    offs = malloc(nch * sizeof *offs);
    lens = malloc(nch * sizeof *lens);
    cnt = malloc(m * sizeof *cnt);
    oo_ = malloc(m * sizeof *oo_);
    if (!offs || !lens || !cnt || !oo_) { PyErr_NoMemory(); goto out; }
    if (rp_parse_table(pl.buf, (size_t)pl.len, nch, offs, lens)) { raise_rc(RP_ECORRUPT, "corrupt chunk table"); goto out; }
    int64_t total = po.len / 8;
    for (Py_ssize_t i = 0; i < m; i++) {
        cnt[i] = PyLong_AsLongLong(PyList_GET_ITEM(cntl, i));
        oo_[i] = PyLong_AsLongLong(PyList_GET_ITEM(offl, i));
        if (PyErr_Occurred()) goto out;
        if (cnt[i] < 0 || oo_[i] < 0 || oo_[i] + cnt[i] > total) {
            PyErr_SetString(PyExc_ValueError, "outputs too small");
            goto out;
        }
    }
    if (oo.len != total * ow || no.len != total * ow) {
        PyErr_SetString(PyExc_ValueError, "output arrays differ in length");
        goto out;
    }
    int rc = RP_OK;
    const char *err = NULL;
    uint64_t delta[2] = {0, 0}, sums[2] = {0, 0};
    Py_BEGIN_ALLOW_THREADS
    if (write) { /* decoded and written chunk by chunk while each is in cache; all or nothing */
        const uint8_t **bodies = malloc(m * sizeof *bodies);
        size_t *bl = malloc(m * sizeof *bl);
        int64_t *st = malloc(m * sizeof *st), *nn = malloc(m * sizeof *nn);
        if (!bodies || !bl || !st || !nn) {
            rc = RP_ENOMEM; err = "out of memory";
        } else {
            for (Py_ssize_t j = 0; j < m; j++) {
                int64_t ci = c0 + j;
                bodies[j] = (const uint8_t *)pl.buf + offs[ci];
                bl[j] = lens[ci];
                st[j] = ci * RP_CHUNK;
                nn[j] = n - st[j] < RP_CHUNK ? n - st[j] : RP_CHUNK;
            }
            rc = rp_decode_apply_chunks(&k, base.buf, (size_t)base.len, (int)m, bodies, bl, st,
                                        nn, cnt, oo_, po.buf, oo.buf, no.buf, ow, delta,
                                        hash ? sums : NULL, &err);
        }
        free(bodies); free(bl); free(st); free(nn);
    }
    for (Py_ssize_t g = 0; !write && g < m && rc == RP_OK; g += 4) {
        int q = (int)(m - g < 4 ? m - g : 4);
        const uint8_t *bodies[4];
        size_t bl[4];
        int64_t st[4], nn[4], cc[4], of[4];
        for (int j = 0; j < q; j++) {
            int64_t ci = c0 + g + j;
            bodies[j] = (const uint8_t *)pl.buf + offs[ci];
            bl[j] = lens[ci];
            st[j] = ci * RP_CHUNK;
            nn[j] = n - st[j] < RP_CHUNK ? n - st[j] : RP_CHUNK;
            cc[j] = cnt[g + j];
            of[j] = oo_[g + j];
        }
        rc = rp_decode_chunks(&k, base.buf, q, bodies, bl, st, nn, cc, of, po.buf, oo.buf,
                              no.buf, ow, &err);
    }
    Py_END_ALLOW_THREADS
    if (rc) { raise_rc(rc, err); goto out; }
    if (write && hash) {
        res = Py_BuildValue("(KKKK)", (unsigned long long)delta[0], (unsigned long long)delta[1],
                            (unsigned long long)sums[0], (unsigned long long)sums[1]);
    } else if (write) {
        res = Py_BuildValue("(KK)", (unsigned long long)delta[0], (unsigned long long)delta[1]);
    } else {
        res = Py_None;
        Py_INCREF(res);
    }
out:
    free(offs); free(lens); free(cnt); free(oo_);
    PyBuffer_Release(&base); PyBuffer_Release(&pl); PyBuffer_Release(&po);
    PyBuffer_Release(&oo); PyBuffer_Release(&no);
    return res;
}

/* join_release(list) -> bytes: the list's buffers concatenated into one new bytes object;
 * each item is replaced by None once copied, so a large item's memory goes back while the
 * result fills (the result and the parts are never all resident at once); a mapped Buf only
 * the list holds (the encoder's arena) gives its pages back as it is copied (buf_drain). */
PyObject *py_join_release(PyObject *self, PyObject *args) {
    PyObject *lst;
    int as_buf = 0; /* join_release(list, True) -> Buf (a native buffer) instead of bytes */
    if (!PyArg_ParseTuple(args, "O!|p", &PyList_Type, &lst, &as_buf)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(lst), total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer b;
        if (PyObject_GetBuffer(PyList_GET_ITEM(lst, i), &b, PyBUF_SIMPLE)) return NULL;
        if (b.len > PY_SSIZE_T_MAX - total) {
            PyBuffer_Release(&b);
            PyErr_SetString(PyExc_OverflowError, "joined size overflows");
            return NULL;
        }
        total += b.len;
        PyBuffer_Release(&b);
    }
    PyObject *out;
    char *dst;
    if (as_buf) {
        BufObject *bo = buf_new();
        if (!bo) return NULL;
        if (rp_obuf_reserve(&bo->o, (size_t)total + 1)) { Py_DECREF(bo); return PyErr_NoMemory(); }
        bo->o.len = (size_t)total;
        out = (PyObject *)bo;
        dst = (char *)bo->o.b;
    } else {
        out = PyBytes_FromStringAndSize(NULL, total);
        if (!out) return NULL;
        dst = PyBytes_AS_STRING(out);
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *it = PyList_GET_ITEM(lst, i);
        Py_ssize_t len;
        if (Py_TYPE(it) == &BufType) {
            len = (Py_ssize_t)((BufObject *)it)->o.len;
        } else {
            Py_buffer b;
            if (PyObject_GetBuffer(it, &b, PyBUF_SIMPLE)) { Py_DECREF(out); return NULL; }
            len = b.len;
            PyBuffer_Release(&b);
        }
        if (len > total - at) { /* an item grew in between: refuse */
            Py_DECREF(out);
            PyErr_SetString(PyExc_ValueError, "an item changed size while joining");
            return NULL;
        }
        /* a native payload only the list holds gives its pages back as it is copied */
        if (buf_drain(it, dst + at, (size_t)len) < 0) { Py_DECREF(out); return NULL; }
        at += len;
        Py_INCREF(Py_None);
        if (PyList_SetItem(lst, i, Py_None)) { Py_DECREF(out); return NULL; }
    }
    if (at != total) {
        Py_DECREF(out);
        PyErr_SetString(PyExc_ValueError, "an item changed size while joining");
        return NULL;
    }
    if (as_buf) rp_obuf_fit(&((BufObject *)out)->o);
    return out;
}

/* One tensor of decode_apply_view: its kind and buffers, held for the call. */
typedef struct {
    rp_kind k;
    Py_buffer base, pl, po, oo, no;
} view_arg;

static void view_arg_free(view_arg *a) {
    PyBuffer_Release(&a->base); PyBuffer_Release(&a->pl); PyBuffer_Release(&a->po);
    PyBuffer_Release(&a->oo); PyBuffer_Release(&a->no);
}

/* (kind, base (writable), payload, changed, step, pos_out, old_out, new_out) -> t; the
 * outputs hold exactly `changed` positions (int64) and old and new elements each. */
static int view_arg_parse(PyObject *item, view_arg *a, rp_dec_tensor *t) {
    PyObject *kt;
    long long changed, step;
    if (!PyArg_ParseTuple(item, "Ow*y*LLw*w*w*", &kt, &a->base, &a->pl, &changed, &step, &a->po,
                          &a->oo, &a->no))
        return -1;
    if (kind_arg(kt, &a->k) || elem_count(&a->k, a->base.len, &t->n)) return -1;
    Py_ssize_t ow = a->k.bits == 4 ? 1 : a->k.bits / 8;
    if (changed < 0 || changed > t->n || step < 1 || a->po.len != changed * 8
        || a->oo.len != changed * ow || a->no.len != changed * ow) {
        PyErr_SetString(PyExc_ValueError, "outputs: `changed` positions and elements each");
        return -1;
    }
    t->k = &a->k;
    t->data = a->base.buf;
    t->nbytes = (size_t)a->base.len;
    t->payload = a->pl.buf;
    t->plen = (size_t)a->pl.len;
    t->changed = changed;
    t->step = step;
    t->pos_out = a->po.buf;
    t->old_out = a->oo.buf;
    t->new_out = a->no.buf;
    return 0;
}

/* decode_apply_view(tensors, threads, hash, failed) -> [(a, b, s0, s1)] per tensor: every
 * tensor's rp.ctxgolomb.v2 payload decoded and written into its base in one call
 * (rp_decode_apply_view: each table and count checked, then jobs of `step` chunks, largest
 * first, on the core's own threads; see view_arg_parse), its rp.sum128 change (a, b) and, with
 * hash, the state of its words as read (s0, s1). All or nothing: on an error nothing stays
 * written, failed[0] is the failing tensor (the first in the list's order; else -1) and its
 * error is raised. */
PyObject *py_decode_apply_view(PyObject *self, PyObject *args) {
    PyObject *tl, *res = NULL;
    int nthreads, hash;
    Py_buffer fb = {0};
    if (!PyArg_ParseTuple(args, "O!ipw*", &PyList_Type, &tl, &nthreads, &hash, &fb)) return NULL;
    Py_ssize_t nt = PyList_GET_SIZE(tl);
    view_arg *va = calloc(nt + 1, sizeof *va); /* zeroed: releasing an unfilled one is a no-op */
    rp_dec_tensor *ts = calloc(nt + 1, sizeof *ts);
    if (fb.len < 8) { PyErr_SetString(PyExc_ValueError, "failed: room for one int64"); goto out; }
    ((int64_t *)fb.buf)[0] = -1;
    if (!va || !ts) { PyErr_NoMemory(); goto out; }
    for (Py_ssize_t i = 0; i < nt; i++)
        if (view_arg_parse(PyList_GET_ITEM(tl, i), &va[i], &ts[i])) goto out;
    int64_t failed = -1;
    const char *err = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_decode_apply_view(ts, nt, nthreads, hash, &failed, &err);
    Py_END_ALLOW_THREADS
    if (rc) {
        ((int64_t *)fb.buf)[0] = failed;
        raise_rc(rc, err);
        goto out;
    }
    res = PyList_New(nt);
    for (Py_ssize_t i = 0; res && i < nt; i++) {
        rp_dec_tensor *t = &ts[i];
        PyObject *r = Py_BuildValue("(KKKK)", (unsigned long long)t->delta[0],
                                    (unsigned long long)t->delta[1],
                                    (unsigned long long)t->sums[0], (unsigned long long)t->sums[1]);
        if (!r) { Py_CLEAR(res); break; }
        PyList_SET_ITEM(res, i, r);
    }
out:
    for (Py_ssize_t i = 0; va && i < nt; i++) view_arg_free(&va[i]);
    free(va); free(ts);
    PyBuffer_Release(&fb);
    return res;
}
