"""The scheduler's pure decisions: fit, no-fit reasons, cordon, loss, tie-break, GPUs, and the
fold of the log into a fleet and a queue."""

from __future__ import annotations

import itertools
from typing import Any

from dsec_core.events import GpuInfo, NodeInventory, Resources
from dsec_core.spec import compile_plan, load_spec

from dsec_scheduler.domain import (
    ASSUMED_S,
    GIB,
    Fleet,
    Node,
    NoFit,
    Placement,
    SchedulerState,
    Seen,
    free_gpus,
    place,
    reason_shape,
    resources_from_plan,
)

NOW = 1_000_000.0
_ids = itertools.count()


def gpu(i: int, mem_gib: int) -> GpuInfo:
    return GpuInfo(index=i, uuid=f"GPU-{i}", model="h100", memory_total_bytes=mem_gib * GIB)


def node(
    node_id: str,
    cpus: float = 8,
    mem_gib: int = 32,
    gpus: tuple[int, ...] = (),
    **kw: Any,
) -> Node:
    inv = NodeInventory(
        cpus=cpus,
        memory_bytes=mem_gib * GIB,
        gpus=[gpu(i, m) for i, m in enumerate(gpus)],
        max_sandboxes=kw.pop("max_sandboxes", 64),
    )
    return Node(node_id=node_id, inventory=inv, last_seen=kw.pop("last_seen", NOW), **kw)


def fleet(*nodes: Node, held: dict[str, tuple[Resources, ...]] | None = None) -> Fleet:
    return Fleet({n.node_id: n for n in nodes}, held or {}, NOW, lost_after_s=15)


def req(cpus: float = 1, mem_gib: float = 1, gpus: int = 0, gpu_gib: int = 0) -> Resources:
    return Resources(
        cpus=cpus, memory_bytes=int(mem_gib * GIB), gpus=gpus, gpu_memory_bytes=gpu_gib * GIB
    )


def test_fits_the_node_that_has_room() -> None:
    decision = place(req(cpus=12), fleet(node("small", cpus=4), node("big", cpus=16)))
    assert isinstance(decision, Placement) and decision.node_id == "big"


def test_no_fit_names_each_node_and_what_it_lacks() -> None:
    decision = place(
        req(cpus=6, mem_gib=40), fleet(node("a", cpus=4), node("b", cpus=8, mem_gib=16))
    )
    assert isinstance(decision, NoFit)
    assert decision.reasons["a"].startswith("CPUs: needs 6, 4 free")
    assert "memory: needs 40.0 GiB, 32.0 GiB free" in decision.reasons["a"]
    assert decision.reasons["b"] == "memory: needs 40.0 GiB, 16.0 GiB free"
    assert decision.summary().startswith("no node fits: a: CPUs")


def test_no_node_at_all_says_so() -> None:
    decision = place(req(), fleet())
    assert isinstance(decision, NoFit) and decision.summary() == "no node has joined"


def test_allocations_count_against_capacity() -> None:
    held = {"a": (req(cpus=6),)}
    decision = place(req(cpus=4), fleet(node("a", cpus=8), held=held))
    assert isinstance(decision, NoFit)
    assert decision.reasons["a"] == "CPUs: needs 4, 2 free"


def test_cordoned_draining_lost_and_unhealthy_nodes_take_nothing() -> None:
    decision = place(
        req(),
        fleet(
            node("c", cordoned=True),
            node("d", cordoned=True, draining=True),
            node("l", lost=True, last_seen=NOW - 40),
            node("u", problems=("disk full",)),
            node("s", last_seen=NOW - 16, heartbeat_s=5),
        ),
    )
    assert isinstance(decision, NoFit)
    assert decision.reasons == {
        "c": "cordoned",
        "d": "draining",
        "l": "lost (silent 40 s)",
        "u": "unhealthy: disk full",
        "s": "no heartbeat for 16 s",
    }


