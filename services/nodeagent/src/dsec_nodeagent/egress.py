"""The node agent's egress layer on the bus: programs attached to each sandbox's cgroup before
its first instruction, detached at exit, and every kernel verdict turned into a
``policy.violation`` event (the kernel refuses; the event explains)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from pathlib import Path
from urllib.parse import urlsplit

from dsec_core import events, retention
from dsec_core.settings import Settings
from dsec_core.spec import EnforcementPlan
from dsec_core.stackinfo import stack_endpoints
from prometheus_client import REGISTRY

from dsec_nodeagent.agent import Publish
from dsec_nodeagent.dns.policy import DnsBounds
from dsec_nodeagent.ebpf import EgressPlan, Verdict, VerdictEvent
from dsec_nodeagent.ebpf.controller import EgressController
from dsec_nodeagent.ebpf.metrics import EgressCollector
from dsec_nodeagent.stackdeny import deny_entries, local_addresses

log = logging.getLogger(__name__)


def stack_addresses(settings: Settings) -> list[str]:
    """Addresses of the stack's servers (NATS, Postgres, S3, Vault): DNS answers may not point
    there unless a rule allows internal targets. Names are resolved once, at start."""
    found: list[str] = []
    for name in ("nats_url", "postgres_dsn", "s3_endpoint", "vault_addr"):
        value = settings.endpoint(name)
        if not value:
            continue
        text = str(value)
        host = urlsplit(text if "://" in text else f"//{text}").hostname
        if not host:
            continue
        with contextlib.suppress(OSError, UnicodeError):
            found.extend(str(info[4][0]) for info in socket.getaddrinfo(host, None))
    return found


def violation(event: VerdictEvent) -> events.PolicyViolation:
    """The ``policy.violation`` payload of one kernel verdict."""
    call = event.hook.name.lower().rstrip("46")
    return events.PolicyViolation(
        layer="kernel",
        rule_id=event.rule_id
        or ("system.egress" if event.verdict is Verdict.DENY_STACK else "default-deny"),
        action="deny" if event.denied else "allow",
        operation=call,
        target=f"{event.address}:{event.port}/{event.protocol}",
        message=event.message(),
    )


class Egress:
    """Owns the egress controller for this node."""

    def __init__(self, settings: Settings, publish: Publish) -> None:
        self.home = settings.home.resolve()
        self.controller = EgressController(
            dns_upstream=settings.dns_upstream,
            dns_bounds=DnsBounds(
                max_ttl_s=settings.dns_max_ttl_s,
                sandbox_quota=settings.egress_sandbox_quota,
                max_addresses=settings.dns_max_answer_addresses,
                queries_per_s=settings.dns_queries_per_s,
                query_burst=max(1, round(settings.dns_queries_per_s * 2)),
                max_wildcard_prefix=settings.dns_max_wildcard_prefix,
            ),
            protected_addresses=[*local_addresses(), *stack_addresses(settings)],
            trusted_targets=settings.dns_trusted_targets,
        )
        self.settings = settings
        self._publish = publish
        self._cgroups: dict[str, Path] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        """Load the programs (or re-open the pinned ones) and re-adopt live sandboxes."""
        await self.controller.start()
        await self.deny_stack()
        report = await self.controller.reconcile()
        log.info("egress reconciled: adopted %s, removed %s", report.adopted, report.removed)
        self.controller.add_listener(self._on_verdict)
        self.controller.proxy.on_denied = self._on_dns_denied
        REGISTRY.register(EgressCollector(self.controller))

    async def deny_stack(self, extra: tuple[tuple[str, str, int], ...] = ()) -> int:
        """Put the stack's servers (settings + ``stack.json``, this agent's metrics port) in
        the kernel's deny set, which wins over every allow rule of every sandbox."""
        endpoints = (*stack_endpoints(self.settings), *extra)
        entries = await asyncio.to_thread(deny_entries, endpoints, local_addresses())
        # Added, not replaced: the pins are node-wide, and a second stack on the node (tests)
        # must not lift the first one's entries.
        count = await self.controller.set_stack_deny(entries, replace=False)
        log.info("egress: %d stack endpoint address(es) denied to every sandbox", count)
        return count

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

    def _on_dns_denied(
        self,
        sandbox_id: str,
        name: str,
        rdtype: str,
        *,
        rule_id: str = "default-deny",
        reason: str | None = None,
    ) -> None:
        if rule_id == "default-deny":
            message = (
                f"{name} matches no egress rule: the node's DNS proxy refused to resolve "
                "it (the sandbox's DNS can only reach the proxy)"
            )
        else:
            message = f"the node's DNS proxy refused {name}/{rdtype}: {reason}"
        self._emit(
            events.PolicyViolation(
                layer="kernel",
                rule_id=rule_id,
                action="deny",
                operation="dns",
                target=f"{name}/{rdtype}",
                message=message,
            ),
            sandbox_id,
        )

    def _emit(self, payload: events.PolicyViolation, sandbox_id: str) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(self._publish(payload, sandbox_id, None))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
