"""An A/B experiment: variants over the same inputs, scored, summarised, on the event log.

Each trial is one variant's run in a sandbox of its own: the variant's spec with ``replay:
RECORDING`` (every recorded call answered from the recording, none made live) or, for a dataset,
the dataset's file in its code at ``dsec_inputs.jsonl`` (``$DSEC_EXPERIMENT_INPUTS``), and
``$DSEC_TRIAL`` set to ``VARIANT:REPEAT``. The agent prints one line per input::

    DSEC_RESULT {"input": "u1", "output": ...}

(``dsec_sdk.experiment.result(input_id, output)`` prints it). The user's scorer module defines
``score(input_id, output) -> float``; without one, ``output`` must be a number. Every trial ends
in ``experiment.trial_completed`` with its scores and the hash of the inputs its sandbox saw;
``experiment.completed`` carries the summary. A run is resumed from the log: trials already
completed (without an error) are not run again.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import blake3
import yaml

from dsec_cli.experiments import stats

if TYPE_CHECKING:
    from dsec_client import DSec
    from dsec_core.events import (
        ExperimentCompleted,
        ExperimentStarted,
        ExperimentTrialCompleted,
    )

RESULT_PREFIX = "DSEC_RESULT "
DATASET_FILE = "dsec_inputs.jsonl"
ENV_TRIAL = "DSEC_TRIAL"
ENV_INPUTS = "DSEC_EXPERIMENT_INPUTS"
RECORDING = re.compile(r"^rec_[0-9a-f]{32}\Z")
VARIANT_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,31}\Z")
ALPHA = 0.05


class ExperimentError(Exception):
    """Bad input to an experiment (the message says which and what is valid)."""


def new_experiment_id() -> str:
    return f"exp_{secrets.token_hex(8)}"


def file_hash(path: Path) -> str:
    return blake3.blake3(path.read_bytes()).hexdigest()


def tree_hash(root: Path) -> str:
    """BLAKE3 over the sorted relative paths and bytes of the files under ``root``."""
    h = blake3.blake3()
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        rel = path.relative_to(root).as_posix().encode()
        h.update(len(rel).to_bytes(4, "big") + rel)
        data = path.read_bytes()
        h.update(len(data).to_bytes(8, "big") + data)
    return h.hexdigest()


@dataclass(frozen=True)
class Variant:
    name: str
    spec_file: Path
    spec_text: str
    spec_hash: str
    code_dir: Path
    code_hash: str


def parse_variant(value: str) -> tuple[str, Path]:
    """``NAME=SPEC.yaml`` of ``--variant``."""
    name, sep, path = value.partition("=")
    if not sep or not path:
        raise ExperimentError(f"--variant {value!r}: use NAME=SPEC.yaml, e.g. a=spec_a.yaml")
    if not VARIANT_NAME.match(name):
        raise ExperimentError(
            f"--variant {value!r}: the name must be 1-32 of a-z, 0-9, '-', '_' (e.g. a, fast-v2)"
        )
    return name, Path(path)


def load_variant(name: str, spec: Path) -> Variant:
    """A variant: its spec and its code (the spec's directory)."""
    try:
        text = spec.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ExperimentError(f"--variant {name}={spec}: cannot read the spec: {exc}") from None
    from dsec_core.spec import load_spec

    loaded = load_spec(text, str(spec))
    if loaded.spec is None:  # located in the user's own file, before any trial starts
        shown = "\n".join(e.format() for e in loaded.errors[:10])
        raise ExperimentError(f"--variant {name}={spec} is not a valid spec:\n{shown}")
    code = spec.resolve().parent
    return Variant(
        name, spec.resolve(), text, blake3.blake3(text.encode()).hexdigest(), code, tree_hash(code)
    )


def trial_spec(variant: Variant, label: str, replay: str | None, dataset: bool) -> str:
    """The variant's spec for one trial: replaying ``replay`` (its own ``record``/``replay``
    dropped), with ``$DSEC_TRIAL`` (and ``$DSEC_EXPERIMENT_INPUTS`` for a dataset)."""
    data = yaml.safe_load(variant.spec_text)
    data.pop("record", None)
    data.pop("replay", None)
    if replay is not None:
        data["replay"] = replay
    context = data.setdefault("runtime_context", {}) or {}
    data["runtime_context"] = context
    env = [e for e in context.get("env_vars") or [] if e.get("name") not in (ENV_TRIAL, ENV_INPUTS)]
    env.append({"name": ENV_TRIAL, "value": label})
    if dataset:
        workdir = str(data.get("workdir") or "/workspace").rstrip("/")
        env.append({"name": ENV_INPUTS, "value": f"{workdir}/{DATASET_FILE}"})
    context["env_vars"] = env
    text: str = yaml.safe_dump(data, sort_keys=False)
    return text


def parse_results(stdout: str) -> dict[str, Any]:
    """The agent's ``DSEC_RESULT`` lines: input id -> output (a later line wins)."""
    out: dict[str, Any] = {}
    for line in stdout.splitlines():
        if not line.startswith(RESULT_PREFIX):
            continue
        try:
            item = json.loads(line[len(RESULT_PREFIX) :])
        except ValueError:
            continue
        if isinstance(item, dict) and "input" in item:
            out[str(item["input"])] = item.get("output")
    return out


Scorer = Callable[[str, Any], float]


def numeric_score(input_id: str, output: Any) -> float:
    """The default scorer: the output is the score."""
    if isinstance(output, bool) or not isinstance(output, int | float):
        raise ValueError(f"input {input_id}: output {output!r} is no number (give --scorer)")
    return float(output)


def load_scorer(path: Path | None) -> tuple[Scorer, str]:
    """The ``score`` function of the user's scorer file, and the file's hash."""
    if path is None:
        return numeric_score, blake3.blake3(b"dsec:numeric").hexdigest()
    if not path.is_file():
        raise ExperimentError(f"--scorer {path}: no such file")
    spec = importlib.util.spec_from_file_location(f"dsec_scorer_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ExperimentError(f"--scorer {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ExperimentError(f"--scorer {path}: importing it failed: {exc}") from None
    score = getattr(module, "score", None)
    if not callable(score):
        raise ExperimentError(
            f"--scorer {path}: define `def score(input_id: str, output) -> float`"
        )
    return score, file_hash(path)


def score_outputs(scorer: Scorer, outputs: Mapping[str, Any]) -> dict[str, float]:
    scores: dict[str, float] = {}
    for input_id, output in outputs.items():
        value = float(scorer(input_id, output))
        if not math.isfinite(value):
            raise ValueError(f"input {input_id}: score {value} is not finite")
        scores[input_id] = value
    return scores


# --- the plan, resume, and the table --------------------------------------------------------


def all_trials(variants: Sequence[str], repeats: int) -> list[tuple[str, int]]:
    """Every trial, interleaved (a0 b0 a1 b1 ...: a stop half-way leaves both arms alike)."""
    return [(v, r) for r in range(repeats) for v in variants]


def pending_trials(
    planned: Iterable[tuple[str, int]], completed: Iterable[ExperimentTrialCompleted]
) -> list[tuple[str, int]]:
    """The trials still to run: those without a completed event, or whose last one failed."""
    last: dict[tuple[str, int], ExperimentTrialCompleted] = {}
    for trial in completed:
        last[(trial.variant, trial.repeat)] = trial
    return [t for t in planned if t not in last or last[t].error]


def latest(trials: Iterable[ExperimentTrialCompleted]) -> list[ExperimentTrialCompleted]:
    """The last event of each (variant, repeat)."""
    last: dict[tuple[str, int], ExperimentTrialCompleted] = {}
    for trial in trials:
        last[(trial.variant, trial.repeat)] = trial
    return list(last.values())


@dataclass
class Table:
    variants: list[str]
    inputs: list[str]
    rows: list[dict[str, Any]] = field(default_factory=list)  # per input, then overall
    overall: dict[str, Any] = field(default_factory=dict)
    failed_trials: int = 0
    trials: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {
            "variants": self.variants,
            "inputs": self.inputs,
            "per_input": self.rows,
            "overall": self.overall,
            "trials": self.trials,
            "failed_trials": self.failed_trials,
        }


def _compare(test: stats.TestResult | None, baseline: str, other: str) -> dict[str, Any] | None:
    if test is None:
        return None
    return {**test.as_dict(), "baseline": baseline, "variant": other}


def result_table(variants: Sequence[str], trials: Iterable[ExperimentTrialCompleted]) -> Table:
    """Per input: each variant's mean and 95 % CI over its repeats and Welch's test against
    the first variant; overall: each variant's mean of per-trial means with its CI, and the
    paired t-test over the inputs (each input's mean per variant) against the first variant
    (Welch's test on the per-trial means when fewer than two inputs)."""
    done = latest(trials)
    ok = [t for t in done if not t.error]
    table = Table(list(variants), [], trials=len(done), failed_trials=len(done) - len(ok))
    inputs = sorted({i for t in ok for i in t.scores}, key=_natural)
    table.inputs = inputs
    by: dict[str, dict[str, list[float]]] = {v: {i: [] for i in inputs} for v in variants}
    trial_means: dict[str, list[float]] = {v: [] for v in variants}
    for t in ok:
        if t.variant not in by or not t.scores:
            continue
        for i, s in t.scores.items():
            by[t.variant][i].append(s)
        trial_means[t.variant].append(stats.mean(list(t.scores.values())))
    base = variants[0]
    for i in inputs:
        row: dict[str, Any] = {"input": i, "variants": {}, "tests": []}
        for v in variants:
            values = by[v][i]
            row["variants"][v] = stats.summary(values).as_dict() if values else None
        for v in variants[1:]:
            test = _compare(stats.welch(by[v][i], by[base][i]), base, v)
            if test is not None:
                row["tests"].append(test)
        table.rows.append(row)
    overall: dict[str, Any] = {"variants": {}, "tests": []}
    for v in variants:
        values = trial_means[v]
        overall["variants"][v] = stats.summary(values).as_dict() if values else None
    for v in variants[1:]:
        common = [i for i in inputs if by[v][i] and by[base][i]]
        result: stats.TestResult | None
        if len(common) >= 2:
            result = stats.paired(
                [stats.mean(by[v][i]) for i in common], [stats.mean(by[base][i]) for i in common]
            )
        else:
            result = stats.welch(trial_means[v], trial_means[base])
        compared = _compare(result, base, v)
        if compared is not None:
            overall["tests"].append(compared)
    table.overall = overall
    return table


def _natural(text: str) -> list[str | int]:
    """u2 before u10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def verdict(table: Table) -> tuple[float | None, str, str]:
    """The overall p value (first comparison), its test, and a sentence."""
    tests = table.overall.get("tests") or []
    if not tests:
        return None, "", "too few trials for a test"
    first = tests[0]
    p, name = float(first["p"]), str(first["test"])
    better = first["variant"] if first["difference"] > 0 else first["baseline"]
    if p < ALPHA:
        return p, name, f"{better} scores higher (p={p:.3g} < {ALPHA}, {name} t-test)"
    return p, name, f"no significant difference (p={p:.3g}, {name} t-test)"


# --- the log -----------------------------------------------------------------------------------


@dataclass
class History:
    started: ExperimentStarted | None = None
    trials: list[ExperimentTrialCompleted] = field(default_factory=list)
    completed: ExperimentCompleted | None = None
    tenant: str = ""
    started_at: str = ""


async def _scan(d: DSec, filter_subject: str) -> list[Any]:
    """Every verified event on ``filter_subject`` up to now (stops when caught up)."""
    out: list[Any] = []
    async for batch in d.follow(filter_subject, 1):
        if not batch:
            break
        out.extend(batch)
    return out


async def history(d: DSec, experiment_id: str) -> History:
    from dsec_core.events import (
        ExperimentCompleted,
        ExperimentStarted,
        ExperimentTrialCompleted,
    )
    from dsec_core.subjects import aggregate_filter

    found = History()
    for event in await _scan(d, aggregate_filter("experiment", experiment_id)):
        payload = event.payload
        if found.started is None:
            # the experiment is its first start; anything before it belongs to nothing
            if isinstance(payload, ExperimentStarted):
                found.started, found.tenant = payload, event.tenant
                found.started_at = event.time.isoformat()
            continue
        if event.tenant != found.tenant:
            continue  # another tenant's user wrote under this id: never one of its trials
        if isinstance(payload, ExperimentTrialCompleted):
            found.trials.append(payload)
        elif isinstance(payload, ExperimentCompleted):
            found.completed = payload
    return found


async def experiments(d: DSec) -> list[dict[str, Any]]:
    """Every experiment on the log: id, name, variants, trials done, state."""
    from dsec_core.events import ExperimentStarted
    from dsec_core.subjects import ROOT

    rows: dict[str, dict[str, Any]] = {}
    for event in await _scan(d, f"{ROOT}.experiment.>"):
        eid = event.aggregate_id
        if eid in rows and event.tenant != rows[eid]["tenant"]:
            continue  # another tenant's user wrote under this id (its first start decides)
        if isinstance(event.payload, ExperimentStarted) and eid not in rows:
            p = event.payload
            rows[eid] = {
                "experiment_id": eid,
                "name": p.name,
                "started_at": event.time.isoformat(),
                "inputs": p.inputs,
                "variants": [v.name for v in p.variants],
                "planned": len(p.variants) * p.repeats,
                "done": set(),
                "state": "running",
                "verdict": "",
                "tenant": event.tenant,
            }
        elif eid in rows and event.type == "experiment.trial_completed":
            rows[eid]["done"].add((event.payload.variant, event.payload.repeat))
        elif eid in rows and event.type == "experiment.completed":
            rows[eid]["state"] = "completed"
            rows[eid]["verdict"] = event.payload.verdict
    out = []
    for row in rows.values():
        row["trials"] = f"{len(row.pop('done'))}/{row.pop('planned')}"
        row.pop("tenant")
        out.append(row)
    return out


async def recording_root(d: DSec, recording_id: str) -> str | None:
    """The root hash ``recording.saved`` gives for ``recording_id`` (None: not on the log)."""
    from dsec_core.events import RecordingSaved
    from dsec_core.subjects import filter_for

    for event in reversed(await _scan(d, filter_for("recording.saved"))):
        payload = event.payload
        if isinstance(payload, RecordingSaved) and payload.recording_id == recording_id:
            return payload.root_hash
    return None


# --- running trials ---------------------------------------------------------------------------


@dataclass
class Setup:
    experiment_id: str
    variants: list[Variant]
    repeats: int
    parallel: int
    inputs_kind: str
    inputs: str
    inputs_hash: str
    scorer: Scorer
    scorer_hash: str
    timeout_s: float
    dataset: Path | None = None


async def run_trial(
    d: DSec, setup: Setup, variant: Variant, repeat: int
) -> ExperimentTrialCompleted:
    """One trial: submit, wait for the exit, read its results, score them."""
    from dsec_client import DSecError
    from dsec_core.events import ExperimentTrialCompleted

    label = f"{variant.name}:{repeat}"
    replay = setup.inputs if setup.inputs_kind == "recording" else None
    spec = trial_spec(variant, label, replay, setup.dataset is not None)
    code = variant.code_dir
    staged: Path | None = None
    if setup.dataset is not None:
        staged = Path(await asyncio.to_thread(tempfile.mkdtemp, prefix="dsec-trial-"))
        await asyncio.to_thread(_stage, variant.code_dir, setup.dataset, staged)
        code = staged
    sandbox_id, exit_code, error, scores = "", -1, "", {}
    try:
        sandbox = await d.submit(spec, code, filename=variant.spec_file.name)
        sandbox_id = sandbox.id
        ended = await sandbox.wait("exited", timeout=setup.timeout_s)
        exit_code = int(ended.data.get("exit_code", -1))
        stdout = await sandbox.logs()
        outputs = parse_results(stdout)
        if exit_code != 0:
            stderr = await sandbox.logs(stderr=True)
            tail = next((ln for ln in reversed(stderr.splitlines()) if ln.strip()), "")
            error = f"exit code {exit_code}: {tail}"[:500]
        elif not outputs:
            error = f"no {RESULT_PREFIX.strip()} lines in its output"
        else:
            scores = score_outputs(setup.scorer, outputs)
    except DSecError as exc:
        error = str(exc)[:500]
    except (ValueError, TypeError) as exc:  # the scorer refused an output
        error = f"scoring: {exc}"[:500]
    finally:
        if staged is not None:
            await asyncio.to_thread(shutil.rmtree, staged, True)
    return ExperimentTrialCompleted(
        variant=variant.name,
        repeat=repeat,
        sandbox_id=sandbox_id or "none",
        inputs_hash=setup.inputs_hash,
        recording_id=replay,
        exit_code=exit_code,
        scores=scores,
        error=error,
    )


def _stage(code: Path, dataset: Path, into: Path) -> None:
    shutil.copytree(code, into, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(dataset, into / DATASET_FILE)


async def run_trials(
    d: DSec,
    setup: Setup,
    todo: Sequence[tuple[str, int]],
    on_trial: Callable[[ExperimentTrialCompleted], None] | None = None,
) -> list[ExperimentTrialCompleted]:
    """Run ``todo`` at most ``setup.parallel`` at once; each is on the log when it ends."""
    by_name = {v.name: v for v in setup.variants}
    gate = asyncio.Semaphore(setup.parallel)
    publisher = await d.publisher()
    done: list[ExperimentTrialCompleted] = []

    async def one(name: str, repeat: int) -> None:
        async with gate:
            trial = await run_trial(d, setup, by_name[name], repeat)
        await publisher.publish(trial, aggregate_id=setup.experiment_id)
        done.append(trial)
        if on_trial is not None:
            on_trial(trial)

    await asyncio.gather(*(one(name, repeat) for name, repeat in todo))
    return done


def env_parallel_default() -> int:
    return max(1, min(4, (os.cpu_count() or 2) // 2))
