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
#include <structmember.h>
#include <errno.h>
#include <math.h>
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
    /* Not view.obj: the buffer's exporter (a slice of the channel's mapping) is owned through
     * the view, and handing it to the collector let it clear the mapping under a live ring. */
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
             "afterwards if decode kept it). The record is consumed even when decode raises.\n"
             "decode must copy what it keeps: a slice of the body would still see ring memory\n"
             "the peer reuses (msgspec's decoders copy).");

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

/* ------------------------------------------------------------------------------------------ */
/* FastCaller: a caller channel's whole common-case tool call in one C call.
 *
 * DSecClient.call_tool spent more of a ~3 us call in Python bytecode around the ring (the lock,
 * the timeout, the request list, the id, the checks of the outcome) than in the rings and the
 * codec together. Here all of it runs in C, calling the same msgspec encoder and decoder and the
 * same ring paths as above. Anything but the common case returns a status tuple and client.py's
 * _SyncChannel.resume() goes on from there in Python, exactly as before.
 *
 * Mutual exclusion: the channel's threading.Lock, taken without blocking (the GIL is held for the
 * whole of this call, so no other thread runs in between; one that holds the lock is in the
 * Python path, and this call leaves it the channel: CALL_BUSY). When the answer did not come
 * while spinning, the call returns CALL_HELD with the lock still held, and the Python path
 * that goes on waiting releases it.
 */
#define CALL_BUSY 0        /* (0,): nothing done, the lock not taken: use the Python path */
#define CALL_HELD 1        /* (1, outcome, call_id, body, deadline_ns): lock held, go on */
#define CALL_UNENCODABLE 2 /* (2,): the request could not be encoded; nothing sent */
#define CALL_TOO_LARGE 3   /* (3, size): the request is over max_payload; nothing sent */
#define CALL_CLOSED 4      /* (4,): the channel was closed; nothing sent */
#define CALL_UNDECODABLE 5 /* (5, exception): the answer could not be decoded */
#define NO_DEADLINE ((int64_t)1 << 62)
#define KIND_REQUEST 1
#define KIND_RESULT 2

typedef struct {
    PyObject_HEAD
    FastRing *requests;
    FastRing *responses;
    PyObject *pack;    /* bytes = pack([tool, arguments, timeout_ms]) */
    PyObject *unpack;  /* value = unpack(memoryview) */
    PyObject *acquire; /* the channel lock's acquire / release */
    PyObject *release;
    PyObject *spin;    /* channel.Spin: settled, budget_ns, pure_ns */
    long long max_payload;
    long long settled_budget_ns; /* a settled Spin's budget_ns (its max_ns) */
    long long settled_pure_ns;   /* and pure_ns (PURE_SPIN_NS) */
    unsigned long long next_id;
    double last_timeout; /* the last timeout seen and its parts: calls repeat the same one */
    long long last_ms;
    long long last_ns;
    int have_last;
    int holding;           /* a CALL_HELD call left the lock held ... */
    unsigned long holder;  /* ... in this thread (PyThread_get_thread_ident) ... */
    PyObject *holder_frame; /* ... for the Python frame that made it (a strong reference) */
    int owned;             /* this caller took the lock and has not released it ... */
    unsigned long owner;   /* ... in this thread */
} FastCaller;

static PyObject *str_settled, *str_budget_ns, *str_pure_ns;

