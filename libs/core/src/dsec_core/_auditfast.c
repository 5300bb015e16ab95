/*
 * dsec_core._auditfast: the audit verifier's common case, a batch at a time, in C.
 *
 * dsec_core.audit.Verifier.feed takes one event: a prologue (the stream sequence in order, the
 * report's first and last sequence), then Verifier._fast for the common event (an authorized
 * producer's next event in its chain, on a route already seen consistent), else the full path.
 * Of the ~5 us an event that costs on this project's 2-core machines, about a quarter was
 * CPython's bytecode around the decodes and lookups: this path takes it off (4.1 against
 * 5.1 us an event fed as `dsec audit verify`'s forked verifier is).
 *
 * run(verifier, batch, start) walks batch[start:] (a list of (seq, data) or (seq, data, digest)
 * tuples) and does, for each event, exactly what feed's prologue and _fast do when _fast takes
 * the event, with the same objects: the verifier's own dicts and sets, its chains' attributes,
 * the same msgspec decoders, the same envelope_hash. It stops, having changed nothing for that
 * event, at the first one _fast would not take or that it cannot judge the same way for sure
 * (any decode error, an authorization verdict not remembered yet, a sequence out of order, a
 * type it does not expect): the Python code feeds that one itself, by the same rules as always,
 * and calls run() again after it. It also stops after an event whose chain is due a signature
 * check (its pending list reached signature_every): the Python code settles the chain.
 *
 * Returns (index, status, chain): status 0 = the batch is done (or a finding already stands),
 * 1 = batch[index] is left to Verifier.feed, 2 = batch[index] was taken and `chain` is due its
 * signature check. Before it returns it writes back what it counted: the verifier's expected
 * sequence and the report's first_seq, last_seq, events and chains.
 *
 * libs/core/tests/test_audit_fast.py holds this path, the Python fast path and the full path to
 * identical reports on seeded logs of forged, replayed, reordered and re-encoded events.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <string.h>

enum { DONE = 0, DECLINED = 1, SETTLE = 2 };

/* What configure() was given (dsec_core.audit's own objects). */
static PyObject *decode_envelope, *decode_payload, *envelope_hash, *unverified_type;
static PyObject *slow_types, *placement_types, *sandbox_aggregate, *scheduled_type;
static PyObject *nodeagent_role, *signed_head;
static PyObject *one_int; /* 1 */

/* Interned attribute names. */
static PyObject *s_type, *s_aggregate_id, *s_aggregate, *s_subject, *s_key_id, *s_producer,
    *s_chain, *s_chain_seq, *s_prev, *s_id, *s_tenant, *s_causation_id, *s_payload, *s_role,
    *s_node_id, *s_next_seq, *s_last_hash, *s_pending, *s_report, *s_expected, *s_routes,
    *s_certs, *s_keys, *s_revoked, *s_chains, *s_seen, *s_refusals, *s_tenants, *s_nodes,
    *s_causes, *s_signature_every, *s_producers, *s_finding, *s_first_seq, *s_last_seq,
    *s_events, *s_chains_count;

/* The verifier's state, read once per run(). Borrowed from `verifier` (kept alive by it). */
typedef struct {
    PyObject *routes, *certs, *keys, *revoked, *chains, *seen, *refusals, *tenants, *nodes,
        *causes, *producers;
    Py_ssize_t signature_every;
} State;

/* One event's outcome. */
enum { TAKEN = 0, LEFT = 1, TAKEN_SETTLE = 2, FAILED = -1 };

/* 1 when a != b (Python's !=), 0 when equal, -1 on error. */
static int differ(PyObject *a, PyObject *b) {
    if (a == b) {
        return 0;
    }
    return PyObject_RichCompareBool(a, b, Py_NE);
}

/* A decoder's error: LEFT for an Exception (the Python path decides), FAILED for anything else
 * (KeyboardInterrupt, SystemExit, ...), as `except Exception` would. */
static int decode_failed(void) {
    if (PyErr_ExceptionMatches(PyExc_Exception)) {
        PyErr_Clear();
        return LEFT;
    }
    return FAILED;
}

