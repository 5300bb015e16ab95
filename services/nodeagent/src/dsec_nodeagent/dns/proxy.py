"""The node agent's DNS proxy: the only resolver a sandbox can reach.

Identity: every sandbox gets its own listening port (UDP and TCP, on 127.0.0.1 and ::1); the
kernel's connect/sendmsg hooks rewrite any port-53 destination of that sandbox to *its* port. The
socket that received a question therefore names the sandbox — no lookup of the sender's address or
cgroup, nothing the sandbox can spoof: even a sandbox that could reach another sandbox's port
would only open addresses in that other sandbox's map, for names that sandbox may resolve anyway.

For an allowed name the answered addresses go into the sandbox's kernel allow map *before* the
answer is released, so the first connect never races the rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import ipaddress
import logging
import random
import re
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, cast

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
from dsec_core.threads import to_the_end
from prometheus_client import Counter

from dsec_nodeagent.dns.policy import (
    DnsBounds,
    NameMatch,
    QueryAction,
    decide_query,
    wildcard_prefix,
)
from dsec_nodeagent.dns.upstream import UpstreamAnswer, UpstreamClient, UpstreamError
from dsec_nodeagent.ebpf.domain import (
    AF_TCP,
    rule_ports,
    screen_answer,
    transport_flags,
    unmap,
)
from dsec_nodeagent.ebpf.model import EgressPlan, EgressRule, IPAddress, IPNetwork
from dsec_nodeagent.refusals import metric_rule

log = logging.getLogger(__name__)

# Labels are bounded: actions and rule ids of a fixed set (dsec_nodeagent.refusals.metric_rule),
# never a sandbox id (a series per sandbox would grow without bound).
DNS_QUERIES = Counter(
    "dsec_dns_queries",
    "Questions the node agent's DNS proxy answered, by action",
    ["action"],
)
DNS_GRANTS = Counter(
    "dsec_dns_granted_addresses",
    "Addresses opened in sandboxes' allow maps from DNS answers",
)

DNS_REFUSALS = Counter(
    "dsec_dns_refusals",
    "Questions or answer addresses the DNS proxy refused, by rule id (dns.qtype, "
    "dns.malformed, dns.rebinding, dns.quota, dns.rate, default-deny, ...)",
    ["rule"],
)
DNS_TRUNCATED = Counter(
    "dsec_dns_truncated_answers",
    "Answers cut to the proxy's max_addresses",
)

MAX_CNAME_HOPS = 8
# Host names only (what A/AAAA lookups are for): no escaped bytes, spaces or binary labels.
_HOSTNAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
_ADDRESS_TYPES = (dns.rdatatype.A, dns.rdatatype.AAAA)
_TCP_IDLE_S = 10.0


class GrantError(Exception):
    """The allow map refused the answered addresses; the question gets SERVFAIL."""


@dataclass(frozen=True, slots=True)
class Grant:
    """Open ``address`` on ``port`` (0 = every port) for rule ``slot`` until ``expires_ns``."""

    address: IPAddress
    port: int
    slot: int
    expires_ns: int
    transports: int = AF_TCP  # AF_TCP / AF_UDP bits of the rule


class GrantSink(Protocol):
    """Where the proxy writes the addresses it hands out (the kernel allow maps)."""

    def grant(self, cgroup_id: int, grants: Sequence[Grant]) -> None:
        """Insert the grants; must be done when it returns."""

    def revoke(self, cgroup_id: int, keys: Sequence[tuple[IPAddress, int]]) -> None:
        """Delete expired entries ``(address, port)`` (their quota is free again)."""


# Called for every refused question with (sandbox id, name, record type) and the keywords
# ``rule_id`` (``default-deny``, ``dns.qtype``, ``dns.malformed``, ...) and ``reason``.
RefusalCallback = Callable[..., None]


_Key = tuple[IPAddress, int]  # (address, port) of an allow-map entry


@dataclass
class _Sandbox:
    cgroup_id: int
    plan: EgressPlan
    port: int = 0
    udp: list[asyncio.DatagramTransport] = field(default_factory=list)
    tcp: list[asyncio.Server] = field(default_factory=list)
    # (address, port) -> expiry of what this sandbox holds in the allow map (its quota).
    ledger: dict[_Key, int] = field(default_factory=dict)
    tokens: float = 0.0
    refilled_ns: int = 0
    tcp_open: int = 0
    # rule id -> (kernel slot, ports as keys, transport bits): the grant of each rule
    rules: dict[str, tuple[int, tuple[int, ...], int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.set_plan(self.plan)

    def set_plan(self, plan: EgressPlan) -> None:
        self.plan = plan
        self.rules = {
            rule.id: (slot, rule_ports(rule), transport_flags(rule))
            for slot, rule in enumerate(plan.rules, start=1)
        }


class _UdpServer(asyncio.DatagramProtocol):
    def __init__(self, proxy: DnsProxy, sandbox: _Sandbox) -> None:
        self.proxy = proxy
        self.sandbox = sandbox
        self.transport: asyncio.DatagramTransport | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        # Screened here, before any task: every datagram counts against the sandbox's rate
        # (runts and responses too), and one refused or dropped costs no task.
        early = self.proxy.screen(self.sandbox, data)
        if early is not None:
            self._send(early, addr)
            return
        task = asyncio.get_running_loop().create_task(self._reply(data, addr))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _reply(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        self._send(await self.proxy.answer(self.sandbox, data, udp=True), addr)

    def _send(self, wire: bytes | None, addr: tuple[str | int, ...]) -> None:
        if wire and self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(wire, addr)


def proxy_port_range(
    ephemeral: Path = Path("/proc/sys/net/ipv4/ip_local_port_range"),
) -> tuple[int, int] | None:
    """The ports above the kernel's ephemeral range (where no autobind, ``bind(port 0)`` or
    ``listen()`` without a bind ever lands), for the DNS proxy's listeners; the egress hooks
    refuse every sandbox a bind there. None when fewer than 256 are left above it."""
    try:
        high = int(ephemeral.read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    if 65535 - high < 256:
        log.warning(
            "DNS proxy: net.ipv4.ip_local_port_range ends at %d, leaving no range above it; "
            "the proxy's listeners take ephemeral ports, which a sandbox's autobind may take "
            "while the node agent restarts (end the range at 65279 or lower to close this)",
            high,
        )
        return None
    return high + 1, 65535


def ports_to_try(ports: tuple[int, int]) -> Iterator[int]:
    """Every port of ``ports`` (low, high), from a random one on: where a node agent's
    loopback listener may take one (its DNS listeners, a sandbox's HTTPS proxy)."""
    low, high = ports
    size = high - low + 1
    start = random.randrange(size)
    for i in range(size):
        yield low + (start + i) % size


class DnsProxy:
    """Per-sandbox DNS listeners that answer by policy and fill the kernel allow map."""

    def __init__(
        self,
        upstream: UpstreamClient,
        sink: GrantSink,
        *,
        listen4: str = "127.0.0.1",
        listen6: str | None = "::1",
        deny_rcode: dns.rcode.Rcode = dns.rcode.NXDOMAIN,
        ttl_grace_s: float = 2.0,
        clock: Callable[[], int] = time.monotonic_ns,
        bounds: DnsBounds | None = None,
        protected: Iterable[IPAddress] = (),
        trusted: tuple[IPNetwork, ...] = (),
        ports: tuple[int, int] | None = None,
    ) -> None:
        """Create the proxy (listens nothing until `serve`).

        Args:
            upstream: the resolver asked for allowed names.
            sink: the kernel allow maps.
            listen4: IPv4 address of every sandbox's listener (the hooks' redirect target).
            listen6: IPv6 address of the listeners, or None for IPv4 only.
            deny_rcode: answer for names no rule allows (NXDOMAIN or REFUSED).
            ttl_grace_s: seconds an answered address stays open past its TTL (clients connect
                right after resolving; a TTL of 0 must still let that connect through).
            clock: CLOCK_MONOTONIC in ns, the clock the kernel compares expiries against.
            bounds: TTL cap, allow-map quotas, answer size, query rate and size (`DnsBounds`).
            protected: the node's own and the stack's servers' addresses: answers pointing there
                are refused unless the rule sets ``allow_internal_only``.
            trusted: networks the operator lets DNS answers open although they are loopback or
                the node's (``DSEC_DNS_TRUSTED_TARGETS``); never link-local or multicast.
            ports: the range the listeners' ports come from (:func:`proxy_port_range`: above
                the kernel's ephemeral ports, which no sandbox may bind); None: any free port.
        """
        if deny_rcode not in (dns.rcode.NXDOMAIN, dns.rcode.REFUSED):
            raise ValueError(f"deny_rcode: expected NXDOMAIN or REFUSED, got {deny_rcode!r}")
        self.upstream = upstream
        self.sink = sink
        self.listen4 = listen4
        self.listen6 = listen6
        self.deny_rcode = deny_rcode
        self.ttl_grace_ns = int(ttl_grace_s * 1e9)
        self.clock = clock
        self.bounds = bounds or DnsBounds()
        self.protected: frozenset[IPAddress] = frozenset(unmap(a) for a in protected)
        self.trusted = trusted
        self.ports = ports
        self._types = frozenset(_ADDRESS_TYPES) | {
            dns.rdatatype.from_text(t) for t in self.bounds.extra_qtypes
        }
        self._sandboxes: dict[int, _Sandbox] = {}
        # Called for every refused question (see `RefusalCallback`), so a refusal is an event
        # and not only a counter.
        self.on_denied: RefusalCallback | None = None

    # --- lifecycle -------------------------------------------------------------------------

    def _candidates(self, port: int) -> Iterator[int]:
        """Ports to try: ``port`` (a re-adoption's) when it is in :attr:`ports`, then
        :func:`ports_to_try` (0, the kernel's choice, when there is no range)."""
        if self.ports is None:
            yield from ([port] if port else []) + [0] * 20
            return
        if port and self.in_range(port):
            yield port
        yield from ports_to_try(self.ports)

    def in_range(self, port: int) -> bool:
        """Whether ``port`` is one the bind hooks keep every sandbox from (see :attr:`ports`)."""
        return self.ports is None or self.ports[0] <= port <= self.ports[1]

    async def serve(self, cgroup_id: int, plan: EgressPlan, port: int = 0) -> int:
        """Start the listeners of one sandbox and return their port.

        ``port`` asks for a specific port (re-adoption after a restart); when it is taken, or
        lies outside :attr:`ports` (a listener of an older agent, among the ephemeral ports an
        autobind may take), a free one of the range is chosen and returned instead.
        """
        if cgroup_id in self._sandboxes:
            raise ValueError(f"cgroup {cgroup_id}: DNS listeners already running")
        sandbox = _Sandbox(
            cgroup_id=cgroup_id,
            plan=plan,
            tokens=float(self.bounds.query_burst),
            refilled_ns=self.clock(),
        )
        for want in self._candidates(port):
            try:  # (to its end: asyncio drops a server cancelled at its last step, bound)
                await to_the_end(self._bind(sandbox, want))
            except BaseException as exc:  # a cancel too: the listeners bound so far are closed
                await self._unbind(sandbox)
                if not isinstance(exc, OSError) or exc.errno != errno.EADDRINUSE:
                    raise
                continue
            self._sandboxes[cgroup_id] = sandbox
            return sandbox.port
        raise OSError(errno.EADDRINUSE, "no free port for the DNS proxy listeners")

    def update(self, cgroup_id: int, plan: EgressPlan) -> None:
        """Answer later questions of this sandbox with a new plan."""
        self._sandboxes[cgroup_id].set_plan(plan)

    def adopt(self, cgroup_id: int, entries: Iterable[tuple[IPAddress, int, int]]) -> None:
        """Count entries ``(address, port, expires_ns)`` a previous agent granted (quota)."""
        ledger = self._sandboxes[cgroup_id].ledger
        for address, port, expires in entries:
            ledger[(address, port)] = max(expires, ledger.get((address, port), 0))

    def held(self, cgroup_id: int) -> int:
        """Allow-map entries a sandbox holds (what counts against its quota)."""
        sandbox = self._sandboxes.get(cgroup_id)
        return len(sandbox.ledger) if sandbox else 0

    def expire(self) -> int:
        """Revoke every sandbox's expired entries; return how many (the periodic sweep)."""
        return sum(self._expire(s) for s in list(self._sandboxes.values()))

    def port_of(self, cgroup_id: int) -> int | None:
        """The listening port of a sandbox, or None."""
        sandbox = self._sandboxes.get(cgroup_id)
        return sandbox.port if sandbox else None

    async def stop(self, cgroup_id: int) -> None:
        """Stop the listeners of one sandbox (no-op when none run)."""
        sandbox = self._sandboxes.pop(cgroup_id, None)
        if sandbox is not None:
            await self._unbind(sandbox)

    async def close(self) -> None:
        """Stop every listener and the upstream socket."""
        for cgroup_id in list(self._sandboxes):
            await self.stop(cgroup_id)
        self.upstream.close()

    async def _bind(self, sandbox: _Sandbox, port: int) -> None:
        loop = asyncio.get_running_loop()
        hosts = [self.listen4] + ([self.listen6] if self.listen6 else [])
        for host in hosts:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _UdpServer(self, sandbox), local_addr=(host, port)
            )
            sandbox.udp.append(transport)
            port = port or transport.get_extra_info("sockname")[1]
        for host in hosts:
            server = await asyncio.start_server(
                lambda r, w: self._tcp_client(sandbox, r, w),
                host=host,
                port=port,
                reuse_address=True,
            )
            sandbox.tcp.append(server)
        sandbox.port = port

    async def _unbind(self, sandbox: _Sandbox) -> None:
        for transport in sandbox.udp:
            transport.close()
        for server in sandbox.tcp:
            server.close()
            with contextlib.suppress(Exception):
                await server.wait_closed()
        sandbox.udp.clear()
        sandbox.tcp.clear()

    async def _tcp_client(
        self, sandbox: _Sandbox, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        limit = self.bounds.max_tcp_connections
        if sandbox.tcp_open >= limit:  # the agent's sockets are the node's: bounded per sandbox
            self._refuse(
                sandbox, "?", "?", "dns.tcp", f"more than {limit} open TCP connections to DNS"
            )
            writer.close()
            return
        sandbox.tcp_open += 1
        try:
            while True:
                async with asyncio.timeout(_TCP_IDLE_S):
                    (length,) = struct.unpack("!H", await reader.readexactly(2))
                    data = await reader.readexactly(length)
                early = self.screen(sandbox, data)
                wire = early if early is not None else await self.answer(sandbox, data, udp=False)
                if not wire:  # dropped: nothing sensible to say on this connection
                    break
                writer.write(struct.pack("!H", len(wire)) + wire)
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            sandbox.tcp_open -= 1
            writer.close()

    # --- answering -------------------------------------------------------------------------

    def _refuse(self, sandbox: _Sandbox, name: str, rdtype: str, rule_id: str, reason: str) -> None:
        DNS_REFUSALS.labels(metric_rule(rule_id)).inc()
        if self.on_denied is not None:
            self.on_denied(sandbox.plan.sandbox_id, name, rdtype, rule_id=rule_id, reason=reason)

    def _rate_ok(self, sandbox: _Sandbox) -> bool:
        now = self.clock()
        refill = (now - sandbox.refilled_ns) / 1e9 * self.bounds.queries_per_s
        sandbox.tokens = min(float(self.bounds.query_burst), sandbox.tokens + refill)
        sandbox.refilled_ns = now
        if sandbox.tokens < 1.0:
            return False
        sandbox.tokens -= 1.0
        return True

    def _screen_message(self, query: dns.message.Message) -> _Refused | None:
        """The opcode and the sections: a plain query, or a refusal."""
        if query.opcode() != dns.opcode.QUERY:
            opcode = dns.opcode.to_text(query.opcode())
            return _Refused(dns.rcode.NOTIMP, "dns.opcode", f"opcode {opcode} (only QUERY)")
        odd = _odd_sections(query)
        if odd is not None:
            return _Refused(dns.rcode.FORMERR, "dns.malformed", odd)
        return None

    def _screen_question(
        self, question: dns.rrset.RRset, name: str, match: NameMatch | None
    ) -> _Refused | None:
        """The record type and the name of an allowed question: answered, or a refusal."""
        if question.rdclass != dns.rdataclass.IN or question.rdtype not in self._types:
            kinds = ", ".join(sorted(dns.rdatatype.to_text(t) for t in self._types))
            return _Refused(
                dns.rcode.REFUSED,
                "dns.qtype",
                f"record type {dns.rdatatype.to_text(question.rdtype)} (class "
                f"{dns.rdataclass.to_text(question.rdclass)}): only {kinds} are answered",
            )
        if not _HOSTNAME.fullmatch(name.lower()):
            return _Refused(
                dns.rcode.REFUSED,
                "dns.name",
                "a name of letters, digits, '-' and '_' is answered, nothing else",
            )
        limit = self.bounds.max_wildcard_prefix
        if match is not None and wildcard_prefix(match, name) > limit:
            return _Refused(
                dns.rcode.REFUSED,
                "dns.name",
                f"a wildcard rule lets at most {limit} characters of a name be chosen",
            )
        return None

    def screen(self, sandbox: _Sandbox, data: bytes) -> bytes | None:
        """What to answer ``sandbox`` at once, before any parsing: ``b""`` (drop) or a refusal
        for a datagram over its rate (every one counts, garbage too) or not even a query;
        ``None``: go on (:meth:`answer`)."""
        bounds = self.bounds
        no_query = len(data) < 12 or bool(data[2] & 0x80)  # no header, or a response
        if not self._rate_ok(sandbox):  # first: a flood of garbage is a flood too
            if no_query:
                return b""  # nothing to answer: dropped, counted
            self._refuse(
                sandbox,
                "?",
                "?",
                "dns.rate",
                f"more than {bounds.queries_per_s:g} queries/s (burst {bounds.query_burst})",
            )
            return _refused_reply(data, bounds.max_query_bytes)
        return b"" if no_query else None

    async def answer(self, sandbox: _Sandbox, data: bytes, *, udp: bool) -> bytes | None:
        """The wire answer to one question of ``sandbox`` that :meth:`screen` let through
        (``None``: drop it).

        The question is parsed and screened; upstream gets a fresh minimal query of our own
        (one lower-cased question, our EDNS OPT, a new id), never the sandbox's bytes.
        """
        bounds = self.bounds
        if len(data) > bounds.max_query_bytes:
            self._refuse(
                sandbox,
                "?",
                "?",
                "dns.malformed",
                f"a query of {len(data)} bytes (at most {bounds.max_query_bytes})",
            )
            return _header_reply(data, dns.rcode.FORMERR)
        try:
            query = dns.message.from_wire(data)
        except dns.exception.DNSException as exc:
            self._refuse(sandbox, "?", "?", "dns.malformed", f"unreadable query: {exc}")
            return _header_reply(data, dns.rcode.FORMERR)
        max_size = 65535
        if udp:
            max_size = max(512, min(query.payload, 65535)) if query.edns >= 0 else 512
        made: list[dns.message.Message] = []

        def response() -> dns.message.Message:  # built only when the answer is not forwarded
            if not made:
                made.append(dns.message.make_response(query, recursion_available=True))
            return made[0]

        def reply(rcode: dns.rcode.Rcode) -> bytes:
            response().set_rcode(rcode)
            return response().to_wire(max_size=max_size, prefer_truncation=True)

        name, qtype = "?", "?"
        if len(query.question) == 1:
            name = query.question[0].name.to_text(omit_final_dot=True)
            qtype = dns.rdatatype.to_text(query.question[0].rdtype)
        refused = self._screen_message(query)
        if refused is not None:
            self._refuse(sandbox, name, qtype, refused.rule_id, refused.reason)
            return reply(refused.rcode)
        question = query.question[0]
        action, match = decide_query(sandbox.plan, name)
        DNS_QUERIES.labels(action.value).inc()
        if action is QueryAction.DENY:
            self._refuse(sandbox, name, qtype, "default-deny", f"{name} matches no egress rule")
            return reply(self.deny_rcode)
        refused = self._screen_question(question, name, match)
        if refused is not None:
            self._refuse(sandbox, name, qtype, refused.rule_id, refused.reason)
            return reply(refused.rcode)
        qname = question.name  # upstream gets it lower-cased (UpstreamClient.ask)
        try:
            first = await self.upstream.ask(qname, question.rdtype)
            answer = first.message
            chain, final, followed = await self._follow(answer, qname, question.rdtype)
            kept: list[dns.rrset.RRset] = list(chain)
            shown = [*chain, *([_first(final, bounds.max_addresses)] if final else [])]
            if udp and not _fits(query, response, shown, max_size):
                # The client retries over TCP: open nothing for an answer it will not see.
                response().flags |= dns.flags.TC
                return reply(answer.rcode())
            if final is not None and action is QueryAction.RESOLVE and match is not None:
                final = self._open(sandbox, name, qtype, final, chain, match)
            if final is not None:
                kept.append(final)
        except (UpstreamError, GrantError) as exc:
            log.warning("sandbox %s: %s", sandbox.plan.sandbox_id, exc)
            DNS_QUERIES.labels("servfail").inc()
            return reply(dns.rcode.SERVFAIL)
        except _QuotaFull:
            return reply(dns.rcode.SERVFAIL)
        if not followed:
            forwarded = _forwardable(data, query, first, kept, bounds.max_ttl_s, max_size)
            if forwarded is not None:
                return forwarded
        response().answer = [_capped(rr, bounds.max_ttl_s) for rr in kept]
        response().authority = [
            _capped(rr, bounds.max_ttl_s)
            for rr in answer.authority
            if rr.rdtype == dns.rdatatype.SOA and not kept
        ]
        return reply(answer.rcode())

    async def _ask(
        self, name: dns.name.Name, rdtype: dns.rdatatype.RdataType
    ) -> dns.message.Message:
        return (await self.upstream.ask(name, rdtype)).message

    async def _follow(
        self, answer: dns.message.Message, qname: dns.name.Name, rdtype: dns.rdatatype.RdataType
    ) -> tuple[list[dns.rrset.RRset], dns.rrset.RRset | None, bool]:
        """The CNAME chain from ``qname``, its final address rrset (asked for when the
        upstream's answer stops at a name outside its zone) and whether more was asked. Sets
        ``answer``'s rcode to the last answer's."""
        records = list(answer.answer)
        chain, last, final = _walk(records, qname, rdtype)
        hops = 0
        while final is None and last is not None and last != qname and hops < MAX_CNAME_HOPS:
            hops += 1
            more = await self._ask(last, rdtype)
            answer.set_rcode(more.rcode())
            answer.authority = list(more.authority)
            records.extend(rr for rr in more.answer if rr not in records)
            chain, next_last, final = _walk(records, qname, rdtype)
            if next_last == last:
                break
            last = next_last
        return chain, final, hops > 0

    def _open(
        self,
        sandbox: _Sandbox,
        name: str,
        qtype: str,
        final: dns.rrset.RRset,
        chain: list[dns.rrset.RRset],
        match: NameMatch,
    ) -> dns.rrset.RRset | None:
        """Open the addresses of ``final`` the rules grant, within the bounds; return the rrset
        the sandbox may see (None when nothing is left).

        Raises:
            GrantError: the kernel refused the entries.
            _QuotaFull: nothing fits in the sandbox's quota (refusal reported).
        """
        bounds = self.bounds
        answered = [unmap(dns_address(rd.address)) for rd in final]
        per_rule: list[tuple[EgressRule, set[IPAddress]]] = [(r, set()) for r in match.rules]
        refused: dict[IPAddress, str] = {}
        for address in answered:
            reasons = []
            for rule, ok in per_rule:
                may, reason = screen_answer(
                    rule, address, match.exact, self.protected, self.trusted
                )
                if may:
                    ok.add(address)
                reasons.append(reason)
            if reasons[0] is not None and all(r is not None for r in reasons):
                refused[address] = reasons[0]
        if refused:
            self._refuse(
                sandbox,
                name,
                qtype,
                "dns.rebinding",
                "answer addresses refused: " + "; ".join(refused.values()),
            )
        wanted = [a for a in answered if any(a in ok for _, ok in per_rule)]
        if len(wanted) > bounds.max_addresses:
            DNS_TRUNCATED.inc()
            wanted = wanted[: bounds.max_addresses]
        ttl = min([final.ttl, *(rr.ttl for rr in chain), bounds.max_ttl_s])
        now = self.clock()
        expires = now + ttl * 1_000_000_000 + self.ttl_grace_ns
        accepted, grants, over, before = self._within_quota(sandbox, wanted, per_rule, expires)
        if over:
            self._refuse(
                sandbox,
                name,
                qtype,
                "dns.quota",
                f"{len(over)} answer addresses not opened: the sandbox holds "
                f"{len(sandbox.ledger)} of its {self._quota()} allow-map entries",
            )
            if not accepted:
                raise _QuotaFull
        if grants:
            try:
                self.sink.grant(sandbox.cgroup_id, grants)  # before the answer leaves
            except Exception as exc:
                for key, old in before.items():  # nothing was promised: undo the ledger
                    if old is None:
                        sandbox.ledger.pop(key, None)
                    else:
                        sandbox.ledger[key] = old
                raise GrantError(f"cannot open {len(grants)} addresses: {exc}") from exc
            DNS_GRANTS.inc(len(accepted))
        kept = [rd for rd, a in zip(final, answered, strict=True) if a in accepted]
        if not kept:
            return None
        if len(kept) == len(final):
            return final  # unchanged: the upstream's encoding may be forwarded
        return dns.rrset.from_rdata_list(final.name, final.ttl, kept)

    def _quota(self) -> int:
        """A sandbox's quota now: the operator's, or its fair share when the node is crowded."""
        share = self.bounds.node_capacity // max(1, len(self._sandboxes))
        return min(self.bounds.sandbox_quota, share)

    def _within_quota(
        self,
        sandbox: _Sandbox,
        wanted: list[IPAddress],
        per_rule: list[tuple[EgressRule, set[IPAddress]]],
        expires: int,
    ) -> tuple[set[IPAddress], list[Grant], list[IPAddress], dict[_Key, int | None]]:
        """Split ``wanted`` into the addresses that fit the quotas (with their grants) and
        those that do not, and note them in the ledger (returning its previous values).
        Refreshing an entry the sandbox holds costs nothing."""
        quota = self._quota()
        ledger = sandbox.ledger
        node_held = sum(len(s.ledger) for s in self._sandboxes.values())
        accepted: set[IPAddress] = set()
        grants: list[Grant] = []
        over: list[IPAddress] = []
        before: dict[_Key, int | None] = {}
        expired_once = False
        for address in wanted:
            plain = unmap(address)
            mine = [
                Grant(plain, port, slot, expires, transports)
                for rule, ok in per_rule
                if plain in ok
                for slot, ports, transports in (sandbox.rules[rule.id],)
                for port in ports
            ]
            new = {(g.address, g.port) for g in mine} - ledger.keys()
            if new and len(ledger) + len(new) > quota and not expired_once:
                expired_once = True
                node_held -= self._expire(sandbox)
                new = {(g.address, g.port) for g in mine} - ledger.keys()
            node_full = node_held + len(new) > self.bounds.node_capacity
            if new and (len(ledger) + len(new) > quota or node_full):
                over.append(plain)
                continue
            for g in mine:
                key = (g.address, g.port)
                before.setdefault(key, ledger.get(key))
                ledger[key] = max(g.expires_ns, ledger.get(key, 0))
            node_held += len(new)
            accepted.add(plain)
            grants.extend(mine)
        return accepted, grants, over, before

    def _expire(self, sandbox: _Sandbox) -> int:
        """Drop the sandbox's expired entries from its ledger and the kernel maps."""
        now = self.clock()
        stale = [key for key, expires in sandbox.ledger.items() if expires < now]
        if not stale:
            return 0
        try:
            self.sink.revoke(sandbox.cgroup_id, stale)
        except Exception:
            log.exception("revoking expired DNS grants of %s failed", sandbox.plan.sandbox_id)
            return 0
        for key in stale:
            del sandbox.ledger[key]
        return len(stale)


@dataclass(frozen=True, slots=True)
class _Refused:
    """A question the proxy will not ask upstream: its answer code and the refusal's rule id."""

    rcode: dns.rcode.Rcode
    rule_id: str
    reason: str


class _QuotaFull(Exception):
    """No answered address fits the sandbox's quota (the refusal is already reported)."""


def _odd_sections(query: dns.message.Message) -> str | None:
    """Why a query is not a plain one-question query, or None."""
    if len(query.question) != 1:
        return f"{len(query.question)} questions (exactly one is answered)"
    if query.answer or query.authority or query.additional:
        return "records in the answer, authority or additional section of a query"
    if query.had_tsig:
        return "a TSIG-signed query"
    return None


def _first(rrset: dns.rrset.RRset, count: int) -> dns.rrset.RRset:
    """At most ``count`` records of ``rrset`` (the first ones)."""
    if len(rrset) <= count:
        return rrset
    return dns.rrset.from_rdata_list(rrset.name, rrset.ttl, list(rrset)[:count])


def _forwardable(
    data: bytes,
    query: dns.message.Message,
    upstream: UpstreamAnswer,
    kept: list[dns.rrset.RRset],
    max_ttl: int,
    max_size: int,
) -> bytes | None:
    """The upstream's own encoding under the sandbox's id and question, when it says exactly
    what the sandbox may see (the common case: saves re-encoding); None otherwise.

    Only an answer whose answer section is ``kept`` record for record, with no authority or
    additional records, no EDNS options, no TTL over the cap, and that fits, is forwarded.
    """
    answer = upstream.message
    if (
        len(answer.answer) != len(kept)
        or any(a is not b for a, b in zip(answer.answer, kept, strict=True))
        or answer.authority
        or answer.additional
        or answer.options
        or answer.had_tsig
        or any(rr.ttl > max_ttl for rr in kept)
    ):
        return None
    wire = upstream.wire
    end = 12 + _name_length(query.question[0].name) + 4  # the question, never compressed
    flags = (wire[2] & ~0x01 | data[2] & 0x01).to_bytes(1, "big")  # the sandbox's RD bit
    counts = wire[4:12]
    tail = wire[end:]
    if answer.edns >= 0 and query.edns < 0:  # no OPT for a client that sent none
        tail = tail[:-11]
        counts = counts[:6] + (int.from_bytes(counts[6:], "big") - 1).to_bytes(2, "big")
    out = data[:2] + flags + wire[3:4] + counts + data[12:end] + tail
    return out if len(out) <= max_size else None


def _fits(
    query: dns.message.Message,
    response: Callable[[], dns.message.Message],
    records: list[dns.rrset.RRset],
    max_size: int,
) -> bool:
    """Whether ``records`` fit in the client's UDP size (an upper bound first, then a render)."""
    question = sum(_name_length(q.name) + 4 for q in query.question)
    bound = (
        12
        + question
        + 11
        + sum(
            len(rr) * (_name_length(rr.name) + 10 + _RDATA_MAX.get(rr.rdtype, 255))
            for rr in records
        )
    )
    if bound <= max_size:
        return True
    message = response()
    message.answer = records
    try:
        message.to_wire(max_size=max_size)
    except dns.exception.TooBig:
        return False
    finally:
        message.answer = []
    return True


_RDATA_MAX = {dns.rdatatype.A: 4, dns.rdatatype.AAAA: 16}


def _name_length(name: dns.name.Name) -> int:
    return sum(len(label) + 1 for label in name.labels)


def _refused_reply(data: bytes, max_query_bytes: int) -> bytes:
    """REFUSED with the question echoed when the query reads as one (stub resolvers such as
    glibc ignore an answer without it), a bare header otherwise."""
    if len(data) <= max_query_bytes:
        with contextlib.suppress(dns.exception.DNSException):
            query = dns.message.from_wire(data)
            if len(query.question) == 1:
                response = dns.message.make_response(query)
                response.set_rcode(dns.rcode.REFUSED)
                return response.to_wire(max_size=512, prefer_truncation=True)
    return _header_reply(data, dns.rcode.REFUSED)


def _header_reply(data: bytes, rcode: dns.rcode.Rcode) -> bytes:
    """A bare answer header (no sections) under the query's id, for what cannot be parsed."""
    flags = 0x8000 | (data[2] << 8 & 0x7900) | int(rcode)  # QR, the opcode and RD, rcode
    return data[:2] + struct.pack("!HHHHH", flags, 0, 0, 0, 0)


def _capped(rrset: dns.rrset.RRset, max_ttl: int) -> dns.rrset.RRset:
    if rrset.ttl <= max_ttl:
        return rrset
    return dns.rrset.from_rdata_list(rrset.name, max_ttl, list(rrset))


def dns_address(text: str) -> IPAddress:
    """Parse an A/AAAA rdata address."""
    return ipaddress.ip_address(text)


def _walk(
    answer: list[dns.rrset.RRset], qname: dns.name.Name, rdtype: dns.rdatatype.RdataType
) -> tuple[list[dns.rrset.RRset], dns.name.Name | None, dns.rrset.RRset | None]:
    """Follow CNAMEs from ``qname``: (the CNAME rrsets, the last name, its address rrset).

    The last name is None when the chain loops or is too long (then nothing is answered).
    """
    name, seen = qname, set()
    chain: list[dns.rrset.RRset] = []
    for _ in range(MAX_CNAME_HOPS * 2):
        if name in seen:
            return [], None, None
        seen.add(name)
        for rrset in answer:
            if rrset.name == name and rrset.rdtype == rdtype:
                return chain, name, rrset
        cname = next(
            (rr for rr in answer if rr.name == name and rr.rdtype == dns.rdatatype.CNAME), None
        )
        if cname is None:
            return chain, name, None
        chain.append(cname)
        name = cname[0].target
    return [], None, None
