"""Three nodes on one machine (`dsec up --nodes 3`, the `dsec_cluster` fixture): each node agent
runs with its own node id, home, certificate and NATS identity, and heartbeats as its node; ten
sandboxes spread over the three nodes survive the loss of one node agent (SIGKILL): the scheduler
reports each of its sandboxes `unit.lost` and places it on another node, and the audit trail
verifies."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from dsec_cli.stack import ServiceSpec
from dsec_core import identity
from dsec_core.bus import follow
from dsec_core.events import NodeHeartbeat
from dsec_core.settings import Settings
from dsec_core.subjects import filter_for
from dsec_core.trust import Gate, KeyRing
from dsec_testing import trust
from dsec_testing.stack import ClusterFixture

pytestmark = [pytest.mark.integration, pytest.mark.kernel]

NODES = ("node-1", "node-2", "node-3")
FAST = {"DSEC_HEARTBEAT_S": "0.5", "DSEC_NODE_LOST_S": "3"}
"""Heartbeats every 0.5 s; a node silent for 3 s is lost (the defaults are 5 s and 15 s)."""

SPEC = """\
version: "1.2"
name: many-{i}
base: dsec/python311:latest
entrypoint: [python, -c, "import time; print('many-{i} is up', flush=True); time.sleep(600)"]
resources: {{cpu: 0.1, memory: 64MiB, pids: 16}}
timeout: 10m
"""


@pytest.fixture(scope="module", autouse=True)
def _services_stop_after_the_module(dsec_cluster: ClusterFixture) -> Iterator[None]:
    """The cluster's stack goes down with this module: its node-1 agent would otherwise share
    node-1's kernel state (pins, cgroups) with the session stack's node agent in later tests."""
    yield
    dsec_cluster.stack.down()  # as `dsec down`: sandboxes stopped first (the servers start again
    # lazily for later tests)
    for node in NODES[1:]:  # nothing of the extra nodes stays in the kernel
        pins, state = Settings(node_id=node).egress_dirs()
        assert not pins.parent.exists() and not state.parent.exists()
        for cgroup2 in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
            assert not (cgroup2 / "dsec" / node).exists()


def _gate(nc: nats.NATS, home: Path) -> Gate:
    root = trust.stack_root(home)
    return Gate(KeyRing(nc, nc.jetstream(), bytes(root.verify_key)), nc.jetstream(), None)


async def test_three_node_agents_heartbeat_each_as_its_own_node(dsec_cluster: ClusterFixture):
    started = await asyncio.to_thread(dsec_cluster.start_node_agents, {"DSEC_HEARTBEAT_S": "0.5"})
    assert started == ["nodeagent", "nodeagent@node-2", "nodeagent@node-3"]
    for node in NODES[1:]:  # a home of its own, certified for its node by the operator root
        cert = identity.read_cert(
            identity.TrustPaths(dsec_cluster.node_home(node)).cert("nodeagent")
        )
        assert cert.role == "nodeagent" and cert.node_id == node
    nc = await nats.connect(servers=dsec_cluster.operator_urls)
    try:
        gate = _gate(nc, dsec_cluster.home)
        seen: dict[str, NodeHeartbeat] = {}
        deadline = time.monotonic() + 30
        subject = filter_for("node.heartbeat")
        async for batch in follow(nc.jetstream(), filter_subject=subject):
            for _, data in batch:
                env = await gate.authentic(data)  # signed, certified, authorized for that node
                if env is not None:
                    seen[env.aggregate_id] = NodeHeartbeat.model_validate(env.payload)
            if set(NODES) <= set(seen) or time.monotonic() > deadline:
                break
        assert set(NODES) <= set(seen), f"heartbeats only from {sorted(seen)}"
    finally:
        await nc.close()


class Lifecycles:
    """The authentic events of some sandboxes, followed live from the log (one reader)."""

    def __init__(self, nc: nats.NATS, gate: Gate, ids: set[str]) -> None:
        self.events: dict[str, list[Any]] = {sid: [] for sid in ids}
        self._nc, self._gate = nc, gate
        self._task = asyncio.create_task(self._follow())

    async def _follow(self) -> None:
        reader = follow(self._nc.jetstream(), filter_subject="dsec.sandbox.>")
        try:
            async for batch in reader:
                for _, data in batch:
                    env = await self._gate.authentic(data)
                    if env is not None and env.aggregate_id in self.events:
                        self.events[env.aggregate_id].append(env)
        finally:
            await reader.aclose()  # on this loop, not in a finalizer after it closed

    async def until(self, done: Any, what: str, timeout: float) -> dict[str, list[Any]]:
        deadline = time.monotonic() + timeout
        while not done(self.events):
            if self._task.done():
                self._task.result()  # the reader failed: show why
            if time.monotonic() > deadline:
                summary = {sid: [_shown(e) for e in evs] for sid, evs in self.events.items()}
                raise AssertionError(f"not {what} within {timeout} s: {summary}")
            await asyncio.sleep(0.2)
        return self.events

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task


def _shown(env: Any) -> str:
    if env.type in ("sandbox.failed", "unit.lost", "sandbox.scheduled"):
        return f"{env.type}{dict(env.payload)}"
    return str(env.type)


def _placements(events: list[Any]) -> list[tuple[str, int]]:
    return [
        (e.payload["node_id"], e.payload["attempt"])
        for e in events
        if e.type == "sandbox.scheduled"
    ]


def _ready_on(events: list[Any], node: str) -> bool:
    return any(e.type == "sandbox.ready" and e.payload.get("node_id") == node for e in events)


async def test_a_lost_node_agents_sandboxes_are_rescheduled_on_the_others(
    dsec_cluster: ClusterFixture, dsec_cli, tmp_path: Path
):
    stack = dsec_cluster.stack
    await asyncio.to_thread(dsec_cluster.start_node_agents, FAST)
    pipeline = [ServiceSpec(n) for n in ("policy", "builder", "scheduler")]
    await asyncio.to_thread(stack.ensure_services, pipeline, extra_env=FAST)
    env = dsec_cluster.env()
    ids: set[str] = set()
    for i in range(10):
        spec = tmp_path / f"spec-{i}.yaml"
        spec.write_text(SPEC.format(i=i))
        result = dsec_cli("submit", str(spec), "--wait", "validated", "--json", env=env)
        assert result.exit_code == 0, result.output
        ids.add(result.last_json()["sandbox_id"])
    victim: str | None = None
    nc = await nats.connect(servers=dsec_cluster.operator_urls)
    watch = Lifecycles(nc, _gate(nc, dsec_cluster.home), ids)
    try:

        def all_ready(state: dict[str, list[Any]]) -> bool:
            return all(any(e.type == "sandbox.ready" for e in evs) for evs in state.values())

        state = await watch.until(all_ready, "all ready", 120)
        first = {sid: _placements(evs)[-1][0] for sid, evs in state.items()}
        spread = Counter(first.values())
        assert set(spread) == set(NODES), f"not spread over the three nodes: {spread}"
        victim = max(NODES[1:], key=lambda n: spread[n])  # an extra node, SIGKILLed
        moved = {sid for sid, node in first.items() if node == victim}
        await asyncio.to_thread(stack.stop_service, f"nodeagent@{victim}", sig=signal.SIGKILL)

        def rescheduled(state: dict[str, list[Any]]) -> bool:
            return all(
                any(e.type == "unit.lost" for e in state[sid])
                and _placements(state[sid])[-1][0] != victim
                and _ready_on(state[sid], _placements(state[sid])[-1][0])
                for sid in moved
            )

        state = await watch.until(rescheduled, "rescheduled and ready", 90)
        for sid in moved:
            (lost,) = [e for e in state[sid] if e.type == "unit.lost"]
            assert lost.producer == "scheduler"
            assert lost.payload["node_id"] == victim and lost.payload["action"] == "reschedule"
            (node_a, attempt_a), (node_b, attempt_b) = _placements(state[sid])
            assert (node_a, attempt_a) == (victim, 1) and attempt_b == 2 and node_b != victim
        for sid in ids - moved:  # the others were left where they run
            assert len(_placements(state[sid])) == 1
            assert not any(e.type == "unit.lost" for e in state[sid])
        # `dsec sandbox logs` of a sandbox on another node than the CLI's: streamed over the bus
        # by the node agent that runs it (one that moved there, and one that never moved)
        now = {sid: _placements(evs)[-1][0] for sid, evs in state.items()}
        for sid in (next(iter(moved)), *[s for s in ids - moved if now[s] != "node-1"][:1]):
            deadline = time.monotonic() + 20  # ready comes before its first line is written
            while True:
                logs = dsec_cli("sandbox", "logs", sid, env=env)
                assert logs.exit_code == 0, (now[sid], logs.output)
                if "is up" in logs.output:
                    break
                assert time.monotonic() < deadline, (now[sid], logs.output)
                await asyncio.sleep(0.5)
    finally:
        await watch.close()
        await nc.close()
        if victim is not None:  # it comes back: its stale copies are fenced off and stopped
            back = [ServiceSpec(f"nodeagent@{victim}")]
            await asyncio.to_thread(stack.ensure_services, back, extra_env=FAST)
    verify = dsec_cli("audit", "verify", "--json", env=env)
    assert verify.exit_code == 0, verify.output