static int FastCaller_init(FastCaller *self, PyObject *args, PyObject *kwds)
{
    if (self->requests != NULL) { /* its calls hold the rings borrowed across Python code */
        PyErr_SetString(PyExc_RuntimeError, "FastCaller is already initialised");
        return -1;
    }
    static char *kwlist[] = {"requests", "responses", "pack", "unpack", "lock", "spin",
                             "max_payload", "settled_budget_ns", "settled_pure_ns", NULL};
    PyObject *requests, *responses, *pack, *unpack, *lock, *spin;
    long long max_payload, budget, pure;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!OOOOLLL", kwlist, &FastRingType, &requests,
                                     &FastRingType, &responses, &pack, &unpack, &lock, &spin,
                                     &max_payload, &budget, &pure))
        return -1;
    if (!PyCallable_Check(pack) || !PyCallable_Check(unpack)) {
        PyErr_SetString(PyExc_TypeError, "pack and unpack must be callable");
        return -1;
    }
    if (max_payload < 0 || budget < 0 || pure < 0) {
        PyErr_SetString(PyExc_ValueError, "max_payload and the spin times must be >= 0");
        return -1;
    }
    PyObject *acquire = PyObject_GetAttrString(lock, "acquire");
    PyObject *release = acquire ? PyObject_GetAttrString(lock, "release") : NULL;
    if (release == NULL) {
        Py_XDECREF(acquire);
        return -1;
    }
    Py_INCREF(requests);
    Py_XSETREF(self->requests, (FastRing *)requests);
    Py_INCREF(responses);
    Py_XSETREF(self->responses, (FastRing *)responses);
    Py_INCREF(pack);
    Py_XSETREF(self->pack, pack);
    Py_INCREF(unpack);
    Py_XSETREF(self->unpack, unpack);
    Py_XSETREF(self->acquire, acquire);
    Py_XSETREF(self->release, release);
    Py_INCREF(spin);
    Py_XSETREF(self->spin, spin);
    self->max_payload = max_payload;
    self->settled_budget_ns = budget;
    self->settled_pure_ns = pure;
    if (self->next_id == 0)
        self->next_id = 1;
    self->have_last = 0;
    return 0;
}

static int FastCaller_traverse(FastCaller *self, visitproc visit, void *arg)
{
    Py_VISIT(self->requests);
    Py_VISIT(self->responses);
    Py_VISIT(self->pack);
    Py_VISIT(self->unpack);
    Py_VISIT(self->acquire);
    Py_VISIT(self->release);
    Py_VISIT(self->spin);
    Py_VISIT(self->holder_frame);
    return 0;
}

static int FastCaller_clear(FastCaller *self)
{
    Py_CLEAR(self->holder_frame);
    Py_CLEAR(self->requests);
    Py_CLEAR(self->responses);
    Py_CLEAR(self->pack);
    Py_CLEAR(self->unpack);
    Py_CLEAR(self->acquire);
    Py_CLEAR(self->release);
    Py_CLEAR(self->spin);
    return 0;
}

