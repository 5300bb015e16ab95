"""The state keeper against real NATS JetStream, SeaweedFS and OpenBao (``dsec_testing``).

A fake agent speaks the wire (``dsec_sdk.state.wire``) over a socketpair, as the broker's
``state`` op would hand it: it checkpoints, its session dies, a new session gets back every
acknowledged checkpoint, first from this node's tmpfs journal and disk, then, with both gone
(another node), from the object store and JetStream. A forged chunk in JetStream is refused
before anything is sent; another sandbox may not open the state; the events are authentic
and carry no state bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import shutil
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import nats
import numpy as np
import pytest
from dsec_core import events
from dsec_core.envelope import Envelope
from dsec_core.settings import Settings
from dsec_core.spec.plan import StatePlan
from dsec_core.subjects import STATE_STREAM, subject_for
from dsec_core.trust import Gate, KeyRing, scan_seq
from dsec_sdk.ipc import control
from dsec_testing import trust
from prometheus_client import REGISTRY

from dsec_nodeagent.ipc import Broker
from dsec_nodeagent.state.keeper import (
    REPORT_INTERVAL_S,
    SandboxState,
    StateError,
    StateKeeper,
    StateKey,
)
from dsec_nodeagent.state.merge import merge

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the test kit
from _state_testkit import FakeAgent, keeper_settings

pytestmark = pytest.mark.integration

NODE = "node-1"


@dataclass
class Node:
    """One node's keeper (its own tmpfs journal and disk)."""

    keeper: StateKeeper
    tasks: list[asyncio.Task[None]]

    async def connect(self, sandbox_id: str) -> FakeAgent:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.tasks.append(asyncio.create_task(self.keeper.serve(ours, sandbox_id)))
        return await FakeAgent(theirs).open()


@dataclass
class World:
    settings: Settings
    tenant: str
    group: str
    agent: str
    js: Any
    nc: Any
    gate: Gate
    pipe: trust.Pipeline
    tmp: Path

    @contextlib.asynccontextmanager
    async def node(self, name: str, publish_delay_s: float = 0.0) -> AsyncIterator[Node]:
        async def publish(payload: events.Payload, aggregate_id: str) -> None:
            await asyncio.sleep(publish_delay_s)  # (a slow NATS: what shutdown must wait for)
            await self.pipe.nodeagent.publish(payload, aggregate_id=aggregate_id)

        keeper = StateKeeper(
            self.settings,
            publish,
            journal_dir=self.tmp / name / "shm",
            warm_dir=self.tmp / name / "disk",
        )
        await keeper.start()
        node = Node(keeper, [])
        try:
            yield node
        finally:
            await keeper.stop()
            for task in node.tasks:
                task.cancel()
            await asyncio.gather(*node.tasks, return_exceptions=True)

    async def sandbox(self, keeper: StateKeeper, agent: str | None = None) -> str:
        """A sandbox scheduled on this node (so its node agent's events are authorized)."""
        sid = f"sbx-{uuid.uuid4().hex[:10]}"
        await self.pipe.scheduler.publish(events.SandboxScheduled(node_id=NODE), aggregate_id=sid)
        keeper.register_sandbox(
            SandboxState(
                sid, self.tenant, self.group, agent or self.agent, StatePlan(warm_interval_s=3600)
            )
        )
        return sid

    async def events_of(self, event_type: str, sid: str) -> list[tuple[bytes, Envelope]]:
        found = []
        async for seq, data in scan_seq(self.js, subject_for(event_type, sid), 1000):
            envelope = await self.gate.authentic(data, stream_seq=seq)
            assert envelope is not None, f"an inauthentic {event_type} for {sid}"
            found.append((data, envelope))
        return found


@pytest.fixture
async def world(
    tmp_path: Path, nats_url: str, s3: Any, vault: Any, dsec_stack: Any
) -> AsyncIterator[World]:
    settings = keeper_settings(tmp_path / "home", nats_url, s3, vault, NODE)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    pipe = await trust.pipeline(js, dsec_stack.home, node_id=NODE)
    root = trust.stack_root(dsec_stack.home)
    gate = Gate(KeyRing(nc, js, bytes(root.verify_key)), js, None)
    tag = uuid.uuid4().hex[:8]
    try:
        yield World(settings, f"t{tag}", "g1", f"a{tag}", js, nc, gate, pipe, tmp_path)
    finally:
        await nc.drain()


