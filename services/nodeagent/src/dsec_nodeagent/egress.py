"""The node agent's egress layer on the bus: programs attached to each sandbox's cgroup before
its first instruction, detached at exit, and every kernel verdict turned into a
``policy.violation`` event (the kernel refuses; the event explains)."""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from pathlib import Path
from urllib.parse import urlsplit

from dsec_core import events, retention
from dsec_core.settings import Settings
from dsec_core.spec import EnforcementPlan
from dsec_core.stackinfo import stack_endpoints
from dsec_core.text import bound
from prometheus_client import REGISTRY

from dsec_nodeagent import leftovers
from dsec_nodeagent.dns.policy import DnsBounds
from dsec_nodeagent.ebpf import EgressPlan, Verdict, VerdictEvent
from dsec_nodeagent.ebpf.controller import EgressController
from dsec_nodeagent.ebpf.metrics import EgressCollector
from dsec_nodeagent.outlet import EventOutlet
from dsec_nodeagent.refusals import Admission, Key
from dsec_nodeagent.semantic.reports import TARGET_LIMIT
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


def rule_of(event: VerdictEvent) -> str:
    """The rule a kernel verdict reports: the spec's, or the node's own."""
    return rule_named(event.rule_id, event.verdict)


def rule_named(rule_id: str | None, verdict: Verdict) -> str:
    """The rule of a verdict (an event's or a counter's): the spec's, or the node's own."""
    if rule_id:
        return rule_id
    if verdict is Verdict.DENY_STACK:
        return "system.egress"
    if verdict is Verdict.DENY_SOCKETS:
        return "system.sockets"
    return "system.bind" if verdict is Verdict.DENY_BIND else "default-deny"


def violation(event: VerdictEvent) -> events.PolicyViolation:
    """The ``policy.violation`` payload of one kernel verdict."""
    call = event.hook.name.lower().rstrip("46")
    return events.PolicyViolation(
        layer="kernel",
        rule_id=rule_of(event),
        action="deny" if event.denied else "allow",
        operation=call,
        target=f"{event.address}:{event.port}/{event.protocol}",
        message=event.message(),
    )