static void FastCaller_dealloc(FastCaller *self)
{
    PyObject_GC_UnTrack(self);
    FastCaller_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Release the channel lock; returns result, or NULL (result dropped) if releasing failed. */
static PyObject *unlock_and(FastCaller *self, PyObject *result)
{
    PyObject *exc_type, *exc_value, *exc_tb;
    PyErr_Fetch(&exc_type, &exc_value, &exc_tb); /* a pending error survives the release */
    self->owned = 0;
    PyObject *r = PyObject_CallNoArgs(self->release);
    if (r == NULL) {
        Py_XDECREF(exc_type);
        Py_XDECREF(exc_value);
        Py_XDECREF(exc_tb);
        Py_XDECREF(result);
        return NULL;
    }
    Py_DECREF(r);
    PyErr_Restore(exc_type, exc_value, exc_tb);
    return result;
}

static PyObject *status1(int code) { return Py_BuildValue("(i)", code); }

/* The deadline of a call with this timeout (None: none); 0 when the Python path must decide
 * (not a plain number, not finite, too large for nanoseconds): it raises as it always did. */
static int call_deadline(FastCaller *self, PyObject *timeout, long long *ms, int64_t *deadline)
{
    if (timeout == Py_None) {
        *ms = 0;
        *deadline = NO_DEADLINE;
        return 1;
    }
    double t;
    if (PyFloat_CheckExact(timeout))
        t = PyFloat_AS_DOUBLE(timeout);
    else if (PyLong_CheckExact(timeout)) {
        t = PyLong_AsDouble(timeout);
        if (t == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0;
        }
    } else
        return 0;
    if (!isfinite(t) || fabs(t) > 9e9)
        return 0;
    if (!self->have_last || t != self->last_timeout) {
        /* As Python's max(1, int(t * 1000)) and int(t * 1e9): truncated toward zero. */
        long long m = (long long)(t * 1000.0);
        self->last_ms = m < 1 ? 1 : m;
        self->last_ns = (long long)(t * 1e9);
        self->last_timeout = t;
        self->have_last = 1;
    }
    *ms = self->last_ms;
    *deadline = now_ns() + self->last_ns;
    return 1;
}

/* CALL_HELD's status (steals outcome); the lock stays held, unless building it failed. */
static PyObject *held(FastCaller *self, PyObject *outcome, unsigned long long call_id,
                      PyObject *body, int64_t deadline)
{
    if (outcome == NULL)
        return unlock_and(self, NULL);
    PyObject *status = Py_BuildValue("(iNKOL)", CALL_HELD, outcome, call_id, body,
                                     (long long)deadline);
    if (status == NULL)
        return unlock_and(self, NULL);
    self->holding = 1;
    self->holder = PyThread_get_thread_ident();
    Py_XSETREF(self->holder_frame, Py_XNewRef((PyObject *)PyEval_GetFrame()));
    return status;
}

/* Whether the running Python code may release what the held call holds: the frame that made
 * the call, one it called (client.py's resume()) or the one that called it (a wrapper around
 * call()). Not a call nested above it in the same thread (a signal handler's call on this
 * channel, which found the lock taken): if that one is interrupted, the outer call's lock is
 * not its to release. */
static int held_here(FastCaller *self)
{
    PyObject *holder = self->holder_frame;
    if (holder == NULL) /* held from C code with no Python frame: the thread's to release */
        return 1;
    PyFrameObject *frame = PyEval_GetFrame();
    if (frame == NULL)
        return 0;
    if ((PyObject *)frame == holder)
        return 1;
    Py_INCREF(holder); /* PyFrame_GetBack may allocate, and so collect */
    PyFrameObject *back = PyFrame_GetBack(frame);
    int mine = (PyObject *)back == holder;
    Py_XDECREF(back);
    if (!mine) {
        back = PyFrame_GetBack((PyFrameObject *)holder);
        mine = (PyObject *)back == (PyObject *)frame;
        Py_XDECREF(back);
    }
    Py_DECREF(holder);
    PyErr_Clear(); /* (out of memory making a frame object: not the caller's) */
    return mine;
}

PyDoc_STRVAR(release_held_doc,
             "release_held() -> bool\n\n"
             "Release the channel lock a CALL_HELD call left held: True if it did, False if\n"
             "there was none (a no-op, so every way out of a call may run it). Only the thread\n"
             "and the Python frame that made that call, or a function it called, release it:\n"
             "a call nested above it (from a signal handler) never releases the outer one's.");

static PyObject *FastCaller_release_held(FastCaller *self, PyObject *Py_UNUSED(ignored))
{
    if (!self->holding || self->holder != PyThread_get_thread_ident() || !held_here(self))
        Py_RETURN_FALSE;
    self->holding = 0;
    /* The lock first: dropping the frame may run finalizers, which may call on this channel. */
    PyObject *done = unlock_and(self, Py_NewRef(Py_True));
    Py_CLEAR(self->holder_frame);
    return done;
}

PyDoc_STRVAR(held_by_this_thread_doc,
             "held_by_this_thread() -> bool\n\n"
             "Whether a call of this thread through this caller holds the channel lock now (a\n"
             "CALL_HELD call, or one whose encoder or decoder runs Python code): a call made on\n"
             "this channel from above it (a signal handler) would wait for itself for ever.");

static PyObject *FastCaller_held_by_this_thread(FastCaller *self, PyObject *Py_UNUSED(ignored))
{
    return PyBool_FromLong(self->owned && self->owner == PyThread_get_thread_ident());
}

PyDoc_STRVAR(caller_call_doc,
             "call(tool, arguments, timeout) -> value | status tuple\n\n"
             "One tool call's common case: the request [tool, arguments, timeout_ms] encoded,\n"
             "published, the answer awaited spinning and decoded. Returns the tool's result (never\n"
             "a tuple: the decoder makes lists), or a status tuple client.py goes on from:\n"
             "(0,) busy, (1, outcome, call_id, body, deadline_ns) with the lock still held,\n"
             "(2,) unencodable, (3, size) too large, (4,) closed, (5, exception) undecodable.");

static PyObject *FastCaller_call(FastCaller *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "call(tool, arguments, timeout) takes 3 arguments");
        return NULL;
    }
    if (self->requests == NULL) {
        PyErr_SetString(PyExc_ValueError, "FastCaller is not initialised");
        return NULL;
    }
    long long timeout_ms;
    int64_t deadline;
    if (!call_deadline(self, args[2], &timeout_ms, &deadline))
        return status1(CALL_BUSY);
    PyObject *got = PyObject_CallOneArg(self->acquire, Py_False);
    if (got == NULL)
        return NULL;
    int locked = got == Py_True;
    Py_DECREF(got);
    if (!locked)
        return status1(CALL_BUSY);
    /* The lock is held: every way out below releases it, but CALL_HELD. Marked as this
     * thread's until released: the encoder or decoder may run Python code (hooks), and a
     * signal handler there that calls on this channel must be refused, not wait for ever. */
    self->owned = 1;
    self->owner = PyThread_get_thread_ident();
    FastRing *requests = self->requests, *responses = self->responses;
    PyObject *frame_list = PyList_New(3);
    if (frame_list == NULL)
        return unlock_and(self, NULL);
    PyObject *ms = PyLong_FromLongLong(timeout_ms);
    if (ms == NULL) {
        Py_DECREF(frame_list);
        return unlock_and(self, NULL);
    }
    Py_INCREF(args[0]);
    PyList_SET_ITEM(frame_list, 0, args[0]);
    Py_INCREF(args[1]);
    PyList_SET_ITEM(frame_list, 1, args[1]);
    PyList_SET_ITEM(frame_list, 2, ms);
    PyObject *body = PyObject_CallOneArg(self->pack, frame_list);
    Py_DECREF(frame_list);
    if (body == NULL) {
        if (PyErr_ExceptionMatches(PyExc_TypeError) || PyErr_ExceptionMatches(PyExc_ValueError) ||
            PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            return unlock_and(self, status1(CALL_UNENCODABLE));
        }
        return unlock_and(self, NULL);
    }
    if (!PyBytes_CheckExact(body)) {
        Py_DECREF(body);
        PyErr_SetString(PyExc_TypeError, "pack must return bytes");
        return unlock_and(self, NULL);
    }
    Py_ssize_t size = PyBytes_GET_SIZE(body);
    if (size > self->max_payload) {
        Py_DECREF(body);
        return unlock_and(self, Py_BuildValue("(in)", CALL_TOO_LARGE, size));
    }
    /* Closed (checked after the encoding, as the Python path: its errors come first). */
    if (!requests->has_view || !responses->has_view) {
        Py_DECREF(body);
        return unlock_and(self, status1(CALL_CLOSED));
    }
    unsigned long long call_id = self->next_id++;
    /* The spin: a settled Spin has its full budget (hit() would change nothing). */
    long long budget = self->settled_budget_ns, pure = self->settled_pure_ns;
    PyObject *flag = PyObject_GetAttr(self->spin, str_settled);
    int settled = flag == NULL ? -1 : PyObject_IsTrue(flag);
    Py_XDECREF(flag);
    if (settled < 0) {
        Py_DECREF(body);
        return unlock_and(self, NULL);
    }
    if (!settled) {
        PyObject *b = PyObject_GetAttr(self->spin, str_budget_ns);
        PyObject *p = b ? PyObject_GetAttr(self->spin, str_pure_ns) : NULL;
        budget = b ? PyLong_AsLongLong(b) : -1;
        pure = p ? PyLong_AsLongLong(p) : -1;
        Py_XDECREF(b);
        Py_XDECREF(p);
        if (PyErr_Occurred()) {
            Py_DECREF(body);
            return unlock_and(self, NULL);
        }
    }
    int done = write_fast(requests, KIND_REQUEST, call_id, body);
    if (done < 0) {
        Py_DECREF(body);
        return unlock_and(self, NULL);
    }
    PyObject *status;
    if (!done) { /* not written here (a wrap, a full ring): the Python path sends it */
        status = held(self, PyLong_FromLong(-1), call_id, body, deadline);
        Py_DECREF(body);
        return status;
    }
    int64_t now = now_ns();
    int64_t until = now + budget < deadline ? now + budget : deadline;
    int outcome = spin_wait(responses, until, now + pure);
    if (outcome != 1) {
        status = held(self, PyLong_FromLong(outcome), call_id, body, deadline);
        Py_DECREF(body);
        return status;
    }
    PyObject *frame = FastRing_try_read(responses, self->unpack);
    if (frame == NULL) {
        Py_DECREF(body);
        if (PyErr_ExceptionMatches(PyExc_ValueError) ||
            PyErr_ExceptionMatches(PyExc_RecursionError)) {
            PyObject *exc_type, *exc_value, *exc_tb;
            PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
            PyErr_NormalizeException(&exc_type, &exc_value, &exc_tb);
            if (exc_tb != NULL)
                PyException_SetTraceback(exc_value, exc_tb);
            Py_XDECREF(exc_type);
            Py_XDECREF(exc_tb);
            return unlock_and(self, Py_BuildValue("(iN)", CALL_UNDECODABLE, exc_value));
        }
        return unlock_and(self, NULL);
    }
    if (settled && PyTuple_CheckExact(frame) && PyTuple_GET_SIZE(frame) == 3 &&
        PyLong_AsLong(PyTuple_GET_ITEM(frame, 0)) == KIND_RESULT &&
        PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(frame, 1)) == call_id) {
        PyObject *value = PyTuple_GET_ITEM(frame, 2);
        Py_INCREF(value);
        Py_DECREF(frame);
        Py_DECREF(body);
        return unlock_and(self, value);
    }
    PyErr_Clear(); /* (an id that did not fit: not ours) */
    status = held(self, frame, call_id, body, deadline);
    Py_DECREF(body);
    return status;
}

