"""Pure scheduling decisions: the fleet, what each node holds, and where a sandbox goes.

Nothing here does I/O. :class:`SchedulerState` folds the authentic events the scheduler reads
from the log (node presence, cordons, the sandbox lifecycle through :mod:`dsec_core.lifecycle`)
into a fleet and a queue; :func:`place` chooses a node for one request. ``place`` is the seam
where placement quality (GPU topology, gangs) plugs in later: it sees the whole fleet.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from dsec_core.events import GpuInfo, NodeInventory, Resources
from dsec_core.lifecycle import Lifecycle, step
from dsec_core.spec.plan import ResourceLimits

from dsec_scheduler.degraded import DEGRADED_TYPES, DegradedGpus
from dsec_scheduler.gangs import MAIN, UnitHeld, held_from_placed, held_from_resources
from dsec_scheduler.migration import HEALTH_TYPES, MIGRATION_TYPES, MigrationBook, started

GIB = 2**30

# --------------------------------------------------------------------------- the request


def resources_from_plan(plan: Mapping[str, Any]) -> Resources:
    """What a sandbox needs, from its compiled plan's ``resources`` (``spec.validated``)."""
    limits = ResourceLimits.model_validate(plan["resources"])
    gpu = limits.gpu
    return Resources(
        cpus=limits.cpu_millicores / 1000,
        memory_bytes=limits.memory_bytes,
        gpus=gpu.count if gpu is not None else 0,
        gpu_memory_bytes=(gpu.memory_bytes or 0) if gpu is not None else 0,
    )


# --------------------------------------------------------------------------- the fleet


@dataclass(frozen=True)
class Node:
    """One node as the scheduler knows it (from its authentic node events)."""

    node_id: str
    inventory: NodeInventory
    last_seen: float
    """When its latest ``node.joined``/``node.heartbeat`` was sent: the earlier of the time the
    node agent signed and the time the log stored it (epoch seconds), so the bytes of an old
    heartbeat published again never make a silent node look alive."""
    heartbeat_s: float = 5.0
    last_event_id: str = ""
    problems: tuple[str, ...] = ()
    cordoned: bool = False
    draining: bool = False
    drain_event_id: str = ""
    """The ``node.cordoned`` that began the drain (what its ``unit.lost`` ids derive from)."""
    lost: bool = False
    flagged_at: float = 0.0
    """When the ``node.cordoned`` in force was signed (a replayed older one changes nothing)."""
    reported: frozenset[str] | None = None
    """The sandboxes its latest heartbeat says run there (``None``: no heartbeat yet)."""


ENDED_MEMORY = 200_000
"""Ended sandboxes remembered (about 60 bytes each) so a late ``env.built`` re-queues none."""

ASSUMED_S = 120.0
"""How long a placement counts on its node without the node reporting the sandbox (staging a
large environment and starting takes a while); after that the node's heartbeat is the truth
(as Kubernetes' scheduler expires assumed pods): a placement the node never started, or whose
end the scheduler never saw, stops holding capacity."""


@dataclass(frozen=True)
class Fleet:
    """The nodes, what is allocated on each, and the clock to judge freshness by."""

    nodes: Mapping[str, Node]
    allocations: Mapping[str, tuple[Resources, ...]]
    now: float
    lost_after_s: float
    units: tuple[UnitHeld, ...] = ()
    """Every compute unit that holds capacity now (what ``allocations`` sums per node)."""


@dataclass(frozen=True)
class Placement:
    """The chosen node."""

    node_id: str
    reason: str


REASON_CHARS = 300
SUMMARY_CHARS = 4000


@dataclass(frozen=True)
class NoFit:
    """No node can take the request now; why not, per node."""

    reasons: Mapping[str, str]

    def summary(self) -> str:
        """One line: each node and why it does not fit, bounded (a node's reason to
        REASON_CHARS, the line to SUMMARY_CHARS, then how many nodes are left out), so a large
        fleet or a node naming many problems never makes a ``sandbox.pending`` too large."""
        if not self.reasons:
            return "no node has joined"
        parts: list[str] = []
        size = 0
        for n, r in sorted(self.reasons.items()):
            part = f"{n}: {r}" if len(r) <= REASON_CHARS else f"{n}: {r[:REASON_CHARS]}…"
            if size + len(part) > SUMMARY_CHARS:
                parts.append(f"… and {len(self.reasons) - len(parts)} more nodes")
                break
            parts.append(part)
            size += len(part) + 2
        return "no node fits: " + "; ".join(parts)


