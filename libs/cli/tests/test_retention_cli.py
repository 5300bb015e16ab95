"""`dsec nats stream` retention flags and `dsec events archive` options: bad input is refused
before anything is contacted (exit 2, the flag named)."""

from __future__ import annotations

import pytest
from dsec_cli.main import app
from typer.testing import CliRunner

pytestmark = pytest.mark.unit

runner = CliRunner()
NOWHERE = {"DSEC_NATS_URL": "nats://127.0.0.1:1", "DSEC_HOME": "/nonexistent-dsec-home"}


def _run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, list(args), env=NOWHERE)
    return result.exit_code, " ".join(result.output.split())


def test_a_limit_needs_the_operators_approval() -> None:
    code, out = _run("nats", "stream", "--max-msgs-per-subject", "1000")
    assert code == 2
    assert "archive them first (`dsec events archive`) and add --approve-discard" in out


def test_bad_age_and_size_are_named() -> None:
    code, out = _run("nats", "stream", "--max-age", "soon", "--approve-discard")
    assert code == 2 and "--max-age 'soon'" in out and "not a duration" in out
    code, out = _run("nats", "stream", "--max-bytes", "lots", "--approve-discard")
    assert code == 2 and "--max-bytes 'lots'" in out and "not a size" in out


def test_no_limits_is_given_alone() -> None:
    code, out = _run("nats", "stream", "--no-limits", "--max-age", "30d", "--approve-discard")
    assert code == 2 and "--no-limits lifts every limit: give it alone" in out


def test_archive_time_must_be_a_time() -> None:
    code, out = _run("events", "archive", "--before", "yesterday")
    assert code == 2 and "'yesterday' is not a time" in out
