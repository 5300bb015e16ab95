"""One lifecycle: the pure fold of a sandbox's events into its state.

Every reader of a sandbox's history uses this fold: the projector (``dsec sandbox list``), the
node agent's idempotency checks, the scheduler, the snapshot service and ``dsec submit``. It
knows which event may follow which; an event that would be an illegal transition (a second
``sandbox.ready``, ``sandbox.ready`` after ``sandbox.exited``, ...) is *refused*: the state is
left as it was and the refusal is recorded, so a duplicate or a forged-but-signed event out of
order never moves a sandbox backwards.

States::

    submitted ─► validated ─► resolved ─► built ─► pending ◄─┐
        │            │            │          │        │        │ (no node fits)
        ▼            ▼            ▼          └──► scheduled ◄──┤
     rejected     conflict     failed              │   ▲       │
                                                   ▼   │ unit.lost (reschedule)
                                                 running ─► lost ──► failed (unit.lost fail)
                                                   │ ▲
                                                   │ └─ sandbox.restarted (stateful, in place),
                                                   │    unit.migrated (now on its to_node)
                                                   ▼
                                            exited | failed

``sandbox.failed`` ends any non-terminal state; ``sandbox.exited`` ends ``running`` (and a
``built``, ``pending`` or ``scheduled`` sandbox stopped before it ran). Events that do not move
the state (``context.injected``, ``policy.*``, ``snapshot.*``, ``sandbox.stop_requested``) are
accepted in any state.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

State = Literal[
    "unknown",
    "submitted",
    "validated",
    "rejected",
    "resolved",
    "conflict",
    "built",
    "pending",
    "scheduled",
    "running",
    "lost",
    "exited",
    "failed",
]

TERMINAL_STATES: frozenset[State] = frozenset({"rejected", "conflict", "exited", "failed"})

# event type -> (the states it may follow, the state it leads to)
_MOVES: dict[str, tuple[frozenset[State], State]] = {
    "spec.submitted": (frozenset({"unknown"}), "submitted"),
    "spec.validated": (frozenset({"submitted"}), "validated"),
    "spec.rejected": (frozenset({"submitted"}), "rejected"),
    "deps.resolved": (frozenset({"validated"}), "resolved"),
    "deps.conflict": (frozenset({"validated"}), "conflict"),
    "env.built": (frozenset({"resolved"}), "built"),
    "sandbox.pending": (frozenset({"built", "pending", "lost"}), "pending"),
    "sandbox.scheduled": (frozenset({"built", "pending", "lost"}), "scheduled"),
    "sandbox.ready": (frozenset({"scheduled"}), "running"),
    # a stateful sandbox that died and was started again in place: it stays running
    "sandbox.restarted": (frozenset({"running"}), "running"),
    # moved to another node while it ran (docs/migration.md): it stays running, there
    "unit.migrated": (frozenset({"running"}), "running"),
    "unit.lost": (frozenset({"scheduled", "running"}), "lost"),
    "sandbox.exited": (frozenset({"built", "pending", "scheduled", "running"}), "exited"),
}
_ANY_LIVE: frozenset[State] = frozenset(
    {
        "unknown",
        "submitted",
        "validated",
        "resolved",
        "built",
        "pending",
        "scheduled",
        "running",
        "lost",
    }
)
MIGRATED = "unit.migrated"
"""A unit moved to another node; for the unit ``main`` the sandbox's node changes with it (it
stays ``running``): from then on the target's node agent is the one that speaks for it."""
LIFECYCLE_TYPES: frozenset[str] = frozenset({*_MOVES, "sandbox.failed", MIGRATED})
"""Event types that move a sandbox's state or its node (all others are facts about it)."""


@dataclass(frozen=True)
class Refused:
    """An event the fold did not apply: it cannot follow the state the sandbox was in."""

    event_type: str
    event_id: str | None
    state: State

    def describe(self) -> str:
        """One line for logs and ``dsec sandbox show``."""
        return f"{self.event_type} cannot follow state {self.state!r}"


@dataclass(frozen=True)
class Lifecycle:
    """A sandbox's state after the events folded so far."""

    state: State = "unknown"
    node_id: str | None = None
    """The node it is scheduled on / runs on (the latest ``sandbox.scheduled``)."""
    attempt: int = 0
    """Placement attempt of that node (``sandbox.scheduled.attempt``)."""
    tenant: str | None = None
    exit_code: int | None = None
    reason: str | None = None
    """Why it waits (``pending``), was lost, failed, exited or was rejected."""
    last_event_id: str | None = None
    refused: tuple[Refused, ...] = field(default_factory=tuple)
    restarts: int = 0
    """Times it was started again in place after dying (``sandbox.restarted``)."""
    migrations: tuple[str, ...] = ()
    """Ids of the migrations that moved it (``unit.migrated``), oldest first."""

    @property
    def terminal(self) -> bool:
        """Whether nothing will happen to it any more."""
        return self.state in TERMINAL_STATES

    @property
    def started(self) -> bool:
        """Whether it reached ``running`` at some point or ended (the node agent must not
        start it again)."""
        return self.state in {"running", "exited", "failed", "lost"}

    def owned_by(self, node_id: str) -> bool:
        """Whether ``node_id`` is the node that acts on this sandbox now."""
        return self.node_id == node_id and self.state in {"scheduled", "running"}


