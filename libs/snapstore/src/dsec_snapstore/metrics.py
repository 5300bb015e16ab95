"""Prometheus metrics of snapshot work, exported by whoever does it (the node agent for the
sandboxes it runs, the snapshot service for those that run nowhere)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Literal

from dsec_core import events
from prometheus_client import Histogram

Operation = Literal["create", "restore", "start"]

SNAPSHOT_SECONDS = Histogram(
    "dsec_snapshot_seconds",
    "Snapshot work from request to answer, by operation (create; restore: a rollback; start: "
    "a sandbox started from a snapshot) and outcome (ok, failed)",
    ["operation", "outcome"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)


def observe(operation: Operation, started: float, outcome: str) -> None:
    """Record one operation that began at ``started`` (``time.perf_counter``)."""
    SNAPSHOT_SECONDS.labels(operation, outcome).observe(time.perf_counter() - started)


def answered(
    operation: Operation, started: float, out: Sequence[events.Payload]
) -> Sequence[events.Payload]:
    """Record a handler's answer (``snapshot.failed`` or not) and return it unchanged."""
    failed = any(isinstance(p, events.SnapshotFailed) for p in out)
    observe(operation, started, "failed" if failed else "ok")
    return out
