/* CPython binding: the encoder's entry points (encode_range*, encode_sparse, encode_records,
 * encode_jobs) and its reusable Workspace type. */
#include "module.h"

/* encode_range(kind, old, new, first_chunk, last_chunk)
 *     -> ([(body, changed), ...], sum128 change a, b) */
/* encode_range(kind, a, b, c0, c1) -> ([(body, k)], sd0, sd1): chunks [c0, c1) of a tensor.
 * encode_range_keep: the same, plus each chunk's changes, [(body, k, pos, old, new)]: pos as
 * int64 absolute positions, old and new as uint64 elements, in bytes objects of k entries. */
static PyObject *encode_range_impl(PyObject *args, int keep) {
    PyObject *kt;
    Py_buffer a = {0}, b = {0};
    Py_ssize_t c0, c1;
    rp_kind k;
    int64_t n;
    if (!PyArg_ParseTuple(args, "Oy*y*nn", &kt, &a, &b, &c0, &c1)) return NULL;
    PyObject *res = NULL;
    uint8_t **bodies = NULL;
    size_t *lens = NULL;
    int64_t *counts = NULL;
    uint32_t **pos = NULL;
    uint64_t **ov = NULL, **nv = NULL;
    Py_ssize_t m = c1 - c0;
    if (kind_arg(kt, &k) || elem_count(&k, a.len, &n)) goto out;
    if (a.len != b.len || c0 < 0 || m < 0 || c1 > (n + RP_CHUNK - 1) / RP_CHUNK) {
        PyErr_SetString(PyExc_ValueError, "buffers differ in size or chunk range is out of bounds");
        goto out;
    }
    bodies = calloc(m + 1, sizeof *bodies);
    lens = calloc(m + 1, sizeof *lens);
    counts = calloc(m + 1, sizeof *counts);
    pos = calloc(m + 1, sizeof *pos);
    ov = calloc(m + 1, sizeof *ov);
    nv = calloc(m + 1, sizeof *nv);
    if (!bodies || !lens || !counts || !pos || !ov || !nv) { PyErr_NoMemory(); goto out; }
    int rc = RP_OK;
    const char *err = NULL;
    uint64_t sd[2] = {0, 0};
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < m && rc == RP_OK; i++) {
        int64_t s = (c0 + i) * RP_CHUNK, len = n - s < RP_CHUNK ? n - s : RP_CHUNK;
        rc = rp_encode_chunk_keep(&k, a.buf, b.buf, (size_t)a.len, s, len, &bodies[i],
                                  &lens[i], &counts[i], sd, keep ? &pos[i] : NULL,
                                  keep ? &ov[i] : NULL, keep ? &nv[i] : NULL, &err);
    }
    Py_END_ALLOW_THREADS
    if (rc) { raise_rc(rc, err); goto out; }
    PyObject *lst = PyList_New(m);
    for (Py_ssize_t i = 0; lst && i < m; i++) {
        const char *body = bodies[i] ? (const char *)bodies[i] : "";
        int64_t kk = counts[i];
        PyObject *t = NULL;
        if (!keep) {
            t = Py_BuildValue("(y#L)", body, (Py_ssize_t)lens[i], (long long)kk);
        } else {
            PyObject *pb = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)(kk * 8));
            if (pb) {
                int64_t *p = (int64_t *)PyBytes_AS_STRING(pb), s = (c0 + i) * RP_CHUNK;
                for (int64_t j = 0; j < kk; j++) p[j] = s + (int64_t)pos[i][j];
                t = Py_BuildValue("(y#LNy#y#)", body, (Py_ssize_t)lens[i], (long long)kk, pb,
                                  ov[i] ? (const char *)ov[i] : "", (Py_ssize_t)(kk * 8),
                                  nv[i] ? (const char *)nv[i] : "", (Py_ssize_t)(kk * 8));
            }
        }
        if (!t) { Py_CLEAR(lst); break; }
        PyList_SET_ITEM(lst, i, t);
    }
    if (lst) {
        res = Py_BuildValue("(NKK)", lst, (unsigned long long)sd[0], (unsigned long long)sd[1]);
    }
out:
    for (Py_ssize_t i = 0; i < m; i++) {
        if (bodies) free(bodies[i]);
        if (pos) free(pos[i]);
        if (ov) free(ov[i]);
        if (nv) free(nv[i]);
    }
    free(bodies); free(lens); free(counts); free(pos); free(ov); free(nv);
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return res;
}

