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
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
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
from prometheus_client import Counter

from dsec_nodeagent.dns.policy import NameMatch, QueryAction, decide_query
from dsec_nodeagent.dns.upstream import UpstreamClient, UpstreamError
from dsec_nodeagent.ebpf.domain import grantable, rule_ports
from dsec_nodeagent.ebpf.model import EgressPlan, IPAddress

log = logging.getLogger(__name__)

DNS_QUERIES = Counter(
    "dsec_dns_queries",
    "Questions the node agent's DNS proxy answered, by sandbox and action",
    ["sandbox", "action"],
)
DNS_GRANTS = Counter(
    "dsec_dns_granted_addresses",
    "Addresses opened in a sandbox's allow map from DNS answers",
    ["sandbox"],
)

MAX_CNAME_HOPS = 8
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


class GrantSink(Protocol):
    """Where the proxy writes the addresses it hands out (the kernel allow maps)."""

    def grant(self, cgroup_id: int, grants: Sequence[Grant]) -> None:
        """Insert the grants; must be done when it returns."""


@dataclass
class _Sandbox:
    cgroup_id: int
    plan: EgressPlan
    port: int = 0
    udp: list[asyncio.DatagramTransport] = field(default_factory=list)
    tcp: list[asyncio.Server] = field(default_factory=list)


class _UdpServer(asyncio.DatagramProtocol):
    def __init__(self, proxy: DnsProxy, sandbox: _Sandbox) -> None:
        self.proxy = proxy
        self.sandbox = sandbox
        self.transport: asyncio.DatagramTransport | None = None
        self.tasks: set[asyncio.Task[None]] = set()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.DatagramTransport, transport)

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        task = asyncio.get_running_loop().create_task(self._reply(data, addr))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _reply(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        wire = await self.proxy.answer(self.sandbox, data, udp=True)
        if wire is not None and self.transport is not None and not self.transport.is_closing():
            self.transport.sendto(wire, addr)


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
        self._sandboxes: dict[int, _Sandbox] = {}
        # Called with (sandbox id, name, record type) for every refused question, so a refusal
        # is an event and not only a counter.
        self.on_denied: Callable[[str, str, str], None] | None = None

    # --- lifecycle -------------------------------------------------------------------------

    async def serve(self, cgroup_id: int, plan: EgressPlan, port: int = 0) -> int:
        """Start the listeners of one sandbox and return their port.

        ``port`` asks for a specific port (re-adoption after a restart); when it is taken a free
        one is chosen and returned instead.
        """
        if cgroup_id in self._sandboxes:
            raise ValueError(f"cgroup {cgroup_id}: DNS listeners already running")
        sandbox = _Sandbox(cgroup_id=cgroup_id, plan=plan)
        for attempt in range(20):
            want = port if attempt == 0 else 0
            try:
                await self._bind(sandbox, want)
            except OSError as exc:
                await self._unbind(sandbox)
                if exc.errno != errno.EADDRINUSE:
                    raise
                continue
            self._sandboxes[cgroup_id] = sandbox
            return sandbox.port
        raise OSError(errno.EADDRINUSE, "no free port for the DNS proxy listeners")

    def update(self, cgroup_id: int, plan: EgressPlan) -> None:
        """Answer later questions of this sandbox with a new plan."""
        self._sandboxes[cgroup_id].plan = plan

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
        try:
            while True:
                async with asyncio.timeout(_TCP_IDLE_S):
                    (length,) = struct.unpack("!H", await reader.readexactly(2))
                    data = await reader.readexactly(length)
                wire = await self.answer(sandbox, data, udp=False)
                if wire is None:
                    break
                writer.write(struct.pack("!H", len(wire)) + wire)
                await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    # --- answering -------------------------------------------------------------------------

    async def answer(self, sandbox: _Sandbox, data: bytes, *, udp: bool) -> bytes | None:
        """The wire answer to one question of ``sandbox`` (None: drop it)."""
        try:
            query = dns.message.from_wire(data)
        except dns.exception.DNSException:
            return None  # not DNS, or a response: nothing sensible to say
        if query.flags & dns.flags.QR:
            return None
        max_size = 65535
        if udp:
            max_size = query.payload if query.edns >= 0 else 512
        response = dns.message.make_response(query, recursion_available=True)
        if query.opcode() != dns.opcode.QUERY or len(query.question) != 1:
            response.set_rcode(dns.rcode.NOTIMP if len(query.question) == 1 else dns.rcode.FORMERR)
            return response.to_wire(max_size=max_size, prefer_truncation=True)
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True)
        action, match = decide_query(sandbox.plan, name)
        DNS_QUERIES.labels(sandbox.plan.sandbox_id, action.value).inc()
        if action is QueryAction.DENY:
            if self.on_denied is not None:
                self.on_denied(
                    sandbox.plan.sandbox_id, name, dns.rdatatype.to_text(question.rdtype)
                )
            response.set_rcode(self.deny_rcode)
            return response.to_wire(max_size=max_size, prefer_truncation=True)
        try:
            upstream = await self.upstream.exchange(query, data)
            answer = upstream.message
            changed = False
            if (
                match is not None
                and question.rdtype in _ADDRESS_TYPES
                and answer.rcode() == dns.rcode.NOERROR
            ):
                changed = await self._resolve(
                    sandbox, answer, question.name, question.rdtype, match
                )
        except (UpstreamError, GrantError) as exc:
            log.warning("sandbox %s: %s", sandbox.plan.sandbox_id, exc)
            DNS_QUERIES.labels(sandbox.plan.sandbox_id, "servfail").inc()
            response.set_rcode(dns.rcode.SERVFAIL)
            return response.to_wire(max_size=max_size, prefer_truncation=True)
        if not changed and len(upstream.wire) <= max_size:
            return data[:2] + upstream.wire[2:]  # the upstream's answer under the client's id
        response.set_rcode(answer.rcode())
        response.answer = list(answer.answer)
        response.authority = list(answer.authority)
        return response.to_wire(max_size=max_size, prefer_truncation=True)

    async def _ask(
        self,
        name: dns.name.Name,
        rdtype: dns.rdatatype.RdataType,
        rdclass: dns.rdataclass.RdataClass,
    ) -> dns.message.Message:
        question = dns.message.make_query(name, rdtype, rdclass)
        question.flags |= dns.flags.RD
        return (await self.upstream.query(question)).message

    async def _resolve(
        self,
        sandbox: _Sandbox,
        answer: dns.message.Message,
        qname: dns.name.Name,
        rdtype: dns.rdatatype.RdataType,
        match: NameMatch,
    ) -> bool:
        """Complete the CNAME chain, open the granted addresses, drop the others from ``answer``.

        Returns whether ``answer`` was changed (then it must be re-encoded).
        """
        final, ttl = _walk(answer.answer, qname, rdtype)
        hops = 0
        while final is not None and final[1] is None and hops < MAX_CNAME_HOPS:
            # The chain leaves the upstream's zone: ask for the target ourselves.
            hops += 1
            more = await self._ask(final[0], rdtype, dns.rdataclass.IN)
            answer.set_rcode(more.rcode())
            answer.answer.extend(rr for rr in more.answer if rr not in answer.answer)
            answer.authority = list(more.authority)
            final, ttl = _walk(answer.answer, qname, rdtype)
        if final is None or final[1] is None:
            return hops > 0
        answered = [dns_address(rd.address) for rd in final[1]]
        granted: set[IPAddress] = set()
        expires = self.clock() + ttl * 1_000_000_000 + self.ttl_grace_ns
        grants: list[Grant] = []
        for rule in match.rules:
            slot = sandbox.plan.slot(rule.id)
            for address in grantable(rule, answered, match.exact):
                granted.add(address)
                grants.extend(Grant(address, port, slot, expires) for port in rule_ports(rule))
        if grants:
            try:
                self.sink.grant(sandbox.cgroup_id, grants)  # before the answer leaves
            except Exception as exc:  # e.g. a full map: answer SERVFAIL, never an unusable name
                raise GrantError(f"cannot open {len(grants)} addresses: {exc}") from exc
            DNS_GRANTS.labels(sandbox.plan.sandbox_id).inc(len(granted))
        return _keep_only(answer, final[1], granted) or hops > 0


