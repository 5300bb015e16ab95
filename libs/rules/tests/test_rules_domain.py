"""validate(): schema, org guardrails and the code comparison, as one pure decision."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsec_core.spec import Severity

from dsec_rules.domain import ValidationOutcome, validate
from dsec_rules.guardrails import default_org_policy, parse_org_policy

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[3]
EXAMPLE = REPO / "examples/websearch-agent"
AGENT = {"agent.py": (EXAMPLE / "agent.py").read_bytes()}
SPEC = (EXAMPLE / "dsec.yaml").read_text()

BASE = 'version: "1.2"\nname: t\nbase: dsec/python311:latest\n'


def agent_line(text: str) -> str:
    """``agent.py:N`` of the example's first line containing ``text``."""
    lines = AGENT["agent.py"].decode().splitlines()
    return f"agent.py:{next(i for i, line in enumerate(lines, 1) if text in line)}"


def rules(outcome: ValidationOutcome) -> list[str]:
    return [e.rule_id for e in (*outcome.errors, *outcome.warnings)]


def test_example_spec_matches_its_code_exactly() -> None:
    outcome = validate(SPEC, "dsec.yaml", AGENT)
    assert outcome.ok, [e.format() for e in outcome.errors]
    assert outcome.warnings == ()
    assert outcome.plan is not None and outcome.plan.secrets[0].env_var == "WEB_SEARCH_KEY"


def test_missing_egress_is_a_warning_with_the_yaml_to_add() -> None:
    # Inference advises, the kernel decides: the spec is accepted and the call will be denied.
    spec = SPEC.replace("domain: api.websearch.test", "domain: api.other.test")
    outcome = validate(spec, "dsec.yaml", AGENT)
    assert outcome.ok and outcome.plan is not None
    (error,) = [e for e in outcome.warnings if e.rule_id == "infer.egress-missing"]
    assert error.severity is Severity.WARNING
    assert "api.websearch.test:443" in error.message
    assert agent_line("urllib.request.Request(") in error.message
    assert "denied at run time" in error.message
    assert error.hint is not None and "- domain: api.websearch.test" in error.hint
    assert "ports: [443]" in error.hint
    assert error.line == spec.splitlines().index("    egress:") + 2  # the egress list
    unused = [e for e in outcome.warnings if e.rule_id == "infer.egress-unused"]
    assert unused and "api.other.test" in unused[0].message


def test_wrong_port_points_at_the_rules_ports() -> None:
    spec = SPEC.replace("ports: [443]", "ports: [8443]")
    outcome = validate(spec, "dsec.yaml", AGENT)
    (error,) = [e for e in outcome.warnings if e.rule_id == "infer.egress-missing"]
    assert error.path == "security_policy.network.egress[0].ports"
    assert error.line == spec.splitlines().index("        ports: [8443]") + 1


def test_secret_read_but_never_injected_is_a_warning() -> None:
    spec = SPEC.replace("name: WEB_SEARCH_KEY", "name: OTHER_KEY")
    outcome = validate(spec, "dsec.yaml", AGENT)
    assert outcome.ok
    (error,) = [e for e in outcome.warnings if e.rule_id == "infer.secret-not-injected"]
    assert "WEB_SEARCH_KEY" in error.message
    assert agent_line('os.getenv("WEB_SEARCH_KEY")') in error.message
    assert error.hint is not None and "source: vault://" in error.hint
    assert "infer.secret-unused" in rules(outcome)


def test_write_outside_grants_and_unused_grant_are_warnings() -> None:
    spec = SPEC.replace("write_allowed: [/workspace/output]", "write_allowed: [/scratch]")
    outcome = validate(spec, "dsec.yaml", AGENT)
    assert outcome.ok
    (error,) = [e for e in outcome.warnings if e.rule_id == "infer.path-missing"]
    assert "/workspace/output" in error.message
    assert error.hint is not None and "write_allowed: [/workspace/output]" in error.hint
    (warning,) = [e for e in outcome.warnings if e.rule_id == "infer.path-unused"]
    assert warning.severity is Severity.WARNING and "/scratch" in warning.message