/* The envelope's attributes this path reads (new references), NULL'd by release(). */
typedef struct {
    PyObject *type, *aggregate_id, *aggregate, *subject, *key_id, *producer, *chain_name,
        *chain_seq, *prev, *id, *tenant, *causation_id;
} Fields;

#define FIELD_COUNT 12

static void release(Fields *f) {
    PyObject **p = (PyObject **)f;
    for (int i = 0; i < FIELD_COUNT; i++) {
        Py_CLEAR(p[i]);
    }
}

static int read_fields(PyObject *envelope, Fields *f) {
    PyObject *names[FIELD_COUNT] = {s_type,     s_aggregate_id, s_aggregate, s_subject,
                                    s_key_id,   s_producer,     s_chain,     s_chain_seq,
                                    s_prev,     s_id,           s_tenant,    s_causation_id};
    PyObject **p = (PyObject **)f;
    for (int i = 0; i < FIELD_COUNT; i++) {
        p[i] = PyObject_GetAttr(envelope, names[i]);
        if (p[i] == NULL) {
            return -1;
        }
    }
    return 0;
}

/* The checks of Verifier._fast after the decode; TAKEN / TAKEN_SETTLE (state changed), LEFT
 * (nothing changed), FAILED (an exception is set). `*settle` gets the chain when due. */
