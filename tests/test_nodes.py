"""Nodes on the bus: the node agent's heartbeat arrives signed and authorized, a node agent
cannot speak for another node, the nodes read model follows the node events, and `dsec node`
lists nodes and asks the scheduler to cordon/uncordon/drain (answered here by a test publisher
certified as the scheduler, on a real NATS)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import nats
import pytest
from dsec_core.bus import EventPublisher, ensure_stream, follow
from dsec_core.events import NodeCordoned, NodeHeartbeat, NodeInventory, NodeJoined, NodeLost
from dsec_core.settings import Settings
from dsec_core.subjects import STREAM, filter_for
from dsec_core.trust import Gate, KeyRing, unpack_fields
from dsec_nodeagent.heartbeat import Heartbeat
from dsec_nodeagent.inventory import Inventory
from dsec_testing import trust
from dsec_testing.stack import StackFixture
from nats.js import JetStreamContext

pytestmark = pytest.mark.integration


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_stream(js)
    yield js
    await nc.close()


def _node() -> str:
    return f"n-{uuid.uuid4().hex[:8]}"


def _gate(js: JetStreamContext, home: Path) -> Gate:
    root = trust.stack_root(home)
    return Gate(KeyRing(js._nc, js, bytes(root.verify_key)), js, None)


async def _messages(js: JetStreamContext, subject: str, start: int) -> list[bytes]:
    """Every message on ``subject`` from stream sequence ``start`` on (as stored now)."""
    out: list[bytes] = []
    seq = start
    while True:
        try:
            msg = await js.get_msg(STREAM, seq=seq, subject=subject, next=True)
        except Exception:  # nothing more on that subject
            return out
        out.append(msg.data)
        seq = msg.seq + 1


async def _heartbeat(js: JetStreamContext, home: Path, node_id: str, cert_node: str) -> Heartbeat:
    publisher = await trust.publisher(js, home, "nodeagent", node_id=cert_node, acts_for="system")

    async def publish(payload: object, aggregate_id: str) -> None:
        await publisher.publish(payload, aggregate_id=aggregate_id)  # type: ignore[arg-type]

    settings = Settings(home=home, node_id=node_id, node_labels="zone=t")
    return Heartbeat(
        node_id, "0.1.0", 0.2, Inventory(settings, list), publish,
        sandboxes=lambda: ["sbx_a"], problems=lambda: ["disk nearly full"],
    )  # fmt: skip


async def test_a_heartbeat_arrives_signed_and_authorized(
    js: JetStreamContext, dsec_stack: StackFixture
) -> None:
    node_id = _node()
    start = (await js.stream_info(STREAM)).state.last_seq + 1
    beat = await _heartbeat(js, dsec_stack.home, node_id, cert_node=node_id)
    await beat.start()
    try:
        deadline = time.monotonic() + 10
        while len(await _messages(js, filter_for("node.heartbeat", node_id), start)) < 2:
            assert time.monotonic() < deadline, "no two heartbeats within 10 s"
            await asyncio.sleep(0.1)
    finally:
        await beat.stop()
    gate = _gate(js, dsec_stack.home)
    (joined,) = await _messages(js, filter_for("node.joined", node_id), start)
    env = await gate.authentic(joined)
    assert env is not None and env.aggregate_id == node_id and env.producer == "nodeagent"
    assert env.payload["heartbeat_s"] == 0.2 and env.payload["inventory"]["cpus"] > 0
    first, second, *_ = await _messages(js, filter_for("node.heartbeat", node_id), start)
    envs = [await gate.authentic(data) for data in (first, second)]
    assert all(e is not None for e in envs)
    beats = [NodeHeartbeat.model_validate(e.payload) for e in envs if e is not None]
    assert [b.seq for b in beats] == [1, 2]
    assert beats[0].sandboxes == ["sbx_a"] and beats[0].problems == ["disk nearly full"]
    assert beats[0].inventory.labels == {"zone": "t"}
    assert beats[0].inventory.gpu_probe.startswith("no NVML: ")  # this machine has no GPU


async def test_a_node_agent_cannot_heartbeat_for_another_node(
    js: JetStreamContext, dsec_stack: StackFixture
) -> None:
    mine, other = _node(), _node()
    start = (await js.stream_info(STREAM)).state.last_seq + 1
    beat = await _heartbeat(js, dsec_stack.home, other, cert_node=mine)
    await beat.beat()
    (data,) = await _messages(js, filter_for("node.heartbeat", other), start)
    gate = _gate(js, dsec_stack.home)
    assert await gate.authentic(data) is None
    refusal = await gate.check(unpack_fields(data), (await _decoded(data)))
    assert refusal == (
        "unauthorized",
        f"node agent of {mine!r} may not speak for node {other!r}",
    )


async def _decoded(data: bytes):  # type: ignore[no-untyped-def]
    from dsec_core.envelope import decode

    return decode(data)


# ---------------------------------------------------------------------- the read model


def _inventory(gpus: int = 0) -> NodeInventory:
    from dsec_core.events import GpuInfo

    return NodeInventory(
        cpus=8,
        memory_bytes=32 << 30,
        cpus_allocated=1.5,
        memory_allocated_bytes=4 << 30,
        gpus=[
            GpuInfo(index=i, uuid=f"GPU-{i}", model="NVIDIA H100", memory_total_bytes=80 << 30)
            for i in range(gpus)
        ],
        gpu_probe="declared" if gpus else "no NVML: test",
    )


async def _project_until(dsn: str, js: JetStreamContext, home: Path, done: str) -> None:
    """Run the projector (with the trust gate, as the scheduler does) until ``done`` (SQL)
    holds."""
    from dsec_core.projections import NodeProjector, ensure_node_schema

    stop = asyncio.Event()
    task = asyncio.create_task(NodeProjector(js, dsn, _gate(js, home)).run(stop))
    conn = await asyncpg.connect(dsn)
    try:
        await ensure_node_schema(conn)
        deadline = time.monotonic() + 15
        while not await conn.fetchval(done):
            assert time.monotonic() < deadline, f"the nodes table never got to: {done}"
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)
        await conn.close()


async def test_the_nodes_table_follows_node_events_and_node_ls_shows_it(
    js: JetStreamContext, dsec_stack: StackFixture, postgres_dsn: str, dsec_cli, stack_env
) -> None:
    home = dsec_stack.home
    ready, gpu, lost, forged = _node(), _node(), _node(), _node()
    scheduler = await trust.publisher(js, home, "scheduler", acts_for="system")
    for node_id, gpus in ((ready, 0), (gpu, 2), (lost, 0)):
        agent = await trust.publisher(js, home, "nodeagent", node_id=node_id, acts_for="system")
        inv = _inventory(gpus)
        await agent.publish(
            NodeJoined(node_id=node_id, hostname="h", version="1", inventory=inv, heartbeat_s=5),
            aggregate_id=node_id,
        )
        for seq in (1, 2, 3):
            await agent.publish(
                NodeHeartbeat(node_id=node_id, seq=seq, inventory=inv, sandboxes=["sbx_1"]),
                aggregate_id=node_id,
            )
        if node_id == gpu:
            # A node agent of `gpu` claiming `forged` is alive: refused, never projected.
            await agent.publish(
                NodeHeartbeat(node_id=forged, seq=1, inventory=inv), aggregate_id=forged
            )
    await scheduler.publish(NodeLost(node_id=lost, silent_s=20.0), aggregate_id=lost)
    await scheduler.publish(
        NodeCordoned(node_id=gpu, cordoned=True, reason="maintenance"), aggregate_id=gpu
    )
    await _project_until(
        postgres_dsn, js, home, f"SELECT cordoned FROM nodes WHERE node_id = '{gpu}'"
    )

    listed = dsec_cli("node", "ls", "--json", env=stack_env)
    assert listed.exit_code == 0, listed.output
    rows = {r["node_id"]: r for r in listed.last_json()}
    assert forged not in rows
    assert rows[ready]["state"] == "ready"
    assert rows[gpu]["state"] == "cordoned" and rows[gpu]["cordon_reason"] == "maintenance"
    assert rows[lost]["state"] == "lost"
    assert rows[gpu]["gpus"] == {"NVIDIA H100": 2}
    assert (rows[ready]["cpus"], rows[ready]["cpus_free"]) == (8.0, 6.5)
    assert rows[ready]["memory_free_bytes"] == 28 << 30
    assert rows[ready]["sandboxes"] == ["sbx_1"] and rows[ready]["seq"] == 3

    table = dsec_cli("node", "ls", env={**stack_env, "COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    line = next(row for row in table.output.splitlines() if gpu in row)
    assert "cordoned" in line and "NVIDIA H100×2" in line and "6.5/8" in line

    shown = dsec_cli("node", "show", gpu, "--json", env=stack_env)
    assert shown.exit_code == 0, shown.output
    detail = shown.last_json()
    assert [g["uuid"] for g in detail["inventory"]["gpus"]] == ["GPU-0", "GPU-1"]
    table = dsec_cli("node", "show", gpu, env=stack_env)
    assert "GPU 1 NVIDIA H100 GPU-1" in table.output and "cordoned" in table.output

    missing = dsec_cli("node", "show", "no-such-node", env=stack_env)
    assert missing.exit_code == 2 and "no node 'no-such-node' has joined" in missing.output


async def test_a_lost_nodes_heartbeat_replayed_does_not_show_it_alive(
    js: JetStreamContext, dsec_stack: StackFixture, postgres_dsn: str, dsec_cli, stack_env
) -> None:
    """The bytes of a lost node's last heartbeat published again: `dsec node ls` still says
    lost (the projection takes a node event older than what it shows for no sign of life)."""
    home = dsec_stack.home
    dead, marker = _node(), _node()
    agent = await trust.publisher(js, home, "nodeagent", node_id=dead, acts_for="system")
    last = await agent.publish(
        NodeHeartbeat(node_id=dead, seq=1, inventory=_inventory()), aggregate_id=dead
    )
    scheduler = await trust.publisher(js, home, "scheduler", acts_for="system")
    await scheduler.publish(NodeLost(node_id=dead, silent_s=20.0), aggregate_id=dead)
    await js.publish(
        last.sealed.subject, last.sealed.wire, headers={"Nats-Msg-Id": uuid.uuid4().hex}
    )
    other = await trust.publisher(js, home, "nodeagent", node_id=marker, acts_for="system")
    await other.publish(
        NodeHeartbeat(node_id=marker, seq=1, inventory=_inventory()), aggregate_id=marker
    )
    await _project_until(
        postgres_dsn, js, home, f"SELECT count(*) FROM nodes WHERE node_id = '{marker}'"
    )
    listed = dsec_cli("node", "ls", "--json", env=stack_env)
    rows = {r["node_id"]: r for r in listed.last_json()}
    assert rows[dead]["state"] == "lost"


# ---------------------------------------------------------------------- cordon / drain


async def _answer_as_scheduler(js: JetStreamContext, home: Path, start: int) -> None:
    """A certified scheduler: answers each authentic cordon request with ``node.cordoned``
    (its cause: the request); drain moves one sandbox."""
    scheduler: EventPublisher = await trust.publisher(js, home, "scheduler", acts_for="system")
    gate = _gate(js, home)
    async for batch in follow(
        js, filter_subject=filter_for("node.cordon_requested"), start_seq=start, idle_s=0.1
    ):
        for _, data in batch:
            request = await gate.authentic(data)
            if request is None:
                continue
            action = request.payload["action"]
            answer = NodeCordoned(
                node_id=request.aggregate_id,
                cordoned=action != "uncordon",
                draining=action == "drain",
                reason=request.payload["reason"],
                moved=["sbx_moved"] if action == "drain" else [],
            )
            await scheduler.publish(answer, aggregate_id=request.aggregate_id, causation=request)


@contextlib.asynccontextmanager
async def _scheduler(js: JetStreamContext, home: Path) -> AsyncIterator[None]:
    start = (await js.stream_info(STREAM)).state.last_seq + 1
    task = asyncio.create_task(_answer_as_scheduler(js, home, start))
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_cordon_uncordon_and_drain_wait_for_the_scheduler(
    js: JetStreamContext, dsec_stack: StackFixture, dsec_cli, stack_env
) -> None:
    node_id = _node()
    async with _scheduler(js, dsec_stack.home):
        cordoned = await asyncio.to_thread(
            dsec_cli, "node", "cordon", node_id, "--reason", "disk swap", "--json", env=stack_env
        )
        drained = await asyncio.to_thread(
            dsec_cli, "node", "drain", node_id, "--yes", "--json", env=stack_env
        )
        back = await asyncio.to_thread(dsec_cli, "node", "uncordon", node_id, env=stack_env)
    assert cordoned.exit_code == 0, cordoned.output
    result = cordoned.last_json()
    assert (result["ok"], result["cordoned"], result["reason"]) == (True, True, "disk swap")
    assert drained.exit_code == 0, drained.output
    assert drained.last_json()["moved"] == ["sbx_moved"]
    assert back.exit_code == 0 and f"{node_id}: ready" in back.output
    # The requests in the log are the operator's, signed with its key.
    gate = _gate(js, dsec_stack.home)
    requests = await _messages(js, filter_for("node.cordon_requested", node_id), 1)
    envs = [await gate.authentic(data) for data in requests]
    assert [e.payload["action"] for e in envs if e is not None] == ["cordon", "drain", "uncordon"]
    assert {e.producer for e in envs if e is not None} == {"operator"}


def test_without_an_answer_cordon_times_out_and_a_non_operator_is_refused(
    dsec_cli, stack_env, tmp_path: Path
) -> None:
    started = time.monotonic()
    waited = dsec_cli("node", "cordon", _node(), "--timeout", "1", env=stack_env)
    assert waited.exit_code == 4 and "is the scheduler running?" in waited.output
    assert time.monotonic() - started < 10
    stranger = dsec_cli("node", "cordon", _node(), env={**stack_env, "DSEC_HOME": str(tmp_path)})
    assert stranger.exit_code == 2 and "only the operator can do this" in stranger.output
    bad = dsec_cli("node", "drain", "a.b", "--yes", env=stack_env)
    assert bad.exit_code == 2 and "node id" in bad.output


# ---------------------------------------------------------------------- the real node agent


@pytest.mark.e2e
@pytest.mark.kernel
async def test_the_node_agent_joins_and_heartbeats_with_a_declared_inventory(
    js: JetStreamContext, dsec_stack: StackFixture, services, tmp_path: Path
) -> None:
    declared = tmp_path / "node.yaml"
    declared.write_text("gpus:\n  - {model: NVIDIA H200, memory: 141GiB, count: 2, link: NVLINK}\n")
    start = (await js.stream_info(STREAM)).state.last_seq + 1
    env = {
        "DSEC_HEARTBEAT_S": "0.5",
        "DSEC_NODE_INVENTORY": str(declared),
        "DSEC_NODE_LABELS": "zone=e2e",
    }
    await asyncio.to_thread(services.start, "nodeagent", env=env)
    try:
        beats_subject = filter_for("node.heartbeat", "node-1")
        deadline = time.monotonic() + 20
        while len(await _messages(js, beats_subject, start)) < 2:
            assert time.monotonic() < deadline, "no two heartbeats within 20 s of the start"
            await asyncio.sleep(0.2)
    finally:
        await asyncio.to_thread(services.stop, "nodeagent")
    gate = _gate(js, dsec_stack.home)
    joined = [
        await gate.authentic(d)
        for d in await _messages(js, filter_for("node.joined", "node-1"), start)
    ]
    assert len(joined) == 1 and joined[0] is not None
    beats = [await gate.authentic(d) for d in await _messages(js, beats_subject, start)]
    assert all(b is not None and b.producer == "nodeagent" for b in beats)
    inventory = NodeInventory.model_validate(beats[-1].payload["inventory"])  # type: ignore[union-attr]
    assert inventory.gpu_probe == "declared" and inventory.labels == {"zone": "e2e"}
    assert [(g.model, g.topology) for g in inventory.gpus] == [
        ("NVIDIA H200", {"GPU-node-1-1": "NVLINK"}),
        ("NVIDIA H200", {"GPU-node-1-0": "NVLINK"}),
    ]
    # Stopped: it beats no more.
    count = len(beats)
    await asyncio.sleep(1.5)
    assert len(await _messages(js, beats_subject, start)) == count


async def test_a_node_id_that_cannot_be_a_subject_token_stops_the_start(
    js: JetStreamContext, dsec_stack: StackFixture
) -> None:
    beat = await _heartbeat(js, dsec_stack.home, "rack1.node2", cert_node="rack1.node2")
    with pytest.raises(ValueError, match=r"DSEC_NODE_ID 'rack1.node2': letters, digits"):
        await beat.start()