static PyMethodDef FastCaller_methods[] = {
    {"call", (PyCFunction)(void (*)(void))FastCaller_call, METH_FASTCALL, caller_call_doc},
    {"release_held", (PyCFunction)FastCaller_release_held, METH_NOARGS, release_held_doc},
    {"held_by_this_thread", (PyCFunction)FastCaller_held_by_this_thread, METH_NOARGS,
     held_by_this_thread_doc},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef FastCaller_members[] = {
    {"next_id", T_ULONGLONG, offsetof(FastCaller, next_id), 0,
     "The id of the next call on this channel (the Python path takes its ids here too)."},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject FastCallerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dsec_sdk.ipc._fastring.FastCaller",
    .tp_doc = PyDoc_STR("A caller channel's common-case tool call in C (see client.py)."),
    .tp_basicsize = sizeof(FastCaller),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FastCaller_init,
    .tp_dealloc = (destructor)FastCaller_dealloc,
    .tp_traverse = (traverseproc)FastCaller_traverse,
    .tp_clear = (inquiry)FastCaller_clear,
    .tp_methods = FastCaller_methods,
    .tp_members = FastCaller_members,
};

/* ------------------------------------------------------------------------------------------ */
/* FastServer: a serving loop's common case in C: spin for a request, read and decode it, call
 * the tool (a plain function registered for its name), encode the result, publish it. Anything
 * else (another shape of request, a tool that raised or is async, a result that will not encode
 * or fit, a full ring) returns where it stopped, and server.py goes on in Python as before. */
#define SERVE_REQUEST 0 /* (0, call_id, request): dispatch it in Python */
#define SERVE_RAISED 1  /* (1, call_id, exception): the tool raised it; answer the error */
#define SERVE_RESULT 2  /* (2, call_id, result): encode it in Python (it failed, or too large) */
#define SERVE_BODY 3    /* (3, call_id, body): the encoded result, not written: write it */

typedef struct {
    PyObject_HEAD
    FastRing *requests;
    FastRing *responses;
    PyObject *decode;      /* body -> request, None when undecodable (see lenient()) */
    PyObject *tools;       /* dict: name -> function */
    PyObject *async_tools; /* set: the names whose function is async */
    PyObject *pack;
    long long max_payload;
} FastServer;

static PyObject *empty_args;

static int FastServer_init(FastServer *self, PyObject *args, PyObject *kwds)
{
    if (self->requests != NULL) { /* its calls hold the rings borrowed across Python code */
        PyErr_SetString(PyExc_RuntimeError, "FastServer is already initialised");
        return -1;
    }
    static char *kwlist[] = {"requests", "responses", "decode", "tools", "async_tools", "pack",
                             "max_payload", NULL};
    PyObject *requests, *responses, *decode, *tools, *async_tools, *pack;
    long long max_payload;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!O!OO!O!OL", kwlist, &FastRingType, &requests,
                                     &FastRingType, &responses, &decode, &PyDict_Type, &tools,
                                     &PySet_Type, &async_tools, &pack, &max_payload))
        return -1;
    if (!PyCallable_Check(decode) || !PyCallable_Check(pack)) {
        PyErr_SetString(PyExc_TypeError, "decode and pack must be callable");
        return -1;
    }
    Py_INCREF(requests);
    Py_XSETREF(self->requests, (FastRing *)requests);
    Py_INCREF(responses);
    Py_XSETREF(self->responses, (FastRing *)responses);
    Py_INCREF(decode);
    Py_XSETREF(self->decode, decode);
    Py_INCREF(tools);
    Py_XSETREF(self->tools, tools);
    Py_INCREF(async_tools);
    Py_XSETREF(self->async_tools, async_tools);
    Py_INCREF(pack);
    Py_XSETREF(self->pack, pack);
    self->max_payload = max_payload;
    return 0;
}