def test_least_loaded_wins_and_ties_go_to_the_smaller_id() -> None:
    held = {"a": (req(cpus=4),)}
    busy = fleet(node("a"), node("b"), held=held)
    assert place(req(), busy) == Placement("b", "least loaded of 2 fitting (100% free)")
    tie = place(req(), fleet(node("z"), node("m"), node("q")))
    assert isinstance(tie, Placement) and tie.node_id == "m"


def test_free_fraction_is_that_of_the_most_used_resource() -> None:
    # a: half its memory used; b: a quarter of its CPUs used -> b is less loaded
    held = {"a": (req(cpus=0.5, mem_gib=16),), "b": (req(cpus=2, mem_gib=1),)}
    decision = place(req(), fleet(node("a"), node("b"), held=held))
    assert isinstance(decision, Placement) and decision.node_id == "b"


def test_avoided_node_is_used_only_when_nothing_else_fits() -> None:
    assert place(req(), fleet(node("a"), node("b")), avoid="a") == Placement(
        "b", "least loaded of 2 fitting (100% free)"
    )
    only = place(req(), fleet(node("a")), avoid="a")
    assert isinstance(only, Placement) and only.node_id == "a"


def test_gpu_count_and_per_gpu_memory_from_declared_inventories() -> None:
    nodes = (node("g24", gpus=(24, 24, 24, 24)), node("g80", gpus=(80, 80)))
    big = place(req(gpus=2, gpu_gib=40), fleet(*nodes))
    assert isinstance(big, Placement) and big.node_id == "g80"
    many = place(req(gpus=3), fleet(*nodes))
    assert isinstance(many, Placement) and many.node_id == "g24"
    none = place(req(gpus=3, gpu_gib=40), fleet(*nodes))
    assert isinstance(none, NoFit)
    assert none.reasons == {
        "g24": "GPUs: needs 3 of 40.0 GiB+, 0 free",
        "g80": "GPUs: needs 3 of 40.0 GiB+, 2 free",
    }
    cpu_only = place(req(gpus=1), fleet(node("cpu")))
    assert isinstance(cpu_only, NoFit) and cpu_only.reasons["cpu"] == "GPUs: needs 1, 0 free"


def test_held_gpus_take_the_smallest_that_fit_them() -> None:
    gpus = [gpu(0, 24), gpu(1, 80), gpu(2, 40)]
    # a 30 GiB need takes the 40 GiB GPU, leaving the 80 for a larger one
    assert free_gpus(gpus, [req(gpus=1, gpu_gib=30)]) == [24 * GIB, 80 * GIB]
    decision = place(
        req(gpus=1, gpu_gib=60),
        fleet(node("g", gpus=(24, 80, 40)), held={"g": (req(gpus=1, gpu_gib=30),)}),
    )
    assert isinstance(decision, Placement)


def test_max_sandboxes_is_a_limit() -> None:
    decision = place(req(), fleet(node("a", max_sandboxes=1), held={"a": (req(),)}))
    assert isinstance(decision, NoFit) and decision.reasons["a"] == "full (1 sandboxes)"


def test_resources_come_from_the_compiled_plan() -> None:
    text = (
        'version: "1.2"\nname: r\nbase: dsec/python311:latest\nentrypoint: [python]\n'
        "resources: {cpu: 1500m, memory: 3GiB, gpu: {count: 2, memory: 40GiB}}\n"
    )
    loaded = load_spec(text, "dsec.yaml")
    assert loaded.spec is not None, loaded.errors
    plan = compile_plan(loaded.spec).model_dump(mode="json")
    assert resources_from_plan(plan) == Resources(
        cpus=1.5, memory_bytes=3 * GIB, gpus=2, gpu_memory_bytes=40 * GIB
    )


# --------------------------------------------------------------------------- the fold


def seen(event_type: str, aggregate_id: str, at: float = NOW, **payload: Any) -> Seen:
    return Seen(f"e{next(_ids)}", event_type, aggregate_id, "default", payload, at)


