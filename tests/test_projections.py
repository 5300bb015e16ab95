"""Postgres read models projected from the log: `dsec sandbox list/show`, exactly-once
application, and `dsec projections rebuild` giving the same rows."""

from __future__ import annotations

import asyncio
import re
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import nats
import pytest
from dsec_core.bus import EventPublisher, ensure_stream, replay
from dsec_core.events import (
    DepsConflict,
    DepsResolved,
    EnvBuilt,
    SandboxExited,
    SandboxPending,
    SandboxReady,
    SandboxRestarted,
    SandboxScheduled,
    SpecRejected,
    SpecSubmitted,
    SpecValidated,
    UnitLost,
)
from dsec_core.projections import (
    LiveState,
    Projector,
    applied_seq,
    apply_batch,
    ensure_schema,
    live_states,
    watch_live_states,
)
from dsec_core.spec import compile_plan, load_spec
from dsec_testing import trust
from nats.js import JetStreamContext

pytestmark = pytest.mark.integration

_SPEC = load_spec('version: "1.2"\nname: agent\nbase: python:3.11\n').spec
assert _SPEC is not None
PLAN = compile_plan(_SPEC).model_dump(mode="json")


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_stream(js)
    yield js
    await nc.close()


def _sid() -> str:
    return f"sbx_{uuid.uuid4().hex[:12]}"


async def _scheduler(js: JetStreamContext, home: Path) -> EventPublisher:
    return await trust.publisher(js, home, "scheduler", acts_for="default")


async def _built(p: trust.Pipeline, sid: str, name: str = "agent") -> None:
    """spec.submitted .. env.built of ``sid``, each from its real producer."""
    await p.user.publish(SpecSubmitted(spec_yaml=f"name: {name}"), aggregate_id=sid)
    await p.policy.publish(SpecValidated(name=name, spec_digest="d", plan=PLAN), aggregate_id=sid)
    await p.builder.publish(
        DepsResolved(lock=[], lock_hash="l1", python="3.11", platform="x", resolve_ms=1.0),
        aggregate_id=sid,
    )
    await p.builder.publish(
        EnvBuilt(
            lock_hash="l1",
            fingerprint="f",
            object_key="envs/l1.tar.zst",
            digest="d",
            size_bytes=1,
            reused=False,
        ),
        aggregate_id=sid,
    )