def test_without_code_there_is_no_comparison() -> None:
    outcome = validate(SPEC.replace("api.websearch.test", "api.other.test"), "dsec.yaml")
    assert outcome.ok and outcome.needs is None


def test_unparseable_code_is_a_warning_located_in_the_code() -> None:
    outcome = validate(SPEC, "dsec.yaml", {**AGENT, "bad.py": b"x = (\n"})
    (warning,) = [w for w in outcome.warnings if w.rule_id == "infer.parse-error"]
    assert warning.file == "bad.py" and warning.line >= 1
    assert outcome.ok


@pytest.mark.parametrize(
    ("snippet", "rule_id", "line"),
    [
        ("security_policy: {network: {egress: [{domain: '*'}]}}", "ORG-NET-001", 4),
        ("security_policy: {network: {egress: [{domain: '*.com'}]}}", "ORG-NET-001", 4),
        ("security_policy: {network: {egress: [{cidr: 0.0.0.0/0}]}}", "ORG-NET-001", 4),
        # everywhere written as v4-mapped IPv6: the kernel opens 0.0.0.0/0 for it
        ("security_policy: {network: {egress: [{cidr: '::ffff:0:0/96'}]}}", "ORG-NET-001", 4),
        ("security_policy: {filesystem: {write_allowed: [/]}}", "ORG-FS-001", 4),
        ("security_policy: {filesystem: {write_allowed: [/etc/app]}}", "ORG-FS-001", 4),
        (
            "runtime_context: {env_vars: [{name: K, source: 'vault://secret/default/k', "
            "ttl: 48h}]}",
            "ORG-SEC-001",
            4,
        ),
        ("resources: {memory: 512GiB}", "ORG-RES-001", 4),
        ("resources: {gpu: {count: 16}}", "ORG-RES-002", 4),
        ("tasks: [{name: a, compute_unit: {memory: 512GiB}}]", "ORG-RES-001", 4),
        # A task topology's units are held at once: the GPU bound is on their sum.
        (
            "tasks: [{name: a, compute_unit: {gpus: 5}}, {name: b, compute_unit: {gpus: 4}}]",
            "ORG-RES-002",
            4,
        ),
        ("include_code: {max_size: 2GiB}", "ORG-CODE-001", 4),
    ],
)
def test_default_guardrails_reject_with_rule_ids(snippet: str, rule_id: str, line: int) -> None:
    outcome = validate(BASE + snippet + "\n", "s.yaml")
    assert not outcome.ok
    (error,) = outcome.errors
    assert (error.rule_id, error.line) == (rule_id, line)
    assert error.message.startswith(f"[{rule_id}]") and "(org policy)" in error.message


def test_default_guardrails_allow_ordinary_specs() -> None:
    spec = BASE + "security_policy: {filesystem: {write_allowed: [/workspace/output, /tmp]}}\n"
    assert validate(spec, "s.yaml").ok


ORG = """
version: "1"
rules:
  - id: ACME-NET-010
    kind: require-rate-limit
    severity: warning
    message: "ask #netops for an exception"
  - id: ACME-SEC-002
    kind: allowed-vault-mounts
    mounts: [prod]
  - id: ACME-RES-003
    kind: max-timeout
    max: 1h
  - id: ACME-IMG-001
    kind: allowed-bases
    prefixes: [dsec/]
  - id: ACME-NET-011
    kind: forbid-domains
    domains: ["*.paste.test"]
"""


def test_org_policy_rules_and_severities() -> None:
    policy = parse_org_policy(ORG, "org.yaml").value
    assert policy is not None
    spec = SPEC.replace("rate_limit: 60req/min", "").replace("timeout: 10m", "timeout: 2h")
    outcome = validate(spec, "dsec.yaml", None, policy)
    assert [e.rule_id for e in outcome.errors] == ["ACME-RES-003", "ACME-SEC-002"]
    (warning,) = outcome.warnings
    assert warning.rule_id == "ACME-NET-010" and "ask #netops" in warning.message
    other = validate(SPEC.replace("api.websearch.test", "bin.paste.test"), "d.yaml", None, policy)
    assert "ACME-NET-011" in rules(other)