/* Workspace: the encoder's work buffers, kept from one encode_range_buf call to the next (a
 * caller hands each to one call at a time); freed with the object. */
typedef struct {
    PyObject_HEAD
    rp_encws *w;
    int busy;
} WsObject;

static void ws_dealloc(PyObject *self) {
    rp_ws_delete(((WsObject *)self)->w);
    Py_TYPE(self)->tp_free(self);
}

static PyObject *ws_tp_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    WsObject *o = (WsObject *)type->tp_alloc(type, 0);
    if (!o) return NULL;
    o->w = rp_ws_new();
    if (!o->w) { Py_DECREF(o); return PyErr_NoMemory(); }
    return (PyObject *)o;
}

PyTypeObject WsType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rollpatch.native._rpcore.Workspace",
    .tp_basicsize = sizeof(WsObject),
    .tp_dealloc = ws_dealloc,
    .tp_new = ws_tp_new,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "The encoder's work buffers, reused across encode_range_buf calls.",
};

/* encode_range_buf(kind, a, b, c0, c1[, workspace]) -> (Buf, changed, sd0, sd1): chunks
 * [c0, c1) of a tensor as payload bytes (varint length + body per chunk), in one buffer. */
PyObject *py_encode_range_buf(PyObject *self, PyObject *args) {
    PyObject *kt, *res = NULL;
    Py_buffer a = {0}, b = {0};
    Py_ssize_t c0, c1;
    rp_kind k;
    int64_t n, changed = 0;
    WsObject *ws = NULL;
    if (!PyArg_ParseTuple(args, "Oy*y*nn|O!", &kt, &a, &b, &c0, &c1, &WsType, &ws)) return NULL;
    BufObject *out = NULL;
    if (ws && ws->busy) {
        PyErr_SetString(PyExc_RuntimeError, "the workspace is in use by another call");
        ws = NULL;
        goto out;
    }
    if (ws) ws->busy = 1;
    if (kind_arg(kt, &k) || elem_count(&k, a.len, &n)) goto out;
    if (a.len != b.len) {
        PyErr_SetString(PyExc_ValueError, "buffers differ in size");
        goto out;
    }
    out = buf_new();
    if (!out) goto out;
    int rc;
    const char *err = NULL;
    uint64_t sd[2] = {0, 0};
    Py_BEGIN_ALLOW_THREADS
    rc = rp_encode_range(&k, a.buf, b.buf, (size_t)a.len, n, c0, c1, &out->o, &changed, sd,
                         ws ? ws->w : NULL, &err);
    Py_END_ALLOW_THREADS
    if (rc) { raise_rc(rc, err); goto out; }
    res = Py_BuildValue("(OLKK)", (PyObject *)out, (long long)changed, (unsigned long long)sd[0],
                        (unsigned long long)sd[1]);
out:
    if (ws) ws->busy = 0;
    Py_XDECREF(out);
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return res;
}

PyObject *py_encode_range(PyObject *self, PyObject *args) {
    return encode_range_impl(args, 0);
}

PyObject *py_encode_range_keep(PyObject *self, PyObject *args) {
    return encode_range_impl(args, 1);
}

/* encode_sparse(kind, base, start, n, pos:int64, old:uint64, new:uint64) -> body */
PyObject *py_encode_sparse(PyObject *self, PyObject *args) {
    PyObject *kt, *res = NULL;
    Py_buffer base = {0}, pos = {0}, ov = {0}, nv = {0};
    long long start, n;
    rp_kind k;
    int64_t total;
    if (!PyArg_ParseTuple(args, "Oy*LLy*y*y*", &kt, &base, &start, &n, &pos, &ov, &nv)) return NULL;
    if (kind_arg(kt, &k) || elem_count(&k, base.len, &total)) goto out;
    Py_ssize_t cnt = pos.len / 8;
    if (pos.len % 8 || ov.len != pos.len || nv.len != pos.len || start < 0 || n < 0
        || start + n > total) {
        PyErr_SetString(PyExc_ValueError, "bad sparse arrays or range");
        goto out;
    }
    uint8_t *body = NULL;
    size_t blen = 0;
    const char *err = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_encode_chunk_sparse(&k, base.buf, start, n, pos.buf, ov.buf, nv.buf, cnt, &body,
                                &blen, &err);
    Py_END_ALLOW_THREADS
    if (rc) { raise_rc(rc, err); goto out; }
    res = PyBytes_FromStringAndSize(body ? (const char *)body : "", (Py_ssize_t)blen);
    free(body);
out:
    PyBuffer_Release(&base); PyBuffer_Release(&pos); PyBuffer_Release(&ov); PyBuffer_Release(&nv);
    return res;
}

