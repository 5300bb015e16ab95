"""The builder's handler driven through FastStream's in-memory broker, behind the real trust
gate (``dsec_testing.inmemory``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsec_core.events import SpecValidated
from dsec_core.settings import Settings
from dsec_core.spec import compile_plan, load_spec
from dsec_testing.inmemory import in_memory

from dsec_builder.app import create_service

pytestmark = pytest.mark.unit


def _validated(name: str = "agent") -> SpecValidated:
    spec = load_spec(f'version: "1.2"\nname: {name}\nbase: python:3.11\n').spec
    assert spec is not None
    return SpecValidated(name=name, spec_digest="d", plan=compile_plan(spec).model_dump())


async def test_a_validated_spec_without_dependencies_resolves_to_an_empty_lock(
    tmp_path: Path,
) -> None:
    async with in_memory(create_service(Settings(home=tmp_path))) as bus:
        sent = await bus.send("policy", _validated(), "sbx_ok")
        (answer,) = bus.caused_by(sent)
    assert answer.type == "deps.resolved" and answer.producer == "builder"
    assert answer.payload["lock"] == [] and answer.payload["lock_hash"]


async def test_a_plan_not_from_the_policy_service_is_never_built(tmp_path: Path) -> None:
    """Only the policy service may say a spec is valid: a user's spec.validated is refused by
    the gate (security.event_rejected) and the handler never resolves it."""
    async with in_memory(create_service(Settings(home=tmp_path))) as bus:
        forged = await bus.send("user", _validated("mine"), "sbx_forged")
        assert bus.caused_by(forged) == []
        (rejected,) = bus.rejections()
    assert rejected.payload["reason"] == "unauthorized"
    assert rejected.payload["consumer"] == "builder-spec-validated"
    assert "only policy" in rejected.payload["detail"]