static int judge(State *st, PyObject *seq, PyObject *data, PyObject *digest, Fields *e,
                 PyObject *payload, PyObject **settle) {
    int r, outcome = LEFT;
    PyObject *key = NULL, *route, *cert, *raw_key, *chain, *subject = NULL, *next_seq = NULL,
                           *last_hash = NULL, *node, *asked = NULL, *problem, *role = NULL,
                           *placed, *cert_node = NULL, *first, *before = NULL, *advanced = NULL,
                           *hash = NULL, *pending = NULL, *unverified = NULL;

    r = PySet_Contains(slow_types, e->type);
    if (r != 0) {
        return r < 0 ? FAILED : LEFT;
    }
    /* route = self._routes.get((type, aggregate_id)); route[0] != aggregate / route[1] != subject */
    key = PyTuple_Pack(2, e->type, e->aggregate_id);
    if (key == NULL) {
        return FAILED;
    }
    route = PyDict_GetItemWithError(st->routes, key);
    Py_CLEAR(key);
    if (route == NULL) {
        return PyErr_Occurred() ? FAILED : LEFT;
    }
    if (!PyTuple_CheckExact(route) || PyTuple_GET_SIZE(route) != 2) {
        return LEFT;
    }
    Py_INCREF(route);
    r = differ(PyTuple_GET_ITEM(route, 0), e->aggregate);
    if (r == 0) {
        r = differ(PyTuple_GET_ITEM(route, 1), e->subject);
    }
    Py_DECREF(route);
    if (r != 0) {
        return r < 0 ? FAILED : LEFT;
    }
    /* the key: certified, its raw key known, not revoked */
    cert = PyDict_GetItemWithError(st->certs, e->key_id);
    if (cert == NULL) {
        return PyErr_Occurred() ? FAILED : LEFT;
    }
    Py_INCREF(cert);
    raw_key = PyDict_GetItemWithError(st->keys, e->key_id);
    if (raw_key == NULL) {
        outcome = PyErr_Occurred() ? FAILED : LEFT;
        goto done_cert;
    }
    Py_INCREF(raw_key);
    r = PySet_Contains(st->revoked, e->key_id);
    if (r != 0) {
        outcome = r < 0 ? FAILED : LEFT;
        goto done_key;
    }
    /* the chain: known; the producer the certificate's subject; the next position; its prev */
    key = PyTuple_Pack(2, e->producer, e->chain_name);
    if (key == NULL) {
        outcome = FAILED;
        goto done_key;
    }
    chain = PyDict_GetItemWithError(st->chains, key);
    Py_CLEAR(key);
    if (chain == NULL) {
        outcome = PyErr_Occurred() ? FAILED : LEFT;
        goto done_key;
    }
    Py_INCREF(chain);
    outcome = FAILED; /* until a check below says otherwise */
    if ((subject = PyObject_GetAttr(cert, s_subject)) == NULL) {
        goto done;
    }
    if ((r = differ(e->producer, subject)) != 0) {
        outcome = r < 0 ? FAILED : LEFT;
        goto done;
    }
    if ((next_seq = PyObject_GetAttr(chain, s_next_seq)) == NULL) {
        goto done;
    }
    if ((r = differ(e->chain_seq, next_seq)) != 0) {
        outcome = r < 0 ? FAILED : LEFT;
        goto done;
    }
    if ((last_hash = PyObject_GetAttr(chain, s_last_hash)) == NULL) {
        goto done;
    }
    if ((r = differ(e->prev, last_hash)) != 0) {
        outcome = r < 0 ? FAILED : LEFT;
        goto done;
    }
    r = PyDict_Contains(st->seen, e->id);
    if (r != 0) {
        outcome = r < 0 ? FAILED : LEFT;
        goto done;
    }
    /* node = payload.get("node_id"): a str or None, else the full path */
    node = PyDict_GetItemWithError(payload, s_node_id);
    if (node == NULL) {
        if (PyErr_Occurred()) {
            goto done;
        }
        node = Py_None;
    }
    if (node != Py_None && !PyUnicode_CheckExact(node)) {
        outcome = LEFT;
        goto done;
    }
    Py_INCREF(node);
    /* the remembered authorization verdict: None (allowed) or the full path */
    asked = PyTuple_Pack(5, e->type, e->key_id, e->producer, e->tenant, node);
    if (asked == NULL) {
        goto done_node;
    }
    problem = PyDict_GetItemWithError(st->refusals, asked);
    Py_CLEAR(asked);
    if (problem == NULL) { /* not asked yet: _fast asks authz and remembers */
        outcome = PyErr_Occurred() ? FAILED : LEFT;
        goto done_node;
    }
    if (problem != Py_None) {
        outcome = LEFT;
        goto done_node;
    }
    /* a sandbox's event: the node it is placed on (a node agent's), its first tenant */
    r = PyObject_RichCompareBool(e->aggregate, sandbox_aggregate, Py_EQ);
    if (r < 0) {
        goto done_node;
    }
    if (r) {
        if ((role = PyObject_GetAttr(cert, s_role)) == NULL) {
            goto done_node;
        }
        r = PyObject_RichCompareBool(role, nodeagent_role, Py_EQ);
        if (r < 0) {
            goto done_node;
        }
        if (r) {
            placed = PyDict_GetItemWithError(st->nodes, e->aggregate_id);
            if (placed == NULL && PyErr_Occurred()) {
                goto done_node;
            }
            if (placed != NULL && placed != Py_None) {
                Py_INCREF(placed);
                cert_node = PyObject_GetAttr(cert, s_node_id);
                r = cert_node == NULL ? -1 : differ(placed, cert_node);
                Py_DECREF(placed);
                if (r != 0) {
                    outcome = r < 0 ? FAILED : LEFT;
                    goto done_node;
                }
            }
        }
        first = PyDict_GetItemWithError(st->tenants, e->aggregate_id);
        if (first == NULL && PyErr_Occurred()) {
            goto done_node;
        }
        if (first != NULL && first != Py_None) {
            if (!PyTuple_CheckExact(first) || PyTuple_GET_SIZE(first) != 2) {
                outcome = LEFT;
                goto done_node;
            }
            Py_INCREF(first);
            r = differ(PyTuple_GET_ITEM(first, 1), e->tenant);
            Py_DECREF(first);
            if (r != 0) {
                outcome = r < 0 ? FAILED : LEFT;
                goto done_node;
            }
        }
    }
    /* Taken: everything that can fail before the state changes is made first. */
    if ((before = PyTuple_Pack(2, next_seq, last_hash)) == NULL) {
        goto done_node;
    }
    if ((advanced = PyNumber_Add(next_seq, one_int)) == NULL) {
        goto done_node;
    }
    r = digest == NULL ? 0 : PyObject_IsTrue(digest); /* `digest or envelope_hash(data)` */
    if (r < 0) {
        goto done_node;
    }
    if (r) {
        hash = Py_NewRef(digest);
    } else if ((hash = PyObject_CallOneArg(envelope_hash, data)) == NULL) {
        goto done_node;
    }
    if ((pending = PyObject_GetAttr(chain, s_pending)) == NULL) {
        goto done_node;
    }
    if (!PyList_Check(pending)) {
        outcome = LEFT;
        goto done_node;
    }
    unverified = ((PyTypeObject *)unverified_type)->tp_alloc((PyTypeObject *)unverified_type, 4);
    if (unverified == NULL) {
        goto done_node;
    }
    PyTuple_SET_ITEM(unverified, 0, Py_NewRef(seq));
    PyTuple_SET_ITEM(unverified, 1, Py_NewRef(data));
    PyTuple_SET_ITEM(unverified, 2, Py_NewRef(raw_key));
    PyTuple_SET_ITEM(unverified, 3, Py_NewRef(before));
    /* _accept, from its "before" on (an error from here on is out of memory) */
    if (PyObject_SetAttr(chain, s_next_seq, advanced) < 0 ||
        PyObject_SetAttr(chain, s_last_hash, hash) < 0 ||
        PyDict_SetItem(st->seen, e->id, seq) < 0) {
        goto done_node;
    }
    if (e->causation_id != Py_None) { /* self._causes.setdefault(cause, seq) */
        r = PyDict_Contains(st->causes, e->causation_id);
        if (r < 0 || (r == 0 && PyDict_SetItem(st->causes, e->causation_id, seq) < 0)) {
            goto done_node;
        }
    }
    if (node != Py_None) {
        r = PySet_Contains(placement_types, e->type);
        if (r < 0) {
            goto done_node;
        }
        if (r) {
            r = PyObject_RichCompareBool(e->type, scheduled_type, Py_EQ);
            if (r == 0) {
                r = PyDict_Contains(st->nodes, e->aggregate_id);
                r = r < 0 ? -1 : !r;
            }
            if (r < 0 || (r && PyDict_SetItem(st->nodes, e->aggregate_id, node) < 0)) {
                goto done_node;
            }
        }
    }
    if (PyList_Append(pending, unverified) < 0 || PySet_Add(st->producers, e->producer) < 0) {
        goto done_node;
    }
    if (PyList_GET_SIZE(pending) >= st->signature_every) {
        *settle = Py_NewRef(chain);
        outcome = TAKEN_SETTLE;
    } else {
        outcome = TAKEN;
    }
done_node:
    Py_DECREF(node);
done:
    Py_XDECREF(subject);
    Py_XDECREF(next_seq);
    Py_XDECREF(last_hash);
    Py_XDECREF(asked);
    Py_XDECREF(role);
    Py_XDECREF(cert_node);
    Py_XDECREF(before);
    Py_XDECREF(advanced);
    Py_XDECREF(hash);
    Py_XDECREF(pending);
    Py_XDECREF(unverified);
    Py_DECREF(chain);
done_key:
    Py_DECREF(raw_key);
done_cert:
    Py_DECREF(cert);
    return outcome;
}

