"""The node agent's launches on fair workers (``dsec_nodeagent.app.handle_launches``), in memory
behind the real trust gate: one start of a sandbox at a time on a node, and a launch the
runtime would end itself is ended only while it is the sandbox's latest placement here.

The launch itself is a stand-in (``NodeAgent._start`` and the lifecycle read are replaced):
what is under test is the registration and ``on_scheduled``'s ordering around them.
``test_node_scoped.py`` runs real launches on a real stack."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from dsec_core import events, lifecycle
from dsec_core.envelope import Envelope
from dsec_core.service import RetryPolicy, Service
from dsec_core.settings import Settings
from dsec_testing.inmemory import MemoryBus, in_memory, until
from dsec_testing.trust import ENV_BUILT

from dsec_nodeagent.agent import NodeAgent, StartRefused
from dsec_nodeagent.app import handle_launches

pytestmark = pytest.mark.unit


class _NothingRuns:
    def get(self, sid: str) -> None:
        return None

    def busy(self, sid: str) -> bool:
        return False


def _agent(placements: dict[str, tuple[str, int, str]]) -> tuple[NodeAgent, list[int]]:
    """A node agent of node ``a`` whose lifecycle reads come from ``placements`` (sandbox ->
    node, attempt, state) and whose starts record their attempt while they wait for
    ``agent.release`` (set by the test)."""
    agent = NodeAgent.__new__(NodeAgent)
    agent.node_id = "a"
    agent._attempts, agent._starting = {}, {}
    agent._ended_here, agent._start_stops, agent._exiting = {}, {}, {}
    agent._launched, agent._restarting, agent._stop_wanted = {}, {}, set()
    agent.manager = _NothingRuns()  # type: ignore[assignment]
    inside: list[int] = []
    release: dict[int, asyncio.Event] = {}
    read_while_starting: list[bool] = []

    async def read(sid: str) -> lifecycle.Lifecycle:
        node, attempt, state = placements[sid]
        read_while_starting.append(sid in agent._starting)
        return lifecycle.Lifecycle(state=state, node_id=node, attempt=attempt)  # type: ignore[arg-type]

    async def start(sid: str, envelope: Envelope, event: events.SandboxScheduled) -> list[Any]:
        inside.append(event.attempt)
        try:
            await release.setdefault(event.attempt, asyncio.Event()).wait()
        finally:
            inside.remove(event.attempt)
        return []

    agent.lifecycle = read  # type: ignore[method-assign]
    agent._start = start  # type: ignore[method-assign]
    agent.release = release  # type: ignore[attr-defined]
    agent.read_while_starting = read_while_starting  # type: ignore[attr-defined]
    return agent, inside


def _service(tmp_path: Path, agent: NodeAgent, **settings: object) -> Service:
    service = Service("nodeagent", Settings(home=tmp_path, node_id="a", **settings))  # type: ignore[arg-type]
    handle_launches(service, agent, RetryPolicy(max_attempts=3, base_delay_s=1.0))
    return service


async def _schedule(bus: MemoryBus, sid: str, node: str, attempt: int) -> Envelope:
    pub = await bus.producer("scheduler")
    sent = await pub.publish(
        events.SandboxScheduled(node_id=node, reason="test", attempt=attempt),
        aggregate_id=sid,
        tenant="acme",
    )
    await bus.broker.publish(sent.sealed.wire, sent.sealed.subject, stream="DSEC_EVENTS")
    return sent.sealed.envelope


async def test_two_placements_of_one_sandbox_on_a_node_start_one_at_a_time(
    tmp_path: Path,
) -> None:
    """Attempt 1 still starting (its environment staging) when the sandbox is placed back on
    this node (attempt 2): attempt 2 waits for it, then decides; the sandbox stays 'starting'
    for stops and fences until both have ended. Two at once, the loser's clean-up (egress,
    context, proxy) would tear down the winner's."""
    placements = {"sbx_x": ("a", 1, "scheduled")}
    agent, inside = _agent(placements)
    service = _service(tmp_path, agent)
    async with in_memory(service, run_hooks=False) as bus:
        await _schedule(bus, "sbx_x", "a", 1)
        await until(lambda: inside == [1], "attempt 1 starting")
        placements["sbx_x"] = ("a", 2, "scheduled")  # lost, then placed here again
        await _schedule(bus, "sbx_x", "a", 2)
        for _ in range(50):
            await asyncio.sleep(0.001)
        assert inside == [1]  # not both
        agent.release[1].set()  # type: ignore[attr-defined]
        await until(lambda: inside == [2], "attempt 2 starts after attempt 1 ended")
        assert "sbx_x" in agent._starting
        agent.release[2].set()  # type: ignore[attr-defined]
        await service.settled()
    assert agent._starting == {}
    # each decided while registered as starting: a stop meanwhile waits for the decision
    assert agent.read_while_starting == [True, True]  # type: ignore[attr-defined]


async def test_a_late_copy_of_an_old_placement_is_not_ended_when_its_tenant_is_full(
    tmp_path: Path,
) -> None:
    """Node a comes back with a backlog: a launch of sbx_moved (attempt 1 here) while the
    tenant holds its bound on this node; the sandbox runs on node b now (attempt 2). The
    runtime asks before it ends it, and does not: a `sandbox.failed` would end it on b. A
    launch still placed here is ended as before, saying why."""
    placements = {
        "sbx_busy": ("a", 1, "scheduled"),
        "sbx_moved": ("b", 2, "running"),
        "sbx_next": ("a", 1, "scheduled"),
    }
    agent, _ = _agent(placements)
    service = _service(tmp_path, agent, tenant_queue=1)
    async with in_memory(service, run_hooks=False) as bus:
        await _schedule(bus, "sbx_busy", "a", 1)  # holds the tenant's one place here
        stale = await _schedule(bus, "sbx_moved", "a", 1)
        assert bus.caused_by(stale) == []
        full = await _schedule(bus, "sbx_next", "a", 1)
        (failed,) = bus.caused_by(full)
        assert failed.type == "sandbox.failed"
        assert "already holds 1 requests of tenant 'acme'" in failed.payload["reason"]
        agent.release[1].set()  # type: ignore[attr-defined]
        await service.settled()