static int FastServer_traverse(FastServer *self, visitproc visit, void *arg)
{
    Py_VISIT(self->requests);
    Py_VISIT(self->responses);
    Py_VISIT(self->decode);
    Py_VISIT(self->tools);
    Py_VISIT(self->async_tools);
    Py_VISIT(self->pack);
    return 0;
}

static int FastServer_clear(FastServer *self)
{
    Py_CLEAR(self->requests);
    Py_CLEAR(self->responses);
    Py_CLEAR(self->decode);
    Py_CLEAR(self->tools);
    Py_CLEAR(self->async_tools);
    Py_CLEAR(self->pack);
    return 0;
}

static void FastServer_dealloc(FastServer *self)
{
    PyObject_GC_UnTrack(self);
    FastServer_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* (stage, call_id, value); steals value. */
static PyObject *stopped_at(int stage, PyObject *call_id, PyObject *value)
{
    if (value == NULL)
        return NULL;
    return Py_BuildValue("(iON)", stage, call_id, value);
}

PyDoc_STRVAR(serve_doc,
             "serve(until_ns, yield_after_ns) -> int | (stage, call_id, value)\n\n"
             "Spin for one request and answer it: 1 once answered; 0 or 2 as spin_until() when\n"
             "none came; or where it stopped: (0, id, request) dispatch it, (1, id, exception)\n"
             "the tool raised, (2, id, result) encode it, (3, id, body) write it.");

static PyObject *FastServer_serve(FastServer *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "serve(until_ns, yield_after_ns) takes 2 arguments");
        return NULL;
    }
    if (self->requests == NULL) {
        PyErr_SetString(PyExc_ValueError, "FastServer is not initialised");
        return NULL;
    }
    FastRing *requests = self->requests, *responses = self->responses;
    if (released(requests) || released(responses))
        return NULL;
    long long until = PyLong_AsLongLong(args[0]);
    long long yield_after = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred())
        return NULL;
    int outcome = spin_wait(requests, until, yield_after);
    if (outcome != 1)
        return PyLong_FromLong(outcome);
    PyObject *frame = FastRing_try_read(requests, self->decode);
    if (frame == NULL) /* ProtocolError: server.py drops the peer */
        return NULL;
    if (frame == Py_None) { /* empty again: only a peer that moved HEAD back does that */
        Py_DECREF(frame);
        return PyLong_FromLong(2);
    }
    if (!PyTuple_CheckExact(frame) || PyTuple_GET_SIZE(frame) != 3) {
        Py_DECREF(frame);
        PyErr_SetString(PyExc_TypeError, "a ring read returned something else than a frame");
        return NULL;
    }
    PyObject *call_id = PyTuple_GET_ITEM(frame, 1);
    PyObject *request = PyTuple_GET_ITEM(frame, 2);
    PyObject *result = NULL;
    if (!PyList_CheckExact(request) || PyList_GET_SIZE(request) != 3)
        goto in_python;
    PyObject *name = PyList_GET_ITEM(request, 0);
    PyObject *arguments = PyList_GET_ITEM(request, 1);
    if (!PyUnicode_CheckExact(name) || !PyDict_CheckExact(arguments))
        goto in_python;
    PyObject *function = PyDict_GetItemWithError(self->tools, name);
    if (function == NULL) {
        if (PyErr_Occurred()) {
            Py_DECREF(frame);
            return NULL;
        }
        goto in_python; /* not a tool of this agent: server.py says which are */
    }
    Py_INCREF(function); /* borrowed from the dict: ours before anything else runs */
    int is_async = PySet_Contains(self->async_tools, name);
    if (is_async) {
        Py_DECREF(function);
        if (is_async < 0) {
            Py_DECREF(frame);
            return NULL;
        }
        goto in_python;
    }
    /* function(**arguments): keys that are not strings raise TypeError here, as there. */
    result = PyObject_Call(function, empty_args, arguments);
    Py_DECREF(function);
    if (result == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) { /* KeyboardInterrupt, SystemExit */
            Py_DECREF(frame);
            return NULL;
        }
        PyObject *exc_type, *exc_value, *exc_tb;
        PyErr_Fetch(&exc_type, &exc_value, &exc_tb);
        PyErr_NormalizeException(&exc_type, &exc_value, &exc_tb);
        if (exc_tb != NULL)
            PyException_SetTraceback(exc_value, exc_tb);
        Py_XDECREF(exc_type);
        Py_XDECREF(exc_tb);
        PyObject *status = stopped_at(SERVE_RAISED, call_id, exc_value);
        Py_DECREF(frame);
        return status;
    }
    PyObject *body = PyObject_CallOneArg(self->pack, result);
    if (body == NULL) {
        /* Whatever encoding raised (even the result's own code: a datetime whose utcoffset()
           raises) is the tool's error: server.py's finish() says so. Only what a tool must not
           swallow (KeyboardInterrupt, SystemExit) goes up. */
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            Py_DECREF(result);
            Py_DECREF(frame);
            return NULL;
        }
        PyErr_Clear();
        PyObject *status = stopped_at(SERVE_RESULT, call_id, result);
        Py_DECREF(frame);
        return status;
    }
    if (!PyBytes_CheckExact(body) || PyBytes_GET_SIZE(body) > self->max_payload) {
        Py_DECREF(body);
        PyObject *status = stopped_at(SERVE_RESULT, call_id, result);
        Py_DECREF(frame);
        return status;
    }
    Py_DECREF(result);
    if (!responses->has_view) { /* the tool closed this channel: server.py sees it closed */
        PyObject *status = stopped_at(SERVE_BODY, call_id, body);
        Py_DECREF(frame);
        return status;
    }
    unsigned long long id = PyLong_AsUnsignedLongLong(call_id);
    if (id == (unsigned long long)-1 && PyErr_Occurred()) {
        Py_DECREF(body);
        Py_DECREF(frame);
        return NULL;
    }
    int done = write_fast(responses, KIND_RESULT, id, body);
    if (done < 0) {
        Py_DECREF(body);
        Py_DECREF(frame);
        return NULL;
    }
    if (!done) {
        PyObject *status = stopped_at(SERVE_BODY, call_id, body);
        Py_DECREF(frame);
        return status;
    }
    Py_DECREF(body);
    Py_DECREF(frame);
    return PyLong_FromLong(1);
