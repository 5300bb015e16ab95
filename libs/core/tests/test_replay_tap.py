"""The replay's tap on a connection's protocol parser (``dsec_core.bus._ReplayTap``): it takes
exactly the replay subscription's stored messages out of the bytes read, however they are cut
into reads, and hands every other frame, in order, to nats-py's own parser."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from dsec_core.bus import _ReplayTap
from nats.protocol.parser import Parser

pytestmark = pytest.mark.unit


class _Conn:
    """What nats-py's parser calls back on (a connection), recording it."""

    def __init__(self) -> None:
        self._ps = Parser(self)
        self.seen: list[tuple[Any, ...]] = []

    async def _process_msg(self, sid: int, subject: bytes, reply: bytes, data: bytes, hdr: Any):
        self.seen.append(("msg", sid, reply, data, hdr))

    async def _process_ping(self) -> None:
        self.seen.append(("ping",))

    async def _process_pong(self) -> None:
        self.seen.append(("pong",))

    async def _process_info(self, info: dict[str, Any]) -> None:
        self.seen.append(("info", info))

    async def _process_err(self, err: str) -> None:
        self.seen.append(("err", err))


def _ack(seq: int) -> bytes:
    if seq % 4 == 0:  # the layout with a domain and an account hash
        return f"$JS.ACK.hub.ACCHASH.DSEC_EVENTS.c1.1.{seq}.{seq}.1700000000000000000.0.r".encode()
    return f"$JS.ACK.DSEC_EVENTS.c1.1.{seq}.{seq}.1700000000000000000.0".encode()


def _stream(rng: random.Random) -> tuple[bytes, list[tuple[int, bytes]], list[tuple[Any, ...]]]:
    """Protocol bytes mixing the replay's messages (sid 7) with everything else."""
    out, ours, theirs = [], [], []
    for seq in range(1, 400):
        body = rng.randbytes(rng.choice([0, 5, 300, 5000, 70_000])).replace(b"\r\n", b"\n\r")
        body += b" MSG x 7 r 5\r\n"  # protocol-looking bytes inside a payload
        if rng.random() < 0.5:  # with headers (Nats-Msg-Id), as JetStream delivers them
            hdr = f"NATS/1.0\r\nNats-Msg-Id: m{seq}\r\n\r\n".encode()
            out.append(
                b"HMSG _INBOX.r 7 %s %d %d\r\n%s%s\r\n"
                % (_ack(seq), len(hdr), len(hdr) + len(body), hdr, body)
            )
        else:
            out.append(b"MSG _INBOX.r 7 %s %d\r\n%s\r\n" % (_ack(seq), len(body), body))
        ours.append((seq, body))
        roll = rng.random()
        if roll < 0.1:
            out.append(b"PING\r\n")
            theirs.append(("ping",))
        elif roll < 0.15:
            out.append(b'INFO {"server_id": "a b", "max_payload": 1048576}\r\n')
            theirs.append(("info", {"server_id": "a b", "max_payload": 1048576}))
        elif roll < 0.3:  # another subscription's message
            out.append(b"MSG other.subject 9 _INBOX.x.y 3\r\nabc\r\n")
            theirs.append(("msg", 9, b"_INBOX.x.y", b"abc", None))
    status = b"NATS/1.0 404 No Messages\r\n\r\n"  # the end of a pull: the callback's
    out.append(b"HMSG _INBOX.r 7 %d %d\r\n%s\r\n" % (len(status), len(status), status))
    theirs.append(("msg", 7, b"", b"", status))
    return b"".join(out), ours, theirs


@pytest.mark.parametrize("seed", range(4))
def test_the_tap_takes_the_replays_messages_and_passes_on_the_rest(seed: int) -> None:
    rng = random.Random(seed)
    data, ours, theirs = _stream(rng)
    conn = _Conn()
    sink: list[tuple[int, bytes]] = []
    full = asyncio.Event()

    async def read() -> None:
        tap = _ReplayTap.install(conn, sink, 10**9, full)  # type: ignore[arg-type]
        assert tap is not None and conn._ps is tap
        tap.sid = b"7"
        at = 0
        while at < len(data):  # cut into reads of any size, as a socket does
            size = rng.choice([1, 2, 7, 100, 4096, 32768, 200_000])
            await tap.parse(data[at : at + size])
            at += size
        tap.remove()
        assert type(conn._ps) is Parser and not conn._ps.buf

    asyncio.run(read())
    assert sink == ours
    assert conn.seen == theirs


def test_the_tap_stays_out_of_a_parser_in_the_middle_of_a_payload() -> None:
    conn = _Conn()

    async def go() -> None:
        await conn._ps.parse(b"MSG a 1 5\r\nab")  # the payload's rest is still to come
        assert _ReplayTap.install(conn, [], 10, asyncio.Event()) is None  # type: ignore[arg-type]
        await conn._ps.parse(b"cde\r\n")

    asyncio.run(go())
    assert conn.seen == [("msg", 1, b"", b"abcde", None)]


def test_a_hole_in_the_consumer_sequence_ends_what_the_tap_takes() -> None:
    """Messages lost on the way (a reconnect: the consumer counted them delivered) show as a
    skipped consumer sequence; the tap takes nothing after it, so the replay reads on from the
    last message before the hole instead of yielding a log with events missing."""
    frames = [
        b"MSG _INBOX.r 7 %s %d\r\n%s\r\n" % (_ack(seq), len(b"e%d" % seq), b"e%d" % seq)
        for seq in (1, 2, 3, 5, 6)
    ]
    conn = _Conn()
    sink: list[tuple[int, bytes]] = []
    full = asyncio.Event()

    async def read() -> _ReplayTap:
        tap = _ReplayTap.install(conn, sink, 10**9, full)  # type: ignore[arg-type]
        assert tap is not None
        tap.sid = b"7"
        await tap.parse(b"".join(frames))
        tap.remove()
        return tap

    tap = asyncio.run(read())
    assert sink == [(1, b"e1"), (2, b"e2"), (3, b"e3")]
    assert tap.hole and full.is_set()
