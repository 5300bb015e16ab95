"""The fast canonical encoder (msgspec, sorted) writes exactly the reference canonical bytes.

The signer builds envelopes with :func:`dsec_core.canonical.pack_json` instead of walking them
with :func:`canonicalize` and packing with msgpack. The wire contract (docs/events.md, section 3)
must not move by one byte: checked here on generated JSON values and on every event type, against
the reference encoding the signer used before (canonicalize + ``msgpack.packb``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, get_args, get_origin
from unittest import mock

import pytest
from dsec_core import canonical
from dsec_core.events import (
    EVENT_MODELS,
    GpuInfo,
    NodeInventory,
    Payload,
    SandboxStopRequested,
)
from dsec_core.signing import Signer, envelope_hash, verify_raw
from dsec_core.subjects import subject_for
from dsec_testing.plans import minimal_plan
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from nacl.signing import SigningKey
from pydantic import BaseModel, ValidationError

pytestmark = pytest.mark.unit

# Every value a JSON-mode dump can hold, at the edges of each MessagePack size class.
_INTS = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.sampled_from(
        [
            *(0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1),
            *(-32, -33, -128, -129, -32768, -32769, -(2**31), -(2**31) - 1, -(2**63)),
        ]
    ),
)
_TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["", "a" * 31, "a" * 32, "é" * 16, "a" * 255, "a" * 256, "ü" * 33000]),
)
_SCALARS = st.one_of(
    st.none(), st.booleans(), _INTS, st.floats(allow_nan=False), _TEXT, st.just(5.0)
)
JSON = st.recursive(
    _SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=20),
        st.dictionaries(_TEXT, inner, max_size=20),
    ),
    max_leaves=30,
)


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(JSON)
def test_fast_encoder_matches_the_reference_on_json_values(value: Any) -> None:
    assert canonical.pack_json(value) == canonical.canonical_bytes(value)


def test_fast_encoder_sorts_keys_by_code_point_and_writes_floats_as_float64() -> None:
    value = {"é": 1, "z": 2.0, "Z": [3, {"b": None, "a": True}], "\U0001f600": 4, "\uffff": 5}
    assert canonical.pack_json(value) == canonical.canonical_bytes(value)
    assert canonical.pack_json({"x": 5.0}) == bytes.fromhex("81a178cb4014000000000000")
    many = {f"k{i:02}": i for i in range(17)}  # a map 16 header, as the envelope's
    assert canonical.pack_json(many)[:3] == bytes.fromhex("de0011")


def _pattern(annotation: Any, metadata: Any = ()) -> str | None:
    """The regex a string field must match (``Field``'s metadata, or ``Annotated`` in the hint)."""
    for item in (*metadata, *getattr(annotation, "__metadata__", ())):
        if getattr(item, "pattern", None):
            return str(item.pattern)
    return None


def _constrained(model: type[BaseModel]) -> dict[str, Any]:
    """Strategies for the fields hypothesis cannot infer from type hints alone: strings with a
    pattern (optional ones too) and lists of models that have such fields."""
    given: dict[str, Any] = {}
    for name, info in model.model_fields.items():
        pattern = _pattern(info.annotation, info.metadata)
        if pattern is not None:
            given[name] = st.from_regex(pattern, fullmatch=True)
            continue
        args = get_args(info.annotation)
        optional = [a for a in args if a is not type(None)]
        if type(None) in args and len(optional) == 1 and _pattern(optional[0]) is not None:
            given[name] = st.none() | st.from_regex(str(_pattern(optional[0])), fullmatch=True)
        elif get_origin(info.annotation) is list and args and isinstance(args[0], type):
            item = args[0]
            if issubclass(item, BaseModel) and _constrained(item):
                low = next((getattr(m, "min_length", None) for m in info.metadata), None) or 0
                given[name] = st.lists(
                    st.builds(item, **_constrained(item)), min_size=low, max_size=low + 1
                )
    return given


def _strategy(model: type[Payload]) -> st.SearchStrategy[Payload]:
    """Payloads of ``model`` (hypothesis infers the fields; the few it cannot are given)."""
    gpus = st.lists(
        st.builds(
            GpuInfo,
            index=st.integers(0, 7),
            uuid=st.text(max_size=8),
            model=st.sampled_from(["H100", "A100"]),
            memory_total_bytes=st.integers(0, 2**40),
            temperature_c=st.none() | st.floats(0, 120),
        ),
        max_size=2,
    )
    inventory = st.builds(NodeInventory, gpus=gpus)
    extra: dict[str, Any] = _constrained(model)
    if "plan" in model.model_fields:  # a whole execution plan: one real one, not generated
        extra["plan"] = st.just(minimal_plan())
    if "inventory" in model.model_fields:
        extra["inventory"] = inventory
    for name in ("errors", "warnings"):
        if name in model.model_fields and model.TYPE == "spec.rejected":
            extra[name] = st.lists(st.dictionaries(_TEXT, _SCALARS, max_size=4), max_size=3)
    return st.builds(model, **extra)


def _reference_wire(signer: Signer, payload: Payload, sealed: Any, tenant: str) -> bytes:
    """The envelope as the signer built it before (canonicalize + msgpack, PyNaCl's sign)."""
    fields: dict[str, Any] = {
        "id": sealed.id,
        "type": payload.TYPE,
        "subject": subject_for(payload.TYPE, "sbx_1"),
        "aggregate": payload.AGGREGATE,
        "aggregate_id": "sbx_1",
        "time": sealed.time.isoformat(),
        "producer": signer.producer,
        "tenant": tenant,
        "causation_id": None,
        "correlation_id": sealed.id,
        "schema_version": payload.VERSION,
        "payload": canonical.canonicalize(payload.model_dump(mode="json")),
        "key_id": signer.key_id,
        "chain": signer.chain,
        "chain_seq": sealed.chain_seq,
        "prev": sealed.prev,
    }
    ordered = dict(sorted(fields.items()))
    ordered["sig"] = signer._key.sign(canonical.pack(ordered)).signature.hex()
    return canonical.pack(dict(sorted(ordered.items())))


SIGNER = Signer("nodeagent", SigningKey(bytes(range(32))))
TIMES = [datetime.fromisoformat("2026-01-02T03:04:05.678901+00:00")]


@pytest.mark.parametrize("model", EVENT_MODELS, ids=lambda m: m.TYPE)
def test_every_event_type_seals_to_the_reference_bytes(model: type[Payload]) -> None:
    payloads = _strategy(model)

    @settings(
        max_examples=8,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    @given(st.data(), st.sampled_from(["system", "team-b", "tënant"]))
    def check(data: st.DataObject, tenant: str) -> None:
        try:
            payload = data.draw(payloads)
        except ValidationError:  # hypothesis drew values the model's constraints refuse
            reject()
        try:
            canonical.canonical_bytes(payload.model_dump(mode="json"))
        except OverflowError:  # an integer beyond 64 bits: no encoding, then as now
            with pytest.raises(OverflowError):
                SIGNER.seal(payload, aggregate_id="sbx_1", tenant=tenant)
            return
        with mock.patch("dsec_core.signing.utcnow", lambda: TIMES[0]):
            sealed = SIGNER.seal(payload, aggregate_id="sbx_1", tenant=tenant)
        assert sealed.wire == _reference_wire(SIGNER, payload, sealed, tenant)
        # what the signer keeps of it agrees with the bytes
        fields = sealed.fields
        assert canonical.pack(fields) == sealed.wire
        assert (fields["chain_seq"], fields["prev"]) == (sealed.chain_seq, sealed.prev)
        assert verify_raw(fields, SIGNER.public_raw)
        reference = canonical.canonical_bytes(payload.model_dump(mode="json"))
        assert canonical.pack(sealed.envelope.payload) == reference  # (bytes: NaN != NaN)

    check()


def test_chain_links_hash_the_wire_bytes() -> None:
    signer = Signer("nodeagent", SigningKey.generate())
    payload = SandboxStopRequested()
    first = signer.seal(payload, aggregate_id="sbx_1")
    second = signer.seal(payload, aggregate_id="sbx_1")
    assert (first.chain_seq, first.prev) == (0, None)
    assert (second.chain_seq, second.prev) == (1, envelope_hash(first.wire))
    signer.rewind(second)
    again = signer.seal(payload, aggregate_id="sbx_1")
    assert (again.chain_seq, again.prev) == (1, envelope_hash(first.wire))