def heartbeat(node_id: str, at: float = NOW, cpus: float = 8, **kw: Any) -> Seen:
    inv = NodeInventory(cpus=cpus, memory_bytes=32 * GIB).model_dump(mode="json")
    return seen("node.heartbeat", node_id, at, node_id=node_id, seq=1, inventory=inv, **kw)


def scheduled(sid: str, node_id: str, cpus: float = 2, attempt: int = 1) -> Seen:
    res = req(cpus=cpus).model_dump(mode="json")
    return seen("sandbox.scheduled", sid, node_id=node_id, attempt=attempt, resources=res)


def test_fold_allocates_scheduled_sandboxes_and_frees_ended_ones() -> None:
    state = SchedulerState(lost_after_s=15)
    assert state.apply(heartbeat("n1")) is True  # a new node: the queue may move
    state.apply(seen("env.built", "s1"))
    state.apply(scheduled("s1", "n1", cpus=6))
    assert state.fleet(NOW).allocations == {"n1": (req(cpus=6),)}
    assert state.on_node("n1") == ["s1"]
    freed = state.apply(seen("sandbox.exited", "s1", exit_code=0, reason="ok", duration_s=1))
    assert freed is True
    assert state.fleet(NOW).allocations == {} and "s1" not in state.sandboxes


def test_fold_refuses_an_out_of_order_event() -> None:
    state = SchedulerState(lost_after_s=15)
    state.apply(heartbeat("n1"))
    state.apply(seen("env.built", "s1"))
    state.apply(scheduled("s1", "n1"))
    # a second placement cannot follow `scheduled`: the first stands
    state.apply(scheduled("s1", "n2"))
    assert state.on_node("n1") == ["s1"] and state.on_node("n2") == []


def test_queue_is_oldest_first_and_skips_stopped() -> None:
    state = SchedulerState(lost_after_s=15)
    for sid, at in (("late", NOW + 5), ("early", NOW), ("stopped", NOW - 5)):
        state.apply(seen("env.built", sid))
        state.apply(seen("sandbox.pending", sid, at, reason="no node", attempt=1))
    state.apply(seen("sandbox.stop_requested", "stopped"))
    assert [s.sandbox_id for s in state.queue()] == ["early", "late"]


def test_silent_node_is_reported_until_lost_and_rejoins_empty() -> None:
    state = SchedulerState(lost_after_s=15)
    state.apply(heartbeat("n1", at=NOW - 20))
    state.apply(heartbeat("n2", at=NOW))
    state.apply(seen("env.built", "s1"))
    state.apply(scheduled("s1", "n1"))
    assert [n.node_id for n in state.silent(NOW)] == ["n1"]
    # a scheduler that started 10 s ago gives it the full 15 s from then
    assert state.silent(NOW, watching_since=NOW - 10) == []
    state.apply(seen("node.lost", "n1", node_id="n1", silent_s=20, sandboxes=["s1"]))
    assert state.silent(NOW) == []
    assert [(n.node_id, held) for n, held in state.evacuate()] == [("n1", ["s1"])]
    lost = seen("unit.lost", "s1", node_id="n1", reason="lost", action="reschedule", attempt=1)
    assert state.apply(lost) is True
    sbx = state.sandboxes["s1"]
    assert sbx.waiting and sbx.next_attempt == 2 and sbx.lost_on == "n1"
    assert state.evacuate() == []
    # n1 heartbeats again: it rejoins, without its old sandbox
    assert state.apply(heartbeat("n1", at=NOW + 1)) is True
    assert not state.nodes["n1"].lost and state.on_node("n1") == []


def test_unit_lost_fail_is_terminal() -> None:
    state = SchedulerState(lost_after_s=15)
    state.apply(heartbeat("n1"))
    state.apply(seen("env.built", "s1"))
    state.apply(scheduled("s1", "n1", attempt=3))
    state.apply(seen("unit.lost", "s1", node_id="n1", reason="x", action="fail", attempt=3))
    assert "s1" not in state.sandboxes and state.queue() == []


