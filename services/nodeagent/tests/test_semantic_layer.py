"""The semantic layer: rules applied inside the sandbox's Python, decisions streamed out."""

from __future__ import annotations

import asyncio
import http.server
import importlib.util
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the test kit
from _dsec_sandbox_testkit import (
    Recorder,
    managed,
    read_json_output,
    run_to_end,
    snippet_config,
)
from dsec_core.spec.loader import load_spec

from dsec_nodeagent.sandbox.plan import RULES_FILE, encode_rules
from dsec_nodeagent.semantic import compile_rules, rules_from_spec, site_dir

RUNTIME_FILE = site_dir() / "dsec_semantic_runtime.py"


def _runtime() -> Any:
    spec = importlib.util.spec_from_file_location("dsec_semantic_runtime_under_test", RUNTIME_FILE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _engine(rules: dict[str, Any]) -> Any:
    return _runtime().Engine(compile_rules(rules), None)


# ---------------------------------------------------------------- pure rule decisions (unit)


@pytest.mark.unit
def test_deny_message_names_the_rule_and_the_spec_line() -> None:
    engine = _engine(
        {
            "spec_file": "agent.yaml",
            "rules": [
                {
                    "name": "no-etc",
                    "on": "open",
                    "match": {"path": "/etc/*"},
                    "action": "deny",
                    "spec_line": 31,
                    "message": "configuration is off limits",
                }
            ],
        }
    )
    with pytest.raises(PermissionError) as info:
        engine.decide("open", "/etc/passwd", {"path": "/etc/passwd"})
    assert str(info.value) == (
        "[dsec] open '/etc/passwd' denied by rule 'no-etc': configuration is off limits; "
        "to allow it, change that rule in agent.yaml line 31"
    )


@pytest.mark.unit
def test_first_matching_rule_wins_and_redirect_returns_the_target() -> None:
    engine = _engine(
        {
            "rules": [
                {
                    "name": "cache",
                    "on": "http",
                    "match": {"host": "*.example.com"},
                    "action": "redirect",
                    "target": "http://127.0.0.1:9/mirror",
                },
                {"name": "all-http", "on": "http", "match": {"url": "*"}, "action": "deny"},
            ]
        }
    )
    decision = engine.decide(
        "http",
        "https://api.example.com/v1",
        {"url": "https://api.example.com/v1", "host": "api.example.com"},
    )
    assert (decision.action, decision.subject) == ("redirect", "http://127.0.0.1:9/mirror")
    with pytest.raises(PermissionError, match="all-http"):
        engine.decide(
            "http", "https://other.org/", {"url": "https://other.org/", "host": "other.org"}
        )


@pytest.mark.unit
def test_subprocess_rule_matches_argv_by_base_name() -> None:
    engine = _engine(
        {
            "rules": [
                {
                    "name": "no-curl",
                    "on": "subprocess",
                    "match": {"argv": ["curl", "*"]},
                    "action": "deny",
                }
            ]
        }
    )
    with pytest.raises(PermissionError, match="no-curl"):
        engine.decide("subprocess", "/usr/bin/curl x", {"argv": ["/usr/bin/curl", "x"]})
    assert engine.decide("subprocess", "ls", {"argv": ["ls"]}).action == "allow"


@pytest.mark.unit
def test_rate_limit_counts_requests_not_connections() -> None:
    engine = _engine(
        {
            "rate_limits": [
                {
                    "name": "egress[0] api.example.com",
                    "host": "api.example.com",
                    "requests": 3,
                    "period_s": 60,
                    "spec_line": 12,
                }
            ]
        }
    )
    facts = {"url": "https://api.example.com/q", "host": "api.example.com"}
    for _ in range(3):
        engine.decide("http", facts["url"], facts)
    with pytest.raises(PermissionError) as info:
        engine.decide("http", facts["url"], facts)
    assert "rate limit 3 requests per 60s" in str(info.value)
    assert "line 12" in str(info.value)


@pytest.mark.unit
def test_the_layer_loads_its_rules_without_json_and_denies_on_first_use(tmp_path: Path) -> None:
    # It runs at every sandboxed interpreter's start: json, fnmatch (re) and _socket wait for
    # the first rule match or report; the rules come as marshal (no _json), the rate limits'
    # deque from _collections (not the collections package), and no __future__ import. A fresh
    # interpreter (no site, no PYTHON* variables) shows what it imported.
    rules = compile_rules(
        {
            "rules": [
                {"name": "no-etc", "on": "open", "match": {"path": "/etc/*"}, "action": "deny"},
                {"name": "quiet", "on": "http", "match": {"host": "*.é.test"}, "action": "log"},
            ],
            "rate_limits": [{"name": "api", "host": "api.test", "requests": 2, "period_s": 60}],
        }
    )
    rules_file = tmp_path / RULES_FILE
    rules_file.write_bytes(encode_rules(rules))
    program = (
        "import sys\n"
        f"sys.path.insert(0, {str(site_dir())!r})\n"
        "import dsec_semantic_runtime as r\n"
        f"engine = r.install({str(rules_file)!r}, None)\n"
        "late = {'json', '_json', 'collections', '__future__', 'fnmatch', 're', '_socket'}\n"
        "late = sorted(late & set(sys.modules))\n"
        "try:\n"
        "    open('/etc/hostname')\n"
        "    denied = False\n"
        "except PermissionError:\n"
        "    denied = True\n"
        "import http.client\n"
        "patched = http.client.HTTPConnection.putrequest.__qualname__\n"
        "print(repr((late, denied, patched, [x.name for x in engine.rules])))\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-S", "-c", program], capture_output=True, text=True, check=True
    ).stdout
    patched = "_wrap_http_client.<locals>.putrequest"  # patched once imported, not before
    assert out.strip() == repr(([], True, patched, ["no-etc", "quiet"]))


