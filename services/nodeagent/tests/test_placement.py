"""The node agent's placement decisions, from the lifecycle fold (pure)."""

from __future__ import annotations

from typing import Any

import pytest
from dsec_core.lifecycle import Lifecycle, fold

from dsec_nodeagent.placement import stale, stop_without_run, why_not_start

pytestmark = pytest.mark.unit

BUILT: list[tuple[str, dict[str, Any]]] = [
    ("spec.submitted", {}),
    ("spec.validated", {}),
    ("deps.resolved", {}),
    ("env.built", {}),
]


def _state(*more: tuple[str, dict[str, Any]]) -> Lifecycle:
    return fold([*BUILT, *more])


def _scheduled(node: str, attempt: int = 1) -> tuple[str, dict[str, Any]]:
    return ("sandbox.scheduled", {"node_id": node, "attempt": attempt})


LOST = ("unit.lost", {"node_id": "a", "attempt": 1, "action": "reschedule", "reason": "lost"})


def test_only_the_scheduled_node_starts_the_latest_placement() -> None:
    state = _state(_scheduled("a"))
    assert why_not_start(state, "a", 1) is None
    assert why_not_start(state, "b", 1) == "it is scheduled on 'a'"
    moved = _state(_scheduled("a"), ("sandbox.ready", {}), LOST, _scheduled("b", 2))
    assert why_not_start(moved, "a", 1) == "it is scheduled on 'b'"
    assert why_not_start(moved, "b", 1) == "placement 1 is not its latest (2)"
    assert why_not_start(moved, "b", 2) is None


def test_a_started_or_ended_sandbox_is_never_started_again() -> None:
    running = _state(_scheduled("a"), ("sandbox.ready", {}))
    assert why_not_start(running, "a", 1) == "it is running, not waiting to start"
    stopped = _state(_scheduled("a"), ("sandbox.exited", {"exit_code": -1, "reason": "stopped"}))
    assert why_not_start(stopped, "a", 1) == "it is exited, not waiting to start"


def test_a_stop_ends_a_sandbox_scheduled_here_that_did_not_start() -> None:
    assert stop_without_run(_state(_scheduled("a")), "a") == "exit-now"
    assert stop_without_run(_state(_scheduled("a")), "b") == "skip"  # another node's
    assert stop_without_run(_state(_scheduled("a"), ("sandbox.ready", {})), "a") == "skip"
    assert stop_without_run(_state(), "a") == "skip"  # not placed: the scheduler answers


def test_a_copy_is_stale_once_the_sandbox_is_placed_elsewhere_or_lost() -> None:
    running = _state(_scheduled("a"), ("sandbox.ready", {}))
    assert not stale(running, "a") and not stale(running, "a", 1)
    assert stale(running, "b")
    assert stale(_state(_scheduled("a"), ("sandbox.ready", {}), LOST), "a")
    moved = _state(_scheduled("a"), ("sandbox.ready", {}), LOST, _scheduled("b", 2))
    assert stale(moved, "a")
    back = _state(
        _scheduled("a"), ("sandbox.ready", {}), LOST, _scheduled("a", 2), ("sandbox.ready", {})
    )
    assert stale(back, "a", 1) and not stale(back, "a", 2)
