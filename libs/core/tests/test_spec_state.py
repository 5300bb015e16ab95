"""The spec's ``state:`` section: validated with located errors (line, field, what is valid) and
compiled to the plan's ``StatePlan``; a spec without it has no state plane."""

from __future__ import annotations

import json

import pytest
from dsec_core.events import SpecValidated, decode_payload
from dsec_core.spec import EnforcementPlan, SpecError, StatePlan, compile_plan, load_spec

pytestmark = pytest.mark.unit

HEAD = 'version: "1.2"\nname: agent\nbase: dsec/python311:latest\nentrypoint: python a.py\n'


def plan_of(body: str) -> EnforcementPlan:
    result = load_spec(HEAD + body, "dsec.yaml")
    assert result.ok and result.spec is not None, [e.format() for e in result.errors]
    return compile_plan(result.spec, source=result.source)


def errors_of(body: str) -> list[SpecError]:
    result = load_spec(HEAD + body, "dsec.yaml")
    assert result.spec is None and result.errors, "expected the spec to be rejected"
    return list(result.errors)


def error_at(body: str, path: str) -> SpecError:
    errors = errors_of(body)
    found = [e for e in errors if e.path == path]
    assert found, [e.format() for e in errors]
    return found[0]


def test_a_spec_without_state_has_no_state_plane() -> None:
    assert plan_of("").state is None


def test_an_empty_state_section_takes_the_documented_defaults() -> None:
    assert plan_of("state: {}\n").state == StatePlan(
        checkpoint_interval_s=5.0,
        warm_interval_s=300.0,
        cold_interval_s=3600.0,
        tiers=(),
        warm_snapshots_kept=3,
        hot_retention_s=7 * 86400.0,
        encryption="tenant-key",
        restart="on-failure",
        max_restarts=5,
    )


def test_every_field_compiles_into_the_plan() -> None:
    state = plan_of(
        "state:\n"
        "  checkpoint_interval: 500ms\n"
        "  warm_interval: 1m\n"
        "  cold_interval: 2h\n"
        "  tiers: {history: hot, adapter: warm, base.weights: cold}\n"
        "  retention: {warm_snapshots: 2, hot: 1d}\n"
        "  encryption: tenant-key\n"
        "  restart: never\n"
        "  max_restarts: 0\n"
    ).state
    assert state == StatePlan(
        checkpoint_interval_s=0.5,
        warm_interval_s=60.0,
        cold_interval_s=7200.0,
        tiers=(("adapter", "warm"), ("base.weights", "cold"), ("history", "hot")),
        warm_snapshots_kept=2,
        hot_retention_s=86400.0,
        encryption="tenant-key",
        restart="never",
        max_restarts=0,
    )


@pytest.mark.parametrize("off", ["0", "off", '"0"', "OFF"])
def test_checkpoint_interval_0_or_off_means_explicit_checkpoints_only(off: str) -> None:
    state = plan_of(f"state:\n  checkpoint_interval: {off}\n  warm_interval: 1s\n").state
    assert state is not None and state.checkpoint_interval_s is None
    assert state.warm_interval_s == 1.0


def test_the_plan_with_state_travels_in_spec_validated() -> None:
    plan = plan_of("state:\n  checkpoint_interval: 2s\n  tiers: {history: warm}\n")
    event = SpecValidated(name="agent", spec_digest="d", plan=plan)
    wire = json.loads(event.model_dump_json())
    assert wire["plan"]["state"]["checkpoint_interval_s"] == 2.0
    back = decode_payload("spec.validated", "1.2", wire)
    assert isinstance(back, SpecValidated) and back.plan.state == plan.state