@pytest.mark.unit
def test_bad_rules_are_refused_with_the_rule_named() -> None:
    with pytest.raises(ValidationError, match=r"'r1'.*matches on path"):
        compile_rules(
            {"rules": [{"name": "r1", "on": "open", "match": {"url": "x"}, "action": "deny"}]}
        )
    with pytest.raises(ValidationError, match="'r2': redirect needs a target"):
        compile_rules(
            {
                "rules": [
                    {
                        "name": "r2",
                        "on": "subprocess",
                        "match": {"argv": ["x"]},
                        "action": "redirect",
                        "target": "y",
                    }
                ]
            }
        )


@pytest.mark.unit
def test_rules_from_a_spec_carry_its_lines_and_rate_limits() -> None:
    text = (
        'version: "1.2"\nname: demo\nbase: python:3.11\n'
        "security_policy:\n"
        "  network:\n    egress:\n      - domain: api.example.com\n"
        "        rate_limit: 100req/min\n"
        "  semantic:\n"
        "    - on: open\n      match: {path: /etc/*}\n      action: deny\n"
    )
    result = load_spec(text, "agent.yaml")
    assert result.ok, result.errors
    assert result.spec is not None
    rules = rules_from_spec(result.spec.security_policy, result.source, "agent.yaml")
    assert rules.rules[0].spec_line == 10
    assert rules.rules[0].name == "semantic[0] deny open /etc/*"
    assert (rules.rate_limits[0].requests, rules.rate_limits[0].period_s) == (100, 60)


@pytest.mark.unit
def test_a_connects_rate_is_left_to_the_kernel() -> None:
    text = (
        'version: "1.2"\nname: demo\nbase: python:3.11\n'
        "security_policy:\n"
        "  network:\n    egress:\n"
        "      - {domain: a.example.com, rate_limit: 10connects/min}\n"
        "      - {domain: b.example.com, rate_limit: 10requests/min}\n"
    )
    result = load_spec(text, "agent.yaml")
    assert result.ok and result.spec is not None, result.errors
    rules = rules_from_spec(result.spec.security_policy, result.source, "agent.yaml")
    assert [limit.host for limit in rules.rate_limits] == ["b.example.com"]


