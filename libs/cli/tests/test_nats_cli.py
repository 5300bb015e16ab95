"""``dsec nats permissions`` and ``dsec nats credentials`` as a user runs them."""

from __future__ import annotations

import json
from pathlib import Path

import nkeys
import pytest
from dsec_cli.main import app
from typer.testing import CliRunner

pytestmark = pytest.mark.unit

runner = CliRunner()


def test_permissions_of_one_role() -> None:
    result = runner.invoke(app, ["nats", "permissions", "user", "--json"])
    assert result.exit_code == 0, result.output
    perms = json.loads(result.output)["user"]
    assert "dsec.sandbox.*.spec.submitted" in perms["publish"]["allow"]
    assert "$JS.API.STREAM.UPDATE.>" in perms["publish"]["deny"]


def test_unknown_role_is_bad_input() -> None:
    result = runner.invoke(app, ["nats", "permissions", "root"])
    assert result.exit_code == 2
    assert "unknown NATS role 'root'; valid: operator, policy" in " ".join(result.output.split())


def test_credentials_are_private_and_kept(tmp_path: Path) -> None:
    out = tmp_path / "creds"
    first = runner.invoke(app, ["nats", "credentials", str(out), "--json"])
    assert first.exit_code == 0, first.output
    keys = json.loads(first.output)["identities"]
    services = {"policy", "builder", "snapshot", "scheduler", "nodeagent"}
    assert set(keys) == {*services, "fleetsim", "user-default"}
    seed = (out / "policy.nk").read_bytes().strip()
    assert nkeys.from_seed(bytearray(seed)).public_key.decode() == keys["policy"]
    assert out.stat().st_mode & 0o777 == 0o700
    assert all(f.stat().st_mode & 0o777 == 0o600 for f in out.iterdir())
    env = (out / "nats-server.env").read_text()
    assert f"DSEC_NKEY_POLICY={keys['policy']}" in env
    assert "DSEC_NATS_OPERATOR_BCRYPT='$2a$" in env
    assert (out / "operator.password").read_text().strip() not in env  # only its hash
    again = runner.invoke(app, ["nats", "credentials", str(out), "--tenant", "acme", "--json"])
    keys2 = json.loads(again.output)["identities"]
    assert keys2["policy"] == keys["policy"] and {"user-acme", "user-default"} <= set(keys2)
    conf = (out / "nats-server.conf").read_text()
    assert "$DSEC_NKEY_USER_ACME" in conf and "$DSEC_NKEY_USER_DEFAULT" in conf
    assert "$DSEC_NKEY_FLEETSIM" in conf and f"DSEC_NKEY_FLEETSIM={keys['fleetsim']}" in env