/* One event: the prologue's checks, the decodes, judge(). */
static int one(State *st, PyObject *item, int have_expected, long long expected, long long *seq_out,
               PyObject **settle) {
    PyObject *seq, *data, *digest = NULL, *envelope, *raw, *payload;
    const char *bytes;
    long long s;
    int overflow, outcome;
    Fields e;

    if (!PyTuple_CheckExact(item) ||
        (PyTuple_GET_SIZE(item) != 2 && PyTuple_GET_SIZE(item) != 3)) {
        return LEFT;
    }
    seq = PyTuple_GET_ITEM(item, 0);
    data = PyTuple_GET_ITEM(item, 1);
    if (PyTuple_GET_SIZE(item) == 3) {
        digest = PyTuple_GET_ITEM(item, 2);
    }
    if (!PyLong_CheckExact(seq) || !PyBytes_CheckExact(data)) {
        return LEFT;
    }
    s = PyLong_AsLongLongAndOverflow(seq, &overflow);
    if (overflow || (s == -1 && PyErr_Occurred()) || s == LLONG_MAX) { /* (s + 1 must fit) */
        PyErr_Clear();
        return LEFT;
    }
    if (have_expected && s != expected) {
        return LEFT; /* a gap: feed says so */
    }
    *seq_out = s; /* (from here on an error is raised after feed's prologue, as in Python) */
    bytes = PyBytes_AS_STRING(data);
    if (PyBytes_GET_SIZE(data) < PyBytes_GET_SIZE(signed_head) ||
        memcmp(bytes, PyBytes_AS_STRING(signed_head), PyBytes_GET_SIZE(signed_head)) != 0) {
        return LEFT;
    }
    envelope = PyObject_CallOneArg(decode_envelope, data);
    if (envelope == NULL) {
        return decode_failed();
    }
    raw = PyObject_GetAttr(envelope, s_payload);
    if (raw == NULL) {
        Py_DECREF(envelope);
        return FAILED;
    }
    payload = PyObject_CallOneArg(decode_payload, raw);
    Py_DECREF(raw);
    if (payload == NULL) {
        Py_DECREF(envelope);
        return decode_failed(); /* (a ValidationError: _fast tries MessagePack's decode) */
    }
    if (!PyDict_CheckExact(payload)) {
        Py_DECREF(payload);
        Py_DECREF(envelope);
        return LEFT;
    }
    memset(&e, 0, sizeof e);
    if (read_fields(envelope, &e) < 0) {
        outcome = FAILED;
    } else {
        outcome = judge(st, seq, data, digest, &e, payload, settle);
    }
    release(&e);
    Py_DECREF(payload);
    Py_DECREF(envelope);
    return outcome;
}

