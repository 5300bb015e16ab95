"""Generate deploy/grafana/dsec-tools.json: an overview row, then a row per tool family (the
tool catalogue's categories, plus ``other`` for tools it does not know).

Run: ``uv run python scripts/tools_dashboard.py`` (tests/test_dashboards.py checks the file is
what this prints).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from dsec_rules.infer.catalogue import load_catalogue

OUT = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "dsec-tools.json"


def families() -> list[str]:
    return [*sorted({tool.category for tool in load_catalogue().tools}), "other"]


def _panel(
    pid: int,
    title: str,
    description: str,
    x: int,
    y: int,
    unit: str,
    targets: list[tuple[str, str]],
    w: int = 6,
) -> dict[str, Any]:
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "description": description,
        "gridPos": {"x": x, "y": y, "w": w, "h": 7},
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"expr": expr, "legendFormat": legend, "refId": chr(ord("A") + i)}
            for i, (expr, legend) in enumerate(targets)
        ],
    }


def _row(pid: int, title: str, y: int) -> dict[str, Any]:
    return {
        "id": pid,
        "type": "row",
        "title": title,
        "collapsed": False,
        "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
        "panels": [],
    }


def dashboard() -> dict[str, Any]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    panels.append(_row(pid, "Tools: overview", y))
    pid, y = pid + 1, y + 1
    overview = [
        (
            "Degraded tools",
            "Tools of an agent that failed degraded_after calls in a row "
            "(tool.degraded; back to 0 on tool.recovered)",
            "short",
            [("max by (tool, agent) (dsec_tool_degraded)", "{{tool}} ({{agent}})")],
        ),
        (
            "Error ratio by family",
            "Failed calls / calls, by tool family",
            "percentunit",
            [
                (
                    "sum by (family) (rate(dsec_tool_errors_total[5m])) / "
                    'sum by (family) (rate(dsec_tool_calls_total{side="call"}[5m]))',
                    "{{family}}",
                )
            ],
        ),
        (
            "Retries and fallbacks / s",
            "Attempts beyond the first, and calls a fallback served",
            "ops",
            [
                ("sum by (tool) (rate(dsec_tool_retries_total[5m]))", "retries {{tool}}"),
                (
                    "sum by (tool, fallback) (rate(dsec_tool_fallbacks_total[5m]))",
                    "{{tool}} → {{fallback}}",
                ),
            ],
        ),
        (
            "Reports refused / s",
            "Tool-call reports (or records) the node agent refused: "
            "rate, size, malformed, from outside a sandbox",
            "ops",
            [("sum by (reason) (rate(dsec_tool_reports_refused_total[5m]))", "{{reason}}")],
        ),
    ]
    for i, (title, description, unit, targets) in enumerate(overview):
        panels.append(_panel(pid, title, description, 6 * i, y, unit, targets))
        pid += 1
    y += 7
    for family in families():
        sel = f'family="{family}"'
        panels.append(_row(pid, f"Family: {family}", y))
        pid, y = pid + 1, y + 1
        per_family = [
            (
                "Calls / s by tool and outcome",
                "Calls made (side=call) and served (side=serve); "
                "plain HTTP requests the semantic layer saw (side=http)",
                "ops",
                [
                    (
                        f"sum by (tool, side, outcome) (rate(dsec_tool_calls_total{{{sel}}}[5m]))",
                        "{{tool}} {{side}} {{outcome}}",
                    )
                ],
            ),
            (
                "Errors / s by tool and class",
                "timeout, rate_limited, auth, bad_arguments, "
                "upstream_5xx, network_policy, unavailable, tool_error",
                "ops",
                [
                    (
                        f"sum by (tool, class) (rate(dsec_tool_errors_total{{{sel}}}[5m]))",
                        "{{tool}} {{class}}",
                    )
                ],
            ),
            (
                "Latency p50 / p99 by tool (ms)",
                "dsec_tool_latency_ms of calls made, retries included",
                "ms",
                [
                    (
                        f"histogram_quantile(0.5, sum by (tool, le) "
                        f"(rate(dsec_tool_latency_ms_bucket"
                        f'{{{sel},side="call"}}[5m])))',
                        "p50 {{tool}}",
                    ),
                    (
                        f"histogram_quantile(0.99, sum by (tool, le) "
                        f"(rate(dsec_tool_latency_ms_bucket"
                        f'{{{sel},side="call"}}[5m])))',
                        "p99 {{tool}}",
                    ),
                ],
            ),
            (
                "Degraded and fallbacks",
                "Degraded tools of the family, and fallback calls / s",
                "short",
                [
                    (f"sum by (tool, agent) (dsec_tool_degraded{{{sel}}})", "degraded {{tool}}"),
                    (
                        f"sum by (tool, fallback) (rate(dsec_tool_fallbacks_total{{{sel}}}[5m]))",
                        "{{tool}} → {{fallback}}",
                    ),
                ],
            ),
        ]
        for i, (title, description, unit, targets) in enumerate(per_family):
            panels.append(_panel(pid, title, description, 6 * i, y, unit, targets))
            pid += 1
        y += 7
    return {
        "title": "DSec tools",
        "uid": "dsec-tools",
        "description": "Tools at run time (docs/tools.md): calls, errors by failure class, "
        "latency, retries, fallbacks and degraded tools, a row per tool family.",
        "schemaVersion": 39,
        "version": 1,
        "tags": ["dsec"],
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "10s",
        "templating": {
            "list": [{"name": "datasource", "type": "datasource", "query": "prometheus"}]
        },
        "links": [
            {"title": "DSec dashboards", "type": "dashboards", "tags": ["dsec"], "asDropdown": True}
        ],
        "panels": panels,
    }


def render() -> str:
    return json.dumps(dashboard(), indent=2, ensure_ascii=False) + "\n"


if __name__ == "__main__":
    if "--check" in sys.argv:
        sys.exit(0 if OUT.read_text() == render() else 1)
    OUT.write_text(render())
    print(f"wrote {OUT}")
