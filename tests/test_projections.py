"""Postgres read models projected from the log: `dsec sandbox list/show`, exactly-once
application, and `dsec projections rebuild` giving the same rows."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import nats
import pytest
from dsec_core.bus import ensure_stream, replay
from dsec_core.events import (
    DepsConflict,
    DepsResolved,
    EnvBuilt,
    SandboxExited,
    SandboxReady,
    SandboxScheduled,
    SpecRejected,
    SpecSubmitted,
    SpecValidated,
)
from dsec_core.projections import Projector, apply_batch, ensure_schema
from dsec_testing import trust
from nats.js import JetStreamContext

pytestmark = pytest.mark.integration


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_stream(js)
    yield js
    await nc.close()


def _sid() -> str:
    return f"sbx_{uuid.uuid4().hex[:12]}"


async def _lifecycle(js: JetStreamContext, home: Path) -> tuple[str, str, str]:
    p = await trust.pipeline(js, home)
    ok, bad, conflict = _sid(), _sid(), _sid()
    await p.user.publish(SpecSubmitted(spec_yaml="name: a", filename="a.yaml"), aggregate_id=ok)
    await p.policy.publish(
        SpecValidated(name="agent-a", spec_digest="d1", plan={"x": 1}), aggregate_id=ok
    )
    await p.builder.publish(
        DepsResolved(lock=[], lock_hash="l1", python="3.11", platform="x", resolve_ms=1.0),
        aggregate_id=ok,
    )
    await p.builder.publish(
        EnvBuilt(
            lock_hash="l1", fingerprint="f", object_key="envs/l1.tar.zst", digest="d", size_bytes=1,
            reused=False,
        ),
        aggregate_id=ok,
    )  # fmt: skip
    # the node agent of n1 speaks for it only once it is scheduled there
    await p.scheduler.publish(SandboxScheduled(node_id="n1"), aggregate_id=ok)
    await p.nodeagent.publish(SandboxReady(node_id="n1", pid=42, cgroup="/c"), aggregate_id=ok)
    await p.nodeagent.publish(
        SandboxExited(exit_code=0, reason="ok", duration_s=2.0), aggregate_id=ok
    )
    await p.user.publish(SpecSubmitted(spec_yaml="nme: b", filename="b.yaml"), aggregate_id=bad)
    await p.policy.publish(
        SpecRejected(
            errors=[{"file": "b.yaml", "line": 1, "column": 1, "message": "unknown field 'nme'"}]
        ),
        aggregate_id=bad,
    )
    await p.user.publish(SpecSubmitted(spec_yaml="name: c"), aggregate_id=conflict)
    await p.policy.publish(
        SpecValidated(name="agent-c", spec_digest="d3", plan={}), aggregate_id=conflict
    )
    await p.builder.publish(
        DepsConflict(explanation="vllm needs transformers>=4.43.2"), aggregate_id=conflict
    )
    return ok, bad, conflict


async def _project_until(js: JetStreamContext, dsn: str, sandbox: str) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(Projector(js, dsn).run(stop))
    conn = await asyncpg.connect(dsn)
    try:
        for _ in range(400):
            await ensure_schema(conn)
            if await conn.fetchval("SELECT terminal FROM sandboxes WHERE sandbox_id=$1", sandbox):
                return
            await asyncio.sleep(0.05)
        raise AssertionError("projector did not reach the sandbox's terminal event")
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await conn.close()


async def test_lifecycle_is_projected_and_listed(
    js, postgres_dsn, nats_url, dsec_cli, tmp_path, dsec_stack
):
    ok, bad, conflict = await _lifecycle(js, dsec_stack.home)
    await _project_until(js, postgres_dsn, conflict)
    env = {"DSEC_NATS_URL": nats_url, "DSEC_POSTGRES_DSN": postgres_dsn, "DSEC_HOME": str(tmp_path)}
    listed = dsec_cli("sandbox", "list", "--json", env=env)
    assert listed.exit_code == 0
    rows = {r["sandbox_id"]: r for r in listed.last_json()}
    assert rows[ok]["state"] == "exited" and rows[ok]["exit_code"] == 0
    assert rows[ok]["name"] == "agent-a" and rows[ok]["node_id"] == "n1"
    assert rows[bad]["state"] == "rejected"
    assert rows[conflict]["state"] == "conflict"
    assert "transformers>=4.43.2" in rows[conflict]["reason"]

    shown = dsec_cli("sandbox", "show", ok, "--json", env=env)
    detail = shown.last_json()
    assert [e["type"] for e in detail["events"]] == [
        "spec.submitted",
        "spec.validated",
        "deps.resolved",
        "env.built",
        "sandbox.scheduled",
        "sandbox.ready",
        "sandbox.exited",
    ]
    assert detail["spec"]["status"] == "validated"
    rejected = dsec_cli("sandbox", "show", bad, "--json", env=env).last_json()
    assert rejected["spec"]["errors"][0]["message"] == "unknown field 'nme'"
    missing = dsec_cli("sandbox", "show", "sbx_nope", env=env)
    assert missing.exit_code == 2 and "no sandbox 'sbx_nope'" in missing.output

    # this test's sandboxes (other tests put forged events in the shared stream, which the
    # rebuild, verifying, leaves out)
    mine = {ok, bad, conflict}
    before = {
        r["sandbox_id"]: (r["state"], r["exit_code"])
        for r in listed.last_json()
        if r["sandbox_id"] in mine
    }
    rebuilt = dsec_cli("projections", "rebuild", "--json", env=env)
    assert rebuilt.exit_code == 0 and rebuilt.last_json()["applied_seq"] > 0
    after = dsec_cli("sandbox", "list", "--json", "--limit", "1000", env=env).last_json()
    assert {
        r["sandbox_id"]: (r["state"], r["exit_code"]) for r in after if r["sandbox_id"] in before
    } == before


async def test_applying_a_batch_twice_changes_nothing(js, postgres_dsn, dsec_stack) -> None:
    ok, _, _ = await _lifecycle(js, dsec_stack.home)
    batch = [item async for item in replay(js, filter_subject=f"dsec.sandbox.{ok}.>")]
    conn = await asyncpg.connect(postgres_dsn)
    try:
        await ensure_schema(conn)
        await conn.execute("DELETE FROM projection_state")
        await apply_batch(conn, batch)
        first = await conn.fetch("SELECT * FROM sandbox_events WHERE sandbox_id=$1", ok)
        position = await apply_batch(conn, batch)
        second = await conn.fetch("SELECT * FROM sandbox_events WHERE sandbox_id=$1", ok)
        assert position == batch[-1][0]
        assert len(first) == len(second) == 7
    finally:
        await conn.close()


async def test_refusals_summaries_and_reports_are_tallied_per_sandbox(
    js, postgres_dsn, dsec_stack
) -> None:
    from datetime import UTC, datetime

    from dsec_core.events import PolicyReported, PolicyViolation, PolicyViolationSummary

    p = await trust.pipeline(js, dsec_stack.home)
    pub = p.nodeagent
    sid = _sid()
    now = datetime.now(UTC)
    await p.user.publish(SpecSubmitted(spec_yaml="name: a", filename="a.yaml"), aggregate_id=sid)
    await pub.publish(SandboxReady(node_id="n1", pid=42, cgroup="/c"), aggregate_id=sid)
    for _ in range(5):
        await pub.publish(
            PolicyViolation(
                layer="kernel", rule_id="default-deny", action="deny", operation="connect",
                target="10.0.0.1:80/tcp",
            ),
            aggregate_id=sid,
        )  # fmt: skip
    await pub.publish(
        PolicyViolationSummary(
            layer="kernel", rule_id="default-deny", operation="connect", count=99_995,
            first=now, last=now, sample_target="10.0.0.1:80/tcp",
        ),
        aggregate_id=sid,
    )  # fmt: skip
    await pub.publish(
        PolicyReported(rule_id="semantic[0]", action="deny", operation="open", target="/x"),
        aggregate_id=sid,
    )
    await pub.publish(
        SandboxExited(exit_code=-9, reason="policy_flood", duration_s=2.0), aggregate_id=sid
    )
    await _project_until(js, postgres_dsn, sid)
    conn = await asyncpg.connect(postgres_dsn)
    try:
        row = await conn.fetchrow("SELECT * FROM sandboxes WHERE sandbox_id=$1", sid)
        summary = await conn.fetchval(
            "SELECT summary FROM sandbox_events WHERE sandbox_id=$1"
            " AND type='policy.violation_summary'",
            sid,
        )
    finally:
        await conn.close()
    assert (row["refusals"], row["reports"]) == (100_000, 1)
    assert row["reason"] == "policy_flood"
    assert '"count": 99995' in summary