/* Borrowed attribute of `obj` of an exact type, into *out; -1 with TypeError otherwise. */
static int get_state(PyObject *obj, PyObject *name, PyTypeObject *type, PyObject *keep,
                     PyObject **out) {
    PyObject *value = PyObject_GetAttr(obj, name);
    if (value == NULL) {
        return -1;
    }
    if (Py_TYPE(value) != type) {
        PyErr_Format(PyExc_TypeError, "verifier state %R is a %s", name, Py_TYPE(value)->tp_name);
        Py_DECREF(value);
        return -1;
    }
    if (PyList_Append(keep, value) < 0) { /* held for the run */
        Py_DECREF(value);
        return -1;
    }
    Py_DECREF(value);
    *out = value;
    return 0;
}

/* Write back what the run counted (the verifier's expected sequence, the report's counters). */
static int write_back(PyObject *verifier, PyObject *report, PyObject *chains, long long first,
                      long long last, int seen, Py_ssize_t taken) {
    PyObject *value, *events, *sum;
    int r;
    if (!seen) { /* (no event's prologue) */
        return 0;
    }
    if ((value = PyLong_FromLongLong(last + 1)) == NULL) {
        return -1;
    }
    r = PyObject_SetAttr(verifier, s_expected, value);
    Py_DECREF(value);
    if (r < 0) {
        return -1;
    }
    if ((value = PyObject_GetAttr(report, s_first_seq)) == NULL) {
        return -1;
    }
    r = 0;
    if (value == Py_None) {
        PyObject *seq = PyLong_FromLongLong(first);
        r = seq == NULL ? -1 : PyObject_SetAttr(report, s_first_seq, seq);
        Py_XDECREF(seq);
    }
    Py_DECREF(value);
    if (r < 0 || (value = PyLong_FromLongLong(last)) == NULL) {
        return -1;
    }
    r = PyObject_SetAttr(report, s_last_seq, value);
    Py_DECREF(value);
    if (r < 0 || (events = PyObject_GetAttr(report, s_events)) == NULL) {
        return -1;
    }
    value = PyLong_FromSsize_t(taken);
    sum = value == NULL ? NULL : PyNumber_Add(events, value);
    Py_DECREF(events);
    Py_XDECREF(value);
    if (sum == NULL) {
        return -1;
    }
    r = PyObject_SetAttr(report, s_events, sum);
    Py_DECREF(sum);
    if (r < 0 || (value = PyLong_FromSsize_t(PyDict_GET_SIZE(chains))) == NULL) {
        return -1;
    }
    r = PyObject_SetAttr(report, s_chains_count, value);
    Py_DECREF(value);
    return r;
}

