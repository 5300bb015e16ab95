"""The scheduler's queue over the fold, without a bus: a stand-in service records what the
scheduler would publish. Priority order, backfill and its bound, quotas, and a gang's events
(each unit's ``unit.placed`` before the sandbox's ``sandbox.scheduled``)."""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import pytest
from dsec_core.events import GpuInfo, NodeInventory, Payload, Resources
from dsec_core.settings import Settings

from dsec_scheduler.app import Scheduler
from dsec_scheduler.domain import Seen
from dsec_scheduler.gangs import BACKFILL_S, Quota, gang_demand

GIB = 2**30
_ids = itertools.count()


@dataclass
class Published:
    payload: Payload
    aggregate_id: str
    event_id: str


@dataclass
class Recorder:
    out: list[Published] = field(default_factory=list)

    async def publish(
        self, payload: Payload, *, aggregate_id: str, event_id: str, **_: Any
    ) -> None:
        self.out.append(Published(payload, aggregate_id, event_id))


@dataclass
class StandIn:
    """What the scheduler uses of its service: settings, a publisher, a name (no gate: a
    sandbox's plan is then read as its resources)."""

    settings: Settings
    publisher: Recorder = field(default_factory=Recorder)
    name: str = "scheduler"
    gate: None = None
    nc: None = None


def scheduler(**settings: Any) -> tuple[Scheduler, Recorder]:
    service = StandIn(Settings(**settings))
    return Scheduler(service), service.publisher  # type: ignore[arg-type]


def seen(type_: str, agg: str, payload: dict[str, Any], at: float, tenant: str = "acme") -> Seen:
    return Seen(f"ev{next(_ids)}", type_, agg, tenant, payload, at, at)


def gpu_node(s: Scheduler, node_id: str, gpus: int) -> None:
    inv = NodeInventory(
        cpus=64,
        memory_bytes=512 * GIB,
        gpus=[
            GpuInfo(index=i, uuid=f"{node_id}-{i}", model="H100", memory_total_bytes=80 * GIB)
            for i in range(gpus)
        ],
    )
    payload = {"node_id": node_id, "inventory": inv.model_dump(mode="json"), "heartbeat_s": 5}
    s.state.apply(seen("node.joined", node_id, payload, time.time(), "system"))


def waiting(s: Scheduler, sid: str, gpus: int, at: float, tenant: str = "acme") -> None:
    """A sandbox built and pending since ``at``."""
    s.state.apply(seen("env.built", sid, {}, at, tenant))
    r = Resources(cpus=1, memory_bytes=GIB, gpus=gpus).model_dump(mode="json")
    s.state.apply(seen("sandbox.pending", sid, {"reason": "x", "resources": r}, at, tenant))


def holding(s: Scheduler, sid: str, node: str, gpus: int, tenant: str = "acme") -> None:
    now = time.time()
    s.state.apply(seen("env.built", sid, {}, now, tenant))
    r = Resources(cpus=1, memory_bytes=GIB, gpus=gpus).model_dump(mode="json")
    s.state.apply(seen("sandbox.scheduled", sid, {"node_id": node, "resources": r}, now, tenant))


def decided(rec: Recorder, sid: str) -> list[str]:
    return [p.payload.TYPE for p in rec.out if p.aggregate_id == sid]


def prioritise(s: Scheduler, sid: str, priority: int) -> None:
    """The sandbox's plan has a topology of one GPU unit with this priority."""
    topology = {
        "units": [{"name": "main", "gpus": 1, "cpu_millicores": 1000, "memory_bytes": GIB}],
        "priority": priority,
    }
    sbx = s.state.sandboxes[sid]
    assert sbx.resources is not None
    s._remember(sid, gang_demand(sid, "acme", {"topology": topology}, sbx.resources))


async def test_higher_priority_goes_first_then_first_come_first_served() -> None:
    s, rec = scheduler()
    gpu_node(s, "n1", gpus=1)
    now = time.time()
    waiting(s, "sbx_old_low", 1, now - 50)
    waiting(s, "sbx_new_high", 1, now - 10)
    waiting(s, "sbx_newer_high", 1, now - 5)
    for sid, prio in (("sbx_old_low", 0), ("sbx_new_high", 5), ("sbx_newer_high", 5)):
        prioritise(s, sid, prio)
    await s.place_waiting()
    assert decided(rec, "sbx_new_high") == ["unit.placed", "sandbox.scheduled"]
    assert "sandbox.scheduled" not in decided(rec, "sbx_newer_high")
    assert "sandbox.scheduled" not in decided(rec, "sbx_old_low")
    placed = next(p.payload for p in rec.out if p.payload.TYPE == "unit.placed")
    assert placed.model_dump()["gpu_indices"] == [0]


