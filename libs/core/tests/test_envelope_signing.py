"""Envelope wire format, signing, chaining and schema versioning (pure, no servers)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsec_core import canonical
from dsec_core.envelope import MalformedEnvelope, decode, encode
from dsec_core.events import (
    EVENT_TYPES,
    SandboxExited,
    SpecSubmitted,
    UnknownEventType,
    UnsupportedSchemaVersion,
    decode_payload,
)
from dsec_core.ids import derive_event_id
from dsec_core.signing import Signer, envelope_hash, load_or_create_key, verify_signature
from dsec_core.subjects import InvalidSubjectToken, subject_for
from nacl.signing import SigningKey

pytestmark = pytest.mark.unit


def _signer(name: str = "policy") -> Signer:
    return Signer(name, SigningKey.generate())


def test_roundtrip_preserves_every_field_and_signature() -> None:
    signer = _signer()
    sealed = signer.seal(SpecSubmitted(spec_yaml="name: a\n"), aggregate_id="sbx_1")
    env, wire = sealed.envelope, sealed.wire
    back = decode(wire)
    assert back == env
    assert encode(back) == wire
    assert verify_signature(back, signer.public_raw)
    assert back.decoded() == SpecSubmitted(spec_yaml="name: a\n")


def test_subject_follows_convention() -> None:
    assert subject_for("sandbox.ready", "sbx_1") == "dsec.sandbox.sbx_1.ready"
    assert subject_for("spec.submitted", "sbx_1") == "dsec.sandbox.sbx_1.spec.submitted"
    with pytest.raises(InvalidSubjectToken, match="one subject token"):
        subject_for("sandbox.ready", "a.b")


def test_altered_payload_breaks_signature() -> None:
    signer = _signer()
    env = signer.seal(
        SandboxExited(exit_code=0, reason="ok", duration_s=1.0), aggregate_id="sbx_1"
    ).envelope
    forged = env.model_copy(update={"payload": {**env.payload, "exit_code": 1}})
    assert not verify_signature(forged, signer.public_raw)


def test_chain_links_each_envelope_to_the_previous() -> None:
    signer = _signer()
    sealed1 = signer.seal(SpecSubmitted(spec_yaml="a"), aggregate_id="sbx_1")
    first, wire1 = sealed1.envelope, sealed1.wire
    second = signer.seal(SpecSubmitted(spec_yaml="b"), aggregate_id="sbx_2").envelope
    assert (first.chain_seq, first.prev) == (0, None)
    assert second.chain_seq == 1
    assert second.prev == envelope_hash(wire1)
    assert second.chain == first.chain


def test_derived_ids_are_stable_and_distinct() -> None:
    assert derive_event_id("a", "deps.resolved#0") == derive_event_id("a", "deps.resolved#0")
    assert derive_event_id("a", "deps.resolved#0") != derive_event_id("b", "deps.resolved#0")
    assert derive_event_id("a", "deps.resolved#0") != derive_event_id("a", "deps.conflict#0")


def test_newer_minor_version_still_decodes_newer_major_is_refused() -> None:
    payload = {"exit_code": 0, "reason": "ok", "duration_s": 1.0, "added_in_1_9": True}
    decoded = decode_payload("sandbox.exited", "1.9", payload)
    assert decoded == SandboxExited(exit_code=0, reason="ok", duration_s=1.0)
    with pytest.raises(UnsupportedSchemaVersion, match=r"understands 1\.x"):
        decode_payload("sandbox.exited", "2.0", payload)
    with pytest.raises(UnknownEventType, match="known:"):
        decode_payload("sandbox.exploded", "1.0", {})


def test_same_minor_version_rejects_unknown_fields() -> None:
    with pytest.raises(ValueError, match="added"):
        decode_payload(
            "sandbox.exited", "1.0", {"exit_code": 0, "reason": "ok", "duration_s": 1, "added": 1}
        )


def test_models_are_frozen() -> None:
    event = SandboxExited(exit_code=0, reason="ok", duration_s=1.0)
    with pytest.raises(ValueError, match="frozen"):
        event.exit_code = 3  # type: ignore[misc]


def test_malformed_bytes_name_the_problem() -> None:
    with pytest.raises(MalformedEnvelope, match="not MessagePack"):
        decode(b"\xc1")
    with pytest.raises(MalformedEnvelope, match="must be a map"):
        decode(canonical.pack([1, 2]))
    with pytest.raises(MalformedEnvelope, match="invalid envelope field"):
        decode(canonical.pack({"id": "x"}))


def test_every_event_type_has_a_documented_model() -> None:
    for event_type, model in EVENT_TYPES.items():
        assert event_type == model.TYPE
        assert (model.__doc__ or "").strip(), f"{event_type} has no docstring"
        assert model.model_config.get("frozen") is True


def test_key_file_is_created_once_with_private_mode(tmp_path: Path) -> None:
    path = tmp_path / "keys" / "svc.key"
    key = load_or_create_key(path)
    again = load_or_create_key(path)
    assert bytes(key) == bytes(again)
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_canonical_mapping_is_taken_as_is_and_packs_the_same() -> None:
    inner = {"b": [1, (2, 3)], "a": {"z": 1, "y": 2}}
    made = canonical.Canonical(canonical.canonicalize(inner))
    assert list(made) == ["a", "b"] and made["b"] == [1, [2, 3]]
    outer = canonical.canonicalize({"x": made, "w": 0})
    assert outer["x"] is made  # not walked again
    assert canonical.pack(outer) == canonical.canonical_bytes({"x": inner, "w": 0})


def test_the_light_aggregate_table_is_the_models_own() -> None:
    """Routing (subject_for) and the audit verifier read each type's aggregate from
    dsec_core.eventtypes, not from the models: the table must name every type, each with its
    model's aggregate, and an unknown type must fail there as it fails in model_for."""
    from dsec_core.events import EVENT_TYPES, model_for
    from dsec_core.eventtypes import AGGREGATES, aggregate_of

    assert {t: m.AGGREGATE for t, m in EVENT_TYPES.items()} == AGGREGATES, (
        "dsec_core/eventtypes.py's AGGREGATES is out of date: add or change the event type there"
    )
    with pytest.raises(UnknownEventType) as light:
        aggregate_of("sandbox.exploded")
    with pytest.raises(UnknownEventType) as full:
        model_for("sandbox.exploded")
    assert str(light.value) == str(full.value)


