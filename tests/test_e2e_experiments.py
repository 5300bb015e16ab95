"""Record, replay and an A/B experiment on real sandboxes (examples/ab-experiment).

Policy, builder and node agent run as processes. The records service serves users' logs; a
risk agent with ``record: {tools: true}`` asks it live and shuts it down: its ``recording.saved``
names the recording. Then ``dsec experiment run`` replays that recording to two variants, each
in its own sandbox: the records service is gone, so every answer came from the recording (a
live call would fail with AgentNotFound), and a call the recording lacks is a ReplayMiss. The
experiment's events carry the same inputs hash for both trials, and each trial's sandbox was
submitted with ``replay:`` that recording: identical inputs, provable from the log.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import nats
import pytest
from dsec_core.envelope import decode
from dsec_core.subjects import STREAM, aggregate_filter, subject_for
from nats.js.errors import NotFoundError

pytestmark = [pytest.mark.e2e, pytest.mark.kernel, pytest.mark.slow]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ab-experiment"


async def _last(nats_url: str, event_type: str, aggregate_id: str, wait_s: float) -> Any:
    """The newest ``event_type`` payload of ``aggregate_id``, polled until a deadline."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + wait_s
        while True:
            try:
                raw = await js.get_last_msg(STREAM, subject_for(event_type, aggregate_id))
                assert raw.data is not None
                return decode(raw.data).payload
            except NotFoundError:
                if time.monotonic() > deadline:
                    return None
                await asyncio.sleep(0.2)
    finally:
        await nc.close()


async def _experiment_events(nats_url: str, experiment_id: str) -> list[Any]:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        sub = await js.subscribe(
            aggregate_filter("experiment", experiment_id), ordered_consumer=True
        )
        out = []
        while True:
            try:
                msg = await sub.next_msg(timeout=2)
            except TimeoutError:
                return out
            out.append(decode(msg.data))
    finally:
        await nc.close()