async def test_backfill_passes_a_head_that_cannot_fit_until_it_waited_too_long() -> None:
    s, rec = scheduler()
    gpu_node(s, "n1", gpus=2)
    holding(s, "sbx_running", "n1", gpus=1)
    now = time.time()
    waiting(s, "sbx_big", 2, now - 60)  # the head: 2 GPUs, only 1 free
    waiting(s, "sbx_small", 1, now - 30)
    await s.place_waiting()
    assert decided(rec, "sbx_small") == ["unit.placed", "sandbox.scheduled"]  # backfilled

    s2, rec2 = scheduler()
    gpu_node(s2, "n1", gpus=2)
    holding(s2, "sbx_running", "n1", gpus=1)
    waiting(s2, "sbx_big", 2, now - BACKFILL_S - 1)
    waiting(s2, "sbx_small", 1, now - 30)
    await s2.place_waiting()
    (small,) = [p.payload for p in rec2.out if p.aggregate_id == "sbx_small"]
    assert small.TYPE == "sandbox.pending"
    assert small.model_dump()["reason"].startswith("queued behind sbx_big (priority 0, waiting")

    s3, rec3 = scheduler()  # a head that could never fit blocks nothing
    gpu_node(s3, "n1", gpus=2)
    holding(s3, "sbx_running", "n1", gpus=1)
    waiting(s3, "sbx_huge", 8, now - BACKFILL_S - 1)
    waiting(s3, "sbx_small", 1, now - 30)
    await s3.place_waiting()
    assert decided(rec3, "sbx_small") == ["unit.placed", "sandbox.scheduled"]


async def test_a_team_at_its_quota_waits_and_another_team_is_placed(tmp_path: Any) -> None:
    quotas = tmp_path / "quotas.yaml"
    quotas.write_text("acme: {gpus: 1}\n")
    s, rec = scheduler(scheduler_quotas=str(quotas))
    assert s.quotas == {"acme": Quota(gpus=1.0)}
    gpu_node(s, "n1", gpus=4)
    holding(s, "sbx_running", "n1", gpus=1, tenant="acme")
    now = time.time()
    waiting(s, "sbx_acme", 1, now - 20, tenant="acme")
    waiting(s, "sbx_lab", 1, now - 10, tenant="lab")
    await s.place_waiting()
    (acme,) = [p.payload.model_dump() for p in rec.out if p.aggregate_id == "sbx_acme"]
    assert acme["reason"] == "quota: team acme uses 1/1 GPUs, asks 1"
    assert acme["unfit"] == {} and acme["nodes_total"] == 1
    assert decided(rec, "sbx_lab") == ["unit.placed", "sandbox.scheduled"]


async def test_a_gang_publishes_every_unit_then_the_sandbox_on_its_main_units_node() -> None:
    s, rec = scheduler()
    gpu_node(s, "n1", gpus=2)
    gpu_node(s, "n2", gpus=4)
    now = time.time()
    waiting(s, "sbx_gang", 0, now - 5)
    topology = {
        "units": [
            {"name": "side", "gpu_milli": 500, "cpu_millicores": 500, "memory_bytes": GIB},
            {"name": "main", "gpus": 4, "cpu_millicores": 4000, "memory_bytes": GIB},
        ]
    }
    sbx = s.state.sandboxes["sbx_gang"]
    assert sbx.resources is not None
    s._remember("sbx_gang", gang_demand("sbx_gang", "acme", {"topology": topology}, sbx.resources))
    await s.place_waiting()
    kinds = decided(rec, "sbx_gang")
    assert kinds == ["unit.placed", "unit.placed", "sandbox.scheduled"]
    units = {p.payload.model_dump()["unit"]: p.payload.model_dump() for p in rec.out[:2]}
    assert units["main"]["node_id"] == "n2" and units["main"]["gang_size"] == 2
    assert units["side"]["gpu_milli"] == 500
    scheduled = rec.out[2].payload.model_dump()
    assert scheduled["node_id"] == "n2"
    # what the gang holds is counted: the fleet's units say so
    held = {
        u.unit: u.node_id for u in s.state.fleet(time.time()).units if u.sandbox_id == "sbx_gang"
    }
    assert held == {"main": "n2", "side": units["side"]["node_id"]}
    assert len({p.event_id for p in rec.out}) == 3  # distinct, derived ids