async def _lifecycle(js: JetStreamContext, home: Path) -> tuple[str, str, str]:
    p = await trust.pipeline(js, home)
    ok, bad, conflict = _sid(), _sid(), _sid()
    await p.user.publish(SpecSubmitted(spec_yaml="name: a", filename="a.yaml"), aggregate_id=ok)
    await p.policy.publish(
        SpecValidated(name="agent-a", spec_digest="d1", plan=PLAN), aggregate_id=ok
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
        SpecValidated(name="agent-c", spec_digest="d3", plan=PLAN), aggregate_id=conflict
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


async def test_a_rebuild_beside_a_running_projector_keeps_the_whole_history(
    js, postgres_dsn, nats_url, dsec_cli, tmp_path, dsec_stack
) -> None:
    """The scheduler's projector keeps running, and events keep coming, while an operator
    rebuilds: the live projector once wrote its position into the fresh tables, and the replay
    then skipped everything before it."""
    ok, bad, _ = await _lifecycle(js, dsec_stack.home)
    env = {"DSEC_NATS_URL": nats_url, "DSEC_POSTGRES_DSN": postgres_dsn, "DSEC_HOME": str(tmp_path)}
    stop, quiet = asyncio.Event(), asyncio.Event()
    live = asyncio.create_task(Projector(js, postgres_dsn).run(stop))
    scheduler = await _scheduler(js, dsec_stack.home)
    last = [0]

    async def traffic() -> None:
        # events no service acts on: a rejected sandbox "waits" (its lifecycle refuses them;
        # the read models still record them), at most 300, and no request for any queue
        for _ in range(300):
            if quiet.is_set():
                return
            sent = await scheduler.publish(SandboxPending(reason="test traffic"), aggregate_id=bad)
            last[0] = sent.stream_seq
            await asyncio.sleep(0.02)

    flowing = asyncio.create_task(traffic())
    try:
        await _project_until(js, postgres_dsn, ok)
        rebuilt = await asyncio.to_thread(dsec_cli, "projections", "rebuild", "--json", env=env)
        assert rebuilt.exit_code == 0, rebuilt.output
    finally:
        quiet.set()
        await flowing
    try:
        shown = dsec_cli("sandbox", "show", ok, "--json", env=env)
        assert shown.exit_code == 0, shown.output
        assert len(shown.last_json()["events"]) == 7  # its whole timeline, from the replay
        conn = await asyncpg.connect(postgres_dsn)
        try:  # and what came during and after the rebuild, from the live projector
            for _ in range(200):
                if await applied_seq(conn) >= last[0]:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the live projector did not go on after the rebuild")
        finally:
            await conn.close()
    finally:
        stop.set()
        await asyncio.wait_for(live, 15)


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
    await _built(p, sid)
    await (await _scheduler(js, dsec_stack.home)).publish(
        SandboxScheduled(node_id="n1"), aggregate_id=sid
    )
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


async def test_pending_scheduled_and_refused_events_as_the_fold_says(
    js, postgres_dsn, nats_url, dsec_cli, tmp_path, dsec_stack
) -> None:
    """A waiting sandbox shows why; a scheduled one its node and attempt; an event that cannot
    follow the state (a second `sandbox.ready`) changes nothing and stays in the timeline."""
    p = await trust.pipeline(js, dsec_stack.home)
    scheduler = await _scheduler(js, dsec_stack.home)
    waiting, moved = _sid(), _sid()
    await _built(p, waiting, "waits")
    await scheduler.publish(
        SandboxPending(reason="n1: needs 64.0 GiB memory, 8.0 GiB free"), aggregate_id=waiting
    )
    await _built(p, moved, "moves")
    await scheduler.publish(SandboxPending(reason="no node"), aggregate_id=moved)
    await scheduler.publish(SandboxScheduled(node_id="n1", attempt=2), aggregate_id=moved)
    await p.nodeagent.publish(SandboxReady(node_id="n1", pid=7, cgroup="/c"), aggregate_id=moved)
    await p.nodeagent.publish(SandboxReady(node_id="n1", pid=8, cgroup="/c"), aggregate_id=moved)
    await p.nodeagent.publish(
        SandboxExited(exit_code=3, reason="error", duration_s=1.0), aggregate_id=moved
    )
    await p.nodeagent.publish(SandboxReady(node_id="n1", pid=9, cgroup="/c"), aggregate_id=moved)
    lost = _sid()
    await _built(p, lost, "lost")
    await scheduler.publish(SandboxScheduled(node_id="n1"), aggregate_id=lost)
    await p.nodeagent.publish(SandboxReady(node_id="n1", pid=5, cgroup="/c"), aggregate_id=lost)
    await scheduler.publish(
        UnitLost(node_id="n1", reason="node n1 silent for 15 s", action="reschedule", attempt=1),
        aggregate_id=lost,
    )
    await _project_until(js, postgres_dsn, moved)
    env = {"DSEC_NATS_URL": nats_url, "DSEC_POSTGRES_DSN": postgres_dsn, "DSEC_HOME": str(tmp_path)}

    rows = {
        r["sandbox_id"]: r
        for r in dsec_cli("sandbox", "list", "--json", "--limit", "1000", env=env).last_json()
    }
    assert rows[waiting]["state"] == "pending" and rows[waiting]["node_id"] is None
    assert rows[waiting]["reason"] == "n1: needs 64.0 GiB memory, 8.0 GiB free"
    done = rows[moved]
    assert (done["state"], done["node_id"], done["attempt"]) == ("exited", "n1", 2)
    assert (done["exit_code"], done["reason"]) == (3, "error")
    assert (rows[lost]["state"], rows[lost]["reason"]) == ("lost", "node n1 silent for 15 s")

    wide = {**env, "COLUMNS": "250"}
    table = dsec_cli("sandbox", "list", "--state", "pending", "--limit", "1000", env=wide).output
    # The node column's width depends on the other pending sandboxes in the shared stack.
    assert re.search(r"┃ node +┃", table), table
    line = next(row for row in table.splitlines() if waiting in row)
    assert "pending (n1: needs 64.0 GiB memory, 8.0 GiB free)" in line
    listed = dsec_cli("sandbox", "list", "--limit", "1000", env=wide).output
    assert "lost (node n1 silent for 15 s)" in next(r for r in listed.splitlines() if lost in r)

    shown = dsec_cli("sandbox", "show", moved, "--json", env=env).last_json()
    timeline = [(e["type"], e["summary"].get("refused")) for e in shown["events"]]
    assert timeline[-5:] == [
        ("sandbox.scheduled", None),
        ("sandbox.ready", None),
        ("sandbox.ready", "sandbox.ready cannot follow state 'running'"),
        ("sandbox.exited", None),
        ("sandbox.ready", "sandbox.ready cannot follow state 'exited'"),
    ]
    text = dsec_cli("sandbox", "show", moved, env=env).output
    assert "node: n1 (placement attempt 2)" in text


async def test_a_restarted_sandbox_stays_running_and_shows_its_restarts(
    js, postgres_dsn, nats_url, dsec_cli, tmp_path, dsec_stack
) -> None:
    """`sandbox.restarted` (a stateful sandbox started again in place) keeps it running in the
    read model, with its restarts counted in `dsec sandbox show` and kept after its exit."""
    p = await trust.pipeline(js, dsec_stack.home)
    scheduler = await _scheduler(js, dsec_stack.home)
    alive, ended = _sid(), _sid()
    for sid in (alive, ended):
        await _built(p, sid, "stateful")
        await scheduler.publish(SandboxScheduled(node_id="n1"), aggregate_id=sid)
        await p.nodeagent.publish(SandboxReady(node_id="n1", pid=7, cgroup="/c"), aggregate_id=sid)
        for n in (1, 2):
            await p.nodeagent.publish(
                SandboxRestarted(restarts=n, exit_code=None, signal=9, reason="error", pid=7 + n),
                aggregate_id=sid,
            )
    await p.nodeagent.publish(
        SandboxExited(exit_code=-1, reason="error", duration_s=3.0, detail="restarted 2 times"),
        aggregate_id=ended,
    )
    await _project_until(js, postgres_dsn, ended)
    env = {"DSEC_NATS_URL": nats_url, "DSEC_POSTGRES_DSN": postgres_dsn, "DSEC_HOME": str(tmp_path)}

    shown = dsec_cli("sandbox", "show", alive, "--json", env=env).last_json()
    assert (shown["state"], shown["restarts"], shown["node_id"]) == ("running", 2, "n1")
    restarted = [e for e in shown["events"] if e["type"] == "sandbox.restarted"]
    assert [e["summary"] for e in restarted] == [
        {"reason": "error", "exit_code": None, "restarts": 1, "signal": 9},
        {"reason": "error", "exit_code": None, "restarts": 2, "signal": 9},
    ]
    text = dsec_cli("sandbox", "show", alive, env=env).output
    assert "state running" in text and "restarted 2 times" in text
    final = dsec_cli("sandbox", "show", ended, "--json", env=env).last_json()
    assert (final["state"], final["restarts"]) == ("exited", 2)


async def test_live_states_count_live_sandboxes_and_age_the_oldest(postgres_dsn) -> None:
    """The stuck-request gauges' source: live sandboxes by state and the age of the oldest's
    last event; ended ones are not counted (a schema of its own: the shared tables hold other
    tests' rows)."""
    schema = f"t_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(postgres_dsn)
    await admin.execute(f"CREATE SCHEMA {schema}")
    dsn = f"{postgres_dsn}{'&' if '?' in postgres_dsn else '?'}search_path={schema}"
    try:
        seen: list[dict[str, LiveState] | None] = []
        stop = asyncio.Event()

        def sink(states: dict[str, LiveState] | None) -> None:
            seen.append(states)
            stop.set()

        # it creates the tables it reads when the projector has not yet
        await asyncio.wait_for(watch_live_states(dsn, stop, sink, interval_s=60), 30)
        assert seen == [{}]
        conn = await asyncpg.connect(dsn)
        try:
            for sid, state, terminal, minutes in (
                ("sbx_a", "submitted", False, 20),
                ("sbx_b", "submitted", False, 1),
                ("sbx_c", "running", False, 120),
                ("sbx_d", "exited", True, 300),
            ):
                await conn.execute(
                    "INSERT INTO sandboxes (sandbox_id, state, terminal, created_at, updated_at,"
                    " last_event, last_seq) VALUES ($1, $2, $3, now() - make_interval(mins => $4),"
                    " now() - make_interval(mins => $4), 'x', 1)",
                    sid,
                    state,
                    terminal,
                    minutes,
                )
            states = await live_states(conn)
        finally:
            await conn.close()
        assert set(states) == {"submitted", "running"}
        assert states["submitted"].count == 2 and states["running"].count == 1
        assert 20 * 60 <= states["submitted"].oldest_s < 21 * 60
        assert 120 * 60 <= states["running"].oldest_s < 121 * 60
    finally:
        await admin.execute(f"DROP SCHEMA {schema} CASCADE")
        await admin.close()