in_python:
    Py_INCREF(request);
    {
        PyObject *status = stopped_at(SERVE_REQUEST, call_id, request);
        Py_DECREF(frame);
        return status;
    }
}

static PyMethodDef FastServer_methods[] = {
    {"serve", (PyCFunction)(void (*)(void))FastServer_serve, METH_FASTCALL, serve_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject FastServerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dsec_sdk.ipc._fastring.FastServer",
    .tp_doc = PyDoc_STR("A served channel's common-case request in C (see runner.py)."),
    .tp_basicsize = sizeof(FastServer),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FastServer_init,
    .tp_dealloc = (destructor)FastServer_dealloc,
    .tp_traverse = (traverseproc)FastServer_traverse,
    .tp_clear = (inquiry)FastServer_clear,
    .tp_methods = FastServer_methods,
};

/* lenient(decode): decode, with an undecodable body (ValueError, RecursionError) read as None,
 * as server.py's decode_request, without a Python frame per request. */
static PyObject *lenient_decode(PyObject *decode, PyObject *body)
{
    PyObject *value = PyObject_CallOneArg(decode, body);
    if (value == NULL && (PyErr_ExceptionMatches(PyExc_ValueError) ||
                          PyErr_ExceptionMatches(PyExc_RecursionError))) {
        PyErr_Clear();
        Py_RETURN_NONE;
    }
    return value;
}

static PyMethodDef lenient_decode_def = {
    "lenient_decode", lenient_decode, METH_O,
    PyDoc_STR("lenient_decode(body) -> value | None (None: the body could not be decoded)")};

static PyObject *lenient(PyObject *Py_UNUSED(module), PyObject *decode)
{
    if (!PyCallable_Check(decode)) {
        PyErr_SetString(PyExc_TypeError, "decode must be callable");
        return NULL;
    }
    return PyCFunction_NewEx(&lenient_decode_def, decode, NULL);
}

static PyMethodDef module_methods[] = {
    {"lenient", lenient, METH_O,
     PyDoc_STR("lenient(decode) -> callable\n\ndecode, reading a body it cannot decode (ValueError, "
               "RecursionError) as None.")},
    {"current_cpu", current_cpu, METH_NOARGS,
     PyDoc_STR("current_cpu() -> int\n\nThe CPU this thread runs on now (sched_getcpu; -1 if unknown).")},
    {NULL, NULL, 0, NULL},
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
    if (PyType_Ready(&FastRingType) < 0 || PyType_Ready(&FastCallerType) < 0 ||
        PyType_Ready(&FastServerType) < 0)
        return NULL;
    empty_args = PyTuple_New(0);
    if (empty_args == NULL)
        return NULL;
    str_settled = PyUnicode_InternFromString("settled");
    str_budget_ns = PyUnicode_InternFromString("budget_ns");
    str_pure_ns = PyUnicode_InternFromString("pure_ns");
    if (str_settled == NULL || str_budget_ns == NULL || str_pure_ns == NULL)
        return NULL;
    PyObject *module = PyModule_Create(&fastring_module);
    if (module == NULL)
        return NULL;
    if (PyModule_AddType(module, &FastRingType) < 0 ||
        PyModule_AddType(module, &FastCallerType) < 0 ||
        PyModule_AddType(module, &FastServerType) < 0 ||
        PyModule_AddIntConstant(module, "CALL_BUSY", CALL_BUSY) < 0 ||
        PyModule_AddIntConstant(module, "CALL_HELD", CALL_HELD) < 0 ||
        PyModule_AddIntConstant(module, "CALL_UNENCODABLE", CALL_UNENCODABLE) < 0 ||
        PyModule_AddIntConstant(module, "CALL_TOO_LARGE", CALL_TOO_LARGE) < 0 ||
        PyModule_AddIntConstant(module, "CALL_CLOSED", CALL_CLOSED) < 0 ||
        PyModule_AddIntConstant(module, "CALL_UNDECODABLE", CALL_UNDECODABLE) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
