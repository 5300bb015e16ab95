"""A final hand-over's ``moved`` notice, on the caller's side: the broker connection names the
caller's channels whose old server is frozen for good, and a call waiting on one of them stops
waiting at once (``PeerGone``: the client sends it again to the new server when its request was
never read), instead of when the old process is gone. The broker's side and the whole flow:
``services/nodeagent/tests/test_ipc_handover.py``."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dsec_sdk.errors import PeerGone
from dsec_sdk.ipc import control
from dsec_sdk.ipc import link as lk

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach test_ring
from test_ring import Pair

pytestmark = pytest.mark.unit

CAPACITY = 4096
SECOND = 1_000_000_000
AGENT = "moved-notice-test"  # (its notice thread's name is this test's own)


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair(CAPACITY, channel_id=7)
    yield p
    p.close()


@pytest.fixture
def notices() -> Iterator[tuple[socket.socket, socket.socket]]:
    """The broker connection as the caller's sleeper sees it: ours, and the broker's end."""
    ours, broker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    yield ours, broker
    ours.close()
    broker.close()


class Script:
    """A ``moved(channel_id)`` answering from a list, recording when it was asked."""

    def __init__(self, *answers: int) -> None:
        self.answers = list(answers)
        self.asked: list[tuple[int, int]] = []

    def __call__(self, channel_id: int) -> int:
        self.asked.append((channel_id, time.perf_counter_ns()))
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def _never(_channel_id: int) -> bool:
    return False


def _later(seconds: float, action: Any) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        action()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_notice_naming_the_channel_ends_the_wait_at_once(pair: Pair, notices: Any) -> None:
    ours, broker = notices
    moved = Script(lk.MOVED)
    pair.caller.watch_moves(ours.fileno(), moved, _never)
    _later(0.05, lambda: broker.send(b"notice"))
    started = time.perf_counter_ns()
    with pytest.raises(PeerGone, match="a hand-over moved it to its new version"):
        pair.caller.wait_response(started + 30 * SECOND)
    assert time.perf_counter_ns() - started < 10 * SECOND  # not the deadline: the notice
    assert [channel for channel, _ in moved.asked] == [7]


def test_an_answer_already_there_wins_over_the_notice(pair: Pair, notices: Any) -> None:
    ours, broker = notices
    pair.caller.watch_moves(ours.fileno(), Script(lk.MOVED), _never)
    # Written while the caller sleeps, just before the notice: the old server answered the call
    # before its final checkpoint.
    sender = _later(0.05, lambda: (pair.server.respond(2, 1, b"answer"), broker.send(b"notice")))
    assert pair.caller.wait_response(time.perf_counter_ns() + 30 * SECOND)
    assert pair.caller.responses.try_read(bytes) == (2, 1, b"answer")
    sender.join()  # (the wait ends at the answer: the notice is sent before the sockets close)


def test_another_thread_reading_the_connection_pauses_the_watch_not_the_wait(
    pair: Pair, notices: Any
) -> None:
    ours, broker = notices
    # Busy (another thread talks to the broker, the datagram stays unread), then not this
    # channel, then this channel.
    moved = Script(lk.BUSY, lk.BUSY, lk.NOT_MOVED, lk.MOVED)
    pair.caller.watch_moves(ours.fileno(), moved, _never)
    _later(0.05, lambda: broker.send(b"notice"))
    with pytest.raises(PeerGone):
        pair.caller.wait_response(time.perf_counter_ns() + 30 * SECOND)
    times = [at for _, at in moved.asked]
    # Unread data keeps the socket readable: after each "busy" the sleeper looks again only
    # after a pause (~1 ms), never in a loop of wake-ups.
    assert len(times) >= 4
    assert times[1] - times[0] >= 900_000 and times[2] - times[1] >= 900_000


def test_a_closed_or_ended_connection_is_no_longer_watched(pair: Pair, notices: Any) -> None:
    ours, broker = notices
    moved = Script(lk.GONE)
    pair.caller.watch_moves(ours.fileno(), moved, _never)
    broker.send(b"unread")  # readable for ever: watched on, it would wake the sleeper each time
    started = time.perf_counter_ns()
    assert not pair.caller.wait_response(started + SECOND // 5)  # the deadline, as usual
    assert len(moved.asked) == 1
    # and a later answer still wakes it
    _later(0.05, lambda: pair.server.respond(2, 1, b"answer"))
    assert pair.caller.wait_response(time.perf_counter_ns() + 30 * SECOND)


# ------------------------------------------------------------------------------ BrokerLink
class FakeBroker:
    """A listening socket that welcomes one caller, then sends what the test says."""

    def __init__(self, path: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.conn: socket.socket | None = None
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        hello = control.recv(conn)
        assert hello is not None and hello[0]["op"] == "hello"
        control.send(conn, {"op": "welcome", "node": "n1", "ring_capacity": CAPACITY})
        self.conn = conn

    def wait(self) -> socket.socket:
        self._thread.join(10)
        assert self.conn is not None
        return self.conn

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
        self.listener.close()


@pytest.fixture
def fake() -> Iterator[tuple[FakeBroker, lk.BrokerLink]]:
    home = Path(tempfile.mkdtemp(prefix="dsec-mv-"))
    broker = FakeBroker(home / "ipc.sock")
    link = lk.BrokerLink(home / "ipc.sock", AGENT, "g1", "caller")
    broker.wait()
    yield broker, link
    link.close()
    broker.close()
    (home / "ipc.sock").unlink()
    home.rmdir()


def _until(condition: Any) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.001)


def _readable(sock: socket.socket) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])


def test_the_link_names_only_the_channels_a_final_notice_lists(fake: Any) -> None:
    broker, link = fake
    conn = broker.wait()
    assert link.moved_channel(7) == lk.NOT_MOVED
    control.send(conn, {"op": "moved", "peer": "b"})  # the switch's notice: no channel named
    control.send(conn, {"op": "moved", "peer": "b", "channels": [3, "7", 8]})
    _until(lambda: _readable(link.sock))
    assert link.moved_channel(7) == lk.NOT_MOVED  # ("7" is no channel id)
    assert link.moved_channel(3) == lk.MOVED
    assert link.moved_channel(8) == lk.MOVED
    assert link.take_moved("b")  # the peer's notice for a call whose server is gone, as before


def test_the_link_is_busy_while_another_thread_talks_to_the_broker(fake: Any) -> None:
    _, link = fake
    with link._lock:  # (what connect() holds while it waits for its answer)
        assert link.moved_channel(7) == lk.BUSY


def test_the_link_says_gone_at_the_connection_end_and_once_closed(fake: Any) -> None:
    broker, link = fake
    conn = broker.wait()
    control.send(conn, {"op": "moved", "peer": "b", "channels": [5]})
    conn.shutdown(socket.SHUT_RDWR)
    _until(lambda: _readable(link.sock))
    assert link.moved_channel(5) == lk.MOVED  # what came before the end still counts
    assert link.moved_channel(6) == lk.GONE
    link.close()
    assert link.moved_channel(6) == lk.GONE
    assert link.moved_channel(5) == lk.MOVED  # (known already: no read needed)


def test_a_notice_another_thread_read_first_still_ends_the_wait(pair: Pair, fake: Any) -> None:
    """The notice arrives while another thread of the caller talks to the broker: the sleeper
    finds the connection busy, and that thread reads the notice before it lets go (the socket
    is then empty: no wake-up comes from it any more)."""
    broker, link = fake
    conn = broker.wait()
    pair.caller.watch_moves(link.sock.fileno(), link.moved_channel, link.moved_known)
    holding, release = threading.Event(), threading.Event()

    def other_thread() -> None:
        with link._lock:  # (connect() waiting for its answer)
            holding.set()
            release.wait(10)
            link._read_queued()  # (what connect() does before it lets go)

    thread = threading.Thread(target=other_thread, daemon=True)
    thread.start()
    assert holding.wait(10)
    control.send(conn, {"op": "moved", "peer": "b", "channels": [7]})
    _later(0.1, release.set)
    started = time.perf_counter_ns()
    with pytest.raises(PeerGone, match="moved"):
        pair.caller.wait_response(started + 30 * SECOND)
    assert time.perf_counter_ns() - started < 5 * SECOND  # (not the deadline)
    thread.join(10)


def test_a_notice_another_thread_read_unseen_wakes_the_sleeper_at_once(
    pair: Pair, fake: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another thread (an event loop's notice thread, a call opening a channel) reads the
    notice before the sleeper ever saw the connection readable: the link rings the channel's
    wake eventfd, so the call ends at once, not when its sleep ends (up to 50 ms; 60 s here)."""
    from dsec_sdk.ipc import channel as ch

    monkeypatch.setattr(ch, "_MAX_SLEEP_NS", 60 * SECOND)
    broker, link = fake
    conn = broker.wait()
    quiet_r, quiet_w = os.pipe()  # (a connection the sleeper watches that never says anything)
    try:
        pair.caller.watch_moves(quiet_r, link.moved_channel, link.moved_known)
        link.ring_on_move(pair.caller)

        def notice_thread() -> None:
            control.send(conn, {"op": "moved", "peer": "b", "channels": [7]})
            _until(lambda: _readable(link.sock))
            assert link.read_notices() == lk.NOT_MOVED  # (read here; noted for channel 7)

        _later(0.1, notice_thread)
        started = time.perf_counter_ns()
        with pytest.raises(PeerGone, match="moved"):
            pair.caller.wait_response(started + 120 * SECOND)
        assert time.perf_counter_ns() - started < 10 * SECOND  # (not its 60 s sleep)
        assert link._bells == {}  # rung once, then forgotten
    finally:
        os.close(quiet_r)
        os.close(quiet_w)


