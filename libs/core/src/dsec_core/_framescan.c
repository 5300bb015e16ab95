/*
 * dsec_core._framescan: a replay's common NATS frames cut out in C.
 *
 * A replay (dsec_core.bus.replay_batches: `dsec audit verify`, the read models' rebuild) reads
 * a JetStream consumer's messages as the server writes them, frame after frame:
 *
 *     HMSG <subject> <sid> $JS.ACK.<stream>.<consumer>.<n>.<sseq>.<cseq>.<ts>.<pending> <hdr> <size>\r\n
 *     <hdr bytes of headers><size - hdr bytes of data>\r\n
 *
 * (or MSG ... <size> without headers). _ReplayTap.parse cuts each out with a regular expression
 * and a few int() calls: 3 us a message of Python, the replay's largest cost. scan() does the
 * same for the frames of the common case and stops, without taking it, at the first frame that
 * is anything else, for the Python code to read that one its own way:
 *
 *   - the control line matches dsec_core.bus._DATA_LINE exactly (the 9-token ack subject);
 *   - its sid is the replay's, and it has a header size exactly when it is an HMSG;
 *   - the stream sequence is not 0, the consumer sequence is the one after `delivered`,
 *     the header fits in the message, the whole frame is in `buf` and ends in CRLF;
 *   - every number has at most 18 digits (no overflow).
 *
 * For each frame taken it appends (stream_seq, data) to `sink`, as the Python path does, and
 * returns (the position after the last frame taken, the last consumer sequence taken).
 * libs/core/tests/test_replay_tap.py holds the two paths equal on generated streams.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <string.h>

#define MAX_DIGITS 18

/* Digits [0-9]+ from *p (at most MAX_DIGITS); -1 when none or too many. */
static long long read_number(const char **p, const char *limit) {
    const char *s = *p;
    long long value = 0;
    int n = 0;
    while (s < limit && *s >= '0' && *s <= '9') {
        if (++n > MAX_DIGITS) {
            return -1;
        }
        value = value * 10 + (*s - '0');
        s++;
    }
    if (n == 0) {
        return -1;
    }
    *p = s;
    return value;
}

/* One or more bytes that are none of `stops` (a NUL-terminated set); NULL when none. */
static const char *skip_token(const char *s, const char *limit, const char *stops) {
    const char *start = s;
    while (s < limit && strchr(stops, *s) == NULL) {
        s++;
    }
    /* (strchr finds the terminating NUL too: a NUL byte stops a token, and then fails the
     * literal that must follow it, so the frame goes the Python way) */
    return s == start ? NULL : s;
}

static int literal(const char **p, const char *limit, const char *text, size_t n) {
    if ((size_t)(limit - *p) < n || memcmp(*p, text, n) != 0) {
        return 0;
    }
    *p += n;
    return 1;
}

