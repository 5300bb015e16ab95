"""``dsec experiment``'s pieces without a stack: the statistics against known values, the trial
plan and resume, the result table, trial specs, results and scorers."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml
from dsec_cli.experiments import runner, stats
from dsec_core.events import ExperimentTrialCompleted

pytestmark = pytest.mark.unit

HASH = "0" * 64


@pytest.mark.parametrize("t", [-30.0, -2.5, -0.3, 0.0, 0.7, 4.0, 100.0])
def test_t_cdf_matches_the_closed_forms_of_one_and_two_degrees_of_freedom(t: float) -> None:
    # df=1 is the Cauchy distribution; df=2 has F(t) = 1/2 + t / (2 sqrt(2 + t^2))
    assert stats.t_cdf(t, 1) == pytest.approx(0.5 + math.atan(t) / math.pi, abs=1e-12)
    assert stats.t_cdf(t, 2) == pytest.approx(0.5 + t / (2 * math.sqrt(2 + t * t)), abs=1e-12)


@pytest.mark.parametrize(
    ("df", "quantile"),
    [(1, 12.706204736174707), (4, 2.7764451051977987), (10, 2.2281388519649385),
     (30, 2.0422724563012373)],
)  # fmt: skip
def test_t_quantiles_match_the_tables(df: int, quantile: float) -> None:
    assert stats.t_ppf(0.975, df) == pytest.approx(quantile, abs=1e-9)
    assert stats.t_ppf(0.025, df) == pytest.approx(-quantile, abs=1e-9)


def test_summary_gives_the_95_percent_interval_of_the_mean() -> None:
    s = stats.summary([1, 2, 3, 4, 5])
    half = 2.7764451051977987 * math.sqrt(2.5) / math.sqrt(5)
    assert (s.n, s.mean, s.sd) == (5, 3.0, pytest.approx(math.sqrt(2.5)))
    assert (s.ci_low, s.ci_high) == (pytest.approx(3 - half), pytest.approx(3 + half))
    one = stats.summary([0.5])
    assert (one.ci_low, one.ci_high) == (0.5, 0.5)


def test_welch_matches_r() -> None:
    # R: t.test(c(1,2,3,4,5), c(2,4,6,8,10)) -> t = -1.8974, df = 5.8824, p-value = 0.1075
    result = stats.welch([1, 2, 3, 4, 5], [2, 4, 6, 8, 10])
    assert result is not None
    assert result.t == pytest.approx(-1.8973665961010275)
    assert result.df == pytest.approx(5.882352941176471)
    assert result.p == pytest.approx(0.1075, abs=5e-4)
    assert result.difference == -3.0
    assert stats.welch([1.0], [2.0, 3.0]) is None


def test_paired_test_matches_the_closed_form() -> None:
    # differences 1, 2, 3: t = 2 sqrt(3), df = 2, p = 1 - t / sqrt(2 + t^2)
    result = stats.paired([2, 4, 6], [1, 2, 3])
    assert result is not None
    t = 2 * math.sqrt(3)
    assert result.t == pytest.approx(t)
    assert result.p == pytest.approx(1 - t / math.sqrt(2 + t * t), abs=1e-12)
    same = stats.paired([1, 2], [1, 2])
    assert same is not None and same.p == 1.0
    shifted = stats.paired([2, 3], [1, 2])  # every pair differs by exactly 1: no spread
    assert shifted is not None and shifted.p == 0.0
    with pytest.raises(ValueError, match="different sizes"):
        stats.paired([1, 2], [1])


def _trial(
    variant: str, repeat: int, scores: dict[str, float], error: str = ""
) -> ExperimentTrialCompleted:
    return ExperimentTrialCompleted(
        variant=variant,
        repeat=repeat,
        sandbox_id=f"sbx_{variant}{repeat}",
        inputs_hash=HASH,
        exit_code=1 if error else 0,
        scores=scores,
        error=error,
    )


def test_resume_runs_only_trials_without_a_successful_completion() -> None:
    planned = runner.all_trials(["a", "b"], 3)
    assert planned == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2), ("b", 2)]
    done = [
        _trial("a", 0, {"x": 1}),
        _trial("b", 0, {}, error="exit code 1: boom"),
        _trial("a", 1, {}, error="timeout"),
        _trial("a", 1, {"x": 2}),  # retried: its last event counts
    ]
    assert runner.pending_trials(planned, done) == [("b", 0), ("b", 1), ("a", 2), ("b", 2)]
    assert runner.pending_trials(planned, []) == planned


def test_the_table_compares_each_variant_with_the_first_per_input_and_overall() -> None:
    trials = [
        _trial("a", 0, {"u1": 0.5, "u2": 0.4, "u3": 0.6}),
        _trial("a", 1, {"u1": 0.6, "u2": 0.5, "u3": 0.5}),
        _trial("b", 0, {"u1": 0.9, "u2": 0.8, "u3": 0.95}),
        _trial("b", 1, {"u1": 0.8, "u2": 0.9, "u3": 0.85}),
        _trial("b", 2, {}, error="exit code 1"),
    ]
    table = runner.result_table(["a", "b"], trials)
    assert table.inputs == ["u1", "u2", "u3"]
    assert (table.trials, table.failed_trials) == (5, 1)
    u1 = table.rows[0]
    assert u1["variants"]["a"]["mean"] == pytest.approx(0.55)
    assert u1["tests"][0]["test"] == "welch" and u1["tests"][0]["variant"] == "b"
    overall = table.overall
    assert overall["variants"]["b"]["n"] == 2  # per-trial means of the trials that scored
    test = overall["tests"][0]
    assert test["test"] == "paired" and test["df"] == 2
    diffs = [0.85 - 0.55, 0.85 - 0.45, 0.9 - 0.55]
    d = sum(diffs) / 3
    sd = math.sqrt(sum((x - d) ** 2 for x in diffs) / 2)
    assert test["t"] == pytest.approx(d / (sd / math.sqrt(3)))
    p, name, sentence = runner.verdict(table)
    assert p is not None and p < 0.05 and name == "paired"
    assert sentence.startswith("b scores higher")


def test_trial_spec_replays_and_labels_the_trial(tmp_path: Path) -> None:
    spec = tmp_path / "a.yaml"
    spec.write_text(
        'version: "1.2"\nname: agent-a\nbase: dsec/python311:latest\n'
        "entrypoint: [python, agent.py]\nrecord: {tools: true}\n"
        "runtime_context:\n  env_vars:\n    - {name: MODE, value: fast}\n"
    )
    variant = runner.load_variant("a", spec)
    assert variant.code_dir == tmp_path
    data = yaml.safe_load(runner.trial_spec(variant, "a:2", "rec_" + "1" * 32, dataset=False))
    assert data["replay"] == "rec_" + "1" * 32 and "record" not in data
    assert data["runtime_context"]["env_vars"] == [
        {"name": "MODE", "value": "fast"},
        {"name": "DSEC_TRIAL", "value": "a:2"},
    ]
    with_dataset = yaml.safe_load(runner.trial_spec(variant, "a:0", None, dataset=True))
    assert "replay" not in with_dataset
    assert {"name": "DSEC_EXPERIMENT_INPUTS", "value": "/workspace/dsec_inputs.jsonl"} in (
        with_dataset["runtime_context"]["env_vars"]
    )


def test_variants_and_scorers_are_checked(tmp_path: Path) -> None:
    with pytest.raises(runner.ExperimentError, match=r"use NAME=SPEC\.yaml"):
        runner.parse_variant("spec.yaml")
    with pytest.raises(runner.ExperimentError, match="the name must be"):
        runner.parse_variant("A B=spec.yaml")
    with pytest.raises(runner.ExperimentError, match="cannot read the spec"):
        runner.load_variant("a", tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text('version: "1.2"\nname: x\nbase: python:3.11\nreplay: rec_nope\n')
    with pytest.raises(runner.ExperimentError, match=r"broken\.yaml:4:9: .*not a recording id"):
        runner.load_variant("a", broken)
    bad = tmp_path / "bad.py"
    bad.write_text("def scores(): pass\n")
    with pytest.raises(runner.ExperimentError, match="define `def score"):
        runner.load_scorer(bad)
    good = tmp_path / "good.py"
    good.write_text("def score(input_id, output):\n    return len(output)\n")
    score, digest = runner.load_scorer(good)
    assert runner.score_outputs(score, {"u1": "abc"}) == {"u1": 3.0}
    assert digest == runner.file_hash(good)
    numeric, _ = runner.load_scorer(None)
    with pytest.raises(ValueError, match="no number"):
        runner.score_outputs(numeric, {"u1": "text"})


def test_results_are_read_from_the_agents_output() -> None:
    stdout = (
        "starting\n"
        'DSEC_RESULT {"input": "u1", "output": 0.5}\n'
        "DSEC_RESULT not json\n"
        'DSEC_RESULT {"input": "u2", "output": {"label": "risky"}}\n'
        'DSEC_RESULT {"input": "u1", "output": 0.75}\n'
    )
    assert runner.parse_results(stdout) == {"u1": 0.75, "u2": {"label": "risky"}}


def test_the_repair_spec_replays_holds_and_adds_the_debugging_tools() -> None:
    from dsec_cli.experiments.debug import repair_spec

    spec = (
        'version: "1.2"\nname: risk-agent\nbase: dsec/python311:latest\n'
        "entrypoint: [python, agent.py]\nrecord: {tools: true}\ntimeout: 2m\n"
        "dependencies:\n  - {package: httpx}\n"
    )
    data = yaml.safe_load(repair_spec(spec, "rec_" + "2" * 32, ["ipdb", "httpx"], "30m"))
    assert data["replay"] == "rec_" + "2" * 32 and "record" not in data
    assert data["entrypoint"] == ["python", "-m", "dsec_sdk.debug"]
    assert data["timeout"] == "30m"
    assert data["dependencies"] == [{"package": "httpx"}, {"package": "ipdb"}]
    assert {"name": "DSEC_DEBUG", "value": "1"} in data["runtime_context"]["env_vars"]


def test_the_repair_sandbox_lists_the_failed_calls_first(tmp_path: Path) -> None:
    from dsec_sdk import recording as rec
    from dsec_sdk.debug import describe

    path = tmp_path / "calls.jsonl"
    recorder = rec.Recorder(path)
    recorder.call_sync(rec.tool_key("records", "users", {}), lambda: rec.encode_result(["u1"]))
    recorder.call_sync(
        rec.tool_key("records", "user_logs", {"user": "zz"}),
        lambda: rec.encode_error(["remote", "KeyError", "no user 'zz'", ""]),
        rec.is_error,
    )
    assert describe(path) == [
        "FAILED tool records.user_logs(user='zz')  KeyError: no user 'zz'",
        "ok     tool records.users()",
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--inputs", "rec_x", "--variant", "a=a.yaml"], "at least two --variant"),
        (["--inputs", "rec_x", "--variant", "a=a.yaml", "--variant", "b=b.yaml", "--repeats", "0"],
         "--repeats 0: use 1-1000"),
        (["--inputs", "rec_x", "--variant", "a=a.yaml", "--variant", "a=b.yaml"],
         "names must differ"),
        (["--resume", "exp_0123456789abcdef", "--inputs", "rec_x"], "--resume ID takes"),
    ],
)  # fmt: skip
def test_bad_experiment_flags_exit_2_before_anything_runs(
    args: list[str], message: str, tmp_path: Path
) -> None:
    from dsec_cli.main import app
    from typer.testing import CliRunner

    for name in ("a.yaml", "b.yaml"):
        (tmp_path / name).write_text('version: "1.2"\nname: x\nbase: python:3.11\n')
    fixed = [a if not a.endswith(".yaml") else a.replace("=", f"={tmp_path}/") for a in args]
    result = CliRunner().invoke(app, ["experiment", "run", *fixed])
    assert result.exit_code == 2, result.output
    assert message in " ".join(result.output.split()), result.output
