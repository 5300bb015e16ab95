"""The node agent's orchestration: from ``env.built`` to a running sandbox and back.

On ``env.built`` it reads the sandbox's spec and compiled plan from the log (the events of the
same aggregate), fetches the code bundle, injects the runtime context (secrets from Vault, data
from S3, config maps), attaches the egress programs to the sandbox's cgroup *before* the
workload's first instruction, launches it and publishes ``context.injected`` and
``sandbox.ready``. When the sandbox ends, ``sandbox.exited`` is published with an id derived
from the sandbox id, so a node-agent restart that re-adopts it can never publish a second one.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

from dsec_core import events
from dsec_core.codebundle import BundleError, extract_bundle
from dsec_core.envelope import Envelope, decode
from dsec_core.ids import derive_event_id
from dsec_core.natsclient import auth_options
from dsec_core.objectstore import BundleAltered, ObjectMissing, get_bundle
from dsec_core.objectstore import client as s3_client
from dsec_core.settings import Settings
from dsec_core.spec import EnforcementPlan, load_spec
from dsec_core.subjects import STREAM, subject_for
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from dsec_nodeagent.context.configmap import ConfigMaps
from dsec_nodeagent.context.injector import ContextInjector, PreparedContext
from dsec_nodeagent.context.models import ContextError
from dsec_nodeagent.context.s3 import S3Materializer
from dsec_nodeagent.context.vault import VaultSecrets
from dsec_nodeagent.sandbox.audit import LandlockRefusal, describe
from dsec_nodeagent.sandbox.manager import SandboxManager
from dsec_nodeagent.sandbox.models import (
    AgentIdentity,
    ExitReason,
    Limits,
    SandboxConfig,
    SandboxExited,
    SandboxReady,
    SandboxStartError,
)
from dsec_nodeagent.sandbox.notify import KernelRefusal
from dsec_nodeagent.semantic.compile import rules_from_spec
from dsec_nodeagent.semantic.models import SemanticDecision

log = logging.getLogger(__name__)

Publish = Callable[[events.Payload, str, str | None], Awaitable[None]]
BeforeStart = Callable[[str, Path, int, EnforcementPlan], Awaitable[None]]


class StartRefused(Exception):
    """A deterministic reason the sandbox cannot start (no retry helps): becomes
    ``sandbox.failed`` at once."""


class NodeAgent:
    """Launches and watches the sandboxes of this node."""

    def __init__(
        self,
        settings: Settings,
        publish: Publish,
        js: Callable[[], JetStreamContext],
        before_start: BeforeStart | None = None,
        on_stopped: Callable[[str], Awaitable[None]] | None = None,
        ipc_socket: Path | None = None,
    ) -> None:
        self.settings = settings
        self.home = settings.home.resolve()
        self._publish = publish
        self._js = js
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
        )
        self.injector = self._injector()
        self._contexts: dict[str, PreparedContext] = {}
        self._keepalive: dict[str, asyncio.Task[None]] = {}

    def _injector(self) -> ContextInjector:
        s = self.settings
        vault = None
        addr, token = s.endpoint("vault_addr"), s.endpoint("vault_token")
        if addr and token:
            vault = VaultSecrets(str(addr), str(token))
        s3 = None
        if s.endpoint("s3_endpoint"):
            s3 = S3Materializer(
                s3_client(s), self.home / "cache" / "s3", unwrap=vault.unwrap if vault else None
            )
        return ContextInjector(
            self.home / "sandboxes",
            vault=vault,
            s3=s3,
            configmaps=ConfigMaps(s.nats_endpoint(), nats_options=auth_options(s)),
        )

    async def start(self) -> None:
        """Re-adopt sandboxes that survived a restart; clean up the ones that ended."""
        report = await self.manager.reconcile()
        log.info("reconciled: adopted %s, cleaned %s", report.adopted, report.cleaned)

    async def shutdown(self) -> None:
        """Stop watching; sandboxes keep running (re-adopted at the next start)."""
        for task in self._keepalive.values():
            task.cancel()
        await self.manager.shutdown(stop_sandboxes=False)

    # --------------------------------------------------------------- the spec, from the log

    async def _last(self, event_type: str, sandbox_id: str) -> Envelope:
        try:
            raw = await self._js().get_last_msg(STREAM, subject_for(event_type, sandbox_id))
        except NotFoundError:
            raise StartRefused(f"no {event_type} recorded for {sandbox_id}") from None
        assert raw.data is not None
        return decode(raw.data)

    async def _maybe_last(self, event_type: str, sandbox_id: str) -> Envelope | None:
        try:
            return await self._last(event_type, sandbox_id)
        except StartRefused:
            return None

    async def _already_started(self, sandbox_id: str) -> bool:
        """Whether the log shows this sandbox started (or ended) already."""
        for event_type in ("sandbox.ready", "sandbox.exited", "sandbox.failed"):
            if await self._maybe_last(event_type, sandbox_id) is not None:
                return True
        return False

    def _check_environment(self, event: events.EnvBuilt) -> None:
        """The environment must be one this node built: its path comes from an event and is
        bound into the sandbox, so it may only ever be ``$DSEC_HOME/envs/<lock>/site-packages``."""
        expected = self.home / "envs" / event.lock_hash / "site-packages"
        if event.node_id != self.settings.node_id:
            raise StartRefused(f"environment built on {event.node_id}, not on this node")
        if not event.lock_hash.isalnum() or Path(event.location) != expected:
            raise StartRefused(f"environment location {event.location!r} is not {expected}")

    def _code_path(self, sandbox_id: str) -> Path:
        """Where the sandbox's code copy lives on this node (``sandbox.ready.code_dir``)."""
        return self.home / "sandboxes" / sandbox_id / "code"

    async def _code_dir(self, sandbox_id: str, code: events.BundleRef | None) -> Path | None:
        if code is None:
            return None
        try:
            data = await get_bundle(self.settings, code.object_key, code.digest)
        except (ObjectMissing, BundleAltered) as exc:
            raise StartRefused(str(exc)) from None
        dest = self._code_path(sandbox_id)
        if dest.exists():  # a redelivery after a crash: the bundle is immutable, reuse it
            return dest
        try:
            await asyncio.to_thread(extract_bundle, data, dest)
        except BundleError as exc:
            raise StartRefused(f"code bundle unusable: {exc}") from None
        return dest

    # --------------------------------------------------------------- handlers

    async def on_env_built(
        self, envelope: Envelope, event: events.EnvBuilt
    ) -> Sequence[events.Payload]:
        """Start the sandbox of a built environment."""
        sid = envelope.aggregate_id
        running = self.manager.get(sid)
        if running is not None:  # redelivered after a crash between launch and ack
            code_dir = self._code_path(sid)
            return [self._ready_event(running.ready, code_dir if code_dir.is_dir() else None)]
        if await self._already_started(sid):  # redelivered after the sandbox ran: never twice
            return []
        try:
            self._check_environment(event)
            return await self._launch(sid, event)
        except (StartRefused, ContextError, SandboxStartError) as exc:
            if self._on_stopped is not None:  # egress attached before a failed start
                await self._on_stopped(sid)
            if isinstance(exc, ContextError) and exc.transient:
                raise  # Vault/S3/NATS unreachable: the runtime retries with backoff
            return [
                events.SandboxFailed(
                    stage="nodeagent", reason=_reason(exc), failed_event_id=envelope.id
                )
            ]

    async def _launch(self, sid: str, event: events.EnvBuilt) -> list[events.Payload]:
        validated = (await self._last("spec.validated", sid)).decoded()
        submitted = (await self._last("spec.submitted", sid)).decoded()
        assert isinstance(validated, events.SpecValidated)
        assert isinstance(submitted, events.SpecSubmitted)
        plan = EnforcementPlan.model_validate(validated.plan)
        if not plan.entrypoint:
            raise StartRefused("the spec has no `entrypoint`; nothing to run")
        code_dir = await self._code_dir(sid, validated.code)
        if code_dir is not None:
            _mountpoints(code_dir, plan)
        ctx = await self.injector.prepare(sid, plan.secrets, plan.mounts)
        outputs: list[events.Payload] = [
            events.ContextInjected(**record.model_dump()) for record in ctx.records
        ]
        try:
            ready = await self.manager.launch(
                self._config(sid, plan, submitted, event, code_dir, ctx),
                before_start=self._attach(plan),
            )
        except BaseException:
            await self.injector.release(ctx)
            raise
        self._contexts[sid] = ctx
        self._keepalive[sid] = asyncio.create_task(self.injector.keepalive(ctx))
        outputs.append(self._ready_event(ready, code_dir))
        return outputs

    def _attach(self, plan: EnforcementPlan) -> Callable[[str, Path, int], Awaitable[None]]:
        async def attach(sid: str, cgroup_dir: Path, cgroup_id: int) -> None:
            if self._before_start is not None:
                await self._before_start(sid, cgroup_dir, cgroup_id, plan)

        return attach

    def _config(
        self,
        sid: str,
        plan: EnforcementPlan,
        submitted: events.SpecSubmitted,
        event: events.EnvBuilt,
        code_dir: Path | None,
        ctx: PreparedContext,
    ) -> SandboxConfig:
        spec = load_spec(submitted.spec_yaml, submitted.filename)
        semantic = None
        if spec.spec is not None:
            rules = rules_from_spec(spec.spec.security_policy, spec.source, submitted.filename)
            semantic = rules.model_dump(mode="json")
        res = plan.resources
        assert plan.entrypoint is not None
        return SandboxConfig(
            sandbox_id=sid,
            argv=list(plan.entrypoint),
            runtime=Path(sys.executable),
            env_dir=Path(event.location),
            code_dir=code_dir,
            workdir=plan.workdir,
            env={e.name: e.value for e in plan.env},
            secret_env=ctx.secret_env,
            mounts=ctx.mounts,
            read_allowed=list(plan.filesystem.read),
            write_allowed=list(plan.filesystem.write) or ["/tmp"],
            limits=Limits(
                memory_bytes=res.memory_bytes, cpus=res.cpu_millicores / 1000, pids=res.pids
            ),
            timeout_s=res.timeout_s,
            semantic_rules=semantic,
            agent=AgentIdentity(name=plan.name, task_group=plan.effective_task_group),
            metadata=ctx.metadata(),
        )

    def _ready_event(self, ready: SandboxReady, code_dir: Path | None) -> events.SandboxReady:
        return events.SandboxReady(
            node_id=self.settings.node_id,
            pid=ready.pid,
            cgroup=ready.cgroup_path,
            start_latency_ms={k: round(v, 2) for k, v in ready.timings_ms.items()}
            | {"total": round(ready.ready_ms, 2)},
            code_dir=str(code_dir) if code_dir is not None else None,
        )

    async def on_stop_requested(
        self, envelope: Envelope, event: events.SandboxStopRequested
    ) -> Sequence[events.Payload]:
        """Stop a sandbox this node runs (``sandbox.exited`` follows from the exit watcher)."""
        if self.manager.get(envelope.aggregate_id) is not None:
            await self.manager.stop(
                envelope.aggregate_id, reason=ExitReason.STOPPED, grace_s=event.grace_s
            )
        return []

    # --------------------------------------------------------------- callbacks

    async def _exited(self, result: SandboxExited) -> None:
        sid = result.sandbox_id
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
        except Exception:  # a failed release must not cost the terminal event
            log.exception("releasing the context of %s failed", sid)
        finally:
            await self._wait_until_ready_recorded(sid)
            exit_code = result.exit_code if result.exit_code is not None else -1
            payload = events.SandboxExited(
                exit_code=exit_code,
                reason=result.reason.value,
                duration_s=round(result.ended_at - result.started_at, 3),
            )
            await self._publish(payload, sid, derive_event_id(sid, "sandbox.exited"))

    async def _wait_until_ready_recorded(self, sid: str, timeout_s: float = 10.0) -> None:
        """A workload that exits at once could beat its own ``sandbox.ready`` (published by
        the runtime after the handler returns): keep the log's order ready → exited."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while await self._maybe_last("sandbox.ready", sid) is None:
            if asyncio.get_running_loop().time() > deadline:
                log.warning("%s: no sandbox.ready recorded; publishing its exit anyway", sid)
                return
            await asyncio.sleep(0.02)

    async def _decided(self, decision: SemanticDecision) -> None:
        payload = events.PolicyViolation(
            layer="semantic",
            rule_id=decision.rule or "rate_limit",
            action=_action(decision.action),
            operation=decision.on,
            target=decision.subject,
            message=f"{decision.action} {decision.on} {decision.subject}",
            spec_line=decision.spec_line,
        )
        await self._publish(payload, decision.sandbox_id, None)

    async def _refused(self, refusal: KernelRefusal) -> None:
        payload = events.PolicyViolation(
            layer="kernel",
            rule_id="seccomp",
            action="deny",
            operation="syscall",
            target=refusal.syscall,
            message=(
                f"the kernel refused system call {refusal.syscall} (pid {refusal.pid}) with "
                f"{refusal.errno_name}: the sandbox's seccomp filter denies it to every workload"
            ),
        )
        await self._publish(payload, refusal.sandbox_id, None)

    async def _landlock_refused(self, refusal: LandlockRefusal) -> None:
        payload = events.PolicyViolation(
            layer="kernel",
            rule_id="landlock",
            action="deny",
            operation=refusal.operation,
            target=refusal.target,
            message=describe(refusal),
        )
        await self._publish(payload, refusal.sandbox_id, None)


def _mountpoints(code_dir: Path, plan: EnforcementPlan) -> None:
    """Create, in the (read-only at run time) code tree, the directories where writable paths
    and mounts under ``workdir`` will be bound: a read-only mount cannot get a new mountpoint."""
    workdir = Path(plan.workdir)
    for target in [*plan.filesystem.write, *(m.path for m in plan.mounts)]:
        path = Path(target)
        if path != workdir and path.is_relative_to(workdir):
            (code_dir / path.relative_to(workdir)).mkdir(parents=True, exist_ok=True)


def _action(value: str) -> Any:
    return value if value in ("deny", "log", "redirect", "allow") else "deny"


def _reason(exc: Exception) -> str:
    if isinstance(exc, ContextError):
        return f"runtime context: {exc}"
    if isinstance(exc, SandboxStartError):
        return f"sandbox start failed at {exc.stage}: {exc.message}"
    return str(exc)
