"""`dsec admin` / `dsec login` / `dsec whoami`: credentials as an operator and a user meet them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dsec_core import identity
from dsec_testing.helpers import run_dsec_inproc

pytestmark = pytest.mark.unit


def test_a_user_logs_in_with_the_credential_the_operator_issued(tmp_path: Path) -> None:
    operator, user = tmp_path / "operator", tmp_path / "user"
    identity.ensure_root(identity.TrustPaths(operator))
    cred = tmp_path / "alice.cred"
    issued = run_dsec_inproc(
        "admin", "issue-user", "alice", "--tenant", "team-a", "--out", str(cred), home=operator
    )
    assert issued.exit_code == 0, issued.stdout
    assert cred.stat().st_mode & 0o777 == 0o600
    anchor = (operator / "trust" / "root.pub").read_text().strip()
    env = {"DSEC_TRUST_ROOT": anchor}
    login = run_dsec_inproc("login", "--credential", str(cred), "--json", home=user, env=env)
    assert login.exit_code == 0, login.stdout
    me = json.loads(run_dsec_inproc("whoami", "--json", home=user).stdout.strip())
    assert (me["producer"], me["role"], me["tenant"]) == ("user-alice", "user", "team-a")


def test_a_credential_from_another_root_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other"
    identity.ensure_root(identity.TrustPaths(other))
    cred = tmp_path / "x.cred"
    run_dsec_inproc("admin", "issue-user", "eve", "--tenant", "t", "--out", str(cred), home=other)
    ours = identity.ensure_root(identity.TrustPaths(tmp_path / "ours"))
    env = {"DSEC_TRUST_ROOT": bytes(ours.verify_key).hex()}
    login = run_dsec_inproc("login", "--credential", str(cred), home=tmp_path / "u", env=env)
    assert login.exit_code == 2
    assert "not valid for this DSec" in login.stdout + login.stderr


def test_only_the_operator_issues_and_names_are_checked(tmp_path: Path) -> None:
    refused = run_dsec_inproc(
        "admin", "issue-user", "bob", "--tenant", "t", "--out", str(tmp_path / "c"), home=tmp_path
    )
    assert refused.exit_code == 2 and "only the operator" in refused.stdout + refused.stderr
    identity.ensure_root(identity.TrustPaths(tmp_path))
    bad = run_dsec_inproc(
        "admin", "issue-user", "Bob!", "--tenant", "t", "--out", str(tmp_path / "c"), home=tmp_path
    )
    assert bad.exit_code == 2 and "is not valid" in bad.stdout + bad.stderr
    for reserved in ("dsec", "dsec-state", "system"):  # the stack's own secrets' paths
        out = tmp_path / f"c-{reserved}"
        taken = run_dsec_inproc(
            "admin", "issue-user", "bob", "--tenant", reserved, "--out", str(out), home=tmp_path
        )
        assert taken.exit_code == 2 and "is reserved" in taken.stdout + taken.stderr
        assert not out.exists()


def test_issue_services_certifies_every_service_for_a_deployment(tmp_path: Path) -> None:
    out = tmp_path / "deploy"
    result = run_dsec_inproc(
        "admin", "issue-services", str(out), "--node", "worker-3", home=tmp_path / "op"
    )
    assert result.exit_code == 0, result.stdout
    anchor = bytes.fromhex((out / "trust.env").read_text().strip().split("=", 1)[1])
    paths = identity.TrustPaths(out)
    for role in identity.SERVICE_ROLES:
        cert = identity.read_cert(paths.cert(role))
        identity.check(cert, anchor)
        assert cert.role == role and cert.subject == role
        assert cert.node_id == ("worker-3" if role == "nodeagent" else None)
    assert not (out / "trust" / "root.key").exists()  # the root key stays with the operator


def test_a_first_login_learns_the_trust_root_from_the_credential(tmp_path: Path) -> None:
    operator, user = tmp_path / "operator", tmp_path / "user"
    root = identity.ensure_root(identity.TrustPaths(operator))
    cred = tmp_path / "c.cred"
    run_dsec_inproc(
        "admin", "issue-user", "ann", "--tenant", "t", "--out", str(cred), home=operator
    )
    assert run_dsec_inproc("login", "--credential", str(cred), home=user).exit_code == 0
    learned = (user / "trust" / "root.pub").read_text().strip()
    assert learned == bytes(root.verify_key).hex()


def test_admin_commands_answer_in_json(tmp_path: Path) -> None:
    operator = tmp_path / "op"
    identity.ensure_root(identity.TrustPaths(operator))
    cred = tmp_path / "carol.cred"
    issued = run_dsec_inproc(
        "admin", "issue-user", "carol", "--tenant", "t", "--out", str(cred), "--json", home=operator
    )
    assert issued.exit_code == 0, issued.stdout
    user = json.loads(issued.stdout)
    assert (user["path"], user["subject"], user["tenant"]) == (str(cred), "user-carol", "t")
    again = run_dsec_inproc(  # never overwrites a credential: one JSON error, no traceback
        "admin", "issue-user", "carol", "--tenant", "t", "--out", str(cred), "--json", home=operator
    )
    assert again.exit_code == 2
    assert "never overwritten" in json.loads(again.stdout)["error"]["message"]
    out = tmp_path / "deploy"
    services = run_dsec_inproc("admin", "issue-services", str(out), "--json", home=operator)
    assert services.exit_code == 0, services.stdout
    keys = json.loads(services.stdout)["keys"]
    assert set(keys) == set(identity.SERVICE_ROLES)
    assert keys["policy"] == identity.read_cert(identity.TrustPaths(out).cert("policy")).key_id
    service = run_dsec_inproc(
        "admin", "issue-service", "builder", "--home", str(tmp_path / "b"), "--json", home=operator
    )
    assert service.exit_code == 0, service.stdout
    assert json.loads(service.stdout)["role"] == "builder"
