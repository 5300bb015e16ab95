"""Migration of running compute units: the scheduler's side (docs/migration.md, "Control plane").

A unit moves when an operator asks (``unit.migration_requested``, operator-signed, ``to_node``
optional) or when the GPU it runs on degrades (``gpu.degraded``: every unit on that GPU whose
spec allows it). The scheduler

1. chooses the target with the same placement engine and policy as any placement, the source
   node and degraded GPUs excluded (``to_node``: that node only, or a clear refusal);
2. reserves the target's resources (a unit ``<unit>~migrating`` held on the target, so nothing
   else is placed there meanwhile) and publishes ``unit.migration_started`` with the path the
   node agents take (``handover`` for a spec with a state-plane section, else ``criu``);
3. on ``unit.migrated`` (from the target's node agent) moves the unit's allocation to the target
   and releases the source; on ``unit.migration_failed`` (either end) releases the target; with
   no answer within :data:`TIMEOUT_S` it publishes ``unit.migration_failed{stage: timeout}``
   itself. The first terminal event of a migration wins; node agents abort on a failure.

Every request ends in exactly one terminal event (ids derived from the request: a replayed
request, or a second replica, publishes the same ids). A storm of ``gpu.degraded`` starts one
migration per unit: a unit already moving is not moved again.

:class:`MigrationBook` is the pure part (folded from the log by
:class:`~dsec_scheduler.domain.SchedulerState`); :class:`Migrator` decides and publishes.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Container, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from dsec_core.envelope import Envelope
from dsec_core.events import (
    GpuDegraded,
    MigrationFailedStage,
    MigrationPath,
    MigrationReason,
    Payload,
    UnitMigrationFailed,
    UnitMigrationRequested,
    UnitMigrationStarted,
)
from dsec_core.ids import answer_event_id, derive_event_id, earlier_answer_ids
from dsec_core.service import HANDLING_SEQ
from dsec_core.subjects import subject_for

from dsec_scheduler.gangs import UnitHeld
from dsec_scheduler.placement.api import GangDemand, GangPlacement, NodeSpec, Unfit

if TYPE_CHECKING:
    from dsec_scheduler.app import Scheduler

log = logging.getLogger(__name__)

STARTED = "unit.migration_started"
MIGRATED = "unit.migrated"
FAILED = "unit.migration_failed"
MIGRATION_TYPES: frozenset[str] = frozenset({STARTED, MIGRATED, FAILED})
"""The migration events the scheduler folds (sandbox aggregate)."""
HEALTH_TYPES: frozenset[str] = frozenset({"gpu.degraded", "gpu.recovered"})
"""GPU health the scheduler folds (node aggregate): which GPUs no migration may go to."""
RESERVED = "~migrating"
"""Suffix of the unit name a migration's target reservation is held under."""
TIMEOUT_S = float(os.environ.get("DSEC_MIGRATION_TIMEOUT_S") or 120.0)
"""A started migration with no ``unit.migrated``/``unit.migration_failed`` after this long
fails (``stage: timeout``) and its target reservation is released."""
ENDED_KEPT = 10_000
REFUSAL_QUIET_S = 60.0
"""An automatic migration that found no target is not tried (nor refused) again for this unit
within this long: a GPU whose health flaps does not fill the log with refusals."""


@dataclass(frozen=True)
class Migration:
    """One migration in flight, as its ``unit.migration_started`` said."""

    migration_id: str
    sandbox_id: str
    unit: str
    tenant: str
    from_node: str
    to_node: str
    from_gpus: tuple[int, ...]
    to_gpus: tuple[int, ...]
    reason: str
    path: str
    started_at: float
    target: UnitHeld | None
    """The reservation held on the target (None: the unit's allocation was not known)."""


