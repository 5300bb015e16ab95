"""Channels: a pair of rings (requests, responses) in one memfd, plus their wake-up eventfds.

The broker calls :func:`create_channel`; the caller and the server wrap the fds they receive in a
:class:`CallerEnd` / :class:`ServerEnd`. Waiting is spin-then-block: spin on the ring for a short,
adaptive budget (a round trip between spinning processes is ~1 µs here, a wake-up ~70 µs), then
announce "I am going to sleep" in the ring header and sleep on the eventfd, so a writer pays the
``eventfd_write`` syscall only when the reader really sleeps. While asleep, the reader also watches
the peer's pidfd: a killed peer wakes it at once and becomes :class:`~dsec_sdk.errors.PeerGone`.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import select
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from dsec_sdk.errors import PeerGone, ProtocolError
from dsec_sdk.ipc import ring as r
from dsec_sdk.ipc.control import close_fds
from dsec_sdk.ipc.link import BUSY as _BUSY
from dsec_sdk.ipc.link import GONE as _GONE
from dsec_sdk.ipc.link import MOVED as _MOVED

DEFAULT_CAPACITY: Final = 1 << 18
DEFAULT_MAX_PAYLOAD: Final = 64 << 20
# A caller that found the broker connection in another thread's hands looks again after this
# (that thread reads the hand-over notices queued there before it lets go).
_MOVES_AGAIN_NS: Final = 1_000_000
# A sleeper re-checks this often even without a wake-up: a lost wake-up costs at most this, never
# a hang (belt and braces on top of the fence).
_MAX_SLEEP_NS: Final = 50_000_000
# Spin at most this long before yielding the CPU between checks: a hot peer answers well within
# it, and past it the peer is probably not running, so on a loaded machine it may need our core.
PURE_SPIN_NS: Final = 5_000
# A sched_yield() that takes longer than this switched to another task: someone (likely the peer)
# was waiting for this very core, so spinning without yielding only delays it.
_SWITCHED_NS: Final = 3_000
# A wake-up usually lands on the core of the task that woke us (the scheduler's wake-affine
# placement), so after a sleep two agents often share one core, and a yield never moves a task:
# every call would then be a context switch (~11 µs instead of ~3 µs) for as long as they talk.
# So an end that wakes up next to its peer moves to another core, at most this often.
MIGRATE_EVERY_NS: Final = 200_000

_RING_SEALS: Final = r.SEALS


@dataclass(frozen=True)
class ChannelFds:
    """File descriptors of a new channel, owned by the broker until sent."""

    memfd: int
    request_overflow: int
    response_overflow: int
    caller_wake: int

    def all(self) -> list[int]:
        """Every fd, in the order they travel."""
        return [self.memfd, self.request_overflow, self.response_overflow, self.caller_wake]

    def close(self) -> None:
        """Close the broker's copies."""
        close_fds(self.all())


def new_eventfd() -> int:
    """A non-blocking, close-on-exec eventfd (the wake-up primitive of one sleeper)."""
    return os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)


def create_channel(
    capacity: int = DEFAULT_CAPACITY, max_payload: int = DEFAULT_MAX_PAYLOAD
) -> ChannelFds:
    """Create the shared memory of one channel (broker side).

    Every memfd is sized here and sealed against shrinking, growing and further seals
    (:data:`ring.SEALS`): a hostile peer can neither shrink one under the other side's mapping
    (SIGBUS) nor grow one so that the other side's mmap() fails. The overflow memfds get
    ``max_payload`` bytes up front; tmpfs allocates pages only when written, so this costs
    nothing until a large body is sent (and a consumer frees them again after reading it).
    """
    r.check_capacity(capacity)
    if max_payload <= 0:
        raise ValueError(f"max_payload {max_payload} is invalid: use a positive byte count")
    memfd = os.memfd_create("dsec-ipc", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    fds = [memfd]
    try:
        os.ftruncate(memfd, 2 * r.ring_size(capacity))
        fcntl.fcntl(memfd, fcntl.F_ADD_SEALS, _RING_SEALS)
        for name in ("dsec-ipc-req", "dsec-ipc-resp"):
            fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            fds.append(fd)
            os.ftruncate(fd, max_payload)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _RING_SEALS)
        fds.append(new_eventfd())
    except BaseException:
        close_fds(fds)
        raise
    return ChannelFds(*fds)


