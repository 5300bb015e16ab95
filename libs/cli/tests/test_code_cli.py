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


def test_bundle_lists_special_files_it_leaves_out(tmp_path: Path) -> None:
    import os

    src = tmp_path / "src"
    src.mkdir()
    (src / "agent.py").write_text("print('hi')\n")
    os.mkfifo(src / "pipe")
    result = runner.invoke(app, ["code", "bundle", str(src)])
    assert result.exit_code == 0, result.output
    assert "left out 1 special file(s) (not code): pipe (fifo)" in " ".join(result.output.split())
    result = runner.invoke(app, ["code", "bundle", str(src), "--json"])
    doc = json.loads(result.output.strip().splitlines()[-1])
    assert doc["skipped"] == ["pipe (fifo)"]


def test_bundle_over_max_size_names_the_largest_files(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "agent.py").write_text("print('hi')\n")
    with (src / "weights.bin").open("wb") as fh:
        fh.truncate(3 * 2**20)  # sparse: nothing on disk, 3 MiB once extracted
    result = runner.invoke(app, ["code", "bundle", str(src), "--max-size", "2MiB"])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert "3.0 MiB once extracted, over include_code.max_size 2.0 MiB" in text
    assert "largest files: weights.bin (3.0 MiB), agent.py" in text
    assert runner.invoke(app, ["code", "bundle", str(src), "--max-size", "4MiB"]).exit_code == 0
