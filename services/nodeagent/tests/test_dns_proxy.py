"""The DNS proxy against a real authoritative server on loopback (no kernel: a recording sink).

The kernel tests show the same proxy behind the cgroup redirect; these cover the answers.
Every address of the test zone is on loopback, so rules that must open them set
``allow_internal_only`` (answers pointing at loopback are refused otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import sys
import time
from collections.abc import AsyncIterator, Sequence
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.edns
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rrset
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the fixture
from _socket_testkit import listening_here
from dns_zone_server import ZoneServer, start_test_dns

from dsec_nodeagent.dns.policy import DnsBounds
from dsec_nodeagent.dns.proxy import DnsProxy, Grant
from dsec_nodeagent.dns.upstream import UpstreamClient
from dsec_nodeagent.ebpf.domain import parse_networks
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
    assert sink.addresses() == {(a, 80, 5) for a in kept}  # the TC answer opened nothing


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
        assert p.held(3) == 0  # nothing was opened, nothing counts against the quota
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


async def test_a_serve_cancelled_while_it_binds_leaves_no_listener(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The node agent's stop cancels a start while its DNS listeners bind: those bound already
    are closed (before, its UDP sockets stayed bound on the node, holding the port, until the
    node agent's process ended)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()

    async def cancelled_here(*_: Any, **__: Any) -> None:
        raise asyncio.CancelledError  # where the cancel lands: UDP bound, TCP not yet

    p = DnsProxy(UpstreamClient("127.0.0.1", 9, timeout=0.2, attempts=1), RecordingSink())
    monkeypatch.setattr(asyncio, "start_server", cancelled_here)
    with pytest.raises(asyncio.CancelledError):
        await p.serve(7, PLAN, port=port)
    assert p.port_of(7) is None

    def port_free() -> bool:
        again = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            again.bind(("127.0.0.1", port))
        except OSError:
            return False
        finally:
            again.close()
        return True

    deadline = time.monotonic() + 5  # a closed transport lets its socket go on the loop's turn
    while not port_free():
        assert time.monotonic() < deadline, "the cancelled serve's UDP listener still holds it"
        await asyncio.sleep(0.01)


async def test_a_serve_cancelled_at_any_step_leaves_no_tcp_listener() -> None:
    """asyncio drops a TCP server cancelled at its last step of starting, still listening: the
    binding runs to its end, then every listener it made is closed."""
    before = listening_here()
    for turns in range(12):
        p = DnsProxy(UpstreamClient("127.0.0.1", 9, timeout=0.2, attempts=1), RecordingSink())
        serve = asyncio.create_task(p.serve(11, PLAN))
        for _ in range(turns):
            await asyncio.sleep(0)
        serve.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serve
        await p.close()
        assert listening_here() == before, f"cancelled after {turns} turns"


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


async def test_rebinding_answers_are_refused_unless_the_rule_allows_internal_targets(
    zone: ZoneServer,
) -> None:
    sink = RecordingSink()
    p = DnsProxy(UpstreamClient(zone.host, zone.port), sink, protected=[ip_address("192.0.2.50")])
    refusals = record_refusals(p)
    plan = EgressPlan(
        sandbox_id="sbx-rebind",
        rules=(
            EgressRule(id="egress[0]", domain="rebind.test", ports=(80,)),  # 127.0.0.1 / ::1
            internal("egress[1]", domain="meta.test", ports=(80,)),  # 169.254.169.254 / fe80::1
            EgressRule(id="egress[2]", domain="node.test", ports=(80,)),  # the node's address
            internal("egress[3]", domain="allowed.test", ports=(80,)),  # internal: allowed
        ),
    )
    port = await p.serve(11, plan)
    try:
        for name, rdtype in (
            ("rebind.test", "A"),
            ("rebind.test", "AAAA"),
            ("meta.test", "A"),
            ("meta.test", "AAAA"),
            ("node.test", "A"),
        ):
            answer = await ask(port, name, rdtype)
            assert answer.rcode() == dns.rcode.NOERROR and addresses(answer) == [], name
        assert sink.grants == []
        assert [(r[1], r[2], r[3]) for r in refusals] == [
            ("rebind.test", "A", "dns.rebinding"),
            ("rebind.test", "AAAA", "dns.rebinding"),
            ("meta.test", "A", "dns.rebinding"),
            ("meta.test", "AAAA", "dns.rebinding"),
            ("node.test", "A", "dns.rebinding"),
        ]
        assert "127.0.0.1 is loopback" in refusals[0][4]
        assert "169.254.169.254 is link-local" in refusals[2][4]
        assert "node's or the stack's own address" in refusals[4][4]
        assert addresses(await ask(port, "allowed.test")) == ["127.0.0.10"]
    finally:
        await p.close()


async def test_upstream_gets_a_fresh_lower_cased_query_not_the_sandbox_bytes(
    proxy: tuple[DnsProxy, RecordingSink, int], zone: ZoneServer
) -> None:
    p, _, port = proxy
    refusals = record_refusals(p)
    before = len(zone.questions)
    answer = await ask(port, "AlLoWeD.TeSt")  # 0x20 case: the sandbox gets its own name back
    assert addresses(answer) == ["127.0.0.10"]
    assert answer.question[0].name.to_text() == "AlLoWeD.TeSt."
    assert zone.questions[before:] == [("allowed.test.", "A", "udp")]
    # An additional-section record (a secret riding along) is refused, and reaches nobody.
    smuggler = dns.message.make_query("allowed.test", "A")
    smuggler.additional.append(
        dns.rrset.from_text("x.allowed.test.", 0, "IN", "TXT", '"secret=hunter2"')
    )
    refused = await dns.asyncquery.udp(smuggler, "127.0.0.1", port=port, timeout=3)
    assert refused.rcode() == dns.rcode.FORMERR
    # A 40 KB query over TCP is refused without parsing or forwarding it.
    wire = dns.message.make_query("allowed.test", "A").to_wire() + b"x" * 40000
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(len(wire).to_bytes(2, "big") + wire)
    length = int.from_bytes(await reader.readexactly(2), "big")
    assert dns.message.from_wire(await reader.readexactly(length)).rcode() == dns.rcode.FORMERR
    writer.close()
    notify = dns.message.make_query("allowed.test", "A")
    notify.set_opcode(dns.opcode.NOTIFY)
    assert (await ask_message(port, notify)).rcode() == dns.rcode.NOTIMP
    assert len(zone.questions) == before + 1
    assert [r[3] for r in refusals] == ["dns.malformed", "dns.malformed", "dns.opcode"]
    assert "secret" not in " ".join(r[4] for r in refusals)
    assert "40" in refusals[1][4] and "at most 512" in refusals[1][4]


async def ask_message(port: int, query: dns.message.Message) -> dns.message.Message:
    return await dns.asyncquery.udp(query, "127.0.0.1", port=port, timeout=3)


async def test_ttl_is_capped_in_the_map_and_the_answer(zone: ZoneServer) -> None:
    sink = RecordingSink()
    p = DnsProxy(
        UpstreamClient(zone.host, zone.port), sink, ttl_grace_s=0, bounds=DnsBounds(max_ttl_s=60)
    )
    port = await p.serve(12, PLAN)
    try:
        before = time.monotonic_ns()
        answer = await ask(port, "long.test")  # TTL 1 day in the zone
        assert answer.answer[0].ttl == 60
        ((_, grant, _),) = sink.grants
        assert before + 60 * 10**9 <= grant.expires_ns <= time.monotonic_ns() + 60 * 10**9
    finally:
        await p.close()


async def test_a_full_quota_refuses_only_that_sandboxes_new_entries(zone: ZoneServer) -> None:
    sink = RecordingSink()
    p = DnsProxy(UpstreamClient(zone.host, zone.port), sink, bounds=DnsBounds(sandbox_quota=48))
    refusals = record_refusals(p)
    attacker, victim = await p.serve(21, PLAN), await p.serve(22, PLAN)
    try:
        assert len(addresses(await ask(attacker, "big.test", tcp=True))) == 32
        partial = await ask(attacker, "big2.test", tcp=True)
        assert len(addresses(partial)) == 16  # truncated to what fits
        assert (await ask(attacker, "big3.test", tcp=True)).rcode() == dns.rcode.SERVFAIL
        assert p.held(21) == 48
        assert [(r[0], r[1], r[3]) for r in refusals] == [
            ("sbx-dns", "big2.test", "dns.quota"),
            ("sbx-dns", "big3.test", "dns.quota"),
        ]
        assert "holds 48 of its 48" in refusals[1][4]
        # Re-resolving a name it already holds costs nothing; the victim is untouched.
        assert (await ask(attacker, "allowed.test")).rcode() == dns.rcode.SERVFAIL
        assert addresses(await ask(victim, "allowed.test")) == ["127.0.0.10"]
        assert p.held(22) == 1
    finally:
        await p.close()


async def test_expired_entries_free_the_quota(zone: ZoneServer) -> None:
    now = [time.monotonic_ns()]
    sink = RecordingSink()
    p = DnsProxy(
        UpstreamClient(zone.host, zone.port),
        sink,
        ttl_grace_s=0,
        clock=lambda: now[0],
        bounds=DnsBounds(sandbox_quota=32),
    )
    port = await p.serve(23, PLAN)
    try:
        assert len(addresses(await ask(port, "big.test", tcp=True))) == 32
        assert (await ask(port, "allowed.test")).rcode() == dns.rcode.SERVFAIL
        now[0] += 301 * 10**9  # past the zone's TTL of 300 s
        assert addresses(await ask(port, "allowed.test")) == ["127.0.0.10"]
        assert len(sink.revoked) == 32 and p.held(23) == 1
    finally:
        await p.close()


async def test_query_rate_and_wildcard_name_length_are_bounded(zone: ZoneServer) -> None:
    sink = RecordingSink()
    p = DnsProxy(
        UpstreamClient(zone.host, zone.port),
        sink,
        bounds=DnsBounds(queries_per_s=0.01, query_burst=3, max_wildcard_prefix=10),
    )
    refusals = record_refusals(p)
    port = await p.serve(24, PLAN)
    try:
        long_label = "a" * 11 + ".wild.test"  # 11 characters chosen under *.wild.test
        assert (await ask(port, long_label)).rcode() == dns.rcode.REFUSED
        assert addresses(await ask(port, "www.wild.test")) == ["127.0.0.12"]
        assert addresses(await ask(port, "allowed.test")) == ["127.0.0.10"]
        limited = await ask(port, "allowed.test")  # the 4th in a burst of 3
        assert limited.rcode() == dns.rcode.REFUSED
        assert limited.question[0].name.to_text() == "allowed.test."  # stubs need the question
        assert [r[3] for r in refusals] == ["dns.name", "dns.rate"]
        assert "more than 0.01 queries/s" in refusals[1][4]
    finally:
        await p.close()


async def test_names_outside_host_name_characters_are_refused(
    proxy: tuple[DnsProxy, RecordingSink, int], zone: ZoneServer
) -> None:
    p, _, port = proxy
    refusals = record_refusals(p)
    before = len(zone.questions)
    binary = dns.name.Name([b"\x00\xffsecret", b"wild", b"test", b""])
    answer = await ask_message(port, dns.message.make_query(binary, "A"))
    assert answer.rcode() == dns.rcode.REFUSED
    assert len(zone.questions) == before
    assert [r[3] for r in refusals] == ["dns.name"]


async def test_a_crowded_node_shares_its_map_fairly(zone: ZoneServer) -> None:
    sink = RecordingSink()
    p = DnsProxy(UpstreamClient(zone.host, zone.port), sink, bounds=DnsBounds(node_capacity=40))
    attacker, victim = await p.serve(31, PLAN), await p.serve(32, PLAN)
    try:
        # 1,024 is the operator's quota, but two sandboxes share 40 entries: 20 each.
        assert len(addresses(await ask(attacker, "big.test", tcp=True))) == 20
        assert (await ask(attacker, "big2.test", tcp=True)).rcode() == dns.rcode.SERVFAIL
        assert addresses(await ask(victim, "allowed.test")) == ["127.0.0.10"]
        assert (p.held(31), p.held(32)) == (20, 1)
    finally:
        await p.close()


async def test_an_operator_can_trust_a_local_target(zone: ZoneServer) -> None:
    sink = RecordingSink()
    p = DnsProxy(
        UpstreamClient(zone.host, zone.port),
        sink,
        trusted=parse_networks("127.0.0.1, 169.254.0.0/16", "DSEC_DNS_TRUSTED_TARGETS"),
    )
    port = await p.serve(41, PLAN)
    try:
        assert addresses(await ask(port, "rebind.test")) == ["127.0.0.1"]  # trusted
        assert addresses(await ask(port, "rebind.test", "AAAA")) == []  # ::1 is not
        assert addresses(await ask(port, "meta.test")) == []  # metadata: never
        assert sink.addresses() == {("127.0.0.1", 80, 8)}
    finally:
        await p.close()
    with pytest.raises(ValueError, match="DSEC_DNS_TRUSTED_TARGETS: 'localhost' is not an"):
        parse_networks("127.0.0.1,localhost", "DSEC_DNS_TRUSTED_TARGETS")


async def test_forwarded_answers_carry_the_sandboxes_id_question_and_edns_choice(
    proxy: tuple[DnsProxy, RecordingSink, int],
) -> None:
    _, _, port = proxy
    plain = dns.message.make_query("ALLOWED.test", "A")
    answer = await ask_message(port, plain)  # dnspython checks the id and the question
    assert addresses(answer) == ["127.0.0.10"] and answer.edns == -1 and not answer.additional
    assert answer.question[0].name.to_text() == "ALLOWED.test."
    with_edns = dns.message.make_query("allowed.test", "A", use_edns=0, payload=4096)
    with_edns.flags &= ~dns.flags.RD
    answer = await ask_message(port, with_edns)
    assert addresses(answer) == ["127.0.0.10"] and answer.edns == 0
    assert not answer.flags & dns.flags.RD and answer.flags & dns.flags.QR


async def test_open_tcp_connections_to_the_proxy_are_bounded_per_sandbox(zone: ZoneServer) -> None:
    p = DnsProxy(
        UpstreamClient(zone.host, zone.port),
        RecordingSink(),
        bounds=DnsBounds(max_tcp_connections=2),
    )
    refusals = record_refusals(p)
    port, other = await p.serve(51, PLAN), await p.serve(52, PLAN)
    held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
    wire = dns.message.make_query("allowed.test", "A").to_wire()
    for reader, writer in held:  # both are being served (and stay open)
        writer.write(len(wire).to_bytes(2, "big") + wire)
        length = int.from_bytes(await reader.readexactly(2), "big")
        assert addresses(dns.message.from_wire(await reader.readexactly(length))) == ["127.0.0.10"]
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        assert await asyncio.wait_for(reader.read(1), 3) == b""  # closed at once
        writer.close()
        assert [r[3] for r in refusals] == ["dns.tcp"]
        assert addresses(await ask(other, "allowed.test", tcp=True)) == ["127.0.0.10"]
    finally:
        for _, w in held:
            w.close()
        await p.close()
    with pytest.raises(ValueError, match="max_tcp_connections: must be at least 1"):
        DnsBounds(max_tcp_connections=0)


async def test_datagrams_too_short_to_answer_count_against_the_rate_too(zone: ZoneServer) -> None:
    """A datagram too short to be a query (or a response sent back) is dropped, and it counts
    against the sandbox's query rate like any other: a flood of them is a flood."""
    p = DnsProxy(
        UpstreamClient(zone.host, zone.port),
        RecordingSink(),
        bounds=DnsBounds(queries_per_s=0.01, query_burst=3),
    )
    refusals = record_refusals(p)
    port = await p.serve(25, PLAN)
    try:
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            asyncio.DatagramProtocol, remote_addr=("127.0.0.1", port)
        )
        for runt in (b"\x00", b"\x00\x01\x80" + b"\x00" * 9, b"short"):  # the burst of 3
            transport.sendto(runt)
        transport.close()
        limited = await ask(port, "allowed.test")
        assert limited.rcode() == dns.rcode.REFUSED
        assert [r[3] for r in refusals] == ["dns.rate"]
    finally:
        await p.close()
