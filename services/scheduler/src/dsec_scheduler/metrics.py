"""The scheduler's own Prometheus metrics (the runtime's are in :mod:`dsec_core.metrics`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

NODES = Gauge(
    "dsec_scheduler_nodes",
    "Nodes the scheduler knows, by placement state (ready, cordoned, unhealthy, lost)",
    ["state"],
)
WAITING = Gauge("dsec_scheduler_waiting", "Sandboxes waiting for a node (pending or lost)")
DECISIONS = Counter(
    "dsec_scheduler_decisions_total",
    "Decisions published: sandbox.scheduled, sandbox.pending, unit.lost, node.lost, ...",
    ["type"],
)
