"""The audit verifier names the first forged, altered, replayed or missing event (pure)."""

from __future__ import annotations

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import pytest

from dsec_core import canonical
from dsec_core.audit import verify_stream
from dsec_core.envelope import decode, encode
from dsec_core.events import KeyRegistered, SandboxExited, SpecSubmitted
from dsec_core.signing import Signer, public_bytes

pytestmark = pytest.mark.unit


def _registration(signer: Signer) -> bytes:
    reg = KeyRegistered(producer=signer.producer, key_id=signer.key_id,
                        public_key=public_bytes(signer.public_key).hex())
    return signer.seal(reg, aggregate_id=signer.producer)[1]


def _log(signer: Signer, n: int = 3) -> list[bytes]:
    wires = [_registration(signer)]
    for i in range(n):
        wires.append(signer.seal(SpecSubmitted(spec_yaml=f"v{i}"), aggregate_id=f"sbx_{i}")[1])
    return wires


def _numbered(wires: list[bytes], first: int = 1) -> list[tuple[int, bytes]]:
    return list(enumerate(wires, start=first))


def test_intact_log_verifies() -> None:
    a, b = Signer("policy", Ed25519PrivateKey.generate()), Signer("cli", Ed25519PrivateKey.generate())
    wires = _log(a) + _log(b)
    report = verify_stream(_numbered(wires))
    assert report.ok, report.finding
    assert report.events == 8
    assert report.producers == {"policy", "cli"}


def test_event_signed_with_wrong_key_is_named() -> None:
    real = Signer("policy", Ed25519PrivateKey.generate())
    impostor = Signer("policy", Ed25519PrivateKey.generate())
    wires = _log(real)
    wires.append(impostor.seal(SandboxExited(exit_code=0, reason="ok", duration_s=1),
                               aggregate_id="sbx_9")[1])
    report = verify_stream(_numbered(wires))
    assert report.finding is not None
    assert report.finding.stream_seq == 5
    assert "not registered for 'policy'" in report.finding.reason


def test_unendorsed_second_key_registration_is_refused() -> None:
    real = Signer("policy", Ed25519PrivateKey.generate())
    impostor = Signer("policy", Ed25519PrivateKey.generate())
    wires = _log(real) + [_registration(impostor)]
    report = verify_stream(_numbered(wires))
    assert report.finding is not None and "not endorsed" in report.finding.reason


def test_endorsed_key_rotation_is_accepted() -> None:
    old = Signer("policy", Ed25519PrivateKey.generate())
    new = Signer("policy", Ed25519PrivateKey.generate())
    reg = KeyRegistered(producer="policy", key_id=new.key_id,
                        public_key=public_bytes(new.public_key).hex(),
                        endorsement=old.endorse(new.public_key))
    wires = _log(old) + [new.seal(reg, aggregate_id="policy")[1]]
    wires.append(new.seal(SpecSubmitted(spec_yaml="x"), aggregate_id="sbx_1")[1])
    assert verify_stream(_numbered(wires)).ok


def test_altered_payload_is_named() -> None:
    signer = Signer("policy", Ed25519PrivateKey.generate())
    wires = _log(signer)
    env = decode(wires[2])
    tampered = env.model_copy(update={"payload": {**env.payload, "spec_yaml": "evil"}})
    wires[2] = encode(tampered)
    report = verify_stream(_numbered(wires))
    assert report.finding is not None
    assert (report.finding.stream_seq, report.finding.event_id) == (3, env.id)
    assert "signature invalid" in report.finding.reason


def test_broken_chain_is_named() -> None:
    signer = Signer("policy", Ed25519PrivateKey.generate())
    wires = _log(signer, n=4)
    del wires[2]  # an event of the chain never reached the log
    report = verify_stream(_numbered(wires))
    assert report.finding is not None
    assert report.finding.stream_seq == 3
    assert "broken: expected position 2, found 3" in report.finding.reason


def test_replayed_old_event_is_named() -> None:
    signer = Signer("policy", Ed25519PrivateKey.generate())
    wires = _log(signer)
    wires.append(wires[1])
    report = verify_stream(_numbered(wires))
    assert report.finding is not None
    assert report.finding.stream_seq == 5
    assert "replayed event" in report.finding.reason


def test_sequence_gap_is_named() -> None:
    signer = Signer("policy", Ed25519PrivateKey.generate())
    numbered = _numbered(_log(signer))
    del numbered[1]
    report = verify_stream(numbered)
    assert report.finding is not None and report.finding.reason == "gap: sequence 2 missing"


def test_non_canonical_bytes_are_refused() -> None:
    signer = Signer("policy", Ed25519PrivateKey.generate())
    wires = _log(signer, n=1)
    raw = canonical.unpack(wires[1])
    reordered = dict(reversed(list(raw.items())))
    wires[1] = canonical.pack(reordered)
    report = verify_stream(_numbered(wires))
    assert report.finding is not None and "not canonical" in report.finding.reason
