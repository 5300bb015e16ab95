"""The ``dsec spec check`` and ``dsec policy infer`` commands, as a user runs them."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from dsec_cli.main import app
from typer.testing import CliRunner

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
BAD = REPO / "examples/bad-spec/dsec.yaml"
GOOD = REPO / "examples/websearch-agent/dsec.yaml"
CODE = REPO / "examples/websearch-agent"
LOCATED = re.compile(r"^(?P<file>\S+):(?P<line>\d+):(?P<col>\d+): error\[[\w.-]+\]: ", re.M)


@pytest.fixture
def runner(monkeypatch: pytest.MonkeyPatch) -> CliRunner:
    monkeypatch.delenv("DSEC_ORG_POLICY", raising=False)
    return CliRunner()


def test_bad_spec_prints_six_located_errors_and_exits_2(runner: CliRunner) -> None:
    result = runner.invoke(app, ["spec", "check", str(BAD)])
    assert result.exit_code == 2
    found = LOCATED.findall(result.stdout)
    assert [(int(line), int(col)) for _, line, col in found] == [
        (4, 7),
        (10, 14),
        (15, 11),
        (21, 7),
        (26, 9),
        (29, 21),
    ]
    assert all(file == str(BAD) for file, _, _ in found)
    assert "did you mean 'ttl'?" in result.stdout
    assert "invalid (6 errors, 0 warnings)" in result.stdout


def test_good_spec_with_its_code_exits_0(runner: CliRunner) -> None:
    result = runner.invoke(app, ["spec", "check", str(GOOD), "--code", str(CODE)])
    assert result.exit_code == 0, result.stdout
    assert "valid (0 errors, 0 warnings)" in result.stdout


def test_json_report_carries_errors_and_plan(runner: CliRunner) -> None:
    bad = runner.invoke(app, ["spec", "check", str(BAD), "--json"])
    report = json.loads(bad.stdout)
    assert bad.exit_code == 2 and report["valid"] is False and report["plan"] is None
    assert {e["rule_id"] for e in report["errors"]} >= {"unknown-field", "invalid-value"}
    assert all({"file", "line", "column", "path", "message"} <= e.keys() for e in report["errors"])
    good = runner.invoke(app, ["spec", "check", str(GOOD), "--json"])
    plan = json.loads(good.stdout)["plan"]
    assert plan["egress"][0]["domain"] == "api.websearch.test"
    assert plan["secrets"][0] == {
        "env_var": "WEB_SEARCH_KEY",
        "vault_mount": "secret",
        "vault_path": "default/agent-tools/websearch",
        "key": "key",
        "ttl_s": 7200,
    }


def test_warnings_do_not_fail_the_check(runner: CliRunner, tmp_path: Path) -> None:
    spec = tmp_path / "dsec.yaml"
    spec.write_text(
        GOOD.read_text().replace(
            "write_allowed: [/workspace/output]", "write_allowed: [/workspace/output, /tmp]"
        )
    )
    result = runner.invoke(app, ["spec", "check", str(spec), "--code", str(CODE)])
    assert result.exit_code == 0
    assert re.search(r":\d+:\d+: warning\[infer.path-unused\]: .*?/tmp", result.stdout)


def test_missing_grant_warns_with_the_yaml_to_add(runner: CliRunner, tmp_path: Path) -> None:
    spec = tmp_path / "dsec.yaml"
    spec.write_text(GOOD.read_text().replace("api.websearch.test", "api.elsewhere.test"))
    result = runner.invoke(app, ["spec", "check", str(spec), "--code", str(CODE)])
    assert result.exit_code == 0, result.stdout
    assert "warning[infer.egress-missing]" in result.stdout
    assert "would be denied at run time" in result.stdout
    assert "- domain: api.websearch.test" in result.stdout


def test_org_policy_can_make_a_missing_grant_an_error(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    org = tmp_path / "org.yaml"
    org.write_text('version: "1"\nseverities: {infer.egress-missing: error}\n')
    monkeypatch.setenv("DSEC_ORG_POLICY", str(org))
    spec = tmp_path / "dsec.yaml"
    spec.write_text(GOOD.read_text().replace("api.websearch.test", "api.elsewhere.test"))
    result = runner.invoke(app, ["spec", "check", str(spec), "--code", str(CODE)])
    assert result.exit_code == 2
    assert "error[infer.egress-missing]" in result.stdout


def test_org_policy_file_from_settings(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    org = tmp_path / "org.yaml"
    org.write_text('version: "1"\nrules:\n  - {id: ACME-RES-001, kind: max-memory, max: 256MiB}\n')
    monkeypatch.setenv("DSEC_ORG_POLICY", str(org))
    result = runner.invoke(app, ["spec", "check", str(GOOD)])
    assert result.exit_code == 2
    assert "error[ACME-RES-001]: resources.memory: [ACME-RES-001] memory 512MiB" in result.stdout


def test_invalid_org_policy_is_bad_input(runner: CliRunner, tmp_path: Path) -> None:
    org = tmp_path / "org.yaml"
    org.write_text('version: "1"\nrules: [{id: X-1, kind: max-memroy, max: 1GiB}]\n')
    result = runner.invoke(app, ["spec", "check", str(GOOD), "--org-policy", str(org)])
    assert result.exit_code == 2
    assert f"{org}:2:" in result.stderr


def test_unreadable_inputs_exit_2(runner: CliRunner, tmp_path: Path) -> None:
    missing = runner.invoke(app, ["spec", "check", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "cannot read" in missing.stderr
    no_code = runner.invoke(app, ["spec", "check", str(GOOD), "--code", str(tmp_path / "x")])
    assert no_code.exit_code == 2 and "not a directory" in no_code.stderr
    infer = runner.invoke(app, ["policy", "infer", "--code", str(tmp_path / "x")])
    assert infer.exit_code == 2 and "not a directory" in infer.stderr


def test_policy_infer_prints_a_pasteable_block(runner: CliRunner) -> None:
    result = runner.invoke(app, ["policy", "infer", "--code", str(CODE)])
    assert result.exit_code == 0
    assert "      - domain: api.websearch.test" in result.stdout
    assert "    - name: WEB_SEARCH_KEY" in result.stdout
    assert result.stdout.index("runtime_context:") < result.stdout.index("security_policy:")


def test_policy_infer_json_and_tools(runner: CliRunner) -> None:
    result = runner.invoke(app, ["policy", "infer", "--code", str(CODE), "--json"])
    needs = json.loads(result.stdout)
    assert [e["host"] for e in needs["egress"]] == ["api.websearch.test"]
    tools = runner.invoke(app, ["policy", "tools", "--json"])
    assert len(json.loads(tools.stdout)) >= 40


def test_spec_check_on_an_alias_bomb_ends_quickly_with_exit_2(
    runner: CliRunner, tmp_path: Path
) -> None:
    lines = ['version: "1.2"', "name: bomb", "base: dsec/python311:latest", 'a0: &a0 ["lol","lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    spec = tmp_path / "bomb.yaml"
    spec.write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    result = runner.invoke(app, ["spec", "check", str(spec)])
    assert time.monotonic() - started < 5.0
    assert result.exit_code == 2, result.stdout
    assert f"{spec}:5:5: error[yaml-limit]: a4[0][0][8]" in result.stdout
    assert "error[yaml-limit]" in result.stdout and "alias expansions limit" in result.stdout


def test_cross_tenant_example_is_refused_line_by_line_with_the_stacks_endpoints(
    runner: CliRunner, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "stack.json").write_text('{"nats_url": "nats://127.0.0.1:4222"}')
    monkeypatch.setenv("DSEC_HOME", str(tmp_path))
    spec = REPO / "examples/cross-tenant/dsec.yaml"
    result = runner.invoke(app, ["spec", "check", str(spec)])
    assert result.exit_code == 2, result.stdout
    found = re.findall(r":(\d+):\d+: error\[([\w.-]+)\]", result.stdout)
    assert [(int(line), rule) for line, rule in found] == [
        (9, "tenant.vault"),
        (11, "system.bucket"),
        (12, "tenant.s3"),
        (16, "ORG-NET-001"),
        (18, "system.egress"),
        (20, "ORG-FS-002"),
    ]
    assert "NATS (127.0.0.1:4222)" in result.stdout
    other = runner.invoke(app, ["spec", "check", str(spec), "--tenant", "acme"])
    assert "error[tenant.vault]" not in other.stdout


def test_the_task_topology_example_checks_valid_with_its_three_units(runner: CliRunner) -> None:
    example = REPO / "examples/rag-training/dsec.yaml"
    result = runner.invoke(app, ["spec", "check", str(example)])
    assert result.exit_code == 0, result.stdout
    assert "valid (0 errors, 3 warnings)" in result.stdout  # no version, no name: defaulted
    report = json.loads(runner.invoke(app, ["spec", "check", str(example), "--json"]).stdout)
    units = report["plan"]["topology"]["units"]
    assert [(u["name"], u["gpu_models"], u["gpus"]) for u in units] == [
        ("embedding-gen", ["A100-80GB"], 1),
        ("llm-inference", ["H100"], 3),
        ("vector-search", ["MI300X"], 1),
    ]
    assert len(report["plan"]["topology"]["edges"]) == 2


def test_a_topology_error_is_printed_at_its_line(runner: CliRunner, tmp_path: Path) -> None:
    spec = tmp_path / "dsec.yaml"
    spec.write_text(
        "tasks:\n  - name: a\n    compute_unit: {gpu_type: h100, gpus: 2, fp16_throughput: "
        "2000 TFLOPS}\ncommunication:\n  - {from: a, to: b, protocol: shm}\n"
    )
    result = runner.invoke(app, ["spec", "check", str(spec)])
    assert result.exit_code == 2
    assert f"{spec}:3:42: error[invalid-value]: tasks[0].compute_unit.gpus:" in result.stdout
    assert f"{spec}:5:19: error[invalid-value]: communication[0].to: 'b' is not a task" in (
        result.stdout
    )