@dataclass
class MigrationBook:
    """Migrations in flight, those that ended (bounded), and the degraded GPUs (pure)."""

    active: dict[str, Migration] = field(default_factory=dict)
    ended: OrderedDict[str, str] = field(default_factory=OrderedDict)
    """migration id -> ``migrated`` or ``failed`` (the first terminal event's outcome)."""
    degraded: dict[tuple[str, int], str] = field(default_factory=dict)
    """(node, GPU index) -> the signal that degraded it, from ``gpu.degraded`` until its
    ``gpu.recovered`` (a minimal view for choosing targets)."""

    def known(self, migration_id: str) -> bool:
        return migration_id in self.active or migration_id in self.ended

    def of_unit(self, sandbox_id: str, unit: str) -> Migration | None:
        for m in self.active.values():
            if m.sandbox_id == sandbox_id and m.unit == unit:
                return m
        return None

    def end(self, migration_id: str, outcome: str) -> Migration | None:
        """Record the first terminal event of a migration; the one that was in flight."""
        if migration_id in self.ended:
            return None
        self.ended[migration_id] = outcome
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)
        return self.active.pop(migration_id, None)

    def reservations(self, alive: Container[str]) -> list[UnitHeld]:
        """Targets held for migrations of sandboxes that are still alive (``alive``: a set or
        a mapping's keys, not copied: this is asked on every recount)."""
        return [
            m.target for m in self.active.values() if m.target is not None and m.sandbox_id in alive
        ]

    def health(self, event_type: str, payload: Mapping[str, Any], node_id: str) -> bool:
        """Fold ``gpu.degraded``/``gpu.recovered``; True when a GPU came back."""
        try:
            key = (str(payload.get("node_id") or node_id), int(payload["gpu_index"]))
        except (KeyError, TypeError, ValueError):
            return False
        if event_type == "gpu.degraded":
            self.degraded[key] = str(payload.get("signal") or "degraded")
            return False
        return self.degraded.pop(key, None) is not None

    def degraded_on(self, node_id: str) -> set[int]:
        return {g for n, g in self.degraded if n == node_id}


def started(payload: Mapping[str, Any], sandbox_id: str, tenant: str, at: float,
            held: UnitHeld | None) -> Migration:  # fmt: skip
    """A ``unit.migration_started`` payload as the migration in flight (``held``: the unit's
    allocation on the source, reserved on the target with the target's GPUs)."""
    unit = str(payload.get("unit") or "main")
    to_node = str(payload["to_node"])
    to_gpus = tuple(int(i) for i in payload.get("to_gpus") or ())
    target = None
    if held is not None:
        target = replace(held, unit=f"{unit}{RESERVED}", node_id=to_node, gpu_indices=to_gpus)
    return Migration(
        migration_id=str(payload["migration_id"]),
        sandbox_id=sandbox_id,
        unit=unit,
        tenant=tenant,
        from_node=str(payload["from_node"]),
        to_node=to_node,
        from_gpus=tuple(int(i) for i in payload.get("from_gpus") or ()),
        to_gpus=to_gpus,
        reason=str(payload.get("reason") or "operator"),
        path=str(payload.get("path") or "criu"),
        started_at=at,
        target=target,
    )


# --------------------------------------------------------------------------- the spec


def _section(plan: Mapping[str, Any]) -> Mapping[str, Any] | bool | None:
    """The spec's migration section, wherever the plan has it (read defensively: the
    section's fields grow; a plan compiled before it has none)."""
    for where in (plan.get("migration"), (plan.get("topology") or {}).get("migration")):
        if where is False or isinstance(where, Mapping):
            return where
    return None


def allows(plan: Mapping[str, Any], reason: str, signal: str | None = None) -> bool:
    """Whether the spec lets the scheduler move its units for ``reason`` (an operator's
    request always may). Default: migrate on ``gpu_degraded``; ``migration: {on: [...]}``
    names the reasons or GPU signals that do (``gpu_degraded``, ``temperature``, ``xid``...),
    ``enabled: false`` or ``on: []`` none."""
    if reason == "operator":
        return True
    section = _section(plan)
    if section is False:
        return False
    if not isinstance(section, Mapping):
        return reason == "gpu_degraded"
    if section.get("enabled") is False:
        return False
    on = section.get("on")
    if not isinstance(on, list | tuple):
        return reason == "gpu_degraded"
    names = {str(x).replace(".", "_") for x in on}
    return reason in names or (signal is not None and signal in names)


def drain_migrates(plan: Mapping[str, Any]) -> bool:
    """Whether a drain moves the unit live instead of restarting it elsewhere: when it would be
    handed over (its state lives in the state plane, and its ``migration.paths`` allow
    ``handover``). The new copy starts as any sandbox does, every isolation layer on, and takes
    the state. Others restart on another node, as a drain always did (CRIU would carry the
    process but not its Landlock domain: docs/migration.md)."""
    section = _section(plan)
    if section is False or (isinstance(section, Mapping) and section.get("enabled") is False):
        return False
    return path_for(plan) == "handover"