def reason_shape(reason: str) -> str:
    """A no-fit reason without its numbers: a pending sandbox's reason is published again only
    when this changes (another node, another kind of shortfall), not with every free CPU."""
    return re.sub(r"\d+(\.\d+)?", "#", reason)


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


def free_gpus(gpus: Sequence[GpuInfo], allocated: Iterable[Resources]) -> list[int]:
    """Memory of each GPU not taken by ``allocated`` (each need takes the smallest GPUs that
    are large enough, the most demanding first), smallest first."""
    free = sorted(g.memory_total_bytes for g in gpus)
    for need in sorted(allocated, key=lambda r: (-r.gpu_memory_bytes, -r.gpus)):
        for _ in range(need.gpus):
            if not free:
                break
            idx = next((i for i, m in enumerate(free) if m >= need.gpu_memory_bytes), len(free) - 1)
            free.pop(idx)
    return free


def usable(node: Node, fleet: Fleet) -> list[str]:
    """Why nothing may be placed on ``node`` now (empty: it may take work)."""
    return _usable(node, fleet)


def _stale_after(node: Node, fleet: Fleet) -> float:
    """Seconds of silence after which ``node``'s heartbeat is stale (it may take nothing)."""
    return min(fleet.lost_after_s, 3 * node.heartbeat_s)


def verdict_until(node: Node, fleet: Fleet) -> float:
    """Until when :func:`usable`'s verdict on ``node`` holds as the clock moves (the node and
    the fleet's settings unchanged): its heartbeat goes stale after that, else never."""
    if node.lost:
        return float("inf")
    stale_at = node.last_seen + _stale_after(node, fleet)
    return stale_at if fleet.now <= stale_at else float("inf")


def _usable(node: Node, fleet: Fleet) -> list[str]:
    """Why nothing may be placed on ``node`` now (empty: it may take work)."""
    silent = fleet.now - node.last_seen
    if node.lost:
        return [f"lost (silent {silent:.0f} s)"]
    why = []
    if node.draining:
        why.append("draining")
    elif node.cordoned:
        why.append("cordoned")
    if node.problems:
        why.append("unhealthy: " + ", ".join(node.problems))
    if silent > _stale_after(node, fleet):
        why.append(f"no heartbeat for {silent:.0f} s")
    return why


def _shortfalls(request: Resources, node: Node, held: Sequence[Resources]) -> list[str]:
    """What ``node`` lacks for ``request`` given what it holds (empty: it fits)."""
    inv = node.inventory
    why = []
    if len(held) >= inv.max_sandboxes:
        why.append(f"full ({inv.max_sandboxes} sandboxes)")
    cpus_free = inv.cpus - sum(r.cpus for r in held)
    if request.cpus > cpus_free + 1e-9:
        why.append(f"CPUs: needs {request.cpus:g}, {max(cpus_free, 0):g} free")
    mem_free = inv.memory_bytes - sum(r.memory_bytes for r in held)
    if request.memory_bytes > mem_free:
        why.append(f"memory: needs {_gib(request.memory_bytes)}, {_gib(max(mem_free, 0))} free")
    if request.gpus:
        free = free_gpus(inv.gpus, held)
        big = [m for m in free if m >= request.gpu_memory_bytes]
        if len(big) < request.gpus:
            size = f" of {_gib(request.gpu_memory_bytes)}+" if request.gpu_memory_bytes else ""
            why.append(f"GPUs: needs {request.gpus}{size}, {len(big)} free")
    return why


def free_fraction(node: Node, held: Sequence[Resources]) -> float:
    """How free the node is: the free share of its most used resource (CPU, memory, GPUs)."""
    inv = node.inventory
    shares = [
        1 - sum(r.cpus for r in held) / inv.cpus if inv.cpus > 0 else 0.0,
        1 - sum(r.memory_bytes for r in held) / inv.memory_bytes if inv.memory_bytes > 0 else 0.0,
    ]
    if inv.gpus:
        shares.append(len(free_gpus(inv.gpus, held)) / len(inv.gpus))
    return max(0.0, min(shares))


