"""Compiling a spec into the enforcement plan the other services act on."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsec_core.spec import EnforcementPlan, compile_plan, load_spec

pytestmark = pytest.mark.unit

FIXTURES = Path(__file__).parent / "spec_fixtures"

SPEC = """
version: "1.2"
name: plan-test
base: dsec/python311:latest
entrypoint: python agent.py --fast
dependencies:
  - {package: Rich, version: ">=13", extras: [jupyter]}
resources: {cpu: 500m, memory: 1GiB, pids: 64, gpu: {count: 2, memory: 40GB, type: a100}}
timeout: 1h30m
runtime_context:
  env_vars:
    - {name: SEARCH_KEY, source: "vault://secret/tools/search#api-key", ttl: 2h}
    - {name: MODE, value: fast}
  mounts:
    - {path: /data, source: "s3://bucket/set/v1", mode: ro-encrypted, cache_ttl: 5m}
    - {path: /scratch, source: "s3://bucket/scratch/", mode: rw}
security_policy:
  network:
    egress:
      - {domain: API.Example.TEST., ports: [443, 80, 443], rate_limit: 10req/s, tls_proxy: true}
      - {domain: "*.cdn.test", protocols: [udp, tcp], rate_limit: 20connects/min}
      - {cidr: 10.1.0.0/16, ports: [6379], allow_internal_only: true, protocol: udp}
  filesystem:
    read_allowed: [/etc/resolv.conf, /data/]
    write_allowed: [/workspace/output/, /tmp]
  semantic:
    - {on: open, match: {path: "/etc/*"}, action: redirect, target: /tmp/etc}
