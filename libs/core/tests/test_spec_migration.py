"""The spec's `migration:` section: which health signals move a unit, how, how long it may
pause, and its own (stricter) thresholds; located errors, and the compiled plan."""

from __future__ import annotations

import pytest
from dsec_core.spec import MigrationPlan, compile_plan, load_spec

pytestmark = pytest.mark.unit

HEAD = 'version: "1.2"\nname: m\nbase: dsec/python311:latest\nentrypoint: [python, x.py]\n'


def test_signals_paths_and_thresholds_compile() -> None:
    result = load_spec(
        HEAD + "migration:\n  on: [temperature, xid]\n  paths: [handover, restart]\n"
        "  max_interruption_ms: 12\n  nvlink_congestion_threshold: 80%\n"
        "  thresholds: {temperature_c: 80, xid_errors: 2}\n",
        "m.yaml",
    )
    assert result.spec is not None, [e.format() for e in result.errors]
    plan = compile_plan(result.spec).topology
    assert plan.migration == MigrationPlan(
        max_temperature_c=80, nvlink_congestion_threshold_pct=80, on=("temperature", "xid"),
        paths=("handover", "restart"), max_interruption_ms=12,
        thresholds={"temperature_c": 80, "xid_errors": 2, "nvlink_utilization_pct": 80},
    )  # fmt: skip
    assert plan.units[0].max_temperature_c == 80  # the placement limit of unit main too


def test_by_default_hardware_faults_move_the_unit_and_an_empty_on_none() -> None:
    plain = load_spec(HEAD, "m.yaml").spec
    limited = load_spec(HEAD + "migration: {max_temperature_c: 85}\n", "m.yaml").spec
    never = load_spec(HEAD + "migration: {on: []}\n", "m.yaml").spec
    assert plain is not None and limited is not None and never is not None
    faults = ("temperature", "xid", "ecc", "lost")
    assert compile_plan(plain).topology.migration.on == faults
    limited_plan = compile_plan(limited).topology.migration
    assert (limited_plan.on, limited_plan.paths) == (faults, ("handover", "criu"))
    assert limited_plan.thresholds == {"temperature_c": 85}
    assert compile_plan(never).topology.migration.on == ()


@pytest.mark.parametrize(
    ("section", "where", "message"),
    [
        ("on: [xid, xid]", "m.yaml:6:13: error[invalid-value]: migration.on[1]", "'xid' is listed twice"),  # noqa: E501
        ("paths: [warp]", "migration.paths[0]", "'warp' is not allowed"),
        ("paths: []", "migration.paths", "should have at least 1 item"),
        ("max_interruption_ms: 0", "migration.max_interruption_ms", "greater than 0"),
        ("thresholds: {ecc_uncorrected: 0}", "migration.thresholds.ecc_uncorrected", "greater than or equal to 1"),  # noqa: E501
        ("thresholds: {hot: 1}", "migration.thresholds.hot", "unknown field 'hot'"),
        ("{max_temperature_c: 85, thresholds: {temperature_c: 80}}",
         "migration.thresholds.temperature_c", "two temperature limits"),
    ],
)  # fmt: skip
def test_errors_are_located(section: str, where: str, message: str) -> None:
    text = HEAD + (
        f"migration: {section}\n" if section.startswith("{") else f"migration:\n  {section}\n"
    )
    result = load_spec(text, "m.yaml")
    assert result.spec is None
    formatted = [e.format() for e in result.errors]
    assert any(where in f and message in f for f in formatted), formatted
