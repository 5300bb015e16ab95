"""A node's snapshots and rollbacks take turns by tenant (in memory: the real service runtime,
trust gate and ``NodeSnapshots`` wiring; the snapshot work itself a stand-in that waits for
the test).

Before, the node agent took ``snapshot.requested`` in fetched batches of four and fetched the
next batch only once the whole batch had ended: one tenant's large snapshots held every other
tenant's request on that node until they had all ended."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from dsec_core import events
from dsec_core.envelope import Envelope
from dsec_core.service import HANDLING_SEQ, Service
from dsec_core.settings import Settings
from dsec_snapstore import requests as requests_module
from dsec_snapstore.requests import SnapshotRequests
from dsec_testing.inmemory import MemoryBus, in_memory, until

from dsec_nodeagent.snapshots import NodeSnapshots

pytestmark = pytest.mark.unit


class _Work:
    """Stand-in snapshot work: each request waits for ``release[name]``; ``owner`` says which
    node each sandbox runs on (what its lifecycle would)."""

    def __init__(self, owner: dict[str, str]) -> None:
        self.owner = owner
        self.inside: list[str] = []
        self.release: dict[str, asyncio.Event] = {}
        self.released = False

    def release_all(self) -> None:
        """Let every request end (a failed assertion must not leave the service's stop
        waiting on them)."""
        for name in list(self.inside):
            self.release.setdefault(name, asyncio.Event()).set()
        for event in self.release.values():
            event.set()
        self.released = True

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        work = self

        async def on_requested(
            self: SnapshotRequests, envelope: Envelope, event: events.SnapshotRequested
        ) -> list[events.Payload]:
            if work.owner[envelope.aggregate_id] != self.node_id:
                return []
            work.inside.append(event.name)
            try:
                if not work.released:
                    await work.release.setdefault(event.name, asyncio.Event()).wait()
            finally:
                work.inside.remove(event.name)
            return []

        async def facts(self: SnapshotRequests, sandbox_id: str) -> tuple[None, str, list[Any]]:
            return None, work.owner[sandbox_id], []

        monkeypatch.setattr(SnapshotRequests, "on_requested", on_requested)
        monkeypatch.setattr(SnapshotRequests, "facts", facts)


def _service(tmp_path: Path, **settings: object) -> Service:
    return _wired(tmp_path, **settings)[0]


def _wired(tmp_path: Path, **settings: object) -> tuple[Service, NodeSnapshots]:
    service = Service("nodeagent", Settings(home=tmp_path, node_id="a", **settings))  # type: ignore[arg-type]
    return service, NodeSnapshots(service)


async def _request(bus: MemoryBus, tenant: str, sid: str, name: str) -> Envelope:
    user = await bus.producer("user", tenant=tenant)
    sent = await user.publish(events.SnapshotRequested(name=name), aggregate_id=sid, tenant=tenant)
    # (the in-memory broker delivers as it publishes: a handler taking one event at a time,
    # as the node's snapshots were, would keep this waiting while one runs)
    async with asyncio.timeout(5):
        await bus.broker.publish(sent.sealed.wire, sent.sealed.subject, stream="DSEC_EVENTS")
    return sent.sealed.envelope


async def test_a_tenants_slow_snapshots_hold_no_other_tenants_snapshot_on_the_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    owner = {f"sbx_a{i}": "a" for i in range(6)} | {"sbx_b": "a"}
    work = _Work(owner)
    work.install(monkeypatch)
    service = _service(tmp_path)
    async with in_memory(service, run_hooks=False) as bus:
        try:
            for i in range(6):
                await _request(bus, "acme", f"sbx_a{i}", f"acme-{i}")
            await _request(bus, "beta", "sbx_b", "beta-0")
            await until(lambda: "beta-0" in work.inside, "beta's snapshot started")
            acme = [n for n in work.inside if n.startswith("acme")]
            assert len(acme) == 3  # acme runs its share, and leaves a worker to the others
        finally:
            work.release_all()
        await service.settled()
    assert work.inside == []


async def test_another_nodes_request_over_its_tenants_bound_is_not_ended_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every node holds every request until it has read whose it is. With its tenant full
    here, a request of a sandbox that runs on node b is acked without an end (b answers it);
    one of a sandbox that runs here is ended at once, saying why and that it never started."""
    work = _Work({"sbx_here": "a", "sbx_there": "b", "sbx_next": "a"})
    work.install(monkeypatch)
    service = _service(tmp_path, tenant_queue=1)
    async with in_memory(service, run_hooks=False) as bus:
        try:
            await _request(bus, "acme", "sbx_here", "held")
            await until(lambda: work.inside == ["held"], "the held snapshot running")
            there = await _request(bus, "acme", "sbx_there", "there")
            full = await _request(bus, "acme", "sbx_next", "next")
            await until(lambda: bus.caused_by(full), "the full tenant's request ended")
            assert bus.caused_by(there) == []
            (failed,) = bus.caused_by(full)
            assert failed.type == "snapshot.failed"
            reason = failed.payload["reason"]
            assert reason.startswith("nodeagent already holds 1 requests of tenant 'acme'"), reason
            assert "this one was not started" in reason
        finally:
            work.release_all()
        await service.settled()
    assert bus.caused_by(there) == []


