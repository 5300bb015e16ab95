"""A real authoritative DNS server for tests: serves zones from text over UDP and TCP on loopback.

Deliberately minimal and strict, like an authoritative server: it answers only what its zones
hold, never follows a CNAME (so the proxy's own chain-following is exercised), truncates UDP
answers over the client's payload (so TCP fallback is exercised), and records every question.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from dataclasses import dataclass, field

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
import dns.zone

TEST_ZONE = """\
$ORIGIN test.
$TTL 300
@               SOA   ns.test. hostmaster.test. 1 3600 600 86400 60
@               NS    ns.test.
ns              A     127.0.0.1
allowed         A     127.0.0.10
allowed         AAAA  ::1
denied          A     127.0.0.20
other           A     127.0.0.21
www.wild        A     127.0.0.12
deep.a.wild     A     127.0.0.12
wild            A     127.0.0.14
alias           CNAME edge.cdn.test.
edge.cdn        A     127.0.0.15
loop1           CNAME loop2.test.
loop2           CNAME loop1.test.
mixed           A     127.0.0.13
mixed           A     203.0.113.5
short     2     A     127.0.0.11
txt             TXT   "hello"
"""


def big_zone_records(count: int = 100) -> str:
    """``big.test`` with ``count`` A records: too large for UDP (512 bytes and EDNS 1232)."""
    return "".join(f"big A 127.0.1.{i}\n" for i in range(1, count + 1))


@dataclass
class ZoneServer:
    """Authoritative server for the given zone texts (each with its own $ORIGIN)."""

    zone_texts: list[str]
    host: str = "127.0.0.1"
    port: int = 0
    questions: list[tuple[str, str, str]] = field(default_factory=list)  # (name, type, proto)
    _zones: list[dns.zone.Zone] = field(default_factory=list)
    _udp: asyncio.DatagramTransport | None = None
    _tcp: asyncio.Server | None = None

    async def start(self) -> ZoneServer:
        """Bind UDP and TCP on the same port and start answering."""
        self._zones = [dns.zone.from_text(text, relativize=False) for text in self.zone_texts]
        loop = asyncio.get_running_loop()
        server = self

        class Udp(asyncio.DatagramProtocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                self.transport = transport

            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                wire = server.answer(data, udp=True)
                if wire is not None:
                    self.transport.sendto(wire, addr)  # type: ignore[attr-defined]

        wanted = self.port
        for _ in range(20):  # UDP picks a free port; TCP may find that port taken: try again
            self._udp, _ = await loop.create_datagram_endpoint(Udp, local_addr=(self.host, wanted))
            self.port = self._udp.get_extra_info("sockname")[1]
            try:
                self._tcp = await asyncio.start_server(self._tcp_client, self.host, self.port)
            except OSError:
                self._udp.close()
                if wanted:
                    raise
                continue
            return self
        raise OSError(f"no port free for both UDP and TCP on {self.host}")

    async def close(self) -> None:
        """Stop serving."""
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            await self._tcp.wait_closed()

    @property
    def address(self) -> str:
        """``host:port`` (the DSEC_DNS_UPSTREAM value)."""
        return f"{self.host}:{self.port}"

    async def _tcp_client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                (length,) = struct.unpack("!H", await reader.readexactly(2))
                wire = self.answer(await reader.readexactly(length), udp=False)
                if wire is None:
                    break
                writer.write(struct.pack("!H", len(wire)) + wire)
                await writer.drain()
        writer.close()

    def answer(self, data: bytes, *, udp: bool) -> bytes | None:
        """Answer one query in wire format."""
        try:
            query = dns.message.from_wire(data)
        except Exception:
            return None
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        question = query.question[0]
        self.questions.append(
            (
                question.name.to_text(),
                dns.rdatatype.to_text(question.rdtype),
                "udp" if udp else "tcp",
            )
        )
        self._fill(response, question.name, question.rdtype)
        max_size = (query.payload if query.edns >= 0 else 512) if udp else 65535
        return response.to_wire(max_size=max_size, prefer_truncation=True)

    def _fill(
        self, response: dns.message.Message, name: dns.name.Name, rdtype: dns.rdatatype.RdataType
    ) -> None:
        zone = next((z for z in self._zones if z.origin and name.is_subdomain(z.origin)), None)
        if zone is None or zone.origin is None:
            response.set_rcode(dns.rcode.REFUSED)
            return
        node = zone.get_node(name)
        soa = zone.find_rrset(zone.origin, dns.rdatatype.SOA)
        if node is None:
            response.set_rcode(dns.rcode.NXDOMAIN)
            response.authority.append(soa)
            return
        for wanted in (rdtype, dns.rdatatype.CNAME):
            rdataset = node.get_rdataset(dns.rdataclass.IN, wanted)
            if rdataset is not None:
                response.answer.append(
                    dns.rrset.from_rdata_list(name, rdataset.ttl, list(rdataset))
                )
                return
        response.authority.append(soa)  # NODATA


async def start_test_dns(host: str = "127.0.0.1") -> ZoneServer:
    """The ``.test`` zone (plus ``big.test``) on ``host`` at a free port."""
    return await ZoneServer([TEST_ZONE + big_zone_records()], host=host).start()