async def test_a_gpu_type_too_long_for_a_reason_key_never_stops_the_queue() -> None:
    """Attack: a spec's unknown ``resources.gpu.type`` (validates with a warning) of 300
    characters, which no node has: its ``no GPU of model …`` reason is longer than a
    ``sandbox.pending`` reason key may be. It waits with a bounded reason, and the sandbox
    behind it is still placed."""
    s, rec = scheduler()
    gpu_node(s, "n1", gpus=1)
    now = time.time()
    waiting(s, "sbx_long", 1, now - 20)
    waiting(s, "sbx_next", 1, now - 10)
    sbx = s.state.sandboxes["sbx_long"]
    assert sbx.resources is not None
    plan = {"resources": {"gpu": {"count": 1, "type": "x" * 300}}}
    s._remember("sbx_long", gang_demand("sbx_long", "acme", plan, sbx.resources))
    await s.place_waiting()
    (long_,) = [p.payload.model_dump() for p in rec.out if p.aggregate_id == "sbx_long"]
    assert long_["unit"] == "main" and sum(long_["unfit"].values()) == 1
    assert all(len(k) <= 200 for k in long_["unfit"])
    assert decided(rec, "sbx_next") == ["unit.placed", "sandbox.scheduled"]


async def test_a_node_reporting_a_gpu_model_too_long_for_unit_placed_never_stops_the_queue() -> (
    None
):
    """Attack: a node agent (its own certified identity) reports a GPU model name of 100
    characters (no catalogue row matches: the name is kept). A unit placed on that GPU is
    published with the name bounded, not a ``unit.placed`` that cannot be built."""
    s, rec = scheduler()
    inv = NodeInventory(
        cpus=64,
        memory_bytes=512 * GIB,
        gpus=[GpuInfo(index=0, uuid="g-0", model="Z" * 100, memory_total_bytes=80 * GIB)],
    )
    payload = {"node_id": "odd", "inventory": inv.model_dump(mode="json"), "heartbeat_s": 5}
    s.state.apply(seen("node.joined", "odd", payload, time.time(), "system"))
    waiting(s, "sbx_on_odd", 1, time.time() - 5)
    await s.place_waiting()
    assert decided(rec, "sbx_on_odd") == ["unit.placed", "sandbox.scheduled"]
    placed = rec.out[0].payload.model_dump()
    assert placed["gpu_model"].startswith("ZZZ") and len(placed["gpu_model"]) <= 64


async def test_a_team_cannot_pass_its_quota_by_a_build_racing_the_queue(tmp_path: Any) -> None:
    """Attack: a team at 0 of its 1-GPU quota has one sandbox waiting and another whose
    ``env.built`` arrives while the queue is being placed; publishing yields between a
    decision's events. Both decisions are taken one after the other: one is placed, the
    other waits on the quota (never 2 GPUs held on a quota of 1)."""
    from types import SimpleNamespace

    from dsec_core.spec import compile_plan, load_spec

    quotas = tmp_path / "quotas.yaml"
    quotas.write_text("acme: {gpus: 1}\n")
    s, rec = scheduler(scheduler_quotas=str(quotas))
    slow = rec.publish

    async def publish(payload: Payload, **kw: Any) -> None:
        await asyncio.sleep(0.01)  # the bus acks later: other decisions may run meanwhile
        await slow(payload, **kw)

    rec.publish = publish  # type: ignore[method-assign]
    loaded = load_spec(
        'version: "1.2"\nname: s\nbase: b\nentrypoint: [x]\nresources: {gpu: {count: 1}}\n',
        "dsec.yaml",
    )
    assert loaded.spec is not None, loaded.errors
    plan = compile_plan(loaded.spec).model_dump(mode="json")

    async def find(subject: str, **_: Any) -> Any:
        return SimpleNamespace(payload={"plan": plan}) if "validated" in subject else None

    async def barrier(timeout: float = 0.0, *, upto: int | None = None) -> None:
        return None

    s.service.gate = SimpleNamespace(find=find)  # type: ignore[assignment]
    s.barrier = barrier  # type: ignore[method-assign]
    gpu_node(s, "n1", gpus=4)
    waiting(s, "sbx_queued", 1, time.time() - 60)
    built = seen("env.built", "sbx_built", {}, time.time())
    s.state.apply(built)
    envelope = SimpleNamespace(id=built.id, aggregate_id="sbx_built", tenant="acme")
    await asyncio.gather(s.place_waiting(), s.on_env_built(envelope))  # type: ignore[arg-type]
    scheduled = [p.aggregate_id for p in rec.out if p.payload.TYPE == "sandbox.scheduled"]
    assert len(scheduled) == 1, rec.out
    (other,) = {"sbx_queued", "sbx_built"} - set(scheduled)
    (wait,) = [p.payload.model_dump() for p in rec.out if p.aggregate_id == other]
    assert wait["reason"] == "quota: team acme uses 1/1 GPUs, asks 1"


