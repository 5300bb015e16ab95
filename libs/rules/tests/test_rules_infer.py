"""Static analysis of agent code: tools, hosts, keys, commands and paths, without running it."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsec_core.spec import load_spec

from dsec_rules.domain import infer
from dsec_rules.infer.analyzer import analyze_files, analyze_source
from dsec_rules.infer.catalogue import load_catalogue
from dsec_rules.infer.needs import InferredNeeds
from dsec_rules.infer.render import render_policy_yaml

pytestmark = pytest.mark.unit

AGENTS = Path(__file__).parent / "agents"
REPO = Path(__file__).resolve().parents[3]


def read_dir(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.glob("*.py"))}


@pytest.fixture(scope="module")
def needs() -> InferredNeeds:
    return infer(read_dir(AGENTS))


def tools_by_name(needs: InferredNeeds) -> dict[str, tuple[str, str]]:
    return {t.name: (t.framework, t.where) for t in needs.tools}


def test_framework_tool_idioms_are_found(needs: InferredNeeds) -> None:
    assert tools_by_name(needs) == {
        "quote_of_the_day": ("langchain", "langchain_agent.py:15"),
        "stock_price": ("langchain", "langchain_agent.py:21"),
        "translate": ("langchain", "langchain_agent.py:36"),
        "summarize": ("langchain", "langchain_agent.py:37"),
        "TavilySearchResults": ("catalogue", "langchain_agent.py:38"),
        "llm-math": ("langchain", "langchain_agent.py:39"),
        "wikipedia": ("langchain", "langchain_agent.py:39"),
        "kb_lookup": ("llamaindex", "llamaindex_agent.py:21"),
        "db_ping": ("llamaindex", "llamaindex_agent.py:22"),
        "weather_lookup": ("crewai", "crewai_agent.py:12"),
        "Fetch page": ("crewai", "crewai_agent.py:24"),
        "SerperDevTool": ("catalogue", "crewai_agent.py:32"),
        "calculator": ("autogen", "autogen_agent.py:27"),
        "report": ("autogen", "autogen_agent.py:28"),
    }


def test_hosts_come_from_literal_urls_and_are_attributed_to_tools(needs: InferredNeeds) -> None:
    egress = {(e.host, e.port): e.tools for e in needs.egress}
    assert egress[("api.quotes.test", 443)] == ("quote_of_the_day",)  # f-string with a constant
    assert egress[("market.test", 8443)] == ("stock_price",)  # explicit port
    assert egress[("translate.test", 443)] == ("summarize", "translate")  # through a helper
    assert egress[("kb.internal.test", 8443)] == ("kb_lookup",)
    assert egress[("10.0.0.5", 5432)] == ("db_ping",)  # socket connect
    assert egress[("api.openweathermap.org", 443)] == ("weather_lookup",)  # aiohttp session
    # Prebuilt tools need what the catalogue says; a local tool's needs come from its own code.
    assert ("api.tavily.com", 443) in egress and ("google.serper.dev", 443) in egress
    assert ("www.alphavantage.co", 443) not in egress


def test_a_parameter_never_borrows_another_functions_constant(needs: InferredNeeds) -> None:
    unresolved = [(u.where, u.kind) for u in needs.unresolved]
    assert ("crewai_agent.py:29", "http") in unresolved
    weather = next(e for e in needs.egress if e.host == "api.openweathermap.org")
    assert all("crewai_agent.py:29" not in s for s in weather.sources)


def test_environment_reads_and_catalogue_secrets(needs: InferredNeeds) -> None:
    env = {e.name: (e.secret, e.has_default) for e in needs.env}
    assert env["MARKET_TOKEN"] == (True, False)  # os.environ["..."]
    assert env["OPENAI_API_KEY"] == (True, False)  # os.getenv
    assert env["OPENWEATHERMAP_API_KEY"] == (True, False)  # os.environ.get
    assert env["AGENT_DEBUG"] == (False, True)  # has a default, not a secret
    assert env["TAVILY_API_KEY"] == (True, False)  # read by a prebuilt tool's client library
    assert "ALPHAVANTAGE_API_KEY" not in env


def test_commands_and_paths(needs: InferredNeeds) -> None:
    assert {c.argv0: c.tools for c in needs.commands} == {
        "python3": ("calculator",),
        "git": ("report",),
    }
    paths = {(p.path, p.write) for p in needs.paths}
    assert paths == {
        ("/data/input.csv", False),
        ("/workspace/output/report.md", True),  # Path constant / "name"
        ("/var/cache/agent", True),  # f-string: the literal directory part
    }


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("import requests\nrequests.get('https://a.test/x')", ("a.test", 443)),
        ("import httpx\nhttpx.Client(base_url='http://b.test:8080')", ("b.test", 8080)),
        ("from urllib.request import urlopen\nurlopen('https://c.test')", ("c.test", 443)),
        ("import aiohttp\naiohttp.request('GET', 'wss://d.test/ws')", ("d.test", 443)),
        ("import requests as r\nU='https://e.test'\nr.post(U + '/v1')", ("e.test", 443)),
        ("import requests\nrequests.get('https://%s.test' % 'x')", None),
        ("import requests\nrequests.get(url)", None),
    ],
)
def test_http_clients(code: str, expected: tuple[str, int] | None) -> None:
    findings = analyze_source(code, "m.py")
    hosts = [(h.host, h.port) for h in findings.http]
    assert hosts == ([expected] if expected else [])
    if expected is None:
        assert findings.unresolved


def test_subprocess_and_open_modes() -> None:
    code = (
        "import subprocess, os\n"
        "subprocess.run(['curl', '-s', url])\n"
        "os.system('ls -la /tmp')\n"
        "open('/etc/hosts')\n"
        "open('/tmp/x.txt', mode='a')\n"
        "os.makedirs('/workspace/cache')\n"
    )
    findings = analyze_source(code, "m.py")
    assert [s.argv for s in findings.subprocesses] == [("curl", "-s", "*"), ("ls", "-la", "/tmp")]
    assert [(f.path, f.write) for f in findings.file_access] == [
        ("/etc/hosts", False),
        ("/tmp/x.txt", True),
        ("/workspace/cache", True),
    ]


def test_syntax_errors_are_reported_not_raised() -> None:
    findings = analyze_files({"bad.py": b"def oops(:\n    pass\n", "notes.txt": b"x"})
    (failure,) = findings.parse_failures
    assert (failure.file, failure.line) == ("bad.py", 1)
    assert findings.files == ("bad.py",)


def test_websearch_example_names_the_host_and_the_key() -> None:
    needs = infer(read_dir(REPO / "examples/websearch-agent"))
    assert [(e.host, e.port, e.tools) for e in needs.egress] == [
        ("api.websearch.test", 443, ("web_search",))
    ]
    assert [(e.name, e.secret) for e in needs.env] == [("WEB_SEARCH_KEY", True)]
    text = render_policy_yaml(needs)
    assert "domain: api.websearch.test" in text and "name: WEB_SEARCH_KEY" in text
    assert "write_allowed: [/workspace/output]" in text


@pytest.mark.parametrize("directory", [AGENTS, REPO / "examples/websearch-agent"])
def test_rendered_block_pastes_into_a_valid_spec(directory: Path) -> None:
    block = render_policy_yaml(infer(read_dir(directory)))
    spec = 'version: "1.2"\nname: pasted\nbase: dsec/python311:latest\n' + block
    result = load_spec(spec, "pasted.yaml")
    assert result.ok, [e.format() for e in result.errors]


def test_catalogue_has_the_semantics_of_at_least_40_tools() -> None:
    catalogue = load_catalogue()
    assert len(catalogue.tools) >= 40
    names = [t.name for t in catalogue.tools]
    assert len(names) == len(set(names))
    for tool in catalogue.tools:
        assert tool.function and tool.category and tool.latency_ms >= 0
    tavily = catalogue.lookup("Tavily-Search-Results")
    assert tavily is not None and tavily.secrets == ("TAVILY_API_KEY",)
    assert tavily.egress[0].domain == "api.tavily.com"
    assert catalogue.lookup("no such tool") is None
