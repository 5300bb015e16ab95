/*
 * dsec_sdk.state._msgcount: how many MessagePack objects a buffer holds, without making them.
 *
 * The node agent's state keeper reads frames of up to 64 MiB from sandboxes it does not trust.
 * Decoding one makes a Python object per MessagePack object: 64 MiB of one-byte empty arrays
 * is 64 million lists, ~4.6 GiB and ~20 s of the loop every sandbox on the node shares. The
 * keeper counts first (here, in a thread, without the GIL) and decodes only a frame within
 * its bound; the SDK counts its records to cut checkpoints into frames within that bound.
 *
 * count(buffer, limit) walks the objects of the first value in `buffer` (an array or a map
 * counts itself and each element; a str, bin or ext is one object, its bytes skipped) and
 * returns their number, or limit + 1 as soon as it passes `limit`. Bytes after the first value
 * are not read. ValueError: the value is cut short, or holds the unused type byte 0xc1.
 * dsec_sdk.state.msgcount holds the pure-Python twin; libs/sdk/tests/test_state_msgcount.py
 * holds the two equal.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

/* Past this size the scan runs without the GIL (below it, taking and giving it back costs
 * more than the scan). */
#define NOGIL_BYTES (64 * 1024)

enum { OK = 0, CUT_SHORT = 1, BAD_TYPE = 2 };

static uint64_t be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) {
        v = (v << 8) | p[i];
    }
    return v;
}

/* The scan: `*found` objects (limit + 1 once past it); the status. `pending` counts the
 * objects still to read (the containers' elements); each is at least one byte, so more of them
 * than bytes left means the value is cut short (and keeps `pending` within the buffer's size). */
static int scan(const unsigned char *p, Py_ssize_t size, uint64_t limit, uint64_t *found) {
    const unsigned char *end = p + size;
    uint64_t pending = 1;
    uint64_t count = 0;
    while (pending > 0) {
        if (p >= end) {
            *found = count;
            return CUT_SHORT;
        }
        unsigned char b = *p++;
        pending--;
        if (++count > limit) {
            *found = count;
            return OK;
        }
        uint64_t skip = 0;  /* payload bytes after the header */
        uint64_t items = 0; /* elements that follow */
        int width = 0;      /* bytes of a length field */
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
            /* fixint, nil, false, true */
        } else if (b <= 0x8f) {
            items = 2u * (b & 0x0f);
        } else if (b <= 0x9f) {
            items = b & 0x0f;
        } else if (b <= 0xbf) {
            skip = b & 0x1f;
        } else if (b == 0xc1) {
            *found = count;
            return BAD_TYPE;
        } else if (b <= 0xc6) { /* bin 8/16/32 */
            width = 1 << (b - 0xc4);
        } else if (b <= 0xc9) { /* ext 8/16/32: length, then a type byte */
            width = 1 << (b - 0xc7);
            skip = 1;
        } else if (b <= 0xcb) { /* float 32/64 */
            skip = b == 0xca ? 4 : 8;
        } else if (b <= 0xd3) { /* uint/int 8..64 */
            skip = (uint64_t)1 << ((b - 0xcc) & 3);
        } else if (b <= 0xd8) { /* fixext 1..16: a type byte, then the data */
            skip = 1 + ((uint64_t)1 << (b - 0xd4));
        } else if (b <= 0xdb) { /* str 8/16/32 */
            width = 1 << (b - 0xd9);
        } else if (b <= 0xdd) { /* array 16/32 */
            if (end - p < (b == 0xdc ? 2 : 4)) {
                *found = count;
                return CUT_SHORT;
            }
            items = be(p, b == 0xdc ? 2 : 4);
            p += b == 0xdc ? 2 : 4;
        } else { /* map 16/32 */
            if (end - p < (b == 0xde ? 2 : 4)) {
                *found = count;
                return CUT_SHORT;
            }
            items = 2 * be(p, b == 0xde ? 2 : 4);
            p += b == 0xde ? 2 : 4;
        }
        if (width) {
            if (end - p < width) {
                *found = count;
                return CUT_SHORT;
            }
            skip += be(p, width);
            p += width;
        }
        if (skip > (uint64_t)(end - p)) {
            *found = count;
            return CUT_SHORT;
        }
        p += skip;
        pending += items;
        if (pending > (uint64_t)(end - p)) {
            *found = count;
            return CUT_SHORT;
        }
    }
    *found = count;
    return OK;
}

static PyObject *count(PyObject *self, PyObject *args) {
    Py_buffer view;
    unsigned long long limit;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*K", &view, &limit)) {
        return NULL;
    }
    uint64_t found = 0;
    int status;
    if (view.len >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        status = scan(view.buf, view.len, limit, &found);
        Py_END_ALLOW_THREADS
    } else {
        status = scan(view.buf, view.len, limit, &found);
    }
    PyBuffer_Release(&view);
    if (status == CUT_SHORT) {
        PyErr_Format(PyExc_ValueError, "MessagePack cut short after %llu objects",
                     (unsigned long long)found);
        return NULL;
    }
    if (status == BAD_TYPE) {
        PyErr_Format(PyExc_ValueError, "MessagePack type byte 0xc1 (unused) at object %llu",
                     (unsigned long long)found);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(found);
}

static PyMethodDef methods[] = {
    {"count", count, METH_VARARGS,
     "count(buffer, limit) -> int\n\n"
     "The MessagePack objects of the first value in buffer, or limit + 1 once past limit.\n"
     "ValueError: cut short, or the unused type byte 0xc1. Large buffers are scanned\n"
     "without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_msgcount", "MessagePack objects counted without making them.", -1,
    methods,
};

PyMODINIT_FUNC PyInit__msgcount(void) { return PyModule_Create(&module); }
