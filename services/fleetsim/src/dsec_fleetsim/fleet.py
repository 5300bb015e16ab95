"""The simulated fleet at run time: one NATS connection, thousands of nodes.

* **Joining**: each node registers its certified key (``audit.key_registered``, as every
  producer does at start) and publishes ``node.joined``; publishes are pipelined (many acks in
  flight, bounded by ``max_in_flight``), never awaited one by one.
* **Heartbeats**: every ``heartbeat_s`` per node (the real agent's default), spread evenly over
  the interval in ticks of :data:`TICK_S`; a node whose previous beat is still in flight skips a
  beat (as the real agent skips while the bus is unreachable: the gap is the signal).
* **Placements**: one reader per event type (not one per node) follows ``sandbox.scheduled``
  (and ``unit.placed`` once the catalogue has it), ``unit.lost`` and ``sandbox.stop_requested``;
  an event about one of its nodes passes the trust gate (signature, certificate, authorization:
  only the scheduler places) before it is acted on; a refused one is answered with
  ``security.event_rejected`` by the node it names, as a node agent's consumer answers it. A
  placed unit "runs" for ``run_for_s``: its node publishes ``sandbox.ready``, lists it in its
  heartbeats and grants its resources, then publishes ``sandbox.exited`` (``ok``) — exactly
  what a node agent publishes for a workload that ends by itself (authz lets the node a
  sandbox is scheduled on report it).
* **Script**: health steps (:mod:`dsec_fleetsim.script`) applied at their time.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import resource
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsec_core import events, natsperms
from dsec_core.bus import EventPublisher, follow
from dsec_core.envelope import Envelope
from dsec_core.gpuhealth import CONFIG_ID, ClusterConfig
from dsec_core.identity import SYSTEM_TENANT
from dsec_core.ids import derive_event_id
from dsec_core.subjects import STREAM, filter_for, subject_for
from dsec_core.trust import Gate, Refusal, unpack_fields
from nats.js import JetStreamContext

from dsec_fleetsim.identities import NodeIdentity
from dsec_fleetsim.inventory import NodePlan
from dsec_fleetsim.migration import carry_out, keys_of, model, moved_unit
from dsec_fleetsim.node import SimNode, Unit
from dsec_fleetsim.script import Step

log = logging.getLogger(__name__)

MIGRATION_TYPES = (events.UnitMigrationStarted.TYPE, events.UnitMigrationFailed.TYPE)
"""What the simulated nodes follow to carry out migrations (and abort them)."""

TICK_S = 0.05
"""Granularity of the heartbeat spread."""
JOIN_CHUNK = 256
"""Nodes joining at once (their registrations and node.joined in flight together)."""
CONFIG_EVERY_S = 5.0
"""How often the operator's cluster config (GPU health thresholds) is read again."""
_STOP_ATTEMPTS = 5
"""Times :meth:`Fleet.stop` cancels a loop that runs on (a second apart)."""


def placement_types() -> list[str]:
    """The placement events a node acts on: ``unit.placed`` (each compute unit: its resources
    and GPUs) and ``sandbox.scheduled`` (the sandbox's lifecycle on its node)."""
    return [events.SandboxScheduled.TYPE, events.UnitPlaced.TYPE]


def rss_mib() -> float:
    """Peak resident memory of this process, MiB."""
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


@dataclass
class Options:
    """How the fleet runs."""

    heartbeat_s: float = 5.0
    run_for_s: float = 300.0
    version: str = "0.1.0"
    max_in_flight: int = 2048
    status_every_s: float = 2.0


