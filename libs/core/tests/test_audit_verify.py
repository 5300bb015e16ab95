"""The audit verifier names the first forged, altered, replayed or missing event (pure)."""

from __future__ import annotations

import pytest
from dsec_core import canonical
from dsec_core.audit import verify_stream
from dsec_core.envelope import decode, encode
from dsec_core.events import KeyRegistered, SandboxExited, SpecSubmitted
from dsec_core.signing import Signer
from nacl.signing import SigningKey

pytestmark = pytest.mark.unit


def _registration(signer: Signer) -> bytes:
    reg = KeyRegistered(
        producer=signer.producer, key_id=signer.key_id, public_key=signer.public_raw.hex()
    )
    return signer.seal(reg, aggregate_id=signer.producer).wire


def _log(signer: Signer, n: int = 3) -> list[bytes]:
    wires = [_registration(signer)]
    for i in range(n):
        wires.append(signer.seal(SpecSubmitted(spec_yaml=f"v{i}"), aggregate_id=f"sbx_{i}").wire)
    return wires


def _numbered(wires: list[bytes], first: int = 1) -> list[tuple[int, bytes]]:
    return list(enumerate(wires, start=first))


def test_intact_log_verifies() -> None:
    a, b = Signer("policy", SigningKey.generate()), Signer("cli", SigningKey.generate())
    wires = _log(a) + _log(b)
    report = verify_stream(_numbered(wires))
    assert report.ok, report.finding
    assert report.events == 8
    assert report.producers == {"policy", "cli"}


def test_event_signed_with_wrong_key_is_named() -> None:
    real = Signer("policy", SigningKey.generate())
    impostor = Signer("policy", SigningKey.generate())
    wires = _log(real)
    wires.append(
        impostor.seal(
            SandboxExited(exit_code=0, reason="ok", duration_s=1), aggregate_id="sbx_9"
        ).wire
    )
    report = verify_stream(_numbered(wires))
    assert report.finding is not None
    assert report.finding.stream_seq == 5
    assert "not registered for 'policy'" in report.finding.reason


def test_unendorsed_second_key_registration_is_refused() -> None:
    real = Signer("policy", SigningKey.generate())
    impostor = Signer("policy", SigningKey.generate())
    wires = [*_log(real), _registration(impostor)]
    report = verify_stream(_numbered(wires))
    assert report.finding is not None and "not endorsed" in report.finding.reason


def test_endorsed_key_rotation_is_accepted() -> None:
    old = Signer("policy", SigningKey.generate())
    new = Signer("policy", SigningKey.generate())
    reg = KeyRegistered(
        producer="policy",
        key_id=new.key_id,
        public_key=new.public_raw.hex(),
        endorsement=old.endorse(new.public_raw),
    )
    wires = [*_log(old), new.seal(reg, aggregate_id="policy").wire]
    wires.append(new.seal(SpecSubmitted(spec_yaml="x"), aggregate_id="sbx_1").wire)
    assert verify_stream(_numbered(wires)).ok


def test_altered_payload_is_named() -> None:
    signer = Signer("policy", SigningKey.generate())
    wires = _log(signer)
    env = decode(wires[2])
    tampered = env.model_copy(update={"payload": {**env.payload, "spec_yaml": "evil"}})
    wires[2] = encode(tampered)
    report = verify_stream(_numbered(wires))
    assert report.finding is not None
    assert (report.finding.stream_seq, report.finding.event_id) == (3, env.id)
    assert "signature invalid" in report.finding.reason


def test_broken_chain_is_named() -> None:
    signer = Signer("policy", SigningKey.generate())
    wires = _log(signer, n=4)
    del wires[2]  # an event of the chain never reached the log
    report = verify_stream(_numbered(wires))
    assert report.finding is not None
    assert report.finding.stream_seq == 3
    assert "broken: expected position 2, found 3" in report.finding.reason


