"""Wiring of the scheduler service: the fleet and the queue from the log, placement decisions
as events, loss detection, and the read-model projector (specs and sandboxes in Postgres).

State: one ordered, ephemeral JetStream consumer per process follows the node events and the
sandbox lifecycle from the start of the stream, each message through the trust gate, folded
into :class:`~dsec_scheduler.domain.SchedulerState`. The durable handlers (``env.built``,
``node.cordon_requested``, ``sandbox.stop_requested``) act only once the fold has caught up
with the log as it was when their message arrived (:meth:`Scheduler.barrier`).

Idempotency: every decision's id is derived from the event it follows (the sandbox's latest
lifecycle event, the node's last heartbeat, the operator's request), so a restarted scheduler, or
a second replica deciding from the same log, publishes the same id, and JetStream stores it once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import nats.errors
import nats.js.errors
from dsec_core import metrics as core_metrics
from dsec_core.envelope import Envelope
from dsec_core.events import (
    GpuDegraded,
    NodeCordoned,
    NodeCordonRequested,
    NodeInventory,
    NodeLost,
    Payload,
    SandboxExited,
    SandboxFailed,
    SandboxPending,
    SandboxScheduled,
    UnitLost,
    UnitMigrationRequested,
    UnitPlaced,
)
from dsec_core.identity import SYSTEM_TENANT
from dsec_core.ids import answer_event_id, derive_event_id
from dsec_core.projections import LiveState, Projector, watch_live_states
from dsec_core.service import HANDLING_SEQ, Output, Service
from dsec_core.settings import Settings
from dsec_core.subjects import STREAM, filter_for, subject_for
from dsec_core.trust import Gate, unpack_fields
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from dsec_scheduler import metrics
from dsec_scheduler.domain import (
    FOLDED_TYPES,
    NODE_SEEN_TYPES,
    NODE_TYPES,
    SANDBOX_TYPES,
    Fleet,
    Node,
    NoFit,
    Sandbox,
    SchedulerState,
    Seen,
    place,
    reason_shape,
    resources_from_plan,
    usable,
    verdict_until,
)
from dsec_scheduler.engines import make_engine
from dsec_scheduler.gangs import (
    MAIN,
    EngineSync,
    Waiting,
    blocks,
    demand_gpus,
    gang_demand,
    load_quotas,
    node_spec,
    ordered,
    quota_refusal,
    unit_counts,
    unit_name,
    unschedulable_class,
    usage,
)
from dsec_scheduler.migration import Migrator
from dsec_scheduler.placement.api import GangDemand, GangPlacement, Unfit
from dsec_scheduler.placement.simple import SimpleEngine

log = logging.getLogger(__name__)

STOP_ROUNDS = 10
STOP_ROUND_S = 0.5

FILTERS: list[str] = sorted({filter_for(t) for t in FOLDED_TYPES})
NODE_FILTERS: list[str] = sorted({filter_for(t) for t in NODE_SEEN_TYPES})
NODE_FLAG_FILTERS: list[str] = sorted({filter_for(t) for t in NODE_TYPES - NODE_SEEN_TYPES})
SANDBOX_FILTERS: list[str] = sorted({filter_for(t) for t in SANDBOX_TYPES})
IDLE_S = 0.2
UNAVAILABLE_S = 30.0
"""How long the start-up read waits out a JetStream answering "service unavailable"."""
BARRIER_TIMEOUT_S = 20.0
SWEEP_S = 5.0
"""The queue is also tried this often while anything waits."""
REASON_EVERY_S = 10.0
"""A pending sandbox's changed reason is published at most this often."""
REASON_MAX = 4400
"""A pending reason's characters at most (the per-node detail is bounded before)."""
DEMANDS_KEPT = 100_000
FIT_JUDGED_EVERY_S = 30.0
"""How often whether the head of the queue could fit an empty fleet is judged again."""


