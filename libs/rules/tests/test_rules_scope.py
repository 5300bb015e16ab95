"""Tenants, the stack's own data and servers, host paths and the union of egress rules."""

from __future__ import annotations

import ipaddress
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec_rules.domain import ValidationOutcome, validate
from dsec_rules.guardrails import StackFacts, parse_org_policy

pytestmark = pytest.mark.unit

BASE = 'version: "1.2"\nname: t\nbase: dsec/python311:latest\n'
FACTS = StackFacts(
    system_bucket="dsec",
    endpoints=(("NATS", "127.0.0.1", 4222), ("OpenBao", "127.0.0.1", 8200)),
    dirs=("/srv/dsec-home",),
)


def check(snippet: str, tenant: str = "default", org: str | None = None) -> ValidationOutcome:
    policy = parse_org_policy(org, "org.yaml").value if org else None
    return validate(BASE + snippet + "\n", "s.yaml", None, policy, tenant=tenant, facts=FACTS)


def only(outcome: ValidationOutcome) -> tuple[str, int, int, str, str]:
    assert len(outcome.errors) == 1, [e.format() for e in outcome.errors]
    e = outcome.errors[0]
    return e.rule_id, e.line, e.column, e.message, e.hint or ""


def env(source: str) -> str:
    return f"runtime_context:\n  env_vars:\n    - {{name: K, source: '{source}'}}"


def mount(source: str) -> str:
    return f"runtime_context:\n  mounts:\n    - {{path: /data, source: '{source}'}}"


# -- tenants --------------------------------------------------------------------------------------


def test_tenant_reads_its_own_secret_data_and_config_by_convention() -> None:
    ok = check(env("vault://secret/acme/tools/search#key"), tenant="acme")
    assert ok.ok and ok.plan is not None and ok.plan.tenant == "acme"
    assert check(mount("s3://lake/acme/set/"), tenant="acme").ok
    assert check(mount("configmap://acme.retrieval/v3"), tenant="acme").ok
    # a tenant named with another's name and a dash is another tenant (before: acme-* held
    # acme-corp's config maps)
    assert only(check(mount("configmap://acme-corp.db/password"), tenant="acme"))[0] == (
        "tenant.configmap"
    )
    assert check(mount("configmap://acme-corp.db/password"), tenant="acme-corp").ok


def test_another_tenants_secret_is_refused_at_its_line_with_what_is_valid() -> None:
    rule, line, col, message, hint = only(check(env("vault://secret/acme/tools#key")))
    assert (rule, line, col) == ("tenant.vault", 6, 25)
    assert "outside the secrets of tenant 'default'" in message
    assert "vault://secret/default/" in hint


@pytest.mark.parametrize(
    "source",
    ["vault://secret/default/../acme/k#v", "vault://secret/default/./x#v", "vault://prod/x#v"],
)
def test_vault_paths_that_escape_or_leave_the_prefix_are_refused(source: str) -> None:
    assert only(check(env(source)))[0] == "tenant.vault"


def test_system_bucket_and_other_tenants_data_are_refused() -> None:
    rule, line, _, message, _ = only(check(mount("s3://dsec/bundles/")))
    assert (rule, line) == ("system.bucket", 6)
    assert "system bucket" in message
    assert only(check(mount("s3://dsec/default/x/")))[0] == "system.bucket"
    assert only(check(mount("s3://lake/acme/x/")))[0] == "tenant.s3"
    assert only(check(mount("s3://lake/default/../acme/")))[0] == "tenant.s3"
    assert only(check(mount("configmap://acme.cfg/k")))[0] == "tenant.configmap"
    assert only(check(mount("configmap://default-cfg/k")))[0] == "tenant.configmap"


def test_org_policy_lists_a_tenants_prefixes() -> None:
    org = (
        'version: "1"\ntenants:\n  acme:\n    vault: [kv/acme-shared/]\n'
        "    s3: [acme-lake/raw/]\n    configmaps: [shared-*]\n"
    )
    assert check(env("vault://kv/acme-shared/k#v"), "acme", org).ok
    assert only(check(env("vault://secret/acme/k#v"), "acme", org))[0] == "tenant.vault"
    assert check(mount("s3://acme-lake/raw/2024/"), "acme", org).ok
    assert only(check(mount("s3://other/acme/"), "acme", org))[0] == "tenant.s3"
    assert check(mount("configmap://shared-x/k"), "acme", org).ok


