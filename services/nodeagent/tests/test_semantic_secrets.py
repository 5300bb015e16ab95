"""What the semantic layer reports reaches the bus every user reads: a command line or URL there
carries no secret.

Before (found by an adversarial review, 2026-12-07): a subprocess rule's report published the
whole command line, so ``git clone https://x-access-token:TOKEN@github.com/...`` or ``psql
postgresql://app:PASSWORD@db/prod`` put the token, often the sandbox's own secret injected from
Vault, in ``policy.reported.target`` and ``.message`` for every tenant to read."""

from __future__ import annotations

import importlib.util
import json
import socket
from pathlib import Path

import pytest
from dsec_core import events
from dsec_core.text import bound

from dsec_nodeagent.semantic import compile_rules
from dsec_nodeagent.semantic.models import SemanticDecision, SemanticRules
from dsec_nodeagent.semantic.reports import TARGET_LIMIT, check_report, scrub

pytestmark = pytest.mark.unit

RUNTIME = (
    Path(__import__("dsec_nodeagent.semantic", fromlist=["x"]).__file__).parent
    / "sandbox_site"
    / "dsec_semantic_runtime.py"
)
TOKEN = "ghp_SECRETfromVault0123456789"


def test_a_secret_on_a_reported_command_line_never_reaches_the_bus(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("dsec_semantic_runtime_under_test", RUNTIME)
    assert spec is not None and spec.loader is not None
    runtime = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(runtime)
    log_git = {"name": "log-git", "on": "subprocess", "match": {"argv": ["git", "*"]}}
    deny_psql = {"name": "deny-psql", "on": "subprocess", "match": {"argv": ["psql", "*"]}}
    compiled = compile_rules(
        {"rules": [{**log_git, "action": "log"}, {**deny_psql, "action": "deny"}]}
    )
    sock_path = str(tmp_path / "events.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as rx:
        rx.bind(sock_path)
        engine = runtime.Engine(compiled, sock_path)
        # what the audit hook reports for subprocess.Popen(argv) in the sandbox
        clone = ["git", "clone", f"https://x-access-token:{TOKEN}@github.com/beta/private.git"]
        engine.decide("subprocess", " ".join(clone), {"argv": clone})
        psql = ["psql", "postgresql://app:hunter2@db.internal/prod", "-c", "select 1"]
        with pytest.raises(PermissionError):
            engine.decide("subprocess", " ".join(psql), {"argv": psql})
        bearer = ["git", "-c", f"http.extraHeader=Authorization: Bearer {TOKEN}", "fetch"]
        engine.decide("subprocess", " ".join(bearer), {"argv": bearer})
        payloads = [json.loads(rx.recv(65536)) for _ in range(3)]
    rules = SemanticRules.model_validate(compiled)
    secrets = (("GH_TOKEN", TOKEN),)
    published = [
        check_report(rules, SemanticDecision(sandbox_id="sbx_beta", **p), secrets) for p in payloads
    ]
    assert all(isinstance(p, events.PolicyReported) for p in published), published
    for report in published:
        assert isinstance(report, events.PolicyReported)
        for text in (report.target, report.message):
            assert TOKEN not in text and "hunter2" not in text, text
            assert TOKEN[:8] not in text, text
    clone_report, psql_report, bearer_report = published
    assert isinstance(clone_report, events.PolicyReported)
    assert clone_report.target == "git clone https://[userinfo]@github.com/beta/private.git"
    assert isinstance(psql_report, events.PolicyReported)
    assert psql_report.target.startswith("psql postgresql://[userinfo]@db.internal/prod")
    assert isinstance(bearer_report, events.PolicyReported)
    assert "Bearer [secret GH_TOKEN] fetch" in bearer_report.target


def test_a_secret_cut_by_a_bound_loses_its_start_too() -> None:
    """A command line longer than the target's bound may end inside a secret: what is left of
    it is replaced as well."""
    text = "tool --key " + TOKEN[:12]
    assert scrub(text, (("API_KEY", TOKEN),)) == "tool --key [secret API_KEY]"
    assert scrub("x" * (TARGET_LIMIT - 3) + TOKEN, (("K", TOKEN),)).endswith("[secret K]")
    # a URL's password is gone whether or not DSec injected it; other text is kept
    assert scrub("curl ftp://me:pw@h/f?q=1 -v") == "curl ftp://[userinfo]@h/f?q=1 -v"
    assert scrub("echo user@example.com") == "echo user@example.com"


def test_encoded_secrets_and_restored_sandboxes_publish_none_and_scrubbing_stays_cheap() -> None:
    """A secret travels percent-encoded (``?access_token=``) or in base64 (an ``Authorization``
    header, git's ``http.extraheader``): those forms are replaced too. A sandbox restored here
    by a migration brought its secret values in its processes, which this node agent never held:
    its reports keep the program or host only."""
    import base64
    import urllib.parse

    from dsec_nodeagent.semantic.reports import WITHHELD

    token = "p@ss/word+1=="
    secrets = (("TOKEN", token),)
    quoted = urllib.parse.quote(token, safe="")
    b64 = base64.b64encode(token.encode()).decode()
    for text in (
        f"curl https://api.example.com/v1?access_token={quoted}",
        f"git -c http.extraheader='Authorization: Basic {b64}' fetch",
        f"git -c http.extraheader='Authorization: Basic {b64.rstrip('=')}' fetch",
    ):
        scrubbed = scrub(text, secrets)
        assert token not in scrubbed and quoted not in scrubbed, scrubbed
        assert b64.rstrip("=") not in scrubbed and "[secret TOKEN]" in scrubbed, scrubbed
    assert scrub("psql postgresql://db/prod -c 'select 1'", WITHHELD) == (
        "psql [arguments withheld: the sandbox's secrets are not known here]"
    )
    assert scrub("https://api.example.com/v1/tok123/items", WITHHELD) == (
        "https://api.example.com [the rest withheld: its secrets are not known here]"
    )
    # texts that made the URL pattern backtrack, and secrets long enough to try every length
    # of a cut (7 ms a report before, on the event loop; `python bench/...` not needed: the
    # work is now linear): still scrubbed right
    long = (("A", "a" * 3000), ("B", "tok_" + "x9" * 20))
    assert scrub("a" * 2048, long) == "[secret A]"
    assert scrub("y" * 200 + " tok_x9x9x9", long) == "y" * 200 + " [secret B]"
    assert "tok_" not in bound(scrub("y" * 2048 + " tok_x9x9x9", long), TARGET_LIMIT)
    assert scrub("ab://" + "c" * 2043, long) == "ab://" + "c" * 2043