async def test_another_nodes_launch_is_neither_held_nor_ended_here(tmp_path: Path) -> None:
    placements = {"sbx_busy": ("a", 1, "scheduled"), "sbx_b": ("b", 1, "scheduled")}
    agent, inside = _agent(placements)
    service = _service(tmp_path, agent, tenant_queue=1)
    async with in_memory(service, run_hooks=False) as bus:
        await _schedule(bus, "sbx_busy", "a", 1)
        others = [await _schedule(bus, "sbx_b", "b", 1) for _ in range(3)]
        (fair,) = service._fair
        assert fair.queue.held == 1 and inside == [1]
        assert all(bus.caused_by(e) == [] for e in others)
        agent.release[1].set()  # type: ignore[attr-defined]
        await service.settled()


def _staging_agent(
    placements: dict[str, tuple[str, int, str]], refuse: bool = False
) -> tuple[NodeAgent, list[int]]:
    """:func:`_agent` whose starts are the real ``_start``: each stages an environment that
    never arrives (a cold multi-GB download) and waits for it as a launch does; ``refuse``:
    the launch fails at once instead (a missing secret)."""
    agent, launches = _agent(placements)
    del agent._start  # type: ignore[attr-defined]
    agent._rules, agent._secrets, agent._on_stopped = {}, {}, None
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    async def last(event_type: str, sid: str, event_id: str) -> Any:
        return type("Env", (), {"decoded": lambda self: ENV_BUILT})()

    async def stage(built: Any) -> Any:
        return await never

    async def launch(sid: str, staging: asyncio.Task[Any], built: Any, **_: Any) -> list[Any]:
        launches.append(agent._attempts[sid])
        if refuse:
            raise StartRefused("secret missing")
        await agent._staged(sid, staging)
        return []

    agent._last, agent._stage, agent._launch = last, stage, launch  # type: ignore[method-assign]
    return agent, launches


async def _stop(agent: NodeAgent, sid: str) -> list[Any]:
    envelope = type("Envelope", (), {"aggregate_id": sid})()
    return list(
        await agent.on_stop_requested(envelope, events.SandboxStopRequested(requested_by="t"))  # type: ignore[arg-type]
    )


async def test_a_stop_ends_a_start_waiting_for_its_environment_and_the_one_behind_it(
    tmp_path: Path,
) -> None:
    """A stop of a sandbox whose start waits for a cold environment: the start ends at once
    (no `sandbox.failed`), the sandbox ends in `sandbox.exited` stopped before it started, and
    a start of it queued behind (placed back here) does not begin: before, it woke, read the
    log before the stop's end was in it, and launched a sandbox its user had stopped."""
    placements = {"sbx_x": ("a", 1, "scheduled")}
    agent, launches = _staging_agent(placements)
    service = _service(tmp_path, agent)
    async with in_memory(service, run_hooks=False) as bus:
        first = await _schedule(bus, "sbx_x", "a", 1)
        await until(lambda: launches == [1], "attempt 1 waits for its environment")
        placements["sbx_x"] = ("a", 2, "scheduled")
        second = await _schedule(bus, "sbx_x", "a", 2)  # waits for attempt 1's start
        async with asyncio.timeout(5):
            (exited,) = await _stop(agent, "sbx_x")
        assert isinstance(exited, events.SandboxExited) and exited.reason == "stopped"
        await service.settled()
        assert launches == [1]  # attempt 2 never launched
        assert bus.caused_by(first) == [] and bus.caused_by(second) == []
    assert agent._starting == {} and agent._start_stops == {}


async def test_a_stop_after_a_start_failed_here_is_not_a_second_end(tmp_path: Path) -> None:
    placements = {"sbx_f": ("a", 1, "scheduled")}
    agent, launches = _staging_agent(placements, refuse=True)
    assert launches == []
    service = _service(tmp_path, agent)
    async with in_memory(service, run_hooks=False) as bus:
        request = await _schedule(bus, "sbx_f", "a", 1)
        await service.settled()
        assert [e.type for e in bus.caused_by(request)] == ["sandbox.failed"]
        assert launches == [1]
        # the log does not show the failure to the stop yet: the lifecycle still says scheduled
        assert await _stop(agent, "sbx_f") == []


async def test_a_failed_launch_delivered_again_gives_the_same_end_once_more(
    tmp_path: Path,
) -> None:
    """Its `sandbox.failed` may not have reached the log (a NATS hiccup: the launch is
    delivered again, the log still says scheduled): the same end is given again (its id is
    derived from the launch: published once), not nothing, which would leave the sandbox
    scheduled here for good. Another launch of it starts nothing."""
    placements = {"sbx_f": ("a", 1, "scheduled")}
    agent, launches = _staging_agent(placements, refuse=True)
    service = _service(tmp_path, agent)
    async with in_memory(service, run_hooks=False) as bus:
        request = await _schedule(bus, "sbx_f", "a", 1)
        await service.settled()
        (failed,) = bus.caused_by(request)
        again = await agent.on_scheduled(request, request.decoded())  # type: ignore[arg-type]
        assert [p.model_dump() for p in again] == [failed.decoded().model_dump()]
        other = await _schedule(bus, "sbx_f", "a", 1)
        await service.settled()
        assert bus.caused_by(other) == []
        assert launches == [1]
