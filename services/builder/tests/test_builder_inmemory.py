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


async def test_the_builder_removes_what_a_killed_build_left_half_written_at_start(
    tmp_path: Path,
) -> None:
    """A builder killed mid-download or mid-upload leaves a staged file; the next start
    removes those older than an hour, and leaves younger ones (another builder's, at work)."""
    import os
    import time

    from dsec_builder.adapters.archives import EnvArchives
    from dsec_builder.handlers import LEFTOVER_AGE_S, BuilderHandlers

    handlers = BuilderHandlers(Settings(home=tmp_path / "home"))
    incoming = handlers.builder.cache.staging_file()  # (makes .incoming)
    handlers.archives = EnvArchives(None, "b", tmp_path / "archives")  # type: ignore[arg-type]
    (tmp_path / "archives").mkdir()
    old = [incoming, tmp_path / "archives" / ".abc.1234.tar.zst"]
    young = [handlers.builder.cache.staging_file(), tmp_path / "archives" / ".def.5678.tar.zst"]
    kept = tmp_path / "archives" / "abc.json"  # a record, not a leftover
    for path in [*old, *young, kept]:
        path.write_bytes(b"x")
    long_ago = time.time() - LEFTOVER_AGE_S - 60
    for path in [*old, kept]:
        os.utime(path, (long_ago, long_ago))
    await handlers.sweep()
    assert [p.exists() for p in old] == [False, False]
    assert all(p.exists() for p in [*young, kept])
    await handlers.close()
