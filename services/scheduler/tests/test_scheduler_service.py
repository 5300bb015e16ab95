"""The scheduler service on real NATS: node agents' heartbeats (published by test publishers the
stack's root certified as the node agent of each node) make the fleet; a sandbox's pipeline
events (policy, builder) make the request; what the scheduler publishes is what is asserted."""

from __future__ import annotations

import asyncio
import contextlib
import re
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import nats
import pytest
from dsec_core import events, identity
from dsec_core.bus import EventPublisher, replay
from dsec_core.envelope import Envelope, decode
from dsec_core.events import GpuInfo, NodeInventory
from dsec_core.spec import compile_plan, load_spec
from dsec_core.subjects import aggregate_filter
from dsec_testing import trust
from nacl.signing import SigningKey
from nats.js import JetStreamContext

pytestmark = pytest.mark.integration

GIB = 2**30
HEARTBEAT_S = 0.4
DECLARED_HEARTBEAT_S = 1.0  # what the node says: stale after 3 s, tolerant of a busy test host
LOST_S = 3.0
SCHEDULER_ENV = {"DSEC_NODE_LOST_S": str(LOST_S), "DSEC_MAX_PLACEMENTS": "3"}

SPEC = """\
version: "1.2"
name: {name}
base: dsec/python311:latest
entrypoint: [python, -c, "pass"]
resources: {{cpu: {cpu}, memory: {memory}{gpu}}}
"""


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_url)
    yield nc.jetstream()
    await nc.close()