def test_record_then_ab_replay_with_identical_inputs_and_no_live_call(
    services: Any,
    stack_env: dict[str, str],
    dsec_cli: Callable[..., Any],
    nats_url: str,
    tmp_path: Path,
) -> None:
    env = dict(stack_env)
    services.start("policy", "builder", "nodeagent")
    shutil.copytree(EXAMPLE, tmp_path / "ab", ignore=shutil.ignore_patterns("__pycache__"))
    here = tmp_path / "ab"
    # variant b also asks one call the recording lacks: a ReplayMiss, never a live call
    spec_b = here / "agent" / "spec_b.yaml"
    spec_b.write_text(spec_b.read_text() + "    - {name: PROBE_MISS, value: '1'}\n")

    records = dsec_cli(
        "submit", str(here / "records" / "dsec.yaml"), "--code", str(here / "records"),
        "--wait", "ready", "--stall", "60", "--json", env=env,
    ).last_json()  # fmt: skip
    assert records["state"] == "running", records
    recorder = dsec_cli(
        "submit", str(here / "agent" / "record.yaml"), "--code", str(here / "agent"),
        "--wait", "exited", "--stall", "60", "--json", env=env,
    ).last_json()  # fmt: skip
    assert recorder["exit_code"] == 0, dsec_cli(
        "sandbox", "logs", "--stderr", recorder["sandbox_id"], env=env
    ).output
    saved = asyncio.run(_last(nats_url, "recording.saved", recorder["sandbox_id"], 10))
    assert saved is not None, "the recording session published no recording.saved"
    assert saved["tool_calls"] == 14 and saved["calls"] == 14  # users, 12 user_logs, shutdown
    assert saved["failed_calls"] == 0 and saved["http_calls"] == 0
    recording = saved["recording_id"]
    # the live source is gone: the trials cannot reach it, only the recording
    exited = asyncio.run(_last(nats_url, "sandbox.exited", records["sandbox_id"], 30))
    assert exited is not None and exited["exit_code"] == 0, exited

    result = dsec_cli(
        "experiment", "run", "--inputs", recording,
        "--variant", f"a={here / 'agent' / 'spec_a.yaml'}",
        "--variant", f"b={spec_b}",
        "--repeats", "1", "--parallel", "2", "--scorer", str(here / "scorer.py"),
        "--name", "risk-ab", "--json", env=env,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    outcome = result.last_json()
    table = outcome["table"]
    assert table["inputs"] == [f"u{i}" for i in range(1, 13)]
    assert table["failed_trials"] == 0 and table["trials"] == 2
    means = {v: s["mean"] for v, s in table["overall"]["variants"].items()}
    assert means["b"] > means["a"], means  # b weighs what the labels weigh
    overall_test = table["overall"]["tests"][0]
    assert overall_test["test"] == "paired" and overall_test["p"] < 0.05, overall_test

    experiment_id = outcome["experiment_id"]
    events = asyncio.run(_experiment_events(nats_url, experiment_id))
    types = [e.type for e in events]
    assert types[0] == "experiment.started" and types[-1] == "experiment.completed", types
    assert all(e.producer == events[0].producer for e in events)  # the user ran it
    trials = [e.payload for e in events if e.type == "experiment.trial_completed"]
    assert {t["variant"] for t in trials} == {"a", "b"}
    assert {t["inputs_hash"] for t in trials} == {saved["root_hash"]}
    assert {t["recording_id"] for t in trials} == {recording}
    for t in trials:  # each trial's own sandbox was submitted replaying that very recording
        submitted = asyncio.run(_last(nats_url, "spec.submitted", t["sandbox_id"], 5))
        assert f"replay: {recording}" in submitted["spec_yaml"]
        assert set(t["scores"]) == set(table["inputs"])
    b_logs = dsec_cli(
        "sandbox", "logs", next(t["sandbox_id"] for t in trials if t["variant"] == "b"), env=env
    ).output
    assert "replay miss: no recorded answer for tool call records.user_logs" in b_logs, b_logs

    shown = dsec_cli("experiment", "show", experiment_id, "--json", env=env).last_json()
    assert shown["state"] == "completed" and shown["table"]["overall"] == table["overall"]
    listed = dsec_cli("experiment", "ls", "--json", env=env).last_json()
    assert any(r["experiment_id"] == experiment_id and r["trials"] == "2/2" for r in listed)
    finished = dsec_cli("experiment", "run", "--resume", experiment_id, env=env)
    assert finished.exit_code == 2 and "is completed" in finished.output, finished.output


def test_an_interrupted_experiment_resumes_from_its_events_and_refuses_changed_variants(
    dsec_cli: Callable[..., Any],
    make_publisher: Callable[..., Any],
    stack_env: dict[str, str],
    nats_url: str,
    tmp_path: Path,
) -> None:
    """An experiment whose trials are all on the log but which never completed (the CLI was
    stopped after the last trial): --resume runs no trial, computes the table from the events
    and completes it; one whose variant's spec changed since is refused."""
    from dsec_cli.experiments import runner
    from dsec_core.events import ExperimentStarted, ExperimentTrialCompleted, ExperimentVariant

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "spec.yaml").write_text(
            f'version: "1.2"\nname: agent-{name}\nbase: dsec/python311:latest\n'
        )
    scorer = tmp_path / "scorer.py"
    scorer.write_text("def score(input_id, output):\n    return float(output)\n")
    variants = [runner.load_variant(n, tmp_path / n / "spec.yaml") for n in ("a", "b")]
    inputs_hash = "ab" * 32

    async def publish(experiment_id: str) -> None:
        nc = await nats.connect(nats_url)
        try:
            publisher = await make_publisher(nc.jetstream(), prefix="exp")
            await publisher.publish(
                ExperimentStarted(
                    inputs_kind="recording",
                    inputs="rec_" + "ab" * 16,
                    inputs_hash=inputs_hash,
                    variants=[
                        ExperimentVariant(
                            name=v.name,
                            spec_file=str(v.spec_file),
                            spec_hash=v.spec_hash,
                            code_hash=v.code_hash,
                        )
                        for v in variants
                    ],
                    repeats=1,
                    scorer_file=str(scorer),
                    scorer_hash=runner.file_hash(scorer),
                    parallel=1,
                ),
                aggregate_id=experiment_id,
            )
            for name, scores in (("a", {"u1": 0.2, "u2": 0.4}), ("b", {"u1": 0.6, "u2": 0.9})):
                await publisher.publish(
                    ExperimentTrialCompleted(
                        variant=name,
                        repeat=0,
                        sandbox_id=f"sbx_{name}",
                        inputs_hash=inputs_hash,
                        exit_code=0,
                        scores=scores,
                    ),
                    aggregate_id=experiment_id,
                )
        finally:
            await nc.close()

    first = runner.new_experiment_id()
    asyncio.run(publish(first))
    shown = dsec_cli("experiment", "show", first, "--json", env=stack_env)
    assert shown.last_json().get("state") == "incomplete", shown.output
    resumed = dsec_cli("experiment", "run", "--resume", first, "--json", env=stack_env)
    assert resumed.exit_code == 0, resumed.output
    table = resumed.last_json()["table"]
    assert table["trials"] == 2 and table["inputs"] == ["u1", "u2"]
    assert table["overall"]["variants"]["b"]["mean"] == pytest.approx(0.75)
    events = asyncio.run(_experiment_events(nats_url, first))
    assert [e.type for e in events][-1] == "experiment.completed"
    assert (
        dsec_cli("experiment", "show", first, "--json", env=stack_env).last_json()["state"]
        == "completed"
    )

    second = runner.new_experiment_id()
    asyncio.run(publish(second))
    (tmp_path / "b" / "spec.yaml").write_text('version: "1.2"\nname: changed\nbase: x\n')
    refused = dsec_cli("experiment", "run", "--resume", second, env=stack_env)
    assert refused.exit_code == 2, refused.output
    assert "changed since the experiment started" in " ".join(refused.output.split())
