"""End to end: a sandbox whose spec passed validation still cannot reach the stack's NATS.

The spec allows the node's own (non-loopback) address on the NATS port: the policy service
cannot know that NATS answers there, but the node agent denies the stack's endpoints on every
local address, before any allow rule. The agent sees EPERM; the log gets a policy.violation.
"""

from __future__ import annotations

import ipaddress
import json
import time
from urllib.parse import urlsplit

import pytest
from dsec_nodeagent.stackdeny import local_addresses

pytestmark = [pytest.mark.e2e, pytest.mark.kernel, pytest.mark.slow]

AGENT = """\
import errno, socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
s.settimeout(5)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
except OSError as exc:
    print("connect refused:", errno.errorcode.get(exc.errno, exc.errno))
else:
    print("connected to the bus!")
    sys.exit(3)
"""


def _node_address() -> str:
    own = [a for a in local_addresses() if ipaddress.ip_address(a).version == 4]
    found = [a for a in own if not ipaddress.ip_address(a).is_loopback]
    assert found, f"this test needs a non-loopback IPv4 address on the node, found {own}"
    return sorted(found)[0]


def test_a_sandbox_cannot_reach_nats_even_when_its_rules_allow_the_address(
    services, stack_env, dsec_cli, tmp_path
) -> None:
    services.start("policy", "builder", "nodeagent")
    nats_port = urlsplit(stack_env["DSEC_NATS_URL"]).port
    address = _node_address()
    code = tmp_path / "code"
    code.mkdir()
    (code / "agent.py").write_text(AGENT)
    spec = tmp_path / "dsec.yaml"
    spec.write_text(
        'version: "1.2"\nname: bus-probe\nbase: dsec/python311:latest\n'
        f"entrypoint: [python, agent.py, {address}, '{nats_port}']\n"
        "resources: {cpu: 1, memory: 256MiB, pids: 64}\ntimeout: 2m\n"
        "security_policy:\n  network:\n    egress:\n"
        f"      - {{cidr: {address}/32, ports: [{nats_port}]}}\n"
    )
    result = dsec_cli(
        "submit",
        str(spec),
        "--code",
        str(code),
        "--wait",
        "exited",
        "--stall",
        "120",
        "--json",
        env=stack_env,
    )
    outcome = result.last_json()
    assert result.exit_code == 0, result.output
    sid = outcome["sandbox_id"]
    logs = dsec_cli("sandbox", "logs", sid, env=stack_env).output
    assert "connect refused: EPERM" in logs, logs

    deadline = time.monotonic() + 15
    while True:
        replay = dsec_cli(
            "audit",
            "replay",
            "--sandbox",
            sid,
            "--type",
            "policy.violation",
            "--json",
            env=stack_env,
        ).output
        found = [json.loads(line)["payload"] for line in replay.splitlines() if line.strip()]
        stack = [v for v in found if v["rule_id"] == "system.egress"]
        if stack or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert stack, found
    assert stack[0]["target"].startswith(f"{address}:{nats_port}")
    assert stack[0]["layer"] == "kernel" and stack[0]["action"] == "deny"
    assert "the DSec stack's own servers" in stack[0]["message"]
