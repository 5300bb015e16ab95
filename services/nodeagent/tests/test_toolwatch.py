"""Tools observed end to end through a real broker: two agents (observed DSecClients) call each
other; the node agent's tool watch turns their reports into metrics and
tool.degraded/tool.recovered, attributed to the connection's sandbox; the caller's trace
context crosses the call in the request frame. Plus the watch's bounds against a hostile
sandbox, without a broker."""

from __future__ import annotations

import io
import os
import shutil
import sys
import tempfile
import threading
import urllib.error
from collections.abc import Iterator
from email.message import Message
from pathlib import Path
from typing import Any

import pytest
from dsec_core import events
from dsec_core.spec import compile_plan, load_spec
from dsec_sdk import BadArguments, DSecClient, RemoteError
from dsec_sdk.tools import tracing
from prometheus_client import REGISTRY

from dsec_nodeagent import toolwatch as tw
from dsec_nodeagent.ipc import AgentKey
from dsec_nodeagent.toolwatch import SecretLease, ToolWatch, effective_tools

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the test kit
from _ipc_testkit import BrokerThread, wait_until

SPEC = """
version: "1.2"
name: searcher
base: dsec/python311:latest
entrypoint: [python, agent.py]
runtime_context:
  env_vars:
    - name: WEB_SEARCH_KEY
      source: vault://secret/default/agent-tools/websearch#key
      ttl: 2h
security_policy:
  network:
    egress:
      - domain: api.websearch.test
        ports: [443]
tools:
  web_search:
    timeout: 2s
    degraded_after: 2
    secret: WEB_SEARCH_KEY
    hosts: [api.websearch.test]
"""


def plan() -> Any:
    result = load_spec(SPEC, "dsec.yaml")
    assert result.spec is not None, result.errors
    return compile_plan(result.spec, source=result.source)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


class Published:
    def __init__(self) -> None:
        self.items: list[tuple[events.Payload, str]] = []

    async def __call__(self, payload: events.Payload, aggregate_id: str) -> None:
        self.items.append((payload, aggregate_id))

    def types(self) -> list[str]:
        return [payload.TYPE for payload, _ in self.items]


@pytest.mark.unit
def test_effective_policy_merges_the_catalogue_under_the_spec() -> None:
    tools = effective_tools(plan())
    assert tools["web_search"]["fallback"] == ["local_search"]  # the catalogue's
    assert tools["web_search"]["timeout_s"] == 2.0  # the spec's
    assert tools["web_search"]["degraded_after"] == 2
    assert tools["web_search"]["family"] == "search"
    assert tools["local_search"]["family"] == "search"


@pytest.mark.unit
def test_degraded_then_recovered_with_a_diagnosis_naming_the_lease() -> None:
    now = [1_000.0]
    wall = [1_796_169_600.0]  # 2026-12-02T00:00:00Z
    watch = ToolWatch("node-1", Published(), clock=lambda: now[0], wall=lambda: wall[0])
    lease = SecretLease("WEB_SEARCH_KEY", "acc-123", wall[0], 7200.0)
    watch.watch("sbx_unit1", "searcher", plan(), [lease])
    fail = ["web_search", "call", "error", "auth", 12.0, 1, 401, "", ""]
    watch.report("sbx_unit1", "searcher", {"calls": [fail]})
    assert watch.published == []
    wall[0] += 9000  # past the lease's TTL
    watch.report("sbx_unit1", "searcher", {"calls": [fail]})
    (degraded,) = watch.published
    assert isinstance(degraded, events.ToolDegraded)
    assert (degraded.tool, degraded.failure_class, degraded.status) == ("web_search", "auth", 401)
    assert degraded.fallback == "local_search"
    assert "401 since the lease of WEB_SEARCH_KEY expired at 02:00:00Z" in degraded.reason
    assert "check the key rotation" in degraded.reason
    assert sample("dsec_tool_degraded", tool="web_search", family="search", agent="searcher") == 1
    now[0] += 23
    ok = ["web_search", "call", "ok", "", 80.0, 2, 0, "", ""]
    watch.report("sbx_unit1", "searcher", {"calls": [ok]})
    recovered = watch.published[-1]
    assert isinstance(recovered, events.ToolRecovered)
    assert recovered.degraded_s == 23.0
    assert sample("dsec_tool_degraded", tool="web_search", family="search", agent="searcher") == 0


