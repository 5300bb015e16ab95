"""Verification of the signed audit trail (pure: no I/O).

:func:`verify_stream` replays ``(stream_sequence, wire_bytes)`` pairs in stream order and proves:
every envelope decodes; every signature is valid for the key its producer registered in the log
(first registration wins; a later, different key must be endorsed by the previous one); every
producer chain is unbroken (``chain_seq`` contiguous, ``prev`` = hash of the previous envelope);
no event id appears twice (a replayed old event); no gap in stream sequence numbers.

Signatures are checked at chain heads. Every envelope carries ``prev``, the BLAKE3 hash of the
envelope before it in its chain, and the signature covers it; so one valid signature from the
producer's registered key authenticates, through the hashes, every envelope before it in that
chain. The verifier checks each chain's newest signature at least every
:data:`SIGNATURE_EVERY` events and at the end (:meth:`Verifier.finish`), instead of all of them
(an Ed25519 verification costs ~55 µs here, more than the rest of the work per event). When
anything is wrong, every signature still pending is checked, so the finding names the first bad
event exactly as a check of every signature would. Key registrations are checked at once.
What it does not prove: that each intermediate ``sig`` field is itself valid (its content is
authentic, but a producer that wrote garbage there would go unnoticed until someone checks that
one event alone).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from nacl.exceptions import BadSignatureError
from nacl.signing import VerifyKey

from dsec_core import canonical
from dsec_core.envelope import MalformedEnvelope
from dsec_core.events import KeyRegistered
from dsec_core.signing import envelope_hash, verify_raw


@dataclass(frozen=True)
class Finding:
    """The first event that breaks the trail, and why."""

    stream_seq: int
    event_id: str | None
    event_type: str | None
    producer: str | None
    reason: str


@dataclass
class VerifyReport:
    """Result of a verification run."""

    events: int = 0
    producers: set[str] = field(default_factory=set)
    chains: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    finding: Finding | None = None

    @property
    def ok(self) -> bool:
        """True when nothing was found."""
        return self.finding is None


# A chain's newest signature is checked at least this often (and every chain's at the end).
SIGNATURE_EVERY = 256


@dataclass(frozen=True)
class _Unverified:
    """An envelope whose signature is not checked yet (a later one may vouch for it)."""

    seq: int
    fields: dict[str, Any]
    key: bytes


@dataclass
class _Chain:
    next_seq: int = 0
    last_hash: str | None = None
    pending: list[_Unverified] = field(default_factory=list)

    def first_bad_signature(self) -> _Unverified | None:
        """Check the newest pending signature; only if it fails, each one in order."""
        if not self.pending:
            return None
        head = self.pending[-1]
        if verify_raw(head.fields, head.key):
            self.pending.clear()  # the head vouches for everything before it (``prev`` hashes)
            return None
        for event in self.pending:
            if not verify_raw(event.fields, event.key):
                return event
        return head


@dataclass
class _State:
    keys: dict[str, dict[str, bytes]] = field(default_factory=dict)  # producer -> key_id -> raw
    chains: dict[tuple[str, str], _Chain] = field(default_factory=dict)
    seen_ids: dict[str, int] = field(default_factory=dict)


_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "id": str,
    "type": str,
    "producer": str,
    "key_id": str,
    "chain": str,
    "chain_seq": int,
    "prev": (str, type(None)),
    "sig": str,
    "payload": dict,
}


def _fields(data: bytes) -> dict[str, Any]:
    """Unpack an envelope without model validation (the verifier's hot path)."""
    try:
        raw = canonical.unpack(data)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise MalformedEnvelope(f"not MessagePack: {exc}") from None
    if not isinstance(raw, dict):
        raise MalformedEnvelope("envelope must be a map")
    for name, kind in _REQUIRED.items():
        if not isinstance(raw.get(name), kind):
            raise MalformedEnvelope(f"invalid envelope field {name}")
    return raw


def _check_registration(state: _State, f: dict[str, Any]) -> str | None:
    try:
        reg = KeyRegistered.model_validate(f["payload"])
        raw = bytes.fromhex(reg.public_key)
    except ValueError as exc:
        return f"malformed key registration: {exc}"
    if reg.producer != f["producer"]:
        return f"key registration for {reg.producer!r} published by {f['producer']!r}"
    if not verify_raw(f, raw):
        return "key registration not signed by the key it registers"
    known = state.keys.setdefault(reg.producer, {})
    if reg.key_id in known:
        return None if known[reg.key_id] == raw else "key id reused for a different key"
    if known and not _endorsed(known, raw, reg.endorsement):
        return f"new key {reg.key_id} for {reg.producer!r} is not endorsed by its previous key"
    known[reg.key_id] = raw
    return None


def _endorsed(known: dict[str, bytes], new_raw: bytes, endorsement: str | None) -> bool:
    if endorsement is None:
        return False
    for old_raw in known.values():
        try:
            VerifyKey(old_raw).verify(new_raw, bytes.fromhex(endorsement))
        except (BadSignatureError, ValueError):
            continue
        return True
    return False


def _bad_signature(f: dict[str, Any]) -> str:
    return f"signature invalid for key {f['key_id']} of {f['producer']!r} (altered content)"


def _check_event(state: _State, seq: int, f: dict[str, Any], data: bytes) -> str | None:
    """Every check but the signature, which joins its chain's pending list (see module doc)."""
    producer, key_id = f["producer"], f["key_id"]
    if f["id"] in state.seen_ids:
        return f"replayed event: id already at stream sequence {state.seen_ids[f['id']]}"
    registration = f["type"] == KeyRegistered.TYPE
    if registration:
        problem = _check_registration(state, f)  # verifies its signature now
        if problem:
            return problem
    raw = state.keys.get(producer, {}).get(key_id)
    if raw is None:
        return f"signed by key {key_id}, which is not registered for {producer!r}"
    chain = state.chains.setdefault((producer, f["chain"]), _Chain())
    label = f"chain {f['chain'][:13]}… of {producer!r} broken"
    problem = None
    if f["chain_seq"] != chain.next_seq:
        problem = f"{label}: expected position {chain.next_seq}, found {f['chain_seq']}"
    elif f["prev"] != chain.last_hash:
        problem = f"{label}: prev hash does not match"
    if problem is not None:
        # As a check of every signature would: a forged envelope is named as such.
        return problem if registration or verify_raw(f, raw) else _bad_signature(f)
    chain.next_seq += 1
    chain.last_hash = envelope_hash(data)
    state.seen_ids[f["id"]] = seq
    if registration:
        chain.pending.clear()  # its signature, checked above, vouches for the chain so far
    else:
        chain.pending.append(_Unverified(seq, f, raw))
    return None


class Verifier:
    """Incremental verifier: feed events in stream order; the first problem sticks.

    ``signature_every``: check a chain's newest signature at least this often (1: every
    signature, as a naive verifier does; for comparison).
    """

    def __init__(self, signature_every: int = SIGNATURE_EVERY) -> None:
        if signature_every < 1:
            raise ValueError(f"signature_every must be >= 1, got {signature_every}")
        self._signature_every = signature_every
        self.report = VerifyReport()
        self._state = _State()
        self._expected: int | None = None

    def feed(self, seq: int, data: bytes) -> Finding | None:
        """Check one event; return the finding if the trail is (or already was) broken."""
        report = self.report
        if report.finding is not None:
            return report.finding
        if self._expected is not None and seq != self._expected:
            report.finding = Finding(
                seq, None, None, None, f"gap: sequence {self._expected} missing"
            )
            return report.finding
        self._expected = seq + 1
        report.first_seq = report.first_seq if report.first_seq is not None else seq
        report.last_seq = seq
        try:
            fields = _fields(data)
        except MalformedEnvelope as exc:
            report.finding = Finding(seq, None, None, None, str(exc))
            return report.finding
        problem = _check_event(self._state, seq, fields, data)
        if problem:
            # A pending signature earlier in the stream may be the first problem.
            if self._check_pending() is None:
                report.finding = Finding(
                    seq, fields["id"], fields["type"], fields["producer"], problem
                )
            return report.finding
        report.events += 1
        report.producers.add(fields["producer"])
        report.chains = len(self._state.chains)
        chain = self._state.chains[(fields["producer"], fields["chain"])]
        if len(chain.pending) >= self._signature_every:
            bad = chain.first_bad_signature()
            if bad is not None:
                return self._signature_finding(bad)
        return None

    def finish(self) -> VerifyReport:
        """Check the signatures still pending (every chain's head); call after the last event.

        Until then ``report.ok`` may be true of a trail with a forged envelope near its end.
        """
        if self.report.finding is None:
            self._check_pending()
        return self.report

    def _check_pending(self) -> Finding | None:
        """Check every chain's pending signatures; record the earliest bad one, if any."""
        bad = [b for c in self._state.chains.values() if (b := c.first_bad_signature())]
        if not bad:
            return None
        return self._signature_finding(min(bad, key=lambda event: event.seq))

    def _signature_finding(self, bad: _Unverified) -> Finding:
        report = self.report
        f = bad.fields
        report.finding = Finding(bad.seq, f["id"], f["type"], f["producer"], _bad_signature(f))
        # The trail holds good events up to the bad one only (stream sequences are contiguous).
        assert report.first_seq is not None
        report.events = bad.seq - report.first_seq
        return report.finding


def verify_stream(
    messages: Iterable[tuple[int, bytes]], *, signature_every: int = SIGNATURE_EVERY
) -> VerifyReport:
    """Verify a stream replay; stop at the first bad event."""
    verifier = Verifier(signature_every)
    for seq, data in messages:
        if verifier.feed(seq, data) is not None:
            break
    return verifier.finish()
