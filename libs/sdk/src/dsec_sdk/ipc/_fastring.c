/*
 * The hot path of dsec_sdk.ipc.ring in C: publish one inline record, consume one, spin for one.
 *
 * Why C: in CPython one write+read of a 200-byte record through memoryviews costs ~1.2 us, and
 * a tool call does two of them on a budget of a few microseconds. Everything else (wrap-around,
 * overflow payloads, malformed records, the sleep handshake) stays in ring.py, which this module
 * calls back for anything but the common case. The shared-memory layout is ring.py's, unchanged:
 * a Python end and a C end interoperate (tests run both against each other), and ring.py works
 * alone where this extension could not be built.
 *
 * Memory ordering (x86-64 and others): the producer's body stores are released by the store of
 * HEAD; the consumer acquires HEAD before reading the body; the sleep handshake (store HEAD, then
 * load CONSUMER_WAITING) needs a full barrier, as in ring.py's fence().
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
/* The layout is little-endian (ring.py's struct "<IBBHQ"); elsewhere ring.py runs alone. */
#error "the ring's C hot path assumes a little-endian CPU"
#endif

#define HEADER_SIZE 512
#define RECORD_SIZE 16
#define W_HEAD 0
#define W_PRODUCER_CPU 1 /* producer: 1 + the CPU it last wrote on (0: unknown); HEAD's line */
#define W_TAIL 8
#define W_CONSUMER_CPU 9 /* consumer: 1 + the CPU it last read on (0: unknown); TAIL's line */
#define W_CONSUMER_WAITING 16
#define W_PRODUCER_WAITING 24
#define REC_INLINE 1

#if defined(__x86_64__) || defined(__i386__)
#define CPU_RELAX() __builtin_ia32_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield" ::: "memory")
#else
#define CPU_RELAX() ((void)0)
#endif

typedef struct {
    PyObject_HEAD
    Py_buffer view; /* header + data of this ring, inside the channel mapping */
    int has_view;
    uint64_t *hdr;
    unsigned char *data;
    uint64_t capacity;
    uint64_t mask;
    uint64_t max_inline;
    uint64_t tail_seen; /* producer's cached view of TAIL */
    int consumer_wake_fd;
    int producer_wake_fd;
    PyObject *write_slow; /* ring.py: (kind, call_id, body) -> bool */
    PyObject *read_slow;  /* ring.py: (decode, tail, pos, n, rec, kind, call_id) -> tuple */
} FastRing;

static inline uint64_t load_acquire(uint64_t *word) { return __atomic_load_n(word, __ATOMIC_ACQUIRE); }
static inline uint64_t load_relaxed(uint64_t *word) { return __atomic_load_n(word, __ATOMIC_RELAXED); }
static inline void store_release(uint64_t *word, uint64_t value)
{
    __atomic_store_n(word, value, __ATOMIC_RELEASE);
}

static inline int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock of time.perf_counter_ns() on Linux */
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void notify(int fd)
{
    /* Failure means the counter is saturated (the peer wakes anyway) or the fd is gone (the peer
     * learns of it through its pidfd): as ring.py's _notify. */
    uint64_t one = 1;
    ssize_t ignored = write(fd, &one, sizeof one);
    (void)ignored;
}

static int released(FastRing *self)
{
    if (!self->has_view) {
        PyErr_SetString(PyExc_ValueError, "operation on a released ring");
        return 1;
    }
    return 0;
}

/* The checks every method starts with: its argument count, and a ring still mapped. */
static int begin(FastRing *self, Py_ssize_t nargs, Py_ssize_t expected, const char *usage)
{
    if (nargs != expected) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", usage, expected);
        return -1;
    }
    return released(self) ? -1 : 0;
}

