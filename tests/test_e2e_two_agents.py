"""Two sandboxed agents call each other's tools through the SDK (examples/two-agents).

Policy, builder and node agent run as processes. The researcher serves ``lookup``; the planner,
in another sandbox of the same task group, calls it a few hundred times over the shared-memory
channel the node agent's broker handed out, reports the latency and shuts the researcher down.
A third sandbox tries to act as the researcher and is refused by the broker.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import pytest
from dsec_core.envelope import decode
from dsec_core.subjects import STREAM, subject_for
from nats.js.errors import NotFoundError

pytestmark = [pytest.mark.e2e, pytest.mark.kernel, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "two-agents"
EXIT_WAIT_S = 20.0

IMPOSTOR = """
from dsec_sdk import AgentNotFound, BrokerUnavailable, DSecClient

def lookup(query):
    return {"summary": "forged"}

refused = 0
# as a caller, and as a server, under the researcher's name; then its own name in another group
for agent, group, serve in (
    ("researcher", "research-team", False),
    ("researcher", "research-team", True),
    ("impostor", "other-team", False),
):
    client = DSecClient(agent, group)
    try:
        if serve:
            client.serve({"lookup": lookup})
        else:
            client.call_tool("researcher", "lookup", query="memfd")
    except BrokerUnavailable as exc:
        refused += 1
        print(f"refused {group}/{agent} (serve={serve}): {exc}", flush=True)
    else:
        print(f"ACCEPTED {group}/{agent} (serve={serve})", flush=True)
    client.close()

# its own identity is accepted: the broker answers that nobody serves "nobody-here"
try:
    DSecClient().call_tool("nobody-here", "lookup", query="memfd")
except AgentNotFound as exc:
    print(f"own identity accepted: {exc}", flush=True)
raise SystemExit(0 if refused == 3 else 1)
"""

IMPOSTOR_SPEC = """\
version: "1.2"
name: impostor
task_group: research-team
base: dsec/python311:latest
entrypoint: [python, agent.py]
workdir: /workspace
resources: {cpu: 1, memory: 256MiB, pids: 32}
timeout: 1m
"""


def _submit(
    dsec_cli: Callable[..., Any], env: dict[str, str], spec: Path, code: Path, wait: str
) -> dict[str, Any]:
    """Submit and follow until ``wait``; the outcome (its ``exit_code`` is checked by callers,
    with the sandbox's logs in the message)."""
    result = dsec_cli(
        "submit",
        str(spec),
        "--code",
        str(code),
        "--wait",
        wait,
        "--stall",
        "60",
        "--json",
        env=env,
    )
    outcome: dict[str, Any] = result.last_json()
    assert outcome["state"] in ("running", "exited"), result.output
    return outcome


def _logs(dsec_cli: Callable[..., Any], env: dict[str, str], sandbox_id: str) -> str:
    """What the sandbox printed: stdout, then stderr."""
    out: str = dsec_cli("sandbox", "logs", sandbox_id, env=env).output
    err: str = dsec_cli("sandbox", "logs", "--stderr", sandbox_id, env=env).output
    return out + err


async def _exited(nats_url: str, sandbox_id: str, timeout_s: float) -> dict[str, Any] | None:
    """The ``sandbox.exited`` payload of a sandbox, polled from the log until a deadline."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                raw = await js.get_last_msg(STREAM, subject_for("sandbox.exited", sandbox_id))
            except NotFoundError:
                await asyncio.sleep(0.1)
                continue
            assert raw.data is not None
            payload: dict[str, Any] = decode(raw.data).payload
            return payload
        return None
    finally:
        await nc.close()


def test_planner_calls_the_researchers_tool_and_both_end(
    services: Any, stack_env: dict[str, str], dsec_cli: Callable[..., Any], nats_url: str
) -> None:
    env = dict(stack_env)
    services.start("policy", "builder", "nodeagent")
    researcher = _submit(
        dsec_cli, env, EXAMPLE / "researcher" / "dsec.yaml", EXAMPLE / "researcher", "ready"
    )
    assert researcher["state"] == "running", researcher
    planner = _submit(
        dsec_cli, env, EXAMPLE / "planner" / "dsec.yaml", EXAMPLE / "planner", "exited"
    )
    logs = _logs(dsec_cli, env, planner["sandbox_id"])
    assert planner["state"] == "exited" and planner["exit_code"] == 0, logs

    assert "lookup('memfd') -> memfd_create gives an anonymous file" in logs, logs
    assert "lookup('io_uring') -> no notes on 'io_uring' yet" in logs, logs
    # "C ring hot path": the SDK's extension loaded inside the sandbox, not only on the host.
    assert re.search(
        r"500 calls to researcher\.lookup: p50 \d+\.\d µs, p99 \d+\.\d µs \(C ring hot path\)",
        logs,
    ), logs
    assert "researcher shut down after serving 556 lookups" in logs, logs

    exited = asyncio.run(_exited(nats_url, researcher["sandbox_id"], EXIT_WAIT_S))
    assert exited is not None, f"the researcher did not exit within {EXIT_WAIT_S}s"
    assert exited["exit_code"] == 0, exited
    researcher_logs = _logs(dsec_cli, env, researcher["sandbox_id"])
    assert "serving lookup and shutdown as 'researcher' in task group 'research-team'" in (
        researcher_logs
    )
    assert "stopped after serving 556 lookups" in researcher_logs, researcher_logs


def test_an_agent_cannot_claim_another_agents_name(
    services: Any, stack_env: dict[str, str], dsec_cli: Callable[..., Any], tmp_path: Path
) -> None:
    env = dict(stack_env)
    services.start("policy", "builder", "nodeagent")
    code = tmp_path / "impostor"
    code.mkdir()
    (code / "agent.py").write_text(IMPOSTOR)
    spec = tmp_path / "dsec.yaml"
    spec.write_text(IMPOSTOR_SPEC)
    outcome = _submit(dsec_cli, env, spec, code, "exited")
    logs = _logs(dsec_cli, env, outcome["sandbox_id"])
    assert outcome["state"] == "exited" and outcome["exit_code"] == 0, logs

    for claim in (
        "research-team/researcher (serve=False)",
        "research-team/researcher (serve=True)",
        "other-team/impostor (serve=False)",
    ):
        line = next((li for li in logs.splitlines() if li.startswith(f"refused {claim}")), None)
        assert line is not None, logs
        assert "may not act as" in line, line
    assert "ACCEPTED" not in logs
    assert "own identity accepted" in logs and "nobody-here" in logs, logs
