"""The replay's tap on a connection's protocol parser (``dsec_core.bus._ReplayTap``): it takes
exactly the replay subscription's stored messages out of the bytes read, however they are cut
into reads, and hands every other frame, in order, to nats-py's own parser. Each test runs with
the C frame scanner (``dsec_core._framescan``) and with the Python path alone.

The C scanner takes exactly the frames the Python path takes, the same way: a stream of frames,
each one common or bent in one way (a sequence of 0 or of 25 digits, another sid, the other ack
layout, a header larger than the message, a skipped consumer sequence, bytes the Python path
reads differently), cut into reads anyhow, gives the same messages, the same frames handed to
nats-py's parser and the same end state with the scanner and without it."""

from __future__ import annotations

import asyncio
import contextlib
import random
from typing import Any

import pytest
from dsec_core import bus
from dsec_core.bus import _ReplayTap
from nats.protocol.parser import Parser

pytestmark = pytest.mark.unit

_SCAN = bus._scan_frames


@pytest.fixture(params=["c", "python"])
def scanner(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which path cuts the common frames out in this test."""
    assert _SCAN is not None, (
        "dsec-core's C extension (dsec_core._framescan) is not built: `./taskw setup` needs a "
        "C compiler (gcc) and the interpreter's headers"
    )
    if request.param == "python":
        monkeypatch.setattr(bus, "_scan_frames", None)
    mode: str = request.param
    return mode


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
def test_the_tap_takes_the_replays_messages_and_passes_on_the_rest(seed: int, scanner: str) -> None:
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


def test_the_tap_stays_out_of_a_parser_in_the_middle_of_a_payload(scanner: str) -> None:
    conn = _Conn()

    async def go() -> None:
        await conn._ps.parse(b"MSG a 1 5\r\nab")  # the payload's rest is still to come
        assert _ReplayTap.install(conn, [], 10, asyncio.Event()) is None  # type: ignore[arg-type]
        await conn._ps.parse(b"cde\r\n")

    asyncio.run(go())
    assert conn.seen == [("msg", 1, b"", b"abcde", None)]


def test_a_hole_in_the_consumer_sequence_ends_what_the_tap_takes(scanner: str) -> None:
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


# --- the C scanner against the Python path ----------------------------------------------

TS = b"1700000000000000000"


_BENDS = [
    "seq0",
    "seq_zeros",
    "seq_long",
    "sid_other",
    "sid_prefix",
    "ack_11",
    "ack_8",
    "nul_subject",
    "seq_plus",
    "tab_subject",
    "size_zeros",
    "ack_extra_dot",
]
# (not here: frames nats-py's own parser, or the tap, refuses with a protocol error, e.g. a sid
# "7x", a MSG with a header size, headers larger than the message: the read ends there, either
# way; the tests below hold that the scanner leaves them alone and that they raise)
_HOLES = ["cseq_skip", "cseq_long"]  # after one, nothing more is taken (rarer: some seeds)


def _bent_frame(rng: random.Random, seq: int, delivered: int, bends: list[str]) -> bytes:
    """One frame of the replay (sid 7, consumer sequence ``delivered``), bent one way (one of
    ``bends``) or not at all."""
    body = rng.randbytes(rng.choice([0, 3, 200, 3000]))
    hdr = b"NATS/1.0\r\nNats-Msg-Id: m%d\r\n\r\n" % seq
    sid, subject, ack_head = b"7", b"dsec.sandbox.sbx_1.exited", b"$JS.ACK.DSEC_EVENTS.c1.1"
    seq_text, cseq_text, tail = b"%d" % seq, b"%d" % delivered, TS + b".0"
    use_hdr, op, hdr_field, size_field = rng.random() < 0.6, None, None, None
    bend = rng.choice(["none"] * len(bends) + bends)
    if bend == "seq0":
        seq_text = b"0"
    elif bend == "seq_zeros":
        seq_text = b"000%d" % seq
    elif bend == "seq_long":
        seq_text = b"9" * 25
    elif bend == "cseq_skip":
        cseq_text = b"%d" % (delivered + 1)
    elif bend == "cseq_long":
        cseq_text = b"1" * 25
    elif bend == "sid_other":
        sid = b"9"
    elif bend == "sid_prefix":
        sid = b"77"
    elif bend == "sid_longer":
        sid = b"7x"
    elif bend == "ack_11":
        ack_head = b"$JS.ACK.hub.ACCHASH.DSEC_EVENTS.c1.1"
        tail = TS + b".0.r"
    elif bend == "ack_8":
        tail = TS
    elif bend == "ack_extra_dot":
        tail = TS + b"..0"
    elif bend == "msg_with_hdr":
        op, use_hdr = b"MSG", True
    elif bend == "hmsg_without_hdr":
        op, use_hdr = b"HMSG", False
    elif bend == "nul_subject":
        subject = b"dsec.sand\x00box"
    elif bend == "seq_plus":
        seq_text = b"+%d" % seq
    elif bend == "tab_subject":
        subject = b"dsec.\tsandbox"
    elif bend == "size_zeros":
        size_field = b"00%d" % ((len(hdr) if use_hdr else 0) + len(body))
    reply = ack_head + b"." + seq_text + b"." + cseq_text + b"." + tail
    payload = (hdr if use_hdr else b"") + body
    if op is None:
        op = b"HMSG" if use_hdr else b"MSG"
    size = size_field or b"%d" % len(payload)
    if use_hdr:
        line = b"%s %s %s %s %s %s\r\n" % (
            op,
            subject,
            sid,
            reply,
            hdr_field or b"%d" % len(hdr),
            size,
        )
    else:
        line = b"%s %s %s %s %s\r\n" % (op, subject, sid, reply, size)
    return line + payload + b"\r\n"


def _python_takes(frame: bytes, delivered: int) -> bool:
    """Whether the Python path takes ``frame`` as the replay's next message."""
    saved, bus._scan_frames = bus._scan_frames, None
    try:
        conn, sink = _Conn(), []  # type: ignore[var-annotated]
        tap = _ReplayTap.install(conn, sink, 10**9, asyncio.Event())  # type: ignore[arg-type]
        assert tap is not None
        tap.sid, tap.delivered = b"7", delivered
        with contextlib.suppress(Exception):
            tap.parse(frame).send(None)  # (it never waits here: one step runs it through)
        return bool(sink)
    finally:
        bus._scan_frames = saved


def _bent_stream(seed: int) -> bytes:
    """299 frames; each one's consumer sequence follows the messages taken before it (the
    server counts only the replay's own), but where a hole is the bend."""
    rng = random.Random(seed)
    bends = _BENDS + (_HOLES if seed % 4 == 0 else [])
    out, delivered = [], 0
    for seq in range(1, 300):
        frame = _bent_frame(rng, seq, delivered + 1, bends)
        if _python_takes(frame, delivered):
            delivered += 1
        out.append(frame)
        if rng.random() < 0.1:
            out.append(b"PING\r\n")
    return b"".join(out)


def _read_in_pieces(data: bytes, seed: int) -> tuple[Any, ...]:
    rng = random.Random(seed)
    conn = _Conn()
    sink: list[tuple[int, bytes]] = []
    full = asyncio.Event()

    async def read() -> tuple[Any, ...]:
        tap = _ReplayTap.install(conn, sink, 10**9, full)  # type: ignore[arg-type]
        assert tap is not None
        tap.sid = b"7"
        at = 0
        try:
            while at < len(data):
                size = rng.choice([1, 5, 150, 4096, 65536, 10**7])
                await tap.parse(data[at : at + size])
                at += size
        except Exception as exc:  # (nats-py's parser on a bent frame: the same either way)
            return ("raised", type(exc).__name__, str(exc), sink, conn.seen)
        tap.remove()
        return (sink, conn.seen, tap.hole, tap.delivered, full.is_set())

    return asyncio.run(read())


@pytest.mark.parametrize("seed", range(40))
def test_the_c_scanner_reads_a_stream_as_the_python_path_does(
    seed: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert bus._scan_frames is not None, "dsec_core._framescan is not built (`./taskw setup`)"
    data = _bent_stream(seed)
    with_c = _read_in_pieces(data, seed)
    monkeypatch.setattr(bus, "_scan_frames", None)
    assert _read_in_pieces(data, seed) == with_c


def test_the_scanner_stops_at_the_first_frame_it_does_not_take() -> None:
    scan = bus._scan_frames
    assert scan is not None
    good = b"MSG s 7 $JS.ACK.S.c.1.%d.%d.%s.0 2\r\nab\r\n"
    data = good % (1, 1, TS) + good % (2, 3, TS) + good % (3, 3, TS)  # the 2nd skips one
    sink: list[tuple[int, bytes]] = []
    pos, delivered = scan(data, 0, b"7", 0, sink)
    assert sink == [(1, b"ab")] and delivered == 1
    assert data[pos:].startswith(b"MSG s 7 $JS.ACK.S.c.1.2.3.")
    # frames of another shape: left to the Python path (and nats-py's parser)
    for line in (
        b"MSG s 7x $JS.ACK.S.c.1.1.1.%s.0 2\r\nab\r\n" % TS,
        b"MSG s 7 $JS.ACK.S.c.1.1.1.%s.0 0 2\r\nab\r\n" % TS,
        b"HMSG s 7 $JS.ACK.S.c.1.1.1.%s.0 2\r\nab\r\n" % TS,
        b"MSG s 7 $JS.ACK.S.c.1.1.1.%s.0 2 \r\nab\r\n" % TS,
        b"MSG s 7 $JS.ACK.S.c.1.1.1.%s.0 1\r\nab\r\n" % TS,  # no CRLF where the size ends
        b"HMSG s 7 $JS.ACK.S.c.1.1.1.%s.0 3 2\r\nab\r\n" % TS,  # headers larger than it
    ):
        assert scan(line, 0, b"7", 0, []) == (0, 0), line
    # a frame not whole yet: nothing taken
    assert scan(data[: len(good % (1, 1, TS)) - 1], 0, b"7", 0, []) == (0, 0)
    with pytest.raises(ValueError, match="pos outside buf"):
        scan(data, len(data) + 1, b"7", 0, [])
    with pytest.raises(TypeError):
        scan(bytearray(data), 0, b"7", 0, [])


_ACK = b"$JS.ACK.S.c.1.1.1.%s.0" % TS


def _tap_reads(data: bytes, sink: list[tuple[int, bytes]]) -> _Conn:
    """``data`` read in one piece by a tap of the replay's sid 7 (5 s at most)."""
    conn = _Conn()

    async def read() -> None:
        tap = _ReplayTap.install(conn, sink, 10**9, asyncio.Event())  # type: ignore[arg-type]
        assert tap is not None
        tap.sid = b"7"
        await asyncio.wait_for(tap.parse(data), 5)

    asyncio.run(read())
    return conn


@pytest.mark.parametrize(
    "frame",
    [
        b"MSG a 9 -100\r\n",  # a negative size: the reader went backwards, for ever
        b"MSG a 7 " + _ACK + b" -100\r\n",
        b"HMSG s 7 " + _ACK + b" -20 3\r\nabc\r\n",  # a negative header size
        b"HMSG s 7 " + _ACK + b" 5 3\r\nabc\r\n",  # headers larger than the message
        b"MSG s 7 " + _ACK + b" 1\r\nabc\r\n",  # the message does not end where its size says
        b"MSG s 7 " + _ACK + b" +3\r\nabc\r\n",  # int() takes these; the protocol does not
        b"MSG s 7 " + _ACK + b" 1_0\r\n0123456789\r\n",
    ],
)
def test_a_malformed_frame_is_a_protocol_error_not_a_hang_or_an_event(
    frame: bytes, scanner: str
) -> None:
    """A server that sends a size or sequence that is not digits, headers larger than their
    message, or a payload that does not end in CRLF where its size says: the replay's reader
    raises nats-py's protocol error (the connection's read loop then reconnects), as nats-py's
    own parser does for a frame it cannot read; it never loops, and never takes bytes of a
    control line for an event."""
    from nats.errors import ProtocolError

    sink: list[tuple[int, bytes]] = []
    with pytest.raises(ProtocolError):
        _tap_reads(frame + b"PING\r\n", sink)
    assert sink == []


@pytest.mark.parametrize("seq", [b"-1", b"+1", b"1_0", b"\xd9\xa1"])
def test_an_ack_subject_whose_sequence_is_not_digits_is_not_taken(seq: bytes, scanner: str) -> None:
    """Not an event of the replay: the frame goes to nats-py's parser and so to the replay's
    subscription callback, which ends the fast path (its caller reads on with follow())."""
    sink: list[tuple[int, bytes]] = []
    conn = _tap_reads(b"MSG s 7 $JS.ACK.S.c.1.%s.1.%s.0 3\r\nabc\r\n" % (seq, TS), sink)
    assert sink == []
    assert [m[3] for m in conn.seen] == [b"abc"]