def place(request: Resources, fleet: Fleet, *, avoid: str | None = None) -> Placement | NoFit:
    """The node for ``request``: one that fits (CPUs, memory, GPU count and per-GPU memory, its
    sandbox maximum), is neither cordoned, draining nor lost, is healthy (no problems, a fresh
    heartbeat), and is the least loaded (highest free fraction; ties by node id). ``avoid``:
    a node not to use (where the sandbox was just lost), unless it is the only one that fits.
    """
    fits: list[tuple[float, str]] = []
    reasons: dict[str, str] = {}
    for node_id, node in fleet.nodes.items():
        held = fleet.allocations.get(node_id, ())
        why = _usable(node, fleet) or _shortfalls(request, node, held)
        if why:
            reasons[node_id] = ", ".join(why)
        else:
            fits.append((free_fraction(node, held), node_id))
    if not fits:
        return NoFit(reasons)
    preferred = [f for f in fits if f[1] != avoid] or fits
    share, node_id = min(preferred, key=lambda f: (-f[0], f[1]))
    return Placement(node_id, f"least loaded of {len(fits)} fitting ({share:.0%} free)")


# --------------------------------------------------------------------------- the fold


def _epoch(value: Any) -> float | None:
    """Epoch seconds of an ISO time in a payload (None when absent or unreadable)."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class Seen:
    """One authentic event as the scheduler folds it."""

    id: str
    type: str
    aggregate_id: str
    tenant: str
    payload: Mapping[str, Any]
    stored_at: float
    """When the log stored it (JetStream's timestamp, epoch seconds)."""
    signed_at: float | None = None
    """The time its producer signed into it (epoch seconds), when known."""
    inventory: NodeInventory | None = None
    """A node event's inventory, validated already (its ``payload`` then holds none); else
    the fold validates ``payload["inventory"]``."""

    @property
    def sent_at(self) -> float:
        """When it was sent, as far as the log can tell: never later than the signed time (a
        replay is stored late but keeps its old signed time)."""
        return self.stored_at if self.signed_at is None else min(self.stored_at, self.signed_at)


@dataclass(frozen=True)
class Sandbox:
    """A sandbox from its ``env.built`` on: what it needs, where it is, whether it waits."""

    sandbox_id: str
    tenant: str
    life: Lifecycle
    env_built_id: str
    resources: Resources | None = None
    queued_at: float | None = None
    """When it began to wait for a node (pending, or lost and to be rescheduled)."""
    lost_on: str | None = None
    pending_attempt: int = 1
    """The attempt a ``sandbox.pending`` waits for."""
    pending_reason: str = ""
    """Why it waits, as last published."""
    pending_at: float = 0.0
    """When that reason was stored."""
    stop_requested: bool = False
    placed_at: float = 0.0
    """When its current placement (``sandbox.scheduled``) was stored."""

    @property
    def waiting(self) -> bool:
        """Whether it is in the queue: pending, or lost with ``action=reschedule``."""
        return self.life.state in {"pending", "lost"}

    @property
    def holds(self) -> str | None:
        """The node whose capacity it takes now."""
        return self.life.node_id if self.life.state in {"scheduled", "running"} else None

    @property
    def next_attempt(self) -> int:
        """The attempt number of its next placement."""
        if self.life.state == "lost":
            return self.life.attempt + 1
        return self.pending_attempt if self.life.state == "pending" else 1


_NODE_SEEN = {"node.joined", "node.heartbeat"}
NODE_SEEN_TYPES: frozenset[str] = frozenset(_NODE_SEEN)
"""Node presence: the latest of each type and node is all the fleet needs."""
_SANDBOX_TYPES = {
    "env.built",
    "sandbox.pending",
    "unit.placed",
    "sandbox.scheduled",
    "sandbox.ready",
    "unit.lost",
    "sandbox.exited",
    "sandbox.failed",
    "sandbox.stop_requested",
    *MIGRATION_TYPES,
}
NODE_TYPES: frozenset[str] = frozenset(
    {*_NODE_SEEN, "node.lost", "node.cordoned", *DEGRADED_TYPES, *HEALTH_TYPES}
)
"""Node events (presence, losses, cordons, degraded GPUs)."""
SANDBOX_TYPES: frozenset[str] = frozenset(_SANDBOX_TYPES)
"""Sandbox events, from ``env.built`` on: folded in full."""
FOLDED_TYPES: frozenset[str] = NODE_TYPES | SANDBOX_TYPES
"""The event types the scheduler's state is folded from."""


@dataclass
class SchedulerState:
    """The fleet and the queue, folded from authentic events in log order (pure, in memory).

    Decisions the scheduler publishes are applied at once as *tentative* (so a second decision
    does not use the same capacity) and confirmed or corrected when the log delivers them: the
    log is the truth, even when another replica's decision won the deduplication.
    """

    lost_after_s: float
    nodes: dict[str, Node] = field(default_factory=dict)
    sandboxes: dict[str, Sandbox] = field(default_factory=dict)
    _tentative: dict[str, tuple[str, str, Any]] = field(default_factory=dict)
    _ended: dict[str, None] = field(default_factory=dict)
    """Sandboxes seen failed or exited (insertion-ordered, bounded): an ``env.built`` that comes
    after the end (a builder's late or second one, a failure recorded before the build) never
    brings one back to the queue."""
    _held: dict[str, tuple[Resources, ...]] | None = None  # allocations, until a sandbox changes
    _awaiting_report: set[str] = field(default_factory=set)  # nodes whose next beat decides
    _counted: dict[str, tuple[tuple[UnitHeld, Resources], ...]] = field(default_factory=dict)
    """Sandbox → the units it holds capacity with now (each with its resources), as judged
    last (:meth:`_judge`); a sandbox is judged again only once something it depends on changed
    (:attr:`_stale`)."""
    _stale: set[str] = field(default_factory=set)
    """Sandboxes to judge again before the next count: an event of theirs, their node's report,
    the end of their assumed placement."""
    _all_stale: bool = True
    _hosts: dict[str, set[str]] = field(default_factory=dict)
    """Node → the sandboxes judged as placed on it (whose count its next report may change)."""
    _host_of: dict[str, str] = field(default_factory=dict)
    _assumed: list[tuple[float, str]] = field(default_factory=list)
    """A heap: when each placement judged as assumed stops being so (judged again then)."""
    _judged_at: float = float("-inf")
    """The latest clock a count was judged at (a clock stepped back: every sandbox again)."""
    _units: dict[str, dict[str, tuple[int, UnitHeld]]] = field(default_factory=dict)
    """Sandbox → unit → (attempt, allocation) from ``unit.placed`` (the latest attempt's)."""
    _held_units: tuple[UnitHeld, ...] = ()
    migrations: MigrationBook = field(default_factory=MigrationBook)
    """Migrations in flight (each holds its target) and the degraded GPUs."""
    degraded: DegradedGpus = field(default_factory=DegradedGpus)
    """GPUs that placed nothing new (``gpu.degraded`` until ``gpu.recovered``)."""

    # -- reading

    def fleet(self, now: float) -> Fleet:
        """The fleet now, with every sandbox's allocation on its node.

        Asked on every decision. Only the sandboxes something changed for are judged again
        (:meth:`_judge`: their own events, their node's report, the end of an assumed
        placement); the sums are made again from what each holds only after such a change, so
        a long queue that fits nowhere costs no recount per entry, and a decision costs what
        changed, not every sandbox of the fleet."""
        if now < self._judged_at:  # the clock stepped back: an expired placement may be assumed
            self._all_stale = True
        self._judged_at = now
        expiring = self._assumed
        while expiring and expiring[0][0] <= now:
            sid = heapq.heappop(expiring)[1]
            if not self._all_stale:
                self._stale.add(sid)
        if self._all_stale or self._stale:
            self._judge(now)
            self._held = None
        if self._held is None:
            held: dict[str, list[Resources]] = {}
            units: list[UnitHeld] = []
            counted = self._counted
            for sid in self.sandboxes:  # (in the sandboxes' order: the engine's sync keeps it)
                for unit, resources in counted.get(sid, ()):
                    held.setdefault(unit.node_id, []).append(resources)
                    units.append(unit)
            for reserved in self.migrations.reservations(self.sandboxes.keys()):
                held.setdefault(reserved.node_id, []).append(reserved.resources())
                units.append(reserved)
            self._held = {n: tuple(r) for n, r in held.items()}
            self._held_units = tuple(units)
        return Fleet(dict(self.nodes), self._held, now, self.lost_after_s, self._held_units)

    def _judge(self, now: float) -> None:
        """Judge again what the stale sandboxes hold (every sandbox after :attr:`_all_stale`):
        nothing unless placed with known resources and counted (:meth:`_counts`); the units of
        its current ``unit.placed``, or one unit of its resources."""
        if self._all_stale:
            stale: Iterable[str] = list(self.sandboxes)
            self._all_stale = False
            self._counted.clear()
            self._hosts.clear()
            self._host_of.clear()
            self._assumed.clear()
            self._awaiting_report = set()
        else:
            stale = self._stale
        self._stale = set()
        for sid in stale:
            was = self._host_of.pop(sid, None)
            if was is not None:
                on = self._hosts.get(was)
                if on is not None:
                    on.discard(sid)
                    if not on:
                        del self._hosts[was]
            sbx = self.sandboxes.get(sid)
            node = sbx.holds if sbx is not None else None
            if sbx is None or node is None or sbx.resources is None:
                self._counted.pop(sid, None)
                continue
            self._host_of[sid] = node
            self._hosts.setdefault(node, set()).add(sid)
            if sbx.placed_at + ASSUMED_S > now:
                heapq.heappush(self._assumed, (sbx.placed_at + ASSUMED_S, sid))
            if not self._counts(sbx, node, now):
                self._counted[sid] = ()
                continue
            placed = self._placed_now(sbx)
            if placed:
                self._counted[sid] = tuple((unit, unit.resources()) for unit in placed)
            else:  # placed as one unit (before units, or a test's sandbox)
                one = held_from_resources(sbx.sandbox_id, sbx.tenant, node, sbx.resources)
                self._counted[sid] = ((one, sbx.resources),)

    def _changed(self, sandbox_id: str) -> None:
        """What ``sandbox_id`` holds may have changed: judged again before the next count
        (remembered only when not every sandbox is judged then anyway: while the log is read
        at start-up, before the first count, no set of every sandbox id grows)."""
        if not self._all_stale:
            self._stale.add(sandbox_id)
        self._held = None

    def _reported(self, node_id: str) -> None:
        """What the node says runs there (or how recently it said it) changed: the sandboxes
        placed on it are judged again (:meth:`_counts` reads its report and its last word)."""
        self._awaiting_report.discard(node_id)
        for sid in self._hosts.get(node_id, ()):
            self._changed(sid)

    def units_of(self, sbx: Sandbox) -> list[UnitHeld]:
        """The units a placed sandbox holds: those its current attempt's ``unit.placed`` named
        (when they agree with its ``sandbox.scheduled``), else one unit ``main`` on its node."""
        node = sbx.holds
        if node is None or sbx.resources is None:
            return []
        return self._placed_now(sbx) or [
            held_from_resources(sbx.sandbox_id, sbx.tenant, node, sbx.resources)
        ]

    def _placed_now(self, sbx: Sandbox) -> list[UnitHeld]:
        """The units the current placement's ``unit.placed`` named, when its first unit is on
        the node ``sandbox.scheduled`` names (else: none, the sandbox counts as one unit)."""
        placed = [
            h
            for attempt, h in (self._units.get(sbx.sandbox_id) or {}).values()
            if attempt == sbx.life.attempt
        ]
        first = next((h for h in placed if h.unit == MAIN), placed[0] if placed else None)
        if first is None or first.node_id != sbx.holds:
            return []
        return placed

    def placed_units(self, sandbox_id: str) -> dict[str, UnitHeld]:
        """The units of a sandbox's latest ``unit.placed`` attempt (by unit name)."""
        return {u: h for u, (_, h) in (self._units.get(sandbox_id) or {}).items()}

    def _counts(self, sbx: Sandbox, node_id: str, now: float) -> bool:
        """Whether a placement holds capacity on its node now: while assumed (placed less than
        :data:`ASSUMED_S` ago), then only while the node's heartbeats report it."""
        if sbx.placed_at + ASSUMED_S > now:
            return True
        node = self.nodes.get(node_id)
        if node is None or node.reported is None or node.last_seen < sbx.placed_at + ASSUMED_S:
            self._awaiting_report.add(node_id)  # its next heartbeat decides: recount then
            return True  # nothing newer from the node to judge by
        return sbx.sandbox_id in node.reported

    def queue(self) -> list[Sandbox]:
        """Sandboxes waiting for a node, oldest first."""
        waiting = [s for s in self.sandboxes.values() if s.waiting and not s.stop_requested]
        return sorted(waiting, key=lambda s: (s.queued_at or 0.0, s.sandbox_id))

    def on_node(self, node_id: str) -> list[str]:
        """Sandboxes the node holds (scheduled there or running there)."""
        return sorted(s.sandbox_id for s in self.sandboxes.values() if s.holds == node_id)

    def evacuate(self) -> list[tuple[Node, list[str]]]:
        """Lost or draining nodes that still hold sandboxes, with those sandboxes (asked on
        every tick: the sandboxes are walked for the lost and draining nodes only, not for
        every node of the fleet)."""
        out = []
        for node_id in sorted(n for n, node in self.nodes.items() if node.lost or node.draining):
            held = self.on_node(node_id)
            if held:
                out.append((self.nodes[node_id], held))
        return out

    def silent(self, now: float, watching_since: float = 0.0) -> list[Node]:
        """Nodes silent longer than ``lost_after_s`` and not yet declared lost. Silence counts
        from ``watching_since`` at the earliest: a scheduler that just started gives every node
        a full period to be heard (its newest heartbeat in the log might not be readable)."""
        return [
            n
            for _, n in sorted(self.nodes.items())
            if not n.lost and now - max(n.last_seen, watching_since) > self.lost_after_s
        ]

    # -- folding

    def apply(self, event: Seen) -> bool:
        """Fold one authentic event from the log; True when a waiting sandbox may now fit."""
        undo = self._tentative.pop(event.id, None)
        if undo is not None:
            self._undo(undo)
        return self._fold(event)

    def tentative(self, event: Seen) -> None:
        """Apply a decision being published now; undone if the log holds another under its id
        (another replica's), or if it is withdrawn."""
        key = event.aggregate_id
        if event.type in MIGRATION_TYPES:
            mid = str(event.payload.get("migration_id"))
            was = self.migrations.active.get(mid)
            self._tentative[event.id] = ("migration", mid, (was, mid in self.migrations.ended))
        elif event.type == "unit.placed":
            unit = str(event.payload.get("unit"))
            before = (self._units.get(key) or {}).get(unit)
            self._tentative[event.id] = ("unit", f"{key}/{unit}", before)
        elif event.type in _SANDBOX_TYPES:
            self._tentative[event.id] = ("sandbox", key, self.sandboxes.get(key))
        else:
            self._tentative[event.id] = ("node", key, self.nodes.get(key))
        self._fold(event)

    def withdraw(self, event_id: str) -> None:
        """A decision that was not published after all: put the state back."""
        undo = self._tentative.pop(event_id, None)
        if undo is not None:
            self._undo(undo)

    def _undo(self, undo: tuple[str, str, Any]) -> None:
        kind, key, before = undo
        if kind == "migration":
            self._all_stale = True  # (rare: whatever the migration touched is judged again)
            self._held = None
            was, ended = before
            if was is None:
                self.migrations.active.pop(key, None)
            else:
                self.migrations.active[key] = was
            if not ended:
                self.migrations.ended.pop(key, None)
            return
        if kind == "unit":
            sid, _, unit = key.rpartition("/")
            self._changed(sid)
            placed = self._units.setdefault(sid, {})
            if before is None:
                placed.pop(unit, None)
            else:
                placed[unit] = before
            if not placed:
                self._units.pop(sid, None)
            return
        if kind == "node":
            now = self.nodes.get(key)
            if now is not None and before is not None:  # only the flags a decision sets
                self.nodes[key] = replace(
                    now, lost=before.lost, cordoned=before.cordoned, draining=before.draining
                )
            return
        self._changed(key)
        now_sbx = self.sandboxes.get(key)
        if before is None:
            self.sandboxes.pop(key, None)
            return
        stop = before.stop_requested or (now_sbx is not None and now_sbx.stop_requested)
        self.sandboxes[key] = replace(before, stop_requested=stop)

    def _fold(self, event: Seen) -> bool:
        if event.type in _NODE_SEEN:
            return self._node_seen(event)
        if event.type == "node.lost":
            old = self.nodes.get(str(event.payload.get("node_id") or event.aggregate_id))
            if old is None:
                return False
            heard = _epoch(event.payload.get("last_seen"))
            if heard is not None and heard < old.last_seen - 0.001:
                return False  # heard from since: an old loss published again
            if heard is not None and heard > old.last_seen:  # the state was rebuilt from less
                self.nodes[old.node_id] = old = replace(old, last_seen=heard)
                self._reported(old.node_id)  # (its last word is later: what it holds may change)
            return self._node_flag(event, lost=True, cordoned=old.cordoned, draining=old.draining)
        if event.type == "node.cordoned":
            p = event.payload
            old = self.nodes.get(str(p.get("node_id") or event.aggregate_id))
            if old is not None and event.signed_at is not None:
                if event.signed_at <= old.flagged_at:
                    return False  # signed before the cordon in force: an old one replayed
                self.nodes[old.node_id] = replace(old, flagged_at=event.signed_at)
            return self._node_flag(
                event, cordoned=bool(p.get("cordoned")), draining=bool(p.get("draining"))
            )
        if event.type in MIGRATION_TYPES:
            return self._migration(event)
        if event.type in DEGRADED_TYPES:
            node_id = str(event.payload.get("node_id") or "")
            if node_id != event.aggregate_id or node_id not in self.nodes:
                return False  # filed under another node's subject, or a node not joined
            changed = self.degraded.apply(event.type, event.payload, event.sent_at, event.id)
            # the migrations' own view: which GPUs no migration may go to
            back = self.migrations.health(event.type, event.payload, event.aggregate_id)
            return (changed and event.type == "gpu.recovered") or back
        if event.type in _SANDBOX_TYPES:
            return self._sandbox(event)
        return False

    def _migration(self, event: Seen) -> bool:
        """A migration started (its target reserved), ended on the target (the unit's
        allocation moves there, the source is released; the unit ``main`` takes the sandbox's
        node with it) or failed (the target released). The first end of one counts."""
        p, sid = event.payload, event.aggregate_id
        mid = str(p.get("migration_id") or "")
        book = self.migrations
        self._changed(sid)  # (and the reservations: the sums are made again)
        if event.type == "unit.migration_started":
            sbx = self.sandboxes.get(sid)
            if not mid or book.known(mid) or sbx is None:
                return False
            unit = str(p.get("unit") or MAIN)
            held = next((u for u in self.units_of(sbx) if u.unit == unit), None)
            book.active[mid] = started(p, sid, sbx.tenant, event.stored_at, held)
            return False
        if event.type == "unit.migration_failed":
            return book.end(mid, "failed") is not None if mid else False
        m = book.end(mid, "migrated")
        if m is None:
            return False  # not in flight: ended before (failed, timed out) or replayed
        sbx = self.sandboxes.get(sid)
        if sbx is None:
            return True
        placed = self._units.get(sid) or {}
        if m.unit in placed:
            attempt, h = placed[m.unit]
            placed[m.unit] = (attempt, replace(h, node_id=m.to_node, gpu_indices=m.to_gpus))
        if m.unit == MAIN:
            life = step(sbx.life, event.type, p, event_id=event.id)
            self.sandboxes[sid] = replace(sbx, life=life, placed_at=event.stored_at)
        return True

    def _node_seen(self, event: Seen) -> bool:
        p = event.payload
        node_id = str(p.get("node_id") or event.aggregate_id)
        if node_id != event.aggregate_id:
            return False  # filed under another node's subject: never read as that node's
        old = self.nodes.get(node_id)
        if old is not None and event.sent_at <= old.last_seen:
            return False  # sent before what is known already: a replay, never a sign of life
        inventory = event.inventory or NodeInventory.model_validate(p["inventory"])
        if event.type == "node.joined":  # a new node agent judges its GPUs afresh
            self.degraded.forget_node(node_id, event.sent_at)
        node = Node(
            node_id=node_id,
            inventory=inventory,
            last_seen=event.sent_at,
            heartbeat_s=float(p.get("heartbeat_s") or 5.0),
            last_event_id=event.id,
            problems=tuple(str(x) for x in p.get("problems") or ()),
            cordoned=old.cordoned if old else False,
            draining=old.draining if old else False,
            drain_event_id=old.drain_event_id if old else "",
            lost=False,
            flagged_at=old.flagged_at if old else 0.0,
            reported=(
                frozenset(str(x) for x in p["sandboxes"])
                if event.type == "node.heartbeat" and isinstance(p.get("sandboxes"), list)
                else (old.reported if old else None)
            ),
        )
        self.nodes[node_id] = node
        if old is None or old.reported != node.reported or node_id in self._awaiting_report:
            # what the node says runs there changed, or now decides: its sandboxes judged again
            self._reported(node_id)
        if old is None:
            return True
        # Returning, heard from again, healthier or larger: the queue may move.
        stale = event.sent_at - old.last_seen > 3 * old.heartbeat_s
        return stale or old.lost or old.problems != node.problems or old.inventory != inventory

    def _node_flag(
        self, event: Seen, *, lost: bool = False, cordoned: bool, draining: bool
    ) -> bool:
        node_id = str(event.payload.get("node_id") or event.aggregate_id)
        old = self.nodes.get(node_id)
        if old is None:
            return False
        drain_id = old.drain_event_id if old.draining else event.id
        new = replace(
            old,
            lost=lost or old.lost,
            cordoned=cordoned,
            draining=draining,
            drain_event_id=drain_id if draining else "",
        )
        self.nodes[node_id] = new
        return old.cordoned and not new.cordoned

    def _remember_end(self, sandbox_id: str) -> None:
        self._ended[sandbox_id] = None
        while len(self._ended) > ENDED_MEMORY:
            self._ended.pop(next(iter(self._ended)))

    def _sandbox(self, event: Seen) -> bool:
        sid, p = event.aggregate_id, event.payload
        self._changed(sid)
        sbx = self.sandboxes.get(sid)
        moved_on = event.type == "sandbox.exited" and p.get("reason") == "migrated"
        if (event.type in {"sandbox.failed", "sandbox.exited"} and not moved_on) or (
            event.type == "unit.lost" and p.get("action") == "fail"
        ):
            self._remember_end(sid)
        if event.type == "unit.placed":
            attempt = int(p.get("attempt") or 1)
            if sbx is None or attempt < sbx.life.attempt:
                return False  # for a placement that is over (or a sandbox not built)
            placed = self._units.setdefault(sid, {})
            if any(a > attempt for a, _ in placed.values()):
                return False  # an older attempt's, replayed: never replaces a newer unit
            if any(a < attempt for a, _ in placed.values()):
                placed.clear()  # a new attempt: the old one's units are gone
            placed[str(p["unit"])] = (attempt, held_from_placed(p, sbx.tenant))
            return False
        if event.type == "env.built":
            if sbx is not None or sid in self._ended:
                return False
            # The fold starts where the scheduler's part does: an authentic env.built follows
            # deps.resolved, so the sandbox was ``resolved`` before it.
            start = Lifecycle(state="resolved", tenant=event.tenant)
            life = step(start, event.type, p, event_id=event.id)
            self.sandboxes[sid] = Sandbox(sid, event.tenant, life, event.id)
            return False
        if sbx is None:
            return False
        if event.type == "sandbox.stop_requested":
            self.sandboxes[sid] = replace(sbx, stop_requested=True)
            return False
        life = step(sbx.life, event.type, p, event_id=event.id)
        if life.last_event_id == sbx.life.last_event_id:
            return False  # refused by the fold (or a fact): nothing moved
        freed = sbx.holds is not None and life.state not in {"scheduled", "running"}
        if life.terminal:
            del self.sandboxes[sid]
            self._units.pop(sid, None)
            return freed
        changes: dict[str, Any] = {"life": life}
        if p.get("resources") is not None:
            changes["resources"] = Resources.model_validate(p["resources"])
        if life.state in {"pending", "lost"} and not sbx.waiting:
            changes["queued_at"] = event.stored_at
        if event.type == "unit.lost":
            changes["lost_on"] = str(p.get("node_id"))
        if event.type == "sandbox.scheduled":
            changes["placed_at"] = event.stored_at
        if event.type == "sandbox.pending":
            changes["pending_attempt"] = int(p.get("attempt") or 1)
            changes["pending_reason"] = str(p.get("reason") or "")
            changes["pending_at"] = event.stored_at
        self.sandboxes[sid] = replace(sbx, **changes)
        return freed or life.state == "lost"