# ---------------------------------------------------------------- inside a real sandbox (kernel)


class _KeepAlive(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def http_server() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _KeepAlive)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


SANDBOX_CODE = r"""
import ctypes, http.client, json, os, subprocess, sys
report = {}
try:
    open("/workspace/output/blocked.txt", "w")
except PermissionError as exc:
    report["deny"] = str(exc)
open("/workspace/output/real.txt", "w").write("redirected")
report["redirect"] = open("/workspace/output/alias.txt").read()
open("/workspace/output/logged.txt", "w").write("x")
try:
    subprocess.run([sys.executable, "-c", "print(1)"])
except PermissionError as exc:
    report["subprocess"] = str(exc)
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.open(b"/workspace/output/blocked.txt", os.O_WRONLY | os.O_CREAT, 0o644)
report["ctypes_bypass_fd"] = fd   # the semantic layer cannot see ctypes: it explains, not enforces
conn = http.client.HTTPConnection("127.0.0.1", int(os.environ["PORT"]))
statuses = []
try:
    for _ in range(5):
        conn.request("GET", "/item?q=1")
        statuses.append(conn.getresponse().read().decode())
except PermissionError as exc:
    report["rate"] = str(exc)
report["served"] = statuses
print(json.dumps(report))
"""


@pytest.mark.kernel
async def test_rules_apply_inside_the_sandbox_and_every_decision_is_reported(
    tmp_path: Path, http_server: int
) -> None:
    rules = compile_rules(
        {
            "spec_file": "agent.yaml",
            "rules": [
                {
                    "name": "no-blocked",
                    "on": "open",
                    "match": {"path": "/workspace/output/blocked*"},
                    "action": "deny",
                    "spec_line": 40,
                },
                {
                    "name": "alias",
                    "on": "open",
                    "match": {"path": "/workspace/output/alias.txt"},
                    "action": "redirect",
                    "target": "/workspace/output/real.txt",
                },
                {
                    "name": "watch",
                    "on": "open",
                    "match": {"path": "/workspace/output/logged.txt"},
                    "action": "log",
                },
                {
                    "name": "no-children",
                    "on": "subprocess",
                    "match": {"argv": ["*"]},
                    "action": "deny",
                    "spec_line": 44,
                },
            ],
            "rate_limits": [
                {
                    "name": "egress[0] 127.0.0.1",
                    "host": "127.0.0.1",
                    "requests": 3,
                    "period_s": 60,
                    "spec_line": 21,
                }
            ],
        }
    )
    recorder = Recorder()
    async with managed(tmp_path / "home", recorder) as manager:
        result = await run_to_end(
            manager,
            snippet_config(
                "semantic",
                SANDBOX_CODE,
                tmp_path,
                semantic_rules=rules,
                # a spec's own import path: the layer does not ride on PYTHONPATH, so this
                # cannot switch it off (it did before 2026-12-04)
                env={"PORT": str(http_server), "PYTHONPATH": "/workspace/code"},
            ),
        )
        decisions = await recorder.wait_decisions(7)
    report = read_json_output(result)
    assert report["deny"] == (
        "[dsec] open '/workspace/output/blocked.txt' denied by rule 'no-blocked'; "
        "to allow it, change that rule in agent.yaml line 40"
    )
    assert report["redirect"] == "redirected"
    assert "denied by rule 'no-children'" in report["subprocess"]
    assert report["ctypes_bypass_fd"] >= 0
    assert report["served"] == ["ok", "ok", "ok"]  # one keep-alive connection, 3 requests
    assert "rate limit 3 requests per 60s" in report["rate"]
    seen = {(d.rule, d.action) for d in decisions}
    assert {
        ("no-blocked", "deny"),
        ("alias", "redirect"),
        ("watch", "log"),
        ("no-children", "deny"),
        (None, "deny"),
    } <= seen
    assert all(d.sandbox_id == "semantic" for d in decisions)
    rate = next(d for d in decisions if d.rule is None)
    assert rate.subject == f"http://127.0.0.1:{http_server}/item"  # no query string