async def test_requests_of_one_sandbox_take_turns_and_other_sandboxes_run_beside_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two rollbacks of one sandbox on two workers each listed the tree, then both wrote it:
    a tree that matched neither snapshot. One sandbox's snapshots and rollbacks now run one at
    a time, in the order they came; another sandbox's beside them. The one that waited acts on
    the sandbox's facts as they are once its turn came, not as they were before it waited."""
    inside: list[str] = []
    seen: list[list[str]] = []
    release: dict[str, asyncio.Event] = {}
    reads = [0]
    acted_on: dict[str, int] = {}

    async def restore(
        self: SnapshotRequests, envelope: Envelope, name: str, facts: object
    ) -> list[events.Payload]:
        acted_on[name] = cast(int, facts)
        inside.append(name)
        seen.append(sorted(inside))
        try:
            await release.setdefault(name, asyncio.Event()).wait()
        finally:
            inside.remove(name)
        return []

    async def facts(self: SnapshotRequests, sandbox_id: str) -> tuple[int, str, list[Any]]:
        reads[0] += 1
        return reads[0], "a", []  # both sandboxes run here; which read it was

    monkeypatch.setattr(SnapshotRequests, "facts", facts)
    monkeypatch.setattr(SnapshotRequests, "_restore_requested", restore)
    service = _service(tmp_path)
    async with in_memory(service, run_hooks=False) as bus:
        user = await bus.producer("user", tenant="acme")
        try:
            for sid, name in (("sbx_1", "first"), ("sbx_1", "second"), ("sbx_2", "other")):
                sent = await user.publish(
                    events.SnapshotRestoreRequested(snapshot=name), aggregate_id=sid, tenant="acme"
                )
                await bus.broker.publish(
                    sent.sealed.wire, sent.sealed.subject, stream="DSEC_EVENTS"
                )
            await until(lambda: sorted(inside) == ["first", "other"], "sbx_1's first and sbx_2's")
            for _ in range(20):
                await asyncio.sleep(0.001)
            assert "second" not in inside  # waits for sbx_1's first
            before_its_turn = reads[0]
            assert before_its_turn == 3  # one read each: the two that did not wait read once
            release.setdefault("first", asyncio.Event()).set()
            await until(lambda: "second" in inside, "sbx_1's second after its first")
            assert acted_on["second"] > before_its_turn  # read again once its turn came
        finally:
            for name in ("first", "second", "other"):
                release.setdefault(name, asyncio.Event()).set()
        await service.settled()
    assert all(not {"first", "second"} <= set(at) for at in seen)