static PyObject *run(PyObject *module, PyObject *args) {
    PyObject *verifier, *batch, *keep = NULL, *report = NULL, *finding, *expected_obj,
                                *every = NULL, *settle = NULL, *result = NULL;
    Py_ssize_t start, i, n, taken = 0;
    long long expected = 0, first = 0, last = 0, s = 0;
    int have_expected, seen = 0, status = DONE, outcome;
    State st;

    if (!PyArg_ParseTuple(args, "OO!n:run", &verifier, &PyList_Type, &batch, &start)) {
        return NULL;
    }
    if (decode_envelope == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "dsec_core._auditfast is not configured");
        return NULL;
    }
    n = PyList_GET_SIZE(batch);
    if (start < 0 || start > n) {
        PyErr_SetString(PyExc_IndexError, "run: start out of the batch");
        return NULL;
    }
    if ((keep = PyList_New(0)) == NULL || (report = PyObject_GetAttr(verifier, s_report)) == NULL) {
        goto out;
    }
    if ((finding = PyObject_GetAttr(report, s_finding)) == NULL) {
        goto out;
    }
    Py_DECREF(finding);
    if (finding != Py_None) {
        result = Py_BuildValue("(niO)", start, DONE, Py_None);
        goto out;
    }
    if (get_state(verifier, s_routes, &PyDict_Type, keep, &st.routes) < 0 ||
        get_state(verifier, s_certs, &PyDict_Type, keep, &st.certs) < 0 ||
        get_state(verifier, s_keys, &PyDict_Type, keep, &st.keys) < 0 ||
        get_state(verifier, s_revoked, &PySet_Type, keep, &st.revoked) < 0 ||
        get_state(verifier, s_chains, &PyDict_Type, keep, &st.chains) < 0 ||
        get_state(verifier, s_seen, &PyDict_Type, keep, &st.seen) < 0 ||
        get_state(verifier, s_refusals, &PyDict_Type, keep, &st.refusals) < 0 ||
        get_state(verifier, s_tenants, &PyDict_Type, keep, &st.tenants) < 0 ||
        get_state(verifier, s_nodes, &PyDict_Type, keep, &st.nodes) < 0 ||
        get_state(verifier, s_causes, &PyDict_Type, keep, &st.causes) < 0 ||
        get_state(report, s_producers, &PySet_Type, keep, &st.producers) < 0) {
        goto out;
    }
    if ((every = PyObject_GetAttr(verifier, s_signature_every)) == NULL) {
        goto out;
    }
    st.signature_every = PyLong_AsSsize_t(every);
    if (st.signature_every == -1 && PyErr_Occurred()) {
        goto out;
    }
    if ((expected_obj = PyObject_GetAttr(verifier, s_expected)) == NULL) {
        goto out;
    }
    have_expected = expected_obj != Py_None;
    if (have_expected) {
        int overflow;
        expected = PyLong_AsLongLongAndOverflow(expected_obj, &overflow);
        if (overflow || (expected == -1 && PyErr_Occurred())) {
            /* (not a sequence this path can hold: the Python path reads it) */
            PyErr_Clear();
            Py_DECREF(expected_obj);
            result = Py_BuildValue("(niO)", start, start < PyList_GET_SIZE(batch) ? DECLINED : DONE,
                                   Py_None);
            goto out;
        }
    }
    Py_DECREF(expected_obj);
    /* (the size read again each time: code this path calls, a digest's __bool__ for one, may
     * have changed the list) */
    for (i = start; i < PyList_GET_SIZE(batch); i++) {
        PyObject *item = Py_NewRef(PyList_GET_ITEM(batch, i));
        outcome = one(&st, item, have_expected, expected, &s, &settle);
        Py_DECREF(item);
        if (outcome == FAILED) {
            /* The events before it were taken, and Python raises after this one's prologue
             * (its sequence, as the last read and the next expected): written back, raised. */
            PyObject *type, *value, *traceback;
            if (!seen) {
                first = s;
            }
            last = s;
            PyErr_Fetch(&type, &value, &traceback);
            if (write_back(verifier, report, st.chains, first, last, 1, taken) < 0) {
                PyErr_Clear();
            }
            PyErr_Restore(type, value, traceback);
            goto out;
        }
        if (outcome == LEFT) {
            status = DECLINED;
            break;
        }
        if (!seen) {
            first = s;
            seen = 1;
        }
        last = s;
        expected = s + 1;
        have_expected = 1;
        taken++;
        if (outcome == TAKEN_SETTLE) {
            status = SETTLE;
            break;
        }
    }
    if (write_back(verifier, report, st.chains, first, last, seen, taken) < 0) {
        goto out;
    }
    result = Py_BuildValue("(niO)", i, status, settle != NULL ? settle : Py_None);
