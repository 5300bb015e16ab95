"""Dashboards shipped in deploy/grafana query only metrics that DSec really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import dsec_core.metrics  # noqa: F401  (registers the service metrics)

# The node agent's metrics: refused semantic reports, the ring-buffer reader, the broker's,
# refusals with their events and floods.
import dsec_nodeagent.agent
import dsec_nodeagent.ebpf.controller
import dsec_nodeagent.ipc.metrics
import dsec_nodeagent.outlet  # noqa: F401  (imported for its metrics)
import dsec_scheduler.metrics  # noqa: F401  (the scheduler's placement metrics)
import pytest
from prometheus_client import REGISTRY, generate_latest

pytestmark = pytest.mark.unit

DASHBOARDS_DIR = Path(__file__).parents[1] / "deploy" / "grafana"
DASHBOARDS = sorted(DASHBOARDS_DIR.glob("*.json"))
PROMQL_FUNCTIONS = {
    "sum",
    "rate",
    "by",
    "histogram_quantile",
    "le",
    "service",
    "type",
    "final",
    "job",
    "instance",
    "up",
}


def _exported() -> set[str]:
    text = generate_latest(REGISTRY).decode()
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":  # series exist once observed; the names are fixed
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def test_every_dashboard_metric_is_exported() -> None:
    assert DASHBOARDS, "no dashboards shipped"
    exported = _exported() | {"up"}  # `up` is Prometheus' own per-target metric
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                names = set(re.findall(r"\b([a-z_][a-z0-9_]*)\b(?=\s*[\{\[])", target["expr"]))
                names -= PROMQL_FUNCTIONS - {"up"}
                missing = names - exported
                assert not missing, f"{path.name} panel {panel['title']!r} queries {missing}"


def test_the_placement_row_shows_the_schedulers_placement_metrics() -> None:
    """Operators find GPU allocation, pending reasons, decisions and their latency in one row."""
    panels = json.loads((DASHBOARDS_DIR / "dsec-backbone.json").read_text())["panels"]
    titles = [p["title"] for p in panels]
    row = titles.index("Placement")
    assert panels[row]["type"] == "row"
    exprs = " ".join(t["expr"] for p in panels[row + 1 :] for t in p.get("targets", []))
    for name in (
        "dsec_scheduler_gpu_allocation_ratio",
        "dsec_scheduler_pending_units",
        "dsec_scheduler_placements_total",
        "dsec_scheduler_placement_seconds_bucket",
    ):
        assert name in exprs, name
        assert name.removesuffix("_bucket") in generate_latest(REGISTRY).decode(), name
