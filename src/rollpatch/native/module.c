/* CPython binding of the native core (rpcore.h): buffers in (numpy arrays, bytes, memoryviews;
 * torch CPU tensors through .numpy()), no copies of tensors, the GIL released around every
 * loop so Python threads can run chunks of one tensor and different tensors in parallel. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>

#include "rpcore.h"
#include "rp_cast.h"

static PyObject *CorruptError; /* set from Python: rollpatch.errors.PatchDecodeError etc. */
static PyObject *BaseError;

static int kind_arg(PyObject *t, rp_kind *k) {
    if (!PyArg_ParseTuple(t, "iiii", &k->bits, &k->order, &k->shift, &k->cbits)) return -1;
    return 0;
}

static PyObject *raise_rc(int rc, const char *msg) {
    if (rc == RP_ENOMEM) return PyErr_NoMemory();
    PyObject *cls = rc == RP_EBASE ? BaseError : rc == RP_ECORRUPT ? CorruptError : PyExc_ValueError;
    if (!cls) cls = PyExc_ValueError;
    PyErr_SetString(cls, msg ? msg : "native codec error");
    return NULL;
}

static int elem_count(const rp_kind *k, Py_ssize_t nbytes, int64_t *n) {
    if (k->bits == 4) { *n = (int64_t)nbytes * 2; return 0; }
    Py_ssize_t w = k->bits / 8;
    if (nbytes % w) { PyErr_SetString(PyExc_ValueError, "buffer is not a whole number of words"); return -1; }
    *n = (int64_t)(nbytes / w);
    return 0;
}

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

/* Buf: a read-only buffer over an rp_obuf (a payload the core wrote); freeing it gives a
 * large one's pages back at once, so a payload copied into the patch stops costing memory. */
typedef struct {
    PyObject_HEAD
    rp_obuf o;
} BufObject;

static int buf_getbuffer(PyObject *self, Py_buffer *view, int flags) {
    BufObject *b = (BufObject *)self;
    return PyBuffer_FillInfo(view, self, b->o.b ? (void *)b->o.b : (void *)"",
                             (Py_ssize_t)b->o.len, 1, flags);
}

static void buf_dealloc(PyObject *self) {
    rp_obuf_free(&((BufObject *)self)->o);
    Py_TYPE(self)->tp_free(self);
}

static Py_ssize_t buf_length(PyObject *self) { return (Py_ssize_t)((BufObject *)self)->o.len; }

static PyBufferProcs buf_as_buffer = {buf_getbuffer, NULL};
static PyMappingMethods buf_as_mapping = {buf_length, NULL, NULL};

static PyTypeObject BufType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rollpatch.native._rpcore.Buf",
    .tp_basicsize = sizeof(BufObject),
    .tp_dealloc = buf_dealloc,
    .tp_as_buffer = &buf_as_buffer,
    .tp_as_mapping = &buf_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A payload written by the native core (read-only buffer).",
};

