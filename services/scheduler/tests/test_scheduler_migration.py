"""The pure part of migration: what the spec allows, which path, and the fold (a started
migration holds its target; the unit moves on unit.migrated, the first end counts; a failure
releases the target; the scheduler's own tentative decision is undone when withdrawn)."""

from __future__ import annotations

import itertools
from typing import Any

from dsec_core.events import (
    GpuInfo,
    NodeInventory,
    Resources,
    UnitMigrationFailed,
    UnitMigrationStarted,
)

from dsec_scheduler.domain import SchedulerState, Seen
from dsec_scheduler.migration import RESERVED, Migrator, allows, drain_migrates, path_for

GIB = 2**30
_ids = itertools.count()


def _seen(type_: str, sid: str, payload: dict[str, Any], at: float = 1000.0) -> Seen:
    return Seen(f"mig{next(_ids)}", type_, sid, "acme", payload, at, at)


def test_what_the_spec_allows_and_the_path_it_takes() -> None:
    assert allows({}, "gpu_degraded") and allows({}, "operator")
    assert not allows({}, "link_congested")
    off = {"topology": {"migration": {"on": []}}}
    assert not allows(off, "gpu_degraded") and allows(off, "operator")
    assert allows({"migration": {"on": ["temperature"]}}, "gpu_degraded", "temperature")
    assert not allows({"migration": {"on": ["xid"]}}, "gpu_degraded", "temperature")
    assert not allows({"migration": {"enabled": False}}, "gpu_degraded")
    assert path_for({}) == "criu" and path_for({"state": {"restart": "never"}}) == "handover"
    assert path_for({"state": {}, "migration": {"paths": ["criu", "restart"]}}) == "criu"
    assert path_for({"migration": {"paths": ["restart"]}}) == "restart"
    # a drain hands stateful units over; the others restart elsewhere (no CRIU by default)
    state = {"restart": "never"}
    assert drain_migrates({"state": state}) and not drain_migrates({})
    assert drain_migrates({"state": state, "topology": {"migration": {"on": ["temperature"]}}})
    assert not drain_migrates({"state": state, "migration": {"paths": ["criu", "restart"]}})
    assert not drain_migrates({"state": state, "migration": {"enabled": False}})


def _placed_on(state: SchedulerState, node: str) -> None:
    gpus = [
        GpuInfo(index=i, uuid=f"G{i}", model="H100", memory_total_bytes=80 * GIB) for i in (0, 1)
    ]
    inventory = NodeInventory(cpus=64, memory_bytes=512 * GIB, gpus=gpus).model_dump(mode="json")
    for n in ("n1", "n2"):
        beat = {"node_id": n, "inventory": inventory}
        state.apply(Seen(f"hb-{n}", "node.joined", n, "system", beat, 1000.0, 1000.0))
    state.apply(_seen("env.built", "sbx_m", {}))
    state.apply(_seen("unit.placed", "sbx_m", {
        "sandbox_id": "sbx_m", "unit": "main", "node_id": node, "gpu_indices": [0],
        "gpu_milli": 1000, "cpu_millicores": 2000, "memory_bytes": GIB, "attempt": 1,
    }))  # fmt: skip
    r = Resources(cpus=2, memory_bytes=GIB, gpus=1).model_dump(mode="json")
    state.apply(_seen("sandbox.scheduled", "sbx_m", {"node_id": node, "resources": r}))
    state.apply(_seen("sandbox.ready", "sbx_m", {"node_id": node}))


def _started(mid: str) -> dict[str, Any]:
    return {"unit": "main", "migration_id": mid, "from_node": "n1", "to_node": "n2",
            "from_gpus": [0], "to_gpus": [1], "reason": "gpu_degraded", "path": "criu"}  # fmt: skip


def _held(state: SchedulerState) -> set[tuple[str, str, tuple[int, ...]]]:
    return {(u.unit, u.node_id, u.gpu_indices) for u in state.fleet(1001.0).units}