def _checkpoints(marker: str) -> list[list[dict[str, Any]]]:
    """Three checkpoints touching every kind; the second one is bigger than a chunk."""
    rng = np.random.default_rng(7)
    adapter = rng.random(300_000, dtype=np.float32)  # 1.2 MB: three chunks when full
    idx = np.array([3, 99, 1000], dtype=np.int64)
    val = np.array([1.5, -2.0, 7.25], dtype=np.float32)
    weights = b"base-weights-" + marker.encode() * 100
    vec = np.arange(8, dtype=np.float32).reshape(2, 4)
    return [
        [
            {
                "c": "history",
                "k": "log",
                "t": "hot",
                "o": "append",
                "items": [
                    ["m1", blake3.blake3(b"hi").hexdigest(), f"hello {marker}"],
                    ["m2", blake3.blake3(b"yo").hexdigest(), {"role": "tool", "n": 2}],
                ],
            },
            {"c": "memo", "k": "kv", "t": "hot", "o": "set", "items": {"a": 1, "b": marker}},
            {
                "c": "base",
                "k": "blob",
                "t": "cold",
                "o": "full",
                "data": weights,
                "hash": blake3.blake3(weights).hexdigest(),
            },
        ],
        [
            {
                "c": "adapter",
                "k": "array",
                "t": "warm",
                "o": "full",
                "dtype": "<f4",
                "shape": [300_000],
                "data": adapter.tobytes(),
            },
            {
                "c": "index",
                "k": "vectors",
                "t": "warm",
                "o": "upsert",
                "dim": 4,
                "dtype": "<f4",
                "ids": ["x", "y"],
                "vec": vec.tobytes(),
            },
        ],
        [
            {
                "c": "adapter",
                "k": "array",
                "t": "warm",
                "o": "sparse",
                "dtype": "<f4",
                "shape": [300_000],
                "idx": idx.tobytes(),
                "val": val.tobytes(),
            },
            {"c": "memo", "k": "kv", "t": "hot", "o": "del", "keys": ["a"]},
            {
                "c": "history",
                "k": "log",
                "t": "hot",
                "o": "append",
                "items": [["m3", blake3.blake3(b"3").hexdigest(), "third"]],
            },
            {"c": "index", "k": "vectors", "t": "warm", "o": "remove", "ids": ["x"]},
        ],
    ]


def _by_name(records: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["c"]: r for r in merge(records)}


async def _write(world: World, node: Node, sid: str) -> list[dict[str, Any]]:
    """Checkpoint the three batches; returns every record acknowledged."""
    agent = await node.connect(sid)
    welcome = await agent.hello(world.agent, world.group)
    assert welcome["op"] == "welcome" and welcome["seq"] == 0, welcome
    assert welcome["config"]["warm_interval_s"] == 3600
    records, fetched = await agent.fetch()
    assert records == [] and fetched["source"] == "empty"
    sent: list[dict[str, Any]] = []
    for seq, batch in enumerate(_checkpoints(world.tenant), start=1):
        ack = await agent.checkpoint(seq, batch)
        assert ack == {"op": "ack", "seq": seq, "bytes": ack["bytes"]} and ack["bytes"] > 0, ack
        sent.extend(batch)
    await agent.close()  # the session dies (as with SIGKILL: no bye)
    return sent