/* encode_records(kind, n, ncnt:uint64[256], pos:int64, ctx:uint8, rank:uint32, old:uint64,
 * new:uint64) -> body */
PyObject *py_encode_records(PyObject *self, PyObject *args) {
    PyObject *kt, *res = NULL;
    Py_buffer nc = {0}, pos = {0}, cx = {0}, rk = {0}, ov = {0}, nv = {0};
    long long n;
    rp_kind k;
    if (!PyArg_ParseTuple(args, "OLy*y*y*y*y*y*", &kt, &n, &nc, &pos, &cx, &rk, &ov, &nv))
        return NULL;
    if (kind_arg(kt, &k)) goto out;
    Py_ssize_t cnt = pos.len / 8;
    if (nc.len != 256 * 8 || pos.len % 8 || cx.len != cnt || rk.len != cnt * 4
        || ov.len != cnt * 8 || nv.len != cnt * 8) {
        PyErr_SetString(PyExc_ValueError, "record arrays differ in length or dtype");
        goto out;
    }
    uint8_t *body = NULL;
    size_t blen = 0;
    const char *err = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_encode_records(&k, n, nc.buf, pos.buf, cx.buf, rk.buf, ov.buf, nv.buf, cnt, &body,
                           &blen, &err);
    Py_END_ALLOW_THREADS
    if (rc) { raise_rc(rc, err); goto out; }
    res = PyBytes_FromStringAndSize(body ? (const char *)body : "", (Py_ssize_t)blen);
    free(body);
out:
    PyBuffer_Release(&nc); PyBuffer_Release(&pos); PyBuffer_Release(&cx);
    PyBuffer_Release(&rk); PyBuffer_Release(&ov); PyBuffer_Release(&nv);
    return res;
}

/* The (kind, a, b) pairs of encode_jobs/encode_view: each pair's buffers held in bufs[2i],
 * bufs[2i + 1] (released by the caller, whatever this returns), its kind and element count. */
static int parse_pairs(PyObject *pl, Py_buffer *bufs, rp_kind *kinds, int64_t *nel) {
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(pl); i++) { /* a failed parse holds no buffer */
        PyObject *kt;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(pl, i), "Oy*y*", &kt, &bufs[2 * i], &bufs[2 * i + 1])
            || kind_arg(kt, &kinds[i]) || elem_count(&kinds[i], bufs[2 * i].len, &nel[i]))
            return -1;
        if (bufs[2 * i].len != bufs[2 * i + 1].len) {
            PyErr_SetString(PyExc_ValueError, "buffers differ in size");
            return -1;
        }
    }
    return 0;
}

static void set_job(rp_enc_job *b, const rp_kind *k, const Py_buffer *ab, int64_t n,
                    Py_ssize_t c0, Py_ssize_t c1, BufObject *out) {
    b->k = k;
    b->old = ab[0].buf;
    b->new_ = ab[1].buf;
    b->nbytes = (size_t)ab[0].len;
    b->n = n;
    b->c0 = c0;
    b->c1 = c1;
    b->out = &out->o;
}

/* encode_jobs(pairs, jobs, threads) -> [(Buf, changed, sd0, sd1)] per job: pairs are (kind,
 * a, b) tensors, jobs (pair index, c0, c1) ranges of chunks; every job on the core's own
 * threads (rp_pool.c) with the GIL released once. Each job's result is what
 * encode_range_buf(kind, a, b, c0, c1) returns. */