def test_a_migration_holds_its_target_then_moves_the_unit_and_the_sandbox() -> None:
    state = SchedulerState(lost_after_s=15)
    _placed_on(state, "n1")
    state.apply(_seen("unit.migration_started", "sbx_m", _started("m1")))
    assert _held(state) == {("main", "n1", (0,)), (f"main{RESERVED}", "n2", (1,))}
    state.apply(_seen("unit.migration_started", "sbx_m", _started("m1")))  # replayed
    assert len(state.migrations.active) == 1
    moved = {**_started("m1"), "interruption_ms": 5.0}
    assert state.apply(_seen("unit.migrated", "sbx_m", moved))  # the source is free: the queue
    assert _held(state) == {("main", "n2", (1,))}
    assert state.sandboxes["sbx_m"].holds == "n2" and state.on_node("n1") == []
    state.apply(_seen("unit.migration_failed", "sbx_m", {**_started("m1"), "reason": "late"}))
    assert _held(state) == {("main", "n2", (1,))}  # the first end counted


def test_a_failed_or_withdrawn_migration_releases_its_target() -> None:
    state = SchedulerState(lost_after_s=15)
    _placed_on(state, "n1")
    state.apply(_seen("unit.migration_started", "sbx_m", _started("m2")))
    state.apply(_seen("unit.migration_failed", "sbx_m", {"migration_id": "m2", "reason": "x"}))
    assert _held(state) == {("main", "n1", (0,))} and state.migrations.active == {}
    decision = _seen("unit.migration_started", "sbx_m", _started("m3"))
    state.tentative(decision)
    assert state.migrations.of_unit("sbx_m", "main") is not None
    state.withdraw(decision.id)  # not published after all
    assert state.migrations.active == {} and not state.migrations.known("m3")
    assert _held(state) == {("main", "n1", (0,))}


class _Decider:
    """What :class:`Migrator.tick` needs of the scheduler: its state and ``_decide``."""

    def __init__(self, state: SchedulerState) -> None:
        self.state = state
        self.published: list[tuple[str, Any]] = []

    async def _decide(self, payload: Any, *, aggregate_id: str, event_id: str, tenant: str,
                      causation: Any = None) -> None:  # fmt: skip
        self.published.append((event_id, payload))
        self.state.tentative(
            Seen(event_id, payload.TYPE, aggregate_id, tenant, payload.model_dump(mode="json"),
                 2000.0, 2000.0)
        )  # fmt: skip


async def test_a_migration_without_an_answer_times_out_once_and_releases_its_target() -> None:
    state = SchedulerState(lost_after_s=15)
    _placed_on(state, "n1")
    state.apply(_seen("unit.migration_started", "sbx_m", _started("m4"), at=1000.0))
    decider = _Decider(state)
    migrator = Migrator(decider, timeout_s=10)  # type: ignore[arg-type]
    await migrator.tick(1005.0)
    assert decider.published == []
    await migrator.tick(1011.0)
    [(_, failed)] = decider.published
    assert isinstance(failed, UnitMigrationFailed)
    assert (failed.migration_id, failed.stage, failed.still_running) == ("m4", "timeout", True)
    assert _held(state) == {("main", "n1", (0,))}  # the target released
    await migrator.tick(1020.0)
    assert len(decider.published) == 1  # once


async def test_a_second_start_of_a_migration_in_flight_does_not_fail_it() -> None:
    # A drain's migration id is derived (drain event, sandbox, unit), and evacuate() runs from
    # both the cordon handler and the watch tick: two for_drain() of one sandbox may both get
    # past their checks before either holds the lock. The second must not publish
    # unit.migration_failed under the id of the migration the first just started (the first
    # end counts: it would release the target and restart the unit mid hand-over).
    state = SchedulerState(lost_after_s=15)
    _placed_on(state, "n1")
    state.apply(_seen("unit.migration_started", "sbx_m", _started("m5")))
    decider = _Decider(state)
    migrator = Migrator(decider, timeout_s=10)  # type: ignore[arg-type]
    started = await migrator._start(
        "sbx_m",
        "main",
        mid="m5",
        reason="drain",
        to_node=None,
        causation=None,  # type: ignore[arg-type]
    )
    assert started  # it is in flight
    assert [p for _, p in decider.published if isinstance(p, UnitMigrationFailed)] == []
    assert "m5" in state.migrations.active


