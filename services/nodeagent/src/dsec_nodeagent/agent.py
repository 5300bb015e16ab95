"""The node agent's orchestration: from ``sandbox.scheduled`` to a running sandbox and back.

Every node agent sees every ``sandbox.scheduled`` (through its own node's durable) and acts only
on those that name its node, and only while the sandbox's lifecycle (the fold of its authentic
events, :mod:`dsec_core.lifecycle`) says it is scheduled here with that attempt. It stages the
environment the named ``env.built`` points to (:mod:`.envstage`), reads the compiled plan from
the log (typed, each rule with its spec line: the YAML is never parsed again), fetches the code
bundle, injects the runtime context (secrets from Vault, data from S3, config maps), attaches
the egress programs to the sandbox's cgroup *before* the workload's first instruction, launches
it and publishes ``context.injected`` and ``sandbox.ready``. When the sandbox ends,
``sandbox.exited`` is published with an id derived from the sandbox id, so a node-agent restart
that re-adopts it can never publish a second one.

Fencing: a copy this node still runs after the sandbox was placed elsewhere (``unit.lost`` for
this node, or found at restart when the fold names another node or a newer attempt) is stopped
and cleaned up without any event: the sandbox's history belongs to its new node.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import math
import os
import sys
import time
import urllib.parse
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec_core import events, lifecycle, retention
from dsec_core.codebundle import BundleError, archive_bound, extract_bundle, open_real_dir
from dsec_core.envelope import Envelope
from dsec_core.ids import derive_event_id
from dsec_core.layout import NodeLayout
from dsec_core.natsclient import auth_options
from dsec_core.objectstore import BundleAltered, ObjectMissing, fetch_bundle
from dsec_core.objectstore import client as s3_client
from dsec_core.settings import Settings
from dsec_core.spec import EnforcementPlan
from dsec_core.spec.plan import ResourceLimits
from dsec_core.stackinfo import stack_dirs
from dsec_core.subjects import subject_for
from dsec_core.text import bound
from dsec_core.threads import to_the_end
from dsec_core.trust import Gate
from prometheus_client import Counter, Gauge, Histogram

from dsec_nodeagent import placement
from dsec_nodeagent.context.configmap import ConfigMaps
from dsec_nodeagent.context.injector import ContextInjector, PreparedContext
from dsec_nodeagent.context.models import ContextError
from dsec_nodeagent.context.s3 import S3Materializer
from dsec_nodeagent.context.vault import VaultSecrets
from dsec_nodeagent.envstage import EnvStageError, EnvStager, EnvStageUnavailable, Staged
from dsec_nodeagent.gpunode import GpuNode
from dsec_nodeagent.gpuslice import SliceError
from dsec_nodeagent.outlet import EventOutlet
from dsec_nodeagent.recording import Prepared, Recordings, ReplayUnavailable
from dsec_nodeagent.recording.store import KEY_PATH as RECORDING_KEY_PATH
from dsec_nodeagent.recording.store import RecordingStore
from dsec_nodeagent.refusals import Key
from dsec_nodeagent.sandbox.audit import LandlockRefusal, describe
from dsec_nodeagent.sandbox.domain import STAGE_ORDER
from dsec_nodeagent.sandbox.manager import SandboxManager
from dsec_nodeagent.sandbox.models import (
    AgentIdentity,
    ExitReason,
    Limits,
    Mount,
    SandboxConfig,
    SandboxExited,
    SandboxReady,
    SandboxStartError,
)
from dsec_nodeagent.sandbox.notify import KernelRefusal
from dsec_nodeagent.semantic.compile import rules_from_plan
from dsec_nodeagent.semantic.models import SemanticDecision, SemanticRules
from dsec_nodeagent.semantic.reports import (
    MESSAGE_LIMIT,
    TARGET_LIMIT,
    WITHHELD,
    Refused,
    check_report,
)
from dsec_nodeagent.snapshots import SnapshotStartRefused
from dsec_nodeagent.state.keeper import SandboxState, StateKeeper
from dsec_nodeagent.state.sealing import TenantKeys
from dsec_nodeagent.state.wiring import ENV_HANDOVER_FROM
from dsec_nodeagent.tlsproxy import CA_BUNDLE_PATH, ProxyGrant, TlsProxies
from dsec_nodeagent.toolwatch import SecretLease, ToolWatch, effective_tools

ENV_TOOLS = "DSEC_TOOLS"
"""The effective tool policies handed to the SDK (dsec_sdk.tools.policy)."""

log = logging.getLogger(__name__)

_WARNINGS = 32
_WARNING_CHARS = 500
"""What ``sandbox.ready`` carries of a start's warnings at most (a spec's paths are in them)."""
RETENTION_INTERVAL_S = 300.0
"""How often the node agent applies DSEC_SANDBOX_KEEP_HOURS / DSEC_SANDBOX_KEEP_MAX."""

REPORTS_REFUSED = Counter(
    "dsec_semantic_reports_refused_total",
    "Reports of an in-sandbox semantic layer that do not fit the sandbox's plan (not published)",
    ["reason"],
)

START_STAGES = ("env_stage", *STAGE_ORDER, "total")
"""The stages of ``sandbox.ready.start_latency_ms`` (a fixed set: the histogram's labels)."""
START_SECONDS = Histogram(
    "dsec_sandbox_start_seconds",
    "Sandbox start latency on its node, by stage (env_stage, plan, cgroup, spawn, ..., exec) "
    "and total (launch call to the workload's execve)",
    ["stage"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
STARTS = Counter(
    "dsec_sandbox_starts_total",
    "Sandbox starts on this node, by outcome (started; failed: sandbox.failed published)",
    ["outcome"],
)
_AGENTS: weakref.WeakSet[NodeAgent] = weakref.WeakSet()
RUNNING = Gauge("dsec_sandboxes_running", "Sandboxes running on this node (watched by its agent)")


def _running() -> float:
    return float(sum(len(agent.manager.running()) for agent in list(_AGENTS)))


RUNNING.set_function(_running)


def observe_start(latency_ms: dict[str, float]) -> None:
    """Record one start's ``sandbox.ready.start_latency_ms`` (unknown stages are skipped)."""
    for stage, ms in latency_ms.items():
        if stage in START_STAGES:
            START_SECONDS.labels(stage).observe(ms / 1000)


BeforeStart = Callable[[str, Path, int, EnforcementPlan, tuple[int, ...]], Awaitable[None]]
"""Egress before a sandbox's first instruction: its id, cgroup, cgroup id, plan and the node
agent's listeners that serve it alone (its HTTPS proxy's port, which no neighbour reaches)."""


StartFromSnapshot = Callable[[str, str, str, int], Awaitable[tuple[Path, events.SnapshotRestored]]]
"""(sandbox id, snapshot, tenant, max code size) → its code dir and ``snapshot.restored``."""


RESTART_BACKOFF_S = 0.2
"""Wait before the first restart of a stateful sandbox; doubled for each next one ..."""
RESTART_BACKOFF_MAX_S = 5.0
"""... up to this."""
RESTARTABLE = frozenset({ExitReason.ERROR, ExitReason.OOM, ExitReason.PIDS, ExitReason.DISK})
"""Exits after which a stateful sandbox with ``state.restart: on-failure`` starts again: it died
(a signal, a non-zero exit, a limit). Never one the node agent caused (stopped, timeout,
policy, policy_flood, a hand-over) nor a clean exit."""
RESTARTS = Counter(
    "dsec_sandbox_restarts_total",
    "Stateful sandboxes started again in place after dying (sandbox.restarted), by reason",
    ["reason"],
)


def restart_backoff_s(restarts: int) -> float:
    """The wait before restart number ``restarts + 1``: 0.2 s doubling up to 5 s."""
    return min(RESTART_BACKOFF_MAX_S, RESTART_BACKOFF_S * 2.0 ** max(0, restarts))


@dataclass
class Launched:
    """What the node agent keeps of a running sandbox to start it again in place: the very
    config it ran with (environment, mounts, proxy), the plan its egress is attached under."""

    config: SandboxConfig
    plan: EnforcementPlan
    egress_plan: EnforcementPlan
    first_started_at: float
    restarts: int = 0


class StartRefused(Exception):
    """A deterministic reason the sandbox cannot start (no retry helps): becomes
    ``sandbox.failed`` at once."""


EXIT_WAIT_S = 30.0
"""How long a start waits for the exit handling of an earlier copy of its sandbox on the node
(its releases: a NATS outage can hold its event) before it is given back to be retried."""


@dataclass
class _Exits:
    """The exits of copies of one sandbox being handled now; ``done`` set once none is."""

    count: int = 0
    done: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


class StartBusy(Exception):
    """Another copy of the sandbox holds its id on this node (a migration's restore, a start's
    leftovers not yet cleaned up): the start is retried later, with nothing of it made and
    nothing of the other copy touched."""


class StartStopped(Exception):
    """A stop was requested while the sandbox was starting: the start ends where it is, its
    steps undone, without an event of its own (the stop's ``sandbox.exited`` ends it)."""


ENDED_HERE_KEEP_S = 3600.0
"""How long a node agent remembers a sandbox it ended before it ran (stopped while starting,
or its start failed): a start or a stop that comes after that end, before the log shows it,
must not start it or end it twice."""


class NodeAgent:
    """Launches and watches the sandboxes of this node."""

    def __init__(
        self,
        settings: Settings,
        outlet: EventOutlet,
        gate: Callable[[], Gate],
        before_start: BeforeStart | None = None,
        on_stopped: Callable[[str], Awaitable[None]] | None = None,
        ipc_socket: Path | None = None,
        state_keeper: StateKeeper | None = None,
    ) -> None:
        self.settings = settings
        self.home = settings.home.resolve()
        self.layout = NodeLayout.of(self.home)
        self.node_id = settings.node_id
        self.outlet = outlet
        self._gate = gate
        self._before_start = before_start
        self._on_stopped = on_stopped
        self.manager = SandboxManager(
            self.home,
            python=Path(sys.executable),
            on_exit=self._exited,
            on_decision=self._decided,
            on_kernel_refusal=self._refused,
            on_landlock_refusal=self._landlock_refused,
            ipc_socket=ipc_socket,
            uid_base=settings.sandbox_uid_base,
            node_id=settings.node_id,
        )
        self.injector = self._injector()
        self._contexts: dict[str, PreparedContext] = {}
        self._keepalive: dict[str, asyncio.Task[None]] = {}
        self._retention: asyncio.Task[None] | None = None
        self._rules: dict[str, SemanticRules] = {}
        # (name, value) of the secrets injected into each sandbox: scrubbed out of its reports
        self._secrets: dict[str, tuple[tuple[str, str], ...]] = {}
        self.proxies = TlsProxies(
            self.layout.tls_proxy, self._http_refused, settings.tls_proxy_upstream_ca
        )
        self.recordings = Recordings(self.layout, _recording_store(settings))
        """Record and replay (docs/experiments.md): per sandbox, before its start and after
        its end."""
        self.envs = EnvStager(
            self.layout,
            s3_client(settings) if settings.endpoint("s3_endpoint") else None,
            settings.s3_bucket,
        )
        self._attempts: dict[str, int] = {}  # sandbox -> placement attempt it runs here as
        self._starting: dict[str, asyncio.Event] = {}  # sandboxes being started right now
        # Sandboxes ended here before they ran: "stopped" (a stop came while it was starting,
        # or before) or "failed" (its start failed), with when; see ENDED_HERE_KEEP_S
        self._ended_here: dict[str, tuple[str, float, list[events.Payload]]] = {}
        self._start_stops: dict[str, asyncio.Event] = {}  # set: a stop wants the start to end
        self._fenced: set[str] = set()  # stale copies being stopped without any event
        self.state_keeper = state_keeper
        """Told about each stateful sandbox before it runs and when it ended for good."""
        self._launched: dict[str, Launched] = {}  # running sandboxes, to restart in place
        # sandboxes waiting to be started again: set to give the restart up (stop, fence)
        self._restarting: dict[str, asyncio.Event] = {}
        self._stop_wanted: set[str] = set()
        self._restart_tasks: dict[str, asyncio.Task[object]] = {}  # exit handlers in a restart
        self._closing = False  # shutting down: nothing is restarted any more
        self._exiting: dict[str, _Exits] = {}  # exits being handled, by sandbox
        # stateful sandboxes re-adopted at start (not restartable): forgotten at their exit
        self._adopted_plans: dict[str, EnforcementPlan] = {}
        self.start_from_snapshot: StartFromSnapshot | None = None
        """Puts a snapshot's code in a new sandbox's code dir (``dsec_nodeagent.snapshots``)."""
        self.expect_handover: Callable[[str, str], None] | None = None
        self.forget_handover: Callable[[str], None] | None = None
        # Tool-call reports -> dsec_tool_* metrics, tool.degraded/recovered (docs/tools.md).
        self.toolwatch: ToolWatch | None = None
        """Tells the IPC broker that a new sandbox takes over an old one's tool name."""
        self.gpus: GpuNode | None = None
        """Slices, fences and watches the GPUs of units placed on GPUs (``gpunode``)."""
        _AGENTS.add(self)  # dsec_sandboxes_running counts its manager's sandboxes

    def _injector(self) -> ContextInjector:
        s = self.settings
        vault = None
        addr, token = s.endpoint("vault_addr"), s.endpoint("vault_token")
        if addr and token:
            vault = VaultSecrets(str(addr), str(token))
        s3 = None
        if s.endpoint("s3_endpoint"):
            s3 = S3Materializer(
                s3_client(s), self.layout.s3_cache, unwrap=vault.unwrap if vault else None
            )
        return ContextInjector(
            self.layout.sandboxes,
            vault=vault,
            s3=s3,
            configmaps=ConfigMaps(s.nats_endpoint(), nats_options=auth_options(s)),
        )

    async def start(self) -> None:
        """Re-adopt sandboxes that survived a restart; clean up the ones that ended."""
        report = await self.manager.reconcile()
        if self.gpus is not None:  # (their slices were taken over at the GPU side's start)
            await self.gpus.keep_only(report.adopted)
        if self.manager.zygote is not None:  # the first launch need not start the launcher
            await self.manager.zygote.prestart()
        self.proxies.forget_all()  # a re-adopted sandbox's proxy is gone: it fails closed
        log.info("reconciled: adopted %s, cleaned %s", report.adopted, report.cleaned)
        for sid in report.adopted:
            state = await self.lifecycle(sid)
            if not placement.stale(state, self.node_id):
                self._attempts[sid] = state.attempt
                await self._readopt_state(sid)
                continue
            # rescheduled while this agent was away (partitioned and declared lost, drained)
            log.warning("%s: now %s; stopping the stale copy here", sid, _where(state))
            await self.fence(sid)
        self._retention = asyncio.create_task(self._retain_forever())

    async def _readopt_state(self, sid: str) -> None:
        """A sandbox that outlived its node agent. Recording: what it recorded is saved at its
        exit. Stateful: registered with this one's keeper again (its agent reconnects),
        forgotten at its exit; it is not restarted (the config it ran with, secrets included,
        died with the previous node agent)."""
        found = await self._maybe_last("spec.validated", sid)
        validated = found.decoded() if found is not None else None
        running = self.manager.get(sid)
        if not isinstance(validated, events.SpecValidated) or running is None:
            return
        if self.recordings.readopt(sid, validated.plan):
            log.info("%s: re-adopted while recording; its recording is saved at its exit", sid)
        if self.state_keeper is None or validated.plan.state is None:
            return
        self._adopted_plans[sid] = validated.plan
        self._register_state(sid, validated.plan, Path(running.ready.cgroup_path), None)

    async def shutdown(self) -> None:
        """Stop watching; sandboxes keep running (re-adopted at the next start) — unless the
        stack is going down (``dsec down``): then each is stopped and cleaned up, and its
        ``sandbox.exited`` published, before the node agent exits."""
        if self._retention is not None:
            self._retention.cancel()
        await self.injector.close()  # what starts cancelled mid-step made: released first
        stop = retention.down_marker(self.home).exists()
        await self._end_restarts(stopping=stop)
        if stop:
            log.info("the stack is going down: stopping %s", self.manager.running())
        else:
            for task in self._keepalive.values():
                task.cancel()
        await self.manager.shutdown(stop_sandboxes=stop)
        await self.proxies.close_all()  # a re-adopted sandbox's proxy is gone: fails closed

    async def _end_restarts(self, *, stopping: bool) -> None:
        """Sandboxes waiting to restart are not started again by a node agent going away:
        their exit is final now (``stopped`` when the stack goes down), published before the
        outlet closes."""
        self._closing = True
        waiting = [task for task in self._restart_tasks.values() if not task.done()]
        for sid, give_up in list(self._restarting.items()):
            if stopping:
                self._stop_wanted.add(sid)
            give_up.set()
        if waiting:
            await asyncio.wait(waiting, timeout=10.0)

    # --------------------------------------------------------------- retention

    async def collect_garbage(self) -> list[retention.Removal]:
        """Remove ended sandboxes' directories beyond the operator's retention (each logged)."""
        keep_s = self.settings.sandbox_keep_hours * 3600
        keep_max = self.settings.sandbox_keep_max

        def sweep() -> list[tuple[retention.Removal, int]]:
            now = time.time()
            chosen = retention.choose(
                retention.scan(self.home, now), now, older_than_s=keep_s, keep_max=keep_max
            )
            done = []
            for removal in chosen:
                try:
                    freed = retention.remove(self.home, removal)
                except Exception as exc:  # one sandbox's leftovers never stop the sweep
                    log.warning("retention: cannot remove %s: %s", removal.entry.path, exc)
                    continue
                if freed is not None:
                    done.append((removal, freed))
            return done

        removed = await asyncio.to_thread(sweep)
        for removal, freed in removed:
            log.info(
                "retention: removed the directory of ended sandbox %s (%d bytes): %s",
                removal.entry.sandbox_id,
                freed,
                removal.why,
            )
        return [removal for removal, _ in removed]

    async def _retain_forever(self) -> None:
        while True:
            try:
                await self.collect_garbage()
            except Exception:  # retention must never take the node agent down
                log.exception("retention sweep failed")
            await asyncio.sleep(RETENTION_INTERVAL_S)

    # --------------------------------------------------------------- the spec, from the log

    async def _last(
        self, event_type: str, sandbox_id: str, event_id: str | None = None
    ) -> Envelope:
        """The authentic event of ``event_type`` (the one with ``event_id`` when given): a
        forged or unauthorized message on the same subject is never read as the spec."""
        found = await self._gate().find(subject_for(event_type, sandbox_id), event_id=event_id)
        if found is None:
            which = f" {event_id}" if event_id else ""
            raise StartRefused(f"no authentic {event_type}{which} recorded for {sandbox_id}")
        return found

    async def _maybe_last(self, event_type: str, sandbox_id: str) -> Envelope | None:
        try:
            return await self._last(event_type, sandbox_id)
        except StartRefused:
            return None

    async def lifecycle(self, sandbox_id: str) -> lifecycle.Lifecycle:
        """The sandbox's state: the fold of its authentic lifecycle events, in log order."""
        return await self._gate().lifecycle(sandbox_id)

    def _code_path(self, sandbox_id: str) -> Path:
        """Where the sandbox's code copy lives on this node (``sandbox.ready.code_dir``)."""
        return self.layout.sandbox(sandbox_id).code

    async def _code_dir(
        self, sandbox_id: str, code: events.BundleRef | None, max_size: int
    ) -> Path | None:
        if code is None:
            return None
        if code.expanded_size is not None and code.expanded_size > max_size:
            raise StartRefused(
                f"code bundle unusable: it expands to {code.expanded_size} bytes, over "
                f"include_code.max_size ({max_size} bytes)"
            )
        dest = self._code_path(sandbox_id)
        if dest.exists():  # a redelivery after a crash: the bundle is immutable, reuse it
            return dest
        # streamed to a file beside the copy, never held whole in the node agent's memory
        archive = dest.with_name(f".{dest.name}.tar.zst")
        await asyncio.to_thread(archive.parent.mkdir, parents=True, exist_ok=True)
        try:
            try:
                await fetch_bundle(
                    self.settings, code.object_key, code.digest, archive,
                    max_bytes=archive_bound(max_size),
                )  # fmt: skip
            except (ObjectMissing, BundleAltered) as exc:
                raise StartRefused(str(exc)) from None
            try:
                await asyncio.to_thread(extract_bundle, archive, dest, max_size=max_size)
            except BundleError as exc:
                raise StartRefused(f"code bundle unusable: {exc}") from None
        finally:
            await asyncio.to_thread(archive.unlink, missing_ok=True)
        return dest

    # --------------------------------------------------------------- handlers

    async def on_scheduled(
        self, envelope: Envelope, event: events.SandboxScheduled
    ) -> Sequence[events.Payload]:
        """Start a sandbox scheduled on this node (every other node acks and skips it)."""
        sid = envelope.aggregate_id
        if event.node_id != self.node_id:
            return []
        async with self._one_start_after_exit(sid):
            running = self.manager.get(sid)
            if running is not None:  # redelivered after a crash between launch and ack
                # (a late copy of an older placement does not make the copy an older one)
                self._attempts[sid] = max(event.attempt, self._attempts.get(sid, 0))
                code_dir = self._code_path(sid)
                return [self._ready_event(running.ready, code_dir if code_dir.is_dir() else None)]
            state = await self.lifecycle(sid)
            why_not = placement.why_not_start(state, self.node_id, event.attempt)
            if why_not is not None:
                log.info("%s: not starting it: %s", sid, why_not)
                return []
            ended = self._ended_here.get(sid)
            if ended is not None:  # ended here already; the log does not show it yet
                log.info("%s: not starting it: it %s here before it ran", sid, ended[0])
                # this very launch failed and its end may not have been published (a NATS
                # hiccup: delivered again): the same end again (its id is derived: published
                # once); any other launch of it starts nothing
                return [
                    p
                    for p in ended[2]
                    if isinstance(p, events.SandboxFailed) and p.failed_event_id == envelope.id
                ]
            self._start_stops[sid] = asyncio.Event()
            try:
                return await self._start(sid, envelope, event)
            finally:
                self._start_stops.pop(sid, None)

    async def still_placed_here(self, envelope: Envelope, event: events.SandboxScheduled) -> bool:
        """Whether this launch is still the sandbox's latest placement on this node and not
        started (the runtime asks before it ends one itself: its tenant full, or every attempt
        crashed): a late copy of an older placement is not ended, it would end the sandbox
        where it runs now."""
        if event.node_id != self.node_id:
            return False
        state = await self.lifecycle(envelope.aggregate_id)
        return placement.why_not_start(state, self.node_id, event.attempt) is None

    @contextlib.asynccontextmanager
    async def _one_start(self, sid: str) -> AsyncIterator[None]:
        """One start of a sandbox at a time on this node (launches run on several workers: a
        placement's launch, a later placement's back on this node, a restart): one under way
        ends first, then the next decides from what it left. Stops, fences and hand-overs wait
        for the one registered."""
        while (other := self._starting.get(sid)) is not None:
            await other.wait()
        started = self._starting[sid] = asyncio.Event()
        try:
            yield
        finally:
            started.set()
            if self._starting.get(sid) is started:
                del self._starting[sid]

    @contextlib.asynccontextmanager
    async def _one_start_after_exit(self, sid: str) -> AsyncIterator[None]:
        """:meth:`_one_start`, once no exit of a copy of ``sid`` is being handled here (its
        GPU slice, egress and context released by ``_exited``, all keyed by the id: a start
        beside it had its new slice or egress released instead). A restart in place, which
        runs inside ``_exited``, takes :meth:`_one_start` alone."""
        while True:
            while (exiting := self._exiting.get(sid)) is not None:
                try:
                    async with asyncio.timeout(EXIT_WAIT_S):
                        await exiting.done.wait()
                except TimeoutError:  # (a worker is not held for good: retried later)
                    raise StartBusy(
                        f"the exit of an earlier copy of {sid} on {self.node_id} is still "
                        f"being handled after {EXIT_WAIT_S:g} s; retried"
                    ) from None
            async with self._one_start(sid):
                if sid not in self._exiting:
                    yield
                    return

    async def _start(
        self, sid: str, envelope: Envelope, event: events.SandboxScheduled
    ) -> Sequence[events.Payload]:
        if self.manager.busy(sid):
            raise StartBusy(f"{sid} is held on {self.node_id} by another copy of it; retried")
        staging: asyncio.Task[Staged] | None = None
        hooked: list[bool] = [False]  # whether its launch's hook ran (egress attached)
        try:
            built_env = await self._last("env.built", sid, event.env_built_id)
            built = built_env.decoded()
            assert isinstance(built, events.EnvBuilt)
            # The environment is staged while the code, secrets and data are fetched: on a
            # cold node both are downloads, and neither needs the other.
            staging = asyncio.create_task(self._stage(built))
            self._attempts[sid] = event.attempt
            return await self._launch(sid, staging, built_env, hooked=hooked)
        except (StartRefused, ContextError, SandboxStartError, StartStopped) as exc:
            await self._undo_start(sid, detach=hooked[0])
            if isinstance(exc, ContextError) and exc.transient:
                raise  # Vault/S3/NATS unreachable: the runtime retries with backoff
            if isinstance(exc, StartStopped):
                log.info("%s: its start ended before the launch: a stop was requested", sid)
                return []  # (the stop ends it: sandbox.exited, stopped before it started)
            STARTS.labels("failed").inc()
            failed: list[events.Payload] = [
                events.SandboxFailed(
                    stage="nodeagent", reason=_reason(exc), failed_event_id=envelope.id
                )
            ]
            self._ended(sid, "failed", failed)
            return failed
        except EnvStageUnavailable:
            self._attempts.pop(sid, None)
            raise  # the object store is unreachable: retried with backoff
        except asyncio.CancelledError:  # the node agent stops: the start is given back
            if self.manager.get(sid) is None:
                with contextlib.suppress(Exception):
                    await self._undo_start(sid, detach=hooked[0])
            raise
        finally:
            if staging is not None and not staging.done():
                # The start ended before it needed the environment: the staging goes on alone
                # (never cancelled: a staged environment is reused by the next sandbox of its
                # lock, and EnvStager holds the lock until its threads end); waiting for a
                # download of minutes here would hold a stop of this sandbox, and every stop
                # on the node behind it.
                staging.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _undo_start(self, sid: str, *, detach: bool) -> None:
        """Forget a start that ended before it launched, and detach the egress it attached."""
        self._attempts.pop(sid, None)
        await self._detach_unstarted(sid, detach=detach)

    async def _detach_unstarted(self, sid: str, *, detach: bool) -> None:
        """The rules a start that did not launch kept, and (``detach``: its launch's hook ran
        before the launch failed, or was cancelled) the egress programs it attached. Egress
        its hook did not attach is never detached here: it may be another copy's of the same
        id (fail-open)."""
        self._rules.pop(sid, None)
        self._secrets.pop(sid, None)
        if detach and self._on_stopped is not None:
            await self._on_stopped(sid)

    def _ended_how(self, sid: str) -> str | None:
        """How ``sid`` ended here before it ran ("stopped", "failed"), if it did."""
        ended = self._ended_here.get(sid)
        return None if ended is None else ended[0]

    async def _staged(self, sid: str, staging: asyncio.Task[Staged]) -> Staged:
        """The staged environment, or :class:`StartStopped` as soon as a stop wants this start
        to end (the staging goes on: see ``_start``). A cancelled caller leaves it too."""
        self._stop_point(sid)
        stop = self._start_stops.get(sid)
        if stop is not None and not staging.done():
            stopped = asyncio.ensure_future(stop.wait())
            try:
                await asyncio.wait({staging, stopped}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                stopped.cancel()
            self._stop_point(sid)
        return await asyncio.shield(staging)

    def _stop_point(self, sid: str) -> None:
        """Where a start may end for a stop (between its steps, never inside one: each step
        cleans up after itself only on its own errors)."""
        if self._ended_how(sid) == "stopped":
            raise StartStopped(sid)

    def _ended(self, sid: str, how: str, outputs: list[events.Payload] | None = None) -> None:
        """Remember that ``sid`` ended here before it ran, and the end it was given (see
        :data:`ENDED_HERE_KEEP_S`). Oldest first: those past it are dropped from the front."""
        now = time.monotonic()
        self._ended_here.pop(sid, None)
        self._ended_here[sid] = (how, now, outputs or [])
        while self._ended_here:
            oldest = next(iter(self._ended_here))
            if now - self._ended_here[oldest][1] <= ENDED_HERE_KEEP_S:
                break
            del self._ended_here[oldest]

    async def _stage(self, built: events.EnvBuilt) -> Staged:
        try:
            return await self.envs.stage(built)
        except EnvStageError as exc:
            raise StartRefused(str(exc)) from None

    async def _launch(
        self,
        sid: str,
        staging: asyncio.Task[Staged],
        built: Envelope,
        *,
        standby: bool = False,
        hooked: list[bool] | None = None,
    ) -> list[events.Payload]:
        """Start ``sid`` here (its callers made sure no other copy holds its id here);
        ``hooked[0]`` is set once the launch's hook on its cgroup runs (its egress attached
        from then on)."""
        # Follow the causes back: env.built <- deps.resolved <- spec.validated <- spec.submitted,
        # each authentic; never simply the newest message on those subjects.
        resolved = await self._last("deps.resolved", sid, built.causation_id)
        validated_env = await self._last("spec.validated", sid, resolved.causation_id)
        validated = validated_env.decoded()
        submitted_env = await self._last("spec.submitted", sid, validated_env.causation_id)
        submitted = submitted_env.decoded()
        assert isinstance(validated, events.SpecValidated)
        assert isinstance(submitted, events.SpecSubmitted)
        plan = validated.plan  # typed: the compiled plan, rules with their spec lines
        if not plan.entrypoint:
            units = plan.topology.units
            if len(units) > 1:
                raise StartRefused(
                    f"a task of {len(units)} compute units ({', '.join(u.name for u in units)}): "
                    "this node agent runs single-unit sandboxes; the units' placements are in "
                    "`dsec schedule explain`, and nodes that accept units (the simulated fleet, "
                    "`dsec fleet simulate`) run them"
                )
            raise StartRefused("the spec has no `entrypoint`; nothing to run")
        code_dir = await self._code_dir(sid, validated.code, plan.code_max_size)
        restored: list[events.Payload] = []
        if submitted.start_from_snapshot is not None:
            code_dir, from_snapshot = await self._from_snapshot(sid, submitted, plan)
            restored.append(from_snapshot)
        if code_dir is not None:
            _mountpoints(code_dir, plan)
        handover_from = submitted.handover_from
        if handover_from is not None and (old := self._starting.get(handover_from)) is not None:
            await old.wait()  # its old version still starting here: hand over from it
        if handover_from is not None and self.manager.get(handover_from) is None:
            # Placed here though its old version runs elsewhere (or no more): a plain start
            # that recovers the state (docs/state.md "Hand-over").
            log.info(
                "%s: %s does not run on this node; starting without a hand-over", sid, handover_from
            )
            handover_from = None
        if standby:  # migration path handover: the warm standby of its copy on another node
            handover_from = sid
        self._stop_point(sid)
        ctx = await self.injector.prepare(
            sid, plan.secrets, plan.mounts, tenant=plan.tenant, tenant_vault=plan.tenant_vault
        )
        sliced = False
        outputs: list[events.Payload] = [
            *restored,
            *(events.ContextInjected(**record.model_dump()) for record in ctx.records),
        ]
        try:
            staged = await self._staged(sid, staging)
            config = self._config(sid, plan, staged.site_packages, code_dir, ctx)
            config = await self._gpu_slice(sid, plan, config)
            sliced = True  # (a slice refused here is another copy's: not released below)
            if handover_from is not None:
                config = config.model_copy(
                    update={"env": {**config.env, ENV_HANDOVER_FROM: handover_from}}
                )
                if self.expect_handover is not None:
                    self.expect_handover(sid, handover_from)
            try:
                recorded = await self.recordings.prepare(sid, plan)
            except ReplayUnavailable as exc:
                raise StartRefused(f"replay: {exc}") from None
            if recorded is not None:
                config = _with_recording(config, recorded)
            grant = await self.proxies.open(sid, plan)
            if grant is not None:
                config = _through_proxy(config, grant)
                if recorded is not None and recorded.http is not None:
                    self.proxies.record(sid, recorded.http)
            egress_plan = grant.egress_plan if grant else plan
            self._stop_point(sid)
            ready = await self.manager.launch(
                config, before_start=self._attach(egress_plan, plan, handover_from, hooked)
            )
        except BaseException:
            if handover_from is not None and self.forget_handover is not None:
                self.forget_handover(sid)  # its servers may no longer stand by for the old names
            await self.proxies.close(sid)
            self.recordings.forget(sid)
            await self.injector.release(ctx)
            self._forget_state(sid, plan)
            if self.gpus is not None and sliced:
                await self.gpus.release(sid)
            raise
        self._launched[sid] = Launched(config, plan, egress_plan, ready.started_at)
        self._contexts[sid] = ctx
        self._keepalive[sid] = asyncio.create_task(self.injector.keepalive(ctx))
        if self.toolwatch is not None and config.agent is not None:
            self.toolwatch.watch(sid, config.agent.name, plan, _leases(ctx, ready.started_at))
        ready_event = self._ready_event(ready, code_dir, {"env_stage": staged.ms})
        observe_start(ready_event.start_latency_ms)
        STARTS.labels("started").inc()
        outputs.append(ready_event)
        return outputs

    async def _gpu_slice(
        self, sid: str, plan: EnforcementPlan, config: SandboxConfig
    ) -> SandboxConfig:
        """``config`` with the unit's GPU slice (docs/gpu.md): its ``unit.placed`` here names
        its GPUs and share; none (no GPU, or a placement before units): unchanged."""
        if self.gpus is None:
            return config
        found = await self._maybe_last("unit.placed", sid)
        placed = found.decoded() if found is not None else None
        if not isinstance(placed, events.UnitPlaced) or placed.node_id != self.node_id:
            return config
        if placed.attempt != self._attempts.get(sid, placed.attempt) or not placed.gpu_indices:
            return config
        units = plan.topology.units
        asked = units[0].min_gpu_memory_bytes if units else 0
        try:
            sliced = await self.gpus.prepare(sid, placed, memory_quota_bytes=asked or None)
        except SliceError as exc:
            raise StartRefused(f"GPU slice: {exc}") from None
        except (OSError, RuntimeError) as exc:  # MPS daemon or MIG instance not made
            raise StartRefused(f"GPU slice: {type(exc).__name__}: {exc}") from None
        return config if sliced is None else self.gpus.apply(config, sliced)

    async def stop_over_gpu_memory(self, sid: str, detail: str) -> None:
        """Stop a unit over its GPU memory quota (``sandbox.exited`` reason ``gpu_memory``, with
        ``detail``, follows from the exit watcher; it is never restarted)."""
        log.warning("%s: %s", sid, detail)
        if sid in self._launched:
            self._stop_wanted.add(sid)
        if self.manager.get(sid) is not None:
            with contextlib.suppress(KeyError):  # it ended meanwhile
                await self.manager.stop(sid, reason=ExitReason.GPU_MEMORY, grace_s=1.0)

    async def _from_snapshot(
        self, sid: str, submitted: events.SpecSubmitted, plan: EnforcementPlan
    ) -> tuple[Path, events.SnapshotRestored]:
        """The snapshot's code in the sandbox's code dir (``dsec sandbox run --snapshot``)."""
        name = submitted.start_from_snapshot
        assert name is not None
        if self.start_from_snapshot is None:
            raise StartRefused(f"this node agent cannot start from snapshot {name!r}")
        try:
            return await self.start_from_snapshot(sid, name, plan.tenant, plan.code_max_size)
        except SnapshotStartRefused as exc:
            raise StartRefused(str(exc)) from None

    def _attach(
        self,
        plan: EnforcementPlan,
        spec_plan: EnforcementPlan | None = None,
        handover_from: str | None = None,
        hooked: list[bool] | None = None,
    ) -> Callable[[str, Path, int], Awaitable[None]]:
        """The hook run once the sandbox's cgroup exists, before its first instruction: the
        egress programs (``plan``: the one with the proxy's rules), the proxy bound to the
        cgroup, and a stateful sandbox (``spec_plan.state``) registered with the state keeper
        (with its cgroup, for the hand-over's freezer) before its agent can connect."""

        async def attach(sid: str, cgroup_dir: Path, cgroup_id: int) -> None:
            if hooked is not None:
                hooked[0] = True
            if self.gpus is not None:  # only its own NVIDIA device nodes
                await self.gpus.attach(sid, cgroup_dir)
            self.proxies.bind(sid, cgroup_dir)
            if self._before_start is not None:
                port = self.proxies.port(sid)
                private = (port,) if port is not None else ()
                await self._before_start(sid, cgroup_dir, cgroup_id, plan, private)
            if spec_plan is not None:
                self._register_state(sid, spec_plan, cgroup_dir, handover_from)

        return attach

    def _register_state(
        self, sid: str, plan: EnforcementPlan, cgroup_dir: Path, handover_from: str | None
    ) -> None:
        if self.state_keeper is None or plan.state is None:
            return
        self.state_keeper.register_sandbox(
            SandboxState(
                sandbox_id=sid,
                tenant=plan.tenant,
                group=plan.effective_task_group,
                agent=plan.name,
                plan=plan.state,
                handover_from=handover_from,
                cgroup_dir=str(cgroup_dir),
            )
        )

    def _forget_state(self, sid: str, plan: EnforcementPlan | None) -> None:
        """The sandbox ended for good (not between restarts): the keeper lets its state go."""
        if self.state_keeper is None or plan is None or plan.state is None:
            return
        try:
            self.state_keeper.forget_sandbox(sid)
        except Exception:  # the terminal event must still go out
            log.exception("%s: the state keeper could not forget it", sid)

    def _config(
        self,
        sid: str,
        plan: EnforcementPlan,
        env_dir: Path,
        code_dir: Path | None,
        ctx: PreparedContext,
    ) -> SandboxConfig:
        rules = rules_from_plan(plan, plan.spec_file)
        semantic = rules.model_dump(mode="json")
        self._rules[sid] = rules  # what the sandbox's reports are checked against
        self._secrets[sid] = tuple(
            (name, value.get_secret_value()) for name, value in ctx.secret_env.items()
        )
        res = plan.resources
        assert plan.entrypoint is not None
        env = {e.name: e.value for e in plan.env}
        # The tool pipeline's policies (spec `tools:` over the catalogue's defaults).
        env[ENV_TOOLS] = json.dumps(effective_tools(plan), separators=(",", ":"))
        return SandboxConfig(
            sandbox_id=sid,
            argv=list(plan.entrypoint),
            runtime=Path(sys.executable),
            env_dir=env_dir,
            code_dir=code_dir,
            workdir=plan.workdir,
            env=env,
            secret_env=ctx.secret_env,
            mounts=ctx.mounts,
            read_allowed=list(plan.filesystem.read),
            host_denied=host_denied(self.settings),
            write_allowed=list(plan.filesystem.write) or ["/tmp"],
            limits=node_limits(res, self.settings),
            timeout_s=res.timeout_s,
            semantic_rules=semantic,
            agent=agent_identity(plan),
            metadata=ctx.metadata(),
            checkpointable=self.settings.migration_checkpointable,
        )

    def _ready_event(
        self, ready: SandboxReady, code_dir: Path | None, before: dict[str, float] | None = None
    ) -> events.SandboxReady:
        """``sandbox.ready``; ``before``: what preceded the launch (``env_stage``), in ms."""
        return events.SandboxReady(
            node_id=self.settings.node_id,
            pid=ready.pid,
            cgroup=ready.cgroup_path,
            start_latency_ms={k: round(v, 2) for k, v in (before or {}).items()}
            | {k: round(v, 2) for k, v in ready.timings_ms.items()}
            | {"total": round(ready.ready_ms, 2)},
            code_dir=str(code_dir) if code_dir is not None else None,
            warnings=[w[:_WARNING_CHARS] for w in ready.warnings[:_WARNINGS]],
        )

    async def on_stop_requested(
        self, envelope: Envelope, event: events.SandboxStopRequested
    ) -> Sequence[events.Payload]:
        """Stop a sandbox this node owns (``sandbox.exited`` follows from the exit watcher); one
        scheduled here but not started yet ends at once in ``sandbox.exited`` reason stopped.
        Every other node acks and skips it."""
        sid = envelope.aggregate_id
        if sid in self._launched:  # a stateful sandbox dying meanwhile is not restarted
            self._stop_wanted.add(sid)
        restarting = self._restarting.get(sid)
        if restarting is not None:  # dead, waiting to restart: it stays down
            restarting.set()  # sandbox.exited (reason stopped) follows from the exit handler
            return []
        starting = self._starting.get(sid)
        if starting is not None:
            if sid not in self._launched:
                # Still starting (a cold environment staging, a large mount): the start
                # ends at its next step (while staging: at once), its steps undone, rather
                # than finishing and then being stopped; nor does a start of the sandbox
                # waiting behind it begin. The stops of other sandboxes on this node do not
                # wait minutes behind it.
                self._ended(sid, "stopped")
                stop = self._start_stops.get(sid)
                if stop is not None:
                    stop.set()
            await starting.wait()  # (a start that already launched is stopped below)
        if self.manager.get(sid) is not None:
            with contextlib.suppress(KeyError):  # it ended meanwhile
                await self.manager.stop(sid, reason=ExitReason.STOPPED, grace_s=event.grace_s)
            return []
        if sid in self._launched:  # between two attempts: _restart sees _stop_wanted
            return []
        if self._ended_how(sid) == "failed":
            return []  # its start failed here: that sandbox.failed ends it, not a second end
        state = await self.lifecycle(sid)
        if placement.stop_without_run(state, self.node_id) == "exit-now":
            self._ended(sid, "stopped")  # (a start of it taken meanwhile does not begin)
            return [
                events.SandboxExited(
                    exit_code=-1,
                    reason="stopped",
                    duration_s=0.0,
                    detail=f"stopped by {event.requested_by or 'a user'} before it started",
                )
            ]
        return []

    async def on_unit_lost(
        self, envelope: Envelope, event: events.UnitLost
    ) -> Sequence[events.Payload]:
        """This node's placement of a sandbox was declared lost (the node was partitioned, or
        drained): a copy still running here is stopped and cleaned up, with no event."""
        sid = envelope.aggregate_id
        if event.node_id != self.node_id:
            return []
        starting = self._starting.get(sid)
        if starting is not None:  # a start of the lost placement still under way: let it end
            await starting.wait()
        if self.manager.get(sid) is None:
            return []
        if self._attempts.get(sid, event.attempt) > event.attempt:
            return []  # it runs here as a newer placement than the one lost
        log.warning("%s: placement %d lost (%s); stopping it", sid, event.attempt, event.reason)
        await self.fence(sid)
        return []

    async def fence(self, sid: str) -> None:
        """Stop a stale copy and clean it up without publishing anything for it."""
        self._fenced.add(sid)
        restarting = self._restarting.get(sid)
        if restarting is not None:  # dead, waiting to restart: it is not started again
            restarting.set()
        with contextlib.suppress(KeyError):  # it ended meanwhile
            await self.manager.stop(sid, reason=ExitReason.STOPPED, grace_s=1.0)

    # --------------------------------------------------------------- migration

    def launched(self, sid: str) -> Launched | None:
        """How a sandbox running here was started (None: re-adopted or restored)."""
        return self._launched.get(sid)

    def release_migrated(self, sid: str) -> None:
        """The sandbox now runs on another node: its copy here ends without any event (as a
        fenced copy does) and is not restarted."""
        self._fenced.add(sid)
        launched = self._launched.pop(sid, None)
        if launched is not None:  # not restarted; the keeper forgets it at its exit
            self._adopted_plans[sid] = launched.plan

    async def stage_migrated(self, sid: str) -> tuple[Envelope, asyncio.Task[Staged]]:
        """Path ``handover``, on the target, while the source still serves: the sandbox's
        authentic ``env.built`` (that of its current ``sandbox.scheduled``) and its
        environment's staging, started."""
        scheduled = (await self._last("sandbox.scheduled", sid)).decoded()
        assert isinstance(scheduled, events.SandboxScheduled)
        built_env = await self._last("env.built", sid, scheduled.env_built_id)
        built = built_env.decoded()
        assert isinstance(built, events.EnvBuilt)
        return built_env, asyncio.create_task(self._stage(built))

    async def launch_migrated(
        self, sid: str, built_env: Envelope, staging: asyncio.Task[Staged]
    ) -> None:
        """Path ``handover``, on the target: start the same sandbox (same plan, code,
        secrets, limits, id) as a start here would, as the warm standby of its copy on the
        source (``DSEC_STATE_HANDOVER_FROM`` = its own id: its agent restores and waits for
        the switch; its tool servers register as standbys). Its events (``sandbox.ready``,
        ``context.injected``) are not published: the sandbox is not starting, it moves
        (``unit.migrated`` says so)."""
        hooked: list[bool] = [False]
        try:
            async with self._one_start_after_exit(sid):  # (not beside another copy's start)
                if self.manager.busy(sid):  # nothing keyed by its id (proxy, slice) is touched
                    raise StartRefused(f"a sandbox {sid} already runs or starts on {self.node_id}")
                outputs = await self._launch(sid, staging, built_env, standby=True, hooked=hooked)
        except BaseException:
            if hooked[0] and not self.manager.busy(sid):  # its egress, and nothing runs
                try:
                    await to_the_end(self._detach_unstarted(sid, detach=True))
                except Exception:
                    log.exception("%s: detaching the failed standby's egress failed", sid)
            raise
        log.info("%s: started here for a migration (%d start events kept back)", sid, len(outputs))

    async def attach_restored(self, sid: str, cgroup_dir: Path, cgroup_id: int) -> None:
        """Before a migrated sandbox's tree is restored here: its egress programs on its new
        cgroup (from its plan, read back from the log through the trust gate)."""
        found = await self._maybe_last("spec.validated", sid)
        validated = found.decoded() if found is not None else None
        if not isinstance(validated, events.SpecValidated):
            raise ValueError(f"no authentic spec.validated for {sid}")
        self._rules[sid] = rules_from_plan(validated.plan, validated.plan.spec_file)
        # Its secret values came with its processes, not through this node agent: its reports
        # keep their program (or host) only, never an argument that may hold one.
        self._secrets[sid] = WITHHELD if validated.plan.secrets else ()
        if self._before_start is not None:
            await self._before_start(sid, cgroup_dir, cgroup_id, validated.plan, ())

    async def detach_restored(self, sid: str) -> None:
        """A restore that was not committed: its egress programs go."""
        self._rules.pop(sid, None)
        self._secrets.pop(sid, None)
        if self._on_stopped is not None:
            with contextlib.suppress(Exception):
                await self._on_stopped(sid)

    async def adopted_migrated(self, sid: str, started: events.UnitMigrationStarted) -> None:
        """A migrated sandbox runs here now: it is this node's (its placement attempt stays)."""
        state = await self.lifecycle(sid)
        self._attempts[sid] = state.attempt
        launched = self._launched.get(sid)
        if launched is not None and ENV_HANDOVER_FROM in launched.config.env:
            # path handover: started as its own standby; a restart in place opens its state
            # as the owner
            env = {k: v for k, v in launched.config.env.items() if k != ENV_HANDOVER_FROM}
            launched.config = launched.config.model_copy(update={"env": env})

    # --------------------------------------------------------------- callbacks

    async def _exited(self, result: SandboxExited) -> None:
        """A sandbox's exit (the manager's callback): restarted in place, or ended for good
        and released. A new start of its id waits for this to end."""
        sid = result.sandbox_id
        exits = self._exiting.setdefault(sid, _Exits())
        exits.count += 1
        try:
            await self._handle_exit(result)
        finally:
            exits.count -= 1
            if not exits.count:
                exits.done.set()
                del self._exiting[sid]

    def exiting(self, sid: str) -> bool:
        """Whether the exit of a copy of ``sid`` is being handled here (its egress, GPU slice
        and context released by the id)."""
        return sid in self._exiting

    async def _handle_exit(self, result: SandboxExited) -> None:
        sid = result.sandbox_id
        launched = self._launched.get(sid)
        if launched is not None and sid not in self._fenced:
            final = await self._restart(launched, result)
            if final is None:
                return  # running again: sandbox.restarted published
            result = final
        self._launched.pop(sid, None)
        if self.toolwatch is not None:
            self.toolwatch.forget(sid)
        self._stop_wanted.discard(sid)
        self._restart_tasks.pop(sid, None)
        if self.gpus is not None:  # its MPS daemon's last unit, its MIG instance
            over = await self.gpus.release(sid)
            if over is not None and result.reason == ExitReason.GPU_MEMORY:
                result = result.model_copy(update={"detail": over})
        if launched is not None:
            self._forget_state(sid, launched.plan)
            result = result.model_copy(update={"started_at": launched.first_started_at})
        self._forget_state(sid, self._adopted_plans.pop(sid, None))
        fenced = sid in self._fenced
        self._fenced.discard(sid)
        self._attempts.pop(sid, None)
        task = self._keepalive.pop(sid, None)
        if task is not None:
            task.cancel()
        try:
            ctx = self._contexts.pop(sid, None)
            if ctx is not None:
                await self.injector.release(ctx)
            else:
                await self.injector.release_metadata(result.metadata)
            if self._on_stopped is not None:
                await self._on_stopped(sid)
            await self.proxies.close(sid)
        except Exception:  # a failed release must not cost the terminal event
            log.exception("releasing the context of %s failed", sid)
        self._rules.pop(sid, None)
        self._secrets.pop(sid, None)
        if fenced:  # its history belongs to the node it is placed on now: nothing published
            self.recordings.forget(sid)
            self.outlet.gate.forget(sid)
            log.info("%s: stale copy stopped and cleaned up (no event)", sid)
            return
        await self._wait_until_ready_recorded(sid)
        try:
            saved = await self.recordings.finish(sid)
        except Exception:  # the terminal event must still go out
            log.exception("%s: its recording could not be saved", sid)
            saved = None
        if saved is not None:  # before sandbox.exited: who waits for the exit finds it
            await self.outlet.lifecycle(saved, sid, derive_event_id(sid, "recording.saved"))
        exit_code = result.exit_code if result.exit_code is not None else -1
        payload = events.SandboxExited(
            exit_code=exit_code,
            reason=result.reason.value,
            duration_s=round(result.ended_at - result.started_at, 3),
            detail=result.detail,
            log_dropped_bytes=result.log_dropped_bytes,
        )
        await self.outlet.sandbox_done(sid)  # its last summaries, before the exit
        await self.outlet.lifecycle(payload, sid, derive_event_id(sid, "sandbox.exited"))

    def _restart_refused(self, launched: Launched, result: SandboxExited) -> str | None:
        """Why ``result`` is not followed by a restart (None: it is)."""
        state = launched.plan.state
        if state is None or state.restart != "on-failure":
            return "no restart"
        if self._closing:
            return "not restarted: its node agent stopped"
        if result.reason not in RESTARTABLE:
            return "not a failure"
        if result.exit_code == 0 and result.signal is None:
            return "not a failure"
        if launched.restarts >= state.max_restarts:
            return f"restarted {launched.restarts} times (state.max_restarts: {state.max_restarts})"
        return None

    @staticmethod
    def _stopped_while_down(result: SandboxExited) -> SandboxExited:
        """A stop asked for while it was dead (or dying): final, as stopped."""
        return result.model_copy(
            update={
                "reason": ExitReason.STOPPED,
                "detail": f"stopped after it died ({result.detail})",
            }
        )

    async def _restart(self, launched: Launched, result: SandboxExited) -> SandboxExited | None:
        """Start a stateful sandbox that died again in place — same id, same config, same
        isolation, a new process — after a backoff; publish ``sandbox.restarted``. Returns
        None when it runs again, else the final result (``sandbox.exited`` follows)."""
        sid = result.sandbox_id
        if sid in self._stop_wanted and result.reason in RESTARTABLE:
            return self._stopped_while_down(result)
        why_not = self._restart_refused(launched, result)
        if why_not is not None:
            if why_not.startswith(("restarted", "not restarted")):
                return result.model_copy(update={"detail": f"{result.detail}; {why_not}"})
            if launched.restarts:
                detail = f"{result.detail}; restarted {launched.restarts} times before"
                return result.model_copy(update={"detail": detail})
            return result
        config = launched.config
        if config.timeout_s is not None:  # the wall-clock limit spans every attempt
            left = config.timeout_s - (time.time() - launched.first_started_at)
            if left <= 0:
                return result.model_copy(
                    update={
                        "reason": ExitReason.TIMEOUT,
                        "detail": f"{result.detail}; its timeout passed before a restart",
                    }
                )
            config = config.model_copy(update={"timeout_s": max(1, math.ceil(left))})
        give_up = self._restarting.setdefault(sid, asyncio.Event())
        task = asyncio.current_task()
        if task is not None:
            self._restart_tasks[sid] = task
        try:
            # The dead attempt's cgroup is gone: its egress programs go with it (attached again
            # to the new cgroup before the new process runs). The context (secrets, mounts,
            # their leases), the proxy and the keeper's registration are kept for the next.
            if self._on_stopped is not None:
                try:
                    await self._on_stopped(sid)
                except Exception:
                    log.exception("%s: detaching the dead attempt's egress failed", sid)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(give_up.wait(), restart_backoff_s(launched.restarts))
        finally:
            self._restarting.pop(sid, None)
        if sid in self._fenced:
            return result
        if sid in self._stop_wanted:
            return self._stopped_while_down(result)
        if self._closing:
            detail = f"{result.detail}; not restarted: its node agent stopped"
            return result.model_copy(update={"detail": detail})
        try:
            async with self._one_start(sid):
                ready = await self.manager.launch(
                    config, before_start=self._attach(launched.egress_plan, launched.plan)
                )
        except SandboxStartError as exc:
            log.warning("%s: restart failed: %s", sid, exc)
            detail = f"{result.detail}; restart {launched.restarts + 1} failed: {_reason(exc)}"
            return result.model_copy(update={"detail": detail})
        launched.restarts += 1
        RESTARTS.labels(result.reason.value).inc()
        log.info(
            "%s: restarted (%d): %s; new pid %d", sid, launched.restarts, result.detail, ready.pid
        )
        await self._wait_until_ready_recorded(sid)
        await self.outlet.lifecycle(
            events.SandboxRestarted(
                restarts=launched.restarts,
                exit_code=result.exit_code,
                signal=result.signal,
                reason=result.reason.value,
                pid=ready.pid,
            ),
            sid,
            derive_event_id(sid, f"sandbox.restarted/{launched.restarts}"),
        )
        return None

    async def _wait_until_ready_recorded(self, sid: str, timeout_s: float = 10.0) -> None:
        """A workload that exits at once could beat its own ``sandbox.ready`` (published by
        the runtime after the handler returns): keep the log's order ready → exited."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while await self._maybe_last("sandbox.ready", sid) is None:
            if asyncio.get_running_loop().time() > deadline:
                log.warning("%s: no sandbox.ready recorded; publishing its exit anyway", sid)
                return
            await asyncio.sleep(0.02)

    async def flooded(self, sandbox_id: str) -> None:
        """Stop a sandbox that passed the refusal limit (``sandbox.exited`` reason
        ``policy_flood`` follows from the exit watcher)."""
        if self.manager.get(sandbox_id) is not None:
            with contextlib.suppress(KeyError):  # it ended meanwhile
                await self.manager.stop(sandbox_id, reason=ExitReason.POLICY_FLOOD, grace_s=1.0)

    async def _decided(self, decision: SemanticDecision) -> None:
        """A report of the in-sandbox semantic layer: checked against the plan, published as
        ``policy.reported`` (the sandbox's claim, never the node agent's verdict)."""
        sid = decision.sandbox_id
        rules = self._rules.get(sid)
        checked = (
            check_report(rules, decision, self._secrets.get(sid, ()))
            if rules is not None
            else Refused("no-plan")
        )
        if isinstance(checked, Refused):
            REPORTS_REFUSED.labels(checked.reason).inc()
            return
        report = checked
        if self.toolwatch is not None:
            if report.action == "deny":  # a tool failing on it is diagnosed by this rule
                # (the rule id was checked against the plan; the target is the sandbox's own
                # words, which never reach a tool event)
                self.toolwatch.refused(sid, "semantic", report.rule_id, "")
            elif decision.on == "http":
                try:  # the sandbox's own words: "http://[x" is no URL
                    host = urllib.parse.urlsplit(decision.subject).hostname
                except ValueError:
                    host = None
                if host:
                    self.toolwatch.http(sid, host)  # a plain HTTP call of a tool
        self.outlet.refusal(
            sid,
            Key("semantic", report.rule_id, report.operation),
            report.target,
            lambda: report,
            refused=report.action == "deny",
        )

    async def _refused(self, refusal: KernelRefusal) -> None:
        def event() -> events.PolicyViolation:
            return events.PolicyViolation(
                layer="kernel",
                rule_id=refusal.rule_id,
                action="deny",
                operation="syscall",
                target=refusal.syscall,
                message=(
                    f"the kernel refused system call {refusal.syscall} (pid {refusal.pid}) with "
                    f"{refusal.errno_name}: {_SECCOMP_WHY.get(refusal.rule_id, 'not allowed')}"
                ),
            )

        self.outlet.refusal(
            refusal.sandbox_id, Key("kernel", refusal.rule_id, "syscall"), refusal.syscall, event
        )

    def _http_refused(self, sid: str, rule_id: str, target: str) -> None:
        """A request the HTTPS proxy answered 429 (the rule's requests budget is spent)."""
        if self.toolwatch is not None:  # a tool's 429 from here is the spec's limit, not theirs
            self.toolwatch.refused(sid, "http_proxy", rule_id, target)

        def event() -> events.PolicyViolation:
            return events.PolicyViolation(
                layer="kernel",
                rule_id=rule_id,
                action="deny",
                operation="http",
                target=bound(target, TARGET_LIMIT),
                message="the node agent's HTTPS proxy: the rule's requests rate limit is spent",
            )

        self.outlet.refusal(sid, Key("kernel", rule_id, "http"), target, event)

    async def _landlock_refused(self, refusal: LandlockRefusal) -> None:
        def event() -> events.PolicyViolation:
            return events.PolicyViolation(
                layer="kernel",
                rule_id="landlock",
                action="deny",
                operation=refusal.operation,
                target=bound(refusal.target, TARGET_LIMIT),
                message=bound(describe(refusal), MESSAGE_LIMIT),
            )

        self.outlet.refusal(
            refusal.sandbox_id,
            Key("kernel", "landlock", refusal.operation),
            refusal.target,
            event,
        )


_SECCOMP_WHY = {
    "seccomp.denied": "the sandbox's seccomp filter denies it to every workload",
    "seccomp.socket-family": "sandboxes may open AF_UNIX, AF_INET, AF_INET6 and "
    "AF_NETLINK (NETLINK_ROUTE) sockets only",
    "seccomp.not-allowed": "not on the sandbox's system call allow-list",
}


HOST_SHARED_DIRS = ("/tmp", "/var/tmp", "/run", "/var/run", "/dev/shm")
"""Host directories every process shares (the stack's servers keep sockets there): never
bound into a sandbox, whatever the org's rules allow."""


def host_denied(settings: Settings) -> list[Path]:
    """The host directories no sandbox's ``read_allowed`` may bind on this node: its home (every
    sandbox's code, logs, keys; the stack's data) and the host's shared directories."""
    return [Path(d) for d in (*stack_dirs(settings), *HOST_SHARED_DIRS)]


def node_limits(res: ResourceLimits, s: Settings) -> Limits:
    """The plan's limits, refused when they exceed this node's operator maxima."""
    for field, asked, most, setting in (
        ("resources.files", res.files, s.sandbox_max_files, "DSEC_SANDBOX_MAX_FILES"),
        ("resources.pids", res.pids, s.sandbox_max_pids, "DSEC_SANDBOX_MAX_PIDS"),
        ("resources.disk", res.disk_bytes, s.sandbox_max_disk, "DSEC_SANDBOX_MAX_DISK"),
        (
            "resources.log_bytes",
            res.log_bytes,
            s.sandbox_max_log_bytes,
            "DSEC_SANDBOX_MAX_LOG_BYTES",
        ),
        (
            "resources.disk_read_rate",
            res.disk_read_bps,
            s.sandbox_max_disk_read_rate,
            "DSEC_SANDBOX_MAX_DISK_READ_RATE",
        ),
        (
            "resources.disk_write_rate",
            res.disk_write_bps,
            s.sandbox_max_disk_write_rate,
            "DSEC_SANDBOX_MAX_DISK_WRITE_RATE",
        ),
        (
            "resources.disk_iops",
            res.disk_iops,
            s.sandbox_max_disk_iops,
            "DSEC_SANDBOX_MAX_DISK_IOPS",
        ),
    ):
        if asked > most:
            raise StartRefused(
                f"{field} = {asked} exceeds this node's maximum {most} ({setting}); "
                f"ask for at most {most}"
            )
    return Limits(
        memory_bytes=res.memory_bytes,
        cpus=res.cpu_millicores / 1000,
        pids=res.pids,
        files=res.files,
        disk_bytes=res.disk_bytes,
        log_bytes=res.log_bytes,
        disk_read_bps=res.disk_read_bps,
        disk_write_bps=res.disk_write_bps,
        disk_iops=res.disk_iops,
    )


def _mountpoints(code_dir: Path, plan: EnforcementPlan) -> None:
    """Create, in the (read-only at run time) code tree, the directories where writable paths
    and mounts under ``workdir`` will be bound: a read-only mount cannot get a new mountpoint.

    The code tree is the user's: each directory is opened with ``O_NOFOLLOW`` below the one
    above it, so a symlink in the bundle (``out -> /etc``) is refused, never followed as root
    (here, nor later by the sandbox's pre-exec stage, which binds onto these directories).

    Raises:
        StartRefused: naming the spec path and the bundle entry that is a symlink or a file.
    """
    workdir = Path(plan.workdir)
    targets = [*plan.filesystem.write, *(m.path for m in plan.mounts)]
    root_fd = os.open(code_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for target in targets:
            path = Path(target)
            if path == workdir or not path.is_relative_to(workdir):
                continue
            try:
                os.close(open_real_dir(root_fd, path.relative_to(workdir).as_posix(), create=True))
            except NotADirectoryError as exc:
                raise StartRefused(
                    f"{target}: in the code bundle, {exc} (a path the spec grants or mounts "
                    "must not pass through a link)"
                ) from None
    finally:
        os.close(root_fd)


def _where(state: lifecycle.Lifecycle) -> str:
    node = f" on {state.node_id!r} (attempt {state.attempt})" if state.node_id else ""
    return f"{state.state}{node}"


def _reason(exc: Exception) -> str:
    if isinstance(exc, ContextError):
        return f"runtime context: {exc}"
    if isinstance(exc, SandboxStartError):
        return f"sandbox start failed at {exc.stage}: {exc.message}"
    return str(exc)


def agent_identity(plan: EnforcementPlan) -> AgentIdentity:
    """Who the sandbox of ``plan`` is on the communication plane: its name and task group,
    granted within the plan's tenant (two tenants' groups of one name never meet)."""
    return AgentIdentity(name=plan.name, task_group=plan.effective_task_group, tenant=plan.tenant)


def _recording_store(settings: Settings) -> RecordingStore | None:
    """Where recordings go: the object store, sealed with the tenants' recording keys."""
    addr, token = settings.endpoint("vault_addr"), settings.endpoint("vault_token")
    if not settings.endpoint("s3_endpoint") or not addr or not token:
        return None
    keys = TenantKeys(str(addr), str(token), path=RECORDING_KEY_PATH)
    return RecordingStore(s3_client(settings), settings.s3_bucket, keys)


def _with_recording(config: SandboxConfig, prepared: Prepared) -> SandboxConfig:
    """``config`` with the recording's (or replay's) environment, mount and paths."""
    return config.model_copy(
        update={
            "env": {**config.env, **prepared.env},
            "mounts": [*config.mounts, *prepared.mounts],
            # (once each: a spec may list /dsec/recording itself)
            "read_allowed": list(dict.fromkeys([*config.read_allowed, *prepared.read])),
            "write_allowed": list(dict.fromkeys([*config.write_allowed, *prepared.write])),
        }
    )


def _leases(ctx: PreparedContext, started_at: float) -> list[SecretLease]:
    """The secrets injected into a sandbox, as the tool watch diagnoses them (no values)."""
    leases = {lease.accessor: lease for lease in ctx.leases}
    return [
        SecretLease(
            r.name, r.lease_id or "", started_at, r.ttl_s or 0.0, leases.get(r.lease_id or "")
        )
        for r in ctx.records
        if r.kind == "secret"
    ]


def _through_proxy(config: SandboxConfig, grant: ProxyGrant) -> SandboxConfig:
    """``config`` with the proxy's environment and its trust bundle (read-only)."""
    mount = Mount(source=grant.bundle, target=CA_BUNDLE_PATH, read_only=True)
    return config.model_copy(
        update={
            "env": {**config.env, **grant.env},
            "mounts": [*config.mounts, mount],
            "read_allowed": [*config.read_allowed, CA_BUNDLE_PATH],
        }
    )