def path_for(plan: Mapping[str, Any]) -> MigrationPath:
    """How the node agents move the unit: ``handover`` when the spec keeps its state in the
    state plane (a ``state:`` section), else ``criu``; a section's ``paths`` list narrows it
    (``restart`` when it names only that)."""
    preferred: list[MigrationPath] = ["handover", "criu"] if plan.get("state") else ["criu"]
    section = _section(plan)
    paths = section.get("paths") if isinstance(section, Mapping) else None
    if isinstance(paths, list | tuple) and paths:
        allowed = {str(p) for p in paths}
        for p in preferred:
            if p in allowed:
                return p
        if "restart" in allowed:
            return "restart"
    return preferred[0]


# --------------------------------------------------------------------------- deciding


class Refused(Exception):
    """A migration that cannot start (its ``unit.migration_failed`` says why)."""

    def __init__(self, reason: str, *, still_running: bool = True, from_node: str | None = None,
                 to_node: str | None = None) -> None:  # fmt: skip
        super().__init__(reason)
        self.reason = reason[:500]
        self.still_running = still_running
        self.from_node = from_node
        self.to_node = to_node


class Migrator:
    """The scheduler's migration decisions, published through its :meth:`Scheduler._decide`."""

    def __init__(self, scheduler: Scheduler, timeout_s: float = TIMEOUT_S) -> None:
        self.s = scheduler
        self.timeout_s = timeout_s
        self._quiet: dict[tuple[str, str], float] = {}

    @property
    def book(self) -> MigrationBook:
        return self.s.state.migrations

    # -- handlers

    async def on_requested(
        self, envelope: Envelope, request: UnitMigrationRequested
    ) -> list[Payload]:
        """An operator's request: start the migration, or refuse it (always a terminal event
        in the end)."""
        await self.s.barrier(upto=HANDLING_SEQ.get())
        mid = answer_event_id(envelope.type, envelope.id, "migration", key_id=envelope.key_id)
        # (or under an id an earlier release derived)
        earlier = earlier_answer_ids(envelope.type, envelope.id, "migration")
        if any(self.book.known(known) for known in (mid, *earlier)):
            return []  # handled before (a redelivery, a restart, another replica)
        async with self.s._deciding:
            await self._start(
                envelope.aggregate_id,
                request.unit,
                mid=mid,
                reason=request.reason,
                to_node=request.to_node,
                causation=envelope,
                detail=f"requested by {request.requested_by}"[:500] if request.requested_by else "",
            )
        return []

    async def on_degraded(self, envelope: Envelope, degraded: GpuDegraded) -> list[Payload]:
        """A degraded GPU: move every unit on it whose spec allows it (one migration a unit,
        however many ``gpu.degraded`` arrive)."""
        await self.s.barrier(upto=HANDLING_SEQ.get())
        node, gpu = degraded.node_id, degraded.gpu_index
        self.book.degraded[(node, gpu)] = degraded.signal  # (the fold has it too, by now)
        fleet = self.s.state.fleet(time.time())
        on_gpu = [
            u
            for u in fleet.units
            if u.node_id == node and gpu in u.gpu_indices and not u.unit.endswith(RESERVED)
        ]
        for held in sorted(on_gpu, key=lambda u: u.key):
            if self.book.of_unit(held.sandbox_id, held.unit) is not None:
                continue  # already moving
            quiet = self._quiet.get((held.sandbox_id, held.unit), 0.0)
            if time.monotonic() - quiet < REFUSAL_QUIET_S:
                continue
            plan = await self._plan(held.sandbox_id)
            if not allows(plan, "gpu_degraded", degraded.signal):
                log.info("scheduler: %s stays on degraded %s/%d (its spec)", held.key, node, gpu)
                continue
            mid = derive_event_id(envelope.id, f"migration/{held.key}")
            if self.book.known(mid):
                continue
            async with self.s._deciding:
                if self.book.of_unit(held.sandbox_id, held.unit) is not None:
                    # moving since the look above: another reading of this storm, handled
                    # meanwhile (while this one read the plan), started it
                    continue
                ok = await self._start(
                    held.sandbox_id,
                    held.unit,
                    mid=mid,
                    reason="gpu_degraded",
                    to_node=None,
                    causation=envelope,
                    detail=f"GPU {gpu} of {node}: {degraded.signal} {degraded.value:g} "
                    f"(threshold {degraded.threshold:g})",
                    plan=plan,
                )
            if not ok:
                self._quiet[(held.sandbox_id, held.unit)] = time.monotonic()
        return []

    async def for_drain(self, node_id: str, drain_event_id: str, sandbox_id: str) -> bool:
        """A draining node's sandbox: start moving it live when its spec allows
        (:func:`drain_migrates`) and it is one unit, all on that node. True while that
        migration is in flight or was just started; False when the drain must restart it
        elsewhere instead (not movable, no target, or the migration this drain started for it
        failed and it still runs there)."""
        sbx = self.s.state.sandboxes.get(sandbox_id)
        if sbx is None or sbx.holds != node_id:
            return False
        units = self.s.state.units_of(sbx)
        if len(units) != 1 or units[0].node_id != node_id:
            return False
        unit = units[0].unit
        if self.book.of_unit(sandbox_id, unit) is not None:
            return True  # moving (this drain's migration, or another's)
        mid = derive_event_id(drain_event_id, f"migration/{sandbox_id}/{unit}")
        if self.book.known(mid):
            return False  # this drain tried, it failed, and it still runs here: restart it
        plan = await self._plan(sandbox_id)
        if not drain_migrates(plan):
            return False
        causation = await self.s._gate().find(subject_for("node.cordoned", node_id))
        if causation is None:
            return False
        async with self.s._deciding:
            return await self._start(
                sandbox_id,
                unit,
                mid=mid,
                reason="drain",
                to_node=None,
                causation=causation,
                detail=f"node {node_id} drained",
                plan=plan,
            )

    async def on_node_lost(self, node_id: str) -> None:
        """A node was declared lost: every migration from or to it ends now (``failed``), so
        its target's reservation is released and a unit lost with its source is restarted
        elsewhere (``unit.lost``) instead of also being handed over: never two copies."""
        for m in list(self.book.active.values()):
            if node_id not in (m.from_node, m.to_node):
                continue
            source_lost = m.from_node == node_id
            why = (
                f"its source {node_id} was lost during the migration; the unit is restarted "
                "elsewhere"
                if source_lost
                else f"its target {node_id} was lost; the unit stays on {m.from_node}"
            )
            await self._end_failed(
                m, why, "transfer" if source_lost else "restore", still_running=not source_lost
            )

    async def tick(self, now: float) -> None:
        """Migrations that got no answer in time, or whose sandbox ended: failed."""
        for m in list(self.book.active.values()):
            gone = m.sandbox_id not in self.s.state.sandboxes
            if not gone and now - m.started_at <= self.timeout_s:
                continue
            stage: MigrationFailedStage
            if gone:
                why = "the sandbox ended during its migration"
                stage, running = "resume", False
            else:
                why = (
                    f"no answer from {m.to_node} within {self.timeout_s:g} s; the unit stays "
                    f"on {m.from_node} and the reservation on {m.to_node} is released"
                )
                stage, running = "timeout", True
            await self._end_failed(m, why, stage, still_running=running)

    async def _end_failed(
        self, m: Migration, why: str, stage: MigrationFailedStage, *, still_running: bool
    ) -> None:
        """End a started migration as failed (the id is the migration's: the first end wins)."""
        await self.s._decide(
            UnitMigrationFailed(
                unit=m.unit,
                migration_id=m.migration_id,
                from_node=m.from_node,
                to_node=m.to_node,
                reason=why,
                stage=stage,
                still_running=still_running,
            ),
            aggregate_id=m.sandbox_id,
            event_id=derive_event_id(m.migration_id, FAILED),
            tenant=m.tenant,
        )

    # -- choosing

    async def _plan(self, sandbox_id: str) -> dict[str, Any]:
        validated = None
        try:
            validated = await self.s._gate().find(subject_for("spec.validated", sandbox_id))
        except Exception:  # unreadable: the defaults apply
            log.warning("scheduler: no readable plan for %s", sandbox_id)
        plan = validated.payload.get("plan") if validated is not None else None
        return dict(plan) if isinstance(plan, Mapping) else {}

    async def _start(
        self,
        sandbox_id: str,
        unit: str,
        *,
        mid: str,
        reason: MigrationReason,
        to_node: str | None,
        causation: Envelope,
        detail: str = "",
        plan: dict[str, Any] | None = None,
    ) -> bool:
        """Choose, reserve and publish ``unit.migration_started``, or publish why not."""
        sbx = self.s.state.sandboxes.get(sandbox_id)
        tenant = sbx.tenant if sbx is not None else causation.tenant
        try:
            # (``scheduled`` too: a restarted scheduler's fold has a migrated sandbox there, its
            # old node's sandbox.ready judged against the node it runs on now)
            if sbx is None or sbx.holds is None:
                state = sbx.life.state if sbx is not None else "not known to the scheduler"
                raise Refused(
                    f"sandbox {sandbox_id} is not running ({state}): only a running unit moves",
                    still_running=False,
                )
            units = {u.unit: u for u in self.s.state.units_of(sbx)}
            held = units.get(unit)
            if held is None:
                raise Refused(
                    f"sandbox {sandbox_id} has no unit {unit!r}; its units: "
                    + ", ".join(sorted(units))
                )
            other = self.book.of_unit(sandbox_id, unit)
            if other is not None and other.migration_id == mid:
                # this very migration, started by a caller that got here first (evacuate()
                # runs from the cordon handler and the watch tick): not a refusal, which
                # would end it under its own id
                return True
            if other is not None:
                raise Refused(
                    f"unit {unit} of {sandbox_id} is already moving to {other.to_node} "
                    f"(migration {other.migration_id})",
                    from_node=held.node_id,
                )
            if to_node is not None and to_node == held.node_id:
                raise Refused(
                    f"unit {unit} already runs on {to_node}: name another node",
                    from_node=held.node_id,
                    to_node=to_node,
                )
            if to_node is not None and to_node not in self.s.state.nodes:
                raise Refused(
                    f"node {to_node} has not joined", from_node=held.node_id, to_node=to_node
                )
            if plan is None:
                plan = await self._plan(sandbox_id)
            gang = await self.s._demand(sbx)
            demand = next((u for u in gang.units if u.key == held.key), None) or held.demand()
            one = GangDemand(
                f"{sandbox_id}{RESERVED}",
                (replace(demand, key=f"{held.key}{RESERVED}"),),
                team=sbx.tenant,
            )
            decision = self._choose(one, held.node_id, to_node)
            if isinstance(decision, Unfit):
                where = f"{to_node} cannot take" if to_node else "no node can take"
                raise Refused(
                    f"{where} unit {unit} of {sandbox_id}: {decision.summary()}; it stays on "
                    f"{held.node_id}",
                    from_node=held.node_id,
                    to_node=to_node,
                )
        except Refused as refused:
            await self.s._decide(
                UnitMigrationFailed(
                    unit=unit[:128],
                    migration_id=mid,
                    from_node=refused.from_node,
                    to_node=refused.to_node,
                    reason=refused.reason,
                    stage="choose",
                    still_running=refused.still_running,
                ),
                aggregate_id=sandbox_id,
                # from the migration's id, unique per unit and request: one cause (a degraded
                # GPU, a drain) may move units of the same name in several sandboxes
                event_id=derive_event_id(mid, f"{FAILED}/choose"),
                tenant=tenant,
                causation=causation,
            )
            log.info("scheduler: migration %s refused: %s", mid, refused.reason)
            return False
        choice = decision.choices[0]
        path = path_for(plan)
        await self.s._decide(
            UnitMigrationStarted(
                unit=unit,
                migration_id=mid,
                from_node=held.node_id,
                to_node=choice.node_id,
                from_gpus=list(held.gpu_indices),
                to_gpus=list(choice.gpu_indices),
                reason=reason,
                path=path,
                detail=(
                    (f"{detail}; " if detail else "")
                    + f"{decision.policy or self.s.policy}: {choice.feasible_nodes} of "
                    f"{decision.nodes_total} nodes fit"
                )[:500],
            ),
            aggregate_id=sandbox_id,
            event_id=derive_event_id(mid, STARTED),
            tenant=sbx.tenant,
            causation=causation,
        )
        log.info(
            "scheduler: migrating %s from %s to %s (%s, %s)",
            held.key,
            held.node_id,
            choice.node_id,
            reason,
            path,
        )
        return True

    def _choose(self, gang: GangDemand, source: str, to_node: str | None) -> GangPlacement | Unfit:
        """The engine's choice for the moving unit: never its source node, nor a degraded GPU;
        only ``to_node`` when named. The engine's nodes are put back afterwards."""
        self.s._sync(self.s.state.fleet(time.time()))
        sync = self.s.engine
        changed: list[NodeSpec] = []
        try:
            for node_id in sorted(self.s._specs):
                spec = sync.node(node_id)
                if spec is None:
                    continue
                new = spec
                if node_id == source:
                    new = replace(spec, schedulable=False, unschedulable_reason="migration source")
                elif to_node is not None and node_id != to_node and spec.schedulable:
                    new = replace(spec, schedulable=False, unschedulable_reason="not the target")
                bad = self.book.degraded_on(node_id)
                if bad and new.schedulable:
                    new = replace(
                        new,
                        gpus=tuple(
                            replace(g, healthy=False) if g.index in bad else g for g in new.gpus
                        ),
                    )
                if new is not spec:
                    changed.append(spec)
                    sync.set_node(new)
            return sync.engine.place(gang)
        finally:
            for spec in changed:
                sync.set_node(spec)