PyObject *py_encode_jobs(PyObject *self, PyObject *args) {
    PyObject *pl, *jl, *res = NULL;
    int nthreads;
    if (!PyArg_ParseTuple(args, "O!O!i", &PyList_Type, &pl, &PyList_Type, &jl, &nthreads))
        return NULL;
    Py_ssize_t np_ = PyList_GET_SIZE(pl), nj = PyList_GET_SIZE(jl);
    Py_buffer *bufs = calloc(2 * np_ + 1, sizeof *bufs);
    rp_kind *kinds = calloc(np_ + 1, sizeof *kinds);
    int64_t *nel = calloc(np_ + 1, sizeof *nel);
    rp_enc_job *jobs = calloc(nj + 1, sizeof *jobs);
    BufObject **outs = calloc(nj + 1, sizeof *outs);
    if (!bufs || !kinds || !nel || !jobs || !outs) { PyErr_NoMemory(); goto out; }
    if (parse_pairs(pl, bufs, kinds, nel)) goto out;
    for (Py_ssize_t j = 0; j < nj; j++) {
        Py_ssize_t p, c0, c1;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(jl, j), "nnn", &p, &c0, &c1)) goto out;
        if (p < 0 || p >= np_) { PyErr_SetString(PyExc_ValueError, "job names no pair"); goto out; }
        if (!(outs[j] = buf_new())) goto out;
        set_job(&jobs[j], &kinds[p], &bufs[2 * p], nel[p], c0, c1, outs[j]);
    }
    int64_t failed = -1;
    const char *err = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_encode_jobs(jobs, nj, nthreads, &failed, &err);
    Py_END_ALLOW_THREADS
    if (rc) { raise_rc(rc, err); goto out; }
    res = PyList_New(nj);
    for (Py_ssize_t j = 0; res && j < nj; j++) {
        PyObject *t = Py_BuildValue("(OLKK)", (PyObject *)outs[j], (long long)jobs[j].changed,
                                    (unsigned long long)jobs[j].sd[0],
                                    (unsigned long long)jobs[j].sd[1]);
        if (!t) { Py_CLEAR(res); break; }
        PyList_SET_ITEM(res, j, t);
    }
out:
    for (Py_ssize_t i = 0; bufs && i < 2 * np_; i++) PyBuffer_Release(&bufs[i]);
    for (Py_ssize_t j = 0; outs && j < nj; j++) Py_XDECREF(outs[j]);
    free(bufs); free(kinds); free(nel); free(jobs); free(outs);
    return res;
}

/* A job of encode_view: its size in elements, pair and first chunk (the order: largest
 * first, then pair and first chunk descending, as codec_v2's sort of (elements, pair, c0)). */
typedef struct {
    int64_t el, p, c0, c1, idx; /* idx: the job's place in pair and chunk order */
} view_job;

static int view_job_cmp(const void *x, const void *y) {
    const view_job *a = x, *b = y;
    if (a->el != b->el) return a->el < b->el ? 1 : -1;
    if (a->p != b->p) return a->p < b->p ? 1 : -1;
    return a->c0 < b->c0 ? 1 : (a->c0 > b->c0 ? -1 : 0);
}

/* Chunks per job of one tensor: codec_v2.job_step (the whole tensor on one thread; on
 * several, ranges of at least 2 chunks, about `per` per thread for the largest tensors). */
static int64_t job_step(int64_t nch, int threads, int per) {
    if (threads <= 1 || nch <= 2) return nch > 1 ? nch : 1;
    int64_t d = (int64_t)per * threads, s = (nch + d - 1) / d;
    return s > 2 ? s : 2;
}

/* encode_view(pairs, threads, per_thread) -> [(Buf, changed, sd0, sd1)] per pair: the jobs
 * codec_v2.encode_dense_many cut in Python (each tensor in ranges of job_step chunks, largest
 * job first) cut, run and each tensor's ranges joined in order into one payload here: the
 * same bytes and results, without ~5 us of Python per tensor and per job. */