static int FastRing_init(FastRing *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"buffer", "capacity", "consumer_wake_fd", "producer_wake_fd",
                             "write_slow", "read_slow", NULL};
    PyObject *buffer, *write_slow, *read_slow;
    unsigned long long capacity;
    int consumer_wake_fd, producer_wake_fd;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OKiiOO", kwlist, &buffer, &capacity,
                                     &consumer_wake_fd, &producer_wake_fd, &write_slow, &read_slow))
        return -1;
    if (capacity < 4096 || (capacity & (capacity - 1))) {
        PyErr_Format(PyExc_ValueError, "ring capacity %llu is not a power of two >= 4096", capacity);
        return -1;
    }
    if (!PyCallable_Check(write_slow) || !PyCallable_Check(read_slow)) {
        PyErr_SetString(PyExc_TypeError, "write_slow and read_slow must be callable");
        return -1;
    }
    if (self->has_view) {
        PyErr_SetString(PyExc_RuntimeError, "FastRing is already initialised");
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &self->view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if ((uint64_t)self->view.len < HEADER_SIZE + capacity || ((uintptr_t)self->view.buf & 63)) {
        PyBuffer_Release(&self->view);
        PyErr_SetString(PyExc_ValueError, "buffer is too small or not 64-byte aligned");
        return -1;
    }
    self->has_view = 1;
    self->hdr = (uint64_t *)self->view.buf;
    self->data = (unsigned char *)self->view.buf + HEADER_SIZE;
    self->capacity = capacity;
    self->mask = capacity - 1;
    self->max_inline = capacity / 2 - RECORD_SIZE;
    self->tail_seen = load_acquire(&self->hdr[W_TAIL]);
    self->consumer_wake_fd = consumer_wake_fd;
    self->producer_wake_fd = producer_wake_fd;
    Py_INCREF(write_slow);
    Py_XSETREF(self->write_slow, write_slow);
    Py_INCREF(read_slow);
    Py_XSETREF(self->read_slow, read_slow);
    return 0;
}

static int FastRing_traverse(FastRing *self, visitproc visit, void *arg)
{
    Py_VISIT(self->write_slow);
    Py_VISIT(self->read_slow);
    if (self->has_view)
        Py_VISIT(self->view.obj);
    return 0;
}

static int FastRing_clear(FastRing *self)
{
    Py_CLEAR(self->write_slow);
    Py_CLEAR(self->read_slow);
    if (self->has_view) {
        self->has_view = 0;
        PyBuffer_Release(&self->view);
    }
    return 0;
}

