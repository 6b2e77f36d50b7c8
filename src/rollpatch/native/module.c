/* CPython binding of the native core (rpcore.h): buffers in (numpy arrays, bytes, memoryviews;
 * torch CPU tensors through .numpy()), no copies of tensors, the GIL released around every
 * loop so Python threads can run chunks of one tensor and different tensors in parallel.
 * This file: the shared helpers, the Buf type, the method table and the module's init; the
 * entry points live in mod_encode.c, mod_encjobs.c, mod_decode.c and mod_ops.c (module.h). */
#include "module.h"

PyObject *CorruptError; /* set from Python: rollpatch.errors.PatchDecodeError etc. */
PyObject *BaseError;

int kind_arg(PyObject *t, rp_kind *k) {
    if (!PyArg_ParseTuple(t, "iiii", &k->bits, &k->order, &k->shift, &k->cbits)) return -1;
    return 0;
}

PyObject *raise_rc(int rc, const char *msg) {
    if (rc == RP_ENOMEM) return PyErr_NoMemory();
    PyObject *cls = rc == RP_EBASE ? BaseError : rc == RP_ECORRUPT ? CorruptError : PyExc_ValueError;
    if (!cls) cls = PyExc_ValueError;
    PyErr_SetString(cls, msg ? msg : "native codec error");
    return NULL;
}

int elem_count(const rp_kind *k, Py_ssize_t nbytes, int64_t *n) {
    if (k->bits == 4) { *n = (int64_t)nbytes * 2; return 0; }
    Py_ssize_t w = k->bits / 8;
    if (nbytes % w) { PyErr_SetString(PyExc_ValueError, "buffer is not a whole number of words"); return -1; }
    *n = (int64_t)(nbytes / w);
    return 0;
}


static int buf_getbuffer(PyObject *self, Py_buffer *view, int flags) {
    BufObject *b = (BufObject *)self;
    int rc = PyBuffer_FillInfo(view, self, b->o.b ? (void *)b->o.b : (void *)"",
                               (Py_ssize_t)b->o.len, 1, flags);
    if (rc == 0) b->exports++;
    return rc;
}

static void buf_releasebuffer(PyObject *self, Py_buffer *view) {
    (void)view;
    ((BufObject *)self)->exports--;
}

#if defined(__linux__)
#include <sys/mman.h>
#endif

/* Pieces of a drained Buf: the output's pages are touched as fast as the Buf's go back, a
 * 32nd of it at a time (at least 64 KiB: fewer unmappings of a large one). */
#define DRAIN_MIN ((size_t)64 << 10)

int buf_drain(PyObject *item, char *dst, size_t len) {
#if defined(__linux__)
    if (Py_TYPE(item) == &BufType && Py_REFCNT(item) == 1) {
        rp_obuf *o = &((BufObject *)item)->o;
        if (((BufObject *)item)->exports == 0 && o->mapped) {
            size_t step = ((o->len / 32) + 4095) & ~(size_t)4095;
            if (step < DRAIN_MIN) step = DRAIN_MIN;
            while (o->len) { /* the mapping starts page-aligned and stays so */
                size_t n = o->len < step ? o->len : step;
                memcpy(dst, o->b, n);
                dst += n;
                if (n == step && o->cap > n) {
                    munmap(o->b, n);
                    o->b += n;
                    o->cap -= n;
                }
                o->len -= n;
            }
            rp_obuf_free(o);
            return 1;
        }
    }
#endif
    Py_buffer b;
    if (PyObject_GetBuffer(item, &b, PyBUF_SIMPLE)) return -1;
    int rc = (size_t)b.len == len ? 0 : -1;
    if (rc) PyErr_SetString(PyExc_ValueError, "an item changed size while joining");
    else memcpy(dst, b.buf, len);
    PyBuffer_Release(&b);
    return rc;
}

static void buf_dealloc(PyObject *self) {
    rp_obuf_free(&((BufObject *)self)->o);
    Py_TYPE(self)->tp_free(self);
}

static Py_ssize_t buf_length(PyObject *self) { return (Py_ssize_t)((BufObject *)self)->o.len; }

static PyBufferProcs buf_as_buffer = {buf_getbuffer, buf_releasebuffer};
static PyMappingMethods buf_as_mapping = {buf_length, NULL, NULL};

PyTypeObject BufType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rollpatch.native._rpcore.Buf",
    .tp_basicsize = sizeof(BufObject),
    .tp_dealloc = buf_dealloc,
    .tp_as_buffer = &buf_as_buffer,
    .tp_as_mapping = &buf_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A payload written by the native core (read-only buffer).",
};

BufObject *buf_new(void) {
    BufObject *b = PyObject_New(BufObject, &BufType);
    if (b) {
        memset(&b->o, 0, sizeof b->o);
        b->exports = 0;
    }
    return b;
}

PyObject *py_set_errors(PyObject *self, PyObject *args) {
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
PyObject *py_isa(PyObject *self, PyObject *args) {
    int level = -2;
    if (!PyArg_ParseTuple(args, "|i", &level)) return NULL;
    if (level != -2) rp_isa_set(level);
    return Py_BuildValue("(ii)", rp_isa(), rp_isa_best());
}

static PyMethodDef methods[] = {
    {"encode_range", py_encode_range, METH_VARARGS, "Encode chunks [first, last) of a tensor."},
    {"encode_range_buf", py_encode_range_buf, METH_VARARGS,
     "Encode chunks [first, last) of a tensor into one payload buffer."},
    {"encode_range_keep", py_encode_range_keep, METH_VARARGS,
     "encode_range, plus each chunk's changes (positions, old and new elements)."},
    {"encode_sparse", py_encode_sparse, METH_VARARGS, "Encode one chunk from its changes."},
    {"encode_records", py_encode_records, METH_VARARGS, "Encode one chunk from records."},
    {"encode_view", py_encode_view, METH_VARARGS,
     "Every (kind, a, b) pair's payload in one call: encode_jobs' jobs cut, run and joined natively."},
    {"encode_view_arena", py_encode_view_arena, METH_VARARGS,
     "encode_view's payloads at their offsets in one buffer, in pair order."},
    {"encode_jobs", py_encode_jobs, METH_VARARGS,
     "Encode many (tensor, chunk range) jobs on the core's own threads."},
    {"decode_apply_view", py_decode_apply_view, METH_VARARGS,
     "Decode and apply many tensors' deltas in jobs on the core's own threads."},
    {"table", py_table, METH_VARARGS, "Changed count per chunk of a delta payload."},
    {"decode_range", py_decode_range, METH_VARARGS, "Decode chunks [first, last)."},
    {"sum128", py_sum128, METH_VARARGS, "rp.sum128 state of a word range."},
    {"sum128_at", py_sum128_at, METH_VARARGS,
     "rp.sum128 terms of words held apart from their tensor, at their tensor indices."},
    {"cast_bf16", py_cast_bf16, METH_VARARGS, "Float32 bits to BF16 words; NaN count."},
    {"cast_bf16_diff", py_cast_bf16_diff, METH_VARARGS,
     "cast_bf16, and the words that differ from prev; (differences, NaN count)."},
    {"join_release", py_join_release, METH_VARARGS, "Concatenate a list of buffers into bytes (or a Buf), releasing each."},
    {"apply", py_apply, METH_VARARGS,
     "Check old, write new (dry: write nothing; readback: read the writes back); returns the "
     "sum128 change."},
    {"copy_apply", py_copy_apply, METH_VARARGS,
     "Copy a buffer with checked writes at positions, read back."},
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