def test_the_audit_verifier_loads_neither_the_event_models_nor_nats() -> None:
    """``dsec audit verify``'s verifier process imports dsec_core.audit while the reader reads:
    it must stay that small (the event models and the spec models are a fifth of a second)."""
    import subprocess
    import sys

    code = (
        "import sys, dsec_core.audit; "
        "print(sorted(m for m in sys.modules if m in ('dsec_core.events', 'dsec_core.spec', "
        "'dsec_core.trust', 'dsec_core.signing', 'dsec_core.envelope') or m.startswith('nats')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("value", ["sbx_1\n", "n1\n", "sbx_1\r", "sbx 1", ""])
def test_names_that_become_subjects_paths_or_permissions_refuse_a_trailing_newline(
    value: str,
) -> None:
    """Each validator matched with ``^...$``, and ``$`` matches before a final newline: an id
    ``"sbx_1\\n"`` passed as a subject token, a NATS node id or a sandbox id of a path."""
    from dsec_core import natsperms, remote
    from dsec_core.layout import LayoutError, NodeLayout
    from dsec_core.subjects import InvalidSubjectToken, subject_for, token_problem

    assert token_problem(value) is not None
    with pytest.raises(InvalidSubjectToken):
        subject_for("sandbox.exited", value)
    with pytest.raises(ValueError):
        natsperms.durable_name("nodeagent", "sandbox.exited", value)
    with pytest.raises(remote.RemoteError):
        remote.request_subject(value, "logs")
    with pytest.raises(LayoutError):
        NodeLayout.of(Path("/tmp/dsec-layout-test")).sandbox(value)
