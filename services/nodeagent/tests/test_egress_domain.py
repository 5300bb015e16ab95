"""Pure egress decisions: plan validation, trie entries, buckets, what a DNS answer may open."""

from __future__ import annotations

import ipaddress
from pathlib import Path

import pytest
from dsec_core.spec.plan import EnforcementPlan, FilesystemPlan, PlanEgressRule, ResourceLimits
from dsec_core.spec.units import Rate
from pydantic import ValidationError

from dsec_nodeagent.ebpf.domain import (
    AF_TCP,
    AF_UDP,
    BucketSpec,
    CidrEntry,
    answer_refusal,
    bucket_specs,
    canonical_network,
    cidr_entries,
    grantable,
    internal_parts,
    is_internal,
    transport_flags,
)
from dsec_nodeagent.ebpf.model import (
    EgressPlan,
    EgressRule,
    Hook,
    RateLimit,
    Verdict,
    VerdictEvent,
)

pytestmark = pytest.mark.unit

net = ipaddress.ip_network
ip = ipaddress.ip_address


def plan(*rules: EgressRule, **kw: object) -> EgressPlan:
    return EgressPlan(sandbox_id="sbx", rules=rules, **kw)


def test_rule_needs_exactly_one_target() -> None:
    with pytest.raises(ValidationError, match="exactly one of 'domain' or 'cidr'"):
        EgressRule(id="r", domain="a.test", cidr=net("10.0.0.0/8"))
    with pytest.raises(ValidationError, match="exactly one of 'domain' or 'cidr'"):
        EgressRule(id="r")


@pytest.mark.parametrize("bad", ["exa mple.com", "*a.com", "a..b", "*.*.a", "-a.com", "a.b*"])
def test_bad_domain_names_the_value_and_the_shape(bad: str) -> None:
    with pytest.raises(ValidationError, match="expected a DNS name"):
        EgressRule(id="r", domain=bad)


def test_domain_is_normalized() -> None:
    assert EgressRule(id="r", domain=" API.Example.COM. ").domain == "api.example.com"
    assert EgressRule(id="r", domain="*.Example.com").is_wildcard


def test_ports_are_checked() -> None:
    with pytest.raises(ValidationError, match="ports"):
        EgressRule(id="r", domain="a.test", ports=(0,))


def test_duplicate_rule_ids_are_refused() -> None:
    with pytest.raises(ValidationError, match="duplicate rule id 'r'"):
        plan(EgressRule(id="r", domain="a.test"), EgressRule(id="r", domain="b.test"))


def test_rate_limit_accepts_the_spec_text_and_type() -> None:
    assert RateLimit.model_validate("100req/min") == RateLimit(count=100, per_seconds=60)
    assert RateLimit.model_validate(Rate(requests=5, period_s=3600)).bucket_size == 5
    limit = RateLimit(count=10, per_seconds=1, burst=3)
    assert (limit.bucket_size, limit.interval_ns) == (3, 100_000_000)


def test_rate_limit_rejects_garbage() -> None:
    with pytest.raises(ValidationError, match="not a rate"):
        RateLimit.model_validate("often")


def test_slots_are_one_based_and_stable() -> None:
    p = plan(EgressRule(id="a", domain="a.test"), EgressRule(id="b", cidr=net("10.0.0.0/8")))
    assert (p.slot("a"), p.slot("b")) == (1, 2)
    assert p.rule_at(2) is p.rules[1]
    assert p.rule_at(0) is None and p.rule_at(3) is None


def test_cidr_entries_one_per_port_and_any_port_as_zero() -> None:
    p = plan(
        EgressRule(id="d", domain="a.test", ports=(443,)),
        EgressRule(id="c", cidr=net("10.1.0.0/16"), ports=(80, 443)),
        EgressRule(id="all", cidr=net("192.168.1.7/32")),
    )
    assert list(cidr_entries(p)) == [
        CidrEntry(net("10.1.0.0/16"), 80, 2),
        CidrEntry(net("10.1.0.0/16"), 443, 2),
        CidrEntry(net("192.168.1.7/32"), 0, 3),
    ]


def test_internal_only_narrows_a_range_to_its_private_parts() -> None:
    assert internal_parts(net("0.0.0.0/0")) == [
        net("127.0.0.0/8"),
        net("10.0.0.0/8"),
        net("172.16.0.0/12"),
        net("192.168.0.0/16"),
    ]
    assert internal_parts(net("10.2.0.0/16")) == [net("10.2.0.0/16")]
    assert internal_parts(net("8.8.8.0/24")) == []
    assert internal_parts(net("::/0")) == [net("::1/128"), net("fc00::/7")]


def test_internal_only_and_any_rule_entries() -> None:
    p = plan(EgressRule(id="any", domain="*", ports=(443,), allow_internal_only=True))
    networks = {e.network for e in cidr_entries(p)}
    assert {n for n in networks if n.version == 4} == {
        net("127.0.0.0/8"),
        net("10.0.0.0/8"),
        net("172.16.0.0/12"),
        net("192.168.0.0/16"),
    }
    v6 = [n for n in networks if n.version == 6]
    private = net("fc00::/7")
    assert net("::1/128") in v6 and all(n == net("::1/128") or n.subnet_of(private) for n in v6)
    assert sum(n.num_addresses for n in v6) == 1 + private.num_addresses - 1  # less IMDS


