"""The alert rules in deploy/prometheus: valid for Prometheus, each documented for the person it
wakes, and each shown by `promtool test rules` to fire on the series that should fire it and to
stay silent on those that should not."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

PROMETHEUS_DIR = Path(__file__).parents[1] / "deploy" / "prometheus"
RULES = PROMETHEUS_DIR / "alerts.yml"
RULE_TESTS = sorted((PROMETHEUS_DIR / "tests").glob("*.yml"))


def _alerts() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian: apt-get install prometheus)")
    return promtool


def test_every_alert_is_documented_for_the_one_it_wakes() -> None:
    alerts = _alerts()
    names = [a["alert"] for a in alerts]
    assert len(names) == len(set(names)), names
    for name in (
        "DSecRequestStuck",
        "DSecViolationSpike",
        "DSecConsumerLag",
        "DSecNodeLost",
        "DSecKeyProblem",
    ):
        assert name in names
    for alert in alerts:
        annotations = alert.get("annotations", {})
        for key in ("summary", "description", "runbook"):
            assert annotations.get(key, "").strip(), f"{alert['alert']}: no {key}"
        assert alert.get("labels", {}).get("severity") in {"warning", "critical"}, alert["alert"]


def test_promtool_accepts_the_rules() -> None:
    result = subprocess.run(
        [_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in result.stdout


def test_every_alert_is_tested_firing_and_silent() -> None:
    """Each alert has a case where it fires and one where it does not (an alert nobody saw
    fire in a test may never fire)."""
    fired: set[str] = set()
    silent: set[str] = set()
    for path in RULE_TESTS:
        doc = yaml.safe_load(path.read_text())
        assert doc["rule_files"] == ["../alerts.yml"], path
        for case in doc["tests"]:
            for check in case.get("alert_rule_test", []):
                (fired if check["exp_alerts"] else silent).add(check["alertname"])
    names = {a["alert"] for a in _alerts()}
    assert names - fired == set(), "never shown firing"
    assert names - silent == set(), "never shown silent"


def test_promtool_unit_tests_of_the_rules_pass() -> None:
    assert RULE_TESTS, "no rule tests in deploy/prometheus/tests"
    result = subprocess.run(
        [_promtool(), "test", "rules", *(p.name for p in RULE_TESTS)],
        cwd=RULE_TESTS[0].parent,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "FAILED" not in result.stdout + result.stderr
