"""An agent's connection to the broker (one per role: calling, serving)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec_sdk.errors import AgentNotFound, BrokerRefused, BrokerUnavailable, ProtocolError
from dsec_sdk.ipc import control

log = logging.getLogger(__name__)

_CONNECT_TIMEOUT_S = 10.0
_MOVED_CHANNELS_KEPT = 4096

# BrokerLink.moved_channel's answers.
MOVED = 1
NOT_MOVED = 0
BUSY = -1
GONE = -2


def _connect(sock: socket.socket, path: Path) -> None:
    """Connect, retrying while the broker's listen backlog is full (EAGAIN on a Unix socket
    with a timeout: someone floods it, and the broker sheds those connections in time)."""
    deadline = time.monotonic() + _CONNECT_TIMEOUT_S
    pause = 0.001
    while True:
        try:
            sock.connect(os.fspath(path))
            return
        except BlockingIOError:
            if time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


_dup = os.dup  # (a name of its own: a test runs out of fds for the bells alone)
_BELLS_PRUNE_AT = 16  # bells kept before closed channels' are looked for (then twice as many)

_WATCH_POLL_MS = 1000  # the notice thread looks whether its connection still lives this often


def _watch(link_ref: weakref.ref[BrokerLink], fd: int) -> None:
    """:meth:`BrokerLink.watch_notices`'s thread. It only polls ``fd``; reading is the link's,
    which first checks that its socket is still open (a closed fd's number may be reused), and
    which tells the listener of every final notice, whichever thread read it."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    paused = False
    while True:
        fired = poller.poll(1 if paused else _WATCH_POLL_MS)
        link = link_ref()
        if link is None:
            return
        if paused:  # look again: the thread that held it read what was queued, or let go
            paused = False
            poller.register(fd, select.POLLIN)
            fired = [(fd, 0)]
        if not fired:
            if link.sock.fileno() < 0:
                return
            continue
        verdict = link.read_notices()
        del link
        if verdict == BUSY:  # leave the connection to that thread a moment (no busy loop)
            poller.unregister(fd)
            paused = True
            continue
        if verdict == GONE:
            return


class BrokerLink:
    """A ``SOCK_SEQPACKET`` connection to the broker, after a successful hello.

    Args:
        path: The broker's socket.
        agent: This agent's name.
        group: This agent's task group.
        role: ``caller`` or ``server``.
        tools: Tool names (servers only).
        takeover: A server that replaces a live server of its name (see ``DSecClient``).
        connect_to: A caller's first peer: its ``connect`` is sent right behind the hello, and
            :meth:`connect` to that peer then only reads the answer (one round trip to the
            broker saved on a new client's first call).

    Raises:
        BrokerUnavailable: Nothing listens on ``path``, or the broker refused the hello.
    """

    def __init__(
        self,
        path: Path,
        agent: str,
        group: str,
        role: str,
        tools: list[str] | None = None,
        *,
        takeover: bool = False,
        connect_to: str | None = None,
    ) -> None:
        self.path = path
        self.agent = agent
        self.group = group
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        sock.settimeout(_CONNECT_TIMEOUT_S)
        try:
            _connect(sock, path)
        except OSError as exc:
            sock.close()
            raise BrokerUnavailable(
                f"cannot reach the DSec IPC broker at {path} ({exc.strerror or exc}); "
                "is the node agent running? (set DSEC_IPC_SOCKET to its socket)"
            ) from exc
        self.sock = sock
        self._lock = threading.Lock()
        # Peers a hand-over moved to a new server (``moved`` messages not yet looked at).
        self._moved: set[str] = set()
        # This caller's channels whose old server a final hand-over froze for good (the
        # ``channels`` of ``moved`` notices; see :meth:`moved_channel`).
        self._moved_channels: set[int] = set()
        self._eof = False  # the broker closed the connection (a notice reader saw it)
        # Channels whose sleeper a final notice wakes, whichever thread reads it: channel id ->
        # (its caller end, weakly; a duplicate of that end's wake eventfd). See ring_on_move.
        self._bells: dict[int, tuple[weakref.ref[Any], int]] = {}
        self._bells_prune_at = _BELLS_PRUNE_AT  # (closed channels' bells forgotten past this)
        self._bells_lock = threading.Lock()
        self._bells_closed = False
        self._watch_lock = threading.Lock()
        # Told of every final notice; set when a thread reads them (see watch_notices).
        self._listener: Callable[[], None] | None = None
        self._refs = itertools.count(1)
        self._sent_connect: tuple[int, str] | None = None  # (ref, peer): sent, unanswered
        try:
            hello = {
                "op": "hello",
                "agent": agent,
                "group": group,
                "role": role,
                "tools": tools or [],
                "pid": os.getpid(),
                "takeover": takeover,
            }
            try:
                control.send(sock, hello)
                if connect_to is not None and role == "caller":
                    # (the broker reads it once the hello is done; refused, it is never read)
                    ref = next(self._refs)
                    control.send(sock, {"op": "connect", "ref": ref, "peer": connect_to})
                    self._sent_connect = (ref, connect_to)
            except OSError as exc:
                # A broker that turns a connection away (a bound reached) sends why and closes,
                # possibly before our hello: its reason is still queued for us to read.
                reply = self._recv_refusal(exc)
            else:
                reply = self._recv()
        except BaseException:
            sock.close()
            raise
        message, fds = reply
        if message["op"] != "welcome":
            control.close_fds(fds)
            sock.close()
            raise BrokerUnavailable(f"the broker refused {agent!r}: {message.get('message')}")
        self.welcome = message
        self.welcome_fds = fds

    def _recv_refusal(self, cause: OSError) -> tuple[dict[str, Any], list[int]]:
        try:
            reply = control.recv(self.sock)
        except OSError:
            reply = None
        if reply is None:
            raise BrokerUnavailable(f"the broker at {self.path} closed the connection: {cause}")
        return reply

    def _recv(self) -> tuple[dict[str, Any], list[int]]:
        """The next answer (``moved`` notices that arrive meanwhile are kept aside)."""
        while True:
            message, fds = self._recv_any()
            if message.get("op") != "moved":
                return message, fds
            control.close_fds(fds)
            self._note_moved(message)

    def _note_moved(self, message: dict[str, Any]) -> None:
        peer = message.get("peer")
        if isinstance(peer, str):
            self._moved.add(peer)
        channels = message.get("channels")
        if isinstance(channels, list):
            if len(self._moved_channels) + len(channels) > _MOVED_CHANNELS_KEPT:
                # (a caller whose channel is forgotten here learns it when the old process
                # is gone, as before final notices existed)
                self._moved_channels.clear()
            named = [c for c in channels if type(c) is int]
            self._moved_channels.update(named)
            self._ring(named)  # (after noting them: a woken sleeper finds its channel known)
            listener = self._listener
            if listener is not None:
                try:
                    listener()
                except Exception:  # (a listener's bug must not stop this thread's request)
                    log.exception("ipc: the moved-notice listener failed")

    def ring_on_move(self, end: Any) -> None:
        """Wake the caller asleep on ``end`` (a ``CallerEnd`` this link opened: it sleeps on
        ``end.wake_fd``) as soon as a final notice naming ``end.channel_id`` is read, by
        whichever thread: without this, a sleeper whose notice another thread read (an event
        loop's notice thread, a thread opening a channel) learned of it only after its current
        sleep, up to 50 ms. The link keeps a duplicate of the fd (``end`` may close its own at
        any time, and a closed fd's number may be reused) until the notice, until the link
        closes, or, once ``end`` is closed or garbage, until the bells are next pruned (when
        their number has doubled since the last time: no scan on every channel opened)."""
        try:
            bell = _dup(end.wake_fd)
        except OSError:  # (no fd left: this channel learns of a move at its next wake-up)
            return
        stale: list[int] = []
        with self._bells_lock:
            if self._bells_closed:
                stale.append(bell)
            else:
                old = self._bells.pop(end.channel_id, None)  # (a dropped channel's id, reused)
                if old is not None:
                    stale.append(old[1])
                if len(self._bells) >= self._bells_prune_at:
                    for cid, (ref, fd) in list(self._bells.items()):
                        owner = ref()
                        if owner is None or owner.is_closed:
                            del self._bells[cid]
                            stale.append(fd)
                    self._bells_prune_at = max(_BELLS_PRUNE_AT, 2 * len(self._bells))
                self._bells[end.channel_id] = (weakref.ref(end), bell)
        self._close_bells_if_closed()
        for fd in stale:
            os.close(fd)

    def _ring(self, channels: list[int]) -> None:
        with self._bells_lock:
            bells = [b for c in channels if (b := self._bells.pop(c, None)) is not None]
        self._close_bells_if_closed()
        for _, fd in bells:
            with contextlib.suppress(OSError):
                os.eventfd_write(fd, 1)
            os.close(fd)

    def _close_bells_if_closed(self) -> None:
        """Once the link is closed, close the bells left, unless another thread holds their
        lock: :meth:`close` never waits for it (it may run in a signal handler above a thread
        holding it), so whoever holds it looks here after letting go."""
        if not self._bells_closed or not self._bells_lock.acquire(blocking=False):
            return
        try:
            bells, self._bells = list(self._bells.values()), {}
        finally:
            self._bells_lock.release()
        for _, fd in bells:
            os.close(fd)

    def _read_queued(self) -> None:
        """Read the notices queued on the connection without waiting (the lock held)."""
        if self._eof or self._sent_connect is not None:
            # (the first connect's answer may be queued among them: connect() reads it, then
            # the notices behind it)
            return
        # poll() first: a socket with a timeout would wait for data despite MSG_DONTWAIT.
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        while poller.poll(0):
            try:
                received = control.recv(self.sock, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except ProtocolError:  # (that datagram is consumed: read on)
                continue
            except OSError:
                self._eof = True
                break
            if received is None:
                self._eof = True
                break
            message, fds = received
            control.close_fds(fds)
            if message.get("op") == "moved":
                self._note_moved(message)

    def take_moved(self, peer: str) -> bool:
        """Whether the broker ever said that ``peer`` moved to a new server (reads the notices
        queued on the connection without waiting)."""
        with self._lock:
            self._read_queued()
            # Kept: several calls in flight to the old server may each need the answer.
            return peer in self._moved

    def moved_channel(self, channel_id: int) -> int:
        """Whether a final hand-over moved the server of this caller's channel ``channel_id``
        (reading the notices queued on the connection without waiting): :data:`MOVED`,
        :data:`NOT_MOVED`; :data:`BUSY` when another thread is talking to the broker now (it
        reads the notices before it lets go: ask again soon); :data:`GONE` when the connection
        is closed or at its end (no notice comes any more: stop watching it)."""
        if channel_id in self._moved_channels:  # (noted by whoever read it: no lock needed)
            return MOVED
        verdict = self.read_notices()
        return MOVED if channel_id in self._moved_channels else verdict

    def read_notices(self) -> int:
        """Read the notices queued on the connection without waiting: :data:`NOT_MOVED` once
        read (see :meth:`moved_known`), :data:`BUSY` while another thread talks to the broker
        (it reads them before it lets go), :data:`GONE` when closed or at its end."""
        if not self._lock.acquire(blocking=False):
            return BUSY
        try:
            if self.sock.fileno() < 0:
                return GONE
            self._read_queued()
            return GONE if self._eof else NOT_MOVED
        finally:
            self._lock.release()

    def watch_notices(self, notify: Callable[[], None]) -> None:
        """Read the notices in a daemon thread from now on (once), and call ``notify()`` for
        each final notice, whichever thread reads it (this one, a sleeping caller, a request):
        for channels whose calls wait in an event loop, not asleep in a blocking call that
        watches the connection itself. ``notify`` runs with the connection's lock held: it must
        only hand over (``call_soon_threadsafe``). The thread ends when the connection is
        closed, at its end, or garbage (it holds neither this link nor ``notify``'s owner alive:
        pass a function of weak references)."""
        with self._watch_lock:
            fd = self.sock.fileno()
            if self._listener is not None or fd < 0:
                return
            self._listener = notify
        thread = threading.Thread(target=_watch, args=(weakref.ref(self), fd), daemon=True)
        thread.name = f"dsec-ipc-notices-{self.agent}"
        thread.start()

    def moved_known(self, channel_id: int) -> bool:
        """Whether a notice already read (by any thread) named ``channel_id``: no lock, no
        syscall (a sleeper asks this on every wake-up, whatever woke it)."""
        return channel_id in self._moved_channels

    def _recv_any(self) -> tuple[dict[str, Any], list[int]]:
        try:
            try:
                reply = control.recv(self.sock)
            except ConnectionResetError:
                # The broker closed while our message was unread (it refused us): the kernel
                # reports the reset before the reason it sent, which is still queued.
                reply = control.recv(self.sock)
        except (TimeoutError, OSError) as exc:
            raise BrokerUnavailable(f"the broker at {self.path} did not answer: {exc}") from exc
        if reply is None:
            raise BrokerUnavailable(f"the broker at {self.path} closed the connection")
        return reply

    def connect(self, peer: str) -> tuple[dict[str, Any], list[int]]:
        """Ask for a channel to ``peer``: the broker's ``channel`` message and its fds.

        Raises:
            AgentNotFound: No agent of that name serves in this task group.
            BrokerUnavailable: The broker is gone.
        """
        with self._lock:
            sent = self._sent_connect
            if sent is not None and sent[1] != peer:
                # (its answer, a channel the broker holds for us, would come first)
                raise ProtocolError(
                    f"this connection's first connect, to {sent[1]!r}, is still unanswered"
                )
            self._sent_connect = None
            if sent is not None:
                ref = sent[0]  # (sent behind the hello: only its answer is left to read)
            else:
                ref = next(self._refs)
                try:
                    control.send(self.sock, {"op": "connect", "ref": ref, "peer": peer})
                except OSError as exc:
                    raise BrokerUnavailable(f"the broker at {self.path} is gone: {exc}") from exc
            message, fds = self._recv()
            # Notices behind the answer: read now, while no caller watching the connection may
            # (it found the lock taken and waits for this thread to read them).
            self._read_queued()
        if message.get("ref") != ref:
            control.close_fds(fds)
            raise ProtocolError(f"broker answered ref {message.get('ref')}, expected {ref}")
        if message["op"] == "error":
            control.close_fds(fds)
            if message.get("code") == "not_found":
                raise AgentNotFound(peer, self.group, str(message.get("message", "")))
            raise BrokerRefused(str(message.get("code")), f"broker: {message.get('message')}")
        if message["op"] != "channel" or len(fds) != control.CALLER_FDS:
            control.close_fds(fds)
            raise ProtocolError(f"unexpected broker reply {message['op']!r} with {len(fds)} fds")
        return message, fds

    def close(self) -> None:
        """Close the connection (the broker forgets a server registration with it)."""
        # Shut down first: a thread polling the socket (the notice thread) keeps it open until
        # its poll returns, and the broker would see the end only then.
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._bells_closed = True
        self._close_bells_if_closed()