def dns_address(text: str) -> IPAddress:
    """Parse an A/AAAA rdata address."""
    return ipaddress.ip_address(text)


def _walk(
    answer: list[dns.rrset.RRset], qname: dns.name.Name, rdtype: dns.rdatatype.RdataType
) -> tuple[tuple[dns.name.Name, dns.rrset.RRset | None] | None, int]:
    """Follow CNAMEs from ``qname``; return ((last name, its address rrset or None), min TTL).

    Returns (None, 0) when the chain loops or is too long.
    """
    name, ttl, seen = qname, 2**31 - 1, set()
    for _ in range(MAX_CNAME_HOPS * 2):
        if name in seen:
            return None, 0
        seen.add(name)
        for rrset in answer:
            if rrset.name == name and rrset.rdtype == rdtype:
                return (name, rrset), min(ttl, rrset.ttl)
        cname = next(
            (rr for rr in answer if rr.name == name and rr.rdtype == dns.rdatatype.CNAME), None
        )
        if cname is None:
            return ((name, None), ttl) if name != qname else (None, 0)
        ttl = min(ttl, cname.ttl)
        name = cname[0].target
    return None, 0


def _keep_only(
    response: dns.message.Message, rrset: dns.rrset.RRset, granted: set[IPAddress]
) -> bool:
    """Remove the addresses the sandbox may not reach from its answer; True if any were."""
    kept = [rd for rd in rrset if dns_address(rd.address) in granted]
    if len(kept) == len(rrset):
        return False
    index = response.answer.index(rrset)
    if kept:
        response.answer[index] = dns.rrset.from_rdata_list(rrset.name, rrset.ttl, kept)
    else:
        del response.answer[index]
    return True
