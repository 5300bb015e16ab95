"""Compute units, gangs, GPU shares, pending counts, the queue's order and quotas: the pure
parts of the scheduler's placement (the reference engine, the plan's topology, node inventories,
the fold of ``unit.placed``)."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
from dsec_core.events import GpuInfo, GpuLink, NodeInventory, Resources

from dsec_scheduler.domain import SchedulerState, Seen
from dsec_scheduler.engines import make_engine
from dsec_scheduler.gangs import (
    BACKFILL_S,
    EngineSync,
    Quota,
    UnitHeld,
    Waiting,
    blocks,
    gang_demand,
    load_quotas,
    node_spec,
    ordered,
    parse_quotas,
    quota_refusal,
    usage,
)
from dsec_scheduler.placement.api import (
    Edge,
    GangDemand,
    GangPlacement,
    NodeSpec,
    Unfit,
    UnitDemand,
)
from dsec_scheduler.placement.simple import SimpleEngine

GIB = 2**30
_ids = itertools.count()


def gpu(i: int, model: str = "NVIDIA H100 80GB HBM3", mem_gib: int = 80, **kw: Any) -> GpuInfo:
    return GpuInfo(index=i, uuid=f"GPU-{i}", model=model, memory_total_bytes=mem_gib * GIB, **kw)


def inv(cpus: float = 64, gpus: list[GpuInfo] | None = None, **kw: Any) -> NodeInventory:
    return NodeInventory(cpus=cpus, memory_bytes=512 * GIB, gpus=gpus or [], **kw)


def engine(*nodes: tuple[str, NodeInventory], policy: str = "leastloaded") -> SimpleEngine:
    e = SimpleEngine(policy)
    for node_id, inventory in nodes:
        e.upsert_node(node_spec(node_id, inventory, []))
    return e


def unit(key: str, gpus: int = 0, milli: int = 0, cpu: int = 1000, **kw: Any) -> UnitDemand:
    return UnitDemand(key=key, cpu_milli=cpu, memory_bytes=GIB, gpus=gpus, gpu_milli=milli, **kw)


def place_commit(e: SimpleEngine, gang: GangDemand) -> GangPlacement:
    got = e.place(gang)
    assert isinstance(got, GangPlacement), got
    e.commit(got)
    return got


# --------------------------------------------------------------------------- node inventory


def test_a_node_inventory_becomes_canonical_gpus_with_nvlink_groups_and_health() -> None:
    gpus = [
        gpu(0, topology={"GPU-1": "NV12", "GPU-2": "SYSTEM"}),
        gpu(1),
        gpu(2, pci_bus_id="0000:03:00.0"),
        gpu(3, nvlinks=[GpuLink(link=0, active=True, remote_pci="0000:03:00.0")], xid_errors=2),
        gpu(4, model="Tesla V100-SXM2-32GB", mem_gib=32, temperature_c=71.0),
    ]
    spec = node_spec("n1", inv(gpus=gpus, max_sandboxes=9), [])
    assert [g.model for g in spec.gpus] == ["H100"] * 4 + ["V100M32"]
    assert [g.nvlink_group for g in spec.gpus] == [0, 0, 2, 2, 4]
    assert [g.healthy for g in spec.gpus] == [True, True, True, False, True]
    assert spec.gpus[4].temperature_c == 71.0
    assert (spec.cpu_milli, spec.max_units, spec.schedulable) == (64_000, 9, True)
    lost = node_spec("n1", inv(), ["lost (silent 40 s)"])
    assert (lost.schedulable, lost.unschedulable_reason) == (False, "lost")
    sick = node_spec("n1", inv(), ["cordoned", "unhealthy: disk"])
    assert sick.unschedulable_reason == "cordoned"


# --------------------------------------------------------------------------- the reference engine


def test_gpu_shares_stack_on_one_gpu_until_it_is_full() -> None:
    e = engine(("n", inv(gpus=[gpu(0), gpu(1)])))
    a = place_commit(e, GangDemand("a", (unit("a/main", milli=600),)))
    b = place_commit(e, GangDemand("b", (unit("b/main", milli=400),)))
    assert a.choices[0].gpu_indices == b.choices[0].gpu_indices == (0,)
    c = place_commit(e, GangDemand("c", (unit("c/main", milli=300),)))
    assert c.choices[0].gpu_indices == (1,) and c.choices[0].gpu_milli == 300
    assert e.allocation_ratio() == {"H100": 0.65, "all": 0.65}
    e.release("a/main")
    assert e.allocation_ratio()["all"] == 0.35


def test_a_gang_is_placed_all_or_none_and_says_which_unit_found_no_place() -> None:
    e = engine(("n1", inv(gpus=[gpu(0), gpu(1)])), ("n2", inv(gpus=[gpu(0)])))
    gang = GangDemand("g", (unit("g/a", gpus=2), unit("g/b", gpus=2)))
    got = e.place(gang)
    assert isinstance(got, Unfit) and got.unit == "g/b"
    assert got.reasons == {"insufficient free GPUs": 2}
    assert got.summary() == "0/2 nodes: 2 insufficient free GPUs"
    assert e.allocation_ratio()["all"] == 0.0  # nothing taken by the failed gang
    ok = place_commit(e, GangDemand("h", (unit("h/a", gpus=2), unit("h/b", gpus=1))))
    assert {c.key: c.node_id for c in ok.choices} == {"h/a": "n1", "h/b": "n2"}
    assert ok.nodes_total == 2 and ok.policy == "leastloaded"


def test_units_joined_by_nvlink_p2p_or_shm_share_a_node_and_an_nvlink_group() -> None:
    linked = [gpu(i, topology={f"GPU-{j}": "NV4" for j in range(2) if j != i}) for i in range(2)]
    lone = [gpu(2), gpu(3)]
    e = engine(("big", inv(gpus=linked + lone)), ("other", inv(cpus=128, gpus=[gpu(0)])))
    gang = GangDemand(
        "g",
        (unit("g/a", gpus=1), unit("g/b", gpus=1), unit("g/c")),
        (Edge("g/a", "g/b", "nvlink-p2p"), Edge("g/b", "g/c", "shm")),
    )
    got = place_commit(e, gang)
    nodes = {c.node_id for c in got.choices}
    assert nodes == {"big"}
    gpus = sorted(i for c in got.choices for i in c.gpu_indices)
    assert gpus == [0, 1]  # the NVLink pair, not two lone GPUs
    far = GangDemand(
        "r", (unit("r/a", gpus=1), unit("r/b", gpus=1)), (Edge("r/a", "r/b", "nvlink-p2p"),)
    )
    assert isinstance(e.place(far), Unfit)  # the lone GPUs have no NVLink between them


def test_unfit_counts_each_node_once_under_its_first_reason() -> None:
    nodes = [(f"cpu{i}", inv()) for i in range(3)]
    nodes += [(f"v{i}", inv(gpus=[gpu(0, "Tesla V100-SXM2-32GB", 32)])) for i in range(2)]
    nodes += [("h", inv(gpus=[gpu(0)]))]
    e = engine(*nodes)
    place_commit(e, GangDemand("x", (unit("x/main", milli=900),)))
    e.upsert_node(node_spec("sick", inv(gpus=[gpu(0)]), ["unhealthy: xid"]))
    got = e.place(GangDemand("g", (unit("g/main", milli=500, models=frozenset({"H100"})),)))
    assert isinstance(got, Unfit)
    assert got.reasons == {
        "no GPU": 3,
        "no GPU of model H100": 2,
        "insufficient GPU share": 1,
        "unhealthy": 1,
    }
    assert got.summary() == (
        "0/7 nodes: 3 no GPU, 2 no GPU of model H100, 1 insufficient GPU share, 1 unhealthy"
    )


def test_choices_carry_a_score_breakdown_and_the_feasible_count() -> None:
    e = engine(("a", inv(cpus=8)), ("b", inv(cpus=32)), ("c", inv(cpus=2)))
    first = place_commit(e, GangDemand("f", (unit("f/main", cpu=4000),)))
    assert first.choices[0].node_id == "a"  # equally free: ties by node id
    got = place_commit(e, GangDemand("g", (unit("g/main", cpu=4000),)))
    choice = got.choices[0]
    assert choice.node_id == "b" and choice.feasible_nodes == 2
    assert choice.breakdown["cpu_free"] == 1.0 and "free_fraction" in choice.breakdown
    packed = engine(("a", inv(cpus=8)), ("b", inv(cpus=32)), policy="bestfit")
    assert (
        place_commit(packed, GangDemand("g", (unit("g/main", cpu=4000),))).choices[0].node_id == "a"
    )


def test_the_policy_setting_picks_an_engine_and_refuses_an_unknown_one() -> None:
    assert make_engine("bestfit").policy == "bestfit"
    assert make_engine().policy in {"dsec", "leastloaded"}
    with pytest.raises(ValueError, match="DSEC_SCHEDULER_POLICY='nope': unknown; valid: "):
        make_engine("nope")


# --------------------------------------------------------------------------- the plan


def test_a_plan_without_topology_is_one_main_unit_from_its_resources() -> None:
    r = Resources(cpus=2, memory_bytes=4 * GIB, gpus=2, gpu_memory_bytes=80 * GIB)
    gang = gang_demand("sbx_1", "acme", {"resources": {"gpu": {"type": "a100"}}}, r)
    (main,) = gang.units
    assert (main.key, main.cpu_milli, main.gpus, main.min_gpu_memory_bytes) == (
        "sbx_1/main",
        2000,
        2,
        80 * GIB,
    )
    assert main.models == {"A100-40GB", "A100-80GB"} and gang.team == "acme"


def test_a_topology_becomes_a_gang_with_edges_shares_and_priority() -> None:
    topology = {
        "units": [
            {"name": "trainer", "gpus": 4, "cpu_millicores": 8000, "memory_bytes": 64 * GIB,
             "gpu_models": ["H100"], "nvlink_group": "ring", "max_temperature_c": 80},
            {"name": "evaluator", "gpu_milli": 250, "cpu_millicores": 1000,
             "memory_bytes": GIB, "nvlink_group": "ring"},
            {"name": "logger", "cpu_millicores": 500, "memory_bytes": GIB},
        ],
        "edges": [{"src": "trainer", "dst": "logger", "protocol": "shm"}],
        "migration": {"max_temperature_c": 85},
        "priority": 7,
    }  # fmt: skip
    gang = gang_demand("sbx_2", "acme", {"resources": {}, "topology": topology}, Resources())
    t, ev, lg = gang.units
    assert (t.gpus, t.nvlink, t.models, t.max_temperature_c) == (4, True, {"H100"}, 80.0)
    assert (ev.gpu_milli, ev.gpus, lg.gpus) == (250, 0, 0)
    assert gang.priority == 7
    assert set(gang.edges) == {
        Edge("sbx_2/trainer", "sbx_2/logger", "shm"),
        Edge("sbx_2/trainer", "sbx_2/evaluator", "nvlink-p2p"),
    }
    bad = {"units": [{"name": "x", "gpus": 1, "gpu_milli": 500}]}
    with pytest.raises(ValueError, match=r"topology.units\[0\] \(x\): gpus=1, gpu_milli=500"):
        gang_demand("s", "t", {"topology": bad}, Resources())


# --------------------------------------------------------------------------- the fold


def _seen(type_: str, sid: str, payload: dict[str, Any], at: float = 1000.0) -> Seen:
    return Seen(f"ev{next(_ids)}", type_, sid, "acme", payload, at, at)


def test_unit_placed_events_make_what_a_scheduled_sandbox_holds() -> None:
    state = SchedulerState(lost_after_s=15)
    beat = {"node_id": "n1", "inventory": inv(gpus=[gpu(0), gpu(1)]).model_dump(mode="json")}
    state.apply(Seen("hb", "node.joined", "n1", "system", beat, 1000.0, 1000.0))
    state.apply(_seen("env.built", "sbx_a", {}))
    r = Resources(cpus=2, memory_bytes=GIB).model_dump(mode="json")
    for name, indices, milli in (("main", [0], 500), ("side", [1], 1000)):
        state.apply(
            _seen(
                "unit.placed",
                "sbx_a",
                {"sandbox_id": "sbx_a", "unit": name, "node_id": "n1", "gpu_indices": indices,
                 "gpu_milli": milli, "cpu_millicores": 1000, "memory_bytes": GIB,
                 "policy": "leastloaded", "attempt": 1},
            )
        )  # fmt: skip
    state.apply(_seen("sandbox.scheduled", "sbx_a", {"node_id": "n1", "resources": r}))
    fleet = state.fleet(1001.0)
    held = {u.unit: (u.gpu_indices, u.gpu_milli) for u in fleet.units}
    assert held == {"main": ((0,), 500), "side": ((1,), 1000)}
    sync = EngineSync(SimpleEngine())
    sync.sync([node_spec("n1", state.nodes["n1"].inventory, [])], fleet.units)
    assert sync.engine.allocation_ratio()["all"] == 0.75
    assert usage(fleet.units) == {"acme": (1500, 2.0)}
    state.apply(_seen("sandbox.failed", "sbx_a", {"stage": "t", "reason": "x"}))
    sync.sync([node_spec("n1", state.nodes["n1"].inventory, [])], state.fleet(1002.0).units)
    assert sync.engine.allocation_ratio()["all"] == 0.0


# --------------------------------------------------------------------------- queue and quotas


def test_the_queue_is_priority_first_then_first_come_first_served() -> None:
    entries = [
        Waiting("old-low", 0, 1.0),
        Waiting("new-high", 5, 9.0),
        Waiting("new-low", 0, 5.0),
        Waiting("old-high", 5, 2.0),
    ]
    assert [w.sandbox_id for w in ordered(entries)] == [
        "old-high",
        "new-high",
        "old-low",
        "new-low",
    ]


def test_a_head_that_waited_long_stops_backfill_unless_it_can_never_fit() -> None:
    head = Waiting("big", 0, 1000.0)
    assert not blocks(head, 1000.0 + BACKFILL_S - 1, could_ever_fit=True)
    assert blocks(head, 1000.0 + BACKFILL_S, could_ever_fit=True)
    assert not blocks(head, 1000.0 + 10 * BACKFILL_S, could_ever_fit=False)


def _held(tenant: str, milli: int, n: int = 1) -> list[UnitHeld]:
    return [
        UnitHeld(f"s{i}", "main", tenant, "n", 1000, GIB, gpu_indices=(0,), gpu_milli=milli)
        for i in range(n)
    ]


def test_a_team_over_its_gpu_quota_waits_with_its_numbers() -> None:
    quotas = {"acme": Quota(gpus=8), "lab": Quota(cpus=4)}
    used = usage(_held("acme", 1000, 7) + _held("acme", 500) + _held("lab", 0, 3))
    one = GangDemand("g", (unit("g/main", gpus=1),), team="acme")
    assert quota_refusal(one, quotas, used) == "quota: team acme uses 7.5/8 GPUs, asks 1"
    half = GangDemand("g", (unit("g/main", milli=500),), team="acme")
    assert quota_refusal(half, quotas, used) is None
    cpus = GangDemand("g", (unit("g/main", cpu=2000),), team="lab")
    assert quota_refusal(cpus, quotas, used) == "quota: team lab uses 3/4 CPUs, asks 2"
    assert quota_refusal(GangDemand("g", one.units, team="free"), quotas, used) is None


def test_quota_files_are_validated_with_located_errors(tmp_path: Path) -> None:
    good = tmp_path / "q.yaml"
    good.write_text("acme: {gpus: 8, cpus: 64}\nlab: {gpu_milli: 2500}\n")
    assert load_quotas(str(good)) == {
        "acme": Quota(gpus=8.0, cpus=64.0),
        "lab": Quota(gpu_milli=2500),
    }
    as_json = tmp_path / "q.json"
    as_json.write_text(json.dumps({"acme": {"gpus": 2}}))
    assert load_quotas(str(as_json)) == {"acme": Quota(gpus=2.0)}
    with pytest.raises(ValueError, match=r"q: acme.gpu: unknown; valid: cpus, gpu_milli, gpus"):
        parse_quotas({"acme": {"gpu": 1}}, "q")
    with pytest.raises(ValueError, match=r"q: acme.gpus: -1 is not a number ≥ 0"):
        parse_quotas({"acme": {"gpus": -1}}, "q")
    with pytest.raises(ValueError, match="cannot read"):
        load_quotas(str(tmp_path / "missing.yaml"))
    broken = tmp_path / "b.yaml"
    broken.write_text("acme: [unclosed\n")
    with pytest.raises(ValueError, match="not valid"):
        load_quotas(str(broken))


def test_node_spec_is_what_the_engine_is_told() -> None:
    spec = node_spec("n", inv(cpus=4), [])
    assert isinstance(spec, NodeSpec) and spec.gpus == ()


def test_a_bad_quota_file_or_policy_stops_the_scheduler_at_start_saying_what(
    tmp_path: Path,
) -> None:
    from dsec_core.settings import Settings

    from dsec_scheduler.app import create_service

    bad = tmp_path / "quotas.yaml"
    bad.write_text("acme: {gpus: lots}\n")
    with pytest.raises(SystemExit, match=r"scheduler: .*quotas.yaml: acme.gpus: 'lots' is not"):
        create_service(Settings(scheduler_quotas=str(bad)))
    with pytest.raises(SystemExit, match="DSEC_SCHEDULER_POLICY='fastest': unknown"):
        create_service(Settings(scheduler_policy="fastest"))


def test_pending_reasons_fall_in_bounded_classes() -> None:
    from dsec_scheduler.metrics import PENDING_REASONS, pending_class

    cases = {
        ("quota: team a uses 8/8 GPUs, asks 1", ()): "quota",
        ("queued behind sbx_1 (priority 0, waiting 301 s): …", ()): "queue",
        ("no node has joined", ()): "no_nodes",
        ("0/9 nodes: …", (("no GPU of model H100", 5), ("insufficient CPU", 4))): "gpu_model",
        ("0/9 nodes: …", (("insufficient GPU share", 9),)): "gpu_share",
        ("0/9 nodes: …", (("insufficient free GPUs", 9),)): "gpus",
        ("0/9 nodes: …", (("insufficient memory", 2), ("cordoned", 1))): "memory",
        ("0/9 nodes: …", (("lost", 9),)): "unschedulable",
    }
    for (reason, unfit), expected in cases.items():
        assert pending_class(reason, dict(unfit)) == expected, reason
        assert expected in PENDING_REASONS


def test_a_replayed_unit_placed_of_an_older_attempt_never_replaces_a_newer_units_place() -> None:
    """Attack: attempt 1's genuine ``unit.placed`` (node n1) published again between attempt
    2's ``unit.placed`` (n2) and its ``sandbox.scheduled``: the sandbox holds what attempt 2
    placed (its unit on n2, with its GPU share), never the whole sandbox counted on n2."""
    state = SchedulerState(lost_after_s=15)
    for node in ("n1", "n2"):
        beat = {"node_id": node, "inventory": inv(gpus=[gpu(0)]).model_dump(mode="json")}
        state.apply(Seen(f"hb-{node}", "node.joined", node, "system", beat, 1000.0, 1000.0))
    state.apply(_seen("env.built", "sbx_r", {}))
    r = Resources(cpus=2, memory_bytes=GIB, gpus=1).model_dump(mode="json")

    def placed(node: str, attempt: int) -> Seen:
        return _seen(
            "unit.placed",
            "sbx_r",
            {"sandbox_id": "sbx_r", "unit": "main", "node_id": node, "gpu_indices": [0],
             "gpu_milli": 250, "cpu_millicores": 1000, "memory_bytes": GIB,
             "policy": "leastloaded", "attempt": attempt},
        )  # fmt: skip

    old = placed("n1", 1)
    state.apply(old)
    state.apply(_seen("sandbox.scheduled", "sbx_r", {"node_id": "n1", "resources": r}))
    lost = {"node_id": "n1", "reason": "node n1 lost", "action": "reschedule", "attempt": 1}
    state.apply(_seen("unit.lost", "sbx_r", lost))
    state.apply(placed("n2", 2))
    state.apply(old)  # the replay
    state.apply(
        _seen("sandbox.scheduled", "sbx_r", {"node_id": "n2", "resources": r, "attempt": 2})
    )
    held = [(u.unit, u.node_id, u.gpu_milli) for u in state.fleet(1001.0).units]
    assert held == [("main", "n2", 250)]
    assert state.placed_units("sbx_r")["main"].node_id == "n2"


@pytest.mark.parametrize("policy", ["dsec", "leastloaded"])
def test_a_unit_on_a_gpu_its_node_no_longer_reports_does_not_stop_a_fresh_engine(
    policy: str,
) -> None:
    """A unit placed on GPU 3 of a node that now reports two GPUs (the others fell off the
    bus): a scheduler started after that (a fresh engine) syncs, the unit keeps its CPUs and
    memory, and the node's two GPUs still take new units. Before, the fresh engine's sync
    raised on every decision ("node 'n1' has no GPU 3")."""
    held = UnitHeld("sbx_a", "main", "acme", "n1", 8000, 64 * GIB, gpu_indices=(3,), gpu_milli=1000)
    sync = EngineSync(make_engine(policy))
    spec = node_spec("n1", inv(cpus=16, gpus=[gpu(0), gpu(1)]), [])
    sync.sync([spec], [held])
    sync.sync([spec], [held])  # (and again: the unit is not taken twice)
    gang = GangDemand(
        "sbx_b", (UnitDemand("sbx_b/main", cpu_milli=8000, memory_bytes=GIB, gpus=2),), team="acme"
    )
    placed = sync.engine.place(gang)
    assert isinstance(placed, GangPlacement)
    assert placed.choices[0].gpu_indices == (0, 1)
    too_much = GangDemand(
        "sbx_c", (UnitDemand("sbx_c/main", cpu_milli=9000, memory_bytes=GIB),), team="acme"
    )
    assert isinstance(sync.engine.place(too_much), Unfit)  # 8 of the 16 CPUs still held