def test_org_policy_cannot_lower_a_tenant_refusal() -> None:
    org = 'version: "1"\nseverities: {tenant.vault: warning}\n'
    assert only(check(env("vault://secret/acme/k#v"), org=org))[0] == "tenant.vault"


# -- the stack's servers ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "rule",
    [
        "{cidr: 127.0.0.0/8, ports: [4222]}",
        "{cidr: 127.0.0.1/32, ports: [8200]}",
        "{domain: localhost, ports: [4222]}",
    ],
)
def test_egress_to_the_stacks_servers_is_refused(rule: str) -> None:
    outcome = check(f"security_policy:\n  network:\n    egress:\n      - {rule}")
    rule_id, line, col, message, _ = only(outcome)
    assert (rule_id, line, col) == ("system.egress", 7, 9)
    assert "127.0.0.1:" in message


def test_domain_star_on_a_stack_port_is_refused_even_without_the_org_rule() -> None:
    org = 'version: "1"\nrules: []\n'
    outcome = check("security_policy: {network: {egress: [{domain: '*', ports: [4222]}]}}", org=org)
    assert only(outcome)[0] == "system.egress"


def test_egress_elsewhere_is_not_the_stack() -> None:
    assert check("security_policy: {network: {egress: [{cidr: 10.0.0.0/8, ports: [4222]}]}}").ok


# -- host paths ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["/etc", "/etc/ssl", "/", "/root", "/var/lib", "/srv/dsec-home/keys"]
)
def test_read_of_host_paths_is_refused_by_default(path: str) -> None:
    rule, line, _, message, _ = only(
        check(f"security_policy: {{filesystem: {{read_allowed: [{path}]}}}}")
    )
    assert (rule, line) == ("ORG-FS-002", 4)
    assert "exposes the host path" in message


def test_the_sandboxs_own_view_stays_readable() -> None:
    snippet = (
        "workdir: /workspace\nruntime_context:\n  mounts:\n"
        "    - {path: /home/agent/data, source: 's3://lake/default/x/'}\n"
        "security_policy: {filesystem: {read_allowed: [/workspace/data, /tmp, /home/agent/data, "
        "/usr/share/dict]}}"
    )
    assert check(snippet).ok


@pytest.mark.parametrize(
    ("snippet", "rule_id", "path"),
    [
        # a workdir of / made every host path "the sandbox's own view" (no code: each
        # read_allowed path was bound from the host): /etc, /root, DSEC_HOME
        (
            "workdir: /\nsecurity_policy: {filesystem: {read_allowed: [/etc, /srv/dsec-home]}}",
            "invalid-value",
            "workdir",
        ),
        # /tmp is the sandbox's own only when writable (a tmpfs); else the host's /tmp
        (
            "security_policy: {filesystem: {read_allowed: [/tmp], write_allowed: [/workspace/o]}}",
            "ORG-FS-002",
            "security_policy.filesystem.read_allowed[0]",
        ),
        # no write_allowed, but a writable mount: the plan writes there, /tmp is the host's
        (
            "runtime_context:\n  mounts:\n    - {path: /data, source: 's3://lake/default/x/',"
            " mode: rw}\nsecurity_policy: {filesystem: {read_allowed: [/tmp]}}",
            "ORG-FS-002",
            "security_policy.filesystem.read_allowed[0]",
        ),
    ],
)
def test_no_spec_reads_the_hosts_protected_paths_as_its_own(
    snippet: str, rule_id: str, path: str
) -> None:
    (error,) = check(snippet).errors
    assert (error.rule_id, error.path) == (rule_id, path), error.message


