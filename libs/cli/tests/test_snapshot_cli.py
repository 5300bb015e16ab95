"""``dsec snapshot`` as a user runs it, against real SeaweedFS and OpenBao."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from dsec_cli.main import app
from typer.testing import CliRunner

if TYPE_CHECKING:
    from dsec_testing.stack import S3Info, VaultInfo

pytestmark = pytest.mark.integration

runner = CliRunner()


@pytest.fixture
def env(s3: S3Info, vault: VaultInfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {
        "DSEC_HOME": str(tmp_path / "home"),
        "DSEC_S3_ENDPOINT": s3.endpoint,
        "DSEC_S3_ACCESS_KEY": s3.access_key,
        "DSEC_S3_SECRET_KEY": s3.secret_key,
        "DSEC_S3_BUCKET": s3.bucket,
        "DSEC_VAULT_ADDR": vault.addr,
        "DSEC_VAULT_TOKEN": vault.token,
    }.items():
        monkeypatch.setenv(key, value)


def flat(text: str) -> str:
    return " ".join(text.split())


def test_create_change_check_code_and_rollback(env: None, tmp_path: Path) -> None:
    code = tmp_path / "code"
    code.mkdir()
    (code / "agent.py").write_text("THRESHOLD = 0.92\n")
    name = f"good-{uuid.uuid4().hex[:8]}"
    created = runner.invoke(app, ["snapshot", "create", "--dir", str(code), "--name", name,
                                  "--json"])  # fmt: skip
    assert created.exit_code == 0, created.output
    assert json.loads(created.output)["files"] == 1

    (code / "agent.py").write_text("THRESHOLD = 0.87\n")
    check = runner.invoke(app, ["snapshot", "check-code", name, str(code)])
    assert check.exit_code == 1
    assert "changed: agent.py" in check.output
    assert "-THRESHOLD = 0.92" in check.output and "+THRESHOLD = 0.87" in check.output

    back = runner.invoke(app, ["snapshot", "restore", name, str(code), "--sync"])
    assert back.exit_code == 0, back.output
    assert (code / "agent.py").read_text() == "THRESHOLD = 0.92\n"
    assert runner.invoke(app, ["snapshot", "verify", name]).exit_code == 0


def test_verify_of_unknown_snapshot_is_bad_input(env: None) -> None:
    result = runner.invoke(app, ["snapshot", "verify", "no-such-snapshot"])
    assert result.exit_code == 2
    assert "no snapshot named 'no-such-snapshot'" in flat(result.output)


def test_unreachable_store_exits_3(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_HOME", str(tmp_path))
    monkeypatch.setenv("DSEC_S3_ENDPOINT", "127.0.0.1:9")
    result = runner.invoke(app, ["snapshot", "ls"])
    assert result.exit_code == 3
    assert "S3 at 127.0.0.1:9" in flat(result.output)