out:
    Py_XDECREF(settle);
    Py_XDECREF(every);
    Py_XDECREF(report);
    Py_XDECREF(keep);
    return result;
}

static PyObject *configure(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"decode_envelope", "decode_payload", "envelope_hash", "unverified",
                            "slow_types",      "placement_types", "sandbox",     "scheduled",
                            "nodeagent",       "signed_head",     NULL};
    PyObject *v[10];
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "$OOOOO!O!UUUS:configure", names, &v[0],
                                     &v[1], &v[2], &v[3], &PyFrozenSet_Type, &v[4],
                                     &PyFrozenSet_Type, &v[5], &v[6], &v[7], &v[8], &v[9])) {
        return NULL;
    }
    if (!PyType_Check(v[3]) || !PyType_IsSubtype((PyTypeObject *)v[3], &PyTuple_Type)) {
        PyErr_SetString(PyExc_TypeError, "configure: unverified must be a tuple type");
        return NULL;
    }
    PyObject **slots[10] = {&decode_envelope, &decode_payload,  &envelope_hash,
                            &unverified_type, &slow_types,      &placement_types,
                            &sandbox_aggregate, &scheduled_type, &nodeagent_role,
                            &signed_head};
    for (int i = 0; i < 10; i++) {
        Py_XSETREF(*slots[i], Py_NewRef(v[i]));
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"run", run, METH_VARARGS,
     "run(verifier, batch, start) -> (index, status, chain): feed's common case over "
     "batch[start:] (see the module's source)."},
    {"configure", (PyCFunction)(void (*)(void))configure, METH_VARARGS | METH_KEYWORDS,
     "configure(*, decode_envelope, decode_payload, envelope_hash, unverified, slow_types, "
     "placement_types, sandbox, scheduled, nodeagent, signed_head): dsec_core.audit's objects."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "dsec_core._auditfast",
    "The audit verifier's common case, a batch at a time, in C (see dsec_core.audit).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__auditfast(void) {
    struct {
        PyObject **slot;
        const char *name;
    } strings[] = {
        {&s_type, "type"},
        {&s_aggregate_id, "aggregate_id"},
        {&s_aggregate, "aggregate"},
        {&s_subject, "subject"},
        {&s_key_id, "key_id"},
        {&s_producer, "producer"},
        {&s_chain, "chain"},
        {&s_chain_seq, "chain_seq"},
        {&s_prev, "prev"},
        {&s_id, "id"},
        {&s_tenant, "tenant"},
        {&s_causation_id, "causation_id"},
        {&s_payload, "payload"},
        {&s_role, "role"},
        {&s_node_id, "node_id"},
        {&s_next_seq, "next_seq"},
        {&s_last_hash, "last_hash"},
        {&s_pending, "pending"},
        {&s_report, "report"},
        {&s_expected, "_expected"},
        {&s_routes, "_routes"},
        {&s_certs, "_certs"},
        {&s_keys, "_keys"},
        {&s_revoked, "_revoked"},
        {&s_chains, "_chains"},
        {&s_seen, "_seen"},
        {&s_refusals, "_refusals"},
        {&s_tenants, "_tenants"},
        {&s_nodes, "_nodes"},
        {&s_causes, "_causes"},
        {&s_signature_every, "_signature_every"},
        {&s_producers, "producers"},
        {&s_finding, "finding"},
        {&s_first_seq, "first_seq"},
        {&s_last_seq, "last_seq"},
        {&s_events, "events"},
        {&s_chains_count, "chains"},
    };
    for (size_t i = 0; i < sizeof strings / sizeof strings[0]; i++) {
        if ((*strings[i].slot = PyUnicode_InternFromString(strings[i].name)) == NULL) {
            return NULL;
        }
    }
    if ((one_int = PyLong_FromLong(1)) == NULL) {
        return NULL;
    }
    return PyModule_Create(&module_def);
}
