"""Snapshots of a running sandbox, end to end through every service as its own process.

A snapshot of a running agent is taken over the bus; its code is changed on the node; a run from
the snapshot with the changed code is refused showing the changed line; a rollback restores the
running sandbox, which prints the restored value; a run from the snapshot starts a new sandbox.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import nats
import pytest
from dsec_core import identity
from dsec_core.bus import replay
from dsec_core.envelope import decode
from dsec_core.events import SpecSubmitted, SpecValidated
from dsec_core.ids import new_sandbox_id
from dsec_core.subjects import aggregate_filter
from dsec_testing import trust
from dsec_testing.plans import minimal_plan

if TYPE_CHECKING:
    from dsec_testing.stack import S3Info, ServiceRunner, StackFixture

pytestmark = [pytest.mark.e2e, pytest.mark.kernel, pytest.mark.slow]

# Prints the threshold it reads from its (read-only) code dir five times a second, so a change
# of the code under it shows in its log. Bounded, in case the test dies before stopping it.
AGENT = """
import pathlib, time
here = pathlib.Path(__file__).resolve().parent
deadline = time.monotonic() + 25
while time.monotonic() < deadline:
    print("threshold", (here / "config.txt").read_text().strip(), flush=True)
    time.sleep(0.2)
"""

SPEC = """\
version: "1.2"
name: snapshot-agent
base: dsec/python311:latest
entrypoint: [python, agent.py]
workdir: /workspace
resources: {cpu: 1, memory: 256MiB, pids: 64}
timeout: 1m
runtime_context:
  env_vars:
    - name: MODE
      value: eval
"""

GOOD, BAD = "0.92", "0.87"


def poll(check: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
    """Call ``check`` until it returns something truthy; fail naming ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.2)


@pytest.fixture
def env(stack_env: dict[str, str]) -> dict[str, str]:
    return dict(stack_env)


def start_agent(dsec_cli: Any, env: dict[str, str], tmp_path: Path) -> tuple[str, Path]:
    code = tmp_path / "code"
    code.mkdir()
    (code / "agent.py").write_text(AGENT)
    (code / "config.txt").write_text(f"{GOOD}\n")
    spec = tmp_path / "dsec.yaml"
    spec.write_text(SPEC)
    result = dsec_cli(
        "submit",
        str(spec),
        "--code",
        str(code),
        "--wait",
        "ready",
        "--stall",
        "120",
        "--json",
        env=env,
    )
    assert result.exit_code == 0, result.output
    outcome = result.last_json()
    ready = next(e["payload"] for e in outcome["events"] if e["type"] == "sandbox.ready")
    assert ready["code_dir"], ready
    return outcome["sandbox_id"], Path(ready["code_dir"])


def thresholds(dsec_cli: Any, env: dict[str, str], sid: str) -> list[str]:
    out = dsec_cli("sandbox", "logs", sid, env=env).output
    return [line.split()[1] for line in out.splitlines() if line.startswith("threshold ")]


def events_of(
    dsec_cli: Any, env: dict[str, str], sid: str, event_type: str
) -> list[dict[str, Any]]:
    out = dsec_cli("audit", "replay", "--sandbox", sid, "--type", event_type, "--json", env=env)
    return [json.loads(line) for line in out.output.splitlines() if line.startswith("{")]


def producers(
    dsec_cli: Any, env: dict[str, str], sid: str, event_type: str, snapshot: str
) -> list[str]:
    """Who published ``event_type`` about ``snapshot`` for the sandbox."""
    return [
        e["producer"]
        for e in events_of(dsec_cli, env, sid, event_type)
        if e["payload"]["snapshot"] == snapshot
    ]


def foreign_snapshot(
    dsec_cli: Any, env: dict[str, str], dsec_stack: StackFixture, tmp_path: Path
) -> str:
    """A snapshot taken by a user of tenant ``acme`` (of a directory of its own)."""
    key, cert = identity.issue_user(trust.stack_root(dsec_stack.home), "eve", "acme")
    cred = tmp_path / "acme.cred.json"
    cred.write_text(identity.credential_json(key, cert))
    cred.chmod(0o600)
    code = tmp_path / "acme-code"
    code.mkdir()
    (code / "agent.py").write_text("print('acme')\n")
    name = f"acme-{uuid.uuid4().hex[:8]}"
    acme = {**env, "DSEC_CREDENTIAL": str(cred)}
    created = dsec_cli("snapshot", "create", "--dir", str(code), "--name", name, env=acme)
    assert created.exit_code == 0, created.output
    return name