/* The frame at `s`: 1 and its parts when it is one of the common case, else 0. */
static int common_frame(const char *s, const char *end, const char *sid, Py_ssize_t sid_len,
                        long long delivered, long long *seq_out, long long *delivered_out,
                        const char **data_out, Py_ssize_t *data_len, const char **next) {
    int hmsg = 0;
    if (s < end && *s == 'H') {
        hmsg = 1;
        s++;
    }
    if (!literal(&s, end, "MSG ", 4)) {
        return 0;
    }
    s = skip_token(s, end, " \r\n"); /* the subject */
    if (s == NULL || !literal(&s, end, " ", 1)) {
        return 0;
    }
    const char *sid_start = s;
    s = skip_token(s, end, " \r\n");
    if (s == NULL || s - sid_start != sid_len || memcmp(sid_start, sid, (size_t)sid_len) != 0) {
        return 0;
    }
    if (!literal(&s, end, " $JS.ACK.", 9)) {
        return 0;
    }
    for (int i = 0; i < 3; i++) { /* stream, consumer, delivery count */
        s = skip_token(s, end, " .\r\n");
        if (s == NULL || !literal(&s, end, ".", 1)) {
            return 0;
        }
    }
    long long seq = read_number(&s, end);
    if (seq < 0 || !literal(&s, end, ".", 1)) {
        return 0;
    }
    long long cseq = read_number(&s, end);
    if (cseq < 0 || !literal(&s, end, ".", 1)) {
        return 0;
    }
    s = skip_token(s, end, " .\r\n"); /* timestamp */
    if (s == NULL || !literal(&s, end, ".", 1)) {
        return 0;
    }
    s = skip_token(s, end, " .\r\n"); /* pending */
    if (s == NULL || !literal(&s, end, " ", 1)) {
        return 0;
    }
    long long first = read_number(&s, end);
    if (first < 0) {
        return 0;
    }
    long long header = -1, size = first;
    if (s < end && *s == ' ') {
        s++;
        header = first;
        size = read_number(&s, end);
        if (size < 0) {
            return 0;
        }
    }
    if (!literal(&s, end, "\r\n", 2)) {
        return 0;
    }
    if ((header >= 0) != hmsg || seq == 0 || cseq != delivered + 1) {
        return 0;
    }
    if (header < 0) {
        header = 0;
    }
    if (header > size || size + 2 > end - s || s[size] != '\r' || s[size + 1] != '\n') {
        return 0;
    }
    *seq_out = seq;
    *delivered_out = cseq;
    *data_out = s + header;
    *data_len = (Py_ssize_t)(size - header);
    *next = s + size + 2;
    return 1;
}

static PyObject *scan(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "scan(buf, pos, sid, delivered, sink)");
        return NULL;
    }
    PyObject *buf = args[0], *sid = args[2], *sink = args[4];
    if (!PyBytes_CheckExact(buf) || !PyBytes_CheckExact(sid) || !PyList_CheckExact(sink)) {
        PyErr_SetString(PyExc_TypeError, "scan: buf and sid must be bytes, sink a list");
        return NULL;
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred()) {
        return NULL;
    }
    long long delivered = PyLong_AsLongLong(args[3]);
    if (delivered == -1 && PyErr_Occurred()) {
        return NULL;
    }
    const char *base = PyBytes_AS_STRING(buf);
    Py_ssize_t size = PyBytes_GET_SIZE(buf);
    if (pos < 0 || pos > size) {
        PyErr_SetString(PyExc_ValueError, "scan: pos outside buf");
        return NULL;
    }
    const char *end = base + size;
    const char *at = base + pos;
    const char *sid_bytes = PyBytes_AS_STRING(sid);
    Py_ssize_t sid_len = PyBytes_GET_SIZE(sid);
    if (sid_len > 0 && delivered >= 0 && delivered < (1LL << 60)) {
        long long seq, cseq;
        const char *data, *next;
        Py_ssize_t data_len;
        while (at < end && common_frame(at, end, sid_bytes, sid_len, delivered, &seq, &cseq,
                                        &data, &data_len, &next)) {
            PyObject *item = Py_BuildValue("(Ly#)", seq, data, data_len);
            if (item == NULL) {
                return NULL;
            }
            int failed = PyList_Append(sink, item);
            Py_DECREF(item);
            if (failed) {
                return NULL;
            }
            delivered = cseq;
            at = next;
        }
    }
    return Py_BuildValue("(nL)", (Py_ssize_t)(at - base), delivered);
}

static PyMethodDef methods[] = {
    {"scan", (PyCFunction)(void (*)(void))scan, METH_FASTCALL,
     "scan(buf, pos, sid, delivered, sink) -> (pos, delivered): append (stream_seq, data) of "
     "the replay's common frames from pos on; stop at the first other one."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "dsec_core._framescan",
    "A replay's common NATS frames cut out in C (see dsec_core.bus._ReplayTap).", -1, methods,
};

PyMODINIT_FUNC PyInit__framescan(void) { return PyModule_Create(&module); }