def test_v4_mapped_cidr_lands_in_the_ipv4_trie() -> None:
    assert canonical_network(net("::ffff:10.0.0.0/104")) == net("10.0.0.0/8")
    assert canonical_network(net("2001:db8::/32")) == net("2001:db8::/32")


def test_no_rule_opens_the_link_local_range() -> None:
    """Before, ``*`` or a wide ``cidr`` (``169.0.0.0/8``; ``0.0.0.0/0`` where the org allows
    it) opened 169.254.169.254, a cloud machine's metadata service and its credentials."""
    p = plan(
        EgressRule(id="any", domain="*", ports=(80,)),
        EgressRule(id="wide", cidr=net("169.0.0.0/8"), ports=(80,)),
        EgressRule(id="inside", cidr=net("169.254.169.254/32"), ports=(80,)),
    )
    entries = list(cidr_entries(p))
    link_local = (net("169.254.0.0/16"), net("fe80::/10"))
    assert entries and not any(
        e.network.overlaps(ll)
        for e in entries
        for ll in link_local
        if e.network.version == ll.version
    )
    assert [e for e in entries if e.slot == 3] == []
    covered = [e.network for e in entries if e.slot == 2]
    for address in ("169.0.0.1", "169.253.255.255", "169.255.0.1"):  # all around it stays
        assert any(ip(address) in n for n in covered)
    everywhere = {e.network for e in entries if e.slot == 1}
    for address in ("8.8.8.8", "169.255.1.1", "2001:db8::1", "fe7f::1", "fec0::1"):
        assert any(ip(address) in n for n in everywhere if n.version == ip(address).version)
    assert not any(ip("169.254.169.254") in n for n in everywhere if n.version == 4)
    # nor the node itself through a wide rule (the DNS path refuses loopback answers to such a
    # rule too), nor AWS's IPv6 metadata address
    for hidden in ("127.0.0.1", "127.9.9.9", "::1", "fd00:ec2::254", "0.0.0.0", "::"):
        assert not any(ip(hidden) in n for n in everywhere if n.version == ip(hidden).version)
    for shown in ("126.255.255.255", "128.0.0.1", "::2", "fd00:ec2::253", "fd00::1"):
        assert any(ip(shown) in n for n in everywhere if n.version == ip(shown).version)
    # a rule naming loopback opens it; with allow_internal_only a wide rule keeps loopback
    named = plan(EgressRule(id="lo", cidr=net("127.0.0.0/8"), ports=(80,)))
    assert [e.network for e in cidr_entries(named)] == [net("127.0.0.0/8")]
    inner = plan(EgressRule(id="in", domain="*", ports=(80,), allow_internal_only=True))
    assert net("127.0.0.0/8") in {e.network for e in cidr_entries(inner)}


def test_link_local_metadata_is_not_internal() -> None:
    assert is_internal(ip("10.1.2.3")) and is_internal(ip("::ffff:192.168.0.1"))
    assert not is_internal(ip("169.254.169.254"))
    assert not is_internal(ip("8.8.8.8"))


def test_bucket_lets_exactly_bucket_size_through_at_once() -> None:
    p = plan(
        EgressRule(id="free", domain="a.test"),
        EgressRule(id="slow", domain="b.test", rate_limit=RateLimit(count=5, per_seconds=3600)),
    )
    (spec,) = bucket_specs(p)
    assert spec == BucketSpec(slot=2, interval_ns=720 * 10**9, tau_ns=4 * 720 * 10**9)
    # Replay the kernel's GCRA arithmetic: 5 conforming connects at the same instant, then none.
    tat, now, allowed = 0, 10**12, 0
    for _ in range(8):
        t = max(tat, now)
        if t - now <= spec.tau_ns:
            tat, allowed = t + spec.interval_ns, allowed + 1
    assert allowed == 5


def test_grantable_filters_public_addresses_for_internal_only_rules() -> None:
    internal = EgressRule(id="kv", domain="kv.test", allow_internal_only=True)
    answered = [ip("10.0.0.5"), ip("203.0.113.9"), ip("::ffff:192.168.1.1")]
    assert grantable(internal, answered, exact_name=True) == [ip("10.0.0.5"), ip("192.168.1.1")]


def test_grantable_drops_doh_resolvers_unless_named_exactly() -> None:
    wildcard = EgressRule(id="w", domain="*.google")
    assert grantable(wildcard, [ip("8.8.8.8"), ip("203.0.113.1")], exact_name=False) == [
        ip("203.0.113.1")
    ]
    exact = EgressRule(id="e", domain="dns.google")
    assert grantable(exact, [ip("8.8.8.8")], exact_name=True) == [ip("8.8.8.8")]