class Scheduler:
    """The scheduler's state and decisions, bound to a running :class:`Service`."""

    def __init__(self, service: Service) -> None:
        self.service = service
        settings = service.settings
        self.max_placements = settings.max_placements
        self.state = SchedulerState(lost_after_s=settings.node_lost_s)
        self.tick_s = min(1.0, settings.node_lost_s / 4)
        self._pos = 0  # stream sequence of the last message folded
        self._refused_seqs: dict[int, None] = {}  # refused positions counted (bounded, ordered)
        self._watching_since = 0.0  # when the rebuild ended
        self._last_sweep = 0.0
        self._idle_rounds = 0  # times the follower found nothing left to read
        self._progress = asyncio.Condition()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.follow_problem: str | None = None
        """Why the state is not following the log now (``/healthz``), or None."""
        self.engine = EngineSync(make_engine(settings.scheduler_policy))
        self.quotas = load_quotas(settings.scheduler_quotas)
        self._demands: dict[str, GangDemand] = {}  # what each waiting sandbox asks (its plan)
        # A hand-over's new sandbox -> the sandbox it takes over from (its spec.submitted).
        self._handovers: dict[str, str] = {}
        self._pending_class: dict[str, str] = {}  # sandbox -> class of its published wait
        self._blocker: Waiting | None = None  # a head of the queue no backfill may pass
        self._specs: dict[str, _Spec] = {}  # node -> its engine spec, and while it holds
        self._empty: tuple[tuple[int, ...], SimpleEngine, list[Any]] | None = None
        self._deciding = asyncio.Lock()
        """Held from a decision's reading of the state to its events' publication: the queue
        and an ``env.built`` never decide from a state without the other's placement (two
        sandboxes of a team would each pass its quota)."""
        self._fit_judged: tuple[str, float, bool] | None = None  # head, when, could it fit
        self.migrator = Migrator(self)

    # ------------------------------------------------------------------ following the log

    def _js(self) -> JetStreamContext:
        assert self.service.nc is not None
        return self.service.nc.jetstream()

    def _gate(self) -> Gate:
        assert self.service.gate is not None
        return self.service.gate

    async def start(self) -> None:
        """Fold the log up to now, then keep following it, placing and watching for losses."""
        started = time.perf_counter()
        last = (await self._js().stream_info(STREAM)).state.last_seq
        if last:
            # Each node's latest joined/heartbeat is all its presence needs (a day of heartbeats
            # is not read again); its losses and cordons (rare) and sandboxes are folded in
            # full, so an old cordon or loss published again last is not taken for the latest.
            nodes = await self._read_up_to(NODE_FILTERS, last, DeliverPolicy.LAST_PER_SUBJECT)
            nodes += await self._read_up_to(NODE_FLAG_FILTERS, last, DeliverPolicy.ALL)
            for seen in sorted(nodes, key=lambda pair: pair[0]):
                self._fold(seen[1])
            for seen in await self._read_up_to(SANDBOX_FILTERS, last, DeliverPolicy.ALL):
                self._fold(seen[1])
        self._pos = last
        self._watching_since = time.time()
        log.info(
            "scheduler: state rebuilt from the log up to sequence %d in %.2f s: %d nodes, "
            "%d sandboxes, %d waiting",
            last,
            time.perf_counter() - started,
            len(self.state.nodes),
            len(self.state.sandboxes),
            len(self.state.queue()),
        )
        self._wake.set()
        self._tasks.append(asyncio.create_task(self._follow(), name="scheduler-follow"))
        self._tasks.append(asyncio.create_task(self._place_forever(), name="scheduler-place"))
        self._tasks.append(asyncio.create_task(self._watch_forever(), name="scheduler-watch"))

    async def stop(self) -> None:
        """Stop following and deciding.

        A cancel can be lost: on Python 3.11, ``asyncio.wait_for`` (nats-py's fetch uses it)
        swallows a cancel that arrives as its inner call completes, and the loop reads on.
        So cancel again until the tasks end, within a bound (a shutdown hung on it until the
        SIGKILL after the grace period)."""
        pending = {task for task in self._tasks if not task.done()}
        for _ in range(STOP_ROUNDS):
            if not pending:
                break
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=STOP_ROUND_S)
        for task in pending:
            log.warning("scheduler: %s did not stop", task.get_name())
        for task in self._tasks:
            if task.done() and not task.cancelled() and task.exception() is not None:
                log.warning("scheduler: %s had failed: %s", task.get_name(), task.exception())
        self._tasks.clear()

    async def _read_up_to(
        self, filters: list[str], last: int, policy: DeliverPolicy
    ) -> list[tuple[int, Seen | None]]:
        """The messages on ``filters`` up to stream sequence ``last``, gate-checked, in the
        order delivered (``None`` for one the gate refused)."""
        config = ConsumerConfig(
            deliver_policy=policy,
            ack_policy=AckPolicy.NONE,
            filter_subjects=filters,
            inactive_threshold=30.0,
            mem_storage=True,
        )
        out: list[tuple[int, Seen | None]] = []
        sub = await self._js().pull_subscribe("", stream=STREAM, config=config)
        # A clustered JetStream just started (or electing a leader) answers "service
        # unavailable" for a moment: wait for it, within a bound, rather than exit.
        unavailable_until = time.monotonic() + UNAVAILABLE_S
        try:
            while True:
                try:
                    msgs = await sub.fetch(512, timeout=IDLE_S)
                except (TimeoutError, nats.errors.TimeoutError):
                    if (await sub.consumer_info()).num_pending:
                        continue
                    return out
                except nats.js.errors.ServiceUnavailableError:
                    if time.monotonic() > unavailable_until:
                        raise
                    await asyncio.sleep(0.25)
                    continue
                for msg in msgs:
                    seq = msg.metadata.sequence.stream
                    if seq > last:
                        return out
                    out.append((seq, await self._authentic_msg(msg)))
                    if seq == last:
                        return out
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    async def _follow(self) -> None:
        while True:
            config = ConsumerConfig(
                deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                opt_start_seq=self._pos + 1,
                ack_policy=AckPolicy.NONE,
                filter_subjects=FILTERS,
                inactive_threshold=30.0,
                mem_storage=True,
            )
            try:
                sub = await self._js().pull_subscribe("", stream=STREAM, config=config)
                try:
                    await self._read(sub)
                finally:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a NATS restart, a deleted consumer: follow again
                log.warning("scheduler: following the log failed (%s); resuming", exc)
                self.follow_problem = f"not following the log: {type(exc).__name__}: {exc}"
                await asyncio.sleep(0.5)

    async def _read(self, sub: JetStreamContext.PullSubscription) -> None:
        while True:
            try:
                msgs = await sub.fetch(256, timeout=IDLE_S)
            except (TimeoutError, nats.errors.TimeoutError):
                if (await sub.consumer_info()).num_pending:
                    continue
                self._idle_rounds += 1
                self.follow_problem = None
                await self._notify()
                continue
            self.follow_problem = None
            for msg in msgs:
                seen = await self._authentic_msg(msg)
                self._pos = max(self._pos, msg.metadata.sequence.stream)
                if seen is not None and self._fold(seen):
                    self._wake.set()
            await self._notify()

    async def _notify(self) -> None:
        async with self._progress:
            self._progress.notify_all()

    def _fold(self, seen: Seen | None) -> bool:
        """Fold one authentic event; True when the queue may move."""
        if seen is None:
            return False
        try:
            return self.state.apply(seen)
        except (ValueError, KeyError, TypeError) as exc:  # a payload the fold cannot read
            log.warning("scheduler: %s %s not folded: %s", seen.type, seen.id, exc)
            return False

    async def _authentic_msg(self, msg: Msg) -> Seen | None:
        stored_at = msg.metadata.timestamp.timestamp()
        return await self._authentic(msg.data, msg.subject, stored_at, msg.metadata.sequence.stream)

    def _first_refusal(self, seq: int) -> bool:
        """Whether this stream position was not refused before (a message read again, by the
        rebuild and then the follow, or after a resumed follow, is counted once)."""
        if seq in self._refused_seqs:
            return False
        self._refused_seqs[seq] = None
        while len(self._refused_seqs) > 10_000:
            self._refused_seqs.pop(next(iter(self._refused_seqs)))
        return True

    async def _authentic(
        self, data: bytes, subject: str, stored_at: float, seq: int = 0
    ) -> Seen | None:
        """The event as the fold takes it, when the gate admits it (never a forged one)."""
        try:
            fields = unpack_fields(data)
            envelope = Envelope.model_validate(fields)
        except ValueError:
            return None
        if envelope.subject != subject:
            return None
        refusal = await self._gate().check(fields, envelope)
        if refusal is not None:  # counted and logged as the runtime does; never folded
            if not self._first_refusal(seq):
                return None
            core_metrics.EVENTS_REJECTED.labels(self.service.name, envelope.type, refusal[0]).inc()
            log.warning(
                "scheduler: not folding %s on %s (%s): %s",
                envelope.type,
                subject,
                refusal[0],
                refusal[1],
            )
            return None
        try:
            typed = envelope.decoded()
        except ValueError as exc:
            log.warning("scheduler: %s %s unreadable: %s", envelope.type, envelope.id, exc)
            return None
        inventory = getattr(typed, "inventory", None)
        if isinstance(inventory, NodeInventory):
            # A node's presence (13 KB of inventory from an 8-GPU node with NVLink, 200 a
            # second from 1,000 nodes): the fold takes the inventory as validated here, not
            # dumped to JSON and validated again.
            payload = typed.model_dump(mode="json", exclude={"inventory"})
        else:
            payload, inventory = typed.model_dump(mode="json"), None
        return Seen(
            envelope.id,
            envelope.type,
            envelope.aggregate_id,
            envelope.tenant,
            payload,
            stored_at,
            envelope.time.timestamp(),
            inventory,
        )

    async def barrier(self, timeout: float = BARRIER_TIMEOUT_S, *, upto: int | None = None) -> None:
        """Wait until the fold includes every message the log held when this was called, or,
        with ``upto``, every message up to that stream sequence (a handler's own message: all
        that came before it is what its decision needs; no round trip, and no wait for the
        heartbeats that kept arriving since)."""
        last = upto if upto else (await self._js().stream_info(STREAM)).state.last_seq
        idle = self._idle_rounds
        async with self._progress:
            await asyncio.wait_for(
                self._progress.wait_for(lambda: self._pos >= last or self._idle_rounds >= idle + 2),
                timeout,
            )

    # ------------------------------------------------------------------ deciding

    async def _decide(
        self,
        payload: Payload,
        *,
        aggregate_id: str,
        event_id: str,
        tenant: str,
        causation: Envelope | None = None,
    ) -> None:
        """Publish one decision with its derived id, applied to the state at once."""
        seen = Seen(
            event_id,
            payload.TYPE,
            aggregate_id,
            tenant,
            payload.model_dump(mode="json"),
            time.time(),
        )
        self.state.tentative(seen)
        assert self.service.publisher is not None
        try:
            await self.service.publisher.publish(
                payload,
                aggregate_id=aggregate_id,
                event_id=event_id,
                causation=causation,
                tenant=tenant,
            )
        except BaseException:
            self.state.withdraw(event_id)
            raise
        metrics.DECISIONS.labels(payload.TYPE).inc()
        core_metrics.EVENTS_PUBLISHED.labels(self.service.name, payload.TYPE).inc()

    @property
    def policy(self) -> str:
        return self.engine.engine.policy

    def _sync(self, fleet: Fleet) -> None:
        """The engine's nodes and allocations as the folded state has them now.

        Asked on every decision, for every node: a node's spec is judged again only when its
        state changed (a heartbeat, a flag, a degraded GPU) or the clock crossed the time its
        verdict changes (its heartbeat going stale), else the one judged before is taken."""
        specs = []
        now = fleet.now
        degraded_of = self.state.degraded.of_node
        known = self._specs
        for n in fleet.nodes.values():
            degraded = degraded_of(n.node_id)
            cached = known.get(n.node_id)
            if (
                cached is not None
                and cached.node is n
                and cached.degraded == degraded
                and cached.since <= now < cached.until
            ):
                specs.append(cached.spec)
                continue
            why = tuple(usable(n, fleet))
            # keyed on the reason's class: "lost (silent 45 s)" changes every second, the spec
            # (which carries only the class) does not
            state: tuple[Any, ...] = (unschedulable_class(why),) if why else ()
            if degraded:  # nothing new on a degraded GPU (gpu.degraded until gpu.recovered)
                state = (*state, degraded)
            if cached is None or cached.node.inventory is not n.inventory or cached.state != state:
                spec = node_spec(n.node_id, n.inventory, why, degraded)
            else:
                spec = cached.spec
            known[n.node_id] = _Spec(n, degraded, state, spec, now, verdict_until(n, fleet))
            specs.append(spec)
        if len(known) > len(fleet.nodes):  # (every node of the fleet has one: others left)
            for gone in set(known) - set(fleet.nodes):
                del known[gone]
        self.engine.sync(specs, fleet.units)

    def _place_avoiding(self, gang: GangDemand, avoid: str | None) -> GangPlacement | Unfit:
        """The engine's choice, away from ``avoid`` (where the sandbox was just lost) unless
        nothing else fits."""
        engine = self.engine.engine
        spec = self.engine.node(avoid) if avoid else None
        if spec is not None and spec.schedulable:
            self.engine.set_node(replace(spec, schedulable=False, unschedulable_reason="avoided"))
            try:
                got = engine.place(gang)
            finally:
                self.engine.set_node(spec)
            if isinstance(got, GangPlacement):
                return got
        return engine.place(gang)

    def _head_could_fit(self, gang: GangDemand, now: float) -> bool:
        """:meth:`_could_ever_fit` for the head of the queue, judged at most once per
        :data:`FIT_JUDGED_EVERY_S` (the reference engine's pass over the fleet costs units x
        nodes on the event loop; a tenant's large gang must not cost that on every pass)."""
        judged = self._fit_judged
        if (
            judged is not None
            and judged[0] == gang.gang_id
            and now - judged[1] < FIT_JUDGED_EVERY_S
        ):
            return judged[2]
        fits = self._could_ever_fit(gang, self.state.fleet(now))
        self._fit_judged = (gang.gang_id, now, fits)
        return fits

    def _could_ever_fit(self, gang: GangDemand, fleet: Fleet) -> bool:
        """Whether ``gang`` fits the schedulable fleet were it empty (the reference engine,
        rebuilt only when a node's spec changed: the queue asks this for every waiting gang)."""
        self._sync(fleet)
        specs = [self._specs[n].spec for n in sorted(self._specs)]
        key = tuple(id(spec) for spec in specs)
        if self._empty is None or self._empty[0] != key:
            empty = SimpleEngine("leastloaded")
            for spec in specs:
                empty.upsert_node(spec)
            self._empty = (key, empty, specs)  # (the specs kept alive: their ids stay theirs)
        return isinstance(self._empty[1].place(gang), GangPlacement)

    def _placement(
        self, sbx: Sandbox, gang: GangDemand, *, behind: Waiting | None = None
    ) -> list[Payload]:
        """Where a waiting (or just built) sandbox's units go now (``unit.placed`` for each,
        then ``sandbox.scheduled``), or why it waits (one ``sandbox.pending``). ``behind``: a
        head of the queue this sandbox may not pass."""
        assert sbx.resources is not None
        started = time.perf_counter()
        fleet = self.state.fleet(time.time())
        self._sync(fleet)
        total = len(fleet.nodes)
        policy = self.policy

        def pending(reason: str, outcome: str, **more: Any) -> list[Payload]:
            metrics.PLACEMENTS.labels(policy, outcome).inc()
            metrics.PLACEMENT_SECONDS.labels(policy).observe(time.perf_counter() - started)
            assert sbx.resources is not None
            return [
                SandboxPending(
                    reason=reason[:REASON_MAX],
                    resources=sbx.resources,
                    attempt=sbx.next_attempt,
                    nodes_total=total,
                    **more,
                )
            ]

        if behind is not None:
            waited = time.time() - behind.queued_at
            return pending(
                f"queued behind {behind.sandbox_id} (priority {behind.priority}, waiting "
                f"{waited:.0f} s): no backfill past a head that waited this long",
                "queued",
            )
        refusal = (  # (what every team holds is summed only for a team with a quota)
            quota_refusal(gang, self.quotas, usage(fleet.units), unit_counts(fleet.units))
            if gang.team in self.quotas
            else None
        )
        if refusal is not None:
            return pending(refusal, "quota")
        decision: GangPlacement | Unfit | None = None
        colocate = self._handover_node(sbx)
        if colocate is not None and colocate != sbx.lost_on:
            decision = self._place_on(gang, colocate)
            if isinstance(decision, Unfit):
                log.info("scheduler: %s does not fit on %s (hand-over)", sbx.sandbox_id, colocate)
                decision = None
        if decision is None:
            decision = self._place_avoiding(gang, sbx.lost_on)
        if isinstance(decision, Unfit):
            return pending(
                self._unfit_reason(decision, gang, sbx, fleet),
                "unfit",
                unit=unit_name(decision.unit),
                unfit=_unfit_counts(decision.reasons),
            )
        out: list[Payload] = []
        by_key = {u.key: u for u in gang.units}
        for choice in decision.choices:
            unit = by_key[choice.key]
            spec = self.engine.node(choice.node_id)
            models = (
                {g.model for g in spec.gpus if g.index in choice.gpu_indices} if spec else set()
            )
            out.append(
                UnitPlaced(
                    sandbox_id=sbx.sandbox_id,
                    unit=unit_name(choice.key),
                    node_id=choice.node_id,
                    gpu_indices=list(choice.gpu_indices),
                    gpu_milli=choice.gpu_milli if choice.gpu_indices else 0,
                    gpu_model=min(models)[:64] if models else None,  # a node names it
                    cpu_millicores=unit.cpu_milli,
                    memory_bytes=unit.memory_bytes,
                    gang_size=len(decision.choices),
                    policy=decision.policy or policy,
                    score=_finite(choice.score),
                    breakdown={
                        str(k)[:64]: _finite(v) for k, v in list(choice.breakdown.items())[:16]
                    },
                    feasible_nodes=choice.feasible_nodes,
                    nodes_total=decision.nodes_total or total,
                    attempt=sbx.next_attempt,
                )
            )
        first = next((c for c in decision.choices if unit_name(c.key) == MAIN), decision.choices[0])
        nodes = sorted({c.node_id for c in decision.choices})
        where = f"{len(decision.choices)} units on {len(nodes)} nodes; " if len(nodes) > 1 else ""
        reason = (
            f"{where}{decision.policy or policy}: {first.feasible_nodes} of "
            f"{decision.nodes_total or total} nodes fit, score {first.score:.3f}"
        )
        out.append(
            SandboxScheduled(
                node_id=first.node_id,
                reason=reason,
                attempt=sbx.next_attempt,
                previous_node=sbx.lost_on,
                resources=sbx.resources,
                env_built_id=sbx.env_built_id,
            )
        )
        self.engine.commit(decision)  # once its events could be built (else nothing is held)
        metrics.PLACEMENTS.labels(policy, "placed").inc()
        metrics.PLACEMENT_SECONDS.labels(policy).observe(time.perf_counter() - started)
        return out

    @staticmethod
    def _unfit_reason(unfit: Unfit, gang: GangDemand, sbx: Sandbox, fleet: Fleet) -> str:
        """``0/3 nodes: 2 insufficient CPU, 1 no GPU`` (for a gang: which unit), then, for a
        sandbox of one unit, each node and what it lacks (bounded)."""
        if not fleet.nodes:
            return "no node has joined"
        if len(gang.units) > 1:
            return f"unit {unit_name(unfit.unit)}: {unfit.summary()}"
        assert sbx.resources is not None
        legacy = place(sbx.resources, fleet)
        if isinstance(legacy, NoFit):
            return f"{unfit.summary()}; {legacy.summary()}"
        return unfit.summary()

    @staticmethod
    def _same_wait(sbx: Sandbox, decision: SandboxPending) -> bool:
        """Whether a pending sandbox would only be told again why it waits: the same kind of
        reason, or another one within REASON_EVERY_S of the last (bounded churn)."""
        if sbx.life.state != "pending":
            return False
        same = reason_shape(decision.reason) == reason_shape(sbx.pending_reason)
        return same or time.time() - sbx.pending_at < REASON_EVERY_S

    async def _demand(self, sbx: Sandbox) -> GangDemand:
        """What a waiting sandbox asks (its plan's topology, read once from its authentic
        ``spec.validated``; without one: a single unit from its resources)."""
        gang = self._demands.get(sbx.sandbox_id)
        if gang is not None:
            return gang
        assert sbx.resources is not None
        plan: dict[str, Any] = {}
        with contextlib.suppress(Exception):  # unreadable: it is placed by its resources
            validated = await self._gate().find(subject_for("spec.validated", sbx.sandbox_id))
            if validated is not None:
                plan = dict(validated.payload["plan"])
        try:
            gang = gang_demand(sbx.sandbox_id, sbx.tenant, plan, sbx.resources)
        except ValueError:
            gang = gang_demand(sbx.sandbox_id, sbx.tenant, {}, sbx.resources)
        self._remember(sbx.sandbox_id, gang)
        await self._note_handover(sbx.sandbox_id)
        return gang

    async def _note_handover(self, sandbox_id: str) -> None:
        """Remember the sandbox a hand-over's new version takes over from (``handover_from``
        of its authentic ``spec.submitted``; the policy service checked its tenant)."""
        if sandbox_id in self._handovers:
            return
        submitted = None
        with contextlib.suppress(Exception):  # unreadable: placed like any other
            submitted = await self._gate().find(subject_for("spec.submitted", sandbox_id))
        old = submitted.payload.get("handover_from") if submitted is not None else None
        if isinstance(old, str):
            self._handovers[sandbox_id] = old
            while len(self._handovers) > DEMANDS_KEPT:
                self._handovers.pop(next(iter(self._handovers)))

    def _handover_node(self, sbx: Sandbox) -> str | None:
        """Where a hand-over's new sandbox should go: the node its old version runs on, while
        it still does (else it is placed normally and the hand-over is just a recovery)."""
        old_id = self._handovers.get(sbx.sandbox_id)
        old = self.state.sandboxes.get(old_id) if old_id is not None else None
        if old is None or old.tenant != sbx.tenant:
            return None
        return old.holds

    def _place_on(self, gang: GangDemand, node: str) -> GangPlacement | Unfit:
        """The engine's choice with ``node`` the only schedulable node."""
        others = []
        for node_id in sorted(self._specs):
            spec = self.engine.node(node_id)
            if node_id != node and spec is not None and spec.schedulable:
                others.append(spec)
        for spec in others:
            self.engine.set_node(
                replace(spec, schedulable=False, unschedulable_reason="hand-over elsewhere")
            )
        try:
            return self.engine.engine.place(gang)
        finally:
            for spec in others:
                self.engine.set_node(spec)

    def _remember(self, sandbox_id: str, gang: GangDemand) -> None:
        self._demands[sandbox_id] = gang
        while len(self._demands) > DEMANDS_KEPT:
            self._demands.pop(next(iter(self._demands)))

    async def place_waiting(self) -> None:
        """Try each waiting sandbox in queue order (higher priority first, then oldest): place
        what fits now; a head that waited :data:`~dsec_scheduler.gangs.BACKFILL_S` and could
        fit stops the ones behind it (README, "Placement")."""
        async with self._deciding:
            await self._place_waiting()

    async def _place_waiting(self) -> None:
        entries: list[tuple[Waiting, GangDemand]] = []
        for queued in self.state.queue():
            if queued.resources is None:
                continue
            gang = await self._demand(queued)
            entries.append(
                (Waiting(queued.sandbox_id, gang.priority, queued.queued_at or 0.0), gang)
            )
        gangs = {w.sandbox_id: g for w, g in entries}
        head_seen = False
        self._blocker = None
        for waiting in ordered(w for w, _ in entries):
            sbx = self.state.sandboxes.get(waiting.sandbox_id)
            if sbx is None or not sbx.waiting or sbx.stop_requested or sbx.resources is None:
                continue
            try:
                decision = self._placement(sbx, gangs[waiting.sandbox_id], behind=self._blocker)
            except ValueError:  # one sandbox whose decision cannot be told never stops the rest
                log.exception("scheduler: no decision for %s", sbx.sandbox_id)
                continue
            first = decision[0]
            if isinstance(first, SandboxPending) and first.unfit and not head_seen:
                head_seen = True  # the head: the first in order that cannot fit
                now = time.time()
                if blocks(waiting, now, True) and self._head_could_fit(gangs[sbx.sandbox_id], now):
                    self._blocker = waiting
            if isinstance(first, SandboxPending) and self._same_wait(sbx, first):
                continue  # still waits, for the reason it was given
            await self._publish_decision(sbx, decision)

    async def _publish_decision(
        self, sbx: Sandbox, decision: list[Payload], causation: Envelope | None = None
    ) -> None:
        """Publish a placement's events (each unit's ``unit.placed``, then the sandbox's
        ``sandbox.scheduled``), or its ``sandbox.pending``, with ids derived from the event
        the decision follows (a redelivery or another replica publishes the same ids)."""
        base = causation.id if causation is not None else sbx.life.last_event_id
        assert base is not None
        try:
            await self._publish_each(sbx, decision, base, causation)
        finally:
            self.engine.unpin(
                f"{sbx.sandbox_id}/{p.unit}" for p in decision if isinstance(p, UnitPlaced)
            )

    async def _publish_each(
        self, sbx: Sandbox, decision: list[Payload], base: str, causation: Envelope | None
    ) -> None:
        for payload in decision:
            if isinstance(payload, UnitPlaced):
                event_id = derive_event_id(base, f"unit.placed/{payload.unit}")
            else:
                event_id = derive_event_id(base, "placement")
            if isinstance(payload, SandboxPending):
                self._pending_class[sbx.sandbox_id] = metrics.pending_class(
                    payload.reason, payload.unfit
                )
            await self._decide(
                payload,
                aggregate_id=sbx.sandbox_id,
                event_id=event_id,
                tenant=sbx.tenant,
                causation=causation,
            )

    async def declare_lost(self, now: float) -> None:
        """Declare silent nodes lost, then move what lost or draining nodes still hold."""
        for node in self.state.silent(now, watching_since=self._watching_since):
            silent = now - node.last_seen
            log.warning("scheduler: node %s silent for %.1f s: lost", node.node_id, silent)
            await self._decide(
                NodeLost(
                    node_id=node.node_id,
                    last_seen=datetime.fromtimestamp(node.last_seen, UTC),
                    silent_s=round(silent, 1),
                    sandboxes=self.state.on_node(node.node_id),
                ),
                aggregate_id=node.node_id,
                event_id=derive_event_id(node.last_event_id, "node.lost"),
                tenant=SYSTEM_TENANT,
            )
            await self.migrator.on_node_lost(node.node_id)
        await self.evacuate()

    async def evacuate(self) -> None:
        """``unit.lost`` for each sandbox a lost or draining node still holds."""
        moved = False
        for node, held in self.state.evacuate():
            if node.lost:
                cause = derive_event_id(node.last_event_id, "node.lost")
                reason = f"node {node.node_id} lost"
            else:
                cause, reason = node.drain_event_id, "node drained"
            for sandbox_id in held:
                sbx = self.state.sandboxes.get(sandbox_id)
                if sbx is None or sbx.holds != node.node_id:
                    continue  # it ended (or moved) while the previous decision was published
                if not node.lost and await self.migrator.for_drain(
                    node.node_id, node.drain_event_id, sandbox_id
                ):
                    continue  # moved live (hand-over): no restart
                retry = node.draining or sbx.life.attempt < self.max_placements
                await self._decide(
                    UnitLost(
                        node_id=node.node_id,
                        reason=reason,
                        action="reschedule" if retry else "fail",
                        attempt=sbx.life.attempt,
                    ),
                    aggregate_id=sandbox_id,
                    event_id=derive_event_id(cause, f"unit.lost/{sandbox_id}"),
                    tenant=sbx.tenant,
                )
                moved = True
        if moved:
            self._wake.set()

    async def _place_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.place_waiting()
            except Exception:  # a decision that could not be published: try again soon
                log.exception("scheduler: placing the queue failed")
                await asyncio.sleep(1.0)
                self._wake.set()

    async def _watch_forever(self) -> None:
        while True:
            await asyncio.sleep(self.tick_s)
            try:
                await self.declare_lost(time.time())
            except Exception:
                log.exception("scheduler: loss detection failed")
            try:
                await self.migrator.tick(time.time())
            except Exception:
                log.exception("scheduler: migration timeouts failed")
            waiting = len(self.state.queue())
            self._export(waiting)
            if waiting and time.monotonic() - self._last_sweep >= SWEEP_S:
                self._last_sweep = time.monotonic()
                self._wake.set()  # a safety net: events wake the queue as they arrive

    def _export(self, waiting: int) -> None:
        states = {"ready": 0, "cordoned": 0, "unhealthy": 0, "lost": 0}
        for node in self.state.nodes.values():
            if node.lost:
                states["lost"] += 1
            elif node.cordoned:
                states["cordoned"] += 1
            elif node.problems:
                states["unhealthy"] += 1
            else:
                states["ready"] += 1
        for state, count in states.items():
            metrics.NODES.labels(state).set(count)
        metrics.WAITING.set(waiting)
        self._sync(self.state.fleet(time.time()))
        for model, ratio in self.engine.engine.allocation_ratio().items():
            metrics.GPU_ALLOCATION.labels(model).set(ratio)
        classes = dict.fromkeys(metrics.PENDING_REASONS, 0)
        for sid in list(self._pending_class):
            sbx = self.state.sandboxes.get(sid)
            if sbx is None or sbx.life.state != "pending":
                del self._pending_class[sid]
                self._demands.pop(sid, None)
                continue
            classes[self._pending_class[sid]] = classes.get(self._pending_class[sid], 0) + 1
        for cls, count in classes.items():
            metrics.PENDING_UNITS.labels(cls).set(count)

    # ------------------------------------------------------------------ handlers

    async def on_env_built(self, envelope: Envelope) -> list[Output | Payload]:
        """A built sandbox: schedule it on a node, or queue it as pending."""
        await self.barrier(upto=HANDLING_SEQ.get())
        sid = envelope.aggregate_id
        sbx = self.state.sandboxes.get(sid)
        if sbx is None or sbx.env_built_id != envelope.id or sbx.life.state != "built":
            return []  # decided before (a redelivery, a restart) or already ended
        validated = await self._gate().find(subject_for("spec.validated", sid))
        if validated is None:
            return [SandboxFailed(stage="scheduler", reason="no authentic spec.validated")]
        try:
            plan = validated.payload["plan"]
            resources = resources_from_plan(plan)
        except (KeyError, TypeError, ValueError) as exc:
            reason = f"the plan's resources are unreadable: {exc}"[:500]
            return [SandboxFailed(stage="scheduler", reason=reason)]
        try:
            gang = gang_demand(sid, envelope.tenant, plan, resources)
        except ValueError as exc:
            reason = f"the plan's topology is unreadable: {exc}"[:500]
            return [SandboxFailed(stage="scheduler", reason=reason)]
        sbx = self.state.sandboxes[sid]
        if sbx.stop_requested or await self._gate().find(
            subject_for("sandbox.stop_requested", sid)
        ):
            return [_stopped()]
        self._remember(sid, gang)
        await self._note_handover(sid)
        async with self._deciding:
            now = self.state.sandboxes.get(sid)
            if now is None or now.life.state != "built":
                return []  # decided or ended while the queue was being placed
            if now.stop_requested:
                return [_stopped()]
            blocker = self._blocker
            behind = None
            if blocker is not None and blocker.priority >= gang.priority:
                head = self.state.sandboxes.get(blocker.sandbox_id)
                behind = blocker if head is not None and head.waiting else None
            decision = self._placement(replace(sbx, resources=resources), gang, behind=behind)
            await self._publish_decision(replace(sbx, resources=resources), decision, envelope)
        if demand_gpus(gang) and isinstance(decision[0], SandboxPending):
            log.info("scheduler: %s waits: %s", sid, decision[0].reason[:300])
        return []

    async def on_cordon_requested(
        self, envelope: Envelope, request: NodeCordonRequested
    ) -> list[Output | Payload]:
        """An operator's cordon, uncordon or drain: the node's placement state, and for a
        drain each of its sandboxes lost and rescheduled elsewhere."""
        await self.barrier()
        node = self.state.nodes.get(request.node_id)
        if node is None:
            answer = NodeCordoned(
                node_id=request.node_id,
                cordoned=False,
                reason=f"node {request.node_id} has not joined: nothing to cordon",
            )
            return [Output(answer, aggregate_id=request.node_id)]
        draining = request.action == "drain"
        answer = NodeCordoned(
            node_id=node.node_id,
            cordoned=request.action != "uncordon",
            draining=draining,
            reason=request.reason,
            moved=self.state.on_node(node.node_id) if draining else [],
        )
        await self._decide(
            answer,
            aggregate_id=node.node_id,
            event_id=answer_event_id(
                envelope.type, envelope.id, "node.cordoned", key_id=envelope.key_id
            ),
            tenant=envelope.tenant,
            causation=envelope,
        )
        await self.evacuate()
        if request.action == "uncordon":
            self._wake.set()
        return []

    async def on_stop_requested(self, envelope: Envelope) -> list[Output | Payload]:
        """A stop of a sandbox that waits for a node: the scheduler ends it."""
        await self.barrier()
        sbx = self.state.sandboxes.get(envelope.aggregate_id)
        if sbx is None:
            return []
        if sbx.life.state == "pending":
            end: Payload = _stopped()
        elif sbx.life.state == "lost":
            end = SandboxFailed(stage="scheduler", reason="stopped while waiting for a new node")
        else:
            return []  # its node agent stops it (or it has not been placed yet: see env.built)
        await self._decide(
            end,
            aggregate_id=sbx.sandbox_id,
            event_id=answer_event_id(
                envelope.type, envelope.id, f"{end.TYPE}#0", key_id=envelope.key_id
            ),
            tenant=sbx.tenant,
            causation=envelope,
        )
        return []