@pytest.mark.parametrize(
    ("body", "path", "line", "message", "hint"),
    [
        (
            "state:\n  checkpoint_interval: 50ms\n",
            "state.checkpoint_interval",
            6,
            "50ms is shorter than the shortest interval, 100ms",
            "0 / off for explicit checkpoints only",
        ),
        (
            "state:\n  checkpoint_interval: soon\n",
            "state.checkpoint_interval",
            6,
            "'soon' is not a duration",
            "at least 100ms",
        ),
        (
            "state:\n  warm_interval: 1s\n  checkpoint_interval: 10s\n",
            "state.warm_interval",
            6,
            "warm_interval 1s is shorter than checkpoint_interval 10s",
            "at least checkpoint_interval",
        ),
        (
            "state:\n  checkpoint_interval: 10m\n",
            "state.checkpoint_interval",
            6,
            "warm_interval 5m is shorter than checkpoint_interval 10m",
            "at least checkpoint_interval",
        ),
        (
            "state:\n  cold_interval: 10ms\n",
            "state.cold_interval",
            6,
            "10ms is shorter than the shortest interval, 100ms",
            "at least 100ms",
        ),
        (
            "state:\n  encryption: aes-256\n",
            "state.encryption",
            6,
            "'aes-256' is not a supported encryption",
            "tenant-key (the only value now",
        ),
        (
            "state:\n  tiers: {history: lukewarm}\n",
            "state.tiers.history",
            6,
            "'lukewarm' is not allowed",
            "'hot', 'warm' or 'cold'",
        ),
        (
            "state:\n  tiers:\n    history: hot\n    9lives: warm\n",
            "state.tiers.9lives",
            8,
            "'9lives' is not a container name",
            "a letter, then letters, digits",
        ),
        (
            "state:\n  tiers: [history]\n",
            "state.tiers",
            6,
            "expected a mapping of container name to tier, got a list",
            "tiers: {history: hot",
        ),
        (
            "state:\n  retention: {hot: 1m}\n",
            "state.retention.hot",
            6,
            "retention.hot 1m is shorter than warm_interval 5m",
            "at least 5m",
        ),
        (
            "state:\n  retention: {warm_snapshots: 0}\n",
            "state.retention.warm_snapshots",
            6,
            "greater than or equal to 1",
            None,
        ),
        (
            "state:\n  restart: always\n",
            "state.restart",
            6,
            "'always' is not allowed",
            "'on-failure' or 'never'",
        ),
        (
            "state:\n  max_restarts: 1000\n",
            "state.max_restarts",
            6,
            "less than or equal to 100",
            None,
        ),
        (
            "state:\n  checkpoint: 5s\n",
            "state.checkpoint",
            6,
            "unknown field 'checkpoint'",
            "did you mean 'checkpoint_interval'?",
        ),
        ("state: yes\n", "state", 5, "expected a mapping, got a string", "checkpoint_interval"),
    ],
)
def test_bad_state_values_are_located_and_say_what_is_valid(
    body: str, path: str, line: int, message: str, hint: str | None
) -> None:
    error = error_at(body, path)
    assert error.line == line and error.file == "dsec.yaml"
    assert message in error.message
    if hint is not None:
        assert error.hint is not None and hint in error.hint


def test_every_bad_state_field_is_reported_at_once() -> None:
    errors = errors_of(
        "state:\n  restart: always\n  encryption: none\n  max_restarts: -1\n  warm_interval: 1x\n"
    )
    assert {e.path for e in errors} == {
        "state.restart",
        "state.encryption",
        "state.max_restarts",
        "state.warm_interval",
    }


def test_tier_overrides_are_bounded_before_each_is_read() -> None:
    many = ", ".join(f"c{i}: hot" for i in range(1001))
    error = error_at(f"state:\n  tiers: {{{many}}}\n", "state.tiers")
    assert "1001 tier overrides; at most 1000" in error.message
    assert (
        len(
            plan_of(
                "state:\n  tiers: {" + ", ".join(f"c{i}: hot" for i in range(1000)) + "}\n"
            ).state.tiers
        )
        == 1000
    )  # type: ignore[union-attr]


def test_a_container_name_is_at_most_63_characters() -> None:
    assert plan_of(f"state:\n  tiers: {{{'a' * 63}: cold}}\n").state is not None
    error = error_at(f"state:\n  tiers: {{{'a' * 64}: cold}}\n", f"state.tiers.{'a' * 64}")
    assert "is not a container name" in error.message


def test_the_state_limit_compiles_and_is_bounded() -> None:
    plan = plan_of("state:\n  max_size: 2GiB\n")
    assert plan.state is not None and plan.state.max_bytes == 2 << 30
    assert plan_of("state: {}\n").state.max_bytes == 1 << 30  # type: ignore[union-attr]
    error = error_at("state:\n  max_size: 10KiB\n", "state.max_size")
    assert error.line == 6 and "1MiB-1TiB" in error.format()