def test_snapshot_refused_run_and_rollback_of_a_running_sandbox(
    services: ServiceRunner,
    env: dict[str, str],
    dsec_cli: Any,
    s3: S3Info,
    dsec_stack: StackFixture,
    tmp_path: Path,
) -> None:
    services.start("policy", "builder", "nodeagent")
    services.start("snapshot", env={"DSEC_SNAPSHOT_INTERVAL_S": "2"})
    sid, code_dir = start_agent(dsec_cli, env, tmp_path)
    poll(lambda: GOOD in thresholds(dsec_cli, env, sid), "the agent's first output")

    # `dsec sandbox exec` runs inside the same isolation: the sandbox's uid, its code, no
    # write access to it.
    probe = (
        "import os; print('uid', os.getuid(), 'cwd', os.getcwd(),"
        " open('config.txt').read().strip()); open('config.txt', 'w')"
    )
    inside = subprocess.run(
        [
            str(Path(sys.executable).parent / "dsec"),
            "sandbox",
            "exec",
            sid,
            "--",
            "python",
            "-c",
            probe,
        ],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert inside.returncode != 0, inside.stdout
    assert f"cwd /workspace {GOOD}" in inside.stdout
    assert "uid 0 " not in inside.stdout
    assert "Read-only file system" in inside.stderr or "Permission denied" in inside.stderr

    name = f"good-{uuid.uuid4().hex[:8]}"
    taken = dsec_cli("snapshot", "create", sid, "--name", name, "--json", env=env)
    assert taken.exit_code == 0, taken.output
    assert taken.last_json()["event"] == "snapshot.taken"
    assert taken.last_json()["files"] == 2  # agent.py, config.txt
    # taken by the node agent that runs the sandbox, from its own code copy
    assert producers(dsec_cli, env, sid, "snapshot.taken", name) == ["nodeagent"]

    # A bad change lands in the running sandbox's code on the node.
    (code_dir / "config.txt").write_text(f"{BAD}\n")
    poll(lambda: thresholds(dsec_cli, env, sid)[-1:] == [BAD], "the agent to see the change")

    changed = tmp_path / "changed"
    shutil.copytree(tmp_path / "code", changed)
    (changed / "config.txt").write_text(f"{BAD}\n")
    refused = dsec_cli("sandbox", "run", "--snapshot", name, "--code", str(changed), env=env)
    assert refused.exit_code == 1, refused.output
    assert "changed: config.txt" in refused.output
    assert f"-{GOOD}" in refused.output and f"+{BAD}" in refused.output

    back = dsec_cli("sandbox", "rollback", sid, "--to", name, "--json", env=env)
    assert back.exit_code == 0, back.output
    restored = back.last_json()
    assert restored["event"] == "snapshot.restored" and restored["files_written"] == 1
    assert (code_dir / "config.txt").read_text() == f"{GOOD}\n"
    assert producers(dsec_cli, env, sid, "snapshot.restored", name) == ["nodeagent"]
    poll(lambda: thresholds(dsec_cli, env, sid)[-1:] == [GOOD], "the restored value in the log")

    verified = dsec_cli("snapshot", "verify", name, env=env)
    assert verified.exit_code == 0, verified.output

    # Another tenant's snapshot: the node agent neither rolls back to it nor starts from it.
    foreign = foreign_snapshot(dsec_cli, env, dsec_stack, tmp_path)
    crossed = dsec_cli("sandbox", "rollback", sid, "--to", foreign, "--json", env=env)
    assert crossed.exit_code == 1, crossed.output
    assert "belongs to another tenant" in crossed.last_json()["reason"]
    assert (code_dir / "config.txt").read_text() == f"{GOOD}\n"
    spec = tmp_path / "dsec.yaml"
    started = dsec_cli(
        "sandbox", "run", "--snapshot", foreign, "--spec", str(spec), "--json", env=env
    )
    assert started.exit_code != 0, started.output
    failed = [e for e in started.last_json()["events"] if e["type"] == "sandbox.failed"]
    assert failed and "belongs to another tenant" in failed[0]["payload"]["reason"]

    # A new sandbox from the snapshot: the spec from the log, the code from the snapshot.
    rerun = dsec_cli("sandbox", "run", "--snapshot", name, "--json", env=env)
    assert rerun.exit_code == 0, rerun.output
    new_sid = rerun.last_json()["sandbox_id"]
    started_from = next(
        e["payload"] for e in rerun.last_json()["events"] if e["type"] == "snapshot.restored"
    )
    assert started_from["snapshot"] == name and started_from["files_written"] == 2
    # restored into the new sandbox's code dir by the node agent that starts it
    assert producers(dsec_cli, env, new_sid, "snapshot.restored", name) == ["nodeagent"]
    submitted = events_of(dsec_cli, env, new_sid, "spec.submitted")
    assert submitted[0]["payload"]["start_from_snapshot"] == name
    assert submitted[0]["payload"]["code"] is None  # no code left the user's machine
    poll(lambda: GOOD in thresholds(dsec_cli, env, new_sid), "the new sandbox's output")

    periodic = poll(
        lambda: [
            e
            for e in events_of(dsec_cli, env, sid, "snapshot.taken")
            if e["payload"]["snapshot"].startswith(f"auto-{sid}-")
        ],
        "a periodic snapshot",
    )
    assert periodic[0]["producer"] == "nodeagent"  # asked by the snapshot service
    asked = [
        e
        for e in events_of(dsec_cli, env, sid, "snapshot.requested")
        if e["payload"]["name"] == periodic[0]["payload"]["snapshot"]
    ]
    assert asked and asked[0]["producer"] == "snapshot"

    for running in (sid, new_sid):
        stopped = dsec_cli("sandbox", "stop", running, "--grace", "1", env=env)
        assert stopped.exit_code == 0, stopped.output
    late = dsec_cli("sandbox", "rollback", sid, "--to", name, env=env)
    assert late.exit_code == 1
    assert "has exited" in late.output

    # An altered manifest: no run starts from it.
    key = f"snapshots/{name}.json"
    doc = json.loads(s3.client().get_object(s3.bucket, key).read())
    doc["manifest"]["labels"]["code"] = "bundle"
    altered = json.dumps(doc).encode()
    s3.client().put_object(s3.bucket, key, io.BytesIO(altered), len(altered))
    tampered = dsec_cli("sandbox", "run", "--snapshot", name, env=env)
    assert tampered.exit_code == 1
    assert "signature does not match its content (altered)" in " ".join(tampered.output.split())


def test_snapshot_of_unknown_sandbox_fails_with_the_reason(
    services: ServiceRunner, env: dict[str, str], dsec_cli: Any
) -> None:
    services.start("snapshot")
    result = dsec_cli(
        "snapshot", "create", "sbx_nosuchsandbox", "--name", "x-unknown", "--json", env=env
    )
    assert result.exit_code == 1, result.output
    answer = result.last_json()
    assert answer["event"] == "snapshot.failed" and answer["operation"] == "create"
    assert "no sandbox 'sbx_nosuchsandbox' in the event log" in answer["reason"]

    refused = dsec_cli("sandbox", "rollback", "sbx_nosuchsandbox", "--to", "x-unknown", env=env)
    assert refused.exit_code == 1
    assert "is not running" in " ".join(refused.output.split())


async def test_a_snapshot_that_keeps_failing_ends_in_snapshot_failed_not_sandbox_failed(
    services: ServiceRunner, env: dict[str, str], dsec_cli: Any, nats_url: str, make_publisher: Any
) -> None:
    # Vault unreachable: the audit segment's key cannot be stored, every attempt fails.
    services.start("snapshot", env={"DSEC_VAULT_ADDR": "http://127.0.0.1:9"})
    nc = await nats.connect(nats_url)
    try:
        publisher = await make_publisher(nc.jetstream())
        policy = await make_publisher(nc.jetstream(), role="policy")
        sid = new_sandbox_id()
        submitted = await publisher.publish(SpecSubmitted(spec_yaml="name: x"), aggregate_id=sid)
        validated = SpecValidated(name="x", spec_digest="d", plan=minimal_plan())
        await policy.publish(validated, aggregate_id=sid, causation=submitted.envelope)
        result = await asyncio.to_thread(
            dsec_cli, "snapshot", "create", sid, "--name", f"v-{sid}", "--json", env=env
        )
        assert result.exit_code == 1, result.output
        answer = result.last_json()
        assert answer["event"] == "snapshot.failed"
        assert "gave up after 4 attempts" in answer["reason"] and "Vault" in answer["reason"]
        types = [
            decode(data).type
            async for _, data in replay(
                nc.jetstream(), filter_subject=aggregate_filter("sandbox", sid)
            )
        ]
        assert "snapshot.failed" in types and "sandbox.failed" not in types
    finally:
        await nc.close()


def test_a_request_nobody_answers_times_out_naming_the_service(
    env: dict[str, str], dsec_cli: Any
) -> None:
    result = dsec_cli(
        "snapshot", "create", new_sandbox_id(), "--name", "t", "--timeout", "1", env=env
    )
    assert result.exit_code == 4, result.output
    assert "is the snapshot service running?" in " ".join(result.output.split())
