"""A whole node agent in this process, on a real NATS, fed the events policy and builder publish.

Used by the refusal-flood tests and ``bench/noisy_neighbour.py``: ``submit`` publishes
``spec.submitted``, ``spec.validated`` (the compiled plan), ``env.built`` and ``sandbox.scheduled``
(on the harness's node) for a sandbox that runs ``python -c CODE`` (no code bundle; its empty
environment is already staged on the node, so nothing is fetched); the node agent (its own egress
pin directory, so it can run beside another node agent of the machine) starts it, and every event
of the sandbox is recorded with the time it arrived.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import nats
from dsec_core import events, identity
from dsec_core.bus import Published, ensure_stream
from dsec_core.envelope import Envelope, MalformedEnvelope, decode
from dsec_core.layout import NodeLayout
from dsec_core.objectstore import env_archive_key
from dsec_core.service import Service
from dsec_core.settings import Settings
from dsec_core.spec import compile_plan, load_spec
from dsec_testing import trust

from dsec_nodeagent.agent import NodeAgent
from dsec_nodeagent.app import wire
from dsec_nodeagent.ebpf.controller import EgressController
from dsec_nodeagent.outlet import EventOutlet

SPEC = """\
version: "1.2"
name: {name}
base: dsec/python311:latest
entrypoint: [python, -c, {code}]
workdir: /workspace
resources: {{cpu: 1, memory: 256MiB, pids: 64}}
timeout: {timeout}
security_policy:
  dns_passthrough: false
  network:
    egress:
      - {egress}
  semantic:
    - {{on: open, match: {{path: "/tmp/secret*"}}, action: deny, message: "no secrets"}}
"""


@dataclass
class Arrived:
    """An event of the log and the monotonic time it reached the harness."""

    at: float
    envelope: Envelope


@dataclass
class Recorded:
    """Everything recorded for one sandbox."""

    submitted_at: float = 0.0
    events: list[Arrived] = field(default_factory=list)
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    def of(self, event_type: str) -> list[Envelope]:
        return [a.envelope for a in self.events if a.envelope.type == event_type]

    def at(self, event_type: str) -> float | None:
        return next((a.at for a in self.events if a.envelope.type == event_type), None)


# Sandbox programs that flood refusals for ``{seconds}``, then print how many they got (used
# by the flood tests and bench/noisy_neighbour.py).
CONNECT_FLOOD = """
import json, socket, time
n = 0
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    s = socket.socket()
    try:
        s.connect(("10.77.0.1", 80))
    except OSError:
        n += 1
    finally:
        s.close()
print(json.dumps({{"refused": n}}), flush=True)
"""

DNS_FLOOD = """
import json, socket, time
n = 0
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    try:
        socket.getaddrinfo(f"h{{n}}.denied.test", 443, type=socket.SOCK_STREAM)
    except OSError:
        n += 1
