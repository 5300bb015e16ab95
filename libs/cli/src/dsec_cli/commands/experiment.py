"""``dsec experiment``: A/B runs of agent variants over the same recorded inputs.

``run`` starts each variant in sandboxes of its own over a recording (replayed: no live call)
or a dataset, scores every trial with the user's scorer and prints the result table (means,
95 % confidence intervals, Welch's and the paired t-test); ``experiment.started``,
``experiment.trial_completed`` and ``experiment.completed`` (signed by the user) make it
auditable, and ``run --resume ID`` finishes an interrupted one. ``show`` and ``ls`` read the log.

Exit codes: 0 ok, 1 every trial of a variant failed, 2 bad input (a spec, a flag, an unknown
recording or experiment), 3 NATS or S3 unreachable.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dsec_cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    client,
    console,
    err_console,
    fail,
    print_json,
    run,
    safe_text,
)

if TYPE_CHECKING:
    from dsec_client import DSec
    from dsec_core.events import ExperimentTrialCompleted

    from dsec_cli.experiments.runner import Setup, Table

experiment_app = typer.Typer(
    help="A/B experiments: agent variants over the same recorded inputs, scored and compared.",
    no_args_is_help=True,
)


def register(app: typer.Typer) -> None:
    app.add_typer(experiment_app, name="experiment")


@experiment_app.command("run")
def run_(
    inputs: Annotated[
        str | None,
        typer.Option(help="A recording id (rec_...) to replay, or a dataset file (JSON lines)"),
    ] = None,
    variant: Annotated[
        list[str] | None,
        typer.Option(help="NAME=SPEC.yaml (two or more); the code is the spec's directory"),
    ] = None,
    repeats: Annotated[int, typer.Option(help="Trials per variant (1-1000)")] = 3,
    scorer: Annotated[
        Path | None, typer.Option(help="Python file defining score(input_id, output) -> float")
    ] = None,
    parallel: Annotated[int, typer.Option(help="Trials running at once (1-64)")] = 2,
    name: Annotated[str, typer.Option(help="A name to find it by")] = "",
    timeout: Annotated[float, typer.Option(help="Seconds a trial may take")] = 600.0,
    resume: Annotated[
        str | None, typer.Option(help="Finish experiment ID: run only its trials not completed")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON")] = False,
) -> None:
    """Run every variant over the same inputs, REPEATS times each, PARALLEL trials at once;
    score the trials and print the result table."""
    from dsec_cli.experiments import runner

    if resume is not None:
        if inputs is not None or variant or scorer is not None:
            fail(
                "--resume ID takes the experiment's own inputs, variants and scorer: give "
                "none of --inputs, --variant, --scorer",
                EXIT_BAD_INPUT,
            )
        run(_resume(resume, as_json))
        return
    if inputs is None or not variant or len(variant) < 2:
        fail("give --inputs and at least two --variant NAME=SPEC.yaml", EXIT_BAD_INPUT)
    if not 1 <= repeats <= 1000:
        fail(f"--repeats {repeats}: use 1-1000", EXIT_BAD_INPUT)
    if not 1 <= parallel <= 64:
        fail(f"--parallel {parallel}: use 1-64", EXIT_BAD_INPUT)
    try:
        parsed = [runner.parse_variant(v) for v in variant]
        names = [n for n, _ in parsed]
        if len(set(names)) != len(names):
            raise runner.ExperimentError(f"--variant names must differ: {', '.join(names)}")
        variants = [runner.load_variant(n, p) for n, p in parsed]
        score, scorer_hash = runner.load_scorer(scorer)
    except runner.ExperimentError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    run(
        _start(
            name, inputs, variants, repeats, parallel, timeout, scorer, score, scorer_hash, as_json
        )
    )


async def _start(
    name: str,
    inputs: str,
    variants: list[Any],
    repeats: int,
    parallel: int,
    timeout: float,
    scorer_file: Path | None,
    score: Any,
    scorer_hash: str,
    as_json: bool,
) -> None:
    from dsec_core.events import ExperimentStarted, ExperimentVariant

    from dsec_cli.experiments import runner

    async with client() as d:
        kind, inputs_hash, dataset = await _inputs(d, inputs)
        setup = runner.Setup(
            experiment_id=runner.new_experiment_id(),
            variants=variants,
            repeats=repeats,
            parallel=parallel,
            inputs_kind=kind,
            inputs=inputs if kind == "recording" else str(Path(inputs).resolve()),
            inputs_hash=inputs_hash,
            scorer=score,
            scorer_hash=scorer_hash,
            timeout_s=timeout,
            dataset=dataset,
        )
        started = ExperimentStarted(
            name=name,
            inputs_kind="recording" if kind == "recording" else "dataset",
            inputs=setup.inputs,
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
            repeats=repeats,
            scorer_file="" if scorer_file is None else str(scorer_file.resolve()),
            scorer_hash=scorer_hash,
            parallel=parallel,
            timeout_s=timeout,
        )
        publisher = await d.publisher()
        await publisher.publish(started, aggregate_id=setup.experiment_id)
        if not as_json:
            err_console.print(
                f"experiment [bold]{setup.experiment_id}[/]: {len(variants)} variants x "
                f"{repeats} over {safe_text(inputs)} (inputs {inputs_hash[:16]}), "
                f"{parallel} at once",
                highlight=False,
            )
        await _finish(d, setup, [], as_json)


async def _inputs(d: DSec, inputs: str) -> tuple[str, str, Path | None]:
    """The kind of ``--inputs``, its hash, and the dataset file (None: a recording)."""
    from dsec_cli.experiments import runner

    if inputs.startswith("rec_"):
        if not runner.RECORDING.match(inputs):
            fail(f"--inputs {inputs}: a recording id is rec_ + 32 hex digits", EXIT_BAD_INPUT)
        root = await runner.recording_root(d, inputs)
        if root is None:
            fail(
                f"--inputs {inputs}: no recording.saved names it (a sandbox with `record:` "
                "saves one when it ends: `dsec audit replay --type recording.saved`)",
                EXIT_BAD_INPUT,
            )
        return "recording", root, None
    path = Path(inputs)
    if not path.is_file():
        fail(f"--inputs {inputs}: neither a recording id (rec_...) nor a file", EXIT_BAD_INPUT)
    return "dataset", runner.file_hash(path), path


async def _finish(
    d: DSec, setup: Setup, earlier: list[ExperimentTrialCompleted], as_json: bool
) -> None:
    from dsec_core.events import ExperimentCompleted

    from dsec_cli.experiments import runner

    names = [v.name for v in setup.variants]
    todo = runner.pending_trials(runner.all_trials(names, setup.repeats), earlier)

    def progress(trial: ExperimentTrialCompleted) -> None:
        if as_json:
            return
        state = (
            f"[red]failed[/]: {safe_text(trial.error)}"
            if trial.error
            else (f"{len(trial.scores)} inputs scored")
        )
        err_console.print(
            f"  trial {trial.variant}:{trial.repeat} ({trial.sandbox_id}) {state}",
            highlight=False,
        )

    done = await runner.run_trials(d, setup, todo, progress)
    table = runner.result_table(names, [*earlier, *done])
    p, test, sentence = runner.verdict(table)
    means = {v: s["mean"] for v, s in table.overall["variants"].items() if s is not None}
    publisher = await d.publisher()
    await publisher.publish(
        ExperimentCompleted(
            trials=table.trials,
            failed_trials=table.failed_trials,
            means=means,
            p_value=p,
            test=test,
            verdict=sentence,
        ),
        aggregate_id=setup.experiment_id,
    )
    _print(setup.experiment_id, table, sentence, as_json)
    if any(table.overall["variants"].get(v) is None for v in names):
        raise typer.Exit(EXIT_FAILED)


async def _resume(experiment_id: str, as_json: bool) -> None:
    from dsec_cli.experiments import runner

    async with client() as d:
        found = await runner.history(d, experiment_id)
        started = found.started
        if started is None:
            fail(f"no experiment {experiment_id} on the log (`dsec experiment ls`)", EXIT_BAD_INPUT)
        tenant = d.identity[1].tenant
        if found.tenant != tenant:
            fail(
                f"experiment {experiment_id} belongs to tenant {found.tenant!r}, not {tenant!r}",
                EXIT_BAD_INPUT,
            )
        if found.completed is not None:
            fail(
                f"experiment {experiment_id} is completed: `dsec experiment show {experiment_id}`",
                EXIT_BAD_INPUT,
            )
        variants = []
        try:
            for v in started.variants:
                loaded = runner.load_variant(v.name, Path(v.spec_file))
                if (loaded.spec_hash, loaded.code_hash) != (v.spec_hash, v.code_hash):
                    raise runner.ExperimentError(
                        f"variant {v.name}: {v.spec_file} or its code changed since the "
                        "experiment started; a resumed run must run what it started with"
                    )
                variants.append(loaded)
            scorer_path = Path(started.scorer_file) if started.scorer_file else None
            score, scorer_hash = runner.load_scorer(scorer_path)
            if scorer_hash != started.scorer_hash:
                raise runner.ExperimentError(f"the scorer {started.scorer_file} changed")
        except runner.ExperimentError as exc:
            fail(str(exc), EXIT_BAD_INPUT)
        dataset = Path(started.inputs) if started.inputs_kind == "dataset" else None
        if dataset is not None and (
            not dataset.is_file() or runner.file_hash(dataset) != started.inputs_hash
        ):
            fail(f"the dataset {started.inputs} changed or is gone", EXIT_BAD_INPUT)
        setup = runner.Setup(
            experiment_id=experiment_id,
            variants=variants,
            repeats=started.repeats,
            parallel=started.parallel,
            inputs_kind=started.inputs_kind,
            inputs=started.inputs,
            inputs_hash=started.inputs_hash,
            scorer=score,
            scorer_hash=scorer_hash,
            timeout_s=started.timeout_s,
            dataset=dataset,
        )
        names = [v.name for v in variants]
        left = runner.pending_trials(runner.all_trials(names, started.repeats), found.trials)
        if not as_json:
            err_console.print(
                f"resuming {experiment_id}: {len(left)} of {len(names) * started.repeats} "
                "trials left",
                highlight=False,
            )
        await _finish(d, setup, found.trials, as_json)


@experiment_app.command("show")
def show(
    experiment_id: Annotated[str, typer.Argument(help="The experiment (exp_...)")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON")] = False,
) -> None:
    """The experiment's result table, computed again from its events."""
    from dsec_cli.experiments import runner

    async def load() -> None:
        async with client() as d:
            found = await runner.history(d, experiment_id)
        if found.started is None:
            fail(f"no experiment {experiment_id} on the log (`dsec experiment ls`)", EXIT_BAD_INPUT)
        names = [v.name for v in found.started.variants]
        table = runner.result_table(names, found.trials)
        sentence = runner.verdict(table)[2]
        if as_json:
            print_json(
                {
                    "experiment_id": experiment_id,
                    "state": "completed" if found.completed else "incomplete",
                    "inputs": found.started.inputs,
                    "inputs_hash": found.started.inputs_hash,
                    "trials": [
                        {
                            "variant": t.variant,
                            "repeat": t.repeat,
                            "sandbox_id": t.sandbox_id,
                            "inputs_hash": t.inputs_hash,
                            "error": t.error,
                        }
                        for t in runner.latest(found.trials)
                    ],
                    "table": table.as_dict(),
                    "verdict": sentence,
                }
            )
            return
        state = "completed" if found.completed else "incomplete (resume with --resume)"
        console.print(
            f"{experiment_id} {safe_text(found.started.name)} — {state}; inputs "
            f"{safe_text(found.started.inputs)} ({found.started.inputs_hash[:16]})",
            highlight=False,
        )
        _print(experiment_id, table, sentence, False)

    run(load())