"""


@pytest.fixture(scope="module")
def plan() -> EnforcementPlan:
    result = load_spec(SPEC, "plan.yaml")
    assert result.spec is not None, [e.format() for e in result.errors]
    return compile_plan(result.spec)


def test_resources_become_cgroup_units(plan: EnforcementPlan) -> None:
    res = plan.resources
    assert (res.cpu_millicores, res.memory_bytes, res.pids, res.timeout_s) == (500, 2**30, 64, 5400)
    assert res.gpu is not None and (res.gpu.count, res.gpu.memory_bytes) == (2, 40 * 10**9)


def test_egress_rules_are_normalized(plan: EnforcementPlan) -> None:
    exact, wildcard, cidr = plan.egress
    assert (exact.kind, exact.domain, exact.ports) == ("domain", "api.example.test", (80, 443))
    assert exact.rate_limit is not None and exact.rate_limit.per_second == 10
    assert (wildcard.kind, wildcard.domain, wildcard.ports) == ("wildcard", "cdn.test", (443,))
    assert (cidr.kind, cidr.cidr, cidr.internal_only) == ("cidr", "10.1.0.0/16", True)
    assert [r.protocols for r in plan.egress] == [("tcp",), ("tcp", "udp"), ("udp",)]
    assert exact.rate_limit.unit == "requests"
    assert wildcard.rate_limit is not None and wildcard.rate_limit.unit == "connects"
    assert [r.tls_proxy for r in plan.egress] == [True, False, False]  # opt-in


@pytest.mark.parametrize(
    ("host", "port", "allowed"),
    [
        ("api.example.test", 443, True),
        ("API.example.test.", 80, True),
        ("api.example.test", 8443, False),
        ("img.cdn.test", 443, True),
        ("cdn.test", 443, False),
        ("evil-cdn.test", 443, False),
        ("10.1.2.3", 6379, True),
        ("10.2.0.1", 6379, False),
    ],
)
def test_egress_matching(plan: EnforcementPlan, host: str, port: int, allowed: bool) -> None:
    assert any(rule.allows(host, port) for rule in plan.egress) is allowed


def test_filesystem_includes_mounts_and_workdir(plan: EnforcementPlan) -> None:
    assert plan.filesystem.write == ("/scratch", "/tmp", "/workspace/output")
    assert plan.filesystem.read == ("/data", "/etc/resolv.conf", "/workspace")


def test_secrets_are_references_never_values(plan: EnforcementPlan) -> None:
    (secret,) = plan.secrets
    assert (secret.env_var, secret.vault_mount, secret.vault_path, secret.key, secret.ttl_s) == (
        "SEARCH_KEY",
        "secret",
        "tools/search",
        "api-key",
        7200,
    )
    assert [(e.name, e.value) for e in plan.env] == [("MODE", "fast")]


def test_mounts_dependencies_entrypoint(plan: EnforcementPlan) -> None:
    data, scratch = plan.mounts
    assert (data.bucket, data.prefix, data.encrypted, data.cache_ttl_s) == (
        "bucket",
        "set/v1/",
        True,
        300,
    )
    assert (scratch.mode, scratch.cache_ttl_s) == ("rw", None)
    assert plan.dependencies[0].requirement() == "rich[jupyter]>=13"
    assert plan.entrypoint == ("python", "agent.py", "--fast")
    assert plan.semantic[0].target == "/tmp/etc"


def test_plan_round_trips_and_digest_is_stable(plan: EnforcementPlan) -> None:
    again = EnforcementPlan.model_validate_json(plan.model_dump_json())
    assert again == plan
    assert again.digest() == plan.digest()
    other = load_spec(SPEC.replace("pids: 64", "pids: 65"))
    assert other.spec is not None
    assert compile_plan(other.spec).digest() != plan.digest()


def test_brief_example_compiles() -> None:
    result = load_spec((FIXTURES / "agent-train-sandbox.yaml").read_text())
    assert result.spec is not None
    plan = compile_plan(result.spec)
    assert plan.secrets[0].key == "value"
    assert plan.dns_passthrough is True
    assert [m.scheme for m in plan.mounts] == ["s3", "configmap"]


def test_code_max_size_defaults_and_reaches_the_plan(plan: EnforcementPlan) -> None:
    assert plan.code_max_size == 256 * 2**20
    text = SPEC + "include_code: {max_size: 200MiB}\n"
    result = load_spec(text, "plan.yaml")
    assert result.spec is not None
    assert compile_plan(result.spec).code_max_size == 200 * 2**20


def test_code_max_size_over_the_limit_is_located() -> None:
    text = SPEC + "include_code: {max_size: 8GiB}\n"
    result = load_spec(text, "plan.yaml")
    assert result.spec is None
    [error] = result.errors
    assert (error.line, error.path) == (text.count("\n"), "include_code.max_size")
    assert "over the limit" in error.message and error.hint == "at most 4GiB"


def test_spec_validated_carries_the_typed_plan_with_rule_lines() -> None:
    """spec.validated's plan is the compiled EnforcementPlan (each rule with its spec line); on
    the wire it is the same map, and a consumer of an older minor drops what it does not know,
    at any depth."""
    from dsec_core.events import SpecValidated, decode_payload

    text = (
        'version: "1.2"\nname: lines\nbase: python:3.11\n'
        "security_policy:\n  network:\n    egress:\n      - {domain: api.example.com}\n"
        "  semantic:\n    - {on: open, match: {path: /etc/*}, action: deny}\n"
    )
    loaded = load_spec(text, "agent.yaml")
    assert loaded.spec is not None, loaded.errors
    plan = compile_plan(loaded.spec, source=loaded.source, spec_file="agent.yaml")
    assert (plan.egress[0].spec_line, plan.semantic[0].spec_line) == (7, 9)
    event = SpecValidated(name="lines", spec_digest="d", plan=plan)
    wire = event.model_dump(mode="json")
    assert isinstance(wire["plan"], dict) and wire["plan"]["spec_file"] == "agent.yaml"
    assert decode_payload("spec.validated", SpecValidated.VERSION, wire).plan == plan
    newer = {**wire, "plan": {**wire["plan"], "gpu_slices": 2}}
    newer["plan"]["egress"] = [{**wire["plan"]["egress"][0], "quic": True}]
    decoded = decode_payload("spec.validated", "1.9", newer)
    assert isinstance(decoded, SpecValidated) and isinstance(decoded.plan, EnforcementPlan)
    assert decoded.plan == plan
    with pytest.raises(ValueError, match="gpu_slices"):
        decode_payload("spec.validated", SpecValidated.VERSION, newer)