PyObject *py_encode_view(PyObject *self, PyObject *args) {
    PyObject *pl, *res = NULL;
    int nthreads, per;
    if (!PyArg_ParseTuple(args, "O!ii", &PyList_Type, &pl, &nthreads, &per)) return NULL;
    if (nthreads < 1 || per < 1) {
        PyErr_SetString(PyExc_ValueError, "threads and jobs per thread must be positive");
        return NULL;
    }
    Py_ssize_t np_ = PyList_GET_SIZE(pl), nj = 0;
    Py_buffer *bufs = calloc(2 * np_ + 1, sizeof *bufs);
    rp_kind *kinds = calloc(np_ + 1, sizeof *kinds);
    int64_t *nel = calloc(np_ + 1, sizeof *nel);
    int64_t *first = calloc(np_ + 1, sizeof *first); /* each pair's first job, in job order */
    view_job *vj = NULL;
    Py_ssize_t *at = NULL; /* job order -> sorted place */
    rp_enc_job *jobs = NULL;
    BufObject **outs = NULL;
    if (!bufs || !kinds || !nel || !first) { PyErr_NoMemory(); goto out; }
    if (parse_pairs(pl, bufs, kinds, nel)) goto out;
    for (Py_ssize_t i = 0; i < np_; i++) { /* chunk counts are bounded by the buffers' sizes */
        int64_t nch = (nel[i] + RP_CHUNK - 1) / RP_CHUNK, st = job_step(nch, nthreads, per);
        nj += (nch + st - 1) / st;
    }
    vj = calloc(nj + 1, sizeof *vj);
    jobs = calloc(nj + 1, sizeof *jobs);
    outs = calloc(nj + 1, sizeof *outs);
    at = calloc(nj + 1, sizeof *at);
    if (!vj || !jobs || !outs || !at) { PyErr_NoMemory(); goto out; }
    Py_ssize_t j = 0;
    for (Py_ssize_t i = 0; i < np_; i++) {
        int64_t n = nel[i], nch = (n + RP_CHUNK - 1) / RP_CHUNK, st = job_step(nch, nthreads, per);
        first[i] = j;
        for (int64_t c0 = 0; c0 < nch; c0 += st, j++) {
            int64_t c1 = c0 + st < nch ? c0 + st : nch, e = c1 * RP_CHUNK < n ? c1 * RP_CHUNK : n;
            vj[j] = (view_job){e - c0 * RP_CHUNK, i, c0, c1, j};
        }
    }
    qsort(vj, (size_t)nj, sizeof *vj, view_job_cmp);
    for (Py_ssize_t q = 0; q < nj; q++) {
        if (!(outs[q] = buf_new())) goto out;
        set_job(&jobs[q], &kinds[vj[q].p], &bufs[2 * vj[q].p], nel[vj[q].p], vj[q].c0, vj[q].c1,
                outs[q]);
        at[vj[q].idx] = q;
    }
    int64_t failed = -1;
    const char *err = NULL;
    int rc, nomem = 0;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_encode_jobs(jobs, nj, nthreads, &failed, &err);
    /* each tensor's later ranges appended to its first one's buffer, in chunk order (job
     * order is pair by pair, chunks increasing), with its totals */
    for (Py_ssize_t o = 0; !rc && o < nj; o++) {
        const view_job *v = &vj[at[o]];
        if (v->c0 == 0) continue;
        rp_enc_job *f = &jobs[at[first[v->p]]], *x = &jobs[at[o]];
        rp_obuf *dst = f->out, *src = x->out;
        if (rp_obuf_reserve(dst, src->len + 1)) { nomem = 1; break; }
        if (src->len) memcpy(dst->b + dst->len, src->b, src->len);
        dst->len += src->len;
        rp_obuf_free(src);
        f->changed += x->changed;
        f->sd[0] += x->sd[0];
        f->sd[1] += x->sd[1];
    }
    Py_END_ALLOW_THREADS
    if (rc) { raise_rc(rc, err); goto out; }
    if (nomem) { PyErr_NoMemory(); goto out; }
    res = PyList_New(np_);
    for (Py_ssize_t i = 0; res && i < np_; i++) {
        PyObject *t;
        if (nel[i] == 0) { /* no chunk, no job */
            t = Py_BuildValue("(y#iii)", "", (Py_ssize_t)0, 0, 0, 0);
        } else {
            Py_ssize_t q = at[first[i]];
            rp_enc_job *f = &jobs[q];
            t = Py_BuildValue("(OLKK)", (PyObject *)outs[q], (long long)f->changed,
                              (unsigned long long)f->sd[0], (unsigned long long)f->sd[1]);
        }
        if (!t) { Py_CLEAR(res); break; }
        PyList_SET_ITEM(res, i, t);
    }
out:
    for (Py_ssize_t i = 0; bufs && i < 2 * np_; i++) PyBuffer_Release(&bufs[i]);
    for (Py_ssize_t q = 0; outs && q < nj; q++) Py_XDECREF(outs[q]);
    free(bufs); free(kinds); free(nel); free(first); free(at); free(vj); free(jobs); free(outs);
    return res;
}