print(json.dumps({{"refused": n}}), flush=True)
"""


class NodeAgentHarness:
    """The node agent service, a publisher standing in for policy and builder, a recorder."""

    def __init__(self, home: Path, nats_url: str, **settings: Any) -> None:
        self.home = home
        self.nats_url = nats_url
        self.settings = Settings(home=home, nats_url=nats_url, **settings)
        self.tag = f"flood-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.controller = EgressController(
            pin_dir=Path(f"/sys/fs/bpf/dsec-{self.tag}/egress"),
            state_dir=Path(f"/run/dsec-{self.tag}/egress"),
        )
        self.wired = wire(self.settings, egress_controller=self.controller)
        self.service: Service = self.wired.service
        self.recorded: dict[str, Recorded] = {}
        self._nc: Any = None
        self._upstream: trust.Pipeline | None = None
        self.lock_hash = "harnessenv"
        self.scheduled: dict[str, Published] = {}  # sandbox -> its sandbox.scheduled
        self._stopped = False

    async def __aenter__(self) -> NodeAgentHarness:
        self._nc = await nats.connect(self.nats_url)
        js = self._nc.jetstream()
        await ensure_stream(js)
        # The node agent signs with a key this home's root certified, and trusts only events
        # of certified producers: a user submits, policy validates, the builder builds.
        paths = identity.TrustPaths(self.home)
        root = identity.ensure_root(paths)
        identity.ensure_service_identity(paths, root, "nodeagent", node_id=self.settings.node_id)
        self._upstream = await trust.pipeline(js, self.home, node_id=self.settings.node_id)
        await self._nc.subscribe("dsec.sandbox.>", cb=self._on_message)
        layout = NodeLayout.of(self.home)
        layout.env_site_packages(self.lock_hash).mkdir(parents=True, exist_ok=True)
        await self.service.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._stopped:
            with contextlib.suppress(Exception):
                for sid in self.agent.manager.running():
                    with contextlib.suppress(KeyError):
                        await self.agent.manager.stop(sid, grace_s=0.5)
            await self.service.stop()
        await self.controller.uninstall()
        for path in (
            Path(f"/sys/fs/bpf/dsec-{self.tag}"),
            Path(f"/run/dsec-{self.tag}"),
            self.settings.state_journal_dir().parent,  # the state journals, in node memory
        ):
            shutil.rmtree(path, ignore_errors=True)
            with contextlib.suppress(OSError):
                _rmdirs(path)
        if self._nc is not None:
            await self._nc.drain()

    @property
    def agent(self) -> NodeAgent:
        return self.wired.agent

    @property
    def outlet(self) -> EventOutlet:
        return self.wired.outlet

    async def _on_message(self, msg: Any) -> None:
        try:
            envelope = decode(msg.data)
        except MalformedEnvelope:  # another test's injected garbage on the shared stream
            return
        rec = self.recorded.setdefault(envelope.aggregate_id, Recorded())
        rec.events.append(Arrived(time.monotonic(), envelope))
        rec.changed.set()

    async def submit(
        self,
        name: str,
        code: str,
        egress: str = "{domain: allowed.test, ports: [443]}",
        *,
        built: events.EnvBuilt | None = None,
        node_id: str | None = None,
        extra: str = "",
        handover_from: str | None = None,
        timeout: str = "2m",
    ) -> str:
        """Publish what policy, builder and scheduler would for a sandbox running
        ``python -c code`` (``egress``: its one egress rule, in YAML flow style; ``built``: its
        ``env.built``, default the harness's staged empty environment; ``node_id``: the node
        it is scheduled on, default the harness's; ``extra``: more top-level YAML, e.g. a
        ``state:`` section; ``handover_from``: the running sandbox this one replaces by a live
        hand-over, as ``dsec sandbox upgrade`` submits it; ``timeout``: its spec's, which ends
        it)."""
        assert self._upstream is not None
        sid = f"{name}-{uuid.uuid4().hex[:8]}"
        text = SPEC.format(name=name, code=json.dumps(code), egress=egress, timeout=timeout) + extra
        spec = load_spec(text, "dsec.yaml")
        assert spec.spec is not None, spec.errors
        plan = compile_plan(spec.spec, source=spec.source)
        rec = self.recorded.setdefault(sid, Recorded())
        p = self._upstream
        submitted = await p.user.publish(
            events.SpecSubmitted(spec_yaml=text, filename="dsec.yaml", handover_from=handover_from),
            aggregate_id=sid,
        )
        validated = await p.policy.publish(
            events.SpecValidated(
                name=name,
                spec_digest=blake3.blake3(text.encode()).hexdigest(),
                plan=plan.model_dump(mode="json"),
            ),
            aggregate_id=sid,
            causation=submitted.envelope,
        )
        resolved = await p.builder.publish(
            events.DepsResolved(
                lock=[], lock_hash=self.lock_hash, python="3.11", platform="x", resolve_ms=0.0
            ),
            aggregate_id=sid,
            causation=validated.envelope,
        )
        rec.submitted_at = time.monotonic()
        published = await p.builder.publish(
            built
            or events.EnvBuilt(
                lock_hash=self.lock_hash,
                fingerprint="harness",
                object_key=env_archive_key(self.lock_hash),
                digest="0" * 64,  # never fetched: the environment is staged on the node
                size_bytes=0,
                reused=True,
            ),
            aggregate_id=sid,
            causation=resolved.envelope,
        )
        self.scheduled[sid] = await p.scheduler.publish(
            events.SandboxScheduled(
                node_id=node_id or self.settings.node_id, env_built_id=published.envelope.id
            ),
            aggregate_id=sid,
            causation=published.envelope,
        )
        return sid

    @property
    def upstream(self) -> trust.Pipeline:
        """The certified publishers standing in for the user and the other services."""
        assert self._upstream is not None
        return self._upstream

    async def stop_agent(self) -> None:
        """Stop the node agent as a restart would: its sandboxes keep running."""
        await self.service.stop()
        self._stopped = True

    async def wait_for(self, sid: str, event_type: str, timeout_s: float = 60.0) -> Envelope:
        """The first ``event_type`` of ``sid`` (polls the recorder until the deadline)."""
        rec = self.recorded.setdefault(sid, Recorded())
        deadline = time.monotonic() + timeout_s
        while True:
            found = rec.of(event_type)
            if found:
                return found[0]
            failed = rec.of("sandbox.failed")
            if failed:
                raise AssertionError(f"{sid} failed: {failed[0].decoded()}")
            left = deadline - time.monotonic()
            if left <= 0:
                seen = [a.envelope.type for a in rec.events]
                raise TimeoutError(f"no {event_type} for {sid} in {timeout_s}s; saw {seen}")
            rec.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rec.changed.wait(), left)

    def ready_ms(self, sid: str) -> float:
        """From publishing ``env.built`` (then ``sandbox.scheduled``) to ``sandbox.ready``
        arriving from the log."""
        rec = self.recorded[sid]
        at = rec.at("sandbox.ready")
        assert at is not None
        return (at - rec.submitted_at) * 1000

    def overhead_ms(self, sid: str) -> float:
        """What the node agent adds to the sandbox's own start: ``ready_ms`` minus the
        ``start_latency_ms.total`` the sandbox.ready reports (consume, launch set-up, publish)."""
        ready = self.recorded[sid].of("sandbox.ready")[0]
        return self.ready_ms(sid) - float(ready.payload["start_latency_ms"]["total"])


def _rmdirs(path: Path) -> None:
    for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    path.rmdir()


@contextlib.asynccontextmanager
async def harness(home: Path, nats_url: str, **settings: Any) -> AsyncIterator[NodeAgentHarness]:
    async with NodeAgentHarness(home, nats_url, **settings) as h:
        yield h


def rss_mb() -> float:
    """This process's resident memory."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0