class Egress:
    """Owns the egress controller for this node."""

    def __init__(
        self,
        settings: Settings,
        outlet: EventOutlet,
        controller: EgressController | None = None,
    ) -> None:
        self.home = settings.home.resolve()
        self._stack: set[tuple[str, int]] = set()
        pin_dir, state_dir = settings.egress_dirs()
        # Only a controller of its own has the node's directories, removed at `dsec down`.
        self._own_state_root = state_dir.parent if controller is None else None
        self.controller = controller or EgressController(
            pin_dir=pin_dir,
            state_dir=state_dir,
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
            max_sandbox_sockets=settings.sandbox_max_sockets,
            trusted_targets=settings.dns_trusted_targets,
        )
        self.settings = settings
        self.outlet = outlet
        self._cgroups: dict[str, Path] = {}
        self._collector: EgressCollector | None = None
        # Per (sandbox, rule): the kernel's deny counter when this node agent started (adopted
        # sandboxes), denies published as events, denies added to the summaries.
        self._base: dict[tuple[str, str], int] = {}
        self._emitted: dict[tuple[str, str], int] = {}
        self._added: dict[tuple[str, str], int] = {}
        self._sample: dict[tuple[str, str], str] = {}  # a target read from the ring buffer

    async def start(self) -> None:
        """Load the programs (or re-open the pinned ones) and re-adopt live sandboxes."""
        await self.controller.start()
        if self._own_state_root is not None:  # whose it is, should this home vanish
            await asyncio.to_thread(leftovers.claim, self._own_state_root, self.home)
        await self.deny_stack()
        report = await self.controller.reconcile()
        log.info("egress reconciled: adopted %s, removed %s", report.adopted, report.removed)
        self.controller.add_listener(self._on_verdict)
        self.controller.proxy.on_denied = self._on_dns_denied
        collector = EgressCollector(self.controller)
        try:
            REGISTRY.register(collector)
            self._collector = collector
        except ValueError:  # a second node agent in one process (two-node tests): first's
            log.warning("egress metrics: another node agent of this process exports them")
        # Adopted sandboxes' earlier denies were reported by the previous node agent.
        self._base = self._denied_totals()
        self.outlet.before_flush.append(self.reconcile_counts)  # the kernel's maps are open

    async def deny_stack(self, extra: tuple[tuple[str, str, int], ...] = ()) -> int:
        """Put the stack's servers (settings + ``stack.json``, this agent's metrics port) in
        the kernel's deny set, which wins over every allow rule of every sandbox."""
        endpoints = (*stack_endpoints(self.settings), *extra)
        entries = await asyncio.to_thread(deny_entries, endpoints, local_addresses())
        # Added, not replaced: the pins are node-wide, and a second stack on the node (tests)
        # must not lift the first one's entries.
        count = await self.controller.set_stack_deny(entries, replace=False)
        self._stack |= entries
        log.info("egress: %d stack endpoint address(es) denied to every sandbox", count)
        return count

    def is_stack(self, address: str, port: int) -> bool:
        """Whether ``address:port`` is in the stack's deny set (loopback folded as the kernel
        does): the node agent's HTTPS proxy holds its upstream connects to it too."""
        ip = ipaddress.ip_address(address)
        if ip.is_loopback or ip.is_unspecified:
            address = "127.0.0.1" if ip.version == 4 else "::1"
        return (address, port) in self._stack

    async def close(self) -> None:
        """Stop reading verdicts; programs stay attached (fail-closed) — unless the stack is
        going down (``dsec down``) and no sandbox uses them any more: then the pinned maps and
        the egress state are removed too, so nothing of DSec stays in the kernel."""
        if self.reconcile_counts in self.outlet.before_flush:
            self.reconcile_counts()  # the last counts, while the kernel's maps are open
            self.outlet.before_flush.remove(self.reconcile_counts)
        if retention.down_marker(self.home).exists() and not self.controller.sandboxes():
            log.info("the stack is down and no sandbox is attached: removing the pinned maps")
            await self.controller.uninstall()
            if self._own_state_root is not None:
                leftovers.release(self._own_state_root)
            return
        await self.controller.close()
        if self._collector is not None:
            REGISTRY.unregister(self._collector)
            self._collector = None

    async def attach(
        self,
        sid: str,
        cgroup: Path,
        cgroup_id: int,
        plan: EnforcementPlan,
        private_ports: tuple[int, ...] = (),
    ) -> None:
        """Put a new sandbox's cgroup under its egress plan (before its first instruction);
        ``private_ports``: the node agent's listeners that serve it alone (its HTTPS proxy)."""
        await self.controller.attach(
            cgroup, EgressPlan.from_enforcement_plan(sid, plan, private_ports=private_ports)
        )
        self._cgroups[sid] = cgroup

    async def detach(self, sid: str) -> None:
        """Remove a finished sandbox's programs, map entries and DNS listener."""
        cgroup = self._cgroups.pop(sid, None)
        if cgroup is None:  # re-adopted after a restart: only the controller knows it
            cgroup = next(
                (a.cgroup_path for a in self.controller.sandboxes() if a.sandbox_id == sid), None
            )
        if cgroup is not None:
            # Before its counters go with the programs. Its events still in the ring buffer are
            # not read first (a neighbour's flood could keep that going): they count as unseen.
            self.reconcile_counts(only=sid)
            await self.controller.detach(cgroup)
        self._forget(sid)

    def reconcile_counts(self, only: str | None = None) -> None:
        """Add to the summaries the denies the kernel counted that were not published as
        events. Only the first few denies of a burst become events (read from the ring buffer,
        which the reader lets overflow in a flood); every other count comes from the kernel's
        per-rule counters, so the summaries are exact whatever the ring buffer dropped."""
        for key, total in self._denied_totals(only).items():
            needed = total - self._base.get(key, 0) - self._emitted.get(key, 0)
            missing = needed - self._added.get(key, 0)
            if missing > 0:
                self._added[key] = self._added.get(key, 0) + missing
                sample = self._sample.get(key, "")
                operation = "bind" if key[1] == "system.bind" else "connect"
                self.outlet.unseen(key[0], Key("kernel", key[1], operation), missing, sample)

    def _denied_totals(self, only: str | None = None) -> dict[tuple[str, str], int]:
        """The kernel's deny counters per (sandbox, rule)."""
        totals: dict[tuple[str, str], int] = {}
        for sample in self.controller.counters():
            if sample.sandbox_id is None or not sample.verdict.denied:
                continue
            if only is not None and sample.sandbox_id != only:
                continue
            key = (sample.sandbox_id, rule_named(sample.rule_id, sample.verdict))
            totals[key] = totals.get(key, 0) + sample.count
        return totals

    def _forget(self, sid: str) -> None:
        for table in (self._base, self._emitted, self._added, self._sample):
            for key in [k for k in table if k[0] == sid]:
                del table[key]

    def _on_verdict(self, event: VerdictEvent) -> None:
        if event.sandbox_id is None:
            return
        rule = rule_of(event)
        operation = event.hook.name.lower().rstrip("46")
        target = f"{event.destination}/{event.protocol}"
        if event.denied:
            self._sample[(event.sandbox_id, rule)] = target
        admission = self.outlet.refusal(
            event.sandbox_id,
            Key("kernel", rule, operation),
            target,
            lambda: violation(event),
            refused=event.denied,  # allows are events only for plans that log them
            counted_elsewhere=event.denied,  # denies past the burst: the kernel's counters
        )
        if event.denied and admission is Admission.EVENT:
            key = (event.sandbox_id, rule)
            self._emitted[key] = self._emitted.get(key, 0) + 1

    def _on_dns_denied(
        self,
        sandbox_id: str,
        name: str,
        rdtype: str,
        *,
        rule_id: str = "default-deny",
        reason: str | None = None,
    ) -> None:
        target = bound(f"{name}/{rdtype}", TARGET_LIMIT)
        if rule_id == "default-deny":
            message = (
                f"{target} matches no egress rule: the node's DNS proxy refused to resolve "
                "it (the sandbox's DNS can only reach the proxy)"
            )
        else:
            message = bound(f"the node's DNS proxy refused {target}: {reason}", 512)

        def event() -> events.PolicyViolation:
            return events.PolicyViolation(
                layer="kernel",
                rule_id=rule_id,
                action="deny",
                operation="dns",
                target=target,
                message=message,
            )

        self.outlet.refusal(sandbox_id, Key("dns", rule_id, "dns"), target, event)