async def test_whose_request_it_is_is_decided_where_it_is_in_the_log(tmp_path: Path) -> None:
    """A request held in its tenant's queue while its sandbox exits: the snapshot service read
    at once that node a had it, node a (reading later) found the sandbox running nowhere, and
    neither answered. Both now decide from the log up to the request: node a acts, the snapshot
    service does not, and node a's check before the runtime ends the request itself agrees
    (the real SnapshotRequests, NodeSnapshots, gate and log)."""
    service, snapshots = _wired(tmp_path)
    async with in_memory(service, run_hooks=False) as bus:
        sid = "sbx_x"
        user = await bus.producer("user", tenant="acme")
        await user.publish(events.SpecSubmitted(spec_yaml="x"), aggregate_id=sid, tenant="acme")
        scheduler = await bus.producer("scheduler")
        placed = events.SandboxScheduled(node_id="a", reason="test")
        await scheduler.publish(placed, aggregate_id=sid, tenant="acme")
        agent = await bus.producer("nodeagent", node_id="a")
        ready = events.SandboxReady(node_id="a", pid=1, cgroup="x")
        await agent.publish(ready, aggregate_id=sid, tenant="acme")
        request = await user.publish(
            events.SnapshotRequested(name="n1"), aggregate_id=sid, tenant="acme"
        )
        exited = events.SandboxExited(exit_code=0, reason="ok", duration_s=1.0)
        await agent.publish(exited, aggregate_id=sid, tenant="acme")
        assert service.gate is not None and service.nc is not None
        nc, gate = service.nc, service.gate
        on_node = SnapshotRequests(service.settings, nc.jetstream, lambda: gate, node_id="a")
        central = SnapshotRequests(service.settings, nc.jetstream, lambda: gate, node_id=None)
        _, now, _ = await on_node.facts(sid)
        assert now is None  # as the log is now: it runs nowhere
        token = HANDLING_SEQ.set(request.stream_seq)  # what the runtime sets while handling it
        try:
            _, then, _ = await on_node.facts(sid)
            assert then == "a"  # node a acts for it (both read the same log prefix)
            envelope = request.sealed.envelope
            assert await central.on_requested(envelope, envelope.decoded()) == []
            assert await snapshots.acts_for(envelope, envelope.decoded())
        finally:
            HANDLING_SEQ.reset(token)


async def test_a_snapshot_that_did_not_wait_reads_its_sandbox_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whose the request is and what to snapshot come from one read of the sandbox's history
    when no request of the sandbox went first (before, it was read twice: a few ms of each
    snapshot); one that waited behind another reads it again once its turn comes."""
    reads: list[int] = []
    took: dict[str, int] = {}
    release = asyncio.Event()

    async def read(self: SnapshotRequests, sandbox_id: str) -> tuple[list[Any], list[Any], int]:
        reads.append(len(reads) + 1)
        return [], [], reads[-1]

    async def take(
        self: SnapshotRequests, envelope: Envelope, event: events.SnapshotRequested, read: Any
    ) -> list[events.Payload]:
        took[event.name] = read[2]
        if event.name == "first":
            await release.wait()
        return []

    monkeypatch.setattr(SnapshotRequests, "_read", read)
    monkeypatch.setattr(SnapshotRequests, "_take", take)
    monkeypatch.setattr(requests_module, "_acting_for_request", lambda *_: "a")
    on_node = SnapshotRequests(Settings(home=tmp_path), lambda: None, lambda: None, node_id="a")  # type: ignore[arg-type, return-value]
    request = cast(Envelope, SimpleNamespace(aggregate_id="sbx_1"))

    def snapshot(name: str) -> asyncio.Task[Any]:
        event = events.SnapshotRequested(name=name)
        return asyncio.create_task(on_node.on_requested(request, event))

    first = snapshot("first")
    await until(lambda: "first" in took, "the first snapshot taken")
    assert reads == [1] and took["first"] == 1  # its one read
    second = snapshot("second")
    await until(lambda: len(reads) == 2, "the second request read")
    release.set()
    await asyncio.gather(first, second)
    assert reads == [1, 2, 3] and took["second"] == 3  # read again once its turn came
