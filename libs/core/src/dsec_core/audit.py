"""Verification of the signed audit trail (pure: no I/O).

:func:`verify_stream` replays ``(stream_sequence, wire_bytes)`` pairs in stream order and tells
two stories apart:

* **The trail was tampered with** (:attr:`VerifyReport.finding`, verification fails): a gap in
  stream sequence numbers; a broken chain of a certified producer (a position skipped or a
  ``prev`` hash that does not match — an authentic event altered or removed); an authorized
  producer that *acted* on an injected message (an authentic event whose cause is one), that
  emitted an event id it already emitted (it acted on a replay), or that acted across tenants.
* **Foreign messages were injected and ignored** (:attr:`VerifyReport.injected`, verification
  still passes): bytes that are not an envelope, keys without a certificate from the operator
  root, revoked keys, signatures that do not hold, producers the authorization table does not
  allow for that type or tenant, copies of old events. Each is listed with its sequence number
  and the ``security.event_rejected`` events that answered it.

Trust comes from the operator root (the *anchor*): a key counts only once an
``audit.key_registered`` event carrying a root-signed certificate registered it; the
certificate's role decides what the key may emit (:mod:`dsec_core.authz`).

Signatures are checked at chain heads: every envelope carries ``prev``, the BLAKE3 hash of the
envelope before it in its chain, and the signature covers it, so one valid signature vouches for
the chain before it. Each chain's newest signature is checked at least every
:data:`SIGNATURE_EVERY` events and at the end; when a chain does not fit, its pending signatures
are checked one by one, so a forgery that copied a real chain position is found and set aside.

Most events of a log are the common case: an authorized producer's next event in its chain, of
a route already seen consistent. :meth:`Verifier._fast` takes those without building the
envelope's dict (a msgspec struct of strict types, the payload decoded by msgspec into a map of
JSON-like values or else by MessagePack, authorization verdicts remembered by what they read);
anything else, or anything it cannot decode the same way, goes the full path, which decides as
it always did. :meth:`Verifier.feed_many` takes a batch: where the C extension
(``dsec_core/_auditfast.c``) is built, one C call takes the common events by :meth:`_fast`'s
rules and hands every other one, and each chain due its signature check, back to
:meth:`Verifier.feed` and :meth:`Verifier._settle`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from dsec_core import authz, canonical
from dsec_core.audit_report import (  # (re-exported: they were defined here)
    SIGNATURE_EVERY,
    Finding,
    Injected,
    VerifyReport,
    c_path_wanted,
    fewer_collections,
)
from dsec_core.canonical import envelope_hash
from dsec_core.eventbase import KeyRegistered, KeyRevoked
from dsec_core.eventtypes import AGGREGATES, MalformedEnvelope, unpack_fields
from dsec_core.identity import Certificate
from dsec_core.sigkeys import verify_raw
from dsec_core.trustcheck import (
    registration_problem,
    shape_problem,
    signed_time,
    user_id_problem,
)

try:  # the C path of the common case (dsec_core/_auditfast.c), where it was built
    from dsec_core import _auditfast
except ImportError:  # (no C compiler where it was installed: the Python path alone)
    _auditfast = None

# The other types the verifier names (literals: their models, in dsec_core.events, are not loaded
# here; libs/core/tests/test_audit_verify.py holds them equal to the models' TYPE and AGGREGATE)
_EVENT_REJECTED = "security.event_rejected"
_USER_FULL_PATH = "a user's event: the full path checks its id"
_SPEC_SUBMITTED = "spec.submitted"
_SANDBOX = AGGREGATES[_SPEC_SUBMITTED]
_UNIT_MIGRATED = "unit.migrated"
_UNIT_MIGRATION_FAILED = "unit.migration_failed"

# Forged-looking events remembered per chain, to name the first altered one if a genuine
# successor shows up later.
_REMOVED_LIMIT = 4096


class _Unverified(NamedTuple):
    """An envelope of a chain whose signature is not checked yet (a later one may vouch).

    A tuple, not a dataclass: one is made per event, on the verifier's hot path. It keeps the
    wire bytes, not the decoded fields: they are decoded again (:attr:`fields`) only for a
    signature check, once per :data:`SIGNATURE_EVERY` events, and the fast path
    (:meth:`Verifier._fast`) never builds them at all."""

    seq: int
    data: bytes
    key: bytes
    before: tuple[int, str | None]  # the chain's (next_seq, last_hash) before it

    @property
    def fields(self) -> dict[str, Any]:
        """The envelope's fields, as :func:`_fields` decodes them (it did once already)."""
        fields: dict[str, Any] = canonical.unpack(self.data)
        return fields


