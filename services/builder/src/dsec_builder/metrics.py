"""The builder's Prometheus metrics (the runtime's are in :mod:`dsec_core.metrics`)."""

from __future__ import annotations

from prometheus_client import Histogram

RESOLVE_SECONDS = Histogram(
    "dsec_resolve_seconds",
    "Dependency resolution of one plan, by outcome (resolved, conflict)",
    ["outcome"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
)
BUILD_SECONDS = Histogram(
    "dsec_build_seconds",
    "Time to produce one environment archive, from deps.resolved to env.built, by outcome "
    "(reused: the archive was stored already; built: installed, packed and stored)",
    ["outcome"],
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200),
)