def test_cordon_and_uncordon_wake_the_queue() -> None:
    state = SchedulerState(lost_after_s=15)
    state.apply(heartbeat("n1"))
    cordon = seen("node.cordoned", "n1", node_id="n1", cordoned=True, draining=True)
    assert state.apply(cordon) is False
    assert state.nodes["n1"].draining and state.nodes["n1"].drain_event_id == cordon.id
    assert state.apply(heartbeat("n1")) is False  # a heartbeat keeps the cordon
    assert state.nodes["n1"].cordoned
    assert state.apply(seen("node.cordoned", "n1", node_id="n1", cordoned=False)) is True


def test_tentative_decision_is_corrected_by_the_log() -> None:
    state = SchedulerState(lost_after_s=15)
    state.apply(heartbeat("n1"))
    state.apply(heartbeat("n2"))
    state.apply(seen("env.built", "s1"))
    mine = scheduled("s1", "n1")
    state.tentative(mine)
    assert state.on_node("n1") == ["s1"]
    # another replica's decision won the id: the log's version is the truth
    theirs = Seen(mine.id, mine.type, "s1", "default", {**mine.payload, "node_id": "n2"}, NOW)
    state.apply(theirs)
    assert state.on_node("n1") == [] and state.on_node("n2") == ["s1"]


def test_withdrawn_decision_leaves_no_trace() -> None:
    state = SchedulerState(lost_after_s=15)
    state.apply(heartbeat("n1"))
    state.apply(seen("env.built", "s1"))
    decision = scheduled("s1", "n1")
    state.tentative(decision)
    assert state.fleet(NOW).allocations == {"n1": (req(cpus=2),)}
    state.withdraw(decision.id)
    assert state.on_node("n1") == [] and state.sandboxes["s1"].life.state == "built"
    assert state.fleet(NOW).allocations == {}


def test_a_pending_reason_changes_shape_with_nodes_not_with_numbers() -> None:
    before = "no node fits: a: CPUs: needs 6, 4 free"
    assert reason_shape(before) == reason_shape("no node fits: a: CPUs: needs 6, 2.5 free")
    another = "no node fits: a: CPUs: needs 6, 4 free; b: cordoned"
    assert reason_shape(before) != reason_shape(another)
    assert reason_shape("no node has joined") != reason_shape(before)


def test_a_heartbeat_filed_under_another_nodes_subject_is_not_folded() -> None:
    state = SchedulerState(lost_after_s=15)
    inv = NodeInventory(cpus=8, memory_bytes=GIB).model_dump(mode="json")
    misfiled = seen("node.heartbeat", "n2", node_id="n1", seq=1, inventory=inv)
    assert state.apply(misfiled) is False and state.nodes == {}


def replayed(event: Seen, at: float) -> Seen:
    """The same signed bytes published again: same id, signed time and payload, stored later."""
    return Seen(
        event.id, event.type, event.aggregate_id, event.tenant, event.payload, at, event.sent_at
    )


def test_replayed_node_events_neither_revive_nor_kill_nor_cordon_a_node() -> None:
    state = SchedulerState(lost_after_s=15)
    last = heartbeat("n1", at=NOW - 20)
    state.apply(last)
    # a dead node's last heartbeat published again keeps it neither alive nor placeable
    assert state.apply(replayed(last, NOW)) is False
    assert [n.node_id for n in state.silent(NOW)] == ["n1"]
    lost = seen("node.lost", "n1", node_id="n1", silent_s=20, last_seen=_iso(NOW - 20))
    state.apply(lost)
    assert state.apply(replayed(last, NOW + 1)) is False and state.nodes["n1"].lost
    assert isinstance(place(req(), state.fleet(NOW + 1)), NoFit)
    # it really comes back; its old loss replayed then does not declare it lost again
    state.apply(heartbeat("n1", at=NOW + 2))
    assert state.apply(replayed(lost, NOW + 3)) is False and not state.nodes["n1"].lost
    # an operator's drain, then an uncordon; the drain's bytes replayed drain nothing
    drain = seen("node.cordoned", "n1", NOW + 4, node_id="n1", cordoned=True, draining=True)
    state.apply(replayed(drain, NOW + 4))
    undo = seen("node.cordoned", "n1", NOW + 5, node_id="n1", cordoned=False)
    state.apply(replayed(undo, NOW + 5))
    assert state.apply(replayed(drain, NOW + 6)) is False
    assert not state.nodes["n1"].cordoned and not state.nodes["n1"].draining