@experiment_app.command("ls")
def ls(
    as_json: Annotated[bool, typer.Option("--json", help="Print the list as JSON")] = False,
) -> None:
    """Every experiment on the log."""
    from rich.table import Table as RichTable

    from dsec_cli.experiments import runner

    async def load() -> list[dict[str, Any]]:
        async with client() as d:
            return await runner.experiments(d)

    rows = run(load())
    if as_json:
        print_json(rows)
        return
    table = RichTable("EXPERIMENT", "NAME", "VARIANTS", "TRIALS", "STATE", "VERDICT")
    for row in rows:
        table.add_row(
            row["experiment_id"],
            safe_text(row["name"]),
            ", ".join(row["variants"]),
            row["trials"],
            row["state"],
            safe_text(row["verdict"]),
        )
    console.print(table)


def _cell(summary: dict[str, Any] | None) -> str:
    if summary is None:
        return "-"
    low, high = summary["ci95"]
    return f"{summary['mean']:.3f} [{low:.3f}, {high:.3f}] n={summary['n']}"


def _test_cell(tests: list[dict[str, Any]]) -> str:
    return (
        "; ".join(
            f"{t['variant']}-{t['baseline']} {t['difference']:+.3f} p={t['p']:.3g}" for t in tests
        )
        or "-"
    )


def _print(experiment_id: str, table: Table, sentence: str, as_json: bool) -> None:
    from rich.table import Table as RichTable

    if as_json:
        print_json({"experiment_id": experiment_id, "table": table.as_dict(), "verdict": sentence})
        return
    rich = RichTable("INPUT", *[f"{v}: mean [95% CI]" for v in table.variants], "DIFF, TEST")
    for row in table.rows:
        rich.add_row(
            safe_text(row["input"]),
            *[_cell(row["variants"][v]) for v in table.variants],
            _test_cell(row["tests"]),
        )
    overall = table.overall
    rich.add_row(
        "[bold]overall[/]",
        *[_cell(overall["variants"][v]) for v in table.variants],
        _test_cell(overall["tests"]),
    )
    console.print(rich)
    failed = f", {table.failed_trials} failed" if table.failed_trials else ""
    console.print(f"{table.trials} trials{failed}. {sentence}", highlight=False)
