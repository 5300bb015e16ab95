"""Prometheus view of egress enforcement.

`EgressCollector` reads the kernel's per-CPU counters at scrape time — every verdict is counted,
allows included, without a ring-buffer event per connect. Register it once per controller::

    REGISTRY.register(EgressCollector(controller))
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from dsec_nodeagent.ebpf.controller import EgressController
from dsec_nodeagent.ebpf.model import VerdictEvent

VERDICT_EVENTS = Counter(
    "dsec_egress_verdict_events",
    "Verdict events read from the kernel ring buffer (denies, and allows when logged)",
    ["sandbox", "rule", "verdict"],
)


def count_event(event: VerdictEvent) -> None:
    """Listener for `EgressController.add_listener`: count one verdict event."""
    VERDICT_EVENTS.labels(event.sandbox_id or "", event.rule_id or "", event.verdict.label).inc()


class EgressCollector(Collector):
    """``dsec_egress_connections_total{sandbox,rule,verdict}`` from the kernel counters."""

    def __init__(self, controller: EgressController) -> None:
        self.controller = controller

    def collect(self) -> Iterator[CounterMetricFamily]:
        """Yield one counter family with a sample per (sandbox, rule, verdict)."""
        family = CounterMetricFamily(
            "dsec_egress_connections",
            "Connect/sendmsg decisions of the egress hooks, by sandbox, rule and verdict",
            labels=["sandbox", "rule", "verdict"],
        )
        for sample in self.controller.counters():
            family.add_metric(
                [
                    sample.sandbox_id or str(sample.cgroup_id),
                    sample.rule_id or "",
                    sample.verdict.label,
                ],
                sample.count,
            )
        yield family
