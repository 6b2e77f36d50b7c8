/* CPython binding: the decoder's entry points (table, decode_range, join_release,
 * decode_apply_jobs). */
#include "module.h"

/* Parse the chunk table of a delta payload: varint length + body per chunk. */
static int parse_table(const uint8_t *p, size_t len, int64_t nchunks, size_t *offs, size_t *lens) {
    size_t q = 0;
    for (int64_t i = 0; i < nchunks; i++) {
        uint64_t v = 0;
        int ok = 0;
        for (int s = 0; s < 9; s++) {
            if (q >= len) return -1;
            uint8_t c = p[q++];
            v |= (uint64_t)(c & 0x7F) << (7 * s);
            if (!(c & 0x80)) { ok = 1; break; }
        }
        if (!ok || v > len - q) return -1;
        offs[i] = q;
        lens[i] = (size_t)v;
        q += v;
    }
    return q == len ? 0 : -1;
}

/* table(kind, payload, n_elements) -> list of changed counts per chunk (validated params) */
PyObject *py_table(PyObject *self, PyObject *args) {
    PyObject *kt, *res = NULL;
    Py_buffer pl = {0};
    long long n;
    rp_kind k;
    if (!PyArg_ParseTuple(args, "Oy*L", &kt, &pl, &n)) return NULL;
    size_t *offs = NULL, *lens = NULL;
    if (kind_arg(kt, &k)) goto out;
    if (n <= 0 || n >= (1LL << 48)) { PyErr_SetString(PyExc_ValueError, "bad element count"); goto out; }
    int64_t nch = (n + RP_CHUNK - 1) / RP_CHUNK;
    if (nch > (int64_t)pl.len) { raise_rc(RP_ECORRUPT, "payload shorter than its chunk table"); goto out; }
    offs = malloc(nch * sizeof *offs);
    lens = malloc(nch * sizeof *lens);
    if (!offs || !lens) { PyErr_NoMemory(); goto out; }
    if (parse_table(pl.buf, (size_t)pl.len, nch, offs, lens)) {
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
    if (parse_table(pl.buf, (size_t)pl.len, nch, offs, lens)) { raise_rc(RP_ECORRUPT, "corrupt chunk table"); goto out; }
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
 * result fills (the result and the parts are never all resident at once). */
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
        Py_buffer b;
        if (PyObject_GetBuffer(PyList_GET_ITEM(lst, i), &b, PyBUF_SIMPLE)) { Py_DECREF(out); return NULL; }
        if (b.len > total - at) { /* an item grew in between: refuse */
            PyBuffer_Release(&b);
            Py_DECREF(out);
            PyErr_SetString(PyExc_ValueError, "an item changed size while joining");
            return NULL;
        }
        memcpy(dst + at, b.buf, (size_t)b.len);
        at += b.len;
        PyBuffer_Release(&b);
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

/* One tensor of decode_apply_jobs: its buffers, chunk table and output offsets. */
typedef struct {
    rp_kind k;
    Py_buffer base, pl, po, oo, no;
    int64_t n, nch, total;
    int ow;
    size_t *offs, *lens; /* chunk table: body offset and length per chunk */
    int64_t *cnt, *oof;  /* outputs per chunk, and where they start */
    uint8_t *taken;      /* chunks already in a job */
} dec_tensor;

static void dec_tensor_free(dec_tensor *t) {
    PyBuffer_Release(&t->base); PyBuffer_Release(&t->pl); PyBuffer_Release(&t->po);
    PyBuffer_Release(&t->oo); PyBuffer_Release(&t->no);
    free(t->offs); free(t->lens); free(t->cnt); free(t->oof); free(t->taken);
}

/* (kind, base (writable), payload, counts, offsets, pos_out, old_out, new_out): the checks
 * decode_range makes, for every chunk of the tensor (counts and offsets: one per chunk). */
static int dec_tensor_parse(PyObject *item, dec_tensor *t) {
    PyObject *kt, *cntl, *offl;
    if (!PyArg_ParseTuple(item, "Ow*y*OOw*w*w*", &kt, &t->base, &t->pl, &cntl, &offl, &t->po,
                          &t->oo, &t->no))
        return -1;
    if (kind_arg(kt, &t->k) || elem_count(&t->k, t->base.len, &t->n)) return -1;
    t->nch = (t->n + RP_CHUNK - 1) / RP_CHUNK;
    t->ow = t->k.bits == 4 ? 1 : t->k.bits / 8;
    if (!PyList_Check(offl) || !PyList_Check(cntl) || PyList_GET_SIZE(offl) < t->nch
        || PyList_GET_SIZE(cntl) < t->nch) {
        PyErr_SetString(PyExc_ValueError, "bad chunk range");
        return -1;
    }
    size_t m = (size_t)t->nch + 1;
    t->offs = malloc(m * sizeof *t->offs);
    t->lens = malloc(m * sizeof *t->lens);
    t->cnt = malloc(m * sizeof *t->cnt);
    t->oof = malloc(m * sizeof *t->oof);
    t->taken = calloc(m, 1);
    if (!t->offs || !t->lens || !t->cnt || !t->oof || !t->taken) { PyErr_NoMemory(); return -1; }
    if (parse_table(t->pl.buf, (size_t)t->pl.len, t->nch, t->offs, t->lens)) {
        raise_rc(RP_ECORRUPT, "corrupt chunk table");
        return -1;
    }
    t->total = t->po.len / 8;
    for (int64_t i = 0; i < t->nch; i++) {
        t->cnt[i] = PyLong_AsLongLong(PyList_GET_ITEM(cntl, i));
        t->oof[i] = PyLong_AsLongLong(PyList_GET_ITEM(offl, i));
        if (PyErr_Occurred()) return -1;
        if (t->cnt[i] < 0 || t->oof[i] < 0 || t->oof[i] > t->total - t->cnt[i]) {
            PyErr_SetString(PyExc_ValueError, "outputs too small");
            return -1;
        }
    }
    if (t->oo.len != t->total * t->ow || t->no.len != t->total * t->ow) {
        PyErr_SetString(PyExc_ValueError, "output arrays differ in length");
        return -1;
    }
    return 0;
}

/* decode_apply_jobs(tensors, jobs, threads, hash, failed) -> [(a, b, s0, s1)] per job: every
 * job (tensor index, c0, c1) is decode_range(..., c0, c1, ..., write=True, hash) of that
 * tensor (see dec_tensor_parse), on the core's own threads, in the order given (largest
 * first); no two jobs may share a chunk. All or nothing: on an error nothing stays written,
 * failed[0] is the failing job first in (tensor, chunk) order (else -1), and its error is
 * raised. */
PyObject *py_decode_apply_jobs(PyObject *self, PyObject *args) {
    PyObject *tl, *jl, *res = NULL;
    int nthreads, hash;
    Py_buffer fb = {0};
    if (!PyArg_ParseTuple(args, "O!O!ipw*", &PyList_Type, &tl, &PyList_Type, &jl, &nthreads,
                          &hash, &fb))
        return NULL;
    Py_ssize_t nt = PyList_GET_SIZE(tl), nj = PyList_GET_SIZE(jl), chunks = 0;
    dec_tensor *ts = calloc(nt + 1, sizeof *ts); /* zeroed: releasing an unfilled one is a no-op */
    rp_dec_job *jobs = calloc(nj + 1, sizeof *jobs);
    int64_t *jt = calloc(nj + 1, sizeof *jt), *jc = calloc(nj + 1, sizeof *jc);
    const uint8_t **body = NULL;
    size_t *len = NULL;
    int64_t *st = NULL, *nn = NULL;
    if (fb.len < 8) { PyErr_SetString(PyExc_ValueError, "failed: room for one int64"); goto out; }
    ((int64_t *)fb.buf)[0] = -1;
    if (!ts || !jobs || !jt || !jc) { PyErr_NoMemory(); goto out; }
    for (Py_ssize_t i = 0; i < nt; i++)
        if (dec_tensor_parse(PyList_GET_ITEM(tl, i), &ts[i])) goto out;
    for (Py_ssize_t j = 0; j < nj; j++) {
        Py_ssize_t ti, c0, c1;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(jl, j), "nnn", &ti, &c0, &c1)) goto out;
        if (ti < 0 || ti >= nt || c0 < 0 || c1 <= c0 || c1 > ts[ti].nch) {
            PyErr_SetString(PyExc_ValueError, "bad chunk range");
            goto out;
        }
        for (Py_ssize_t c = c0; c < c1; c++) {
            if (ts[ti].taken[c]) {
                PyErr_SetString(PyExc_ValueError, "two jobs share a chunk");
                goto out;
            }
            ts[ti].taken[c] = 1;
        }
        chunks += c1 - c0;
        jobs[j].m = (int)(c1 - c0);
        jt[j] = ti;
        jc[j] = c0;
    }
    body = malloc((chunks + 1) * sizeof *body);
    len = malloc((chunks + 1) * sizeof *len);
    st = malloc((chunks + 1) * sizeof *st);
    nn = malloc((chunks + 1) * sizeof *nn);
    if (!body || !len || !st || !nn) { PyErr_NoMemory(); goto out; }
    for (Py_ssize_t j = 0, at = 0; j < nj; j++) {
        rp_dec_job *b = &jobs[j];
        int64_t c0 = jc[j];
        dec_tensor *t = &ts[jt[j]];
        for (int q = 0; q < b->m; q++) {
            int64_t ci = c0 + q;
            body[at + q] = (const uint8_t *)t->pl.buf + t->offs[ci];
            len[at + q] = t->lens[ci];
            st[at + q] = ci * RP_CHUNK;
            nn[at + q] = t->n - st[at + q] < RP_CHUNK ? t->n - st[at + q] : RP_CHUNK;
        }
        b->k = &t->k;
        b->data = t->base.buf;
        b->nbytes = (size_t)t->base.len;
        b->body = body + at;
        b->len = len + at;
        b->start = st + at;
        b->n = nn + at;
        b->count = t->cnt + c0;
        b->off = t->oof + c0;
        b->pos_out = t->po.buf;
        b->old_out = t->oo.buf;
        b->new_out = t->no.buf;
        b->ow = t->ow;
        b->hash = hash;
        at += b->m;
    }
    int64_t failed = -1;
    const char *err = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_decode_apply_jobs(jobs, nj, nthreads, &failed, &err);
    Py_END_ALLOW_THREADS
    if (rc) { /* the first failure in (tensor, chunk) order, whatever order the jobs ran in */
        for (Py_ssize_t j = 0; j < nj; j++)
            if (jobs[j].rc && (jt[j] < jt[failed] || (jt[j] == jt[failed] && jc[j] < jc[failed])))
                failed = j;
        ((int64_t *)fb.buf)[0] = failed;
        raise_rc(jobs[failed].rc, jobs[failed].err);
        goto out;
    }
    res = PyList_New(nj);
    for (Py_ssize_t j = 0; res && j < nj; j++) {
        rp_dec_job *b = &jobs[j];
        PyObject *t = Py_BuildValue("(KKKK)", (unsigned long long)b->delta[0],
                                    (unsigned long long)b->delta[1],
                                    (unsigned long long)b->sums[0], (unsigned long long)b->sums[1]);
        if (!t) { Py_CLEAR(res); break; }
        PyList_SET_ITEM(res, j, t);
    }
out:
    for (Py_ssize_t i = 0; ts && i < nt; i++) dec_tensor_free(&ts[i]);
    free(ts); free(jobs); free(jt); free(jc); free(body); free(len); free(st); free(nn);
    PyBuffer_Release(&fb);
    return res;
}