@dataclass
class Stats:
    """What the fleet did (the status line)."""

    started: float = field(default_factory=time.monotonic)
    events: int = 0
    heartbeats: int = 0
    publish_errors: int = 0
    placements: int = 0
    """Sandboxes placed here (``sandbox.scheduled``)."""
    units_placed: int = 0
    """Compute units placed here (``unit.placed``)."""
    refused: int = 0
    exited: int = 0
    migrated: int = 0
    """Units this fleet moved (``unit.migrated``)."""
    last_refusals: deque[str] = field(default_factory=lambda: deque(maxlen=5))
    _window: deque[tuple[float, int, float]] = field(default_factory=lambda: deque(maxlen=64))

    def rate(self) -> tuple[float, float]:
        """Events per second and CPU µs per event over the last few status lines."""
        now, cpu = time.monotonic(), time.process_time()
        self._window.append((now, self.events, cpu))
        t0, e0, c0 = self._window[0]
        if now - t0 <= 0 or self.events == e0:
            return 0.0, 0.0
        return (self.events - e0) / (now - t0), (cpu - c0) / (self.events - e0) * 1e6


class NotPermitted(RuntimeError):
    """The bus refuses the fleet's events (not the ``fleetsim`` credential)."""


class Fleet:
    """Simulated nodes publishing on one connection."""

    def __init__(
        self,
        plans: Sequence[NodePlan],
        identities: dict[str, NodeIdentity],
        js: JetStreamContext,
        gate: Gate,
        options: Options,
        steps: Sequence[Step] = (),
        *,
        report: Callable[[dict[str, Any]], None] = lambda _: None,
    ) -> None:
        self.js, self.gate, self.options, self.steps = js, gate, options, list(steps)
        self.report = report
        self.identities = identities
        self.nodes = {p.node_id: SimNode(p, options.heartbeat_s, options.version) for p in plans}
        self.publishers = {n: self._publisher(n) for n in self.nodes}
        self.stats = Stats()
        self.attempts: dict[str, int] = {}
        self.where: dict[str, str] = {}  # unit key (sandbox, or sandbox/unit) -> its node
        self.sandboxes: dict[str, set[str]] = {}  # sandbox -> keys of its units running here
        self._ends: list[tuple[float, str, str]] = []  # (until, node, unit key): a heap
        self._inflight: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[Any]] = []
        self._sem = asyncio.Semaphore(options.max_in_flight)
        self._migrations: set[str] = set()  # migration ids acted on (a replay is not)
        self._aborted: set[str] = set()  # migration ids failed before they finished
        self._t0 = time.monotonic()
        self.ready = asyncio.Event()
        self.config = ClusterConfig()
        """The operator's settings (``cluster.config_set``): the GPU health thresholds."""
        self._config_seq = 0  # the stream seq of cluster.config_set read up to
        self._config_event: Envelope | None = None  # the cluster.config_set in force
        self.thresholds = self.config.thresholds()

    def _publisher(self, node_id: str) -> EventPublisher:
        ident = self.identities[node_id]
        return EventPublisher(self.js, ident.signer(), certificate=ident.cert, retries=3)

    def now(self) -> float:
        """Seconds since the fleet started."""
        return time.monotonic() - self._t0

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Follow placements from now on, register and join every node, start beating."""
        start_seq = (await self.js.stream_info(STREAM)).state.last_seq + 1
        for event_type in [
            *placement_types(),
            events.UnitLost.TYPE,
            events.SandboxStopRequested.TYPE,
            *MIGRATION_TYPES,
        ]:
            self._loop(self._follow(event_type, start_seq), f"follow-{event_type}")
        nodes = list(self.nodes.values())
        first = self.publishers[nodes[0].node_id]
        try:  # one registration alone first: a credential NATS refuses fails here, said once
            await first.register_key()
        except Exception as exc:
            raise NotPermitted(
                f"the bus did not take {nodes[0].node_id}'s key registration ({exc}): connect "
                "with the `fleetsim` NATS credential (DSEC_NATS_NKEY_SEED=$DSEC_HOME/nats/"
                "fleetsim.nk), which may publish node events"
            ) from None
        self.stats.events += 1
        for i in range(0, len(nodes), JOIN_CHUNK):
            await asyncio.gather(
                *(self._join(n, registered=n is nodes[0]) for n in nodes[i : i + JOIN_CHUNK])
            )
        self._t0 = time.monotonic()
        self.ready.set()
        self._loop(self._beat_forever(), "heartbeats")
        self._loop(self._end_units(), "units")
        self._loop(self._run_script(), "script")
        self._loop(self._status_forever(), "status")
        self._loop(self._config_forever(), "config")

    async def read_config(self) -> ClusterConfig:
        """The latest authentic ``cluster.config_set`` (none: the defaults)."""
        try:
            found, self._config_seq = await self.gate.newest(
                subject_for(events.ClusterConfigSet.TYPE, CONFIG_ID),
                after=self._config_seq,
                than=self._config_event,
            )
        except Exception as exc:  # the bus is away: keep what is known
            log.warning("cluster config not read: %s", exc)
            return self.config
        if found is not None:
            payload = found.decoded()
            assert isinstance(payload, events.ClusterConfigSet)
            self._config_event = found
            config = ClusterConfig.of(payload.config)
            if config != self.config:
                self.config, self.thresholds = config, config.thresholds()
        return self.config

    async def _config_forever(self) -> None:
        while True:
            await self.read_config()
            await asyncio.sleep(CONFIG_EVERY_S)

    async def stop(self) -> None:
        """Stop publishing (nodes fall silent, as node agents that stop)."""
        pending = set(self._loops)
        for _ in range(_STOP_ATTEMPTS):
            # Cancelled again while one runs on: on Python 3.11 a cancellation that races the
            # result of an `asyncio.wait_for` (nats-py waits for acks and fetches with it) is
            # lost, and the loop it hit would run on; awaited once, stop() never returned.
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=1.0)
            if not pending:
                break
        for task in self._loops:
            if task.done() and not task.cancelled():
                task.exception()  # (retrieved: a loop that failed is not logged at exit)
        if pending:
            log.warning("%d loops did not stop: %s", len(pending), [t.get_name() for t in pending])
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)

    def _loop(self, coro: Any, name: str) -> None:
        self._loops.append(asyncio.create_task(coro, name=name))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _publish(
        self,
        node: SimNode,
        payload: events.Payload,
        *,
        aggregate_id: str,
        tenant: str | None = SYSTEM_TENANT,
        event_id: str | None = None,
    ) -> bool:
        async with self._sem:
            try:
                await self.publishers[node.node_id].publish(
                    payload, aggregate_id=aggregate_id, tenant=tenant, event_id=event_id
                )
            except Exception as exc:  # a lost ack or an outage: the node skips, never dies
                self.stats.publish_errors += 1
                log.warning("%s: %s not published: %s", node.node_id, payload.TYPE, exc)
                return False
        self.stats.events += 1
        return True

    async def _join(self, node: SimNode, *, registered: bool = False) -> None:
        """Register the node's key (unless done) and announce it (a node agent's start)."""
        if not registered:
            async with self._sem:
                try:
                    await self.publishers[node.node_id].register_key()
                except Exception as exc:
                    self.stats.publish_errors += 1
                    log.warning("%s: key registration not published: %s", node.node_id, exc)
                    return
            self.stats.events += 1
        if await self._publish(node, node.joined_event(self.now()), aggregate_id=node.node_id):
            node.joined = True

    # ------------------------------------------------------------------ heartbeats

    async def _beat_forever(self) -> None:
        nodes = list(self.nodes.values())
        interval = self.options.heartbeat_s
        slots = max(1, min(len(nodes), round(interval / TICK_S)))
        buckets = [nodes[i::slots] for i in range(slots)]
        loop = asyncio.get_running_loop()
        next_at, k = loop.time(), 0
        while True:
            next_at += interval / slots
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            for node in buckets[k % slots]:
                if node.node_id in self._inflight:
                    continue  # still publishing its last beat: skipped, not queued
                if node.alive and not node.joined:
                    self._inflight.add(node.node_id)
                    self._spawn(self._rejoin(node))
                elif node.alive:
                    self._inflight.add(node.node_id)
                    self._spawn(self._beat(node))
            k += 1
            if loop.time() > next_at + interval:
                next_at = loop.time()  # fell behind: do not burst to catch up

    async def _beat(self, node: SimNode) -> None:
        try:
            if await self._publish(node, node.heartbeat(self.now()), aggregate_id=node.node_id):
                self.stats.heartbeats += 1
            # GPU health, judged as a node agent judges NVML's readings at each beat
            for event in node.health_events(self.now(), self.thresholds):
                await self._publish(node, event, aggregate_id=node.node_id)
        finally:
            self._inflight.discard(node.node_id)

    async def _rejoin(self, node: SimNode) -> None:
        try:
            await self._join(node)
        finally:
            self._inflight.discard(node.node_id)

    # ------------------------------------------------------------------ placements

    async def _follow(self, event_type: str, start_seq: int) -> None:
        subject = filter_for(event_type)
        while True:
            try:
                async for batch in follow(self.js, filter_subject=subject, start_seq=start_seq):
                    for seq, data in batch:
                        start_seq = seq + 1
                        try:
                            await self._on_event(event_type, seq, data)
                        except Exception:  # one odd event never stops the reader
                            log.exception("%s at %d", event_type, seq)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a reader lost with its server: read on from where it was
                log.warning("reading %s: %s; reading on from %d", event_type, exc, start_seq)
                await asyncio.sleep(1.0)

    def _concerns_us(self, event_type: str, fields: dict[str, Any]) -> bool:
        payload = fields.get("payload")
        if not isinstance(payload, dict):
            return False
        runs_here = str(fields.get("aggregate_id")) in self.sandboxes
        if event_type == events.SandboxStopRequested.TYPE:
            return runs_here
        if event_type in MIGRATION_TYPES:
            return bool({payload.get("from_node"), payload.get("to_node")} & set(self.nodes))
        return runs_here or str(payload.get("node_id")) in self.nodes

    async def _on_event(self, event_type: str, seq: int, data: bytes) -> None:
        try:
            fields = unpack_fields(data)
        except ValueError:
            return
        if not self._concerns_us(event_type, fields):
            return  # another node's: not ours to verify or act on
        admitted = await self.gate.admit(data, stream_seq=seq, event_type=event_type)
        if isinstance(admitted, Refusal):
            await self._refused(event_type, seq, fields, admitted)
            return
        if event_type in placement_types():
            await self._on_placed(admitted)
        elif event_type == events.UnitLost.TYPE:
            self._on_lost(admitted)
        elif event_type == events.SandboxStopRequested.TYPE:
            await self._on_stop(admitted)
        elif event_type == events.UnitMigrationStarted.TYPE:
            self._spawn(self._migrate(admitted))
        elif event_type == events.UnitMigrationFailed.TYPE:
            self._aborted.add(str(admitted.payload.get("migration_id")))

    async def _refused(
        self, event_type: str, seq: int, fields: dict[str, Any], refusal: Refusal
    ) -> None:
        """Never act on it; answer it with ``security.event_rejected`` as a node agent's
        consumer does — once, from the node it names (or runs the sandbox), not from every
        simulated node (each real node agent's durable would answer it)."""
        self.stats.refused += 1
        sid = str(fields.get("aggregate_id"))
        note = f"{refusal.event_type} of {sid} by {refusal.producer}: "
        self.stats.last_refusals.append(f"{note}{refusal.reason}: {refusal.detail}"[:300])
        log.warning("refused %s%s (%s)", note, refusal.reason, refusal.detail)
        payload = fields.get("payload")
        named = str(payload.get("node_id")) if isinstance(payload, dict) else ""
        keys = self._keys_of(sid)
        node_id = named if named in self.nodes else (self.where[keys[0]] if keys else None)
        node = self.nodes.get(node_id or "")
        if node is None or not node.alive:
            return
        durable = natsperms.durable_name("nodeagent", event_type, node.node_id)
        answer = events.EventRejected(
            stream_seq=seq,
            event_id=refusal.event_id,
            event_type=refusal.event_type,
            producer=refusal.producer,
            subject=str(fields.get("subject") or filter_for(event_type))[:300],
            consumer=durable,
            reason=refusal.reason,
            detail=refusal.detail,
        )
        await self._publish(
            node,
            answer,
            aggregate_id=durable,
            event_id=derive_event_id(f"{durable}/{seq}", events.EventRejected.TYPE),
        )

    async def _on_placed(self, envelope: Envelope) -> None:
        """A placement: ``sandbox.scheduled`` (the whole sandbox on one node; its lifecycle
        reported) or ``unit.placed`` (one compute unit, GPUs named; reported only by the
        heartbeats: ``sandbox.ready`` belongs to the node of ``sandbox.scheduled``)."""
        p = envelope.payload
        sid = str(p.get("sandbox_id") or envelope.aggregate_id)
        unit_name = p.get("unit") if envelope.type != events.SandboxScheduled.TYPE else None
        key = f"{sid}/{unit_name}" if unit_name else sid
        attempt = int(p.get("attempt") or 1)
        if attempt <= self.attempts.get(key, 0):
            return  # an older placement (or the same one read again): never moves it back
        self.attempts[key] = attempt
        old = self.where.get(key)
        if old is not None:  # it moved: the copy here is fenced off, nothing published
            self._drop(old, key)
        node = self.nodes.get(str(p.get("node_id")))
        if node is None or not node.alive:
            return  # another node's; or this one crashed (the scheduler will find out)
        resources = events.Resources.model_validate(p.get("resources") or {})
        reports = envelope.type == events.SandboxScheduled.TYPE
        if reports:
            # The scheduler places every unit (``main`` too) with its own ``unit.placed``, which
            # takes the unit's CPUs, memory and GPUs; ``sandbox.scheduled`` then only carries
            # the sandbox's lifecycle here (ready, exited), not a second copy of its resources.
            resources = events.Resources(cpus=0, memory_bytes=0)
        indices = p.get("gpu_indices")
        if isinstance(indices, list):
            gpus = tuple(int(i) for i in indices)
        else:
            gpus = tuple(node.free_gpus()[: resources.gpus])
        now = self.now()
        run_for = node.run_for_s if node.run_for_s is not None else self.options.run_for_s
        tenant = await self.gate.tenant_of(sid) if reports else None
        cpus = float(p["cpu_millicores"]) / 1000 if "cpu_millicores" in p else resources.cpus
        memory = int(p.get("memory_bytes") or resources.memory_bytes)
        unit = Unit(sid, cpus, memory, gpus, now, now + run_for, tenant)
        unit.key, unit.reports = key, reports
        node.units[key] = unit
        self.where[key] = node.node_id
        self.sandboxes.setdefault(sid, set()).add(key)
        heapq.heappush(self._ends, (unit.until, node.node_id, key))
        if not reports:
            self.stats.units_placed += 1
            return
        self.stats.placements += 1
        ready = events.SandboxReady(
            node_id=node.node_id,
            pid=100_000 + self.stats.placements,
            cgroup=f"/sys/fs/cgroup/dsec/{node.node_id}/{sid}",
            start_latency_ms={"total": 0.0},
        )
        await self._publish(
            node,
            ready,
            aggregate_id=sid,
            tenant=tenant,
            event_id=derive_event_id(envelope.id, "sandbox.ready"),
        )

    def _drop(self, node_id: str, key: str) -> Unit | None:
        """Forget a unit on a node (no event)."""
        node = self.nodes.get(node_id)
        self.where.pop(key, None)
        unit = node.units.pop(key, None) if node is not None else None
        if unit is not None:
            keys = self.sandboxes.get(unit.sandbox_id, set())
            keys.discard(key)
            if not keys:
                self.sandboxes.pop(unit.sandbox_id, None)
        return unit

    def _keys_of(self, sid: str) -> list[str]:
        return sorted(self.sandboxes.get(sid, ()))

    def _on_lost(self, envelope: Envelope) -> None:
        """The loss of one placement attempt on one node: only units of that attempt (or an
        earlier one) leave it; the replayed bytes of an old attempt's loss never drop a later
        placement on the same node."""
        node_id = str(envelope.payload.get("node_id"))
        try:
            attempt = int(envelope.payload.get("attempt") or 0)
        except (TypeError, ValueError):
            return
        for key in self._keys_of(envelope.aggregate_id):
            if self.where.get(key) == node_id and self.attempts.get(key, 0) <= attempt:
                self._drop(node_id, key)  # fenced: its own cleanup, no event

    async def _on_stop(self, envelope: Envelope) -> None:
        for key in self._keys_of(envelope.aggregate_id):
            node_id = self.where[key]
            unit = self._drop(node_id, key)
            if unit is not None and unit.reports:
                await self._exited(self.nodes[node_id], unit, "stopped", -1)

    async def _exited(
        self, node: SimNode, unit: Unit, reason: events.ExitReason, code: int
    ) -> None:
        payload = events.SandboxExited(
            exit_code=code,
            reason=reason,
            duration_s=round(self.now() - unit.started, 3),
        )
        if await self._publish(
            node,
            payload,
            aggregate_id=unit.sandbox_id,
            tenant=unit.tenant,
            event_id=derive_event_id(unit.sandbox_id, "sandbox.exited"),
        ):
            self.stats.exited += 1

    async def _end_units(self) -> None:
        """Units whose run time is over exit by themselves (``ok``)."""
        while True:
            await asyncio.sleep(0.2)
            now = self.now()
            while self._ends and self._ends[0][0] <= now:
                _, node_id, key = heapq.heappop(self._ends)
                node = self.nodes[node_id]
                unit = node.units.get(key)
                if unit is None or unit.until > now:
                    continue  # dropped, stopped or moved meanwhile
                self._drop(node_id, key)
                if node.alive and unit.reports:
                    self._spawn(self._exited(node, unit, "ok", 0))

    # ------------------------------------------------------------------ migrations

    async def _migrate(self, envelope: Envelope) -> None:
        """Carry out a migration whose source is simulated here (:mod:`.migration`)."""
        p = envelope.payload
        sid, mid = envelope.aggregate_id, str(p.get("migration_id"))
        unit, path = str(p.get("unit") or "main"), str(p.get("path") or "criu")
        src = self.nodes.get(str(p.get("from_node")))
        dst = self.nodes.get(str(p.get("to_node")))
        if src is None or mid in self._migrations or mid in self._aborted:
            return  # the source is not simulated here (it moves the unit), or done before
        self._migrations.add(mid)
        ends = {
            "unit": unit,
            "migration_id": mid,
            "from_node": src.node_id,
            "to_node": str(p.get("to_node")),
        }
        keys = keys_of(sid, unit, self.where, src.node_id)
        if not src.alive:
            return  # a crashed source says nothing (the scheduler's timeout ends it)
        if not keys:
            await self._migration_failed(
                src, sid, ends, f"unit {unit} does not run on {src.node_id}", "checkpoint", False
            )
            return
        if dst is None or not dst.alive:
            await self._migration_failed(
                src, sid, ends, f"target {ends['to_node']} does not answer", "transfer", True
            )
            return
        running = src.units[keys[0]]
        plan = model(path, running.memory_bytes)
        times = await carry_out(plan, self._aborted, mid)
        if times is None or mid in self._aborted:
            return  # failed meanwhile (the scheduler's timeout): the unit stays
        if not dst.alive or any(self.where.get(k) != src.node_id for k in keys):
            await self._migration_failed(
                src, sid, ends, "the unit or the target went away during the move", "restore",
                src.alive and all(self.where.get(k) == src.node_id for k in keys),
            )  # fmt: skip
            return
        frozen, resumed = times
        to_gpus = tuple(int(i) for i in p.get("to_gpus") or ())
        for key in keys:
            old = src.units.pop(key)
            new = moved_unit(old, to_gpus, own_gpus=not old.reports)
            dst.units[key] = new
            self.where[key] = dst.node_id
            heapq.heappush(self._ends, (new.until, dst.node_id, key))
        interruption = (resumed - frozen) * 1000
        self.stats.migrated += 1
        await self._publish(
            dst,
            events.UnitMigrated(
                **ends,
                from_gpus=[int(i) for i in p.get("from_gpus") or ()],
                to_gpus=list(to_gpus),
                reason=p.get("reason") or "operator",
                path=path,
                interruption_ms=round(interruption, 3),
                bytes_moved=plan.bytes_moved,
                precopy_rounds=plan.rounds,
                stages_ms=plan.stages(),
            ),
            aggregate_id=sid,
            tenant=running.tenant or await self.gate.tenant_of(sid),
            event_id=derive_event_id(mid, events.UnitMigrated.TYPE),
        )

    async def _migration_failed(
        self,
        node: SimNode,
        sid: str,
        ends: dict[str, str],
        reason: str,
        stage: str,
        still_running: bool,
    ) -> None:
        await self._publish(
            node,
            events.UnitMigrationFailed(
                **ends,
                reason=reason,
                stage=stage,
                still_running=still_running,
            ),
            aggregate_id=sid,
            tenant=await self.gate.tenant_of(sid),
            event_id=derive_event_id(ends["migration_id"], events.UnitMigrationFailed.TYPE),
        )

    # ------------------------------------------------------------------ script

    async def _run_script(self) -> None:
        ids = list(self.nodes)
        for step in self.steps:
            await asyncio.sleep(max(0.0, step.at - self.now()))
            for node_id in step.nodes(ids):
                await self.apply(step, self.nodes[node_id])

    async def apply(self, step: Step, node: SimNode) -> None:
        """Apply one scripted step to one node now."""
        action, now = step.action, self.now()
        log.info("script t=%.0f: %s %s", step.at, node.node_id, action)
        if action == "crash":
            node.alive = False
            for key in list(node.units):
                self._drop(node.node_id, key)
        elif action == "recover":
            if not node.alive:
                node.restart()
                self.publishers[node.node_id] = self._publisher(node.node_id)  # a new chain
        elif action == "run_for":
            node.run_for_s = step.run_for
        else:
            gpus = range(len(node.gpus)) if step.gpu == "all" else [int(step.gpu or 0)]
            for gpu in gpus:
                if gpu >= len(node.gpus):
                    continue
                state = node.health[gpu]
                if action == "temperature":
                    node.heat(gpu, float(step.temperature or 0), step.over, now)
                elif action == "xid":
                    node.xid(gpu, int(step.xid or 0), step.count)
                elif action == "ecc":
                    state.ecc += int(step.ecc or 0)
                elif action == "throttle":
                    state.throttle = frozenset(step.throttle or ())
                elif action == "nvlink_utilization":
                    state.nvlink_utilization = step.nvlink_utilization
                elif action == "nvlink_errors":
                    state.nvlink_errors += int(step.nvlink_errors or 0)
                elif action == "heal":
                    node.heal(gpu)

    # ------------------------------------------------------------------ status

    def status(self) -> dict[str, Any]:
        """The status line (JSON-ready)."""
        rate, cpu_us = self.stats.rate()
        nodes = self.nodes.values()
        return {
            "t": round(self.now(), 1),
            "nodes": len(self.nodes),
            "alive": sum(1 for n in nodes if n.alive and n.joined),
            "events": self.stats.events,
            "heartbeats": self.stats.heartbeats,
            "events_per_s": round(rate, 1),
            "cpu_us_per_event": round(cpu_us, 1),
            "publish_errors": self.stats.publish_errors,
            "placements": self.stats.placements,
            "units_placed": self.stats.units_placed,
            "running": sum(len(n.units) for n in nodes),
            "exited": self.stats.exited,
            "migrated": self.stats.migrated,
            "refused": self.stats.refused,
            "last_refusals": list(self.stats.last_refusals),
            "rss_mib": rss_mib(),
        }

    async def _status_forever(self) -> None:
        while True:
            await asyncio.sleep(self.options.status_every_s)
            self.report({"event": "status", **self.status()})
