"""asyncio ends of a channel: the event loop sleeps where the sync code would block.

The same announce-then-sleep handshake as the blocking code, but the "sleep" is the loop's
``add_reader`` on the eventfd, so many calls can be in flight on one channel (answers are matched by
call id) and the loop keeps running other tasks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from dsec_sdk.errors import PeerGone, ProtocolError
from dsec_sdk.ipc import ring as r
from dsec_sdk.ipc.channel import CallerEnd, ServerEnd, Spin, drain
from dsec_sdk.ipc.server import ServeCore

if TYPE_CHECKING:
    from dsec_sdk.ipc.link import BrokerLink

T = TypeVar("T")
Frame = tuple[int, Any]


class AsyncCaller:
    """Pipelined calls over one :class:`CallerEnd`, from one event loop.

    Args:
        end: The channel (this object owns it from now on).
        decode: Turns a response body into a value (``codec.decode``, or ``bytes`` for a proxy).
    """

    def __init__(self, end: CallerEnd, decode: Callable[[memoryview], Any]) -> None:
        self.end = end
        self._decode = decode
        self._loop = asyncio.get_running_loop()
        self.loop = self._loop
        self.link: BrokerLink | None = None  # the connection that opened it (notices name it)
        self._pending: dict[int, asyncio.Future[Frame]] = {}
        self._space = asyncio.Event()
        self._send_lock = asyncio.Lock()
        self._blocked_senders = 0
        self._gone: PeerGone | None = None
        self._consumed_at_end: int | None = None  # the requests ring's TAIL when it failed
        self._loop.add_reader(end.wake_fd, self._on_wake)
        self._loop.add_reader(end.peer_pidfd, self._on_peer_exit)

    @property
    def closed(self) -> bool:
        """Whether the channel can no longer be used."""
        return self._gone is not None or self.end.is_closed

    async def call(self, kind: int, body: bytes, deadline_ns: int) -> Frame | None:
        """Send one request; its ``(kind, value)`` response, or ``None`` at the deadline.

        Raises:
            PeerGone: The server died or closed the channel.
        """
        end = self.end
        call_id = end.next_id
        end.next_id += 1
        future: asyncio.Future[Frame] = self._loop.create_future()
        self._pending[call_id] = future
        sent_to = -1
        try:
            self._raise_if_gone()
            if not await self._send(kind, call_id, body, deadline_ns):
                return None
            sent_to = int(end.requests.hdr[r.HEAD])  # where this request ends in the ring
            if len(self._pending) == 1 and end.spin.budget_ns:
                self._spin(future, deadline_ns)
            if not future.done():
                self._arm()
            if not future.done():
                timeout = max(0.0, (deadline_ns - time.perf_counter_ns()) / 1e9)
                try:
                    return await asyncio.wait_for(asyncio.shield(future), timeout)
                except TimeoutError:
                    return None
            return future.result()
        except PeerGone as exc:
            consumed = self._consumed_at_end
            # Written (sent_to >= 0) and read by the server, or not known to be unread: as is.
            if sent_to >= 0 and (consumed is None or consumed >= sent_to):
                raise
            # Never written (gone before, or while it waited for room), or never read: say so
            # (a hand-over may send it again).
            raise PeerGone(exc.agent, exc.reason, untaken=True) from exc
        finally:
            self._pending.pop(call_id, None)
            if future.done() and not future.cancelled():
                future.exception()  # (seen: a call that never got to wait on it raised already)
            if not self._pending and not self.end.is_closed:
                self.end.responses.hdr[r.CONSUMER_WAITING] = 0

    async def _send(self, kind: int, call_id: int, body: bytes, deadline_ns: int) -> bool:
        ring = self.end.requests
        # Requests enter the ring in call order: once one waits for space, later ones queue
        # behind it (asyncio.Lock is FIFO) instead of slipping into the ring ahead of it.
        if not self._blocked_senders and ring.try_write(kind, call_id, body):
            return True
        self._blocked_senders += 1
        try:
            async with self._send_lock:
                return await self._send_when_room(kind, call_id, body, deadline_ns)
        finally:
            self._blocked_senders -= 1

    async def _send_when_room(self, kind: int, call_id: int, body: bytes, deadline_ns: int) -> bool:
        ring = self.end.requests
        while True:
            self._raise_if_gone()  # (before the ring is touched: a gone channel is unmapped)
            if ring.try_write(kind, call_id, body):
                break
            ring.hdr[r.PRODUCER_WAITING] = 1
            r.fence()
            self.end.responses.wake_waiting_producer()
            if ring.try_write(kind, call_id, body):
                break
            self._space.clear()
            timeout = (deadline_ns - time.perf_counter_ns()) / 1e9
            if timeout <= 0:
                return False
            try:
                await asyncio.wait_for(self._space.wait(), timeout)
            except TimeoutError:
                return False
            finally:
                if not self.end.is_closed:
                    ring.hdr[r.PRODUCER_WAITING] = 0
        return True

    def _spin(self, future: asyncio.Future[Frame], deadline_ns: int) -> None:
        """Busy-wait briefly in the loop thread: a local tool often answers within microseconds."""
        end = self.end
        spin_until = end.responses.spin_until
        clock = time.perf_counter_ns
        now = clock()
        stop = min(deadline_ns, now + end.spin.budget_ns)
        yield_after = now + end.spin.pure_ns
        while True:
            outcome = spin_until(stop, yield_after)
            if outcome == 1:
                break
            if outcome == 0:
                end.spin.miss()
                return
            yield_after = end.spin.yield_cpu(clock())
        end.spin.hit()
        self._read_all()

    def _arm(self) -> None:
        self.end.responses.hdr[r.CONSUMER_WAITING] = 1
        r.fence()
        self.end.responses.wake_waiting_producer()
        self._read_all()

    def _read_all(self) -> None:
        responses = self.end.responses
        while True:
            try:
                frame = responses.try_read(self._decode)
            except ProtocolError as exc:
                self._fail(PeerGone(self.end.peer, f"it wrote a malformed frame ({exc})"))
                return
            if frame is None:
                return
            kind, call_id, value = frame
            future = self._pending.get(call_id)
            # No future: the answer to a call that already timed out.
            if future is not None and not future.done():
                future.set_result((kind, value))

    def _on_wake(self) -> None:
        if self.end.is_closed:
            return
        drain(self.end.wake_fd)
        if self.end.spin.max_ns:  # a spinning caller gains from a core of its own
            self.end.leave_servers_core()
        self._space.set()
        self._read_all()
        reason = self.end.peer_gone_reason(check_pid=False)  # the pidfd has its own reader
        if reason is not None:
            self._fail(PeerGone(self.end.peer, reason))

    def _on_peer_exit(self) -> None:
        if not self.end.is_closed:
            self._read_all()
        self._fail(PeerGone(self.end.peer, "its process exited"))

    def moved(self) -> None:
        """A final hand-over moved this channel's server (its old process frozen for good):
        answers already here are delivered, every call still waiting ends in ``PeerGone``
        (untaken where the old server never read its request: the client sends it to the new
        one), and the channel is closed (the next call opens one to the new server)."""
        if self.end.is_closed or self._gone is not None:
            return
        self._read_all()
        self._fail(PeerGone(self.end.peer, "a hand-over moved it to its new version"))

    def _raise_if_gone(self) -> None:
        gone = self._gone
        if gone is not None:  # (a new one each time: one raised in many tasks would collect
            raise PeerGone(gone.agent, gone.reason)  # every task's traceback)
        if self.end.is_closed:
            raise PeerGone(self.end.peer, "the channel was closed")

    def _fail(self, exc: PeerGone) -> None:
        self._gone = exc
        if not self.end.is_closed and self._consumed_at_end is None:
            self._consumed_at_end = int(self.end.requests.hdr[r.TAIL])
        for future in self._pending.values():
            if not future.done():
                future.set_exception(exc)
        self._space.set()
        self.close()

    def close(self) -> None:
        """Stop watching the channel and free it; calls in flight get ``PeerGone``."""
        if self.end.is_closed:
            return
        self._loop.remove_reader(self.end.wake_fd)
        self._loop.remove_reader(self.end.peer_pidfd)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(PeerGone(self.end.peer, "the channel was closed"))
        self.end.close()


class AsyncServeLoop:
    """Serve a :class:`ServeCore` from an event loop, sleeping on the doorbell between bursts.

    Args:
        doorbell: The eventfd every caller rings.
        decode: Turns a request body into a value.
        handle: Called with ``(end, call_id, value)``; may return an awaitable.
        spin_ns: How long to spin for the next request before sleeping (0: never spin).
        on_gone: Called with each channel whose caller went away.
    """

    def __init__(
        self,
        doorbell: int,
        decode: Callable[[memoryview], Any],
        handle: Callable[[ServerEnd, int, Any], Awaitable[None] | None],
        spin_ns: int = 0,
        on_gone: Callable[[ServerEnd], None] | None = None,
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self.core = ServeCore(on_remove=self._forget)
        self.doorbell = doorbell
        self._decode = decode
        self._handle = handle
        self._spin_ns = spin_ns
        self._spin = Spin(spin_ns)
        self._on_gone = on_gone
        self._wake = asyncio.Event()
        self._stopped = False
        self._pid_fired = False
        # A hand-over's pause: no new request is read while set (the one in progress finishes).
        self._pause_asked = False
        self._paused = asyncio.Event()
        self._resumed = asyncio.Event()

    def add(self, end: ServerEnd) -> None:
        """Serve a new channel."""
        self.core.add(end)
        self._loop.add_reader(end.peer_pidfd, self._on_peer_exit)
        self.kick()

    def respond(self, end: ServerEnd, kind: int, call_id: int, body: bytes) -> None:
        """Send a response from any task of this loop."""
        if end.is_closed:
            return
        end.respond(kind, call_id, body)
        if end.backlog:
            self.kick()

    def kick(self) -> None:
        """Wake the loop (new channel, backlog, peer exit, stop)."""
        self._wake.set()

    def _on_peer_exit(self) -> None:
        self._pid_fired = True
        self.kick()

    def stop(self) -> None:
        """Make :meth:`run` return."""
        self._stopped = True
        self._resumed.set()
        self.kick()

    async def pause(self, timeout_s: float = 10.0) -> bool:
        """Finish the requests being answered, then read no new ones until :meth:`resume`
        (the old version of a hand-over); ``False`` if that took longer than ``timeout_s``."""
        self._pause_asked = True
        self._resumed.clear()
        self.kick()
        try:
            await asyncio.wait_for(self._paused.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    def resume(self) -> None:
        """Read requests again (a hand-over that failed)."""
        self._pause_asked = False
        self._paused.clear()
        self._resumed.set()
        self.kick()

    async def run(self) -> None:
        """Serve until :meth:`stop`; closes every channel on the way out."""
        self._loop.add_reader(self.doorbell, self._on_doorbell)
        try:
            while not self._stopped:
                if self._pause_asked:
                    self._paused.set()
                    await self._resumed.wait()
                    continue
                if await self._serve_burst():
                    continue
                if self._spin_ns and self._spin_for_work():
                    continue
                if self.core.announce_sleep():
                    self._wake.clear()
                    await self._wake.wait()
                    self.core.woke()
                    if self._spin_ns:  # a spinning server gains from its own core
                        self.core.leave_callers_core()
                self._reap()
        finally:
            self._loop.remove_reader(self.doorbell)
            self.core.close()

    async def _serve_burst(self) -> bool:
        work = self.core.next_requests(self._decode)
        for end, call_id, value in work:
            pending = self._handle(end, call_id, value)
            if pending is not None:
                await pending
        if work:
            # Let the rest of the application run between bursts.
            await asyncio.sleep(0)
        return bool(work)

    def _spin_for_work(self) -> bool:
        spin = self._spin
        if self.core.spin_for_work(time.perf_counter_ns() + spin.budget_ns, spin):
            spin.hit()
            return True
        spin.miss()
        return False

    def _on_doorbell(self) -> None:
        drain(self.doorbell)
        self._wake.set()

    def _forget(self, end: ServerEnd) -> None:
        self._loop.remove_reader(end.peer_pidfd)
        if self._on_gone is not None:
            self._on_gone(end)

    def _reap(self) -> None:
        check_pids, self._pid_fired = self._pid_fired, False
        self.core.reap(check_pids=check_pids)