static BufObject *buf_new(void) {
    BufObject *b = PyObject_New(BufObject, &BufType);
    if (b) memset(&b->o, 0, sizeof b->o);
    return b;
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

static PyTypeObject WsType = {
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
static PyObject *py_encode_range_buf(PyObject *self, PyObject *args) {
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

static PyObject *py_encode_range(PyObject *self, PyObject *args) {
    return encode_range_impl(args, 0);
}

static PyObject *py_encode_range_keep(PyObject *self, PyObject *args) {
    return encode_range_impl(args, 1);
}

/* encode_sparse(kind, base, start, n, pos:int64, old:uint64, new:uint64) -> body */
static PyObject *py_encode_sparse(PyObject *self, PyObject *args) {
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
static PyObject *py_encode_records(PyObject *self, PyObject *args) {
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
static PyObject *py_table(PyObject *self, PyObject *args) {
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
static PyObject *py_decode_range(PyObject *self, PyObject *args) {
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
static PyObject *py_join_release(PyObject *self, PyObject *args) {
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

/* sum128(data, w0, nwords) -> (a, b) */
static PyObject *py_sum128(PyObject *self, PyObject *args) {
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
static PyObject *py_cast_bf16(PyObject *self, PyObject *args) {
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
static PyObject *py_cast_bf16_diff(PyObject *self, PyObject *args) {
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

/* apply(kind, data(writable), pos:int64, old, new) -> (da, db); old/new in element width */
static PyObject *py_apply(PyObject *self, PyObject *args) {
    PyObject *kt, *res = NULL;
    Py_buffer d = {0}, pos = {0}, ov = {0}, nv = {0};
    rp_kind k;
    if (!PyArg_ParseTuple(args, "Ow*y*y*y*", &kt, &d, &pos, &ov, &nv)) return NULL;
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
    rc = rp_apply(&k, d.buf, (size_t)d.len, pos.buf, ov.buf, nv.buf, cnt, iw, delta, &err);
    Py_END_ALLOW_THREADS
    if (rc) { raise_rc(rc, err); goto out; }
    res = Py_BuildValue("(KK)", (unsigned long long)delta[0], (unsigned long long)delta[1]);
out:
    PyBuffer_Release(&d); PyBuffer_Release(&pos); PyBuffer_Release(&ov); PyBuffer_Release(&nv);
    return res;
}

/* compose(width, pp, po, pn, qp, qo, qn, rp, ro, rn) -> count, or -1 when the patches
 * disagree on an intermediate element (the caller raises its own error) */
static PyObject *py_compose(PyObject *self, PyObject *args) {
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
static PyObject *py_gather(PyObject *self, PyObject *args) {
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

/* diff(kind, a, b, start, n) -> bytes of int64 positions where a and b differ */
static PyObject *py_diff(PyObject *self, PyObject *args) {
    PyObject *kt, *res = NULL;
    Py_buffer a = {0}, b = {0};
    long long start, n;
    rp_kind k;
    int64_t total;
    if (!PyArg_ParseTuple(args, "Oy*y*LL", &kt, &a, &b, &start, &n)) return NULL;
    if (kind_arg(kt, &k) || elem_count(&k, a.len, &total)) goto out;
    if (a.len != b.len || start < 0 || n < 0 || start + n > total) {
        PyErr_SetString(PyExc_ValueError, "bad diff range");
        goto out;
    }
    int64_t cap = n / 32 + 1024, found = 0;
    int64_t *pos = NULL;
    for (;;) {
        int64_t *np_ = realloc(pos, (size_t)cap * 8);
        if (!np_) { free(pos); PyErr_NoMemory(); goto out; }
        pos = np_;
        Py_BEGIN_ALLOW_THREADS
        rp_diff(&k, a.buf, b.buf, start, n, pos, cap, &found);
        Py_END_ALLOW_THREADS
        if (found <= cap) break;
        cap = found;
    }
    res = PyBytes_FromStringAndSize((const char *)pos, (Py_ssize_t)found * 8);
    free(pos);
out:
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    return res;
}

static PyObject *py_set_errors(PyObject *self, PyObject *args) {
    PyObject *c, *b;
    if (!PyArg_ParseTuple(args, "OO", &c, &b)) return NULL;
    Py_XDECREF(CorruptError);
    Py_XDECREF(BaseError);
    Py_INCREF(c);
    Py_INCREF(b);
    CorruptError = c;
    BaseError = b;
    Py_RETURN_NONE;
}

/* isa() -> (level in use, best level); isa(level): force one (-1: the default) first. */
static PyObject *py_isa(PyObject *self, PyObject *args) {
    int level = -2;
    if (!PyArg_ParseTuple(args, "|i", &level)) return NULL;
    if (level != -2) rp_isa_set(level);
    return Py_BuildValue("(ii)", rp_isa(), rp_isa_best());
}

/* encode_jobs(pairs, jobs, threads) -> [(Buf, changed, sd0, sd1)] per job: pairs are (kind,
 * a, b) tensors, jobs (pair index, c0, c1) ranges of chunks; every job on the core's own
 * threads (rp_pool.c) with the GIL released once. Each job's result is what
 * encode_range_buf(kind, a, b, c0, c1) returns. */
static PyObject *py_encode_jobs(PyObject *self, PyObject *args) {
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
    for (Py_ssize_t i = 0; i < np_; i++) { /* a failed parse holds no buffer */
        PyObject *kt;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(pl, i), "Oy*y*", &kt, &bufs[2 * i], &bufs[2 * i + 1])
            || kind_arg(kt, &kinds[i]) || elem_count(&kinds[i], bufs[2 * i].len, &nel[i]))
            goto out;
        if (bufs[2 * i].len != bufs[2 * i + 1].len) {
            PyErr_SetString(PyExc_ValueError, "buffers differ in size");
            goto out;
        }
    }
    for (Py_ssize_t j = 0; j < nj; j++) {
        Py_ssize_t p, c0, c1;
        if (!PyArg_ParseTuple(PyList_GET_ITEM(jl, j), "nnn", &p, &c0, &c1)) goto out;
        if (p < 0 || p >= np_) { PyErr_SetString(PyExc_ValueError, "job names no pair"); goto out; }
        rp_enc_job *b = &jobs[j];
        b->k = &kinds[p];
        b->old = bufs[2 * p].buf;
        b->new_ = bufs[2 * p + 1].buf;
        b->nbytes = (size_t)bufs[2 * p].len;
        b->n = nel[p];
        b->c0 = c0;
        b->c1 = c1;
        if (!(outs[j] = buf_new())) goto out;
        b->out = &outs[j]->o;
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
static PyObject *py_decode_apply_jobs(PyObject *self, PyObject *args) {
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

static PyMethodDef methods[] = {
    {"encode_range", py_encode_range, METH_VARARGS, "Encode chunks [first, last) of a tensor."},
    {"encode_range_buf", py_encode_range_buf, METH_VARARGS,
     "Encode chunks [first, last) of a tensor into one payload buffer."},
    {"encode_range_keep", py_encode_range_keep, METH_VARARGS,
     "encode_range, plus each chunk's changes (positions, old and new elements)."},
    {"encode_sparse", py_encode_sparse, METH_VARARGS, "Encode one chunk from its changes."},
    {"encode_records", py_encode_records, METH_VARARGS, "Encode one chunk from records."},
    {"encode_jobs", py_encode_jobs, METH_VARARGS,
     "Encode many (tensor, chunk range) jobs on the core's own threads."},
    {"decode_apply_jobs", py_decode_apply_jobs, METH_VARARGS,
     "Decode and apply many (tensor, chunk range) jobs on the core's own threads."},
    {"table", py_table, METH_VARARGS, "Changed count per chunk of a delta payload."},
    {"decode_range", py_decode_range, METH_VARARGS, "Decode chunks [first, last)."},
    {"sum128", py_sum128, METH_VARARGS, "rp.sum128 state of a word range."},
    {"cast_bf16", py_cast_bf16, METH_VARARGS, "Float32 bits to BF16 words; NaN count."},
    {"cast_bf16_diff", py_cast_bf16_diff, METH_VARARGS,
     "cast_bf16, and the words that differ from prev; (differences, NaN count)."},
    {"join_release", py_join_release, METH_VARARGS, "Concatenate a list of buffers into bytes (or a Buf), releasing each."},
    {"apply", py_apply, METH_VARARGS, "Check old, write new; returns the sum128 change."},
    {"gather", py_gather, METH_VARARGS, "Gather elements at positions."},
    {"compose", py_compose, METH_VARARGS, "Merge two sorted change lists (p then q)."},
    {"diff", py_diff, METH_VARARGS, "Positions where two buffers differ."},
    {"set_errors", py_set_errors, METH_VARARGS, "Exception classes for corrupt/base errors."},
    {"isa", py_isa, METH_VARARGS,
     "(level in use, best level); with a level (0 scalar, 1 AVX2, 2 AVX-512, -1 default), "
     "force it first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_rpcore", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rpcore(void) {
    if (PyType_Ready(&BufType) < 0 || PyType_Ready(&WsType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (m) {
        Py_INCREF(&WsType);
        if (PyModule_AddObject(m, "Workspace", (PyObject *)&WsType) < 0) {
            Py_DECREF(&WsType);
            Py_DECREF(m);
            return NULL;
        }
    }
    if (m) PyModule_AddIntConstant(m, "CHUNK", (long)RP_CHUNK);
    if (m) PyModule_AddIntConstant(m, "DECODE_HASH", 1); /* decode_range(..., write, hash) */
    return m;
}
