"""`dsec sandbox upgrade` against a real event log (only the policy service running, which
grants code uploads): what it submits for
the new version — the old one's authentic spec (or --spec), the new code, ``handover_from`` —
and how it ends when there is nothing to hand over from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import nats
import pytest
from dsec_core.envelope import decode
from dsec_core.events import SandboxExited, SpecSubmitted
from dsec_core.subjects import STREAM, subject_for
from dsec_testing import trust

pytestmark = pytest.mark.integration

SPEC = 'version: "1.2"\nname: agent-b\nbase: python:3.11\nentrypoint: [python, agent.py]\n'


def _last_json(output: str) -> dict[str, Any]:
    line = [x for x in output.splitlines() if x.startswith("{")][-1]
    result: dict[str, Any] = json.loads(line)
    return result


async def _submitted(nats_url: str, sandbox_id: str) -> SpecSubmitted:
    nc = await nats.connect(nats_url)
    try:
        raw = await nc.jetstream().get_last_msg(STREAM, subject_for("spec.submitted", sandbox_id))
    finally:
        await nc.close()
    payload = decode(raw.data or b"").decoded()
    assert isinstance(payload, SpecSubmitted)
    return payload


async def test_upgrade_submits_the_old_spec_with_new_code_and_handover_from(
    dsec_cli: Any, stack_env: dict[str, str], nats_url: str, tmp_path: Path, services: Any
) -> None:
    services.start("policy")  # it grants the new code's upload
    spec = tmp_path / "agent.yaml"
    spec.write_text(SPEC)
    code = tmp_path / "v2"
    code.mkdir()
    (code / "agent.py").write_text("print('v2')\n")
    # The old version (no builder runs here: it stays validated)
    old = dsec_cli("submit", str(spec), "--stall", "1", "--json", env=stack_env)
    old_id = _last_json(old.output)["sandbox_id"]

    up = dsec_cli(
        "sandbox",
        "upgrade",
        old_id,
        "--code",
        str(code),
        "--stall",
        "1",
        "--json",
        env=stack_env,
    )

    assert up.exit_code == 4, up.output  # stalled: no scheduler, no node agent here
    result = _last_json(up.output)
    assert result["handover_from"] == old_id and result["state"] == "stalled"
    new = await _submitted(nats_url, result["sandbox_id"])
    assert new.handover_from == old_id
    first = await _submitted(nats_url, old_id)
    assert (new.spec_yaml, new.filename) == (SPEC, first.filename)  # the old one's, from the log
    assert new.code is not None  # the new code, uploaded

    # --spec: that spec instead (the old code bundle is kept when no --code is given)
    other = tmp_path / "v3.yaml"
    other.write_text(SPEC.replace("agent.py", "main.py"))
    up = dsec_cli(
        "sandbox", "upgrade", old_id, "--spec", str(other), "--stall", "1", "--json", env=stack_env
    )
    newer = await _submitted(nats_url, _last_json(up.output)["sandbox_id"])
    assert (newer.handover_from, newer.filename) == (old_id, "v3.yaml")
    assert "main.py" in newer.spec_yaml


async def test_upgrade_of_a_sandbox_not_running_says_so(
    dsec_cli: Any, stack_env: dict[str, str], nats_url: str, dsec_stack: Any, tmp_path: Path
) -> None:
    code = tmp_path / "v2"
    code.mkdir()
    missing = dsec_cli("sandbox", "upgrade", "sbx_nothere", "--code", str(code), env=stack_env)
    assert missing.exit_code == 1
    assert "no sandbox sbx_nothere in the event log" in " ".join(missing.output.split())

    spec = tmp_path / "agent.yaml"
    spec.write_text(SPEC)
    old_id = _last_json(
        dsec_cli("submit", str(spec), "--stall", "1", "--json", env=stack_env).output
    )["sandbox_id"]
    nc = await nats.connect(nats_url)
    try:
        node = await trust.publisher(
            nc.jetstream(), dsec_stack.home, "scheduler", acts_for="default"
        )
        await node.publish(
            SandboxExited(exit_code=0, reason="ok", duration_s=1.0), aggregate_id=old_id
        )
    finally:
        await nc.close()
    ended = dsec_cli("sandbox", "upgrade", old_id, "--code", str(code), env=stack_env)
    assert ended.exit_code == 1
    assert f"sandbox {old_id} has ended (sandbox.exited): nothing to hand over from" in " ".join(
        ended.output.split()
    )