def _reason(event_type: str, payload: Mapping[str, Any]) -> str | None:
    if event_type == "spec.rejected":
        errors = payload.get("errors") or []
        first = errors[0] if errors and isinstance(errors[0], dict) else {}
        return str(first.get("message", "rejected"))
    if event_type == "deps.conflict":
        return str(payload.get("explanation", "")).split("\n", 1)[0] or "conflict"
    if event_type in {"sandbox.pending", "unit.lost", "sandbox.failed", "sandbox.exited"}:
        value = payload.get("reason")
        return None if value is None else str(value)
    return None


def _stale_placement(current: Lifecycle, event_type: str, payload: Mapping[str, Any]) -> bool:
    """Whether a placement event belongs to an earlier placement than the current one: a
    ``sandbox.scheduled`` or ``sandbox.pending`` whose attempt is not above that of the last
    placement, or a ``unit.lost`` of another
    node or attempt — the replayed bytes of an old genuine event, which must never move the
    sandbox back to a node it left, nor take it from the node it runs on now."""
    try:
        if event_type in {"sandbox.scheduled", "sandbox.pending"}:
            return int(payload.get("attempt", 1)) <= current.attempt
        if event_type == "unit.lost" and current.node_id is not None:
            node = payload.get("node_id", current.node_id)
            attempt = int(payload.get("attempt", current.attempt))
            return node != current.node_id or attempt != current.attempt
    except (TypeError, ValueError):
        return True
    return False


def step(
    current: Lifecycle,
    event_type: str,
    payload: Mapping[str, Any],
    *,
    event_id: str | None = None,
    tenant: str | None = None,
) -> Lifecycle:
    """The state after one more event (pure). An illegal transition is refused, recorded, and
    leaves the state as it was."""
    if event_type == MIGRATED:
        return _migrated(current, payload, event_id)
    if event_type == "sandbox.exited" and payload.get("reason") == "migrated":
        return current  # the process left its old node; the sandbox runs on (unit.migrated)
    if event_type == "sandbox.failed":
        allowed: frozenset[State] = _ANY_LIVE
        target: State = "failed"
    elif event_type == "unit.lost" and payload.get("action") == "fail":
        allowed, target = _MOVES["unit.lost"][0], "failed"
    elif event_type in _MOVES:
        allowed, target = _MOVES[event_type]
    else:
        return current  # a fact about the sandbox, not a move
    if current.state not in allowed or _stale_placement(current, event_type, payload):
        refused = Refused(event_type, event_id, current.state)
        return replace(current, refused=(*current.refused, refused))
    changes: dict[str, Any] = {"state": target, "last_event_id": event_id}
    if event_type == "spec.submitted":
        changes["tenant"] = tenant
    if event_type == "sandbox.scheduled":
        changes["node_id"] = payload.get("node_id")
        changes["attempt"] = int(payload.get("attempt", 1))
        changes["reason"] = None
    if event_type == "sandbox.exited":
        changes["exit_code"] = payload.get("exit_code")
    if event_type == "sandbox.restarted":
        try:
            changes["restarts"] = max(current.restarts, int(payload.get("restarts", 0)))
        except (TypeError, ValueError):
            changes["restarts"] = current.restarts + 1
    reason = _reason(event_type, payload)
    if reason is not None:
        changes["reason"] = reason
    return replace(current, **changes)


def _migrated(current: Lifecycle, payload: Mapping[str, Any], event_id: str | None) -> Lifecycle:
    """``unit.migrated``: the unit ``main`` of a placed sandbox moves its node from the node it
    was on (another unit's move changes nothing here; one that does not start from the
    sandbox's node, or that was applied already — replayed bytes of an older move — is
    refused)."""
    if payload.get("unit", "main") != "main":
        return current
    # (``scheduled`` too: a reader that judges the source's ``sandbox.ready`` against the
    # sandbox's latest node, as a rebuilt scheduler does, never saw it running there)
    placed = current.state in {"scheduled", "running"}
    mid = str(payload.get("migration_id"))
    if not placed or payload.get("from_node") != current.node_id or mid in current.migrations:
        refused = Refused(MIGRATED, event_id, current.state)
        return replace(current, refused=(*current.refused, refused))
    return replace(
        current,
        node_id=str(payload.get("to_node")),
        migrations=(*current.migrations, mid),
        last_event_id=event_id,
    )


def fold(events: Iterable[tuple[str, Mapping[str, Any]]]) -> Lifecycle:
    """The state after ``(event_type, payload)`` pairs in log order."""
    state = Lifecycle()
    for event_type, payload in events:
        state = step(state, event_type, payload)
    return state


def fold_envelopes(envelopes: Iterable[Any]) -> Lifecycle:
    """The state after envelopes (anything with ``type``, ``payload``, ``id``, ``tenant``) in
    log order; only pass authentic ones (:meth:`dsec_core.trust.Gate.check`). An event id
    folded once is not folded again: a genuine event published anew (anyone may publish its
    bytes) is a replay. Before, an old placement's ``sandbox.ready`` replayed after the
    sandbox was placed on the same node again moved the new placement to ``running``, and
    the node agent never started it."""
    state = Lifecycle()
    seen: set[str] = set()
    for env in envelopes:
        if env.id in seen:
            continue
        seen.add(env.id)
        state = step(
            state, env.type, env.payload, event_id=env.id, tenant=getattr(env, "tenant", None)
        )
    return state


STATE_OF: dict[str, State] = {event: target for event, (_, target) in _MOVES.items()}
STATE_OF["sandbox.failed"] = "failed"
"""The state each lifecycle event leads to (for display where no history is at hand)."""