REASON_KEY_MAX = 200
"""A ``sandbox.pending`` reason key's characters at most (the event's bound)."""
UNFIT_KEYS_MAX = 32


READ_MODEL_EXPORT_S = 15.0
"""How often the scheduler reads the live sandboxes by state for ``dsec_sandboxes``."""


@dataclass(frozen=True, slots=True)
class _Spec:
    """A node's engine spec as judged from ``node`` (the folded state's object: a new one for
    every change) and its degraded GPUs, which holds from ``since`` until ``until``."""

    node: Node
    degraded: frozenset[int]
    state: tuple[Any, ...]
    spec: Any
    since: float
    until: float


def export_live_states(states: Mapping[str, LiveState] | None) -> None:
    """Set ``dsec_sandboxes{state}`` and ``dsec_sandbox_state_oldest_seconds{state}`` (``None``:
    the read model could not be read; counted)."""
    if states is None:
        metrics.READ_MODEL_FAILURES.inc()
        return
    for state in metrics.LIVE_STATES:
        live = states.get(state)
        metrics.SANDBOXES.labels(state).set(live.count if live else 0)
        metrics.STATE_AGE.labels(state).set(live.oldest_s if live else 0)


def _unfit_counts(reasons: Mapping[str, int]) -> dict[str, int]:
    """The engine's reason counts as ``sandbox.pending`` may carry them: each reason cut to
    :data:`REASON_KEY_MAX` characters (a spec's unknown GPU type of any length is named in a
    reason; counts of reasons cut alike are added), the :data:`UNFIT_KEYS_MAX` largest."""
    out: dict[str, int] = {}
    for reason, count in reasons.items():
        key = (
            str(reason)
            if len(str(reason)) <= REASON_KEY_MAX
            else f"{reason[: REASON_KEY_MAX - 1]}…"
        )
        out[key] = out.get(key, 0) + max(0, int(count))
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:UNFIT_KEYS_MAX])