@pytest.mark.unit
def test_rules_from_the_typed_plan_are_those_of_the_spec() -> None:
    """The node agent reads the rules (with their lines) from spec.validated's typed plan, never
    the YAML: the same rules as compiling the spec itself."""
    from dsec_core.spec import compile_plan

    from dsec_nodeagent.semantic import rules_from_plan

    text = (
        'version: "1.2"\nname: demo\nbase: python:3.11\n'
        "security_policy:\n"
        "  network:\n    egress:\n"
        "      - {domain: api.example.com, rate_limit: 100req/min}\n"
        "      - {domain: '*.cdn.example.com', rate_limit: 5requests/s}\n"
        "      - {domain: a.example.com, rate_limit: 10connects/min}\n"
        "      - {cidr: 10.0.0.0/8, ports: [443]}\n"
        "  semantic:\n"
        "    - on: open\n      match: {path: /etc/*}\n      action: deny\n"
        "    - on: subprocess\n      match: {argv: [curl, '*']}\n      action: log\n"
    )
    result = load_spec(text, "agent.yaml")
    assert result.ok and result.spec is not None, result.errors
    plan = compile_plan(result.spec, source=result.source, spec_file="agent.yaml")
    from_plan = rules_from_plan(plan, plan.spec_file)
    assert from_plan == rules_from_spec(result.spec.security_policy, result.source, "agent.yaml")
    assert [r.spec_line for r in from_plan.rules] == [12, 15]
    assert [(r.host, r.spec_line) for r in from_plan.rate_limits] == [
        ("api.example.com", 7),
        ("*.cdn.example.com", 8),
    ]


async def test_garbage_on_the_decision_channel_is_dropped_cheaply_and_raises_nothing(
    tmp_path: Path,
) -> None:
    """What a sandbox sends on its decision channel is its own to shape: deeply nested JSON
    (which made the parser recurse until RecursionError), a list, a number, bytes that are not
    JSON — each is counted as malformed and dropped, no exception reaches the node agent's
    loop, and the next well-formed decision (brackets in its subject) still arrives."""
    import socket

    from dsec_nodeagent.semantic.channel import DecisionChannel

    got: list[object] = []
    errors: list[dict[str, object]] = []

    async def handler(decision: object) -> None:
        got.append(decision)

    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: errors.append(context))
    channel = await DecisionChannel.open("garbage", tmp_path / "events.sock", os.getuid(), handler)
    try:
        sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        good = {"on": "connect", "action": "log", "subject": "http://[::1]:8080/x", "rule": "r"}
        script = "python -c " + "x = [[1], {2: [3]}]; " * 20  # 140 brackets, all in a string
        busy = {"on": "subprocess", "action": "log", "subject": script, "rule": "r"}
        for data in (
            b"[" * 16000,
            b'{"on": ' + b"[" * 15000,
            b"[1, 2]",
            b"7",
            b"\xff\xfe not json",
            json.dumps(busy).encode(),
            json.dumps(good).encode(),
        ):
            sender.sendto(data, str(tmp_path / "events.sock"))
        deadline = loop.time() + 10
        while len(got) < 2 and loop.time() < deadline:
            await asyncio.sleep(0.01)
        sender.close()
    finally:
        await channel.close()
        loop.set_exception_handler(None)
    assert [(d.on, d.subject) for d in got] == [  # type: ignore[attr-defined]
        ("subprocess", script),
        ("connect", "http://[::1]:8080/x"),
    ]
    assert errors == []