static void FastRing_dealloc(FastRing *self)
{
    PyObject_GC_UnTrack(self);
    FastRing_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(try_write_doc,
             "try_write(kind, call_id, body) -> bool\n\n"
             "Publish one record; False when there is no space yet. Anything but an inline record\n"
             "that fits before the end of the data goes to ring.py's slow path.");

/* Publish one inline record that fits before the end of the data: 1 done, 0 not possible here
 * (no space, needs a wrap, too large: ring.py's slow path decides), -1 error. */
static int write_fast(FastRing *self, unsigned long kind, unsigned long long call_id,
                      PyObject *body)
{
    Py_buffer body_view;
    const char *src;
    Py_ssize_t n;
    int have_buffer = 0, done = 0;
    if (PyBytes_CheckExact(body)) {
        src = PyBytes_AS_STRING(body);
        n = PyBytes_GET_SIZE(body);
    } else {
        if (PyObject_GetBuffer(body, &body_view, PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        have_buffer = 1;
        src = (const char *)body_view.buf;
        n = body_view.len;
    }
    uint64_t *hdr = self->hdr;
    uint64_t head = load_relaxed(&hdr[W_HEAD]); /* only this process writes HEAD */
    uint64_t need = RECORD_SIZE + (((uint64_t)n + 15) & ~(uint64_t)15);
    uint64_t pos = head & self->mask;
    if ((uint64_t)n <= self->max_inline && pos + need <= self->capacity) {
        if (head + need > self->tail_seen + self->capacity)
            self->tail_seen = load_acquire(&hdr[W_TAIL]);
        if (head + need <= self->tail_seen + self->capacity) {
            unsigned char *record = self->data + pos;
            uint32_t len32 = (uint32_t)n;
            uint16_t zero = 0;
            uint64_t id64 = (uint64_t)call_id;
            /* <u32 body_len, u8 record_type, u8 kind, u16 0, u64 call_id>, little-endian */
            memcpy(record, &len32, 4);
            record[4] = REC_INLINE;
            record[5] = (uint8_t)kind;
            memcpy(record + 6, &zero, 2);
            memcpy(record + 8, &id64, 8);
            memcpy(record + RECORD_SIZE, src, (size_t)n);
            int cpu = sched_getcpu(); /* where the producer runs (see W_CONSUMER_CPU) */
            if (cpu >= 0 && load_relaxed(&hdr[W_PRODUCER_CPU]) != (uint64_t)cpu + 1)
                __atomic_store_n(&hdr[W_PRODUCER_CPU], (uint64_t)cpu + 1, __ATOMIC_RELAXED);
            store_release(&hdr[W_HEAD], head + need);
            __atomic_thread_fence(__ATOMIC_SEQ_CST); /* HEAD store before WAITING load */
            if (load_relaxed(&hdr[W_CONSUMER_WAITING]))
                notify(self->consumer_wake_fd);
            done = 1;
        }
    }
    if (have_buffer)
        PyBuffer_Release(&body_view);
    return done;
}

static int parse_kind_id(PyObject *kind_obj, PyObject *id_obj, unsigned long *kind,
                         unsigned long long *call_id)
{
    *kind = PyLong_AsUnsignedLong(kind_obj);
    if (*kind == (unsigned long)-1 && PyErr_Occurred())
        return -1;
    if (*kind > 255) {
        PyErr_SetString(PyExc_OverflowError, "kind must fit in one byte");
        return -1;
    }
    *call_id = PyLong_AsUnsignedLongLong(id_obj);
    if (*call_id == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    return 0;
}

static PyObject *FastRing_try_write(FastRing *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (begin(self, nargs, 3, "try_write(kind, call_id, body)") < 0)
        return NULL;
    unsigned long kind;
    unsigned long long call_id;
    if (parse_kind_id(args[0], args[1], &kind, &call_id) < 0)
        return NULL;
    int done = write_fast(self, kind, call_id, args[2]);
    if (done < 0)
        return NULL;
    if (done)
        Py_RETURN_TRUE;
    return PyObject_Vectorcall(self->write_slow, args, 3, NULL);
}

PyDoc_STRVAR(try_read_doc,
             "try_read(decode) -> (kind, call_id, value) | None\n\n"
             "Consume one record; decode runs on the body in place (a memoryview that is released\n"
             "afterwards if decode kept it). The record is consumed even when decode raises.");

static PyObject *FastRing_try_read(FastRing *self, PyObject *decode)
{
    if (released(self))
        return NULL;
    uint64_t *hdr = self->hdr;
    uint64_t tail = load_relaxed(&hdr[W_TAIL]); /* only this process writes TAIL */
    uint64_t head = load_acquire(&hdr[W_HEAD]);
    if (head == tail)
        Py_RETURN_NONE;
    uint64_t pos = tail & self->mask;
    /* TAIL lives in shared memory a hostile peer can write: a record header that is not 16-byte
     * aligned could end past the data area, so it is not even read here (ring.py refuses it). */
    uint32_t n = 0;
    uint8_t rec = 0, kind = 0;
    uint64_t call_id = 0;
    if (pos & 15)
        goto slow;
    const unsigned char *record = self->data + pos;
    /* The record's lines were just written on another core: ask for the first four at once, so
     * a ~200-byte frame costs one cross-core transfer, not one per line in turn. */
    uint64_t ahead = self->capacity - pos < 256 ? self->capacity - pos : 256;
    for (uint64_t offset = 64; offset < ahead; offset += 64)
        __builtin_prefetch(record + offset, 0, 3);
    memcpy(&n, record, 4);
    rec = record[4];
    kind = record[5];
    memcpy(&call_id, record + 8, 8);
    if (rec != REC_INLINE || n > self->max_inline || pos + RECORD_SIZE + n > self->capacity) {
    slow:
        /* WRAP, LARGE, or garbage: ring.py knows what to do. */
        PyObject *slow_args[7];
        slow_args[0] = decode;
        slow_args[1] = PyLong_FromUnsignedLongLong(tail);
        slow_args[2] = PyLong_FromUnsignedLongLong(pos);
        slow_args[3] = PyLong_FromUnsignedLong(n);
        slow_args[4] = PyLong_FromLong(rec);
        slow_args[5] = PyLong_FromLong(kind);
        slow_args[6] = PyLong_FromUnsignedLongLong(call_id);
        PyObject *result = NULL;
        if (slow_args[1] && slow_args[2] && slow_args[3] && slow_args[4] && slow_args[5] &&
            slow_args[6])
            result = PyObject_Vectorcall(self->read_slow, slow_args, 7, NULL);
        for (int i = 1; i < 7; i++)
            Py_XDECREF(slow_args[i]);
        return result;
    }
    PyObject *body = PyMemoryView_FromMemory((char *)record + RECORD_SIZE, n, PyBUF_READ);
    PyObject *value = NULL;
    if (body != NULL) {
        value = PyObject_CallOneArg(decode, body);
        if (Py_REFCNT(body) > 1) {
            /* decode kept the view: invalidate it, so it can never read a reused slot. */
            PyObject *exc_type, *exc_value, *exc_tb;
            PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
            PyObject *r = PyObject_CallMethod(body, "release", NULL);
            if (r == NULL)
                PyErr_Clear();
            Py_XDECREF(r);
            PyErr_Restore(exc_type, exc_value, exc_tb);
        }
        Py_DECREF(body);
    }
    store_release(&hdr[W_TAIL], tail + RECORD_SIZE + (((uint64_t)n + 15) & ~(uint64_t)15));
    /* Where the consumer runs, for a producer that wonders whether they share a core (vDSO call,
     * and a store to a line this side writes anyway, only when it changed). */
    int cpu = sched_getcpu();
    if (cpu >= 0 && load_relaxed(&hdr[W_CONSUMER_CPU]) != (uint64_t)cpu + 1)
        __atomic_store_n(&hdr[W_CONSUMER_CPU], (uint64_t)cpu + 1, __ATOMIC_RELAXED);
    /* No fence (as ring.py): a producer whose WAITING flag this misses is woken by the next read
     * or by wake_waiting_producer(), which every consumer runs, fenced, before it sleeps. */
    if (load_relaxed(&hdr[W_PRODUCER_WAITING]))
        notify(self->producer_wake_fd);
    if (value == NULL)
        return NULL;
    PyObject *frame = PyTuple_New(3);
    if (frame == NULL) {
        Py_DECREF(value);
        return NULL;
    }
    PyTuple_SET_ITEM(frame, 0, PyLong_FromLong(kind));
    PyTuple_SET_ITEM(frame, 1, PyLong_FromUnsignedLongLong(call_id));
    PyTuple_SET_ITEM(frame, 2, value);
    if (PyTuple_GET_ITEM(frame, 0) == NULL || PyTuple_GET_ITEM(frame, 1) == NULL) {
        Py_DECREF(frame);
        return NULL;
    }
    return frame;
}

PyDoc_STRVAR(spin_until_doc,
             "spin_until(until_ns, yield_after_ns) -> int\n\n"
             "Spin while this ring is empty: 1 once a record is readable, 0 at until_ns, 2 at\n"
             "yield_after_ns (the caller yields the CPU and spins again). Times are\n"
             "time.perf_counter_ns() values.");

/* Spin while the ring is empty: 1 readable, 0 at until, 2 at yield_after. */
static int spin_wait(FastRing *self, int64_t until, int64_t yield_after)
{
    uint64_t *hdr = self->hdr;
    uint64_t tail = load_relaxed(&hdr[W_TAIL]);
    unsigned spins = 0;
    while (load_acquire(&hdr[W_HEAD]) == tail) {
        CPU_RELAX();
        if (!(++spins & 31)) {
            int64_t now = now_ns();
            if (now >= until)
                return 0;
            if (now >= yield_after)
                return 2;
        }
    }
    return 1;
}

static PyObject *FastRing_spin_until(FastRing *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (begin(self, nargs, 2, "spin_until(until_ns, yield_after_ns)") < 0)
        return NULL;
    long long until = PyLong_AsLongLong(args[0]);
    long long yield_after = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromLong(spin_wait(self, until, yield_after));
}

static PyTypeObject FastRingType;

PyDoc_STRVAR(call_doc,
             "call(responses, kind, call_id, body, decode, spin_ns, pure_ns, deadline_ns)\n\n"
             "One round trip's common case, on the request ring: publish an inline request, spin\n"
             "on the responses ring (at most spin_ns, and not past deadline_ns), consume one\n"
             "response. Returns its frame (kind, call_id, value): check the id. Or an int:\n"
             "-1 nothing was sent (no space or not inline: use the general path), 0 sent but the\n"
             "spin budget ran out, 2 sent and pure_ns passed (yield the CPU, then wait as usual).");

static PyObject *FastRing_call(FastRing *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (begin(self, nargs, 8,
              "call(responses, kind, call_id, body, decode, spin_ns, pure_ns, deadline_ns)") < 0)
        return NULL;
    if (Py_TYPE(args[0]) != &FastRingType) {
        PyErr_SetString(PyExc_TypeError, "responses must be a FastRing");
        return NULL;
    }
    FastRing *responses = (FastRing *)args[0];
    if (released(responses))
        return NULL;
    unsigned long kind;
    unsigned long long call_id;
    if (parse_kind_id(args[1], args[2], &kind, &call_id) < 0)
        return NULL;
    long long spin_ns = PyLong_AsLongLong(args[5]);
    long long pure_ns = PyLong_AsLongLong(args[6]);
    long long deadline = PyLong_AsLongLong(args[7]);
    if (PyErr_Occurred())
        return NULL;
    int done = write_fast(self, kind, call_id, args[3]);
    if (done < 0)
        return NULL;
    if (!done)
        return PyLong_FromLong(-1);
    int64_t now = now_ns();
    int64_t until = now + spin_ns < deadline ? now + spin_ns : deadline;
    int outcome = spin_wait(responses, until, now + pure_ns);
    if (outcome != 1)
        return PyLong_FromLong(outcome);
    return FastRing_try_read(responses, args[4]);
}

PyDoc_STRVAR(spin_read_doc,
             "spin_read(until_ns, yield_after_ns, decode) -> frame | int\n\n"
             "spin_until() then try_read() in one call: the frame (kind, call_id, value) once a\n"
             "record came, else 0 (until_ns) or 2 (yield_after_ns) as spin_until().");

static PyObject *FastRing_spin_read(FastRing *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (begin(self, nargs, 3, "spin_read(until_ns, yield_after_ns, decode)") < 0)
        return NULL;
    long long until = PyLong_AsLongLong(args[0]);
    long long yield_after = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    int outcome = spin_wait(self, until, yield_after);
    if (outcome != 1)
        return PyLong_FromLong(outcome);
    return FastRing_try_read(self, args[2]);
}

PyDoc_STRVAR(release_doc, "release()\n\nDrop the buffer and the callbacks (idempotent).");

static PyObject *FastRing_release(FastRing *self, PyObject *Py_UNUSED(ignored))
{
    FastRing_clear(self);
    Py_RETURN_NONE;
}

static PyMethodDef FastRing_methods[] = {
    {"try_write", (PyCFunction)(void (*)(void))FastRing_try_write, METH_FASTCALL, try_write_doc},
    {"try_read", (PyCFunction)FastRing_try_read, METH_O, try_read_doc},
    {"spin_until", (PyCFunction)(void (*)(void))FastRing_spin_until, METH_FASTCALL, spin_until_doc},
    {"call", (PyCFunction)(void (*)(void))FastRing_call, METH_FASTCALL, call_doc},
    {"spin_read", (PyCFunction)(void (*)(void))FastRing_spin_read, METH_FASTCALL, spin_read_doc},
    {"release", (PyCFunction)FastRing_release, METH_NOARGS, release_doc},
    {NULL, NULL, 0, NULL},
};

static PyObject *current_cpu(PyObject *Py_UNUSED(module), PyObject *Py_UNUSED(ignored))
{
    return PyLong_FromLong(sched_getcpu());
}

static PyMethodDef module_methods[] = {
    {"current_cpu", current_cpu, METH_NOARGS,
     PyDoc_STR("current_cpu() -> int\n\nThe CPU this thread runs on now (sched_getcpu; -1 if unknown).")},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FastRingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dsec_sdk.ipc._fastring.FastRing",
    .tp_doc = PyDoc_STR("The C hot path of one ring direction (see ring.py for the layout)."),
    .tp_basicsize = sizeof(FastRing),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FastRing_init,
    .tp_dealloc = (destructor)FastRing_dealloc,
    .tp_traverse = (traverseproc)FastRing_traverse,
    .tp_clear = (inquiry)FastRing_clear,
    .tp_methods = FastRing_methods,
};

static struct PyModuleDef fastring_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dsec_sdk.ipc._fastring",
    .m_doc = "C hot path of the DSec shared-memory rings (optional; ring.py works without it).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__fastring(void)
{
    if (PyType_Ready(&FastRingType) < 0)
        return NULL;
    PyObject *module = PyModule_Create(&fastring_module);
    if (module == NULL)
        return NULL;
    Py_INCREF(&FastRingType);
    if (PyModule_AddObject(module, "FastRing", (PyObject *)&FastRingType) < 0) {
        Py_DECREF(&FastRingType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
