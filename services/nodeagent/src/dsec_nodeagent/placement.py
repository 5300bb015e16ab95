"""What this node does about a sandbox, decided from its lifecycle (pure).

Each decision reads :class:`dsec_core.lifecycle.Lifecycle`, the fold of the sandbox's authentic
events, so a redelivered, late or foreign event never starts, stops or keeps the wrong copy.
"""

from __future__ import annotations

from typing import Literal

from dsec_core.lifecycle import Lifecycle

StopAction = Literal["exit-now", "skip"]


def why_not_start(state: Lifecycle, node_id: str, attempt: int) -> str | None:
    """``None`` when ``node_id`` should start the sandbox for placement ``attempt``; otherwise
    why not (logged; the event is acked)."""
    if state.state != "scheduled":
        return f"it is {state.state}, not waiting to start"
    if state.node_id != node_id:
        return f"it is scheduled on {state.node_id!r}"
    if state.attempt != attempt:
        return f"placement {attempt} is not its latest ({state.attempt})"
    return None


def stop_without_run(state: Lifecycle, node_id: str) -> StopAction:
    """A stop for a sandbox this node does not run: ``exit-now`` when it is scheduled here and
    has not started (it ends in ``sandbox.exited`` reason stopped), else ``skip`` (another node
    owns it, or nothing is left to stop)."""
    return "exit-now" if state.state == "scheduled" and state.owned_by(node_id) else "skip"


def stale(state: Lifecycle, node_id: str, attempt: int | None = None) -> bool:
    """Whether a copy running here (as placement ``attempt``, ``None``: unknown, e.g. re-adopted
    after a restart) must be fenced off: the sandbox is placed elsewhere now, or lost, or on a
    newer placement than this copy."""
    if not state.owned_by(node_id):
        return True
    return attempt is not None and state.attempt > attempt and state.state == "running"
