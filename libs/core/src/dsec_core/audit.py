"""Verification of the signed audit trail (pure: no I/O).

:func:`verify_stream` replays ``(stream_sequence, wire_bytes)`` pairs in stream order and proves:
every envelope decodes; every signature is valid for the key its producer registered in the log
(first registration wins; a later, different key must be endorsed by the previous one); every
producer chain is unbroken (``chain_seq`` contiguous, ``prev`` = hash of the previous envelope);
no event id appears twice (a replayed old event); no gap in stream sequence numbers.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from dsec_core import canonical
from dsec_core.envelope import Envelope, MalformedEnvelope, decode, encode
from dsec_core.events import KeyRegistered
from dsec_core.signing import envelope_hash, verify_signature


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


@dataclass
class _Chain:
    next_seq: int = 0
    last_hash: str | None = None


@dataclass
class _State:
    keys: dict[str, dict[str, bytes]] = field(default_factory=dict)  # producer -> key_id -> raw
    chains: dict[tuple[str, str], _Chain] = field(default_factory=dict)
    seen_ids: dict[str, int] = field(default_factory=dict)


def _check_registration(state: _State, env: Envelope) -> str | None:
    reg = KeyRegistered.model_validate(env.payload)
    raw = bytes.fromhex(reg.public_key)
    if reg.producer != env.producer:
        return f"key registration for {reg.producer!r} published by {env.producer!r}"
    if not verify_signature(env, raw):
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
            Ed25519PublicKey.from_public_bytes(old_raw).verify(bytes.fromhex(endorsement), new_raw)
        except Exception:  # InvalidSignature or malformed hex: try the next known key
            continue
        return True
    return False


def _check_event(state: _State, seq: int, env: Envelope) -> str | None:
    if env.id in state.seen_ids:
        return f"replayed event: id already at stream sequence {state.seen_ids[env.id]}"
    if env.type == KeyRegistered.TYPE:
        problem = _check_registration(state, env)
        if problem:
            return problem
    raw = state.keys.get(env.producer, {}).get(env.key_id)
    if raw is None:
        return f"signed by key {env.key_id}, which is not registered for {env.producer!r}"
    if not verify_signature(env, raw):
        return f"signature invalid for key {env.key_id} of {env.producer!r} (altered content)"
    chain = state.chains.setdefault((env.producer, env.chain), _Chain())
    if env.chain_seq != chain.next_seq:
        return (
            f"chain {env.chain[:13]}… of {env.producer!r} broken: expected position "
            f"{chain.next_seq}, found {env.chain_seq}"
        )
    if env.prev != chain.last_hash:
        return f"chain {env.chain[:13]}… of {env.producer!r} broken: prev hash does not match"
    chain.next_seq += 1
    chain.last_hash = envelope_hash(encode(env))
    state.seen_ids[env.id] = seq
    return None


def verify_stream(messages: Iterable[tuple[int, bytes]]) -> VerifyReport:
    """Verify a stream replay; stop at the first bad event."""
    report, state = VerifyReport(), _State()
    expected: int | None = None
    for seq, data in messages:
        if expected is not None and seq != expected:
            report.finding = Finding(seq, None, None, None, f"gap: sequence {expected} missing")
            return report
        expected = seq + 1
        report.first_seq = report.first_seq if report.first_seq is not None else seq
        report.last_seq = seq
        try:
            env = decode(data)
            if canonical.pack(canonical.canonicalize(canonical.unpack(data))) != data:
                raise MalformedEnvelope("bytes are not canonical")
        except MalformedEnvelope as exc:
            report.finding = Finding(seq, None, None, None, str(exc))
            return report
        problem = _check_event(state, seq, env)
        if problem:
            report.finding = Finding(seq, env.id, env.type, env.producer, problem)
            return report
        report.events += 1
        report.producers.add(env.producer)
    report.chains = len(state.chains)
    return report
