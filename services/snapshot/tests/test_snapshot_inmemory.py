"""The snapshot service's handlers driven through FastStream's in-memory broker, behind the real
trust gate (``dsec_testing.inmemory``); the store is the real S3 server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dsec_core import events
from dsec_core.settings import Settings
from dsec_core.spec import compile_plan, load_spec
from dsec_testing.inmemory import MemoryBus, in_memory

from dsec_snapshot.app import create_service

SPEC = 'version: "1.2"\nname: agent\nbase: python:3.11\n'


async def _submitted_and_validated(bus: MemoryBus, sid: str) -> None:
    spec = load_spec(SPEC).spec
    assert spec is not None
    plan = compile_plan(spec).model_dump()
    await bus.send("user", events.SpecSubmitted(spec_yaml=SPEC), sid, deliver=False)
    validated = events.SpecValidated(name="agent", spec_digest="d", plan=plan)
    await bus.send("policy", validated, sid, deliver=False)


def _settings(home: Path, s3: Any, vault: Any) -> Settings:
    """The service's settings on the test servers (S3 and OpenBao)."""
    return Settings(
        home=home,
        s3_endpoint=s3.endpoint,
        s3_access_key=s3.access_key,
        s3_secret_key=s3.secret_key,
        s3_bucket=s3.bucket,
        vault_addr=vault.addr,
        vault_token=vault.token,
    )


@pytest.mark.integration
async def test_a_requested_snapshot_is_taken_and_signed_by_the_service(
    tmp_path: Path, s3, vault
) -> None:
    settings = _settings(tmp_path, s3, vault)
    async with in_memory(create_service(settings)) as bus:
        await _submitted_and_validated(bus, "sbx_snap")
        name = f"inmem-{tmp_path.name[-12:]}"
        sent = await bus.send("user", events.SnapshotRequested(name=name), "sbx_snap")
        (answer,) = bus.caused_by(sent)
    assert answer.type == "snapshot.taken", answer.payload
    assert answer.producer == "snapshot" and answer.payload["snapshot"] == name


@pytest.mark.unit
async def test_a_rollback_of_a_sandbox_that_does_not_run_is_refused(tmp_path: Path) -> None:
    """The sandbox never ran (no sandbox.scheduled/ready): snapshot.failed says so, and a
    rollback request signed by another tenant's user is refused by the gate."""
    async with in_memory(create_service(Settings(home=tmp_path)), run_hooks=False) as bus:
        await _submitted_and_validated(bus, "sbx_idle")
        request = events.SnapshotRestoreRequested(snapshot="s1")
        sent = await bus.send("user", request, "sbx_idle")
        (answer,) = bus.caused_by(sent)
        other = await bus.send("user", request, "sbx_idle", tenant="acme")
        assert bus.caused_by(other) == []
        (rejected,) = bus.rejections()
    assert answer.type == "snapshot.failed" and answer.payload["operation"] == "restore"
    assert "sandbox sbx_idle is not running" in answer.payload["reason"]
    assert rejected.payload["reason"] == "cross-tenant"


@pytest.mark.integration
async def test_a_request_delivered_again_after_its_answer_does_not_act_again(
    tmp_path: Path, s3, vault
) -> None:
    """JetStream delivers a request again when its ack is lost or its wait runs out: answered
    already (its answer is in the sandbox's history), it is not acted on twice, so a snapshot
    the user deleted meanwhile is not taken again."""
    from dsec_snapstore.adapters.objectstore import S3ObjectStore
    from dsec_snapstore.manifest import manifest_key, summary_key

    settings = _settings(tmp_path, s3, vault)
    objects = S3ObjectStore(s3.endpoint, s3.access_key, s3.secret_key, s3.bucket)
    async with in_memory(create_service(settings)) as bus:
        await _submitted_and_validated(bus, "sbx_again")
        name = f"again-{tmp_path.name[-12:]}"
        sent = await bus.send("user", events.SnapshotRequested(name=name), "sbx_again")
        (answer,) = bus.caused_by(sent)
        assert answer.type == "snapshot.taken"
        objects.delete_many([manifest_key(name), summary_key(name)])  # the user's rm, say
        seq = bus.log.seq_of_id(sent.id)
        _, subject, data = bus.log.records[seq - 1]
        await bus.deliver(data, subject)  # the same request, delivered again
        assert [e.id for e in bus.caused_by(sent)] == [answer.id]
    assert not objects.exists(manifest_key(name))
