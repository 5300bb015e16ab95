"""The one lifecycle fold: legal transitions move the state, illegal ones are refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsec_core.layout import LayoutError, NodeLayout
from dsec_core.lifecycle import fold, step

HAPPY = [
    ("spec.submitted", {}),
    ("spec.validated", {}),
    ("deps.resolved", {}),
    ("env.built", {}),
    ("sandbox.scheduled", {"node_id": "node-2", "attempt": 1}),
    ("context.injected", {"kind": "secret"}),
    ("sandbox.ready", {"node_id": "node-2"}),
    ("sandbox.exited", {"exit_code": 0, "reason": "ok"}),
]


def test_happy_path_ends_exited_on_its_node() -> None:
    state = fold(HAPPY)
    assert state.state == "exited"
    assert state.node_id == "node-2"
    assert state.exit_code == 0
    assert state.terminal
    assert state.refused == ()


def test_ready_twice_or_after_exit_is_refused_and_changes_nothing() -> None:
    state = fold([*HAPPY[:7], ("sandbox.ready", {"node_id": "node-3"})])
    assert state.state == "running"
    assert [r.describe() for r in state.refused] == ["sandbox.ready cannot follow state 'running'"]
    after = step(fold(HAPPY), "sandbox.ready", {})
    assert after.state == "exited"
    assert len(after.refused) == 1


def test_a_restarted_sandbox_stays_running_and_counts_its_restarts() -> None:
    died = {"exit_code": None, "signal": 9, "reason": "error", "pid": 7}
    state = fold(
        [
            *HAPPY[:7],
            ("sandbox.restarted", {**died, "restarts": 1}),
            ("sandbox.restarted", {**died, "restarts": 2}),
        ]
    )
    assert (state.state, state.restarts, state.node_id) == ("running", 2, "node-2")
    assert state.owned_by("node-2") and state.refused == ()
    # a replayed older restart never lowers the count
    assert step(state, "sandbox.restarted", {**died, "restarts": 1}).restarts == 2
    ended = step(state, "sandbox.exited", {"exit_code": -1, "reason": "error"})
    assert (ended.state, ended.restarts) == ("exited", 2)


def test_a_restart_is_refused_unless_it_runs() -> None:
    payload = {"restarts": 1, "exit_code": 1, "signal": None, "reason": "error", "pid": 7}
    before = step(fold(HAPPY[:5]), "sandbox.restarted", payload)
    assert before.state == "scheduled" and before.restarts == 0
    assert [r.describe() for r in before.refused] == [
        "sandbox.restarted cannot follow state 'scheduled'"
    ]
    after = step(fold(HAPPY), "sandbox.restarted", payload)
    assert after.state == "exited" and after.restarts == 0 and len(after.refused) == 1


def test_lost_then_rescheduled_moves_ownership() -> None:
    state = fold(
        [
            *HAPPY[:7],
            ("unit.lost", {"node_id": "node-2", "action": "reschedule", "reason": "node lost"}),
        ]
    )
    assert state.state == "lost"
    assert not state.owned_by("node-2")
    state = step(state, "sandbox.scheduled", {"node_id": "node-3", "attempt": 2})
    assert state.owned_by("node-3") and not state.owned_by("node-2")
    assert state.attempt == 2


def test_lost_with_fail_is_terminal_with_the_reason() -> None:
    state = fold([*HAPPY[:7], ("unit.lost", {"action": "fail", "reason": "no node left"})])
    assert state.state == "failed"
    assert state.reason == "no node left"


def test_pending_then_scheduled_and_failure_from_any_live_state() -> None:
    state = fold([*HAPPY[:4], ("sandbox.pending", {"reason": "no node has 64 GiB"})])
    assert (state.state, state.reason) == ("pending", "no node has 64 GiB")
    assert fold([*HAPPY[:2], ("sandbox.failed", {"reason": "x"})]).state == "failed"
    assert fold([*HAPPY, ("sandbox.failed", {"reason": "x"})]).refused


def test_out_of_order_pipeline_events_are_refused() -> None:
    state = fold([("spec.submitted", {}), ("env.built", {}), ("sandbox.ready", {})])
    assert state.state == "submitted"
    assert len(state.refused) == 2


def test_layout_names_one_component_only(tmp_path: Path) -> None:
    layout = NodeLayout.of(tmp_path)
    assert layout.sandbox("sbx_1").code == tmp_path.resolve() / "sandboxes" / "sbx_1" / "code"
    assert layout.env_site_packages("ab12cd34ef").name == "site-packages"
    for bad in ("../etc", "a/b", "", "x" * 200):
        with pytest.raises(LayoutError):
            layout.sandbox(bad)
    with pytest.raises(LayoutError, match="lock hash"):
        layout.env("../../x")


def test_a_sandbox_stopped_while_it_was_built_but_not_placed_ends_exited() -> None:
    state = fold([*HAPPY[:4], ("sandbox.exited", {"exit_code": -1, "reason": "stopped"})])
    assert (state.state, state.reason, state.exit_code) == ("exited", "stopped", -1)


def test_replayed_placement_events_never_move_a_sandbox_back() -> None:
    """The bytes of an old genuine ``sandbox.scheduled`` / ``unit.lost`` re-published later (a
    replay: authentic, so only the fold can tell) neither move a rescheduled sandbox back to
    the node it left nor take it from the node it runs on now."""
    first = ("sandbox.scheduled", {"node_id": "node-2", "attempt": 1})
    lost = ("unit.lost", {"node_id": "node-2", "attempt": 1, "action": "reschedule"})
    moved = ("sandbox.scheduled", {"node_id": "node-3", "attempt": 2})
    ready = ("sandbox.ready", {"node_id": "node-3"})
    # lost, waiting for a node: the old placement replayed does not bring it back to node-2
    waiting = fold([*HAPPY[:4], first, lost, ("sandbox.pending", {"reason": "x", "attempt": 2})])
    replayed = step(waiting, *first)
    assert (replayed.state, replayed.node_id) == ("pending", "node-2")
    assert [r.event_type for r in replayed.refused] == ["sandbox.scheduled"]
    # running on node-3: the old loss replayed takes nothing from it
    running = fold([*HAPPY[:4], first, lost, moved, ready])
    after = step(running, *lost)
    assert (after.state, after.node_id, after.attempt) == ("running", "node-3", 2)
    assert [r.event_type for r in after.refused] == ["unit.lost"]
    # lost, about to be placed again: the first wait (attempt 1) replayed does not make the
    # scheduler place it as attempt 1 again
    waited = fold([*HAPPY[:4], ("sandbox.pending", {"reason": "no node", "attempt": 1}), first])
    again = step(step(waited, *lost), "sandbox.pending", {"reason": "no node", "attempt": 1})
    assert again.state == "lost" and again.refused[-1].event_type == "sandbox.pending"
    # the same placement twice (a redelivery of attempt 2) is refused too
    assert step(fold([*HAPPY[:4], first, lost]), *moved).state == "scheduled"
    assert step(fold([*HAPPY[:4], first, lost, moved]), *moved).refused


def test_a_migrated_main_unit_moves_the_sandbox_to_the_target_node() -> None:
    running = fold([*HAPPY[:4], ("sandbox.scheduled", {"node_id": "node-2", "attempt": 1}),
                    ("sandbox.ready", {"node_id": "node-2"})])  # fmt: skip
    moved = {"unit": "main", "migration_id": "m1", "from_node": "node-2", "to_node": "node-3"}
    after = step(running, "unit.migrated", moved)
    assert (after.state, after.node_id, after.attempt) == ("running", "node-3", 1)
    assert after.owned_by("node-3") and not after.owned_by("node-2")
    assert step(after, "unit.migrated", moved).refused[-1].event_type == "unit.migrated"  # replay
    side = step(after, "unit.migrated", {**moved, "unit": "trainer", "from_node": "node-3"})
    assert side == after  # another unit's move leaves the sandbox where it is
    left = step(after, "sandbox.exited", {"exit_code": 0, "reason": "migrated"})
    assert left == after  # the process left its old node; the sandbox runs on


def _migrated(mid: str, from_node: str, to_node: str) -> tuple[str, dict[str, str]]:
    return "unit.migrated", {"migration_id": mid, "from_node": from_node, "to_node": to_node}


def test_a_migration_moves_a_running_sandbox_once_and_only_from_where_it_runs() -> None:
    running = HAPPY[:7]  # running on node-2
    moved = fold([*running, _migrated("m1", "node-2", "node-5")])
    assert (moved.state, moved.node_id) == ("running", "node-5")
    assert moved.owned_by("node-5") and not moved.owned_by("node-2")
    # the same migration's bytes again, or one that starts from a node it is not on: no move
    again = step(moved, *_migrated("m1", "node-2", "node-5"))
    elsewhere = step(moved, *_migrated("m2", "node-2", "node-7"))
    assert again.node_id == elsewhere.node_id == "node-5"
    assert len(again.refused) == len(elsewhere.refused) == 1
    # its end comes from the node it moved to
    assert step(moved, "sandbox.exited", {"exit_code": 0}).state == "exited"
    # a sandbox placed nowhere does not migrate
    assert step(fold(HAPPY[:3]), *_migrated("m3", "node-2", "node-5")).node_id is None