def test_the_link_forgets_the_bells_of_closed_channels_and_closes_their_fds(fake: Any) -> None:
    _, link = fake
    ends = [Pair(CAPACITY, channel_id=cid) for cid in (1, 2)]
    link._bells_prune_at = 1  # (pruned at every registration here; see the test below)
    try:
        link.ring_on_move(ends[0].caller)
        first_dup = link._bells[1][1]
        ends[0].caller.close()
        link.ring_on_move(ends[1].caller)
        assert list(link._bells) == [2]  # the closed one's forgotten when the next comes
        with pytest.raises(OSError):
            os.fstat(first_dup)  # and its duplicate closed
        second_dup = link._bells[2][1]
        link.close()
        assert link._bells == {}
        with pytest.raises(OSError):
            os.fstat(second_dup)
        link.ring_on_move(ends[1].caller)  # after close: kept nowhere
        assert link._bells == {}
    finally:
        for p in ends:
            p.close()


def test_closed_channels_bells_do_not_pile_up_and_are_not_scanned_at_every_open(
    fake: Any,
) -> None:
    """A long-lived client opening and dropping channels: the bells of closed ones are
    forgotten (their fds closed) once the bells have doubled since the last look, so at most
    twice the live ones (16 at least) are ever kept, without a scan on every channel opened."""
    _, link = fake
    before = len(os.listdir("/proc/self/fd"))
    for cid in range(1, 101):
        pair = Pair(CAPACITY, channel_id=cid)
        link.ring_on_move(pair.caller)
        pair.close()
        assert len(link._bells) <= lk._BELLS_PRUNE_AT + 1
    # (every pair closed: what is left open is the bells still kept, no more)
    assert len(os.listdir("/proc/self/fd")) == before + len(link._bells)
    link.close()
    assert link._bells == {}
    assert len(os.listdir("/proc/self/fd")) <= before