def test_org_policy_errors_are_located_like_spec_errors() -> None:
    bad = ORG.replace("kind: max-timeout", "kind: max-timout").replace("max: 1h", "max: soon")
    result = parse_org_policy(bad, "org.yaml")
    assert result.value is None
    assert result.errors and all(e.file == "org.yaml" and e.line > 1 for e in result.errors)


def test_default_org_policy_covers_the_baseline() -> None:
    ids = {rule.id for rule in default_org_policy().rules}
    assert {"ORG-NET-001", "ORG-FS-001", "ORG-SEC-001", "ORG-RES-001"} <= ids


def test_outcome_survives_json_for_the_event() -> None:
    outcome = validate(SPEC.replace("name: WEB_SEARCH_KEY", "name: X_KEY"), "d.yaml", AGENT)
    again = ValidationOutcome.model_validate_json(outcome.model_dump_json())
    assert again == outcome
    assert "infer.secret-not-injected" in [e.rule_id for e in again.warnings]


def test_org_policy_severities_raise_an_inference_rule_to_an_error() -> None:
    strict = parse_org_policy(
        'version: "1"\nseverities: {infer.path-missing: error}\nrules: []\n', "org.yaml"
    ).value
    assert strict is not None
    spec = SPEC.replace("write_allowed: [/workspace/output]", "write_allowed: [/scratch]")
    outcome = validate(spec, "dsec.yaml", AGENT, strict)
    assert not outcome.ok and outcome.plan is None
    (error,) = outcome.errors
    assert error.rule_id == "infer.path-missing" and error.severity is Severity.ERROR
    assert error.hint is not None and "write_allowed: [/workspace/output]" in error.hint


def test_org_policy_severities_name_only_known_levels() -> None:
    result = parse_org_policy('version: "1"\nseverities: {infer.path-missing: fatal}\n', "o.yaml")
    assert result.value is None
    assert result.errors[0].line == 2 and "severities" in result.errors[0].path


def test_org_maximum_of_the_code_bundle_applies_to_the_default_too() -> None:
    org = 'version: "1"\nrules:\n  - {id: ACME-CODE-001, kind: max-code-size, max: 100MiB}\n'
    policy = parse_org_policy(org, "org.yaml").value
    assert policy is not None
    unset = validate(BASE, "s.yaml", None, policy)
    (error,) = unset.errors
    assert error.rule_id == "ACME-CODE-001"
    assert "include_code.max_size 256MiB is above 100MiB" in error.message
    assert error.hint == "include_code: {max_size: 100MiB} or less"
    assert validate(BASE + "include_code: {max_size: 50MiB}\n", "s.yaml", None, policy).ok


@pytest.mark.parametrize(
    "cidr",
    [
        "169.254.169.254/32",
        "169.254.0.0/16",
        "fe80::1/128",
        "::ffff:169.254.169.254/128",
    ],
)
def test_a_rule_inside_the_link_local_range_is_refused_naming_the_field(cidr: str) -> None:
    """The cloud metadata service answers at 169.254.169.254: its credentials are the node's."""
    outcome = validate(
        BASE + f"security_policy: {{network: {{egress: [{{cidr: '{cidr}', ports: [80]}}]}}}}\n",
        "s.yaml",
    )
    assert not outcome.ok
    (error,) = outcome.errors
    assert error.path.endswith("egress[0].cidr") and "in the link-local range" in error.message


def test_a_v4_mapped_rule_is_the_ipv4_range_it_opens() -> None:
    outcome = validate(
        BASE + "security_policy: {network: {egress: [{cidr: '::ffff:10.0.0.0/104'}]}}\n", "s.yaml"
    )
    assert outcome.ok and outcome.plan is not None
    (rule,) = outcome.plan.egress
    assert str(rule.cidr) == "10.0.0.0/8"