def test_replayed_old_event_is_named() -> None:
    signer = Signer("policy", SigningKey.generate())
    wires = _log(signer)
    wires.append(wires[1])
    report = verify_stream(_numbered(wires))
    assert report.finding is not None
    assert report.finding.stream_seq == 5
    assert "replayed event" in report.finding.reason


def test_sequence_gap_is_named() -> None:
    signer = Signer("policy", SigningKey.generate())
    numbered = _numbered(_log(signer))
    del numbered[1]
    report = verify_stream(numbered)
    assert report.finding is not None and report.finding.reason == "gap: sequence 2 missing"


def test_reordered_fields_count_as_altered() -> None:
    signer = Signer("policy", SigningKey.generate())
    wires = _log(signer, n=1)
    raw = canonical.unpack(wires[1])
    wires[1] = canonical.pack(dict(reversed(list(raw.items()))))
    report = verify_stream(_numbered(wires))
    assert report.finding is not None and "signature invalid" in report.finding.reason


# ------------------------------------------------------------------ signatures checked at heads
def _forge_from(wires: list[bytes], index: int) -> None:
    """Alter event ``index`` and re-link every later one (an attacker without the key can fix
    the ``prev`` hashes, not the signatures)."""
    from dsec_core.signing import envelope_hash

    env = decode(wires[index])
    wires[index] = encode(env.model_copy(update={"payload": {**env.payload, "spec_yaml": "evil"}}))
    for j in range(index + 1, len(wires)):
        later = decode(wires[j])
        wires[j] = encode(later.model_copy(update={"prev": envelope_hash(wires[j - 1])}))


def test_a_relinked_forgery_deep_in_a_long_chain_is_named_before_the_end() -> None:
    from dsec_core.audit import SIGNATURE_EVERY, Verifier

    signer = Signer("policy", SigningKey.generate())
    wires = _log(signer, n=SIGNATURE_EVERY + 50)
    _forge_from(wires, 10)
    verifier = Verifier()
    finding = None
    for seq, wire in _numbered(wires):
        finding = verifier.feed(seq, wire)
        if finding is not None:
            break
    # Found when the chain's newest signature was due, well before the last event...
    assert finding is not None and seq <= SIGNATURE_EVERY + 1
    # ...and named at the first forged event, as a check of every signature would.
    assert finding.stream_seq == 11 and "signature invalid" in finding.reason
    assert verifier.report.events == 10


def test_the_first_bad_event_is_named_across_chains() -> None:
    a, b = Signer("policy", SigningKey.generate()), Signer("cli", SigningKey.generate())
    wires_a, wires_b = _log(a, n=2), _log(b, n=3)
    _forge_from(wires_a, 2)  # the last event of a's chain: only its own signature shows it
    del wires_b[2]  # then b's chain breaks, later in the stream
    report = verify_stream(_numbered(wires_a + wires_b))
    assert report.finding is not None
    assert report.finding.stream_seq == 3, report.finding  # a's forged event comes first
    assert "signature invalid" in report.finding.reason
    assert report.events == 2


def test_a_forged_last_event_needs_finish() -> None:
    from dsec_core.audit import Verifier

    signer = Signer("policy", SigningKey.generate())
    wires = _log(signer, n=3)
    _forge_from(wires, 3)
    verifier = Verifier()
    assert all(verifier.feed(seq, wire) is None for seq, wire in _numbered(wires))
    report = verifier.finish()
    assert report.finding is not None and report.finding.stream_seq == 4
    assert verifier.finish() is report  # idempotent


def test_signature_interval_must_be_positive() -> None:
    from dsec_core.audit import Verifier

    with pytest.raises(ValueError, match="signature_every must be >= 1, got 0"):
        Verifier(0)
    signer = Signer("policy", SigningKey.generate())
    wires = _log(signer, n=5)
    _forge_from(wires, 3)
    report = verify_stream(_numbered(wires), signature_every=1)  # a naive full check agrees
    assert report.finding is not None and report.finding.stream_seq == 4