class _CloseInside:
    """The link's bell lock, with ``link.close()`` run once while it is held: as a signal
    handler above the thread registering a channel would."""

    def __init__(self, link: lk.BrokerLink) -> None:
        self.lock = threading.Lock()
        self.link = link
        self.armed = True

    def __enter__(self) -> None:
        self.lock.acquire()
        if self.armed:
            self.armed = False
            self.link.close()

    def __exit__(self, *_: object) -> None:
        self.lock.release()

    def acquire(self, blocking: bool = True) -> bool:
        return self.lock.acquire(blocking)

    def release(self) -> None:
        self.lock.release()


def test_closing_the_link_inside_a_registration_neither_hangs_nor_leaks(fake: Any) -> None:
    """``close()`` never waits for the bell lock (before the review's fix, 2026-12-06, a
    signal handler closing the client above a channel's registration hung for ever); the
    thread that held it closes the bells left once it lets go."""
    _, link = fake
    ends = [Pair(CAPACITY, channel_id=cid) for cid in (1, 2)]
    try:
        link.ring_on_move(ends[0].caller)
        first_dup = link._bells[1][1]
        link._bells_lock = _CloseInside(link)  # type: ignore[assignment]
        link.ring_on_move(ends[1].caller)  # close() runs inside
        assert link.sock.fileno() < 0  # closed
        assert link._bells == {}  # the bell being registered and the earlier one: closed
        with pytest.raises(OSError):
            os.fstat(first_dup)
    finally:
        for p in ends:
            p.close()


def _watchers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == f"dsec-ipc-notices-{AGENT}"]


def test_the_notice_thread_reads_for_event_loops_and_ends_with_the_connection(fake: Any) -> None:
    broker, link = fake
    conn = broker.wait()
    read = threading.Event()
    link.watch_notices(read.set)
    link.watch_notices(read.set)  # (once: a second asks for nothing more)
    assert len(_watchers()) == 1
    control.send(conn, {"op": "moved", "peer": "b", "channels": [4]})
    assert read.wait(10)
    assert link.moved_known(4) and not _readable(link.sock)
    conn.shutdown(socket.SHUT_RDWR)
    _until(lambda: not _watchers())