@pytest.mark.unit
def test_plain_http_calls_count_for_the_spec_s_and_the_catalogue_s_hosts() -> None:
    watch = ToolWatch("node-1", Published())
    watch.watch("sbx_http", "crawler", plan())
    labels = {"family": "search", "agent": "crawler", "side": "http", "outcome": "seen"}
    before = sample("dsec_tool_calls_total", tool="web_search", **labels)
    tavily = sample("dsec_tool_calls_total", tool="tavily_search", **labels)
    watch.http("sbx_http", "API.websearch.test.")  # the spec's tools.web_search.hosts
    watch.http("sbx_http", "api.tavily.com")  # the catalogue's tavily_search
    watch.http("sbx_http", "unknown.example.com")  # no tool: not counted
    watch.http("sbx_other", "api.tavily.com")  # not a watched sandbox
    assert sample("dsec_tool_calls_total", tool="web_search", **labels) == before + 1
    assert sample("dsec_tool_calls_total", tool="tavily_search", **labels) == tavily + 1


@pytest.mark.unit
def test_refusals_of_the_sandbox_s_own_policy_are_named_in_the_diagnosis() -> None:
    now = [0.0]
    watch = ToolWatch("node-1", Published(), clock=lambda: now[0])
    watch.watch("sbx_rules", "searcher", plan())
    watch.refused("sbx_rules", "http_proxy", "egress[0]", "https://api.websearch.test/v1")
    limited = ["web_search", "call", "error", "rate_limited", 5.0, 3, 429, "", ""]
    watch.report("sbx_rules", "searcher", {"calls": [limited, limited]})
    degraded = watch.published[-1]
    assert isinstance(degraded, events.ToolDegraded)
    assert "rate limited by the sandbox's own policy, not its provider" in degraded.reason
    assert "rule egress[0]" in degraded.reason
    ok = ["web_search", "call", "ok", "", 5.0, 1, 0, "", ""]
    watch.report("sbx_rules", "searcher", {"calls": [ok]})
    now[0] += 1000  # long after: the refusal is forgotten
    watch.refused("sbx_rules", "semantic", "semantic[1]", "")  # the node agent passes no target
    refused = ["web_search", "call", "error", "network_policy", 1.0, 1, 0, "", ""]
    watch.report("sbx_rules", "searcher", {"calls": [refused, refused]})
    degraded = watch.published[-1]
    assert isinstance(degraded, events.ToolDegraded)
    assert degraded.failure_class == "network_policy"
    assert "rule semantic[1] refused it (a spec problem" in degraded.reason


