"""``dsec code bundle`` as a user runs it."""

from __future__ import annotations

import json
from pathlib import Path

import blake3
import pytest
from dsec_cli.main import app
from typer.testing import CliRunner

pytestmark = pytest.mark.unit

runner = CliRunner()


def test_bundle_json_and_archive_file(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "agent.py").write_text("print('hi')\n")
    (src / "secret.env").write_text("TOKEN=1\n")
    out = tmp_path / "b.tar.zst"
    result = runner.invoke(
        app, ["code", "bundle", str(src), "--exclude", "*.env", "--out", str(out), "--json"]
    )
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    assert [f["path"] for f in doc["manifest"]["files"]] == ["pkg/agent.py"]
    assert doc["digest"] == blake3.blake3(out.read_bytes()).hexdigest()


def test_bundle_of_missing_directory_is_bad_input(tmp_path: Path) -> None:
    result = runner.invoke(app, ["code", "bundle", str(tmp_path / "nope")])
    assert result.exit_code == 2
    assert "nope: not a directory" in " ".join(result.output.split())
