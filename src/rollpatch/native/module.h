/* The CPython binding's shared parts (module.c): the error classes set from Python, argument
 * helpers, the Buf payload type, and the entry points each binding file defines for the method
 * table (mod_encode.c, mod_encjobs.c, mod_decode.c, mod_ops.c). */
#ifndef RP_MODULE_H
#define RP_MODULE_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdlib.h>
#include <string.h>

#include "rpcore.h"

extern PyObject *CorruptError; /* rollpatch.errors.PatchDecodeError, set by set_errors */
extern PyObject *BaseError;    /* rollpatch.errors.BaseMismatchError */

int kind_arg(PyObject *t, rp_kind *k);
PyObject *raise_rc(int rc, const char *msg);
int elem_count(const rp_kind *k, Py_ssize_t nbytes, int64_t *n);

/* Buf: a read-only buffer over an rp_obuf (a payload the core wrote); freeing it gives a
 * large one's pages back at once, so a payload copied into the patch stops costing memory. */
typedef struct {
    PyObject_HEAD
    rp_obuf o;
    Py_ssize_t exports; /* buffer views handed out and not released */
} BufObject;
extern PyTypeObject BufType;
BufObject *buf_new(void);
/* Copy `item`'s len bytes to dst; where it is a mapped Buf only its holder references (the
 * caller's list: reference count 1, no view of it out), its pages are given back as they are
 * copied. 1 if it was such a Buf (its bytes are gone: the caller drops it), 0 if copied, -1
 * with an exception set if it could not be read or is not len bytes long. */
int buf_drain(PyObject *item, char *dst, size_t len);
extern PyTypeObject WsType; /* mod_encode.c */

PyObject *py_encode_range_buf(PyObject *self, PyObject *args);
PyObject *py_encode_range(PyObject *self, PyObject *args);
PyObject *py_encode_range_keep(PyObject *self, PyObject *args);
PyObject *py_encode_sparse(PyObject *self, PyObject *args);
PyObject *py_encode_records(PyObject *self, PyObject *args);
PyObject *py_table(PyObject *self, PyObject *args);
PyObject *py_decode_range(PyObject *self, PyObject *args);
PyObject *py_join_release(PyObject *self, PyObject *args);
PyObject *py_sum128(PyObject *self, PyObject *args);
PyObject *py_sum128_at(PyObject *self, PyObject *args);
PyObject *py_cast_bf16(PyObject *self, PyObject *args);
PyObject *py_cast_bf16_diff(PyObject *self, PyObject *args);
PyObject *py_apply(PyObject *self, PyObject *args);
PyObject *py_copy_apply(PyObject *self, PyObject *args);
PyObject *py_compose(PyObject *self, PyObject *args);
PyObject *py_gather(PyObject *self, PyObject *args);
PyObject *py_diff(PyObject *self, PyObject *args);
PyObject *py_set_errors(PyObject *self, PyObject *args);
PyObject *py_isa(PyObject *self, PyObject *args);
PyObject *py_encode_jobs(PyObject *self, PyObject *args); /* mod_encjobs.c */
PyObject *py_encode_view(PyObject *self, PyObject *args);
PyObject *py_encode_view_arena(PyObject *self, PyObject *args);
PyObject *py_decode_apply_view(PyObject *self, PyObject *args);

#endif
