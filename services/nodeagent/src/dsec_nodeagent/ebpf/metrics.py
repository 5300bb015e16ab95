"""Prometheus view of egress enforcement.

`EgressCollector` reads the kernel's per-CPU counters at scrape time — every verdict is counted,
allows included, without a ring-buffer event per connect — and exports their sums by rule and
verdict (never a series per sandbox). Register it once per controller::

    REGISTRY.register(EgressCollector(controller))
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

from prometheus_client import Counter
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from dsec_nodeagent.ebpf.controller import EgressController
from dsec_nodeagent.ebpf.model import Verdict, VerdictEvent
from dsec_nodeagent.refusals import metric_rule

VERDICT_EVENTS = Counter(
    "dsec_egress_verdict_events",
    "Verdict events read from the kernel ring buffer (denies, and allows when logged), by rule "
    "and verdict",
    ["rule", "verdict"],
)


def rule_label(rule_id: str | None) -> str:
    """A bounded label for a rule id: ``-`` when no rule decided (``deny_no_rule``), else the
    plan's ``egress[i]`` (see :func:`dsec_nodeagent.refusals.metric_rule`)."""
    return "-" if rule_id is None else metric_rule(rule_id)


def count_event(event: VerdictEvent) -> None:
    """Listener for `EgressController.add_listener`: count one verdict event."""
    VERDICT_EVENTS.labels(rule_label(event.rule_id), event.verdict.label).inc()


class EgressCollector(Collector):
    """``dsec_egress_connections_total{rule,verdict}`` from the kernel counters.

    The kernel counts per (sandbox cgroup, rule slot, verdict); Prometheus gets the sums over
    the node's sandboxes by rule label and verdict, so no series is per sandbox. A sandbox's
    counters vanish with its cgroup: the collector adds each scrape's increase per cgroup to
    running totals, so the exported counters never go down (what a sandbox counted between
    its last scrape and its end is not seen).
    """

    def __init__(self, controller: EgressController) -> None:
        self.controller = controller
        self._last: dict[tuple[int, str | None, Verdict], int] = {}
        self._totals: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()

    def collect(self) -> Iterator[CounterMetricFamily]:
        """Yield one counter family with a sample per (rule, verdict) seen on this node."""
        now: dict[tuple[int, str | None, Verdict], int] = {}
        for sample in self.controller.counters():
            key = (sample.cgroup_id, sample.rule_id, sample.verdict)
            now[key] = now.get(key, 0) + sample.count
        with self._lock:
            for key, count in now.items():
                before = self._last.get(key, 0)
                grown = count - before if count >= before else count  # a reused cgroup id
                label = (rule_label(key[1]), key[2].label)
                self._totals[label] = self._totals.get(label, 0) + grown
            self._last = now
            totals = dict(self._totals)
        family = CounterMetricFamily(
            "dsec_egress_connections",
            "Connect/sendmsg decisions of the egress hooks on this node, by rule (egress[i], "
            "or - when none matched) and verdict (allow, deny_no_rule, deny_rate_limit, ...)",
            labels=["rule", "verdict"],
        )
        for (rule, verdict), count in sorted(totals.items()):
            family.add_metric([rule, verdict], count)
        yield family
