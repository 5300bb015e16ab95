"""The DNS proxy against a real authoritative server on loopback (no kernel: a recording sink).

The kernel tests show the same proxy behind the cgroup redirect; these cover the answers.
Every address of the test zone is on loopback, so rules that must open them set
``allow_internal_only`` (answers pointing at loopback are refused otherwise).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.flags
import dns.message
import dns.rcode
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the fixture
from dns_zone_server import ZoneServer, start_test_dns

from dsec_nodeagent.dns.proxy import DnsProxy, Grant
from dsec_nodeagent.dns.upstream import UpstreamClient
from dsec_nodeagent.ebpf.model import EgressPlan, EgressRule, IPAddress

pytestmark = pytest.mark.integration


class RecordingSink:
    """Stands in for the kernel maps: records grants and when they arrived."""

    def __init__(self) -> None:
        self.grants: list[tuple[int, Grant, int]] = []
        self.revoked: list[tuple[int, IPAddress, int]] = []

    def grant(self, cgroup_id: int, grants: Sequence[Grant]) -> None:
        now = time.monotonic_ns()
        self.grants.extend((cgroup_id, g, now) for g in grants)

    def revoke(self, cgroup_id: int, keys: Sequence[tuple[IPAddress, int]]) -> None:
        self.revoked.extend((cgroup_id, a, p) for a, p in keys)

    def addresses(self) -> set[tuple[str, int, int]]:
        return {(str(g.address), g.port, g.slot) for _, g, _ in self.grants}


def internal(rule_id: str, **fields: Any) -> EgressRule:
    return EgressRule(id=rule_id, allow_internal_only=True, **fields)


PLAN = EgressPlan(
    sandbox_id="sbx-dns",
    rules=(
        internal("egress[0]", domain="allowed.test", ports=(8080,)),
        internal("egress[1]", domain="*.wild.test", ports=(443, 8443)),
        internal("egress[2]", domain="alias.test", ports=(443,)),
        internal("egress[3]", domain="mixed.test", ports=(6379,)),
        internal("egress[4]", domain="big.test", ports=(80,)),
        internal("egress[5]", domain="short.test", ports=(80,)),
        internal("egress[6]", domain="txt.test", ports=(80,)),
        EgressRule(id="egress[7]", domain="rebind.test", ports=(80,)),
        internal("egress[8]", domain="meta.test", ports=(80,)),
        internal("egress[9]", domain="long.test", ports=(80,)),
        internal("egress[10]", domain="big2.test", ports=(80,)),
        internal("egress[11]", domain="big3.test", ports=(80,)),
    ),
)


@pytest.fixture(scope="module")
async def zone() -> AsyncIterator[ZoneServer]:
    server = await start_test_dns()
    yield server
    await server.close()


@pytest.fixture
async def proxy(zone: ZoneServer) -> AsyncIterator[tuple[DnsProxy, RecordingSink, int]]:
    sink = RecordingSink()
    p = DnsProxy(UpstreamClient(zone.host, zone.port), sink, ttl_grace_s=1.0)
    port = await p.serve(77, PLAN)
    yield p, sink, port
    await p.close()


async def ask(
    port: int, name: str, rdtype: str = "A", *, tcp: bool = False, host: str = "127.0.0.1"
) -> dns.message.Message:
    query = dns.message.make_query(name, rdtype)
    if tcp:
        return await dns.asyncquery.tcp(query, host, port=port, timeout=3)
    return await dns.asyncquery.udp(query, host, port=port, timeout=3)


def addresses(msg: dns.message.Message) -> list[str]:
    return sorted(rd.address for rr in msg.answer if rr.rdtype in (1, 28) for rd in rr)


async def test_allowed_name_is_answered_and_granted_before_release(
    proxy: tuple[DnsProxy, RecordingSink, int],
) -> None:
    _, sink, port = proxy
    answer = await ask(port, "allowed.test")
    received = time.monotonic_ns()
    assert answer.rcode() == dns.rcode.NOERROR and addresses(answer) == ["127.0.0.10"]
    assert sink.addresses() == {("127.0.0.10", 8080, 1)}
    assert all(at < received for _, _, at in sink.grants)
    assert {cg for cg, _, _ in sink.grants} == {77}


async def test_aaaa_and_ipv6_listener(proxy: tuple[DnsProxy, RecordingSink, int]) -> None:
    _, sink, port = proxy
    answer = await ask(port, "allowed.test", "AAAA", host="::1")
    assert addresses(answer) == ["::1"]
    assert ("::1", 8080, 1) in sink.addresses()


async def test_other_names_get_nxdomain_without_asking_upstream(
    proxy: tuple[DnsProxy, RecordingSink, int], zone: ZoneServer
) -> None:
    _, sink, port = proxy
    before = len(zone.questions)
    for name in ("denied.test", "wild.test", "evil.allowed.test", "dns.google"):
        assert (await ask(port, name)).rcode() == dns.rcode.NXDOMAIN
    assert len(zone.questions) == before  # nothing leaked upstream
    assert sink.grants == []


async def test_refused_is_configurable(zone: ZoneServer) -> None:
    p = DnsProxy(
        UpstreamClient(zone.host, zone.port), RecordingSink(), deny_rcode=dns.rcode.REFUSED
    )
    port = await p.serve(1, PLAN)
    try:
        assert (await ask(port, "denied.test")).rcode() == dns.rcode.REFUSED
    finally:
        await p.close()
    with pytest.raises(ValueError, match="deny_rcode"):
        DnsProxy(
            UpstreamClient(zone.host, zone.port), RecordingSink(), deny_rcode=dns.rcode.SERVFAIL
        )


async def test_wildcard_rule_grants_every_port_of_the_rule(
    proxy: tuple[DnsProxy, RecordingSink, int],
) -> None:
    _, sink, port = proxy
    assert addresses(await ask(port, "deep.a.wild.test")) == ["127.0.0.12"]
    assert sink.addresses() == {("127.0.0.12", 443, 2), ("127.0.0.12", 8443, 2)}


async def test_cname_chain_is_followed_to_its_addresses(
    proxy: tuple[DnsProxy, RecordingSink, int], zone: ZoneServer
) -> None:
    _, sink, port = proxy
    answer = await ask(port, "alias.test")
    assert [rr.rdtype for rr in answer.answer] == [5, 1]  # CNAME, then A
    assert addresses(answer) == ["127.0.0.15"]
    assert ("edge.cdn.test.", "A", "udp") in zone.questions  # the proxy asked for the target
    assert sink.addresses() == {("127.0.0.15", 443, 3)}


async def test_internal_only_removes_public_addresses_from_answer_and_map(
    proxy: tuple[DnsProxy, RecordingSink, int],
) -> None:
    _, sink, port = proxy
    assert addresses(await ask(port, "mixed.test")) == ["127.0.0.13"]
    assert sink.addresses() == {("127.0.0.13", 6379, 4)}


async def test_truncated_answers_go_over_tcp(
    proxy: tuple[DnsProxy, RecordingSink, int], zone: ZoneServer
) -> None:
    _, sink, port = proxy
    over_udp = await ask(port, "big.test")
    assert over_udp.flags & dns.flags.TC
    over_tcp = await ask(port, "big.test", tcp=True)
    kept = addresses(over_tcp)
    assert len(kept) == 32 and all(a.startswith("127.0.1.") for a in kept)  # max_addresses
    assert ("big.test.", "A", "tcp") in zone.questions  # upstream truncated to us too
    assert len(sink.grants) == 64  # 32 per answer (the zone shuffles which ones)
    assert {(a, 80, 5) for a in kept} <= sink.addresses()


async def test_expiry_follows_the_ttl(proxy: tuple[DnsProxy, RecordingSink, int]) -> None:
    _, sink, port = proxy
    before = time.monotonic_ns()
    await ask(port, "short.test")  # TTL 2 in the zone, grace 1 s
    ((_, grant, _),) = sink.grants
    assert before + 3 * 10**9 <= grant.expires_ns <= time.monotonic_ns() + 3 * 10**9


async def test_non_address_questions_are_refused_without_asking_upstream(
    proxy: tuple[DnsProxy, RecordingSink, int], zone: ZoneServer
) -> None:
    p, sink, port = proxy
    refusals = record_refusals(p)
    before = len(zone.questions)
    for rdtype in ("TXT", "ANY", "MX"):
        answer = await ask(port, "txt.test", rdtype)
        assert answer.rcode() == dns.rcode.REFUSED and answer.answer == []
    assert len(zone.questions) == before
    assert [(r[1], r[2], r[3]) for r in refusals] == [
        ("txt.test", t, "dns.qtype") for t in ("TXT", "ANY", "MX")
    ]
    assert "only A, AAAA are answered" in refusals[0][4]
    assert sink.grants == []


def record_refusals(p: DnsProxy) -> list[tuple[str, str, str, str, str]]:
    """(sandbox, name, type, rule id, reason) of every refusal the proxy reports."""
    seen: list[tuple[str, str, str, str, str]] = []

    def on_denied(sid: str, name: str, rdtype: str, *, rule_id: str, reason: str) -> None:
        seen.append((sid, name, rdtype, rule_id, reason))

    p.on_denied = on_denied
    return seen


async def test_passthrough_answers_every_name_but_grants_only_rule_names(
    zone: ZoneServer,
) -> None:
    sink = RecordingSink()
    p = DnsProxy(UpstreamClient(zone.host, zone.port), sink)
    port = await p.serve(5, PLAN.model_copy(update={"dns_passthrough": True}))
    try:
        assert addresses(await ask(port, "denied.test")) == ["127.0.0.20"]
        assert (await ask(port, "nothing.test")).rcode() == dns.rcode.NXDOMAIN
        assert sink.grants == []
    finally:
        await p.close()


class FullSink:
    def grant(self, cgroup_id: int, grants: Sequence[Grant]) -> None:
        raise OSError(28, "No space left on device")

    def revoke(self, cgroup_id: int, keys: Sequence[tuple[IPAddress, int]]) -> None:
        pass


async def test_full_allow_map_gives_servfail_not_an_unusable_answer(zone: ZoneServer) -> None:
    p = DnsProxy(UpstreamClient(zone.host, zone.port), FullSink())
    port = await p.serve(3, PLAN)
    try:
        answer = await ask(port, "allowed.test")
        assert answer.rcode() == dns.rcode.SERVFAIL and answer.answer == []
    finally:
        await p.close()


async def test_dead_upstream_gives_servfail() -> None:
    p = DnsProxy(UpstreamClient("127.0.0.1", 9, timeout=0.2, attempts=1), RecordingSink())
    port = await p.serve(9, PLAN)
    try:
        assert (await ask(port, "allowed.test")).rcode() == dns.rcode.SERVFAIL
    finally:
        await p.close()


async def test_each_sandbox_has_its_own_port_and_plan(zone: ZoneServer) -> None:
    sink = RecordingSink()
    p = DnsProxy(UpstreamClient(zone.host, zone.port), sink)
    other = EgressPlan(sandbox_id="other", rules=(internal("r", domain="other.test"),))
    first, second = await p.serve(1, PLAN), await p.serve(2, other)
    try:
        assert first != second
        assert (await ask(second, "allowed.test")).rcode() == dns.rcode.NXDOMAIN
        assert addresses(await ask(second, "other.test")) == ["127.0.0.21"]
        assert {(cg, str(g.address)) for cg, g, _ in sink.grants} == {(2, "127.0.0.21")}
        with pytest.raises(ValueError, match="already running"):
            await p.serve(1, PLAN)
        await p.stop(1)
        assert p.port_of(1) is None
    finally:
        await p.close()


async def test_garbage_is_dropped_and_the_proxy_keeps_serving(
    proxy: tuple[DnsProxy, RecordingSink, int],
) -> None:
    _, _, port = proxy
    loop = asyncio.get_running_loop()
    transport, _ = await loop.create_datagram_endpoint(
        asyncio.DatagramProtocol, remote_addr=("127.0.0.1", port)
    )
    transport.sendto(b"\x00\x01not dns")
    transport.close()
    assert addresses(await ask(port, "allowed.test")) == ["127.0.0.10"]
