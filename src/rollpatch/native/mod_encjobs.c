/* CPython binding: the encoder's many-tensor entry points (encode_jobs, encode_view): the
 * (kind, a, b) pairs of a view cut into jobs of chunks and coded on the core's threads (split
 * from mod_encode.c, which keeps the one-tensor entry points and the Workspace type). */
#include "module.h"

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

/* The arguments shared by encode_view and encode_view_arena: (pairs, threads, per_thread)
 * parsed and checked, and the per-pair arrays (first: n + 2 entries). On failure (-1, an
 * exception set) and after use, pairs_close releases whatever was taken. */
typedef struct {
    Py_ssize_t n;
    int nthreads, per;
    Py_buffer *bufs;
    rp_kind *kinds;
    int64_t *nel, *first;
} pairs_t;

static int pairs_open(PyObject *args, pairs_t *p) {
    PyObject *pl;
    memset(p, 0, sizeof *p);
    if (!PyArg_ParseTuple(args, "O!ii", &PyList_Type, &pl, &p->nthreads, &p->per)) return -1;
    if (p->nthreads < 1 || p->per < 1) {
        PyErr_SetString(PyExc_ValueError, "threads and jobs per thread must be positive");
        return -1;
    }
    p->n = PyList_GET_SIZE(pl);
    p->bufs = calloc(2 * p->n + 1, sizeof *p->bufs);
    p->kinds = calloc(p->n + 1, sizeof *p->kinds);
    p->nel = calloc(p->n + 1, sizeof *p->nel);
    p->first = calloc(p->n + 2, sizeof *p->first);
    if (!p->bufs || !p->kinds || !p->nel || !p->first) {
        PyErr_NoMemory();
        return -1;
    }
    return parse_pairs(pl, p->bufs, p->kinds, p->nel) ? -1 : 0;
}

static void pairs_close(pairs_t *p) {
    for (Py_ssize_t i = 0; p->bufs && i < 2 * p->n; i++) PyBuffer_Release(&p->bufs[i]);
    free(p->bufs); free(p->kinds); free(p->nel); free(p->first);
}

/* encode_view(pairs, threads, per_thread) -> [(Buf, changed, sd0, sd1)] per pair: the jobs
 * codec_v2.encode_dense_many cut in Python (each tensor in ranges of job_step chunks, largest
 * job first) cut, run and each tensor's ranges joined in order into one payload here: the
 * same bytes and results, without ~5 us of Python per tensor and per job. */
PyObject *py_encode_view(PyObject *self, PyObject *args) {
    PyObject *res = NULL;
    pairs_t pa;
    Py_ssize_t nj = 0;
    view_job *vj = NULL;
    Py_ssize_t *at = NULL; /* job order -> sorted place */
    rp_enc_job *jobs = NULL;
    BufObject **outs = NULL;
    if (pairs_open(args, &pa)) goto out;
    const Py_ssize_t np_ = pa.n;
    const int nthreads = pa.nthreads, per = pa.per;
    Py_buffer *const bufs = pa.bufs;
    rp_kind *const kinds = pa.kinds;
    int64_t *const nel = pa.nel, *const first = pa.first; /* each pair's first job, in job order */
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
    for (Py_ssize_t q = 0; outs && q < nj; q++) Py_XDECREF(outs[q]);
    pairs_close(&pa);
    free(at); free(vj); free(jobs); free(outs);
    return res;
}

/* encode_view_arena(pairs, threads, per_thread) -> (Buf, [(offset, length, changed, sd0, sd1)]
 * per pair): encode_view's results, every pair's payload at its offset in one buffer, in pair
 * order (rp_encode_jobs_arena: the jobs run in that order, each tensor's ranges in chunk
 * order), so a caller whose pairs are in the container's order ships the buffer whole. A pair
 * with no change has an empty payload (it ships none), not its chunks' empty bodies. */
PyObject *py_encode_view_arena(PyObject *self, PyObject *args) {
    PyObject *res = NULL, *lst = NULL;
    pairs_t pa;
    Py_ssize_t nj = 0;
    rp_enc_job *jobs = NULL;
    size_t *at = NULL;
    unsigned char *edge = NULL;
    BufObject *arena = NULL;
    if (pairs_open(args, &pa)) goto out;
    if (!(arena = buf_new())) goto out;
    const Py_ssize_t np_ = pa.n;
    const int nthreads = pa.nthreads, per = pa.per;
    Py_buffer *const bufs = pa.bufs;
    rp_kind *const kinds = pa.kinds;
    int64_t *const nel = pa.nel, *const first = pa.first; /* pair i's jobs: [first[i], first[i+1]) */
    for (Py_ssize_t i = 0; i < np_; i++) { /* chunk counts are bounded by the buffers' sizes */
        int64_t nch = (nel[i] + RP_CHUNK - 1) / RP_CHUNK, st = job_step(nch, nthreads, per);
        first[i] = nj;
        nj += (nch + st - 1) / st;
    }
    first[np_] = nj;
    jobs = calloc(nj + 1, sizeof *jobs);
    at = calloc(nj + 1, sizeof *at);
    edge = calloc(nj + 1, 1);
    /* mapped from the start (rp_obuf: 64 KiB and up), so its pages can be given back in
     * pieces as it is copied out (join_release) */
    if (!jobs || !at || !edge || rp_obuf_reserve(&arena->o, (size_t)64 << 10)) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < np_; i++) {
        int64_t nch = (nel[i] + RP_CHUNK - 1) / RP_CHUNK;
        for (int64_t q = first[i], c0 = 0; q < first[i + 1]; q++) {
            int64_t st = job_step(nch, nthreads, per), c1 = c0 + st < nch ? c0 + st : nch;
            set_job(&jobs[q], &kinds[i], &bufs[2 * i], nel[i], c0, c1, arena);
            edge[q] = (q == first[i] ? RP_JOB_FIRST : 0) | (q + 1 == first[i + 1] ? RP_JOB_LAST : 0);
            c0 = c1;
        }
    }
    int64_t failed = -1;
    const char *err = NULL;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = rp_encode_jobs_arena(jobs, nj, nthreads, &arena->o, edge, at, &failed, &err);
    Py_END_ALLOW_THREADS
    if (rc) { raise_rc(rc, err); goto out; }
    at[nj] = arena->o.len;
    lst = PyList_New(np_);
    for (Py_ssize_t i = 0; lst && i < np_; i++) {
        int64_t changed = 0;
        uint64_t sd[2] = {0, 0};
        for (int64_t q = first[i]; q < first[i + 1]; q++) {
            changed += jobs[q].changed;
            sd[0] += jobs[q].sd[0];
            sd[1] += jobs[q].sd[1];
        }
        size_t off = at[first[i]], end = at[first[i + 1]];
        PyObject *t = Py_BuildValue("(nnLKK)", (Py_ssize_t)off, (Py_ssize_t)(end - off),
                                    (long long)changed, (unsigned long long)sd[0],
                                    (unsigned long long)sd[1]);
        if (!t) { Py_CLEAR(lst); break; }
        PyList_SET_ITEM(lst, i, t);
    }
    if (lst) res = Py_BuildValue("(ON)", (PyObject *)arena, lst);
out:
    Py_XDECREF(arena);
    pairs_close(&pa);
    free(jobs); free(at); free(edge);
    return res;
}
