"""The node agent's egress layer on the bus: programs attached to each sandbox's cgroup before
its first instruction, detached at exit, and every kernel verdict turned into a
``policy.violation`` event (the kernel refuses; the event explains)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from dsec_core import events, retention
from dsec_core.settings import Settings
from dsec_core.spec import EnforcementPlan
from prometheus_client import REGISTRY

from dsec_nodeagent.agent import Publish
from dsec_nodeagent.ebpf import EgressPlan, VerdictEvent
from dsec_nodeagent.ebpf.controller import EgressController
from dsec_nodeagent.ebpf.metrics import EgressCollector

log = logging.getLogger(__name__)


def violation(event: VerdictEvent) -> events.PolicyViolation:
    """The ``policy.violation`` payload of one kernel verdict."""
    call = event.hook.name.lower().rstrip("46")
    return events.PolicyViolation(
        layer="kernel",
        rule_id=event.rule_id or "default-deny",
        action="deny" if event.denied else "allow",
        operation=call,
        target=f"{event.address}:{event.port}/{event.protocol}",
        message=event.message(),
    )


class Egress:
    """Owns the egress controller for this node."""

    def __init__(self, settings: Settings, publish: Publish) -> None:
        self.home = settings.home.resolve()
        self.controller = EgressController(dns_upstream=settings.dns_upstream)
        self._publish = publish
        self._cgroups: dict[str, Path] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Load the programs (or re-open the pinned ones) and re-adopt live sandboxes."""
        await self.controller.start()
        report = await self.controller.reconcile()
        log.info("egress reconciled: adopted %s, removed %s", report.adopted, report.removed)
        self.controller.add_listener(self._on_verdict)
        self.controller.proxy.on_denied = self._on_dns_denied
        REGISTRY.register(EgressCollector(self.controller))

    async def close(self) -> None:
        """Stop reading verdicts; programs stay attached (fail-closed) — unless the stack is
        going down (``dsec down``) and no sandbox uses them any more: then the pinned maps and
        the egress state are removed too, so nothing of DSec stays in the kernel."""
        if retention.down_marker(self.home).exists() and not self.controller.sandboxes():
            log.info("the stack is down and no sandbox is attached: removing the pinned maps")
            await self.controller.uninstall()
            return
        await self.controller.close()

    async def attach(self, sid: str, cgroup: Path, cgroup_id: int, plan: EnforcementPlan) -> None:
        """Put a new sandbox's cgroup under its egress plan (before its first instruction)."""
        await self.controller.attach(cgroup, EgressPlan.from_enforcement_plan(sid, plan))
        self._cgroups[sid] = cgroup

    async def detach(self, sid: str) -> None:
        """Remove a finished sandbox's programs, map entries and DNS listener."""
        cgroup = self._cgroups.pop(sid, None)
        if cgroup is None:  # re-adopted after a restart: only the controller knows it
            cgroup = next(
                (a.cgroup_path for a in self.controller.sandboxes() if a.sandbox_id == sid), None
            )
        if cgroup is not None:
            await self.controller.detach(cgroup)

    def _on_verdict(self, event: VerdictEvent) -> None:
        if event.sandbox_id is not None:
            self._emit(violation(event), event.sandbox_id)

    def _on_dns_denied(self, sandbox_id: str, name: str, rdtype: str) -> None:
        self._emit(
            events.PolicyViolation(
                layer="kernel",
                rule_id="default-deny",
                action="deny",
                operation="dns",
                target=f"{name}/{rdtype}",
                message=f"{name} matches no egress rule: the node's DNS proxy refused to resolve "
                "it (the sandbox's DNS can only reach the proxy)",
            ),
            sandbox_id,
        )

    def _emit(self, payload: events.PolicyViolation, sandbox_id: str) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(self._publish(payload, sandbox_id, None))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