def _metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_acknowledged_state_comes_back_locally_then_on_another_node(
    world: World,
) -> None:
    before = {t: _metric("dsec_state_checkpoints_total", tier=t) for t in ("hot", "warm")}
    remote_before = _metric("dsec_state_recoveries_total", source="remote")
    async with world.node("a") as node_a:
        sid = await world.sandbox(node_a.keeper)
        sent = await _write(world, node_a, sid)
        expected = _by_name(sent)
        adapter = np.frombuffer(expected["adapter"]["data"], dtype=np.float32)
        assert adapter[99] == -2.0 and list(expected["index"]["ids"]) == ["y"]

        # the same node: a restarted sandbox (same id) gets everything back from tmpfs + disk
        key = StateKey(world.tenant, world.group, world.agent)
        await _released(node_a.keeper, key)
        again = await node_a.connect(sid)
        welcome = await again.hello(world.agent, world.group)
        assert welcome["seq"] == 3
        records, fetched = await again.fetch()
        assert fetched["op"] == "fetched" and fetched["source"] == "local"
        assert fetched["seq"] == 3 and fetched["deltas"] == 3
        assert _by_name(records) == expected
        assert not any(r["k"] == "ref" for r in records), "cold refs are resolved"

        # a warm merge: snapshot on disk and in the object store, JetStream rolled up to it
        session = node_a.keeper.session_of(key)
        assert session is not None
        await session.warm()
        extra = {"c": "memo", "k": "kv", "t": "hot", "o": "set", "items": {"late": True}}
        ack = await again.checkpoint(4, [extra])
        assert ack["op"] == "ack" and ack["seq"] == 4
        expected = _by_name([*sent, extra])
        await again.close()
        for private in (world.tmp / "a" / "shm", world.tmp / "a" / "disk"):
            assert private.stat().st_mode & 0o777 == 0o700  # the journal is plain
        disk = list((world.tmp / "a" / "disk").rglob("warm-*.bin"))
        assert [p.name for p in disk] == ["warm-3.bin"]
        assert world.tenant.encode() not in disk[0].read_bytes()  # sealed, not plain

        # the hot tier's JetStream messages are sealed too
        subject = f"dsec_state.{world.tenant}.{world.group}.{world.agent}"
        msg = await world.js.get_msg(STATE_STREAM, subject=subject)
        assert msg.headers["Dsec-State-Seq"] == "4" and msg.headers["Dsec-Chunk"] == "0/1"
        assert b"late" not in (msg.data or b"")

    # another node: neither the tmpfs journal nor the disk: object store + JetStream
    async with world.node("b") as node_b:
        sid_b = await world.sandbox(node_b.keeper)
        agent = await node_b.connect(sid_b)
        welcome = await agent.hello(world.agent, world.group)
        assert welcome["op"] == "welcome" and welcome["seq"] == 4, welcome
        records, fetched = await agent.fetch()
        assert fetched["source"] == "remote" and fetched["seq"] == 4
        assert fetched["deltas"] == 1  # warm snapshot 3 + checkpoint 4
        assert _by_name(records) == expected
        await agent.close()

    # the node agent's metrics counted them (no per-agent labels)
    assert _metric("dsec_state_checkpoints_total", tier="hot") - before["hot"] == 4
    assert _metric("dsec_state_checkpoints_total", tier="warm") - before["warm"] == 1
    assert _metric("dsec_state_recoveries_total", source="remote") - remote_before == 1

    # events: authentic (signed by the node agent, authorized), and never the state itself
    hot = await world.events_of("state.checkpointed", sid)
    tiers = sorted((e.payload["tier"], e.payload["seq"]) for _, e in hot)
    assert ("warm", 3) in tiers and ("cold", 1) in tiers
    # every hot checkpoint reported: the first at once, the rest within a second together
    reports = [e.payload for _, e in hot if e.payload["tier"] == "hot"]
    assert reports[0]["seq"] == 1 and reports[0]["checkpoints"] == 1
    assert [r["seq"] for r in reports] == sorted(r["seq"] for r in reports)
    assert reports[-1]["seq"] == 4 and sum(r["checkpoints"] for r in reports) == 4
    recovered = await world.events_of("state.recovered", sid)
    assert [e.payload["source"] for _, e in recovered] == ["local"]
    assert recovered[0][1].payload["deltas_applied"] == 3
    remote = await world.events_of("state.recovered", sid_b)
    assert [(e.payload["source"], e.payload["seq"]) for _, e in remote] == [("remote", 4)]
    assert recovered[0][1].payload["from_sandbox"] is None  # its own state, restarted
    assert remote[0][1].payload["from_sandbox"] == sid  # written by the sandbox on node a
    adapter_bytes = np.frombuffer(expected["adapter"]["data"], dtype=np.uint8)[:64].tobytes()
    for data, _ in [*hot, *recovered, *remote]:
        assert world.tenant.encode() not in data  # the marker in every checkpoint's values
        assert adapter_bytes not in data and b"base-weights" not in data


async def _released(keeper: StateKeeper, key: StateKey) -> None:
    """The closed session has let go of the state (polled, with a deadline)."""
    deadline = asyncio.get_running_loop().time() + 30
    while keeper.session_of(key) is not None:
        assert asyncio.get_running_loop().time() < deadline, "the old session never ended"
        await asyncio.sleep(0.02)


async def test_a_forged_chunk_in_jetstream_is_refused_before_anything_is_sent(
    world: World,
) -> None:
    async with world.node("a") as node_a:
        sid = await world.sandbox(node_a.keeper)
        await _write(world, node_a, sid)
    subject = f"dsec_state.{world.tenant}.{world.group}.{world.agent}"
    original = await world.js.get_msg(STATE_STREAM, subject=subject)
    altered = bytearray(original.data)
    altered[40] ^= 0x01
    headers = {k: v for k, v in original.headers.items() if k != "Nats-Msg-Id"}
    await world.js.publish(subject, bytes(altered), headers=headers)

    async with world.node("b") as node_b:
        sid_b = await world.sandbox(node_b.keeper)
        agent = await node_b.connect(sid_b)
        frame = await agent.hello(world.agent, world.group)
        assert frame["op"] == "error" and frame["code"] == "corrupt", frame
        assert "does not authenticate" in frame["message"] and "checkpoint 3" in frame["message"]
        await agent.close()
    assert not list((world.tmp / "b").rglob("warm-*.bin"))
    assert not [p for p in (world.tmp / "b").rglob("journal.bin") if p.stat().st_size]