def _finite(value: float) -> float:
    """A score term as an event may carry it (never NaN or infinite)."""
    value = float(value)
    return value if value == value and abs(value) != float("inf") else 0.0


def _stopped() -> SandboxExited:
    return SandboxExited(
        exit_code=-1, reason="stopped", duration_s=0.0, detail="stopped before it was placed"
    )


def create_service(settings: Settings | None = None) -> Service:
    """Build the scheduler service: placement, loss detection and the projector."""
    service = Service("scheduler", settings)
    try:
        scheduler = Scheduler(service)
    except ValueError as exc:  # a bad DSEC_SCHEDULER_POLICY or quotas file: say which, stop
        raise SystemExit(f"scheduler: {exc}") from None
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    # Its decision goes out under ids derived from the env.built (label "placement"), its
    # refusals as the runtime's outputs: what a spare delivery looks for before it fails one.
    placement = ((SandboxScheduled, "placement"), (SandboxPending, "placement"))

    @service.handles("env.built", answers=(*placement, SandboxFailed, SandboxExited))
    async def env_built(envelope: Envelope, _: Any) -> list[Output | Payload]:
        return await scheduler.on_env_built(envelope)

    @service.handles("node.cordon_requested")
    async def cordon(envelope: Envelope, request: NodeCordonRequested) -> list[Output | Payload]:
        return await scheduler.on_cordon_requested(envelope, request)

    @service.handles("sandbox.stop_requested")
    async def stop_requested(envelope: Envelope, _: Any) -> list[Output | Payload]:
        return await scheduler.on_stop_requested(envelope)

    @service.handles("unit.migration_requested")
    async def migration_requested(
        envelope: Envelope, request: UnitMigrationRequested
    ) -> list[Output | Payload]:
        return list(await scheduler.migrator.on_requested(envelope, request))

    @service.handles("gpu.degraded")
    async def gpu_degraded(envelope: Envelope, degraded: GpuDegraded) -> list[Output | Payload]:
        return list(await scheduler.migrator.on_degraded(envelope, degraded))

    async def start_projector() -> None:
        dsn = service.settings.endpoint("postgres_dsn")
        if not dsn:
            log.warning("no DSEC_POSTGRES_DSN: read models are not projected")
            return
        assert service.nc is not None
        projector = Projector(service.nc.jetstream(), str(dsn), gate=service.gate)
        tasks.append(asyncio.create_task(projector.run(stop), name="projector"))
        states = watch_live_states(str(dsn), stop, export_live_states, READ_MODEL_EXPORT_S)
        tasks.append(asyncio.create_task(states, name="live-states"))

    async def stop_all() -> None:
        await scheduler.stop()
        stop.set()
        for task in tasks:
            try:
                await asyncio.wait_for(task, timeout=5)
            except TimeoutError:
                log.warning("scheduler: %s did not stop within 5 s", task.get_name())
            except Exception:  # it failed before: shutting down goes on all the same
                log.exception("scheduler: %s had failed", task.get_name())

    service.health_checks.append(lambda: scheduler.follow_problem)
    service.on_start.append(start_projector)
    service.on_start.append(scheduler.start)  # the state is rebuilt before the handlers run
    service.on_stop.append(stop_all)
    return service