@pytest.mark.parametrize(
    ("address", "internal_rule_may"),
    [
        ("127.0.0.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("169.254.169.254", False),
        ("fe80::1", False),
        ("0.0.0.0", False),
        ("::", False),
        ("224.0.0.1", False),
        ("ff02::1", False),
        ("255.255.255.255", False),
        ("192.0.2.7", True),  # the node's own address (protected below)
    ],
)
def test_rebinding_targets_are_refused_unless_the_rule_allows_internal_ones(
    address: str, internal_rule_may: bool
) -> None:
    public = EgressRule(id="p", domain="api.test")
    internal = EgressRule(id="i", domain="api.test", allow_internal_only=True)
    node = frozenset({ip("192.0.2.7")})
    assert answer_refusal(public, ip(address), node) is not None
    assert grantable(public, [ip(address)], exact_name=True, protected=node) == []
    assert (answer_refusal(internal, ip(address), node) is None) is internal_rule_may
    assert answer_refusal(public, ip("203.0.113.1"), node) is None


def test_from_enforcement_plan_keeps_every_egress_field() -> None:
    compiled = EnforcementPlan(
        name="agent",
        base="python",
        entrypoint=None,
        workdir="/work",
        dependencies=(),
        build_options=(),
        resources=ResourceLimits(
            cpu_millicores=1000, memory_bytes=1 << 30, pids=64, gpu=None, timeout_s=None
        ),
        dns_passthrough=True,
        egress=(
            PlanEgressRule(
                kind="domain",
                domain="api.test",
                ports=(443,),
                rate_limit=Rate(requests=100, period_s=60),
            ),
            PlanEgressRule(kind="wildcard", domain="cdn.test", ports=(443,)),
            PlanEgressRule(kind="cidr", cidr="10.0.0.0/8", ports=(6379,), internal_only=True),
            PlanEgressRule(kind="any", ports=(80,), protocols=("tcp", "udp")),
        ),
        filesystem=FilesystemPlan(read=(), write=()),
        semantic=(),
        secrets=(),
        env=(),
        mounts=(),
        exclude_patterns=(),
    )
    egress = EgressPlan.from_enforcement_plan("sbx-1", compiled)
    assert egress.dns_passthrough
    assert [(r.id, r.domain, r.cidr) for r in egress.rules] == [
        ("egress[0]", "api.test", None),
        ("egress[1]", "*.cdn.test", None),
        ("egress[2]", None, net("10.0.0.0/8")),
        ("egress[3]", "*", None),
    ]
    assert egress.rules[0].rate_limit == RateLimit(count=100, per_seconds=60)
    assert egress.rules[2].allow_internal_only
    assert egress.rate_limited_rules() == (egress.rules[0],)
    assert [r.protocols for r in egress.rules] == [("tcp",)] * 3 + [("tcp", "udp")]
    assert [transport_flags(r) for r in egress.rules] == [AF_TCP] * 3 + [AF_TCP | AF_UDP]


def test_verdict_event_message_names_the_rule_and_destination() -> None:
    event = VerdictEvent(
        time_ns=1,
        wall_time=0.0,
        cgroup_id=7,
        sandbox_id="sbx",
        pid=42,
        comm="python",
        verdict=Verdict.DENY_RATE_LIMIT,
        hook=Hook.CONNECT6,
        rule_id="egress[0]",
        family=6,
        protocol="tcp",
        address="2001:db8::1",
        port=443,
    )
    assert event.denied
    assert event.message() == (
        "connect to [2001:db8::1]:443/tcp by python (pid 42): "
        "denied: rate limit of rule egress[0] exceeded"
    )
    assert event.as_dict()["verdict"] == "deny_rate_limit"
    assert not Verdict.REDIRECT_DNS.denied


def test_the_dns_proxys_ports_lie_above_the_kernels_ephemeral_range(tmp_path: Path) -> None:
    """No autobind (bind to port 0, listen() or sendto() on an unbound socket) lands there,
    so no sandbox can take a proxy's port while the node agent restarts."""
    from dsec_nodeagent.dns.proxy import proxy_port_range

    ephemeral = tmp_path / "ip_local_port_range"
    ephemeral.write_text("32768\t60999\n")
    assert proxy_port_range(ephemeral) == (61000, 65535)
    ephemeral.write_text("1024\t65500\n")
    assert proxy_port_range(ephemeral) is None  # no room above: any free port, the map decides
    assert proxy_port_range(tmp_path / "missing") is None


def test_the_proxy_tries_every_port_of_its_range_and_moves_an_old_one_into_it() -> None:
    """A re-adopted listener's port outside the range (an older agent's, among the ephemeral
    ports an autobind may take) is not kept; every port of the range is tried, once, before
    the proxy gives up (64 random guesses failed while a port was free)."""
    from dsec_nodeagent.dns.proxy import DnsProxy

    proxy = DnsProxy(None, None, ports=(61000, 61009))  # type: ignore[arg-type]
    assert next(iter(proxy._candidates(61003))) == 61003
    moved = list(proxy._candidates(45123))
    assert 45123 not in moved and sorted(moved) == list(range(61000, 61010))
    assert proxy.in_range(61009) and not proxy.in_range(45123)
    anywhere = DnsProxy(None, None, ports=None)  # type: ignore[arg-type]
    assert list(anywhere._candidates(45123))[:2] == [45123, 0]