async def test_whether_a_head_could_ever_fit_is_judged_seldom() -> None:
    """Attack: a tenant's large gang at the head of the queue (priority 1000) made every queue
    pass judge it against the whole fleet with the reference engine (units x nodes, on the
    event loop). It is judged only once the head waited long enough to block backfill, and
    then at most once per :data:`FIT_JUDGED_EVERY_S` (a head cannot take what is not there)."""
    from dsec_scheduler.app import FIT_JUDGED_EVERY_S

    assert FIT_JUDGED_EVERY_S <= 60
    s, _ = scheduler()
    gpu_node(s, "n1", gpus=1)
    judged: list[str] = []
    real = s._could_ever_fit

    def counting(gang: Any, fleet: Any) -> bool:
        judged.append(gang.gang_id)
        return real(gang, fleet)

    s._could_ever_fit = counting  # type: ignore[method-assign]
    now = time.time()
    waiting(s, "sbx_young", 2, now - 10)
    for _ in range(3):
        await s.place_waiting()
    assert judged == []  # it has not waited BACKFILL_S: nothing to judge yet
    s2, _ = scheduler()
    gpu_node(s2, "n1", gpus=1)
    real2 = s2._could_ever_fit

    def counting2(gang: Any, fleet: Any) -> bool:
        judged.append(gang.gang_id)
        return real2(gang, fleet)

    s2._could_ever_fit = counting2  # type: ignore[method-assign]
    waiting(s2, "sbx_old", 2, now - BACKFILL_S - 1)
    for _ in range(3):
        await s2.place_waiting()
    assert judged == ["sbx_old"]


async def test_a_team_cannot_fill_every_nodes_unit_slots_with_tiny_units(tmp_path: Any) -> None:
    """Attack: units of 1 millicore and 1 byte pass any GPU and CPU quota (64 CPUs hold 64,000
    of them) and take each node's unit slots (``max_sandboxes``, 64 by default), so no other
    team's unit finds a node. A ``units`` quota bounds how many units a team holds at once."""
    from dsec_scheduler.gangs import parse_quotas

    assert parse_quotas({"acme": {"units": 3}}) == {"acme": Quota(units=3)}
    quotas = tmp_path / "quotas.yaml"
    quotas.write_text("acme: {gpus: 8, cpus: 64, units: 3}\n")
    s, rec = scheduler(scheduler_quotas=str(quotas))
    inv = NodeInventory(cpus=64, memory_bytes=512 * GIB, max_sandboxes=4)
    payload = {"node_id": "n1", "inventory": inv.model_dump(mode="json"), "heartbeat_s": 5}
    s.state.apply(seen("node.joined", "n1", payload, time.time(), "system"))
    now = time.time()
    waiting(s, "sbx_swarm", 0, now - 30)
    tiny = [{"name": f"t{i}", "cpu_millicores": 1, "memory_bytes": 1} for i in range(4)]
    sbx = s.state.sandboxes["sbx_swarm"]
    assert sbx.resources is not None
    s._remember(
        "sbx_swarm", gang_demand("sbx_swarm", "acme", {"topology": {"units": tiny}}, sbx.resources)
    )
    waiting(s, "sbx_lab", 0, now - 10, tenant="lab")
    await s.place_waiting()
    (swarm,) = [p.payload.model_dump() for p in rec.out if p.aggregate_id == "sbx_swarm"]
    assert swarm["reason"] == "quota: team acme holds 0/3 units, asks 4"
    assert decided(rec, "sbx_lab") == ["unit.placed", "sandbox.scheduled"]


async def test_a_node_whose_heartbeat_went_stale_takes_nothing_until_it_is_heard_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The engine's view of a node is judged again when the clock passes the time its
    heartbeat goes stale, not only when the node's state changes (a decision reuses the view
    judged before while it holds)."""
    clock = [time.time()]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    s, rec = scheduler()
    gpu_node(s, "n1", gpus=2)
    waiting(s, "sbx_a", 1, clock[0])
    await s.place_waiting()
    assert decided(rec, "sbx_a") == ["unit.placed", "sandbox.scheduled"]
    clock[0] += 3 * 5 + 1  # three heartbeats (heartbeat_s 5) missed: stale, not yet lost
    waiting(s, "sbx_b", 1, clock[0])
    await s.place_waiting()
    assert "sandbox.scheduled" not in decided(rec, "sbx_b")
    spec = s.engine.node("n1")
    assert spec is not None and not spec.schedulable
    gpu_node(s, "n1", gpus=2)  # heard from again (a node.joined at the clock's time)
    await s.place_waiting()
    assert decided(rec, "sbx_b")[-2:] == ["unit.placed", "sandbox.scheduled"]
