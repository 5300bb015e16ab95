"""The demo, as a user runs it: the websearch example against the loopback demo world.

The world (DNS for ``websearch.test``, the search API on 127.0.0.53:443, a tracker on
127.0.0.54:443) runs as its own process; the key goes into OpenBao and the queries and CA into S3
through the world's ``seed`` command; policy, builder and node agent run as processes with the
node's DNS proxy pointed at the world. The agent searches by name, writes its output, and is
refused a write by a semantic rule, a name by the DNS proxy and an address by the kernel.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from dsec_testing import ServiceRunner
from dsec_testing.demo_world import API_ADDRESS, DEFAULT_QUERIES, WORLD_FILE, WorldInfo

pytestmark = [pytest.mark.e2e, pytest.mark.kernel, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "websearch-agent"
WORLD_START_S = 30.0
EVENTS_S = 15.0


@dataclass
class World:
    """The running demo world: what ``world.json`` says, and its stdout."""

    info: WorldInfo
    directory: Path
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _demo_world(*args: str) -> list[str]:
    return [sys.executable, "-m", "dsec_testing.demo_world", *args]


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    """Start the world as the demo does (a background process) and stop it with SIGTERM."""
    directory = tmp_path / "world"
    log = tmp_path / "world.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            _demo_world("--dir", str(directory), "--max-seconds", "300"),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + WORLD_START_S
        while not (directory / WORLD_FILE).exists():
            if proc.poll() is not None:
                pytest.fail(f"the demo world exited: {log.read_text()}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {WORLD_FILE} after {WORLD_START_S}s: {log.read_text()}")
            time.sleep(0.05)
        yield World(WorldInfo.load(directory / WORLD_FILE), directory, log)
    finally:
        proc.terminate()
        proc.wait(timeout=15)
    assert proc.returncode == 0, log.read_text()
    assert not directory.exists(), "the demo world left files behind"


def _violations(
    dsec_cli: Callable[..., Any], env: dict[str, str], sid: str, kind: str = "policy.violation"
) -> list[Any]:
    replay = dsec_cli("audit", "replay", "--sandbox", sid, "--type", kind, "--json", env=env)
    assert replay.exit_code == 0, replay.output
    return [json.loads(line)["payload"] for line in replay.output.splitlines() if line.strip()]


def _spec_line(text: str) -> int:
    lines = (EXAMPLE / "dsec.yaml").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_demo_agent_searches_by_name_and_is_refused_everything_else(
    services: ServiceRunner,
    stack_env: dict[str, str],
    dsec_cli: Callable[..., Any],
    world: World,
) -> None:
    env = dict(stack_env)
    key = world.info.api_key
    seeded = subprocess.run(
        _demo_world("seed", "--dir", str(world.directory)),
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert seeded.returncode == 0, seeded.stderr
    assert "vault://secret/default/agent-tools/websearch#key" in seeded.stdout
    # The world's API answers from loopback, which DNS answers may only open when trusted.
    agent_env = {"DSEC_DNS_UPSTREAM": world.info.dns, "DSEC_DNS_TRUSTED_TARGETS": API_ADDRESS}
    services.start("policy", "builder", "nodeagent", env=agent_env)

    result = dsec_cli(
        "submit",
        str(EXAMPLE / "dsec.yaml"),
        "--code",
        str(EXAMPLE),
        "--wait",
        "exited",
        "--stall",
        "120",
        "--json",
        env=env,
    )
    outcome = result.last_json()
    sid = outcome["sandbox_id"]
    logs = dsec_cli("sandbox", "logs", sid, env=env).output
    assert result.exit_code == 0, f"{result.output}\n{logs}\n{world.output()}"
    assert outcome["state"] == "exited" and outcome["exit_code"] == 0, logs

    # Runtime context: the secret from OpenBao and both S3 mounts, by name and hash only.
    injected = [e["payload"] for e in outcome["events"] if e["type"] == "context.injected"]
    assert {(i["kind"], i["name"]) for i in injected} == {
        ("secret", "WEB_SEARCH_KEY"),
        ("s3", "/workspace/data"),
        ("s3", "/workspace/trust"),
    }
    assert all(i["digest"] for i in injected)

    # The allowed calls, by name, through TLS with the demo CA: the API answered each query.
    queries = len(DEFAULT_QUERIES.splitlines())
    assert logs.count("allowed      GET https://api.websearch.test/v1/search") == queries, logs
    assert world.output().count("api: GET /v1/search 200") == queries, world.output()
    home = Path(env["DSEC_HOME"])
    output = home / "sandboxes" / sid / "fs" / "workspace__output"
    answers = json.loads((output / "result.json").read_text())["answers"]
    assert [len(a["results"]) for a in answers] == [3] * queries  # the agent's limit
    assert (output / "result.msgpack").stat().st_size > 0
    assert not (output / "secrets-dump.txt").exists()
    # Exited means cleaned up: the materialized S3 data and the sandbox's run state are gone.
    assert not (home / "sandboxes" / sid / "context").exists()
    assert not (home / "run" / "sandboxes" / sid).exists()

    # What the user sees in the sandbox's log: each refusal, explained.
    rule = "semantic[1] deny open /workspace/output/secrets*"
    spec_line = _spec_line("- on: open")
    denied = "refused      write /workspace/output/secrets-dump.txt: [dsec] open "
    assert denied in logs and f"denied by rule '{rule}'" in logs, logs
    assert f"dsec.yaml line {spec_line}" in logs
    assert "refused      connect tracker.websearch.test:443: the name does not resolve" in logs
    assert "refused      connect 127.0.0.54:443: [Errno 1] Operation not permitted" in logs
    assert "every forbidden one was refused" in logs

    # The denied name never left the node; nothing reached the tracker.
    questions = [line for line in world.output().splitlines() if line.startswith("dns: ")]
    assert any("api.websearch.test." in q for q in questions), questions
    assert not any("tracker" in q for q in questions), questions
    assert "tracker: connection" not in world.output()

    # policy.violation events (the node agent's verdicts): the refused name and the kernel's
    # EPERM. policy.reported events (what the sandbox's semantic layer says, checked against
    # the plan): the deny with its rule and line, and the logged requests.
    deadline = time.monotonic() + EVENTS_S
    while True:
        violations = _violations(dsec_cli, env, sid)
        reports = _violations(dsec_cli, env, sid, "policy.reported")
        semantic = [r for r in reports if r["action"] == "deny"]
        kernel = [v for v in violations if v["layer"] == "kernel" and v["action"] == "deny"]
        dns = [v for v in kernel if v["operation"] == "dns"]
        if (semantic and len(kernel) > len(dns) and dns) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(v["rule_id"], v["target"], v["spec_line"]) for v in semantic] == [
        (rule, "/workspace/output/secrets-dump.txt", spec_line)
    ]
    assert not [v for v in violations if v["layer"] == "semantic"]  # never a verdict
    assert any(v["target"].startswith("127.0.0.54:443") for v in kernel), kernel
    assert any(v["target"].startswith("tracker.websearch.test/") for v in dns), kernel
    assert any(r["action"] == "log" for r in reports)

    # The key is in no event, no service log, no sandbox log, nor the world's output.
    everything = dsec_cli("audit", "replay", "--sandbox", sid, "--json", env=env).output
    assert sid in everything
    for name, text in [
        ("events", everything + json.dumps(outcome)),
        ("sandbox log", logs),
        ("world", world.output()),
        *((f"{svc} log", services.log(svc)) for svc in ("policy", "builder", "nodeagent")),
    ]:
        assert key not in text, f"the API key appears in the {name}"
