"""End to end through every service as its own process: a spec with a Vault secret runs in a
sandbox, writes its output, is refused a forbidden write, and exits; everything is released."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
from dsec_cli.commands.submit import Outcome

pytestmark = [pytest.mark.e2e, pytest.mark.kernel, pytest.mark.slow]

AGENT = """
import os, sys
key = os.environ.get("API_KEY", "")
print("secret present:", bool(key), "length", len(key))
os.makedirs("/workspace/output", exist_ok=True)
with open("/workspace/output/result.txt", "w") as fh:
    fh.write("done\\n")
try:
    # built at run time, so the policy service's static analysis cannot see (and reject) it
    open("/".join(["", "workspace", "forbidden.txt"]), "w")
except OSError as exc:
    print("forbidden write refused:", type(exc).__name__, exc.errno)
else:
    sys.exit(3)
"""

SPEC = """\
version: "1.2"
name: e2e-agent
base: dsec/python311:latest
entrypoint: [python, agent.py]
workdir: /workspace
dependencies:
  - package: msgpack
    version: ">=1.0,<2"
resources: {cpu: 1, memory: 256MiB, pids: 64}
timeout: 2m
runtime_context:
  env_vars:
    - name: API_KEY
      source: vault://secret/default/e2e/api#token
      ttl: 10m
security_policy:
  filesystem:
    write_allowed: [/workspace/output]
"""


@pytest.fixture
def env(stack_env: dict[str, str]) -> dict[str, str]:
    return dict(stack_env)


def test_agent_runs_with_its_secret_and_is_refused_a_forbidden_write(
    services, env, vault, dsec_cli, tmp_path
) -> None:
    vault.client().secrets.kv.v2.create_or_update_secret(
        path="default/e2e/api", secret={"token": "s3cr3t-value-never-logged"}
    )
    services.start("policy", "builder", "nodeagent")
    code = tmp_path / "code"
    code.mkdir()
    (code / "agent.py").write_text(AGENT)
    spec = tmp_path / "dsec.yaml"
    spec.write_text(SPEC)
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
        env=env,
    )
    outcome = result.last_json()
    types = [e["type"] for e in outcome["events"]]
    assert result.exit_code == 0, result.output
    assert outcome["state"] == "exited" and outcome["exit_code"] == 0
    assert types.index("context.injected") < types.index("sandbox.ready")
    injected = next(e["payload"] for e in outcome["events"] if e["type"] == "context.injected")
    assert injected["kind"] == "secret" and injected["name"] == "API_KEY"
    assert injected["lease_id"]
    ready = next(e["payload"] for e in outcome["events"] if e["type"] == "sandbox.ready")
    assert {"landlock", "seccomp", "cgroup"} <= set(ready["start_latency_ms"])

    sid = outcome["sandbox_id"]
    logs = dsec_cli("sandbox", "logs", sid, env=env)
    assert "secret present: True length 25" in logs.output, logs.output
    assert (
        "forbidden write refused: PermissionError 13" in logs.output
        or "forbidden write refused: OSError 30" in logs.output
    )

    everything = json.dumps(outcome)
    assert "s3cr3t-value-never-logged" not in everything
    assert "s3cr3t-value-never-logged" not in services.log("nodeagent")


LINK_SPEC = """\
version: "1.2"
name: e2e-link
base: dsec/python311:latest
entrypoint: [python, agent.py]
workdir: /workspace
resources: {cpu: 1, memory: 128MiB, pids: 32}
timeout: 1m
security_policy:
  filesystem:
    write_allowed: [/workspace/out/x]
"""


def test_bundle_symlink_out_of_the_tree_is_refused_and_nothing_is_created_on_the_host(
    services, env, dsec_cli, tmp_path
) -> None:
    """The attack of the issue: `out -> /host/dir` in the bundle plus a write grant below it
    made the root node agent create `/host/dir/x`. Now the start is refused, naming the path."""
    services.start("policy", "builder", "nodeagent")
    host_dir = tmp_path / "host-dir"
    host_dir.mkdir()
    code = tmp_path / "code"
    code.mkdir()
    (code / "agent.py").write_text("print('never runs')\n")
    (code / "out").symlink_to(host_dir)
    spec = tmp_path / "dsec.yaml"
    spec.write_text(LINK_SPEC)
    result = dsec_cli("submit", str(spec), "--code", str(code), "--stall", "120", "--json", env=env)
    outcome = result.last_json()
    assert result.exit_code == 1, result.output
    assert outcome["state"] == "failed"
    failed = next(e["payload"] for e in outcome["events"] if e["type"] == "sandbox.failed")
    assert failed["reason"].startswith("/workspace/out/x: in the code bundle, out is a symlink")
    assert list(host_dir.iterdir()) == []


VSOCK_AGENT = """
import socket
try:
    socket.socket(40, socket.SOCK_STREAM)  # AF_VSOCK: a channel to the hypervisor
except OSError as exc:
    print("vsock refused:", exc.errno)
with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM):
    print("unix ok")
