"""The node agent's egress layer on the bus: programs attached to each sandbox's cgroup before
its first instruction, detached at exit, and every kernel verdict turned into a
``policy.violation`` event (the kernel refuses; the event explains)."""

from __future__ import annotations

import logging
from pathlib import Path

from dsec_core import events
from dsec_core.settings import Settings
from dsec_core.spec import EnforcementPlan
from dsec_core.text import bound
from prometheus_client import REGISTRY

from dsec_nodeagent.ebpf import EgressPlan, VerdictEvent
from dsec_nodeagent.ebpf.controller import EgressController
from dsec_nodeagent.ebpf.metrics import EgressCollector
from dsec_nodeagent.outlet import EventOutlet
from dsec_nodeagent.refusals import Admission, Key
from dsec_nodeagent.semantic.reports import TARGET_LIMIT

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

    def __init__(
        self,
        settings: Settings,
        outlet: EventOutlet,
        controller: EgressController | None = None,
    ) -> None:
        self.controller = controller or EgressController(dns_upstream=settings.dns_upstream)
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
        report = await self.controller.reconcile()
        log.info("egress reconciled: adopted %s, removed %s", report.adopted, report.removed)
        self.controller.add_listener(self._on_verdict)
        self.controller.proxy.on_denied = self._on_dns_denied
        self._collector = EgressCollector(self.controller)
        REGISTRY.register(self._collector)
        # Adopted sandboxes' earlier denies were reported by the previous node agent.
        self._base = self._denied_totals()
        self.outlet.before_flush.append(self.reconcile_counts)  # the kernel's maps are open

    async def close(self) -> None:
        """Stop reading verdicts; programs stay attached (fail-closed)."""
        if self.reconcile_counts in self.outlet.before_flush:
            self.reconcile_counts()  # the last counts, while the kernel's maps are open
            self.outlet.before_flush.remove(self.reconcile_counts)
        await self.controller.close()
        if self._collector is not None:
            REGISTRY.unregister(self._collector)
            self._collector = None

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
                self.outlet.unseen(key[0], Key("kernel", key[1], "connect"), missing, sample)

    def _denied_totals(self, only: str | None = None) -> dict[tuple[str, str], int]:
        """The kernel's deny counters per (sandbox, rule)."""
        totals: dict[tuple[str, str], int] = {}
        for sample in self.controller.counters():
            if sample.sandbox_id is None or not sample.verdict.denied:
                continue
            if only is not None and sample.sandbox_id != only:
                continue
            key = (sample.sandbox_id, sample.rule_id or "default-deny")
            totals[key] = totals.get(key, 0) + sample.count
        return totals

    def _forget(self, sid: str) -> None:
        for table in (self._base, self._emitted, self._added, self._sample):
            for key in [k for k in table if k[0] == sid]:
                del table[key]

    def _on_verdict(self, event: VerdictEvent) -> None:
        if event.sandbox_id is None:
            return
        rule = event.rule_id or "default-deny"
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

    def _on_dns_denied(self, sandbox_id: str, name: str, rdtype: str) -> None:
        target = bound(f"{name}/{rdtype}", TARGET_LIMIT)

        def event() -> events.PolicyViolation:
            return events.PolicyViolation(
                layer="kernel",
                rule_id="default-deny",
                action="deny",
                operation="dns",
                target=target,
                message=f"{target} matches no egress rule: the node's DNS proxy refused to "
                "resolve it (the sandbox's DNS can only reach the proxy)",
            )

        self.outlet.refusal(sandbox_id, Key("dns", "default-deny", "dns"), target, event)
