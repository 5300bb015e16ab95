"""``dsec sandbox upgrade``: its argument errors are one clear line and exit 2, before any
connection to the stack (the hand-over itself is exercised by the node agent's tests)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsec_cli.main import app
from typer.testing import CliRunner

pytestmark = pytest.mark.unit

runner = CliRunner()


def _upgrade(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["sandbox", "upgrade", *args])
    return result.exit_code, " ".join(result.output.split())


def test_without_new_code_or_spec_there_is_nothing_to_upgrade_to() -> None:
    code, output = _upgrade("sbx_0123")
    assert code == 2
    assert "nothing to upgrade to: give the new version's --code DIR and/or --spec FILE" in output


def test_code_must_be_a_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    code, output = _upgrade("sbx_0123", "--code", str(missing))
    assert code == 2
    assert f"--code {missing} is not a directory" in output
    assert "Traceback" not in output


def test_an_unreadable_spec_is_named(tmp_path: Path) -> None:
    code, output = _upgrade("sbx_0123", "--code", str(tmp_path), "--spec", str(tmp_path / "x.yaml"))
    assert code == 2
    assert "cannot read spec" in output and "x.yaml" in output


def test_a_sandbox_id_that_cannot_be_one_is_refused(tmp_path: Path) -> None:
    code, output = _upgrade("sbx.1*", "--code", str(tmp_path))
    assert code == 2
    assert "sandbox id" in output


def test_the_sandbox_id_is_required() -> None:
    result = runner.invoke(app, ["sandbox", "upgrade", "--code", "."])
    assert result.exit_code == 2
    assert "Missing argument" in result.output