@pytest.mark.unit
def test_a_hostile_sandbox_is_bounded() -> None:
    now = [0.0]
    watch = ToolWatch("node-1", Published(), clock=lambda: now[0])
    watch.watch("sbx_hostile", "mallory", plan())
    refused_before = sample("dsec_tool_reports_refused_total", reason="unknown_sandbox")
    watch.report("sbx_other", "mallory", {"calls": []})  # not a sandbox the node watches
    after = sample("dsec_tool_reports_refused_total", reason="unknown_sandbox")
    assert after == refused_before + 1
    # Fresh tool names: only UNKNOWN_TOOLS_PER_SANDBOX get a label of their own.
    calls = [[f"t{i}", "call", "ok", "", 1.0, 1, 0, "", ""] for i in range(40)]
    malformed = [
        ["web_search", "call", "error", "not-a-class", 1.0, 1, 0, "", ""],
        ["web_search", "call", "ok", "", float("nan"), 1, 0, "", ""],
        ["bad name!", "call", "ok", "", 1.0, 1, 0, "", ""],
        ["web_search", "call", "ok", "", 1.0, 10**9, 0, "", ""],
        "not a list",
    ]
    watch.report("sbx_hostile", "mallory", {"calls": calls + malformed})
    own = [
        i
        for i in range(40)
        if sample(
            "dsec_tool_calls_total",
            tool=f"t{i}",
            family="other",
            agent="mallory",
            side="call",
            outcome="ok",
        )
    ]
    assert len(own) == tw.UNKNOWN_TOOLS_PER_SANDBOX
    other = sample(
        "dsec_tool_calls_total",
        tool="other",
        family="other",
        agent="mallory",
        side="call",
        outcome="ok",
    )
    assert other == 40 - tw.UNKNOWN_TOOLS_PER_SANDBOX
    # The rate bound: a burst, then one report per 1/REPORTS_PER_S.
    rate_before = sample("dsec_tool_reports_refused_total", reason="rate")
    for _ in range(int(tw.REPORT_BURST) + 10):
        watch.report("sbx_hostile", "mallory", {"calls": []})
    assert sample("dsec_tool_reports_refused_total", reason="rate") - rate_before >= 10
    # Events: at most EVENTS_PER_MINUTE per sandbox, however it flaps.
    fail = ["web_search", "call", "error", "timeout", 1.0, 1, 0, "", ""]
    ok = ["web_search", "call", "ok", "", 1.0, 1, 0, "", ""]
    for _ in range(100):
        now[0] += 1.0  # refills the report budget
        watch.report("sbx_hostile", "mallory", {"calls": [fail, fail, ok]})
    assert (
        len([p for p in watch.published if p.TYPE.startswith("tool.")]) <= tw.EVENTS_PER_MINUTE * 2
    )


@pytest.mark.unit
def test_sandboxes_spending_the_nodes_unknown_tool_labels_leave_a_neighbours_tools_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Names no policy knows get labels of their own only within a node-wide budget. Sandboxes
    that spend it (16 fresh names each, and each restart again) must not take a neighbour's
    declared tool its label, nor its health events."""
    monkeypatch.setattr(tw, "MAX_TOOL_LABELS", 32)
    now = [1_000.0]
    wall = [1_796_169_600.0]
    watch = ToolWatch("node-1", Published(), clock=lambda: now[0], wall=lambda: wall[0])
    for n in range(4):  # 4 x 16 fresh names: the node's budget of 32 is spent
        sid = f"sbx_spender{n}"
        watch.watch(sid, "mallory", plan())
        calls = [[f"x{n}_{i}", "call", "ok", "", 1.0, 1, 0, "", ""] for i in range(16)]
        watch.report(sid, "mallory", {"calls": calls})
    neighbour = "sbx_neighbour_tools"
    watch.watch(neighbour, "searcher", plan(), [SecretLease("WEB_SEARCH_KEY", "a", wall[0], 60)])
    wall[0] += 120  # its lease expired
    fail = ["web_search", "call", "error", "auth", 12.0, 1, 401, "", ""]
    watch.report(neighbour, "searcher", {"calls": [fail, fail]})
    assert [p.TYPE for p in watch.published] == ["tool.degraded"]
    assert sample("dsec_tool_degraded", tool="web_search", family="search", agent="searcher") == 1
    # Declared names have a node budget of their own too: labels stay bounded however many
    # specs come and go (here 1: the next declared name is 'other').
    monkeypatch.setattr(tw, "MAX_DECLARED_TOOL_LABELS", 1)
    box = watch._sandboxes[neighbour]
    assert [watch._tool_label(box, t) for t in ("web_search", "local_search")] == [
        "web_search",
        "other",
    ]


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dsec-tools-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def spans() -> Iterator[Any]:
    """An in-memory OpenTelemetry exporter as the process's tracer provider."""
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.reset()
    yield exporter
    exporter.shutdown()
    tracing.reset()