class Sleeper:
    """Sleeps on one eventfd while watching pidfds (readable = that process exited)."""

    def __init__(self, wake_fd: int) -> None:
        self.wake_fd = wake_fd
        self._poll = select.poll()
        self._poll.register(wake_fd, select.POLLIN)

    def watch(self, fd: int) -> None:
        """Also wake when ``fd`` becomes readable."""
        self._poll.register(fd, select.POLLIN)

    def unwatch(self, fd: int) -> None:
        """Stop watching ``fd``."""
        with contextlib.suppress(KeyError):
            self._poll.unregister(fd)

    def sleep(self, timeout_ns: int) -> list[int]:
        """Sleep up to ``timeout_ns``; return the watched fds that fired (drains the eventfd)."""
        timeout_ms = max(0, min(timeout_ns, _MAX_SLEEP_NS) + 999_999) // 1_000_000
        fired: list[int] = []
        for fd, _ in self._poll.poll(timeout_ms):
            if fd == self.wake_fd:
                drain(fd)
            else:
                fired.append(fd)
        return fired


def drain(fd: int) -> None:
    """Reset an eventfd's counter (non-blocking)."""
    with contextlib.suppress(BlockingIOError):
        os.eventfd_read(fd)


def pidfd_exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def current_cpu() -> int:
    """The CPU this thread runs on now; -1 without the C extension (then no ring records a
    core either, so nothing is compared with it)."""
    if r._fastring is None:
        return -1
    cpu: int = r._fastring.current_cpu()
    return cpu


def move_off_core(peer_cpu: int) -> bool:
    """If this thread runs on ``peer_cpu``, migrate it once to another CPU it may use.

    Not pinning: the thread's affinity is narrowed to the chosen CPU, which moves it there at
    once, then set back to what it was, which leaves it there until the scheduler decides
    otherwise. Only CPUs of the current mask are chosen (a sandbox's cpuset holds).
    """
    if peer_cpu < 0 or current_cpu() != peer_cpu:
        return False
    try:
        allowed = os.sched_getaffinity(0)
        others = sorted(allowed - {peer_cpu})
        if not others:
            return False
        os.sched_setaffinity(0, {others[time.perf_counter_ns() % len(others)]})
        os.sched_setaffinity(0, allowed)
    except OSError:
        return False
    return True


class CoreMover:
    """Leaves the peer's core after a wake-up (:func:`move_off_core`), at most once per
    ``MIGRATE_EVERY_NS``; counts the moves."""

    def __init__(self) -> None:
        self._next = 0
        self.moves = 0

    def leave(self, peer_cpu: int) -> bool:
        """Move off ``peer_cpu`` if this thread runs there and the last try is long enough ago."""
        now = time.perf_counter_ns()
        if now < self._next:
            return False
        self._next = now + MIGRATE_EVERY_NS
        moved = move_off_core(peer_cpu)
        self.moves += moved
        return moved


