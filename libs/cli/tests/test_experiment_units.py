"""Experiment history read from the log: only the experiment's own tenant's events count."""

from __future__ import annotations

import pytest


def test_another_tenants_events_under_an_experiment_id_are_never_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A user of another tenant may store signed events on an experiment's subject (its own
    tenant's, by authz): `show`, `ls` and `--resume` must not count them as trials, nor let a
    second start take the experiment over."""
    import asyncio
    from datetime import UTC, datetime
    from types import SimpleNamespace

    from dsec_cli.experiments import runner
    from dsec_core.events import (
        ExperimentCompleted,
        ExperimentStarted,
        ExperimentTrialCompleted,
        ExperimentVariant,
    )

    h = "0" * 64
    variants = [
        ExperimentVariant(name=n, spec_file=f"{n}.yaml", spec_hash=h, code_hash=h) for n in "ab"
    ]
    started = ExperimentStarted(
        inputs_kind="dataset", inputs="d.jsonl", inputs_hash=h, variants=variants, repeats=1,
        scorer_hash=h, parallel=1,
    )  # fmt: skip

    def trial(variant: str, score: float) -> ExperimentTrialCompleted:
        return ExperimentTrialCompleted(
            variant=variant, repeat=0, sandbox_id="sbx_1", inputs_hash=h, exit_code=0,
            scores={"q1": score},
        )  # fmt: skip

    def ev(payload: object, tenant: str) -> SimpleNamespace:
        return SimpleNamespace(
            payload=payload, tenant=tenant, time=datetime.now(UTC), aggregate_id="exp_12345678",
            type=payload.TYPE,  # type: ignore[attr-defined]
        )  # fmt: skip

    log = [
        ev(trial("a", 0.0), "intruder"),  # before the start
        ev(started, "team-a"),
        ev(trial("a", 0.9), "team-a"),
        ev(started, "intruder"),  # a second start: not a takeover
        ev(trial("b", 1.0), "intruder"),
        ev(ExperimentCompleted(trials=2, failed_trials=0), "intruder"),
    ]

    async def scan(_d: object, _subject: str) -> list[SimpleNamespace]:
        return log

    monkeypatch.setattr(runner, "_scan", scan)
    found = asyncio.run(runner.history(object(), "exp_12345678"))  # type: ignore[arg-type]
    assert found.tenant == "team-a"
    assert [(t.variant, t.scores) for t in found.trials] == [("a", {"q1": 0.9})]
    assert found.completed is None
    rows = asyncio.run(runner.experiments(object()))  # type: ignore[arg-type]
    assert [(r["experiment_id"], r["trials"], r["state"]) for r in rows] == [
        ("exp_12345678", "1/2", "running")
    ]