# tuple.__new__ skips the generated __new__'s Python frame (the fields are given in order).
_new_unverified = tuple.__new__


@dataclass(slots=True)
class _Chain:
    next_seq: int = 0
    last_hash: str | None = None
    pending: list[_Unverified] = field(default_factory=list)
    removed: list[_Unverified] = field(default_factory=list)  # the latest set aside as forged

    def fits(self, f: dict[str, Any]) -> bool:
        return bool(f["chain_seq"] == self.next_seq and f["prev"] == self.last_hash)

    def advance(self, data: bytes) -> None:
        self.next_seq += 1
        self.last_hash = envelope_hash(data)


_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "type": str,
    "producer": str,
    "tenant": str,
    "key_id": str,
    "chain": str,
    "chain_seq": int,
    "prev": (str, type(None)),
    "sig": str,
    "payload": dict,
    "aggregate_id": str,
}


_REQUIRED_ITEMS = tuple(_REQUIRED.items())

_KEY_REGISTERED = KeyRegistered.TYPE

# Routing fields found consistent, per (type, aggregate id): (aggregate, subject). Bounded.
_ROUTES_LIMIT = 65_536


class _Envelope(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    """Every field a :class:`~dsec_core.signing.Signer` writes, each of the one type it writes:
    the fast path's view of an envelope (:meth:`Verifier._fast`). Decoding into it (in C, no
    dict) either fails or gives the very values MessagePack's full decode gives for these
    fields: msgspec and msgpack read the same wire format; a field missing, of another type
    (a bool for an int, bytes for a str), an unknown field, invalid UTF-8 or trailing bytes
    make it fail, and the envelope takes the full path (``libs/core/tests/test_audit_fast.py``
    holds the two equal). The payload is decoded apart (:data:`_decode_payload`)."""

    id: str
    type: str
    subject: str
    aggregate: str
    aggregate_id: str
    time: str
    producer: str
    tenant: str
    causation_id: str | None
    correlation_id: str | None
    schema_version: str
    payload: msgspec.Raw
    key_id: str
    chain: str
    chain_seq: int
    prev: str | None
    sig: str


_decode_envelope = msgspec.msgpack.Decoder(_Envelope).decode

_SIGNED_MAP_HEAD = b"\xde" + len(_Envelope.__struct_fields__).to_bytes(2, "big")
"""The map header a signer writes (a map16 of exactly the struct's 17 fields). The fast path
takes only envelopes that begin with it: with every field required and no other allowed, 17
entries leave no room for a duplicate key, which msgspec resolves without reading the first
value (a ``payload`` shadowed by one MessagePack's strict decode refuses passed the fast path
and failed the signature check's decode later)."""


def _json_like(depth: int) -> Any:
    """The values a payload holds (what ``model_dump(mode="json")`` gives: string keys; str,
    int, float, bool, None, lists and maps), nested at most ``depth`` lists or maps deep."""
    scalar: Any = str | int | float | bool | None
    value = scalar
    for _ in range(depth):
        value = scalar | list[value] | dict[str, value]  # type: ignore[valid-type]
    return value


_decode_payload = msgspec.msgpack.Decoder(dict[str, _json_like(6)]).decode  # type: ignore[misc]
"""The fast path's payload decode: a map of string keys to JSON-like values, six levels deep at
most, in C (0.47 against 1.36 us for MessagePack's decode of a small payload). What it decodes,
MessagePack's strict decode (:func:`canonical.unpack`) decodes to the very same values: msgspec
and msgpack read the same format, and every map key is a string at every level (the strict
decode refuses others); anything else (bytes, ext types, a non-string key, deeper nesting)
fails it with ``ValidationError``, and MessagePack's own decode takes the payload, as before
(``libs/core/tests/test_audit_fast.py`` holds the paths equal)."""

# Types the fast path leaves to the full one (they change what the verifier trusts or records
# about refusals; rare in a log).
_SLOW_TYPES = frozenset(
    {
        KeyRegistered.TYPE,
        KeyRevoked.TYPE,
        _EVENT_REJECTED,
        _SPEC_SUBMITTED,
        _UNIT_MIGRATED,
        _UNIT_MIGRATION_FAILED,
    }
)
_PLACEMENT_TYPES = frozenset({"sandbox.scheduled", "env.built"})

# authz.refusal's verdicts, per everything it reads (bounded).
_REFUSALS_LIMIT = 65_536

# verify_stream's batches for Verifier.feed_many.
_BATCH = 4096


# Verifier.feed_many's C path: run(verifier, batch, start) -> (index, status, chain); None where
# the extension is not built, or DSEC_AUDIT_PURE_PYTHON=1 turns it off (a test does too).
_RUN_DONE, _RUN_LEFT, _RUN_SETTLE = 0, 1, 2
_C_EVERY_MAX = 2**62  # (a signature_every the C path holds; above it no chain is ever due)
_fast_run: Any = None
if _auditfast is not None and c_path_wanted():
    _auditfast.configure(
        decode_envelope=_decode_envelope,
        decode_payload=_decode_payload,
        envelope_hash=envelope_hash,
        unverified=_Unverified,
        slow_types=_SLOW_TYPES,
        placement_types=_PLACEMENT_TYPES,
        sandbox=_SANDBOX,
        scheduled="sandbox.scheduled",
        nodeagent="nodeagent",
        signed_head=_SIGNED_MAP_HEAD,
    )
    _fast_run = _auditfast.run


def _fields(data: bytes) -> dict[str, Any]:
    """Unpack an envelope without model validation (the verifier's hot path)."""
    raw = unpack_fields(data)
    try:  # _REQUIRED unrolled (the common case, in one expression; a missing field: below)
        if (
            isinstance(raw["id"], str)
            and isinstance(raw["type"], str)
            and isinstance(raw["producer"], str)
            and isinstance(raw["tenant"], str)
            and isinstance(raw["key_id"], str)
            and isinstance(raw["chain"], str)
            and isinstance(raw["chain_seq"], int)
            and ((prev := raw["prev"]) is None or isinstance(prev, str))
            and isinstance(raw["sig"], str)
            and isinstance(raw["payload"], dict)
            and isinstance(raw["aggregate_id"], str)
        ):
            return raw
    except KeyError:
        pass
    for name, kind in _REQUIRED_ITEMS:
        if name not in raw or not isinstance(raw[name], kind):  # (a missing prev too)
            raise MalformedEnvelope(f"invalid envelope field {name}")
    return raw  # (not reached: the expression above is _REQUIRED)


def _bad_signature(f: dict[str, Any]) -> str:
    return f"signature invalid for key {f['key_id']} of {f['producer']!r}"


class Verifier:
    """Incremental verifier: feed events in stream order; the first tampering finding sticks.

    Args:
        anchor: the operator root's public key (raw 32 bytes). Without it no key is trusted
            and every message is foreign.
        signature_every: check a chain's newest signature at least this often (1: every one).
    """

    def __init__(self, anchor: bytes | None, signature_every: int = SIGNATURE_EVERY) -> None:
        if signature_every < 1:
            raise ValueError(f"signature_every must be >= 1, got {signature_every}")
        self._anchor = anchor
        self._signature_every = signature_every
        self.report = VerifyReport()
        self._expected: int | None = None
        self._certs: dict[str, Certificate] = {}
        self._keys: dict[str, bytes] = {}  # key id -> raw public key of its certificate
        self._revoked: set[str] = set()
        self._chains: dict[tuple[str, str], _Chain] = {}
        self._seen: dict[str, int] = {}  # authentic event id -> stream seq
        self._tenants: dict[str, tuple[str, str]] = {}  # sandbox -> (first submission, tenant)
        self._nodes: dict[str, str] = {}  # sandbox -> the node it is placed on (latest)
        self._causes: dict[str, int] = {}  # cause id -> first authentic event it caused
        self._answers: dict[int, list[int]] = {}
        self._injected_at: dict[int, Injected] = {}
        self._routes: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._refusals: dict[tuple[str | None, ...], str | None] = {}

    # -- feeding ---------------------------------------------------------------------------------

    def feed(self, seq: int, data: bytes, digest: str | None = None) -> Finding | None:
        """Check one event; return the finding if the trail is (or already was) tampered with.

        ``digest``: ``envelope_hash(data)`` where the caller computed it already (the verifier
        process's reader does, on the other core); computed here when not given."""
        report = self.report
        if report.finding is not None:
            return report.finding
        if self._expected is not None and seq != self._expected:
            return self._find(seq, None, f"gap: sequence {self._expected} missing")
        self._expected = seq + 1
        report.first_seq = report.first_seq if report.first_seq is not None else seq
        report.last_seq = seq
        if data[:3] == _SIGNED_MAP_HEAD:  # else the full path (a duplicate key, for one)
            try:
                envelope = _decode_envelope(data)
                try:
                    payload = _decode_payload(envelope.payload)
                except msgspec.ValidationError:  # (deeper, or rarer types: MessagePack decides)
                    payload = canonical.unpack(envelope.payload)
            except Exception:  # (msgspec or msgpack: the full path says what is wrong, if any)
                pass
            else:
                if type(payload) is dict and self._fast(seq, envelope, payload, data, digest):
                    return None
        try:
            f = _fields(data)
        except MalformedEnvelope as exc:
            self._inject(seq, None, f"malformed: {exc}")
            return None
        route = self._routes.get((f["type"], f["aggregate_id"]))
        if route is None or route[0] != f.get("aggregate") or route[1] != f.get("subject"):
            shape = shape_problem(f)
            if shape is not None:
                self._inject(seq, f, f"malformed: {shape}")
                return None
            if len(self._routes) >= _ROUTES_LIMIT:
                self._routes.clear()
            # shape_problem found these consistent: the same pair gives the same verdict again
            self._routes[(f["type"], f["aggregate_id"])] = (f["aggregate"], f["subject"])
        self._check(seq, f, data, digest)
        return report.finding

    def feed_many(
        self, batch: Sequence[tuple[int, bytes]] | Sequence[tuple[int, bytes, str | None]]
    ) -> Finding | None:
        """:meth:`feed` each ``(seq, data)`` or ``(seq, data, digest)`` of ``batch`` in order;
        stop at the first finding (returned, as :meth:`feed` returns it).

        With the C extension (``dsec_core._auditfast``) the common events are taken in C, by the
        same rules as :meth:`_fast`, with this verifier's own state; every other event, and
        every chain due its signature check, comes back here (:meth:`feed`, :meth:`_settle`)."""
        run = _fast_run
        items: list[Any] = batch if type(batch) is list else list(batch)
        every = self._signature_every
        if run is None or type(every) is not int or every > _C_EVERY_MAX:  # (the C reads an int)
            for item in items:
                if self.feed(*item) is not None:
                    break
            return self.report.finding
        start = 0
        while start < len(items):
            index, status, chain = run(self, items, start)
            if status == _RUN_DONE:
                break
            if status == _RUN_SETTLE:
                self._settle(chain)
            elif self.feed(*items[index]) is not None:  # _RUN_LEFT: this one is feed's
                break
            if self.report.finding is not None:
                break
            start = index + 1
        return self.report.finding

    def _fast(
        self, seq: int, e: _Envelope, payload: dict[str, Any], data: bytes, digest: str | None
    ) -> bool:
        """The common case of :meth:`feed` (an authorized producer's next event in its chain,
        routing already seen consistent), without building the fields' dict: True when it
        took the event, just as the full path (:meth:`_check`, :meth:`_accept`) would have.
        False, having changed nothing, for anything else: the full path decides."""
        event_type, aggregate_id = e.type, e.aggregate_id
        if event_type in _SLOW_TYPES:
            return False
        route = self._routes.get((event_type, aggregate_id))
        if route is None or route[0] != e.aggregate or route[1] != e.subject:
            return False
        key_id = e.key_id
        cert = self._certs.get(key_id)
        key = self._keys.get(key_id)
        if cert is None or key is None or key_id in self._revoked:
            return False
        producer = e.producer
        chain = self._chains.get((producer, e.chain))
        if (
            chain is None
            or producer != cert.subject
            or e.chain_seq != chain.next_seq
            or e.prev != chain.last_hash
            or e.id in self._seen
        ):
            return False
        # authz.refusal reads the type, producer and tenant, and of the payload its node_id
        # (its to_node, from_node and key_id only for the types left to the full path): the
        # same values, the same verdict (a str or None only: 1 and True are equal keys, yet
        # named differently in a refusal).
        node = payload.get("node_id")
        if node is not None and type(node) is not str:
            return False
        asked = (event_type, key_id, producer, e.tenant, node)
        refusals = self._refusals
        problem = refusals.get(asked, False)
        if problem is False:
            problem = authz.refusal(
                {"type": event_type, "producer": producer, "tenant": e.tenant, "payload": payload},
                cert,
            )
            if problem is None and cert.role == "user":
                problem = _USER_FULL_PATH  # (its id's freshness: the full path, in C too)
            if len(refusals) >= _REFUSALS_LIMIT:
                refusals.clear()
            refusals[asked] = problem
        if problem is not None:
            return False
        sandbox = e.aggregate == _SANDBOX
        if sandbox:
            if cert.role == "nodeagent":  # _wrong_node
                placed = self._nodes.get(aggregate_id)
                if placed is not None and placed != cert.node_id:
                    return False
            first = self._tenants.get(aggregate_id)  # _tenancy (not a spec.submitted: above)
            if first is not None and first[1] != e.tenant:
                return False
        # _accept, from its "before" on
        before = (chain.next_seq, chain.last_hash)
        chain.next_seq += 1
        chain.last_hash = digest or envelope_hash(data)
        self._seen[e.id] = seq
        cause = e.causation_id  # _record
        if cause is not None:
            self._causes.setdefault(cause, seq)
        if (
            node is not None  # (a str: above)
            and event_type in _PLACEMENT_TYPES
            and (event_type == "sandbox.scheduled" or aggregate_id not in self._nodes)
        ):
            self._nodes[aggregate_id] = node
        pending = chain.pending
        pending.append(_new_unverified(_Unverified, (seq, data, key, before)))
        if len(pending) >= self._signature_every:
            self._settle(chain)
        report = self.report
        report.events += 1
        report.producers.add(producer)
        report.chains = len(self._chains)
        return True

    def _check(self, seq: int, f: dict[str, Any], data: bytes, digest: str | None) -> None:
        key_id = f["key_id"]
        if f["type"] == _KEY_REGISTERED and key_id not in self._certs:
            found = (
                registration_problem(f, self._anchor)
                if self._anchor is not None
                else "no trust root given: no key can be trusted"
            )
            if isinstance(found, str):
                self._inject(seq, f, f"uncertified-key: {found}")
                return
            self._certs[key_id] = found
        cert = self._certs.get(key_id)
        if cert is None:
            self._inject(seq, f, f"unknown-key: key {key_id} has no certified registration")
            return
        if key_id in self._revoked:
            self._inject(seq, f, f"revoked-key: key {key_id} was revoked before")
            return
        producer = f["producer"]
        chain = self._chains.get((producer, f["chain"]))
        if chain is None:  # (not setdefault: that would build a _Chain for every event)
            chain = self._chains[(producer, f["chain"])] = _Chain()
        key = self._keys.get(key_id)
        if key is None:
            key = self._keys[key_id] = bytes.fromhex(cert.public_key)
        if producer != cert.subject:
            self._inject(seq, f, f"unauthorized: key certified for {cert.subject!r}")
            return
        if f["chain_seq"] != chain.next_seq or f["prev"] != chain.last_hash:  # chain.fits, inline
            self._repair(chain)
            if self.report.finding is not None:
                return
            if not chain.fits(f):
                self._misfit(seq, f, data, chain, key, chain.removed)
                return
        self._accept(seq, f, data, chain, cert, key, digest)

    def _accept(
        self,
        seq: int,
        f: dict[str, Any],
        data: bytes,
        chain: _Chain,
        cert: Certificate,
        key: bytes,
        digest: str | None = None,
    ) -> None:
        """A message in its chain's next position: authentic unless its signature fails later."""
        problem = authz.refusal(f, cert) or self._wrong_node(f, cert)
        if problem is None and cert.role == "user":
            # as every consumer's gate: a user's event id is a fresh UUIDv7 (a user's event
            # under a service's predictable id was refused there; taken here, the service's own
            # event under that id then read as a replay it acted on: tampering, for ever)
            signed = signed_time(f)
            if isinstance(signed, str):
                problem = f"malformed: {signed}"
            else:
                fresh = user_id_problem(f["id"], signed)
                problem = None if fresh is None else f"id-not-fresh: {fresh}"
        if f["id"] in self._seen:
            if verify_raw(f, key) and cert.role == "user":
                chain.advance(data)
                self._inject(
                    seq, f, f"replayed: a user re-used the event id at seq {self._seen[f['id']]}"
                )
            elif verify_raw(f, key):
                chain.advance(data)
                self._find(
                    seq,
                    f,
                    f"event id {f['id']} emitted again (first at seq "
                    f"{self._seen[f['id']]}): its producer acted on a replay",
                )
            else:
                self._forged(seq, f, data, key, chain)
            return
        if problem is not None:
            # Its own key signed it (checked now), so it is in its chain, but nobody may act on it.
            if not verify_raw(f, key):
                self._forged(seq, f, data, key, chain)
                return
            chain.advance(data)
            self._inject(seq, f, f"unauthorized: {problem}")
            return
        tenancy = self._tenancy(f, cert)
        if tenancy is not None:
            if not verify_raw(f, key):
                self._forged(seq, f, data, key, chain)
                return
            chain.advance(data)
            if cert.role == "user":
                self._inject(seq, f, tenancy)
            else:
                self._find(seq, f, f"a service acted across tenants: {tenancy}")
            return
        before = (chain.next_seq, chain.last_hash)
        chain.next_seq += 1  # chain.advance, inline
        chain.last_hash = digest or envelope_hash(data)
        self._seen[f["id"]] = seq
        self._record(seq, f, key)
        pending = chain.pending
        if f["type"] == _KEY_REGISTERED:
            pending.clear()  # its signature, checked at registration, vouches for the chain
        else:
            pending.append(_new_unverified(_Unverified, (seq, data, key, before)))
            if len(pending) >= self._signature_every:
                self._settle(chain)
        report = self.report
        report.events += 1
        report.producers.add(f["producer"])
        report.chains = len(self._chains)

    def _wrong_node(self, f: dict[str, Any], cert: Certificate) -> str | None:
        """A node agent's sandbox event for a sandbox its latest ``sandbox.scheduled`` placed on
        another node (as the gate; logs from before scheduling: the node ``env.built`` named)."""
        # After the shape check, ``aggregate`` is the one the subject and the type give.
        if cert.role != "nodeagent" or f["aggregate"] != _SANDBOX:
            return None
        node = self._nodes.get(f["aggregate_id"])
        if node is None or node == cert.node_id:
            return None
        return f"node agent of {cert.node_id!r} spoke for a sandbox of node {node!r}"

    def _tenancy(self, f: dict[str, Any], cert: Certificate) -> str | None:
        if f["payload"] is None or f["aggregate"] != _SANDBOX:
            return None
        sandbox = f["aggregate_id"]
        first = self._tenants.get(sandbox)
        if f["type"] == _SPEC_SUBMITTED:
            if first is not None and first[0] != f["id"]:
                return f"aggregate-exists: sandbox {sandbox} was submitted at an earlier sequence"
            if first is None:
                self._tenants[sandbox] = (f["id"], f["tenant"])
            return None
        if first is not None and first[1] != f["tenant"]:
            return f"cross-tenant: sandbox {sandbox} belongs to tenant {first[1]!r}"
        return None

    def _record(self, seq: int, f: dict[str, Any], key: bytes) -> None:
        cause = f.get("causation_id")
        if isinstance(cause, str):
            self._causes.setdefault(cause, seq)
        if f["type"] == "sandbox.scheduled" or (
            f["type"] == "env.built" and f["aggregate_id"] not in self._nodes
        ):
            node = f["payload"].get("node_id")
            if isinstance(node, str):
                self._nodes[f["aggregate_id"]] = node  # the latest placement counts
        if f["type"] == _EVENT_REJECTED:
            target = f["payload"].get("stream_seq")
            if isinstance(target, int):
                self._answers.setdefault(target, []).append(seq)
                if target in self._injected_at:
                    self._injected_at[target].answered_by.append(seq)
        elif f["type"] == KeyRevoked.TYPE:
            revoked = f["payload"].get("key_id")
            # A revocation takes effect only once its own signature holds (checked now).
            if isinstance(revoked, str) and verify_raw(f, key):
                self._revoked.add(revoked)

    # -- signatures ------------------------------------------------------------------------------

    def _forged(self, seq: int, f: dict[str, Any], data: bytes, key: bytes, chain: _Chain) -> None:
        """A signature that does not hold: injected, and remembered in case a genuine successor
        later shows it was the producer's own event, altered."""
        self._inject(seq, f, f"bad-signature: {_bad_signature(f)}")
        if f["chain_seq"] >= chain.next_seq and len(chain.removed) < _REMOVED_LIMIT:
            chain.removed.append(_Unverified(seq, data, key, (chain.next_seq, chain.last_hash)))

    def _misfit(
        self,
        seq: int,
        f: dict[str, Any],
        data: bytes,
        chain: _Chain,
        key: bytes,
        removed: list[_Unverified],
    ) -> None:
        """A message that does not fit its chain: a forgery, a copy, or a sign of tampering."""
        if not verify_raw(f, key):
            self._forged(seq, f, data, key, chain)
            return
        if f["id"] in self._seen and f["chain_seq"] < chain.next_seq:
            self._inject(seq, f, f"replayed: copy of the event at seq {self._seen[f['id']]}")
            return
        if self._certs[f["key_id"]].role == "user":
            # A user's own client may break its own chain; that is no tampering of the trail.
            self._inject(seq, f, "unauthorized: a user's event out of its chain's order")
            return
        label = f"chain {f['chain'][:13]}… of {f['producer']!r} broken"
        altered = _altered_run(removed, f["chain_seq"])
        if altered is not None:
            # The producer's genuine successor links to other bytes than the log holds there.
            self._injected_at.pop(altered.seq, None)
            self._find(
                altered.seq,
                altered.fields,
                f"{label}: this event was altered (signature invalid; the next event of the "
                f"chain, seq {seq}, links to the original bytes)",
            )
            return
        where = f"expected position {chain.next_seq}, found {f['chain_seq']}"
        if f["chain_seq"] == chain.next_seq:
            where = "prev hash does not match"
        self._find(seq, f, f"{label}: {where}")

    def _repair(self, chain: _Chain) -> list[_Unverified]:
        """Check the chain's unchecked events one by one; set the bad ones aside as injected.

        The chain is rebuilt up to the first bad one. A good event that had chained onto a bad
        one means its producer signed a garbage signature: that is tampering.
        Returns the events set aside.
        """
        bad = [p for p in chain.pending if not verify_raw(p.fields, p.key)]
        if not bad:
            chain.pending.clear()
            return []
        first = bad[0]
        later_good = [p for p in chain.pending if p.seq > first.seq and p not in bad]
        chain.next_seq, chain.last_hash = first.before
        chain.pending = [p for p in chain.pending if p.seq < first.seq]
        chain.removed = bad
        for p in bad:
            f = p.fields  # (decoded from its bytes on each read: once here)
            self._unaccept(p.seq, f)
            self._inject(p.seq, f, f"bad-signature: {_bad_signature(f)}")
        if later_good:
            p = later_good[0]
            f = p.fields
            self._find(
                p.seq,
                f,
                f"chain of {f['producer']!r} broken: it links to the event at seq "
                f"{first.seq}, whose signature is invalid",
            )
        return bad

    def _unaccept(self, seq: int, f: dict[str, Any]) -> None:
        self._seen.pop(f["id"], None)
        cause = f.get("causation_id")
        if isinstance(cause, str) and self._causes.get(cause) == seq:
            del self._causes[cause]  # a forgery acted on nothing
        sandbox = f["aggregate_id"]
        if self._tenants.get(sandbox, ("", ""))[0] == f["id"]:
            del self._tenants[sandbox]
        self.report.events -= 1

    def _settle(self, chain: _Chain) -> None:
        """Check the chain's newest signature; if it fails, find the bad ones (see _repair)."""
        if not chain.pending:
            return
        head = chain.pending[-1]
        if verify_raw(head.fields, head.key):
            chain.pending.clear()
            return
        self._repair(chain)

    def finish(self) -> VerifyReport:
        """Check every pending signature and every injected message's consequences."""
        if self.report.finding is None:
            for chain in list(self._chains.values()):
                self._settle(chain)
                if self.report.finding is not None:
                    break
        if self.report.finding is None:
            for item in sorted(self._injected_at.values(), key=lambda i: i.stream_seq):
                acted = self._causes.get(item.event_id or "")
                # (an authentic event of that id is what it acted on: anyone may store a
                # message under an id read on the bus, and the verifier sets it aside)
                if (
                    acted is not None
                    and item.event_id not in self._seen
                    and not item.reason.startswith("replayed")
                ):
                    self.report.finding = Finding(
                        acted,
                        None,
                        None,
                        None,
                        f"an authentic event acted on the injected message at seq "
                        f"{item.stream_seq} ({item.reason})",
                    )
                    break
        self.report.injected = sorted(self._injected_at.values(), key=lambda i: i.stream_seq)
        return self.report

    # -- outcomes --------------------------------------------------------------------------------

    def _inject(self, seq: int, f: dict[str, Any] | None, reason: str) -> None:
        item = Injected(
            seq,
            f.get("id") if f else None,
            f.get("type") if f else None,
            f.get("producer") if f else None,
            reason,
            list(self._answers.get(seq, [])),
        )
        self._injected_at[seq] = item

    def _find(self, seq: int, f: dict[str, Any] | None, reason: str) -> Finding:
        self.report.finding = Finding(
            seq,
            f.get("id") if f else None,
            f.get("type") if f else None,
            f.get("producer") if f else None,
            reason,
        )
        return self.report.finding


def _altered_run(removed: list[_Unverified], chain_seq: int) -> _Unverified | None:
    """The first of the forged-looking events just before position ``chain_seq``, if any: a
    genuine successor linking past them means they were the producer's own, altered."""
    by_position = {p.fields["chain_seq"]: p for p in removed}
    first = None
    position = chain_seq - 1
    while position in by_position:
        first = by_position[position]
        position -= 1
    return first


def verify_stream(
    messages: Iterable[tuple[int, bytes]],
    anchor: bytes | None,
    *,
    signature_every: int = SIGNATURE_EVERY,
) -> VerifyReport:
    """Verify a stream replay; stop at the first tampering finding."""
    verifier = Verifier(anchor, signature_every)
    with fewer_collections():
        items = iter(messages)
        while batch := list(itertools.islice(items, _BATCH)):
            if verifier.feed_many(batch) is not None:
                break
        return verifier.finish()
