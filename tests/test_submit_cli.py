"""`dsec submit` as a user meets it: bad input, an unreachable stack, and a chain that stops
where the services stop."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

SPEC = "version: '1.2'\nname: hello\nbase: python:3.11\n"


def _env(nats_url: str, home: Path) -> dict[str, str]:
    return {"DSEC_NATS_URL": nats_url, "DSEC_HOME": str(home)}


def test_missing_spec_file_is_bad_input(dsec_cli, nats_url, tmp_path) -> None:
    result = dsec_cli("submit", str(tmp_path / "nope.yaml"), env=_env(nats_url, tmp_path))
    assert result.exit_code == 2
    assert "cannot read spec" in result.output and "nope.yaml" in result.output


def test_invalid_wait_level_names_the_valid_ones(dsec_cli, nats_url, tmp_path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    result = dsec_cli("submit", str(spec), "--wait", "done", env=_env(nats_url, tmp_path))
    assert result.exit_code == 2
    assert "validated, built, ready, exited" in result.output


def test_code_dir_must_exist(dsec_cli, nats_url, tmp_path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    result = dsec_cli(
        "submit", str(spec), "--code", str(tmp_path / "missing"), env=_env(nats_url, tmp_path)
    )
    assert result.exit_code == 2 and "is not a directory" in result.output


def test_unreachable_stack_exits_3(dsec_cli, tmp_path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    result = dsec_cli(
        "submit", str(spec), env={"DSEC_NATS_URL": "nats://127.0.0.1:1", "DSEC_HOME": str(tmp_path)}
    )
    assert result.exit_code == 3 and "cannot reach NATS" in result.output


def test_chain_without_a_consumer_stalls_visibly(dsec_cli, nats_url, tmp_path) -> None:
    """No service consumes the spec here: submit says where the chain stopped. (Code uploads,
    which need the policy service's grant: tests/test_code_upload.py.)"""
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    result = dsec_cli(
        "submit", str(spec), "--wait", "exited", "--stall", "1", "--json",
        env=_env(nats_url, tmp_path),
    )  # fmt: skip
    outcome = result.last_json()
    assert result.exit_code == 4, result.output
    assert outcome["sandbox_id"].startswith("sbx_")
    assert outcome["stalled_after"] == "spec.submitted"
    assert [e["type"] for e in outcome["events"]] == ["spec.submitted"]
    assert outcome["events"][0]["payload"]["code"] is None
    assert outcome["skipped"] == []


def test_stopping_an_unknown_sandbox_is_bad_input(dsec_cli, nats_url, tmp_path) -> None:
    result = dsec_cli("sandbox", "stop", "sbx_nope", env=_env(nats_url, tmp_path))
    assert result.exit_code == 2
    assert "no sandbox 'sbx_nope'" in result.output


def test_stopping_a_known_sandbox_publishes_the_request(dsec_cli, nats_url, tmp_path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    submitted = dsec_cli(
        "submit", str(spec), "--stall", "1", "--json", env=_env(nats_url, tmp_path)
    ).last_json()
    stop = dsec_cli(
        "sandbox", "stop", submitted["sandbox_id"], "--no-wait", env=_env(nats_url, tmp_path)
    )
    assert stop.exit_code == 0
    replayed = dsec_cli(
        "audit",
        "replay",
        "--sandbox",
        submitted["sandbox_id"],
        "--type",
        "sandbox.stop_requested",
        "--json",
        env=_env(nats_url, tmp_path),
    )
    assert replayed.output.count('"type":"sandbox.stop_requested"') == 1


def test_spec_over_the_bus_payload_limit_is_bad_input_not_a_traceback(
    dsec_cli, nats_url, tmp_path
) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC + "# " + "x" * (2 * 2**20) + "\n")  # over NATS' default 1 MiB
    result = dsec_cli("submit", str(spec), env=_env(nats_url, tmp_path))
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "spec.submitted is" in text and "over the bus' max payload of 1048576 bytes" in text
    assert "nothing was published" in text and "Traceback" not in text


def test_code_over_max_size_is_refused_before_upload(dsec_cli, nats_url, tmp_path) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC + "include_code: {max_size: 1MiB}\n")
    code = tmp_path / "code"
    code.mkdir()
    (code / "main.py").write_text("print('hi')\n")
    with (code / "zeros.bin").open("wb") as fh:
        fh.truncate(2 * 2**30)
    result = dsec_cli("submit", str(spec), "--code", str(code), env=_env(nats_url, tmp_path))
    text = " ".join(result.output.split())
    assert result.exit_code == 2, result.output
    assert "over include_code.max_size 1.0 MiB; largest files: zeros.bin (2.0 GiB)" in text


async def test_a_pending_sandbox_is_followed_until_it_runs(
    dsec_cli, nats_url, tmp_path, dsec_stack
) -> None:
    """`sandbox.pending` is not an end: submit keeps following past --stall, says the reason
    once, and returns when the sandbox is scheduled and ready."""
    import asyncio

    import nats
    from dsec_core.envelope import decode
    from dsec_core.events import (
        DepsResolved,
        EnvBuilt,
        SandboxPending,
        SandboxReady,
        SandboxScheduled,
        SpecValidated,
    )
    from dsec_core.spec import compile_plan, load_spec
    from dsec_testing import trust

    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    loaded = load_spec(SPEC).spec
    assert loaded is not None
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        submitted = await nc.subscribe("dsec.sandbox.*.spec.submitted")
        p = await trust.pipeline(js, dsec_stack.home)
        scheduler = await trust.publisher(js, dsec_stack.home, "scheduler", acts_for="default")
        run = asyncio.create_task(
            asyncio.to_thread(
                dsec_cli,
                "submit", str(spec), "--wait", "ready", "--stall", "1", "--timeout", "30",
                env={**_env(nats_url, tmp_path), "COLUMNS": "250"},
            )
        )  # fmt: skip
        sid = decode((await submitted.next_msg(timeout=30)).data).aggregate_id
        plan = compile_plan(loaded).model_dump(mode="json")
        await p.policy.publish(
            SpecValidated(name="hello", spec_digest="d", plan=plan), aggregate_id=sid
        )
        await p.builder.publish(
            DepsResolved(lock=[], lock_hash="l", python="3.11", platform="x", resolve_ms=1.0),
            aggregate_id=sid,
        )
        await p.builder.publish(
            EnvBuilt(
                lock_hash="l",
                fingerprint="f",
                object_key="envs/l.tar.zst",
                digest="d",
                size_bytes=1,
                reused=False,
            ),
            aggregate_id=sid,
        )
        why = "n1: needs 1 GPU, has 0"
        await scheduler.publish(SandboxPending(reason=why), aggregate_id=sid)
        await scheduler.publish(SandboxPending(reason=why, attempt=1), aggregate_id=sid)
        # Longer than --stall on purpose: a sandbox waiting for a node is not a stalled chain.
        await asyncio.sleep(1.5)
        assert not run.done()
        await scheduler.publish(SandboxScheduled(node_id="n1"), aggregate_id=sid)
        await p.nodeagent.publish(SandboxReady(node_id="n1", pid=1, cgroup="/c"), aggregate_id=sid)
        result = await asyncio.wait_for(run, 30)
    finally:
        await nc.close()
    assert result.exit_code == 0, result.output
    assert result.output.count(f"pending: {why} (waiting for a node)") == 1
    assert "sandbox.scheduled" in result.output and "sandbox.ready" in result.output