def _iso(at: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(at, UTC).isoformat()


def test_a_no_fit_summary_stays_bounded_for_a_large_fleet_and_long_problems() -> None:
    reasons = {f"n{i:04d}": "unhealthy: " + "x" * 10_000 for i in range(1000)}
    text = NoFit(reasons).summary()
    assert len(text) < 4500
    assert text.startswith("no node fits: n0000: unhealthy: xxx")
    assert text.endswith("more nodes") and "… and 988 more nodes" in text


def test_a_placement_the_node_does_not_report_stops_holding_capacity_once_assumed() -> None:
    """Like Kubernetes' assumed pods: a placement holds its CPUs for ASSUMED_S without the node
    reporting it; after that only while the node's heartbeats list the sandbox (one the node
    never started, or whose end the log never showed, frees the node)."""
    state = SchedulerState(lost_after_s=1e9)
    state.apply(heartbeat("n1", sandboxes=[]))
    for sid in ("runs", "never"):
        state.apply(seen("env.built", sid))
        state.apply(scheduled(sid, "n1", cpus=3))
    assert state.fleet(NOW + 10).allocations == {"n1": (req(cpus=3), req(cpus=3))}
    later = NOW + ASSUMED_S + 5
    # no heartbeat since the placements became old: nothing to judge by, both still count
    assert len(state.fleet(later).allocations["n1"]) == 2
    state.apply(heartbeat("n1", at=later, sandboxes=["runs"]))
    assert state.fleet(later + 1).allocations == {"n1": (req(cpus=3),)}
    assert isinstance(place(req(cpus=5), state.fleet(later + 1)), Placement)
    # a report that drops "runs" too frees it; the sandboxes themselves are still known
    state.apply(heartbeat("n1", at=later + 5, sandboxes=[]))
    assert state.fleet(later + 6).allocations == {}
    assert state.on_node("n1") == ["never", "runs"]


def test_a_sandbox_that_ended_before_or_after_its_env_built_is_never_queued() -> None:
    """A failure recorded before the (late) env.built, or an env.built again after the end:
    the sandbox is not placed, and holds nothing."""
    state = SchedulerState(lost_after_s=1e9)
    state.apply(heartbeat("n1"))
    state.apply(seen("sandbox.failed", "early", stage="builder", reason="x"))
    state.apply(seen("env.built", "early"))
    state.apply(seen("env.built", "late"))
    state.apply(scheduled("late", "n1"))
    state.apply(seen("sandbox.exited", "late", exit_code=0, reason="ok", duration_s=1))
    state.apply(seen("env.built", "late"))
    assert state.queue() == [] and state.sandboxes == {}
    assert state.fleet(NOW).allocations == {}


def test_an_expired_placement_is_judged_by_the_next_heartbeat_after_it() -> None:
    """The placement's assumption ends between two heartbeats: the fleet counted it then (no
    newer word from the node), and the next heartbeat that does not list it frees the node."""
    state = SchedulerState(lost_after_s=1e9)
    state.apply(heartbeat("n1", sandboxes=[]))
    state.apply(seen("env.built", "ghost"))
    state.apply(scheduled("ghost", "n1", cpus=8))
    state.apply(heartbeat("n1", at=NOW + ASSUMED_S - 2, sandboxes=[]))
    assert state.fleet(NOW + ASSUMED_S + 1).allocations == {"n1": (req(cpus=8),)}
    state.apply(heartbeat("n1", at=NOW + ASSUMED_S + 3, sandboxes=[]))
    assert state.fleet(NOW + ASSUMED_S + 4).allocations == {}
