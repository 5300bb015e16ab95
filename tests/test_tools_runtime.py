"""Tools at run time, end to end: a real sandbox whose tool fails, then recovers.

The node agent runs in this process (real NATS, a real sandbox, its IPC broker); the agent in
the sandbox calls ``web_search`` through ``dsec_sdk.tools`` with the spec's ``tools:`` policy.
The first calls get HTTP 401 (a key the provider refuses), so the pipeline falls back to
``local_search`` and the node agent publishes ``tool.degraded`` (auth, a diagnosis naming the
key's lease, the fallback); then the key works again and ``tool.recovered`` follows. A real
Prometheus scrapes the node agent's metrics and shows the failures by class.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import socket
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dsec_cli.stack import domain
from dsec_cli.stack.adapters.servers import PrometheusServer
from dsec_core import events
from prometheus_client import REGISTRY, start_http_server

sys.path.insert(0, str(Path(__file__).parents[1] / "services" / "nodeagent" / "tests"))
from _nodeagent_harness import NodeAgentHarness

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

AGENT = """
import sys
from dsec_sdk.tools import ToolFailure, ToolRunner

tools = ToolRunner(on_event=lambda line: print(line, flush=True))
calls = 0

@tools.tool("web_search")
def web_search(query):
    global calls
    calls += 1
    if calls <= 3:  # the provider refuses the key, then takes it again
        raise ToolFailure("auth", "HTTP 401 Unauthorized", status=401)
    return "web: " + query

@tools.tool("local_search")
def local_search(query):
    return "local: " + query

answers = [tools.call("web_search", query=f"q{i}") for i in range(5)]
print(answers, flush=True)
tools.reporter.close()
expected = ["local: q0", "local: q1", "local: q2", "web: q3", "web: q4"]
sys.exit(0 if answers == expected else 1)
"""

TOOLS = """
tools:
  web_search:
    timeout: 5s
    retries: {attempts: 2, backoff: 10ms, max_backoff: 20ms}
    degraded_after: 2
"""


@pytest.fixture
def home() -> Iterator[Path]:
    """A short home: the sandboxes' socket paths must fit in AF_UNIX's 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="dtl-", dir="/tmp"))
    yield path / "home"
    shutil.rmtree(path, ignore_errors=True)


class _FastPrometheus(PrometheusServer):
    """The stack's Prometheus config (same template as `dsec up`), scraping every second."""

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


@pytest.fixture
def prometheus(home: Path) -> Iterator[str]:
    """A real Prometheus scraping this process's metrics (the node agent's, running here)."""
    if not PrometheusServer.default_binary():
        pytest.skip("prometheus not installed (Debian: apt-get install prometheus)")
    server, thread = start_http_server(0, addr="127.0.0.1", registry=REGISTRY)
    home.parent.joinpath("prom").mkdir()
    prom = _FastPrometheus(
        home.parent / "prom",
        ports=[_free_port()],
        services={"nodeagent": server.server_address[1]},
        die_with_parent=True,
    )
    try:
        prom.start(timeout=60)
        yield prom.url
    finally:
        prom.stop()
        server.shutdown()
        thread.join(timeout=5)


def _query(url: str, expr: str) -> list[Any]:
    query = urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(f"{url}/api/v1/query?{query}", timeout=10) as resp:
        body = json.loads(resp.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def _targets(url: str) -> Any:
    with urllib.request.urlopen(f"{url}/api/v1/targets", timeout=10) as resp:
        return [
            (t["scrapeUrl"], t["health"], t.get("lastError"))
            for t in json.loads(resp.read())["data"]["activeTargets"]
        ]


async def test_a_failing_tool_is_degraded_with_a_diagnosis_then_recovers(
    home: Path, nats_url: str, prometheus: str
) -> None:
    async with NodeAgentHarness(home, nats_url) as h:
        sid = await h.submit("toolsdemo", AGENT, extra=TOOLS)
        degraded = (await h.wait_for(sid, "tool.degraded", 120)).decoded()
        recovered = (await h.wait_for(sid, "tool.recovered", 60)).decoded()
        exited = (await h.wait_for(sid, "sandbox.exited", 60)).decoded()
    assert isinstance(exited, events.SandboxExited)
    assert exited.exit_code == 0, exited
    assert isinstance(degraded, events.ToolDegraded)
    assert (degraded.agent, degraded.tool) == ("toolsdemo", "web_search")
    assert (degraded.failure_class, degraded.status, degraded.failures) == ("auth", 401, 2)
    assert degraded.fallback == "local_search"  # the catalogue's fallback for web_search
    assert degraded.reason.startswith("HTTP 401 from web_search since ")
    assert "check the key rotation" in degraded.reason
    assert isinstance(recovered, events.ToolRecovered)
    assert (recovered.tool, recovered.failures) == ("web_search", 1)

    errors = 'sum by (class) (dsec_tool_errors_total{tool="web_search",agent="toolsdemo"})'
    deadline = time.monotonic() + 120  # generous: the machine may be loaded
    while not (result := await asyncio.to_thread(_query, prometheus, errors)):
        if time.monotonic() > deadline:
            targets = await asyncio.to_thread(_targets, prometheus)
            raise AssertionError(f"Prometheus never scraped dsec_tool_errors_total: {targets}")
        await asyncio.sleep(0.5)
    assert {r["metric"]["class"]: float(r["value"][1]) for r in result} == {"auth": 3.0}
    fallbacks = await asyncio.to_thread(
        _query,
        prometheus,
        'sum(dsec_tool_fallbacks_total{tool="web_search",fallback="local_search",'
        'agent="toolsdemo"})',
    )
    assert fallbacks and float(fallbacks[0]["value"][1]) >= 3