def test_the_notice_thread_leaves_the_connection_to_a_thread_talking_to_the_broker(
    fake: Any,
) -> None:
    broker, link = fake
    conn = broker.wait()
    calls: list[int] = []
    with link._lock:
        link.watch_notices(lambda: calls.append(time.perf_counter_ns()))
        control.send(conn, {"op": "moved", "peer": "b", "channels": [9]})
        time.sleep(0.05)  # the thread found the connection busy: it waits, it does not spin
        assert len(calls) == 0
        link._read_queued()
    _until(lambda: calls)  # told once the connection is free again
    assert link.moved_known(9)
    link.close()
    _until(lambda: not _watchers())


def test_an_async_call_waiting_on_a_moved_channel_ends_untaken(pair: Pair) -> None:
    from dsec_sdk.ipc.aio import AsyncCaller

    async def run() -> None:
        caller = AsyncCaller(pair.caller, bytes)
        call = asyncio.ensure_future(
            caller.call(1, b"request", time.perf_counter_ns() + 30 * SECOND)
        )
        await asyncio.sleep(0.05)  # sent, waiting (the server never reads it)
        assert not call.done()
        caller.moved()
        with pytest.raises(PeerGone, match="moved") as gone:
            await call
        assert gone.value.untaken  # never read by the old server: the client sends it again
        assert caller.closed

    asyncio.run(run())


def test_an_answer_already_there_wins_over_the_move_in_an_event_loop(pair: Pair) -> None:
    from dsec_sdk.ipc.aio import AsyncCaller

    async def run() -> None:
        caller = AsyncCaller(pair.caller, bytes)
        call = asyncio.ensure_future(
            caller.call(1, b"request", time.perf_counter_ns() + 30 * SECOND)
        )
        await asyncio.sleep(0.05)
        frame = pair.server.requests.try_read(bytes)
        assert frame is not None
        # (read: taken by the old server, and answered before its final checkpoint)
        assert pair.server.responses.try_write(2, frame[1], b"answer")
        caller.moved()
        assert await call == (2, b"answer")

    asyncio.run(run())


def test_the_listener_hears_of_a_notice_whichever_thread_read_it(fake: Any) -> None:
    """A sync caller or a request may read the notice before the notice thread does: the
    event loops must hear of it all the same."""
    broker, link = fake
    conn = broker.wait()
    heard = threading.Event()
    with link._lock:  # (the notice thread stays out while this thread talks to the broker)
        link.watch_notices(heard.set)
        control.send(conn, {"op": "moved", "peer": "b", "channels": [11]})
        _until(lambda: _readable(link.sock))
        link._read_queued()  # (as connect() does before it lets go)
        assert heard.is_set()
    heard.clear()
    control.send(conn, {"op": "moved", "peer": "b"})  # no channel named: nobody to tell
    _until(lambda: not _readable(link.sock))
    time.sleep(0.05)
    assert not heard.is_set()


def test_async_calls_waiting_for_room_in_a_moved_channel_end_untaken(pair: Pair) -> None:
    """The old server stopped reading with the ring full: the calls written end untaken, and
    so do the calls still waiting for room (never written), none with another error."""
    from dsec_sdk.ipc.aio import AsyncCaller

    async def run() -> None:
        caller = AsyncCaller(pair.caller, bytes)
        deadline = time.perf_counter_ns() + 30 * SECOND
        calls = [asyncio.ensure_future(caller.call(1, bytes(1000), deadline)) for _ in range(10)]
        await asyncio.sleep(0.05)
        assert not any(call.done() for call in calls)  # (4 KiB ring: most wait for room)
        caller.moved()
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(o, PeerGone) and o.untaken for o in outcomes), outcomes

    asyncio.run(run())


def test_a_call_on_a_channel_closed_before_it_could_write_is_untaken(pair: Pair) -> None:
    """Another thread's call found the channel moved (or its server dead) and closed it while
    this call waited for it: nothing of this call was written, so it may go elsewhere."""
    from dsec_sdk.client import _SyncChannel

    channel = _SyncChannel(pair.caller, 1 << 20)
    pair.caller.close()
    with pytest.raises(PeerGone, match="the channel was closed") as gone:
        channel.invoke("record", {"seq": 1}, 5.0, "g1")
    assert gone.value.untaken
    with pytest.raises(PeerGone) as again:  # the Python path (a traced call) says the same
        channel.invoke(
            "record", {"seq": 1}, 5.0, "g1", trace="00-" + "1" * 32 + "-" + "2" * 16 + "-01"
        )
    assert again.value.untaken