@dataclass
class Beating:
    """A node agent of one node: heartbeats every HEARTBEAT_S until silenced."""

    node_id: str
    pub: EventPublisher
    inventory: NodeInventory
    task: asyncio.Task[None] | None = None
    seq: int = 0

    async def beat(self, problems: tuple[str, ...] = ()) -> None:
        self.seq += 1
        await self.pub.publish(
            events.NodeHeartbeat(
                node_id=self.node_id,
                seq=self.seq,
                inventory=self.inventory,
                problems=list(problems),
                heartbeat_s=DECLARED_HEARTBEAT_S,
            ),
            aggregate_id=self.node_id,
        )

    async def _run(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(HEARTBEAT_S)

    def silence(self) -> None:
        if self.task is not None:
            self.task.cancel()
            self.task = None


@dataclass
class World:
    """Certified producers of one test; ends what it started."""

    js: JetStreamContext
    home: Path
    pipe: trust.Pipeline
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    nodes: list[Beating] = field(default_factory=list)
    sandboxes: list[str] = field(default_factory=list)

    def node_id(self, name: str) -> str:
        return f"{name}-{self.tag}"

    async def node(
        self,
        name: str,
        *,
        cpus: float,
        mem_gib: int = 4096,
        gpus: tuple[int, ...] = (),
        joined: bool = True,
    ) -> Beating:
        node_id = self.node_id(name)
        pub = await trust.publisher(self.js, self.home, "nodeagent", node_id=node_id)
        inv = NodeInventory(
            cpus=cpus,
            memory_bytes=mem_gib * GIB,
            gpus=[
                GpuInfo(index=i, uuid=f"GPU-{node_id}-{i}", model="h100", memory_total_bytes=m)
                for i, m in enumerate(g * GIB for g in gpus)
            ],
            gpu_probe="declared",
        )
        beating = Beating(node_id, pub, inv)
        if joined:
            await pub.publish(
                events.NodeJoined(
                    node_id=node_id,
                    hostname="test",
                    version="0",
                    inventory=inv,
                    heartbeat_s=DECLARED_HEARTBEAT_S,
                ),
                aggregate_id=node_id,
            )
        beating.task = asyncio.create_task(beating._run())
        self.nodes.append(beating)
        return beating

    async def submit(
        self,
        *,
        cpu: float,
        memory: str = "1GiB",
        gpu: str = "",
        stop_while_building: bool = False,
        handover_from: str | None = None,
    ) -> str:
        """What the user, policy and builder publish for a sandbox of these resources (and the
        user's stop while it builds)."""
        sid = f"sbx_sched_{uuid.uuid4().hex[:12]}"
        text = SPEC.format(name="s", cpu=cpu, memory=memory, gpu=f", gpu: {gpu}" if gpu else "")
        loaded = load_spec(text, "dsec.yaml")
        assert loaded.spec is not None, loaded.errors
        plan = compile_plan(loaded.spec).model_dump(mode="json")
        p = self.pipe
        sub = await p.user.publish(
            events.SpecSubmitted(spec_yaml=text, handover_from=handover_from), aggregate_id=sid
        )
        val = await p.policy.publish(
            events.SpecValidated(
                name="s", spec_digest=blake3.blake3(text.encode()).hexdigest(), plan=plan
            ),
            aggregate_id=sid,
            causation=sub.envelope,
        )
        res = await p.builder.publish(
            events.DepsResolved(lock=[], lock_hash="l", python="3.11", platform="x", resolve_ms=0),
            aggregate_id=sid,
            causation=val.envelope,
        )
        if stop_while_building:
            await p.user.publish(events.SandboxStopRequested(), aggregate_id=sid)
        await p.builder.publish(
            events.EnvBuilt(
                lock_hash="l",
                fingerprint="f",
                object_key="envs/l.tar.zst",
                digest="d",
                size_bytes=1,
                reused=True,
            ),
            aggregate_id=sid,
            causation=res.envelope,
        )
        self.sandboxes.append(sid)
        return sid

    async def close(self) -> None:
        # The nodes say they are unhealthy as they stop: no later test's sandbox lands there.
        for beating in self.nodes:
            beating.silence()
            await beating.beat(problems=("test over",))
        # End every sandbox this test made, so no later test finds it waiting in the queue.
        for sid in self.sandboxes:
            with contextlib.suppress(Exception):
                await self.pipe.builder.publish(
                    events.SandboxFailed(stage="test", reason="test over"), aggregate_id=sid
                )


@pytest.fixture
async def world(js: JetStreamContext, dsec_stack: Any, services: Any) -> AsyncIterator[World]:
    w = World(js, dsec_stack.home, await trust.pipeline(js, dsec_stack.home))
    try:
        yield w
    finally:
        await w.close()
        with contextlib.suppress(Exception):  # shown by pytest when the test failed
            print(services.log("scheduler")[-6000:])


async def history(js: JetStreamContext, aggregate: str, agg_id: str) -> list[Envelope]:
    return [
        decode(data)
        async for _, data in replay(js, filter_subject=aggregate_filter(aggregate, agg_id))
    ]


async def wait_for(
    js: JetStreamContext,
    agg_id: str,
    predicate: Callable[[Envelope], bool],
    *,
    aggregate: str = "sandbox",
    timeout: float = 30.0,
) -> Envelope:
    """The first event of the aggregate that satisfies ``predicate`` (polled until the
    deadline; the assertion error lists what arrived)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        found = await history(js, aggregate, agg_id)
        for env in found:
            if predicate(env):
                return env
        if asyncio.get_running_loop().time() > deadline:
            got = [(e.type, e.producer, e.payload) for e in found]
            raise AssertionError(f"timed out on {agg_id}; events: {got}")
        await asyncio.sleep(0.1)


async def scrape(services: Any, needle: str, timeout: float = 10.0) -> str:
    """The scheduler's /metrics once it shows ``needle`` (and one export tick later)."""
    url = services.url("scheduler") + "/metrics"
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        body = text.decode()
        if needle in body and "dsec_scheduler_nodes{" in body:
            return body
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{needle} not on /metrics: {body[-2000:]}")
        await asyncio.sleep(0.2)


def of(event_type: str, **fields: Any) -> Callable[[Envelope], bool]:
    return lambda e: e.type == event_type and all(e.payload.get(k) == v for k, v in fields.items())


async def start_scheduler(services: Any, **env: str) -> None:
    """Start the service in a thread: the test's node agents keep beating meanwhile."""
    await asyncio.to_thread(services.start, "scheduler", env={**SCHEDULER_ENV, **env})


async def test_sandbox_is_scheduled_on_the_node_that_fits(
    world: World, js: JetStreamContext, services: Any
) -> None:
    await world.node("small", cpus=16)
    big = await world.node("big", cpus=1000)
    await start_scheduler(services)
    sid = await world.submit(cpu=500, memory="8GiB")
    placed = await wait_for(js, sid, of("sandbox.scheduled"))
    assert placed.producer == "scheduler"
    assert placed.payload["node_id"] == big.node_id
    assert placed.payload["attempt"] == 1
    assert placed.payload["resources"] == {
        "cpus": 500.0,
        "memory_bytes": 8 * GIB,
        "gpus": 0,
        "gpu_memory_bytes": 0,
    }
    built = await wait_for(js, sid, of("env.built"))
    assert placed.payload["env_built_id"] == built.id
    assert placed.causation_id == built.id
    # what an operator sees on /metrics
    text = await scrape(services, 'dsec_scheduler_decisions_total{type="sandbox.scheduled"}')
    assert 'dsec_scheduler_decisions_total{type="sandbox.scheduled"} 1.0' in text
    assert re.search(r'dsec_scheduler_nodes\{state="ready"\} [2-9]', text), text
    # the read model's live sandboxes by state, and the age of the oldest (stuck requests)
    text = await scrape(services, 'dsec_sandbox_state_oldest_seconds{state="submitted"}')
    assert re.search(r'dsec_sandboxes\{state="scheduled"\} [0-9.e+]+\n', text), text


async def test_a_hand_over_goes_to_the_node_its_old_version_runs_on(
    world: World, js: JetStreamContext, services: Any
) -> None:
    small = await world.node("small", cpus=16)
    await start_scheduler(services)
    old = await world.submit(cpu=10)
    placed = await wait_for(js, old, of("sandbox.scheduled"))
    assert placed.payload["node_id"] == small.node_id
    big = await world.node("big", cpus=1000)
    plain = await world.submit(cpu=4)  # where a sandbox of its size goes: the emptier node
    assert (await wait_for(js, plain, of("sandbox.scheduled"))).payload["node_id"] == big.node_id
    new = await world.submit(cpu=4, handover_from=old)
    placed = await wait_for(js, new, of("sandbox.scheduled"))
    assert placed.payload["node_id"] == small.node_id


async def test_no_fit_is_pending_with_the_reason_then_scheduled_when_a_big_node_joins(
    world: World, js: JetStreamContext, services: Any
) -> None:
    small = await world.node("small", cpus=16, gpus=(24, 24))
    await start_scheduler(services)
    sid = await world.submit(cpu=4, gpu="{count: 2, memory: 80GiB}")
    pending = await wait_for(js, sid, of("sandbox.pending"))
    assert f"{small.node_id}: GPUs: needs 2 of 80.0 GiB+, 0 free" in pending.payload["reason"]
    gpu_node = await world.node("gpu", cpus=64, gpus=(80, 80, 80, 80))
    placed = await wait_for(js, sid, of("sandbox.scheduled"))
    assert placed.payload["node_id"] == gpu_node.node_id
    assert placed.payload["resources"]["gpus"] == 2


async def test_silent_node_is_lost_and_its_sandbox_rescheduled_elsewhere(
    world: World, js: JetStreamContext, services: Any
) -> None:
    a = await world.node("a", cpus=1000)
    b = await world.node("b", cpus=1000)
    await start_scheduler(services)
    sid = await world.submit(cpu=400)
    first = await wait_for(js, sid, of("sandbox.scheduled"))
    on, other = (a, b) if first.payload["node_id"] == a.node_id else (b, a)
    on.silence()
    lost = await wait_for(js, on.node_id, of("node.lost"), aggregate="node")
    assert lost.payload["sandboxes"] == [sid]
    assert lost.payload["silent_s"] >= LOST_S
    unit = await wait_for(js, sid, of("unit.lost"))
    assert unit.payload == {
        "node_id": on.node_id,
        "reason": f"node {on.node_id} lost",
        "action": "reschedule",
        "attempt": 1,
    }
    again = await wait_for(js, sid, of("sandbox.scheduled", attempt=2))
    assert again.payload["node_id"] == other.node_id
    assert again.payload["previous_node"] == on.node_id
    # the silent node comes back: it rejoins empty (its old sandbox is not counted there), so
    # a sandbox that only fits a node with 700 free CPUs goes to it
    on.task = asyncio.create_task(on._run())
    later = await world.submit(cpu=700)
    back = await wait_for(js, later, of("sandbox.scheduled"))
    assert back.payload["node_id"] == on.node_id
    placements = [e for e in await history(js, "sandbox", sid) if e.type == "sandbox.scheduled"]
    assert [e.payload["node_id"] for e in placements] == [on.node_id, other.node_id]


async def test_cordon_stops_placement_there_and_drain_moves_sandboxes(
    world: World, js: JetStreamContext, services: Any
) -> None:
    a = await world.node("a", cpus=1000)
    b = await world.node("b", cpus=1000)
    operator = await trust.publisher(js, world.home, "operator", subject="operator")
    await start_scheduler(services)
    await operator.publish(
        events.NodeCordonRequested(node_id=a.node_id, action="cordon", reason="maintenance"),
        aggregate_id=a.node_id,
    )
    answer = await wait_for(js, a.node_id, of("node.cordoned"), aggregate="node")
    assert answer.payload["cordoned"] is True and answer.payload["draining"] is False
    first = await world.submit(cpu=300)
    placed = await wait_for(js, first, of("sandbox.scheduled"))
    assert placed.payload["node_id"] == b.node_id
    # drain b: its sandbox is lost ("node drained") and waits, since a is cordoned
    await operator.publish(
        events.NodeCordonRequested(node_id=b.node_id, action="drain"), aggregate_id=b.node_id
    )
    drained = await wait_for(js, b.node_id, of("node.cordoned", draining=True), aggregate="node")
    assert drained.payload["moved"] == [first]
    unit = await wait_for(js, first, of("unit.lost"))
    assert unit.payload["reason"] == "node drained" and unit.payload["action"] == "reschedule"
    pending = await wait_for(js, first, of("sandbox.pending"))
    assert f"{a.node_id}: cordoned" in pending.payload["reason"]
    assert f"{b.node_id}: draining" in pending.payload["reason"]
    await operator.publish(
        events.NodeCordonRequested(node_id=a.node_id, action="uncordon"), aggregate_id=a.node_id
    )
    moved = await wait_for(js, first, of("sandbox.scheduled", attempt=2))
    assert moved.payload["node_id"] == a.node_id
    assert moved.payload["previous_node"] == b.node_id


async def test_stop_of_a_pending_sandbox_ends_it_stopped(
    world: World, js: JetStreamContext, services: Any
) -> None:
    await world.node("small", cpus=8)
    await start_scheduler(services)
    sid = await world.submit(cpu=3000)
    await wait_for(js, sid, of("sandbox.pending"))
    await world.pipe.user.publish(
        events.SandboxStopRequested(requested_by="test"), aggregate_id=sid
    )
    ended = await wait_for(js, sid, of("sandbox.exited"))
    assert ended.producer == "scheduler"
    assert ended.payload["reason"] == "stopped" and ended.payload["exit_code"] == -1
    # a node big enough for it joins later: the stopped sandbox is not placed
    big = await world.node("big", cpus=4000)
    # stopped while it was built: once built it ends, never placed
    early = await world.submit(cpu=1, stop_while_building=True)
    ended_early = await wait_for(js, early, of("sandbox.exited"))
    assert ended_early.producer == "scheduler" and ended_early.payload["reason"] == "stopped"
    marker = await world.submit(cpu=3500)
    await wait_for(js, marker, of("sandbox.scheduled", node_id=big.node_id))
    for stopped in (sid, early):
        assert not placements(await history(js, "sandbox", stopped))


async def test_forged_heartbeats_never_change_placement(
    world: World, js: JetStreamContext, services: Any
) -> None:
    await world.node("real", cpus=8)
    forged_id = world.node_id("forged")
    huge = NodeInventory(cpus=100_000, memory_bytes=100_000 * GIB)  # fits anything
    beat = events.NodeHeartbeat(node_id=forged_id, seq=1, inventory=huge)
    # a user may not speak for a node; a key of another root is not certified; the node agent
    # of one node may not speak for another
    user = world.pipe.user
    other_root = trust.certified(SigningKey.generate(), "nodeagent", node_id=forged_id)
    stranger = EventPublisher(js, other_root.signer, certificate=other_root.cert)
    await stranger.register_key()
    neighbour = await trust.publisher(js, world.home, "nodeagent", node_id=world.node_id("n"))
    # one before the scheduler starts (its rebuild reads it), all three while it follows the log
    await neighbour.publish(beat, aggregate_id=forged_id)
    await start_scheduler(services)
    # the scheduler process may have served earlier tests: count what these beats add
    before = _rejected_heartbeats(await scrape(services, "dsec_events_rejected_total"))
    for pub in (user, stranger, neighbour):
        await pub.publish(beat, aggregate_id=forged_id)
    sid = await world.submit(cpu=4000)
    pending = await wait_for(js, sid, of("sandbox.pending"))
    assert forged_id not in pending.payload["reason"]
    assert "CPUs: needs 4000" in pending.payload["reason"]
    assert not [e for e in await history(js, "sandbox", sid) if e.type == "sandbox.scheduled"]
    # each refusal is counted where an operator looks
    after = _rejected_heartbeats(await scrape(services, 'reason="uncertified-key"'))
    added = {r: after[r] - before.get(r, 0.0) for r in after if after[r] != before.get(r, 0.0)}
    # each forged beat once: the user's and the neighbour's (+ the one its rebuild read, when
    # the first scrape came before the rebuild ended), the stranger's
    assert added.pop("uncertified-key") == 1.0
    assert added in ({"unauthorized": 2.0}, {"unauthorized": 3.0})
    assert after["unauthorized"] >= 3.0


def _rejected_heartbeats(text: str) -> dict[str, float]:
    return {
        reason: float(value)
        for reason, value in re.findall(
            r'dsec_events_rejected_total\{reason="([^"]+)",service="scheduler",'
            r'type="node.heartbeat"\} (\S+)',
            text,
        )
    }


def placements(found: list[Envelope]) -> list[str]:
    return [e.payload["node_id"] for e in found if e.type == "sandbox.scheduled"]


async def test_state_survives_a_crash_of_the_scheduler(
    world: World, js: JetStreamContext, services: Any
) -> None:
    small = await world.node("small", cpus=16)
    await start_scheduler(services)
    held = await world.submit(cpu=10)
    await wait_for(js, held, of("sandbox.scheduled", node_id=small.node_id))
    waits = await world.submit(cpu=50)
    await wait_for(js, waits, of("sandbox.pending"))
    await asyncio.to_thread(services.restart, "scheduler", kill=True)
    # the allocation on `small` was rebuilt from the log: 6 CPUs are free there
    later = await world.submit(cpu=10)
    pending = await wait_for(js, later, of("sandbox.pending"))
    assert f"{small.node_id}: CPUs: needs 10, 6 free" in pending.payload["reason"]
    # so was the queue: both waiting sandboxes go to the node that joins, oldest first
    big = await world.node("big", cpus=100)
    first = await wait_for(js, waits, of("sandbox.scheduled"))
    second = await wait_for(js, later, of("sandbox.scheduled"))
    assert first.payload["node_id"] == second.payload["node_id"] == big.node_id
    for sid in (held, waits, later):
        assert len(placements(await history(js, "sandbox", sid))) == 1, sid


async def test_two_schedulers_at_once_place_each_sandbox_once(
    world: World, js: JetStreamContext, services: Any, dsec_stack: Any
) -> None:
    from dsec_core.settings import Settings

    from dsec_scheduler.app import create_service

    home = dsec_stack.home
    identity.ensure_service_identity(identity.TrustPaths(home), trust.stack_root(home), "scheduler")
    replica = create_service(
        Settings(
            home=dsec_stack.home,
            nats_url=dsec_stack.nats_plain_url,
            nats_nkey_seed=dsec_stack.nats_seed("scheduler"),
            postgres_dsn="",  # one projector is enough
            node_lost_s=LOST_S,
        )
    )
    await asyncio.gather(start_scheduler(services), replica.start())
    try:
        sandboxes = [await world.submit(cpu=30) for _ in range(4)]
        for sid in sandboxes:
            await wait_for(js, sid, of("sandbox.pending"))
        # both replicas see the node join and try the queue: one placement per sandbox
        big = await world.node("big", cpus=1000)
        for sid in sandboxes:
            await wait_for(js, sid, of("sandbox.scheduled", node_id=big.node_id))
        await world.node("other", cpus=1000)  # another pass of both replicas
        marker = await world.submit(cpu=10)
        await wait_for(js, marker, of("sandbox.scheduled"))
        for sid in sandboxes:
            found = await history(js, "sandbox", sid)
            assert placements(found) == [big.node_id], [(e.type, e.producer) for e in found]
    finally:
        await replica.stop()


async def test_a_sandbox_lost_at_its_last_placement_fails(
    world: World, js: JetStreamContext, services: Any
) -> None:
    a = await world.node("a", cpus=1000)
    await start_scheduler(services, DSEC_MAX_PLACEMENTS="1")
    sid = await world.submit(cpu=300)
    await wait_for(js, sid, of("sandbox.scheduled", node_id=a.node_id))
    a.silence()
    unit = await wait_for(js, sid, of("unit.lost"))
    assert unit.payload["action"] == "fail" and unit.payload["attempt"] == 1
    # a node joins afterwards: the failed sandbox is not placed again (the marker is)
    b = await world.node("b", cpus=1000)
    marker = await world.submit(cpu=300)
    await wait_for(js, marker, of("sandbox.scheduled", node_id=b.node_id))
    found = await history(js, "sandbox", sid)
    assert placements(found) == [a.node_id]
    assert "sandbox.pending" not in [e.type for e in found]


async def test_the_scheduler_follows_the_log_again_after_nats_restarts(
    world: World, js: JetStreamContext, services: Any, nats_restart: Any
) -> None:
    a = await world.node("a", cpus=1000)
    await start_scheduler(services)
    await nats_restart.arestart(kill=True)
    # its fold reads the log again (heartbeats, the new sandbox): otherwise the handler would
    # wait for it in vain and the node would look silent
    sid = await world.submit(cpu=200)
    placed = await wait_for(js, sid, of("sandbox.scheduled"), timeout=60)
    assert placed.payload["node_id"] == a.node_id
    health = await asyncio.to_thread(
        lambda: urllib.request.urlopen(services.url("scheduler") + "/healthz", timeout=5).read()
    )
    assert b'"status": "ok"' in health


async def test_a_dead_nodes_heartbeat_replayed_does_not_bring_it_back(
    world: World, js: JetStreamContext, services: Any
) -> None:
    """Whoever reads the bus publishes the bytes of a lost node's last genuine heartbeat again
    (authentic, signed by that node agent): the node stays lost and takes no sandbox."""
    from dsec_core.subjects import STREAM, subject_for

    await world.node("small", cpus=8)
    dead = await world.node("dead", cpus=1000)
    await start_scheduler(services)
    dead.silence()
    await wait_for(js, dead.node_id, of("node.lost"), aggregate="node")
    subject = subject_for("node.heartbeat", dead.node_id)
    last = await js.get_last_msg(STREAM, subject)
    await js.publish(subject, last.data, headers={"Nats-Msg-Id": uuid.uuid4().hex})
    sid = await world.submit(cpu=500)
    pending = await wait_for(js, sid, of("sandbox.pending"))
    assert f"{dead.node_id}: lost" in pending.payload["reason"]
    assert not placements(await history(js, "sandbox", sid))
    lost = [e for e in await history(js, "node", dead.node_id) if e.type == "node.lost"]
    assert len(lost) == 1  # not revived, so not lost a second time either


def _unchecked(payload: dict[str, Any]) -> events.NodeHeartbeat:
    """A heartbeat carrying ``payload`` as is (what a hostile node agent's own code sends,
    never validated by the model on its way out)."""

    class Unchecked(events.NodeHeartbeat):
        def model_dump(self, **_: Any) -> dict[str, Any]:  # type: ignore[override]
            return payload

    return Unchecked.model_construct()


async def test_a_node_agent_claiming_absurd_inventory_or_endless_problems_poisons_nothing(
    world: World, js: JetStreamContext, services: Any, postgres_dsn: str
) -> None:
    """Certified node agents (each for its own node) heartbeat NaN or negative CPUs, 10^30
    bytes, and 700 KB of problems: the scheduler cannot read those heartbeats, so those nodes
    are not in the fleet; the honest node takes what fits it and a sandbox that fits nowhere
    waits with a reason of bounded size (it used to be placed on the NaN node, or fail to
    publish at all)."""
    honest = await world.node("honest", cpus=8)
    hostile = {
        "nan": {"cpus": float("nan"), "memory_bytes": 2**40},
        "negative": {"cpus": -5.0, "memory_bytes": -1},
        "huge": {"cpus": 4.0, "memory_bytes": 1e30},
    }
    await start_scheduler(services)
    for name, inventory in hostile.items():
        node_id = world.node_id(name)
        pub = await trust.publisher(js, world.home, "nodeagent", node_id=node_id)
        payload = {"node_id": node_id, "seq": 1, "inventory": inventory, "heartbeat_s": 1.0}
        await pub.publish(_unchecked(payload), aggregate_id=node_id)
    noisy_id = world.node_id("noisy")
    noisy = await trust.publisher(js, world.home, "nodeagent", node_id=noisy_id)
    inv = {"cpus": 10_000.0, "memory_bytes": 2**40}
    problems = [f"problem {i} " + "x" * 7000 for i in range(100)]
    beat = {"node_id": noisy_id, "seq": 1, "inventory": inv, "problems": problems}
    await noisy.publish(_unchecked(beat), aggregate_id=noisy_id)
    big = await world.submit(cpu=500)
    pending = await wait_for(js, big, of("sandbox.pending"))
    reason = pending.payload["reason"]
    assert f"{honest.node_id}: CPUs: needs 500" in reason and len(reason) < 4500
    for name in (*hostile, "noisy"):
        assert world.node_id(name) not in reason
    small = await world.submit(cpu=2)
    placed = await wait_for(js, small, of("sandbox.scheduled"))
    assert placed.payload["node_id"] == honest.node_id
    assert not placements(await history(js, "sandbox", big))
    # the read model an operator lists (`dsec node list`) keeps following: the honest node's
    # heartbeats after the hostile ones are projected, the hostile nodes never are
    import asyncpg

    after = (await history(js, "node", honest.node_id))[-1].time
    conn = await asyncpg.connect(postgres_dsn)
    try:
        deadline = asyncio.get_running_loop().time() + 15
        while True:
            rows = dict(await conn.fetch("SELECT node_id, last_seen FROM nodes"))
            if rows.get(honest.node_id) and rows[honest.node_id] >= after:
                break
            assert asyncio.get_running_loop().time() < deadline, rows
            await asyncio.sleep(0.2)
        assert not {world.node_id(n) for n in (*hostile, "noisy")} & set(rows)
    finally:
        await conn.close()


async def test_replayed_or_unauthorized_cordons_drain_nothing(
    world: World, js: JetStreamContext, services: Any
) -> None:
    """After an operator's drain and uncordon, the bytes of the drain request and of the
    scheduler's `node.cordoned{draining}` are published again, and a user and a node agent ask
    for a drain: the node stays uncordoned and takes the next sandbox."""
    from dsec_core.subjects import STREAM, subject_for

    a = await world.node("a", cpus=1000)
    operator = await trust.publisher(js, world.home, "operator", subject="operator")
    await start_scheduler(services)
    drain = await operator.publish(
        events.NodeCordonRequested(node_id=a.node_id, action="drain"), aggregate_id=a.node_id
    )
    await wait_for(js, a.node_id, of("node.cordoned", draining=True), aggregate="node")
    await operator.publish(
        events.NodeCordonRequested(node_id=a.node_id, action="uncordon"), aggregate_id=a.node_id
    )
    await wait_for(js, a.node_id, of("node.cordoned", cordoned=False), aggregate="node")
    cordoned = subject_for("node.cordoned", a.node_id)
    first = await js.get_msg(STREAM, seq=1, subject=cordoned, next=True)  # the drain's answer
    for subject, data in ((drain.sealed.subject, drain.sealed.wire), (cordoned, first.data)):
        await js.publish(subject, data, headers={"Nats-Msg-Id": uuid.uuid4().hex})
    request = events.NodeCordonRequested(node_id=a.node_id, action="drain")
    await world.pipe.user.publish(request, aggregate_id=a.node_id)
    await world.pipe.nodeagent.publish(request, aggregate_id=a.node_id)
    text = await scrape(services, 'reason="replayed",service="scheduler"')
    assert re.search(
        r'dsec_events_rejected_total\{reason="replayed",service="scheduler",'
        r'type="node.cordon_requested"\} 1.0',
        text,
    ), text
    sid = await world.submit(cpu=500)
    placed = await wait_for(js, sid, of("sandbox.scheduled"))
    assert placed.payload["node_id"] == a.node_id
    answers = [e for e in await history(js, "node", a.node_id) if e.type == "node.cordoned"]
    assert [e.payload["draining"] for e in answers] == [True, False, True]  # incl. the copy
    assert len({e.id for e in answers}) == 2
    needle = 'reason="unauthorized",service="scheduler",type="node.cordon_requested"} 2.0'
    assert needle in await scrape(services, needle)


async def test_another_tenants_stop_neither_ends_nor_unqueues_a_waiting_sandbox(
    world: World, js: JetStreamContext, services: Any
) -> None:
    """A certified user of tenant `acme` stops tenant `default`'s pending sandbox: refused
    (`cross-tenant`); the sandbox keeps waiting and is placed when a node fits it."""
    await world.node("small", cpus=8)
    await start_scheduler(services)
    sid = await world.submit(cpu=3000)
    await wait_for(js, sid, of("sandbox.pending"))
    mallory = await trust.publisher(js, world.home, "user", tenant="acme")
    await mallory.publish(events.SandboxStopRequested(requested_by="mallory"), aggregate_id=sid)
    # refused twice: by the stop handler and by the fold that keeps the queue
    needle = 'reason="cross-tenant",service="scheduler",type="sandbox.stop_requested"} 2.0'
    assert needle in await scrape(services, needle)
    big = await world.node("big", cpus=4000)
    placed = await wait_for(js, sid, of("sandbox.scheduled"))
    assert placed.payload["node_id"] == big.node_id
    assert not [e for e in await history(js, "sandbox", sid) if e.type == "sandbox.exited"]


async def test_a_gpu_unit_is_placed_with_its_score_and_a_misfit_waits_with_node_counts(
    world: World, js: JetStreamContext, services: Any
) -> None:
    """On a declared GPU inventory: each unit's ``unit.placed`` (GPUs, model, policy, score
    breakdown, feasible/total nodes) comes before ``sandbox.scheduled``; a unit asking for a
    model no node has waits with how many nodes lacked what; operators see both on /metrics
    (`dsec schedule explain` on such events: tests/test_schedule_explain.py)."""
    gpu_node = await world.node("h100s", cpus=64, gpus=(80, 80))
    await start_scheduler(services, DSEC_SCHEDULER_POLICY="dsec")
    sid = await world.submit(cpu=4, gpu="{count: 2, type: h100}")
    scheduled = await wait_for(js, sid, of("sandbox.scheduled"))
    assert scheduled.payload["node_id"] == gpu_node.node_id
    kinds = [e.type for e in await history(js, "sandbox", sid)]
    assert kinds.index("unit.placed") < kinds.index("sandbox.scheduled")
    placed = await wait_for(js, sid, of("unit.placed"))
    p = placed.payload
    assert placed.producer == "scheduler"
    assert (p["unit"], p["node_id"], p["gpu_indices"], p["gpu_milli"]) == (
        "main",
        gpu_node.node_id,
        [0, 1],
        1000,
    )
    assert (p["gpu_model"], p["cpu_millicores"], p["gang_size"], p["attempt"]) == (
        "H100",
        4000,
        1,
        1,
    )
    assert p["policy"] and p["breakdown"] and 1 <= p["feasible_nodes"] <= p["nodes_total"]

    waits = await world.submit(cpu=1, gpu="{count: 1, type: v100}")
    pending = await wait_for(js, waits, of("sandbox.pending"))
    q = pending.payload
    assert q["unit"] == "main"
    assert q["unfit"]["no GPU of model V100M16/V100M32"] >= 1  # the H100 node (and others)
    assert sum(q["unfit"].values()) == q["nodes_total"]
    assert q["reason"].startswith(f"0/{q['nodes_total']} nodes: ")

    text = await scrape(services, 'dsec_scheduler_placements_total{outcome="placed"')
    assert re.search(r'dsec_scheduler_placements_total\{outcome="unfit",policy="\w+"\} [1-9]', text)
    assert 'dsec_scheduler_gpu_allocation_ratio{model="H100"}' in text
    # The wait's class is its commonest reason (here, after other tests: often their
    # unhealthy nodes), exported on the next tick.
    pending_gauge = r'dsec_scheduler_pending_units\{reason="(\w+)"\} ([1-9]\d*)'
    deadline = asyncio.get_running_loop().time() + 10
    while not re.search(pending_gauge, text):
        assert asyncio.get_running_loop().time() < deadline, text[-3000:]
        await asyncio.sleep(0.2)
        text = await scrape(services, "dsec_scheduler_pending_units")
    assert "dsec_scheduler_placement_seconds_bucket" in text


async def test_forged_unit_placed_or_pending_neither_holds_nor_frees_capacity(
    world: World, js: JetStreamContext, services: Any
) -> None:
    """Attack: a ``unit.placed`` claiming that a placed sandbox also holds both GPUs of
    another node, and a ``sandbox.pending`` for it (which would free its node and place it
    again), each signed by the other node's agent, by the sandbox's tenant's user, by the
    policy service and by a key no root certified. The scheduler folds none: the next
    sandbox takes the GPUs the forgeries claimed, and the first keeps its one placement."""
    one = await world.node("one", cpus=64, gpus=(80, 80))
    two = await world.node("two", cpus=64, gpus=(80, 80))
    await start_scheduler(services)
    first = await world.submit(cpu=4, gpu="{count: 2}")
    placed = await wait_for(js, first, of("sandbox.scheduled"))
    held_on = placed.payload["node_id"]
    free = two if held_on == one.node_id else one
    stranger_id = trust.certified(SigningKey.generate(), "scheduler")
    stranger = EventPublisher(js, stranger_id.signer, certificate=stranger_id.cert)
    await stranger.register_key()
    pubs = (free.pub, world.pipe.user, world.pipe.policy, stranger)
    claim = events.UnitPlaced(
        sandbox_id=first, unit="side", node_id=free.node_id, gpu_indices=[0, 1],
        gpu_milli=1000, cpu_millicores=1000, memory_bytes=GIB, policy="dsec", attempt=1,
    )  # fmt: skip
    wait = events.SandboxPending(reason="forged", attempt=2)
    for pub in pubs:
        with contextlib.suppress(Exception):  # a publisher may refuse to sign what it may not
            await pub.publish(claim, aggregate_id=first)
            await pub.publish(wait, aggregate_id=first)
    second = await world.submit(cpu=4, gpu="{count: 2}")
    got = await wait_for(js, second, of("sandbox.scheduled"))
    assert got.payload["node_id"] == free.node_id
    told = await history(js, "sandbox", first)
    forged = [e for e in told if e.type in {"unit.placed", "sandbox.pending"}]
    assert {e.producer for e in forged} - {"scheduler"}, "the forgeries are in the log"
    assert len([e for e in forged if e.payload.get("node_id") == free.node_id]) == len(pubs)
    scheduled = [e for e in told if e.type == "sandbox.scheduled"]
    assert [e.payload["node_id"] for e in scheduled] == [held_on]
