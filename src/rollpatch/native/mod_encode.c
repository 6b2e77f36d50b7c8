/* CPython binding: the encoder's one-tensor entry points (encode_range*, encode_sparse,
 * encode_records) and its reusable Workspace type; encode_jobs and encode_view: mod_encjobs.c. */
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