def test_writes_into_dsec_home_are_refused_and_the_operator_can_allow_a_path() -> None:
    outcome = check("security_policy: {filesystem: {write_allowed: [/srv/dsec-home/x]}}")
    assert "ORG-FS-002" in [e.rule_id for e in outcome.errors]
    org = (
        'version: "1"\nrules:\n  - {id: ACME-FS-1, kind: forbid-host-paths, paths: [/etc], '
        "allow: [/etc/ssl/certs]}\n"
    )
    assert check("security_policy: {filesystem: {read_allowed: [/etc/ssl/certs]}}", org=org).ok


# -- the union of egress rules ----------------------------------------------------------------


def split_cover(seed: int, version: int, pieces: int) -> list[str]:
    """The whole address space split into ``pieces`` random disjoint networks."""
    rng = random.Random(seed)
    nets = [ipaddress.ip_network("0.0.0.0/0" if version == 4 else "::/0")]
    while len(nets) < pieces:
        net = nets.pop(rng.randrange(len(nets)))
        if net.prefixlen >= 30:
            nets.append(net)
            continue
        nets += list(net.subnets())
    rng.shuffle(nets)
    return [str(n) for n in nets]


def egress_yaml(cidrs: list[str], port: int = 443) -> str:
    rules = "\n".join(f"      - {{cidr: '{c}', ports: [{port}]}}" for c in cidrs)
    return f"security_policy:\n  network:\n    egress:\n{rules}"


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.sampled_from([4, 6]), st.integers(2, 12))
def test_rules_that_together_cover_everything_are_refused_like_slash_zero(
    seed: int, version: int, pieces: int
) -> None:
    cidrs = split_cover(seed, version, pieces)
    outcome = check(egress_yaml(cidrs))
    assert [e.rule_id for e in outcome.errors] == ["ORG-NET-001"]
    assert "allows every destination on port(s) 443" in outcome.errors[0].message
    # One piece less is not everything any more.
    assert check(egress_yaml(cidrs[1:])).ok


def test_halves_on_different_ports_are_not_everywhere() -> None:
    snippet = (
        "security_policy:\n  network:\n    egress:\n"
        "      - {cidr: 0.0.0.0/1, ports: [443]}\n      - {cidr: 128.0.0.0/1, ports: [80]}"
    )
    assert check(snippet).ok
    assert not check(snippet.replace("ports: [80]", "ports: [80, 443]")).ok


@pytest.mark.parametrize("tenant", ["", "a/b", "../acme", "ACME", "x" * 64])
def test_a_tenant_that_is_not_a_name_is_refused(tenant: str) -> None:
    outcome = validate(BASE, "s.yaml", tenant=tenant)
    assert [e.rule_id for e in outcome.errors] == ["tenant.invalid"] and outcome.plan is None


def test_org_policy_prefixes_are_whole_segments() -> None:
    bad = 'version: "1"\ntenants:\n  acme: {vault: [secret/acme], s3: ["lake/../"]}\n'
    result = parse_org_policy(bad, "org.yaml")
    assert result.value is None
    assert sorted((e.line, e.path) for e in result.errors) == [
        (3, "tenants.acme.s3[0]"),
        (3, "tenants.acme.vault[0]"),
    ]


def test_public_host_files_are_allowed_by_default_but_not_their_neighbours() -> None:
    ok = "security_policy: {filesystem: {read_allowed: [/etc/resolv.conf, /etc/ssl/certs]}}"
    assert check(ok).ok
    assert only(check("security_policy: {filesystem: {read_allowed: [/etc/ssl]}}"))[0] == (
        "ORG-FS-002"
    )


@pytest.mark.parametrize("tenant", ["dsec", "dsec-state", "dsec-recording", "system"])
def test_a_tenant_named_like_the_stacks_own_paths_reads_nothing_by_convention(tenant: str) -> None:
    """The stack keeps its secrets under secret/dsec/keys (the producers' keys),
    secret/dsec-state/<t> and secret/dsec-recording/<t>: a tenant named dsec-state had every
    tenant's state key in its conventional scope (secret/<tenant>/)."""
    outcome = check(env("vault://secret/dsec-state/acme#key"), tenant=tenant)
    assert [e.rule_id for e in outcome.errors] == ["tenant.vault"]
    assert only(check(env(f"vault://secret/{tenant}/x#k"), tenant=tenant))[0] == "tenant.vault"
