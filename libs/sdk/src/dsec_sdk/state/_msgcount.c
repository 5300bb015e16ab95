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
 * are not read. ValueError: the value is cut short, holds the unused type byte 0xc1, or is
 * nested deeper than msgpack decodes (1024); with strict, a map key is not a str or bin, or
 * a value is an extension type.
 * dsec_sdk.state.msgcount holds the pure-Python twin; libs/sdk/tests/test_state_msgcount.py
 * holds the two equal.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

/* Past this size the scan runs without the GIL (below it, taking and giving it back costs
 * more than the scan). */
#define NOGIL_BYTES (64 * 1024)

enum { OK = 0, CUT_SHORT = 1, BAD_TYPE = 2, BAD_KEY = 3, TOO_DEEP = 4, EXT = 5 };

/* msgpack's decoder refuses a value nested deeper than this (StackError): so does the scan. */
#define MAX_DEPTH 1024
#define STR(x) #x
#define XSTR(x) STR(x)

/* ValueError's text for each status but OK (the object it stopped at follows). */
static const char *const messages[] = {
    [CUT_SHORT] = "MessagePack cut short after %llu objects",
    [BAD_TYPE] = "MessagePack type byte 0xc1 (unused) at object %llu",
    [BAD_KEY] = "a map key that is not a string at object %llu",
    [TOO_DEEP] = "nested deeper than " XSTR(MAX_DEPTH) " at object %llu",
    [EXT] = "an extension type (a timestamp...) at object %llu",
};

static uint64_t be(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) {
        v = (v << 8) | p[i];
    }
    return v;
}

/* The scan ends: `count` objects found, with `status`. */
static int stop(uint64_t *found, uint64_t count, int status) {
    *found = count;
    return status;
}

/* One open container: the elements still to read, and whether it is a map (whose elements
 * alternate key, value: a key when an even number is left). */
typedef struct {
    uint64_t left;
    int map;
} level;

/* The scan: `*found` objects (limit + 1 once past it); the status. `pending` counts the
 * objects still to read (the containers' elements); each is at least one byte, so more of them
 * than bytes left means the value is cut short (and keeps `pending` within the buffer's size).
 * With `strict`, a map key must be a str or a bin (whose Python hashes are salted: an int
 * or a timestamp key's are not, and a map of colliding keys costs its square to build), and
 * no value may be an extension type (a timestamp hashes as a tuple wherever it ends up in a
 * dict or set, and an ext decodes to two or three Python objects, not one). */
static int scan(const unsigned char *p, Py_ssize_t size, uint64_t limit, int strict,
                uint64_t *found) {
    const unsigned char *end = p + size;
    level stack[MAX_DEPTH];
    int depth = 0;
    uint64_t pending = 1;
    uint64_t count = 0;
    while (pending > 0) {
        if (p >= end) {
            return stop(found, count, CUT_SHORT);
        }
        while (depth > 0 && stack[depth - 1].left == 0) {
            depth--;
        }
        int is_key = 0;
        if (depth > 0) {
            is_key = stack[depth - 1].map && (stack[depth - 1].left % 2 == 0);
            stack[depth - 1].left--;
        }
        unsigned char b = *p++;
        pending--;
        if (++count > limit) {
            return stop(found, count, OK);
        }
        if (is_key && strict && !((b >= 0xa0 && b <= 0xbf) || (b >= 0xd9 && b <= 0xdb) ||
                                       (b >= 0xc4 && b <= 0xc6))) {
            return stop(found, count, BAD_KEY);
        }
        if (strict && ((b >= 0xc7 && b <= 0xc9) || (b >= 0xd4 && b <= 0xd8))) {
            return stop(found, count, EXT);
        }
        uint64_t skip = 0;  /* payload bytes after the header */
        uint64_t items = 0; /* elements that follow */
        int container = 0;
        int map = 0;
        int width = 0; /* bytes of a length field */
        if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
            /* fixint, nil, false, true */
        } else if (b <= 0x8f) {
            items = 2u * (b & 0x0f);
            container = map = 1;
        } else if (b <= 0x9f) {
            items = b & 0x0f;
            container = 1;
        } else if (b <= 0xbf) {
            skip = b & 0x1f;
        } else if (b == 0xc1) {
            return stop(found, count, BAD_TYPE);
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
        } else { /* array 16/32, map 16/32 */
            int n = (b == 0xdc || b == 0xde) ? 2 : 4;
            if (end - p < n) {
                return stop(found, count, CUT_SHORT);
            }
            items = be(p, n);
            p += n;
            container = 1;
            if (b >= 0xde) {
                items *= 2;
                map = 1;
            }
        }
        if (width) {
            if (end - p < width) {
                return stop(found, count, CUT_SHORT);
            }
            skip += be(p, width);
            p += width;
        }
        if (skip > (uint64_t)(end - p)) {
            return stop(found, count, CUT_SHORT);
        }
        p += skip;
        if (container) {
            if (depth + 1 > MAX_DEPTH) { /* (an empty one counts too, as msgpack's stack does) */
                return stop(found, count, TOO_DEEP);
            }
            if (items > 0) {
                stack[depth].left = items;
                stack[depth].map = map;
                depth++;
            }
        }
        pending += items;
        if (pending > (uint64_t)(end - p)) {
            return stop(found, count, CUT_SHORT);
        }
    }
    return stop(found, count, OK);
}

static PyObject *count(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *keywords[] = {"", "", "strict", NULL};
    Py_buffer view;
    long long signed_limit;
    int strict = 0;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*L|$p", keywords, &view, &signed_limit,
                                     &strict)) {
        return NULL;
    }
    /* (a negative limit is passed at the first object, as in the Python twin) */
    uint64_t limit = signed_limit < 0 ? 0 : (uint64_t)signed_limit;
    uint64_t found = 0;
    int status;
    if (view.len >= NOGIL_BYTES) {
        Py_BEGIN_ALLOW_THREADS
        status = scan(view.buf, view.len, limit, strict, &found);
        Py_END_ALLOW_THREADS
    } else {
        status = scan(view.buf, view.len, limit, strict, &found);
    }
    PyBuffer_Release(&view);
    if (status != OK) {
        PyErr_Format(PyExc_ValueError, messages[status], (unsigned long long)found);
        return NULL;
    }
    return PyLong_FromUnsignedLongLong(found);
}

static PyMethodDef methods[] = {
    {"count", (PyCFunction)(void (*)(void))count, METH_VARARGS | METH_KEYWORDS,
     "count(buffer, limit, *, strict=False) -> int\n\n"
     "The MessagePack objects of the first value in buffer, or limit + 1 once past limit.\n"
     "ValueError: cut short, the unused type byte 0xc1, nested deeper than 1024, or (with\n"
     "strict) a map key that is not a str or bin, or an extension type. Large buffers are\n"
     "scanned without the GIL."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_msgcount",
    .m_doc = "MessagePack objects counted without making them.",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__msgcount(void) { return PyModule_Create(&module); }
