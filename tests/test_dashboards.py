"""Dashboards shipped in deploy/grafana query only metrics that DSec really exports, and every
panel's query is evaluated by a real Prometheus (the embedded stack's, configured from the same
template and alert rules as `dsec up`) scraping those metrics."""

from __future__ import annotations

import json
import re
import socket
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dsec_builder.metrics  # build and resolution durations
import dsec_core.metrics  # noqa: F401  (registers the service metrics)

# The node agent's metrics: refused semantic reports, the ring-buffer reader, the broker's,
# refusals with their events and floods, DNS, starts and running sandboxes.
import dsec_nodeagent.agent
import dsec_nodeagent.dns.proxy
import dsec_nodeagent.ebpf.controller
import dsec_nodeagent.ipc.metrics
import dsec_nodeagent.outlet  # imported for its metrics
import dsec_nodeagent.toolwatch  # the dsec_tool_* metrics
import dsec_scheduler.metrics  # the scheduler's placement and live-state metrics
import dsec_snapstore.metrics
import pytest
import yaml
from dsec_cli.stack import domain
from dsec_cli.stack.adapters.servers import PrometheusServer
from dsec_core import metrics as core_metrics
from dsec_core.projections import LiveState
from dsec_nodeagent.ebpf.controller import CounterSample
from dsec_nodeagent.ebpf.metrics import EgressCollector
from dsec_nodeagent.ebpf.model import Verdict
from dsec_nodeagent.outlet import REFUSALS
from dsec_scheduler.app import export_live_states
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest, start_http_server
from prometheus_client.registry import Collector

DASHBOARDS_DIR = Path(__file__).parents[1] / "deploy" / "grafana"
DASHBOARDS = sorted(DASHBOARDS_DIR.glob("*.json"))
ALERTS = Path(__file__).parents[1] / "deploy" / "prometheus" / "alerts.yml"
# Metric names: DSec's own, the client library's process metrics, Prometheus' `up`.
METRIC = re.compile(r"\b(?:dsec|process|python)_[a-z0-9_]+\b|\bup\b")
EXPECTED_DASHBOARDS = {
    "dsec-backbone",
    "dsec-lifecycle",
    "dsec-security",
    "dsec-fleet",
    "dsec-bus",
    "dsec-tools",
}


class _Controller:
    """Stands in for the node agent's egress controller: kernel counters of two sandboxes."""

    def counters(self) -> list[CounterSample]:
        return [
            CounterSample(1, "sbx-a", "egress[0]", Verdict.ALLOW, 3),
            CounterSample(2, "sbx-b", None, Verdict.DENY_NO_RULE, 2),
        ]


class _Exported(Collector):
    """What a node agent with egress enforcement exports: the process registry plus the
    egress collector it registers when the eBPF programs load."""

    def __init__(self) -> None:
        self.egress = EgressCollector(_Controller())  # type: ignore[arg-type]

    def collect(self) -> Iterator[Any]:
        names = set()
        for family in REGISTRY.collect():
            names.add(family.name)
            yield family
        for family in self.egress.collect():
            if family.name not in names:  # a kernel test of this session registered one
                yield family


def _registry() -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Exported())
    return registry