async def test_checkpoints_go_on_during_a_warm_merge_and_survive_its_rollup(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The merge's upload is held back: a checkpoint taken meanwhile is acked at once, and
    the rollup that drops the deltas up to the snapshot carries it (another node gets it)."""
    from dsec_nodeagent.state import keeper as keeper_module

    uploading, release = asyncio.Event(), asyncio.Event()
    real_put = keeper_module.objectstore.put_bytes

    async def held_put(store: Any, bucket: str, name: str, data: bytes) -> None:
        if "/warm/" in name:
            uploading.set()
            await release.wait()
        await real_put(store, bucket, name, data)

    monkeypatch.setattr(keeper_module.objectstore, "put_bytes", held_put)
    async with world.node("a") as node_a:
        sid = await world.sandbox(node_a.keeper)
        sent = await _write(world, node_a, sid)
        key = StateKey(world.tenant, world.group, world.agent)
        await _released(node_a.keeper, key)
        agent = await node_a.connect(sid)
        assert (await agent.hello(world.agent, world.group))["seq"] == 3
        session = node_a.keeper.session_of(key)
        assert session is not None
        merging = asyncio.create_task(session.warm())
        await asyncio.wait_for(uploading.wait(), 60)
        during = {"c": "memo", "k": "kv", "t": "hot", "o": "set", "items": {"during": 1}}
        ack = await agent.checkpoint(4, [during])  # not behind the merge
        assert ack["op"] == "ack" and ack["seq"] == 4
        release.set()
        await merging
        await agent.close()
    subject = f"dsec_state.{world.tenant}.{world.group}.{world.agent}"
    info = await world.js.stream_info(STATE_STREAM, subjects_filter=subject)
    assert info.state.subjects == {subject: 1}  # rolled up: the marker alone

    async with world.node("b") as node_b:
        sid_b = await world.sandbox(node_b.keeper)
        agent = await node_b.connect(sid_b)
        welcome = await agent.hello(world.agent, world.group)
        assert welcome["seq"] == 4, welcome
        records, fetched = await agent.fetch()
        assert fetched["source"] == "remote" and fetched["deltas"] == 1
        assert _by_name(records) == _by_name([*sent, during])
        await agent.close()


async def test_an_attempt_jetstream_failed_is_not_state(world: World) -> None:
    """Chunks of a checkpoint that never got all its acks (so was never acknowledged) are
    left out of a recovery, and its seq is free for the retry."""
    async with world.node("a") as node_a:
        sid = await world.sandbox(node_a.keeper)
        sent = await _write(world, node_a, sid)
    subject = f"dsec_state.{world.tenant}.{world.group}.{world.agent}"
    leftover = {"Dsec-State-Seq": "4", "Dsec-Chunk": "0/2", "Dsec-Digest": "ab" * 16}
    await world.js.publish(subject, b"half of an attempt", headers=leftover)

    async with world.node("b") as node_b:
        sid_b = await world.sandbox(node_b.keeper)
        agent = await node_b.connect(sid_b)
        welcome = await agent.hello(world.agent, world.group)
        assert welcome["op"] == "welcome" and welcome["seq"] == 3, welcome
        records, fetched = await agent.fetch()
        assert fetched["source"] == "remote" and fetched["deltas"] == 3
        assert _by_name(records) == _by_name(sent)
        retry = {"c": "memo", "k": "kv", "t": "hot", "o": "set", "items": {"retry": 1}}
        assert (await agent.checkpoint(4, [retry]))["op"] == "ack"
        await agent.close()


async def test_an_altered_cold_object_is_found_by_the_check_and_never_served(
    world: World, s3: Any
) -> None:
    async with world.node("a") as node_a:
        sid = await world.sandbox(node_a.keeper)
        sent = await _write(world, node_a, sid)
        key = StateKey(world.tenant, world.group, world.agent)
        store = node_a.keeper._agent(key)
        assert await node_a.keeper.verify_cold(store) == []
        base = next(r for r in sent if r["c"] == "base")
        name = f"state/{world.tenant}/{world.group}/{world.agent}/cold/{base['hash']}"
        sealed = s3.client().get_object(s3.bucket, name).read()
        assert base["data"] not in sealed  # sealed in the object store
        altered = bytes([sealed[0] ^ 1]) + sealed[1:]
        s3.client().put_object(s3.bucket, name, io.BytesIO(altered), len(altered))
        assert await node_a.keeper.verify_cold(store) == [name]

        await _released(node_a.keeper, key)
        agent = await node_a.connect(sid)
        assert (await agent.hello(world.agent, world.group))["op"] == "welcome"
        await agent.send({"op": "fetch"})
        frame = await agent.recv()
        assert frame["op"] == "error" and frame["code"] == "corrupt", frame
        assert name in frame["message"]
        await agent.close()


async def test_another_sandbox_may_not_open_the_state(world: World) -> None:
    async with world.node("a") as node:
        owner = await world.sandbox(node.keeper)
        first = await node.connect(owner)
        assert (await first.hello(world.agent, world.group))["op"] == "welcome"

        other = await world.sandbox(node.keeper, agent="someone-else")
        intruder = await node.connect(other)
        refused = await intruder.hello(world.agent, world.group)
        assert refused["op"] == "error" and refused["code"] == "wrong-agent", refused
        assert "someone-else" in refused["message"]

        # the owner's agent restarts before its old socket is seen closed: the new session
        # of the same sandbox takes over, the old one is dropped
        restarted = await node.connect(owner)
        assert (await restarted.hello(world.agent, world.group))["op"] == "welcome"
        assert first.reader is not None
        assert await asyncio.wait_for(first.reader.read(), 30) == b""  # closed by the keeper
        first = restarted

        twin = await world.sandbox(node.keeper)  # the same agent in a second sandbox
        second = await node.connect(twin)
        held = await second.hello(world.agent, world.group)
        assert held["op"] == "error" and held["code"] == "state-held", held
        assert owner in held["message"]
        for agent in (first, intruder, second):
            await agent.close()


async def test_the_broker_hands_out_state_sockets_within_the_bound(world: World) -> None:
    async with world.node("a") as node:
        path = world.tmp / "ipc.sock"
        broker = Broker(path, state_keeper=node.keeper)
        await broker.start()
        try:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            conn.connect(str(path))

            def ask(message: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
                control.send(conn, message)
                got = control.recv(conn)
                assert got is not None
                return got

            hello = {"op": "hello", "group": world.group, "agent": world.agent, "role": "caller"}
            welcome, _ = await asyncio.to_thread(ask, hello)
            assert welcome["op"] == "welcome"
            socks = []
            for ref in range(broker.limits.state_per_sandbox):
                answer, fds = await asyncio.to_thread(ask, {"op": "state", "ref": ref})
                assert answer == {"op": "state", "ref": ref} and len(fds) == 1
                socks.append(socket.socket(fileno=fds[0]))
            answer, fds = await asyncio.to_thread(ask, {"op": "state", "ref": 99})
            assert answer["op"] == "error" and answer["code"] == "too_many_state_sockets"
            assert fds == []
            # a dev broker's connection: tenant default, the hello's agent
            agent = await FakeAgent(socks[0]).open()
            frame = await agent.hello(world.agent, world.group)
            assert frame["op"] == "welcome", frame
            await agent.close()
            for sock in socks[1:]:
                sock.close()
            conn.close()
        finally:
            await broker.stop()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))


async def test_an_agent_checkpointing_in_a_loop_is_reported_once_a_second(
    world: World,
) -> None:
    """300 checkpoints as fast as the keeper acks them: each is acked (none is slowed or
    refused), and the event log gets one ``state.checkpointed`` at once and then at most one a
    second, which together stand for all 300 (the last names seq 300)."""
    async with world.node("a") as node:
        sid = await world.sandbox(node.keeper)
        agent = await node.connect(sid)
        welcome = await agent.hello(world.agent, world.group)
        assert welcome["op"] == "welcome", welcome
        started = time.monotonic()
        for seq in range(1, 301):
            record = {"c": "memo", "k": "kv", "t": "hot", "o": "set", "items": {"n": seq}}
            # (each flagged final as a hand-over's last is: only one the keeper asked for counts)
            ack = await agent.checkpoint(seq, [record], final=True)
            assert ack["op"] == "ack" and ack["seq"] == seq, ack
        elapsed = time.monotonic() - started
        await agent.close()
        deadline = time.monotonic() + 10
        while True:
            hot = [
                e.payload
                for _, e in await world.events_of("state.checkpointed", sid)
                if e.payload["tier"] == "hot"
            ]
            if sum(p["checkpoints"] for p in hot) >= 300 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
    assert sum(p["checkpoints"] for p in hot) == 300 and hot[-1]["seq"] == 300
    assert len(hot) <= elapsed / REPORT_INTERVAL_S + 2, (len(hot), elapsed)
    assert hot[0]["checkpoints"] == 1 and hot[0]["seq"] == 1


async def test_reports_held_back_go_out_when_the_connection_and_then_the_keeper_stop(
    world: World,
) -> None:
    """Checkpoint 2 comes within a second of 1: its report is held back. The node agent
    stops its broker first (the agent's connection ends), then its keeper, over a slow NATS:
    the held-back report still goes out."""
    async with world.node("a", publish_delay_s=0.2) as node:
        sid = await world.sandbox(node.keeper)
        agent = await node.connect(sid)
        assert (await agent.hello(world.agent, world.group))["op"] == "welcome"
        for seq in (1, 2):
            record = {"c": "memo", "k": "kv", "t": "hot", "o": "set", "items": {"n": seq}}
            assert (await agent.checkpoint(seq, [record]))["seq"] == seq
        await agent.close()
        await _released(node.keeper, StateKey(world.tenant, world.group, world.agent))
    hot = [e.payload for _, e in await world.events_of("state.checkpointed", sid)]
    assert [(p["seq"], p["checkpoints"]) for p in hot if p["tier"] == "hot"] == [(1, 1), (2, 1)]


async def test_a_report_sent_at_once_takes_along_what_was_held_back_never_a_lower_seq_after_it(
    world: World,
) -> None:
    """Checkpoint 2 is held back; its interval ends (its report is scheduled) and, before that
    report goes out, checkpoint 3 must be reported at once (a hand-over's last): one report
    names seq 3 and both checkpoints, and no report of seq 2 comes after it (it used to, the
    held-back report being published second)."""
    async with world.node("a", publish_delay_s=0.05) as node:
        keeper = node.keeper
        sid = await world.sandbox(keeper)
        key = StateKey(world.tenant, world.group, world.agent)
        await keeper.report(key, sid, "hot", 1, 10, 1, 0.1, 0.1)  # the first: at once
        await keeper.report(key, sid, "hot", 2, 10, 1, 0.1, 0.1)  # held back
        assert keeper._pending  # the state under test
        keeper._reported_at[(key, "hot")] -= REPORT_INTERVAL_S  # its second ends
        keeper._reports_due()  # (the timer's callback) schedules its report
        await keeper.report(key, sid, "hot", 3, 10, 1, 0.1, 0.1, now=True)
        await asyncio.gather(*keeper._reports)  # the scheduled one has run
    hot = [e.payload for _, e in await world.events_of("state.checkpointed", sid)]
    assert [(p["seq"], p["checkpoints"]) for p in hot] == [(1, 1), (3, 2)]


async def test_an_agent_reconnecting_or_fetching_in_a_loop_is_reported_once_a_second(
    world: World,
) -> None:
    """The report clock is the agent's, not its connection's: 30 connections, each with a
    hello, a fetch and a checkpoint, give at most one state.checkpointed and one
    state.recovered a second (the checkpoints' count still adds up)."""
    async with world.node("a") as node:
        sid = await world.sandbox(node.keeper)
        key = StateKey(world.tenant, world.group, world.agent)
        started = time.monotonic()
        for seq in range(1, 31):
            agent = await node.connect(sid)
            assert (await agent.hello(world.agent, world.group))["op"] == "welcome"
            await agent.fetch()
            record = {"c": "memo", "k": "kv", "t": "hot", "o": "set", "items": {"n": seq}}
            assert (await agent.checkpoint(seq, [record]))["seq"] == seq
            await agent.close()
            await _released(node.keeper, key)
        elapsed = time.monotonic() - started
    hot = [e.payload for _, e in await world.events_of("state.checkpointed", sid)]
    hot = [p for p in hot if p["tier"] == "hot"]
    recovered = await world.events_of("state.recovered", sid)
    bound = elapsed / REPORT_INTERVAL_S + 2
    assert sum(p["checkpoints"] for p in hot) == 30 and len(hot) <= bound, (len(hot), elapsed)
    # 29 fetches found state (all but the first); the first of them is reported, at most one
    # a second after it
    assert recovered[0][1].payload["seq"] == 1, recovered[0][1].payload
    assert len(recovered) <= min(bound, 28), (len(recovered), elapsed)


async def test_an_agent_past_its_state_limit_is_refused_and_its_neighbour_is_not(
    world: World,
) -> None:
    """`state.max_size`: one agent cannot fill the node's tmpfs journal and disk for the
    others; its checkpoints are refused with `quota` (naming the limit) once its state on the
    node reaches it, and another agent of the node checkpoints on."""
    async with world.node("a") as node:
        greedy = await world.sandbox(node.keeper)
        node.keeper.register_sandbox(
            SandboxState(
                greedy, world.tenant, world.group, world.agent, StatePlan(max_bytes=1 << 20)
            )
        )
        agent = await node.connect(greedy)
        assert (await agent.hello(world.agent, world.group))["op"] == "welcome"
        payload = b"x" * (300 << 10)
        answers = []
        for seq in range(1, 8):
            record = {"c": "blob", "k": "kv", "t": "hot", "o": "set", "items": {str(seq): payload}}
            answers.append(await agent.checkpoint(seq, [record]))
            if answers[-1]["op"] == "error":
                break
        acked = [a for a in answers if a["op"] == "ack"]
        refused = answers[-1]
        assert refused["op"] == "error" and refused["code"] == "quota", answers
        assert "1 MiB" in refused["message"] and "state.max_size" in refused["message"]
        assert 3 <= len(acked) <= 5  # ~1 MiB of 300 KiB deltas, then no more

        neighbour = await world.sandbox(node.keeper, agent="neighbour")
        other = await node.connect(neighbour)
        assert (await other.hello("neighbour", world.group))["op"] == "welcome"
        small = {"c": "memo", "k": "kv", "t": "hot", "o": "set", "items": {"a": 1}}
        assert (await other.checkpoint(1, [small]))["op"] == "ack"
        for each in (agent, other):
            await each.close()


async def test_stopping_leaves_no_empty_journal_dirs_and_dsec_down_leaves_none(
    tmp_path: Path,
) -> None:
    from dsec_core import retention

    settings = Settings(home=tmp_path / "home", node_id="node-t")
    root = tmp_path / "shm" / "dsec-node-t-12345678"  # as /dev/shm/dsec-<node>-<hash>
    keeper = StateKeeper(settings, journal_dir=root / "state", warm_dir=tmp_path / "warm")
    keeper._private_dirs()  # what start() makes before it connects
    (root / "state" / "acme" / "g" / "idle").mkdir(parents=True)
    live = root / "state" / "acme" / "g" / "busy"
    live.mkdir(parents=True)
    (live / "journal.bin").write_bytes(b"entries")
    await keeper.stop()  # a restart: the journal with entries stays for the next start
    assert not (root / "state" / "acme" / "g" / "idle").exists()
    assert (live / "journal.bin").read_bytes() == b"entries"
    retention.down_marker(settings.home).parent.mkdir(parents=True)
    retention.down_marker(settings.home).touch()
    await keeper.stop()  # `dsec down`: nothing stays in node memory
    assert not root.exists() and (tmp_path / "shm").is_dir()


def test_a_journal_directory_someone_else_made_in_dev_shm_is_replaced_by_our_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # /dev/shm is writable by every user: another one may make our directory (or a link) first.
    import os

    from dsec_nodeagent.state.keeper import StateError

    settings = Settings(home=tmp_path / "home", node_id="node-t")
    planted = tmp_path / "shm" / "dsec-node-t-12345678"
    planted.mkdir(parents=True, mode=0o777)
    (planted / "theirs").write_text("x")
    os.chown(planted, 65534, 65534)  # nobody's
    keeper = StateKeeper(settings, journal_dir=planted / "state", warm_dir=tmp_path / "warm")
    keeper._private_dirs()  # root: removed, and ours made in its place
    assert planted.stat().st_uid == os.geteuid() and not (planted / "theirs").exists()
    assert oct(planted.stat().st_mode & 0o777) == oct(0o700) and (planted / "state").is_dir()
    shutil.rmtree(planted)
    (tmp_path / "elsewhere").mkdir()
    planted.symlink_to(tmp_path / "elsewhere")  # a link to a directory it controls
    keeper._private_dirs()
    assert not planted.is_symlink() and list((tmp_path / "elsewhere").iterdir()) == []
    shutil.rmtree(planted)
    planted.mkdir(mode=0o777)
    os.chown(planted, 65534, 65534)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)  # not root: it refuses, writes nothing
    with pytest.raises(StateError, match="uid 65534, not this node agent's"):
        keeper._private_dirs()
    assert list(planted.iterdir()) == []


async def test_nothing_after_a_hand_overs_final_checkpoint_is_taken_until_it_is_aborted(
    world: World,
) -> None:
    """A hand-over hands the state over as of the old version's final checkpoint: a checkpoint
    the old version sends after it is refused (``handed-over``; the state's seq stays at the
    final's, where the new version goes on from), and taken again once the hand-over failed."""
    async with world.node("a") as node:
        sid = await world.sandbox(node.keeper)
        agent = await node.connect(sid)
        assert (await agent.hello(world.agent, world.group))["op"] == "welcome"
        await agent.fetch()
        first = {"c": "memo", "k": "kv", "t": "hot", "o": "set", "items": {"a": 1}}
        assert (await agent.checkpoint(1, [first]))["op"] == "ack"
        key = StateKey(world.tenant, world.group, world.agent)
        session = node.keeper.session_of(key)
        assert session is not None
        asking = asyncio.ensure_future(session.request_final("sbx-new"))
        assert (await agent.recv()) == {"op": "handover", "to": "sbx-new"}
        last = {"c": "memo", "k": "kv", "t": "hot", "o": "set", "items": {"b": 2}}
        assert (await agent.checkpoint(2, [last], final=True))["op"] == "ack"
        assert await asyncio.wait_for(asking, 10) == [last]

        late = {"c": "memo", "k": "kv", "t": "hot", "o": "set", "items": {"late": 3}}
        refused = await agent.checkpoint(3, [late])
        assert refused["op"] == "error" and refused["code"] == "handed-over", refused
        assert refused["seq"] == 3 and "final hand-over checkpoint 2" in refused["message"]
        records, seq = await node.keeper.records_of(session)
        assert seq == 2 and "late" not in str(records)

        await session.abort_handover("the new version went away")
        aborted = await agent.recv()
        assert aborted["op"] == "error" and aborted["code"] == "handover-aborted", aborted
        assert (await agent.checkpoint(3, [late]))["op"] == "ack"
        await agent.close()


async def test_a_final_checkpoint_still_being_made_durable_when_the_hand_over_gave_up_is_ordinary(
    world: World,
) -> None:
    """The old version's final checkpoint is being made durable when the keeper stops waiting
    for it and aborts the hand-over: once durable it is an ordinary checkpoint, and the ones
    after it are taken (the old version serves on, its state its own)."""
    async with world.node("a") as node:
        sid = await world.sandbox(node.keeper)
        agent = await node.connect(sid)
        assert (await agent.hello(world.agent, world.group))["op"] == "welcome"
        await agent.fetch()
        session = node.keeper.session_of(StateKey(world.tenant, world.group, world.agent))
        assert session is not None
        durable, entered, release = node.keeper._durable, asyncio.Event(), asyncio.Event()

        async def slow_durable(*args: Any) -> int:
            entered.set()
            await release.wait()
            return await durable(*args)

        node.keeper._durable = slow_durable  # type: ignore[method-assign]
        asking = asyncio.ensure_future(session.request_final("sbx-new", timeout_s=0.5))
        assert (await agent.recv()) == {"op": "handover", "to": "sbx-new"}
        last = {"c": "memo", "k": "kv", "t": "hot", "o": "set", "items": {"last": 1}}
        await agent.send(
            {"op": "checkpoint", "seq": 1, "records": [last], "pause_ms": 0.5,
             "tiers": ["hot"], "final": True}
        )  # fmt: skip
        await asyncio.wait_for(entered.wait(), 10)
        with pytest.raises(TimeoutError):
            await asking
        await session.abort_handover("the old version did not answer in time")
        release.set()
        assert (await agent.recv())["code"] == "handover-aborted"
        assert (await agent.recv())["op"] == "ack"
        node.keeper._durable = durable  # type: ignore[method-assign]
        more = {"c": "memo", "k": "kv", "t": "hot", "o": "set", "items": {"more": 2}}
        assert (await agent.checkpoint(2, [more]))["op"] == "ack"
        await agent.close()


async def test_a_checkpoint_the_keeper_cannot_make_durable_is_answered_under_its_seq(
    world: World,
) -> None:
    """A failure inside the keeper (OpenBao, NATS or the object store away) refuses the
    checkpoint by its seq: the agent waiting for that answer gets it, and sends it again."""
    async with world.node("a") as node:
        sid = await world.sandbox(node.keeper)
        agent = await node.connect(sid)
        assert (await agent.hello(world.agent, world.group))["op"] == "welcome"
        await agent.fetch()
        durable = node.keeper._durable

        async def away(*_: Any) -> int:
            raise StateError("unavailable", "NATS is away")

        node.keeper._durable = away  # type: ignore[method-assign]
        memo = {"c": "memo", "k": "kv", "t": "hot", "o": "set", "items": {"a": 1}}
        refused = await agent.checkpoint(1, [memo])
        assert refused["op"] == "error" and refused["code"] == "unavailable", refused
        assert refused["seq"] == 1
        node.keeper._durable = durable  # type: ignore[method-assign]
        assert (await agent.checkpoint(1, [memo]))["op"] == "ack"
        await agent.close()