async def test_a_lost_node_ends_the_migrations_from_or_to_it() -> None:
    # A unit whose source is lost mid hand-over is restarted elsewhere (unit.lost follows): the
    # migration must end first, or its target would also take it over (two copies).
    state = SchedulerState(lost_after_s=15)
    _placed_on(state, "n1")
    state.apply(_seen("unit.migration_started", "sbx_m", _started("m6")))
    decider = _Decider(state)
    migrator = Migrator(decider)  # type: ignore[arg-type]
    await migrator.on_node_lost("n3")  # not involved: nothing
    assert decider.published == []
    await migrator.on_node_lost("n1")  # the source
    [(_, failed)] = decider.published
    assert isinstance(failed, UnitMigrationFailed)
    assert (failed.migration_id, failed.stage, failed.still_running) == ("m6", "transfer", False)
    assert state.migrations.active == {} and _held(state) == {("main", "n1", (0,))}
    state.apply(_seen("unit.migration_started", "sbx_m", _started("m7")))
    await migrator.on_node_lost("n2")  # the target: the unit stays where it runs
    (_, failed) = decider.published[-1]
    assert (failed.migration_id, failed.stage, failed.still_running) == ("m7", "restore", True)
    assert _held(state) == {("main", "n1", (0,))}


async def test_a_storm_of_gpu_degraded_handled_at_once_starts_one_migration(
    monkeypatch: Any,
) -> None:
    # Two readings of one GPU, handled concurrently: both find the unit not moving, then both
    # read its plan (an await). The one that gets the lock second must see the migration the
    # first started meanwhile and leave it alone, not refuse it ("already moving": a
    # unit.migration_failed for a unit that is moving fine).
    import asyncio

    from dsec_core.envelope import Envelope
    from dsec_core.events import GpuDegraded

    state = SchedulerState(lost_after_s=15)
    _placed_on(state, "n1")
    decider = _Decider(state)
    decider.barrier = lambda upto=None: asyncio.sleep(0)  # type: ignore[attr-defined]
    decider._deciding = asyncio.Lock()  # type: ignore[attr-defined]
    migrator = Migrator(decider)  # type: ignore[arg-type]
    both_planning = asyncio.Barrier(2)
    starts: list[str] = []

    async def plan(sandbox_id: str) -> dict[str, Any]:
        await both_planning.wait()  # neither goes on before both looked
        return {}

    async def start(sandbox_id: str, unit: str, *, mid: str, **_: Any) -> bool:
        starts.append(mid)
        await decider._decide(
            UnitMigrationStarted(**{**_started(mid), "reason": "gpu_degraded"}),
            aggregate_id=sandbox_id,
            event_id=mid,
            tenant="acme",
        )
        return True

    monkeypatch.setattr(migrator, "_plan", plan)
    monkeypatch.setattr(migrator, "_start", start)

    def reading(value: float) -> tuple[Envelope, GpuDegraded]:
        degraded = GpuDegraded(
            node_id="n1", gpu_index=0, signal="temperature", value=value, threshold=85.0
        )
        envelope = Envelope.model_construct(id=f"reading-{value}", type=degraded.TYPE)
        return envelope, degraded

    await asyncio.gather(*(migrator.on_degraded(*reading(v)) for v in (91.0, 93.0)))
    assert len(starts) == 1  # one migration for the storm, no refusal
    assert [p for _, p in decider.published if isinstance(p, UnitMigrationFailed)] == []
