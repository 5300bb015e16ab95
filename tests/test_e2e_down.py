"""``dsec down`` leaves nothing of a sandbox in the kernel: the node agent stops it (its exit is
recorded), removes its cgroup and egress programs, and the pinned maps once nothing uses them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from dsec_core.retention import down_marker
from dsec_core.settings import Settings

pytestmark = [pytest.mark.e2e, pytest.mark.kernel, pytest.mark.slow]


SPEC = """\
version: "1.2"
name: long-runner
base: dsec/python311:latest
entrypoint: [python, agent.py]
workdir: /workspace
resources: {cpu: 1, memory: 256MiB, pids: 64}
timeout: 5m
security_policy:
  network:
    egress:
      - {domain: api.example.test, ports: [443]}
  filesystem:
    write_allowed: [/workspace/output]
"""


def _events(dsec_cli: Any, env: dict[str, str], sid: str, kind: str) -> list[dict[str, Any]]:
    out = dsec_cli("audit", "replay", "--sandbox", sid, "--type", kind, "--json", env=env)
    return [json.loads(line) for line in out.output.splitlines() if line.startswith("{")]


def test_down_stops_sandboxes_and_leaves_no_cgroup_program_or_pinned_map(
    services: Any, stack_env: dict[str, str], dsec_cli: Any, tmp_path: Path
) -> None:
    env = dict(stack_env)
    # the test node agent's pins and egress state (per node and home)
    pin_dir, egress_state = Settings(node_id="node-1", home=Path(env["DSEC_HOME"])).egress_dirs()
    services.start("policy", "builder", "nodeagent")
    code = tmp_path / "code"
    code.mkdir()
    (code / "agent.py").write_text("import time\nprint('up', flush=True)\ntime.sleep(300)\n")
    spec = tmp_path / "dsec.yaml"
    spec.write_text(SPEC)
    result = dsec_cli(
        "submit", str(spec), "--code", str(code), "--wait", "ready", "--json", env=env
    )
    assert result.exit_code == 0, result.output
    outcome = result.last_json()
    sid = outcome["sandbox_id"]
    ready = next(e["payload"] for e in outcome["events"] if e["type"] == "sandbox.ready")
    cgroup = Path(ready["cgroup"])
    assert cgroup.is_dir()
    cgroup_id = cgroup.stat().st_ino
    assert (egress_state / f"{cgroup_id}.json").exists()

    # What `dsec down` does to the node agent (the stack fixture's servers stay up for the
    # other tests): the marker, then SIGTERM.
    home = Path(env["DSEC_HOME"])
    marker = down_marker(home)
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text("stop sandboxes\n")
    try:
        services.stop("nodeagent")
    finally:
        marker.unlink(missing_ok=True)

    exited = _events(dsec_cli, env, sid, "sandbox.exited")
    assert [e["payload"]["reason"] for e in exited] == ["stopped"]
    assert not cgroup.exists()
    assert not (egress_state / f"{cgroup_id}.json").exists()
    # the pins and egress state are this stack's own (per node and home): nothing else is
    # attached there, so the node agent removed them
    assert "removing the pinned maps" in services.log("nodeagent")
    assert not pin_dir.exists() and not pin_dir.parent.exists()
    assert not egress_state.parent.exists()  # /run/dsec-<node>-<hash>
    journals = Settings(node_id="node-1", home=home).state_journal_dir()
    assert not journals.exists() and not journals.parent.exists()  # /dev/shm/dsec-<node>-<hash>
    assert not (home / "run" / "sandboxes" / f"{sid}.json").exists()
    assert "stopping" in services.log("nodeagent")
