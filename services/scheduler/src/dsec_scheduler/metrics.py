"""The scheduler's own Prometheus metrics (the runtime's are in :mod:`dsec_core.metrics`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

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

# Placement of compute units (README, "Placement").
GPU_ALLOCATION = Gauge(
    "dsec_scheduler_gpu_allocation_ratio",
    "GPU thousandths allocated / capacity of schedulable and unschedulable nodes, per canonical "
    "GPU model and 'all'",
    ["model"],
)
PENDING_REASONS: tuple[str, ...] = (
    "gpu_model",
    "gpu_share",
    "gpus",
    "cpu",
    "memory",
    "unschedulable",
    "quota",
    "queue",
    "no_nodes",
)
"""The bounded classes of why a sandbox waits (``dsec_scheduler_pending_units{reason}``)."""
PENDING_UNITS = Gauge(
    "dsec_scheduler_pending_units",
    "Sandboxes pending, by the class of the reason they wait for ("
    + ", ".join(PENDING_REASONS)
    + ")",
    ["reason"],
)
PLACEMENTS = Counter(
    "dsec_scheduler_placements_total",
    "Placement decisions, by policy and outcome (placed, unfit, quota, queued)",
    ["policy", "outcome"],
)
PLACEMENT_SECONDS = Histogram(
    "dsec_scheduler_placement_seconds",
    "Time to decide one sandbox's placement (all its units), by policy",
    ["policy"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
)


def pending_class(reason: str, unfit: dict[str, int] | None = None) -> str:
    """The class of a pending reason (one of :data:`PENDING_REASONS`)."""
    if reason.startswith("quota"):
        return "quota"
    if reason.startswith("queued behind"):
        return "queue"
    if reason.startswith("no node has joined") or not unfit:
        return "no_nodes" if reason.startswith("no node has joined") else "unschedulable"
    top = max(unfit.items(), key=lambda kv: (kv[1], kv[0]))[0].lower()
    if "gpu of model" in top:
        return "gpu_model"
    if "share" in top:
        return "gpu_share"
    if "gpu" in top or "nvlink" in top:
        return "gpus"
    if "cpu" in top:
        return "cpu"
    if "memory" in top:
        return "memory"
    return "unschedulable"


# The read model's view of every request (README, "Observability"): how many sandboxes are in
# each live state and how long the oldest one has had no event. States are the lifecycle's
# fixed set (dsec_core.lifecycle.State).
LIVE_STATES: tuple[str, ...] = (
    "submitted",
    "validated",
    "resolved",
    "built",
    "pending",
    "scheduled",
    "running",
    "lost",
)
SANDBOXES = Gauge(
    "dsec_sandboxes",
    "Sandboxes not ended, by lifecycle state, as the read model (Postgres) has them",
    ["state"],
)
STATE_AGE = Gauge(
    "dsec_sandbox_state_oldest_seconds",
    "Seconds since the last event of the oldest sandbox in each live state (0: none in it); a "
    "request stuck between submitted and running grows it",
    ["state"],
)
READ_MODEL_FAILURES = Counter(
    "dsec_read_model_export_failures_total",
    "Times the scheduler could not read the sandboxes read model for its gauges",
)
