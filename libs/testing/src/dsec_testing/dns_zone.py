"""A real authoritative DNS server for tests and the demo: serves zones from text over UDP and TCP
on loopback.

Deliberately minimal and strict, like an authoritative server: it answers only what its zones
hold (REFUSED for names outside them, NXDOMAIN for names inside them it does not know), never
follows a CNAME (so a resolver's own chain-following is exercised), truncates UDP answers over the
client's payload (so TCP fallback is exercised), and records every question.

```python
server = await ZoneServer([zone_text]).start()  # free port on 127.0.0.1
server.address  # "127.0.0.1:PORT", the DSEC_DNS_UPSTREAM value
await server.close()
```
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
import dns.zone

Question = tuple[str, str, str]
"""``(name, type, protocol)`` of one question, e.g. ``("api.websearch.test.", "A", "udp")``."""

_PORT_ATTEMPTS = 20


@dataclass
class ZoneServer:
    """Authoritative server for the given zone texts (each with its own ``$ORIGIN``).

    Attributes:
        zone_texts: zone files as text.
        host: loopback address to bind.
        port: port to bind (0: a free port, the same for UDP and TCP).
        questions: every question received, in order.
        on_question: called with each question and its answer's rcode name (e.g. to log it).
    """

    zone_texts: list[str]
    host: str = "127.0.0.1"
    port: int = 0
    questions: list[Question] = field(default_factory=list)
    on_question: Callable[[Question, str], None] | None = None
    _zones: list[dns.zone.Zone] = field(default_factory=list)
    _udp: asyncio.DatagramTransport | None = None
    _tcp: asyncio.Server | None = None

    async def start(self) -> ZoneServer:
        """Bind UDP and TCP on the same port and start answering.

        Raises:
            dns.exception.SyntaxError: a zone text does not parse.
            OSError: the port is taken (or no port is free for both protocols).
        """
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
        for _ in range(_PORT_ATTEMPTS):  # UDP picks a free port; TCP may find it taken: retry
            self._udp, _ = await loop.create_datagram_endpoint(Udp, local_addr=(self.host, wanted))
            self.port = self._udp.get_extra_info("sockname")[1]
            try:
                self._tcp = await asyncio.start_server(self._tcp_client, self.host, self.port)
            except OSError:
                self._udp.close()
                self._udp = None
                if wanted:
                    raise
                continue
            return self
        raise OSError(f"no port free for both UDP and TCP on {self.host}")

    async def close(self) -> None:
        """Stop serving."""
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        if self._tcp is not None:
            self._tcp.close()
            await self._tcp.wait_closed()
            self._tcp = None

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
        """Answer one query in wire format (``None``: not a query, drop it)."""
        try:
            query = dns.message.from_wire(data)
        except (dns.exception.DNSException, ValueError):  # garbage on the port: ignore it
            return None
        if not query.question:
            return None
        response = dns.message.make_response(query)
        response.flags |= dns.flags.AA
        question = query.question[0]
        asked: Question = (
            question.name.to_text(),
            dns.rdatatype.to_text(question.rdtype),
            "udp" if udp else "tcp",
        )
        self.questions.append(asked)
        self._fill(response, question.name, question.rdtype)
        if self.on_question is not None:
            self.on_question(asked, dns.rcode.to_text(response.rcode()))
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