class Spin:
    """Adaptive spin budget.

    A hit (the event came while spinning) restores the full budget. Only a run of misses halves
    it: one miss is usually a preemption on a busy machine, while a steady run means the peer is
    slow (a tool that takes milliseconds), where spinning only burns a core. A miss during which
    a yield switched to another task does not count: the budget ran out while someone else had
    the core (often the very peer we wait for), which says nothing about the peer's speed. (It
    did count once, and two agents stacked on one core shrank their budget to nothing, then
    slept and woke, ~25 µs, on every call.)
    """

    MISSES_BEFORE_SHRINK: Final = 8

    def __init__(self, max_ns: int) -> None:
        self.max_ns = max(0, max_ns)
        self.min_ns = min(self.max_ns, 2_000)
        self.budget_ns = self.max_ns
        # Pure spinning before the first yield: drops to 0 when a yield shows that we share our
        # core with a waiting task (then only yielding lets the peer run); back to full when a
        # yield comes straight back, else regrows by 500 ns a hit.
        self.pure_ns = PURE_SPIN_NS
        self._misses = 0
        # True while hit() would change nothing: the hot path tests this flag instead of calling.
        self.settled = True
        self._contended = False  # a yield switched to another task since the last hit or miss

    def hit(self) -> None:
        """The awaited event came while spinning."""
        self._misses = 0
        self._contended = False
        self.budget_ns = self.max_ns
        if self.pure_ns < PURE_SPIN_NS:
            self.pure_ns += 500
        self.settled = self.pure_ns >= PURE_SPIN_NS

    def yield_cpu(self, now: int) -> int:
        """Yield the core once (when spinning past ``pure_ns``); return when to yield next.

        A yield that switched to another task proves the core is shared: from then on, yield at
        every check. One that came straight back proves nobody wants this core now, so another
        syscall soon would only delay noticing the event: spin purely again (now and next time).
        """
        os.sched_yield()
        after = time.perf_counter_ns()
        if after - now > _SWITCHED_NS:
            self.pure_ns = 0
            self.settled = False
            self._contended = True
            return after
        self.pure_ns = PURE_SPIN_NS
        return after + PURE_SPIN_NS

    def miss(self) -> None:
        """Spinning was in vain."""
        self.settled = False
        if self._contended:
            self._contended = False
            return
        self._misses += 1
        if self._misses >= self.MISSES_BEFORE_SHRINK:
            self.budget_ns = max(self.min_ns, self.budget_ns // 2)


class _End:
    """What both ends share: the mapping, both rings, the peer's pidfd."""

    def __init__(
        self,
        *,
        channel_id: int,
        peer: str,
        capacity: int,
        fds: list[int],
        caller_wake: int,
        server_wake: int,
        peer_pidfd: int,
        max_payload: int,
    ) -> None:
        memfd, req_overflow, resp_overflow = fds[:3]
        self.channel_id = channel_id
        self.peer = peer
        self.peer_pidfd = peer_pidfd
        self._fds = fds
        size = 2 * r.ring_size(capacity)
        try:
            r.check_capacity(capacity)
            c_path = r.accelerated()  # a bad DSEC_IPC_PURE_PYTHON fails here, nothing mapped yet
            if r.sealed_size(memfd, "channel memfd") != size:
                raise ValueError(f"channel memfd is not {size} bytes for ring capacity {capacity}")
            for fd in (req_overflow, resp_overflow):
                r.sealed_size(fd, "overflow memfd")
        except (ValueError, ProtocolError):
            close_fds(fds)  # this end owns them: nothing may leak from a refused channel
            raise
        # Faulted in as the rings are used, not up front: a page's first touch costs a fault in
        # each process (~4 µs in a VM), so a new channel pays one every ~18 small calls until
        # its rings have wrapped once, instead of ~0.5 ms for all 128 pages with MAP_POPULATE on
        # the call that opened it (the first call to every peer, and the call that follows a
        # hand-over). Populating on a helper thread instead gained nothing on two cores: it
        # took the CPU the first calls needed (2026-12-06, first + second call 0.65 against
        # 0.62 ms with MAP_POPULATE).
        self._mm = mmap.mmap(memfd, size, flags=mmap.MAP_SHARED)
        view = memoryview(self._mm)
        half = r.ring_size(capacity)
        self.requests = r.Ring(
            view[:half],
            capacity,
            req_overflow,
            server_wake,
            caller_wake,
            max_payload,
            c_path=c_path,
        )
        self.responses = r.Ring(
            view[half:],
            capacity,
            resp_overflow,
            caller_wake,
            server_wake,
            max_payload,
            c_path=c_path,
        )
        view.release()
        self.is_closed = False
        # Why this end stopped trusting the channel (a peer corrupted it); reaped like a dead peer.
        self.broken: str | None = None

    def peer_gone_reason(self, *, check_pid: bool = True) -> str | None:
        """Why the peer is gone, or ``None`` while it is alive and the channel open.

        ``check_pid=False`` skips the pidfd (a syscall) when the caller watches it anyway.
        """
        if self.is_closed:
            return "the channel was closed"
        if self.broken is not None:
            return self.broken
        if self.requests.closed or self.responses.closed:
            return "it closed the channel"
        if check_pid and pidfd_exited(self.peer_pidfd):
            return "its process exited"
        return None

    def close(self) -> None:
        """Mark the channel closed for the peer and free everything this end holds."""
        if self.is_closed:
            return
        self.is_closed = True
        for ring in (self.requests, self.responses):
            ring.mark_closed()
            ring.release()
        self._mm.close()
        close_fds(self._fds)


class CallerEnd(_End):
    """The calling side: produces requests, consumes responses. Not thread-safe (lock it)."""

    def __init__(
        self,
        *,
        channel_id: int,
        peer: str,
        capacity: int,
        fds: list[int],
        max_payload: int,
        spin_ns: int,
    ) -> None:
        if len(fds) != 6:
            close_fds(fds)
            raise ValueError(f"a caller channel needs 6 fds, got {len(fds)}")
        caller_wake, server_wake, peer_pidfd = fds[3], fds[4], fds[5]
        super().__init__(
            channel_id=channel_id,
            peer=peer,
            capacity=capacity,
            fds=fds,
            caller_wake=caller_wake,
            server_wake=server_wake,
            peer_pidfd=peer_pidfd,
            max_payload=max_payload,
        )
        self.wake_fd = caller_wake
        self.spin = Spin(spin_ns)
        self._spin_until = self.responses.spin_until
        self.placement = CoreMover()
        self.sleeper = Sleeper(caller_wake)
        self.sleeper.watch(peer_pidfd)
        self.next_id = 1
        # The broker connection's moved notices (see watch_moves): its fd, the question to ask
        # when it is readable, and when to watch it again after the answer was "busy".
        self._moves_fd = -1
        self._moves: Callable[[int], int] | None = None
        self._moves_known: Callable[[int], bool] | None = None
        self._moves_again_ns = 0

    def watch_moves(
        self, fd: int, moved: Callable[[int], int], known: Callable[[int], bool]
    ) -> None:
        """While asleep, also watch the broker connection ``fd``: a final hand-over's ``moved``
        notice naming this channel wakes a call whose request the old (frozen) server never
        read, which then goes to the new server at once instead of when the old process is
        gone. ``moved(channel_id)`` answers as ``BrokerLink.moved_channel``; ``known`` as
        ``BrokerLink.moved_known`` (a notice another thread read already: asked before each
        sleep and after each wake-up, whatever woke it)."""
        self._moves_fd, self._moves, self._moves_known = fd, moved, known
        self.sleeper.watch(fd)

    def _server_cpu(self) -> int:
        # Recorded by the server's C read path; 0 (unknown) in a pure-Python server.
        return int(self.requests.hdr[r.CONSUMER_CPU]) - 1

    def send(self, kind: int, call_id: int, body: bytes, deadline_ns: int) -> bool:
        """Publish a request, waiting for space; ``False`` if the deadline passed first.

        Raises:
            PeerGone: The server died or closed the channel.
        """
        ring = self.requests
        if ring.try_write(kind, call_id, body):
            return True
        hdr = ring.hdr
        while True:
            hdr[r.PRODUCER_WAITING] = 1
            r.fence()
            self.responses.wake_waiting_producer()
            if ring.try_write(kind, call_id, body):
                hdr[r.PRODUCER_WAITING] = 0
                return True
            if not self._sleep(deadline_ns):
                hdr[r.PRODUCER_WAITING] = 0
                return False

    def wait_response(self, deadline_ns: int) -> bool:
        """Spin, then sleep, until a response is readable; ``False`` at the deadline.

        Raises:
            PeerGone: The server died or closed the channel with nothing left to read.
        """
        hdr = self.responses.hdr
        if hdr[0] != hdr[8]:  # HEAD != TAIL
            return True
        spin = self.spin
        now = time.perf_counter_ns()
        spin_end = min(now + spin.budget_ns, deadline_ns)
        yield_after = now + spin.pure_ns
        spin_until = self._spin_until
        while True:
            outcome = spin_until(spin_end, yield_after)
            if outcome == 1:
                if not spin.settled:
                    spin.hit()
                return True
            if outcome == 0:
                break
            yield_after = spin.yield_cpu(time.perf_counter_ns())
        spin.miss()
        while True:
            hdr[r.CONSUMER_WAITING] = 1
            r.fence()
            self.responses.wake_waiting_producer()
            if hdr[r.HEAD] != hdr[r.TAIL]:
                hdr[r.CONSUMER_WAITING] = 0
                return True
            alive = self._sleep(deadline_ns)
            hdr[r.CONSUMER_WAITING] = 0
            if hdr[r.HEAD] != hdr[r.TAIL]:
                return True
            if not alive:
                return False

    def _sleep(self, deadline_ns: int) -> bool:
        """One bounded sleep; ``False`` when the deadline has passed; raises if the peer is gone."""
        reason = self.peer_gone_reason()
        if reason is not None and not self.responses.readable():
            raise PeerGone(self.peer, reason)
        now = time.perf_counter_ns()
        remaining = deadline_ns - now
        if remaining <= 0:
            return False
        known = self._moves_known
        if known is not None:
            if known(self.channel_id):  # (another thread read the notice: no wake-up comes)
                self._moved()
            if self._moves_again_ns:  # watching the connection paused (see _check_moved)
                if now >= self._moves_again_ns:
                    self._moves_again_ns = 0
                    self.sleeper.watch(self._moves_fd)
                else:
                    remaining = min(remaining, self._moves_again_ns - now)
        fired = self.sleeper.sleep(remaining)
        if known is not None and self._moves is not None:
            if fired and self._moves_fd in fired:
                self._check_moved()
            elif known(self.channel_id):
                self._moved()
        self.leave_servers_core()
        return True

    def _moved(self) -> None:
        """A final hand-over moved this channel's server: unless its answer is here, the call
        waiting on it stops waiting (the client sends it again if the old one never read it)."""
        if not self.responses.readable():
            raise PeerGone(self.peer, "a hand-over moved it to its new version")

    def _check_moved(self) -> None:
        """The broker connection is readable: raise :class:`PeerGone` if a final hand-over moved
        this channel's server and no answer is waiting here."""
        assert self._moves is not None
        verdict = self._moves(self.channel_id)
        if verdict == _MOVED:
            self._moved()
        elif verdict == _BUSY:
            # Another thread reads the connection now (and the notices with it): stop watching
            # it for a moment instead of waking again and again while its answer is unread.
            self.sleeper.unwatch(self._moves_fd)
            self._moves_again_ns = time.perf_counter_ns() + _MOVES_AGAIN_NS
        elif verdict == _GONE:  # closed, or at its end: it says nothing any more
            self.sleeper.unwatch(self._moves_fd)
            self._moves, self._moves_known, self._moves_fd = None, None, -1

    def leave_servers_core(self) -> None:
        """Just woken (likely by the server): if it runs on this core, move to another."""
        self.placement.leave(self._server_cpu())

    @property
    def moves(self) -> int:
        """Times this end left its server's core after a wake-up."""
        return self.placement.moves


class ServerEnd(_End):
    """The serving side of one channel: consumes requests, produces responses."""

    def __init__(
        self,
        *,
        channel_id: int,
        peer: str,
        capacity: int,
        fds: list[int],
        doorbell: int,
        max_payload: int,
    ) -> None:
        if len(fds) != 5:
            close_fds(fds)
            raise ValueError(f"a server channel needs 5 fds, got {len(fds)}")
        super().__init__(
            channel_id=channel_id,
            peer=peer,
            capacity=capacity,
            fds=fds,
            caller_wake=fds[3],
            server_wake=doorbell,
            peer_pidfd=fds[4],
            max_payload=max_payload,
        )
        # Responses that did not fit (the caller is slow to read): sent before any new request
        # of this channel is read, so one slow caller throttles only itself.
        self.backlog: list[tuple[int, int, bytes]] = []

    def flush_backlog(self) -> bool:
        """Send queued responses; ``True`` when the backlog is empty afterwards."""
        backlog = self.backlog
        while backlog:
            kind, call_id, body = backlog[0]
            try:
                if not self.responses.try_write(kind, call_id, body):
                    return False
            except ProtocolError as exc:  # a hostile caller corrupted its ring: only this channel
                self._break(exc)
                return True
            backlog.pop(0)
        return True

    def respond(self, kind: int, call_id: int, body: bytes) -> None:
        """Send a response now, or queue it behind earlier ones when the ring is full.

        A ring a hostile caller corrupted marks this channel broken (the server reaps it, see
        :meth:`peer_gone_reason`) instead of raising into the server's loop. A channel closed
        meanwhile (a tool that stopped its server, a hand-over) has nobody to answer: dropped.
        """
        if self.broken is not None or self.is_closed:
            return
        try:
            if self.backlog or not self.responses.try_write(kind, call_id, body):
                self.backlog.append((kind, call_id, body))
        except ProtocolError as exc:
            self._break(exc)

    def _break(self, exc: ProtocolError) -> None:
        self.backlog.clear()
        self.broken = f"it corrupted the channel ({exc})"