def _exported(registry: CollectorRegistry) -> set[str]:
    text = generate_latest(registry).decode()
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":  # series exist once observed; the names are fixed
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def _metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (label matchers and strings left out)."""
    bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    bare = re.sub(r"\{[^}]*\}", "", bare)
    bare = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", bare)
    return set(METRIC.findall(bare))


def _targets() -> Iterator[tuple[str, str, str]]:
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                yield path.stem, panel["title"], target["expr"]


def test_the_dashboards_for_lifecycle_security_fleet_and_bus_are_shipped() -> None:
    uids = {json.loads(p.read_text())["uid"]: p.stem for p in DASHBOARDS}
    assert set(uids) == EXPECTED_DASHBOARDS
    assert all(uid == stem for uid, stem in uids.items())  # provisioned by file name
    for path in DASHBOARDS:
        ids = [p["id"] for p in json.loads(path.read_text())["panels"]]
        assert len(ids) == len(set(ids)), f"{path.name}: panel ids repeat"


def test_every_dashboard_metric_is_exported() -> None:
    assert DASHBOARDS, "no dashboards shipped"
    exported = _exported(_registry()) | {"up"}  # `up` is Prometheus' own per-target metric
    for dashboard, title, expr in _targets():
        names = _metric_names(expr)
        assert names, f"{dashboard} panel {title!r}: no metric in {expr!r}"
        missing = names - exported
        assert not missing, f"{dashboard} panel {title!r} queries {missing}"


def test_no_dashboard_metric_has_a_per_sandbox_label() -> None:
    """Bounded label sets: a series per sandbox would grow without bound."""
    text = generate_latest(_registry()).decode()
    for line in text.splitlines():
        if line.startswith("dsec_"):
            assert "sandbox=" not in line and "sandbox_id=" not in line, line


def test_the_tools_dashboard_is_generated_with_a_row_per_tool_family() -> None:
    """docs/tools.md: one row per family of the tool catalogue (and `other`), generated."""
    import importlib.util

    script = Path(__file__).parents[1] / "scripts" / "tools_dashboard.py"
    spec = importlib.util.spec_from_file_location("tools_dashboard", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    path = DASHBOARDS_DIR / "dsec-tools.json"
    assert path.read_text() == module.render(), "run `uv run python scripts/tools_dashboard.py`"
    rows = [p["title"] for p in json.loads(path.read_text())["panels"] if p["type"] == "row"]
    assert rows == ["Tools: overview", *(f"Family: {f}" for f in module.families())]
    assert "Family: search" in rows and rows[-1] == "Family: other"


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


# --- against a real Prometheus -----------------------------------------------------------------


class _FastPrometheus(PrometheusServer):
    """The stack's Prometheus, its config rendered from the same template and alert rules as
    `dsec up`, scraping every second so that rates have data within seconds."""

    def prepare(self) -> None:
        super().prepare()
        text = domain.render_prometheus_config(
            self.template_path().read_text(),
            services=self.services,
            prometheus_port=self.ports[0],
            scrape_interval="1s",
        )
        self.config_path.write_text(text)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _api(url: str, path: str, **params: str) -> Any:
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    with urllib.request.urlopen(f"{url}/api/v1/{path}{query}", timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return body


def _poll(what: str, check: Any, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def _observe_what_services_observe() -> None:
    """One sample of the metrics the new dashboards are about, through the code that sets
    them in the services."""
    dsec_nodeagent.agent.observe_start({"env_stage": 40.0, "plan": 1.0, "exec": 2.0, "total": 80})
    dsec_nodeagent.agent.STARTS.labels("started").inc()
    export_live_states({"submitted": LiveState(1, 42.0), "running": LiveState(2, 300.0)})
    dsec_snapstore.metrics.observe("create", time.perf_counter(), "ok")
    dsec_builder.metrics.BUILD_SECONDS.labels("built").observe(2.5)
    dsec_builder.metrics.RESOLVE_SECONDS.labels("resolved").observe(0.4)
    core_metrics.CONSUMER_PENDING.labels("policy", "policy-spec-submitted").set(0)
    core_metrics.CONSUMER_ACK_PENDING.labels("policy", "policy-spec-submitted").set(0)
    core_metrics.EVENTS_REJECTED.labels("policy", "spec.submitted", "revoked-key").inc(0)
    REFUSALS.labels("kernel", "seccomp").inc()
    dsec_scheduler.metrics.NODES.labels("ready").set(1)
    dsec_nodeagent.dns.proxy.DNS_QUERIES.labels("answer").inc()
    _observe_tool_calls()


def _observe_tool_calls() -> None:
    """A web_search that failed and fell back to local_search, through the node agent's
    tool watch (as the SDK reports it)."""
    from dsec_core.spec import compile_plan, load_spec

    spec = load_spec(
        'version: "1.2"\nname: dash\nbase: dsec/python311:latest\nentrypoint: [python, a.py]\n'
    )
    assert spec.spec is not None
    watch = dsec_nodeagent.toolwatch.ToolWatch("node-1", _no_publish)
    watch.watch("sbx_dashboard", "dash", compile_plan(spec.spec))
    calls = [
        ["web_search", "call", "error", "timeout", 2000.0, 3, 0, "", ""],
        ["local_search", "call", "ok", "", 4.0, 1, 0, "web_search", ""],
    ]
    watch.report("sbx_dashboard", "dash", {"calls": calls})
    watch.http("sbx_dashboard", "api.websearch.test")


async def _no_publish(payload: Any, aggregate_id: str) -> None:
    """The dashboards test publishes no event."""


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not PrometheusServer.default_binary():
        pytest.skip("prometheus not installed (Debian: apt-get install prometheus)")
    _observe_what_services_observe()
    server, thread = start_http_server(0, addr="127.0.0.1", registry=_registry())
    port = server.server_address[1]
    prom = _FastPrometheus(
        tmp_path_factory.mktemp("prometheus"),
        ports=[_free_port()],
        services={"nodeagent": port},
        die_with_parent=True,
    )
    try:
        prom.start(timeout=60)
        yield prom.url
    finally:
        prom.stop()
        server.shutdown()
        thread.join(timeout=5)


@pytest.mark.integration
def test_every_panel_query_evaluates_on_a_real_prometheus(prometheus: str) -> None:
    """Prometheus scraped the metrics (three scrapes: rates have data); every query of every
    dashboard evaluates without error; each metric it reads is one Prometheus scraped from the
    DSec target; a query whose metrics all have samples and no label filter returns data."""

    def scraped_thrice() -> bool:
        data = _api(prometheus, "query", query='count_over_time(up{job="dsec"}[1m])')["data"]
        return bool(data["result"]) and float(data["result"][0]["value"][1]) >= 3

    _poll("three scrapes of the DSec target", scraped_thrice)
    metadata = _api(prometheus, "metadata")["data"]
    text = generate_latest(_registry()).decode()
    lines = [line for line in text.splitlines() if not line.startswith("#")]
    with_samples = {line.split("{")[0].split(" ")[0] for line in lines}
    assert metadata, "Prometheus recorded no metadata from the DSec target"
    evaluated = 0
    for dashboard, title, expr in _targets():
        where = f"{dashboard} panel {title!r}: {expr}"
        body = _api(prometheus, "query", query=expr)
        assert not body.get("warnings"), f"{where}: {body['warnings']}"
        names = _metric_names(expr) - {"up"}
        for name in names:
            family = re.sub(r"_(bucket|sum|count|total)$", "", name)  # OpenMetrics names
            assert name in metadata or family in metadata, f"{where}: {name} never scraped"
        if names <= with_samples and "{" not in expr:
            assert body["data"]["result"], f"{where}: no data although every metric has samples"
        evaluated += 1
    assert evaluated >= 60


@pytest.mark.integration
def test_the_stacks_prometheus_loads_and_evaluates_every_alert_rule(prometheus: str) -> None:
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    expected = {r["alert"] for g in groups for r in g["rules"] if "alert" in r}

    def evaluated() -> dict[str, str] | None:
        loaded = _api(prometheus, "rules")["data"]["groups"]
        health = {r["name"]: r["health"] for g in loaded for r in g["rules"]}
        return health if set(health) == expected and "unknown" not in health.values() else None

    health = _poll("every alert rule evaluated", evaluated)
    assert {name for name, h in health.items() if h != "ok"} == set(), health