def http_401() -> urllib.error.HTTPError:
    return urllib.error.HTTPError("https://api.websearch.test", 401, "no", Message(), io.BytesIO())


@pytest.mark.integration
def test_calls_through_the_broker_become_metrics_events_and_one_trace(
    sock_dir: Path, spans: Any
) -> None:
    published = Published()
    watch = ToolWatch("node-1", published)
    broker = BrokerThread(sock_dir / "ipc.sock")
    broker.broker.tool_reports = watch.report
    sandbox = f"pid-{os.getpid()}"  # a broker without sandboxes: each process is its own
    watch.watch(sandbox, "searcher", plan())
    healthy = threading.Event()

    def web_search(query: str) -> list[str]:
        if not healthy.is_set():
            raise http_401()
        return [f"result for {query}"]

    server = DSecClient("searcher", "g1", socket_path=broker.socket_path, observe=True)
    server.add_tool("web_search", web_search)
    thread = threading.Thread(target=server.serve, daemon=True)
    thread.start()
    wait_until(lambda: broker.broker.local_server(AgentKey("g1", "searcher")), what="server")
    caller = DSecClient("planner", "g1", socket_path=broker.socket_path, observe=True, timeout=20)
    try:
        with pytest.raises(BadArguments):  # observed, a signature mismatch is still that
            caller.call_tool("searcher", "web_search", q="memfd")
        for _ in range(2):
            with pytest.raises(RemoteError):
                caller.call_tool("searcher", "web_search", query="memfd")
        wait_until(lambda: "tool.degraded" in published.types(), what="tool.degraded")
        healthy.set()
        assert caller.call_tool("searcher", "web_search", query="memfd") == ["result for memfd"]
        wait_until(lambda: "tool.recovered" in published.types(), what="tool.recovered")
    finally:
        caller.close()
        server.stop()
        thread.join(10)
        broker.stop()
    degraded = next(p for p, _ in published.items if isinstance(p, events.ToolDegraded))
    # The caller saw a remote error whose text says 401: classified as auth on its side.
    assert (degraded.agent, degraded.tool, degraded.failure_class) == (
        "planner",
        "web_search",
        "auth",
    )
    assert all(aggregate == sandbox for _, aggregate in published.items)
    assert degraded.trace_id  # tracing is on: the event points at the failing call's trace
    served_errors = sample(
        "dsec_tool_errors_total",
        tool="web_search",
        family="search",
        agent="searcher",
        **{"class": "auth"},
    )
    assert served_errors >= 2
    # One trace per call: the serving span is the caller's child.
    finished = spans.get_finished_spans()
    calls = [s for s in finished if s.name == "call searcher.web_search"]
    serves = [s for s in finished if s.name == "serve web_search"]
    assert len(calls) == 4 and len(serves) == 4
    by_trace = {s.context.trace_id: s for s in calls}
    for serve in serves:
        parent = by_trace[serve.context.trace_id]
        assert serve.parent is not None and serve.parent.span_id == parent.context.span_id
        assert serve.attributes["dsec.tool"] == "web_search"
    assert f"{calls[0].context.trace_id:032x}" in {degraded.trace_id} | {
        f"{s.context.trace_id:032x}" for s in calls
    }


def test_the_sdk_and_the_events_name_the_same_failure_classes() -> None:
    """The SDK (no dsec_core inside a sandbox) keeps its own copy of the classes it reports;
    the node agent accepts exactly those of ``tool.degraded``."""
    from typing import get_args

    from dsec_core import events
    from dsec_sdk.tools.classify import FailureClass

    assert set(get_args(FailureClass)) == set(get_args(events.ToolFailureClass))
