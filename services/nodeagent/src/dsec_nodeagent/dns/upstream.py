"""The node agent's client for its upstream resolver (``DSEC_DNS_UPSTREAM=host:port``).

One long-lived UDP socket multiplexes every question by message id (no socket per query: the
proxy's overhead target is well under a millisecond); a truncated answer is asked again over TCP.
Only questions the proxy built itself go out (`UpstreamClient.query`): a sandbox's bytes never do.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import secrets
import struct
from dataclasses import dataclass

import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rdataclass
import dns.rdatatype

UPSTREAM_ENV = "DSEC_DNS_UPSTREAM"
EDNS_PAYLOAD = 1232  # the DNS flag day 2020 size: avoids IP fragmentation
_MADE_KEPT = 4096  # encoded questions kept for reuse


class UpstreamError(Exception):
    """The upstream resolver did not answer usefully (timeout, closed, garbage)."""


@dataclass(frozen=True, slots=True)
class UpstreamAnswer:
    """An answer both parsed and as received (forwarded as is when nothing needs changing)."""

    message: dns.message.Message
    wire: bytes


def parse_upstream(text: str) -> tuple[str, int]:
    """Parse ``host:port`` / ``[v6]:port`` / ``host`` (port 53).

    Raises:
        ValueError: naming the setting and the valid shape.
    """
    raw = text.strip()
    host, port = raw, "53"
    if raw.startswith("["):
        host, sep, rest = raw[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"{UPSTREAM_ENV}={text!r}: expected [IPv6]:PORT")
        port = rest[1:] or "53"
    elif raw.count(":") == 1:
        host, port = raw.split(":")
    try:
        ipaddress.ip_address(host)
        number = int(port)
    except ValueError:
        raise ValueError(
            f"{UPSTREAM_ENV}={text!r}: expected IP:PORT (e.g. 127.0.0.1:5353 or [::1]:53)"
        ) from None
    if not 0 < number < 65536:
        raise ValueError(f"{UPSTREAM_ENV}={text!r}: port must be 1-65535")
    return host, number


def upstream_from_env() -> tuple[str, int]:
    """The upstream named by ``DSEC_DNS_UPSTREAM``.

    Raises:
        ValueError: when the variable is unset or malformed.
    """
    value = os.environ.get(UPSTREAM_ENV)
    if not value:
        raise ValueError(f"{UPSTREAM_ENV} is not set: the DNS proxy needs an upstream host:port")
    return parse_upstream(value)


def _expire(fut: asyncio.Future[bytes]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class _UdpMux(asyncio.DatagramProtocol):
    def __init__(self) -> None:
        self.pending: dict[int, asyncio.Future[bytes]] = {}

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        if len(data) < 2:
            return
        fut = self.pending.get(int.from_bytes(data[:2], "big"))
        if fut is not None and not fut.done():
            fut.set_result(data)

    def error_received(self, exc: Exception) -> None:
        for fut in self.pending.values():
            if not fut.done():
                fut.set_exception(UpstreamError(f"upstream unreachable: {exc}"))


class UpstreamClient:
    """Asks one upstream resolver; UDP first, TCP when the answer comes back truncated."""

    def __init__(self, host: str, port: int, *, timeout: float = 2.0, attempts: int = 2) -> None:
        self.host = host
        self.port = port
        self.timeout = timeout
        self.attempts = attempts
        self._transport: asyncio.DatagramTransport | None = None
        self._mux = _UdpMux()
        self._lock = asyncio.Lock()
        self._made: dict[tuple[dns.name.Name, int], tuple[dns.message.Message, bytes]] = {}

    async def _udp(self) -> asyncio.DatagramTransport:
        async with self._lock:
            if self._transport is None or self._transport.is_closing():
                loop = asyncio.get_running_loop()
                transport, _ = await loop.create_datagram_endpoint(
                    lambda: self._mux, remote_addr=(self.host, self.port)
                )
                self._transport = transport
            return self._transport

    def _new_id(self) -> int:
        while True:
            qid = secrets.randbelow(65536)
            if qid not in self._mux.pending:
                return qid

    async def ask(self, name: dns.name.Name, rdtype: dns.rdatatype.RdataType) -> UpstreamAnswer:
        """Ask the fresh minimal question (``name`` lower-cased, ``rdtype``, class IN, RD, our
        EDNS OPT).

        Its encoding is kept for the next time the same question is asked (each send gets a new
        id): building it costs more than the rest of the proxy's work.

        Raises:
            UpstreamError: timeout, refused, or an answer that does not match the question.
        """
        key = (name, rdtype)  # names hash and compare without case
        made = self._made.get(key)
        if made is None:
            question = dns.message.make_query(name.canonicalize(), rdtype, dns.rdataclass.IN)
            question.flags |= dns.flags.RD
            question.use_edns(0, 0, EDNS_PAYLOAD)
            if len(self._made) >= _MADE_KEPT:
                self._made.clear()
            made = self._made[key] = (question, question.to_wire())
        return await self._exchange(*made)

    async def query(self, question: dns.message.Message) -> UpstreamAnswer:
        """Ask a question the proxy made itself (EDNS added so answers rarely truncate).

        Raises:
            UpstreamError: timeout, refused, or an answer that does not match the question.
        """
        question.use_edns(0, 0, EDNS_PAYLOAD)
        return await self._exchange(question, question.to_wire())

    async def _exchange(self, question: dns.message.Message, wire: bytes) -> UpstreamAnswer:
        """Send ``wire`` (the encoding of ``question``, never a sandbox's bytes) under a fresh
        id; UDP, then TCP if the answer comes back truncated. The answer's wire keeps that id.

        Raises:
            UpstreamError: timeout, refused, or an answer that does not match the question.
        """
        qid = self._new_id()
        wire = qid.to_bytes(2, "big") + wire[2:]
        answer = await self._exchange_udp(question, qid, wire)
        if answer.message.flags & dns.flags.TC:
            answer = await self._exchange_tcp(question, qid, wire)
        return answer

    async def _exchange_udp(
        self, question: dns.message.Message, qid: int, wire: bytes
    ) -> UpstreamAnswer:
        transport = await self._udp()
        loop = asyncio.get_running_loop()
        for _ in range(self.attempts):
            fut: asyncio.Future[bytes] = loop.create_future()
            self._mux.pending[qid] = fut
            # A timer on the future, not asyncio.wait_for: no extra task per question.
            timer = loop.call_later(self.timeout, _expire, fut)
            try:
                transport.sendto(wire)
                data = await fut
            except TimeoutError:
                continue
            finally:
                timer.cancel()
                self._mux.pending.pop(qid, None)
            return self._parse(question, qid, data)
        raise UpstreamError(f"upstream {self.host}:{self.port} did not answer (UDP)")

    async def _exchange_tcp(
        self, question: dns.message.Message, qid: int, wire: bytes
    ) -> UpstreamAnswer:
        try:
            async with asyncio.timeout(self.timeout):
                reader, writer = await asyncio.open_connection(self.host, self.port)
                try:
                    writer.write(struct.pack("!H", len(wire)) + wire)
                    await writer.drain()
                    (length,) = struct.unpack("!H", await reader.readexactly(2))
                    data = await reader.readexactly(length)
                finally:
                    writer.close()
                    with contextlib.suppress(OSError):
                        await writer.wait_closed()
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as exc:
            raise UpstreamError(f"upstream {self.host}:{self.port} over TCP: {exc!r}") from exc
        return self._parse(question, qid, data)

    def _parse(self, question: dns.message.Message, qid: int, data: bytes) -> UpstreamAnswer:
        try:
            answer = dns.message.from_wire(data)
        except dns.exception.DNSException as exc:
            raise UpstreamError(f"upstream sent an unreadable answer: {exc}") from exc
        if (
            answer.id != qid
            or not answer.flags & dns.flags.QR
            or answer.question != question.question
        ):
            raise UpstreamError("upstream answer does not match the question")
        return UpstreamAnswer(answer, data)

    def close(self) -> None:
        """Close the UDP socket (pending questions fail)."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