"""


def test_vsock_socket_is_refused_and_reported_as_a_policy_violation(
    services, env, dsec_cli, tmp_path
) -> None:
    services.start("policy", "builder", "nodeagent")
    code = tmp_path / "code"
    code.mkdir()
    (code / "agent.py").write_text(VSOCK_AGENT)
    spec = tmp_path / "dsec.yaml"
    spec.write_text(LINK_SPEC.replace("e2e-link", "e2e-vsock").replace("/workspace/out/x", "/tmp"))
    result = dsec_cli("submit", str(spec), "--code", str(code), "--stall", "120", "--json", env=env)
    outcome = result.last_json()
    assert result.exit_code == 0, result.output
    violations = [e["payload"] for e in outcome["events"] if e["type"] == "policy.violation"]
    assert [(v["layer"], v["rule_id"], v["target"]) for v in violations] == [
        ("kernel", "seccomp.socket-family", "socket(AF_VSOCK)")
    ]
    assert "EAFNOSUPPORT" in violations[0]["message"]
    logs = dsec_cli("sandbox", "logs", outcome["sandbox_id"], env=env)
    assert "vsock refused: 97" in logs.output and "unix ok" in logs.output  # 97: EAFNOSUPPORT


BOMB_SPEC = (
    LINK_SPEC.replace("e2e-link", "e2e-bomb").replace("/workspace/out/x", "/tmp")
    + "include_code: {max_size: 1MiB}\n"
)


def _submit_raw_bundle(
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    zeros: int,
    declared: int,
    *,
    noise: int = 0,
) -> Outcome:
    """Store a hand-made bundle (agent.py + ``zeros`` bytes of zeros + ``noise`` random bytes)
    declaring ``declared`` bytes, submit BOMB_SPEC with it as a client other than `dsec submit`
    could (the stack's own object-store keys), follow it."""
    import io
    import tarfile

    import blake3
    import zstandard
    from dsec_cli.commands.submit import submit_and_follow
    from dsec_core.events import BundleRef
    from dsec_core.objectstore import client as s3_client
    from dsec_core.objectstore import ensure_bucket
    from dsec_core.settings import Settings

    for name, value in env.items():
        monkeypatch.setenv(name, value)
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        members = [("agent.py", b"print('never runs')\n"), ("zeros.bin", bytes(zeros))]
        for name, data in members + [("noise.bin", os.urandom(noise))] * bool(noise):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    archive = zstandard.ZstdCompressor().compress(raw.getvalue())
    digest = blake3.blake3(archive).hexdigest()
    settings = Settings()
    client = s3_client(settings)
    ensure_bucket(client, settings.s3_bucket)
    key = f"bundles/default/{digest}.tar.zst"  # (the test user's tenant)
    client.put_object(settings.s3_bucket, key, io.BytesIO(archive), len(archive))
    ref = BundleRef(
        digest=digest, object_key=key, size=len(archive), files=2, expanded_size=declared
    )
    return asyncio.run(
        submit_and_follow(BOMB_SPEC, "dsec.yaml", ref, "exited", 120.0, 120.0, as_json=True)
    )


def test_a_bundle_is_bounded_by_what_it_expands_to_not_by_what_it_declares(
    services, env, monkeypatch
) -> None:
    """A bundle that declares 100 bytes but expands to 8 MiB (a client that lies, a zip bomb):
    the first service to unpack it (policy, reading the agent's code) stops at the spec's bound;
    the node agent counts the same way (test_codebundle), and never gets to unpack it here."""
    services.start("policy", "builder", "nodeagent")
    outcome = _submit_raw_bundle(env, monkeypatch, zeros=8 << 20, declared=100)
    assert outcome.state == "rejected", outcome.events
    rejected = next(e["payload"] for e in outcome.events if e["type"] == "spec.rejected")
    [error] = rejected["errors"]
    assert error["rule_id"] == "code-bundle"
    assert error["message"] == (
        "invalid code bundle: archive member 'zeros.bin': the bundle expands past "
        "include_code.max_size 1.0 MiB; extraction stopped"
    )
    sandbox_dir = Path(env["DSEC_HOME"]) / "sandboxes" / outcome.sandbox_id
    assert not sandbox_dir.exists()


def test_a_stored_bundle_larger_than_its_spec_allows_is_never_read(
    services, env, monkeypatch
) -> None:
    """A tenant stores 24 MiB that no build of a 1 MiB tree makes (its own prefix, its real
    digest) and submits it: the shared policy service reads the object's size and refuses it,
    instead of loading it whole into memory (any size a tenant stores, at 8 validations at
    once)."""
    services.start("policy")
    outcome = _submit_raw_bundle(env, monkeypatch, zeros=0, declared=100, noise=24 << 20)
    assert outcome.state == "rejected", outcome.events
    rejected = next(e["payload"] for e in outcome.events if e["type"] == "spec.rejected")
    [error] = rejected["errors"]
    assert error["rule_id"] == "code-bundle"
    assert "is larger than 17842176 bytes, the most a bundle of its spec's" in error["message"]


def test_node_agent_refuses_a_bundle_declared_over_the_bound_before_fetching_it(
    services, env, monkeypatch
) -> None:
    services.start("policy", "builder", "nodeagent")
    outcome = _submit_raw_bundle(env, monkeypatch, zeros=10, declared=2 << 20)
    assert outcome.state == "failed", outcome.events
    failed = next(e["payload"] for e in outcome.events if e["type"] == "sandbox.failed")
    assert failed["reason"] == (
        "code bundle unusable: it expands to 2097152 bytes, over include_code.max_size "
        "(1048576 bytes)"
    )
    assert not (Path(env["DSEC_HOME"]) / "sandboxes" / outcome.sandbox_id / "code").exists()
