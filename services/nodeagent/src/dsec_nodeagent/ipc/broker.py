"""The node agent's IPC broker: creates shared-memory channels and hands them over SCM_RIGHTS.

Agents connect to one Unix ``SOCK_SEQPACKET`` socket (protocol: :mod:`dsec_sdk.ipc.control`).
The broker learns each connection's pid from ``SO_PEERCRED`` (unforgeable, translated into the
broker's pid namespace, so it works for sandboxes with their own), keeps a pidfd of it, and gives
each side of a channel the other's pidfd: a killed peer is then seen by poll() at once.

The broker never touches the hot path: once a channel is handed over, the two agents talk through
shared memory alone. Only calls to an agent on another node pass through it (see
:mod:`dsec_nodeagent.ipc.remote`).

What a sandbox may take is bounded (:mod:`dsec_nodeagent.ipc.limits`): connections and
connections without hello per sandbox and node-wide (within an fd budget well below
``RLIMIT_NOFILE``), a hello timeout, live channels per agent. A refusal is an ``error`` message
to that client, a ``dsec_ipc_refusals_total{reason}`` count and, at most every 10 s, one log line.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import logging
import mmap
import os
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from dsec_sdk.errors import ProtocolError
from dsec_sdk.ipc import channel as ch
from dsec_sdk.ipc import control

from dsec_nodeagent.ipc import metrics
from dsec_nodeagent.ipc.limits import (
    FDS_PER_CONNECTION,
    Admission,
    BrokerLimits,
    RefusalLog,
    ServerBusy,
)
from dsec_nodeagent.ipc.registry import AgentKey, Registry

if TYPE_CHECKING:
    from dsec_nodeagent.state.keeper import StateKeeper

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")
READS_PER_TURN = 64
"""Messages read from one connection before the event loop serves the rest of the node."""

Identify = Callable[[int, int, int], AgentKey | None]
"""Maps a connecting process ``(pid, uid, gid)`` to the only identity it may claim (its tenant
included)."""

SandboxOf = Callable[[int, int], str | None]
"""Maps a connecting process ``(pid, uid)`` to the sandbox its connections count against
(``None``: a process outside every sandbox; those share one bucket, :data:`HOST`)."""

HOST: Final = "-host-"
# fds the broker holds for each channel it serves itself (a caller here, the callee elsewhere).
PROXY_FDS: Final = 5
# Connections queued before accept(); each readiness accepts up to _ACCEPT_BATCH of them, so a
# flood is shed (turned away at once) faster than one sandbox can queue it.
_BACKLOG: Final = 1024
_ACCEPT_BATCH: Final = 64
# Channel ids one ``moved`` notice names at most (9 bytes each in MessagePack at worst).
_NOTICE_CHANNELS: Final = 4096
# The CLOSED word of a channel's first ring header (see dsec_sdk.ipc.ring.CLOSED).
_CLOSED_AT: Final = 32 * 8


_SO_PEERPIDFD: Final = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5+
_SO_PASSRIGHTS: Final = getattr(socket, "SO_PASSRIGHTS", 83)  # Linux 6.16+
_SCM_MAX_FD: Final = 253  # fds one message may carry: all taken, none closed by the kernel


def _peer_pidfd(sock: socket.socket, pid: int) -> int:
    """A pidfd of the process that connected ``sock`` (-1: it is gone)."""
    try:
        return int(sock.getsockopt(socket.SOL_SOCKET, _SO_PEERPIDFD))
    except OSError as exc:
        if exc.errno not in (errno.ENOPROTOOPT, errno.EINVAL):
            return -1  # (ESRCH: the peer exited)
    try:  # an older kernel: the pid as of now (it was the peer's a moment ago)
        return os.pidfd_open(pid)
    except OSError:
        return -1


@dataclass(eq=False)
class _Tracked:
    """A channel handed to a caller, watched (one read-only page, no fd) until it is closed."""

    header: mmap.mmap
    server: Connection | None  # None: the broker's own proxy serves it
    caller: Connection | None = None  # the local caller it was handed to
    channel_id: int = -1  # (the caller's name for it in a final hand-over's ``moved`` notice)

    def closed(self) -> bool:
        return bool(struct.unpack_from("<Q", self.header, _CLOSED_AT)[0])


@dataclass(eq=False)
class Connection:
    """One agent connection."""

    sock: socket.socket
    pid: int
    uid: int
    pidfd: int
    sandbox: str = HOST
    key: AgentKey | None = None
    role: str = ""
    tools: list[str] = field(default_factory=list)
    doorbell: int = -1
    hello_timer: asyncio.TimerHandle | None = None

    @property
    def name(self) -> str:
        return self.key.agent if self.key else f"pid {self.pid}"


class Broker:
    """Creates memfd channels for the agents of this node and routes calls between them.

    Args:
        socket_path: Where to listen (parent directories are created).
        node_id: This node's name (in answers to remote lookups).
        nats_url: NATS server for peers on other nodes (``None``: this node only).
        nats_options: credentials and TLS for that connection (``dsec_core.natsclient``).
        ring_capacity: Data bytes of each ring (power of two).
        max_payload: Largest request or response body.
        identify: Optional check of who a connecting process is; the hello must match it.
        socket_mode: Permissions of the socket file.
        limits: Bounds per sandbox and node-wide (default :class:`BrokerLimits`).
        sandbox_of: Which sandbox a connecting process belongs to (default: each process is
            its own).
        state_keeper: Serves the ``state`` op (an agent's state socket, docs/state.md);
            ``None``: the op is answered ``unavailable``.
    """

    def __init__(
        self,
        socket_path: str | os.PathLike[str],
        *,
        node_id: str = "node-1",
        nats_url: str | None = None,
        nats_options: Mapping[str, Any] | None = None,
        ring_capacity: int = ch.DEFAULT_CAPACITY,
        max_payload: int = ch.DEFAULT_MAX_PAYLOAD,
        identify: Identify | None = None,
        socket_mode: int = 0o666,
        limits: BrokerLimits | None = None,
        sandbox_of: SandboxOf | None = None,
        state_keeper: StateKeeper | None = None,
    ) -> None:
        from dsec_sdk.ipc.ring import check_capacity

        check_capacity(ring_capacity)
        self.socket_path = Path(socket_path)
        self.node_id = node_id
        self.nats_url = nats_url
        self.nats_options = dict(nats_options or {})
        self.ring_capacity = ring_capacity
        self.max_payload = max_payload
        self._identify = identify
        # Without sandboxes to tell (a development broker, the benchmarks), each process counts
        # as its own sandbox.
        self._sandbox_of = sandbox_of or (lambda pid, _uid: f"pid-{pid}")
        self._socket_mode = socket_mode
        self.limits = limits or BrokerLimits()
        self._admission: Admission[Connection] = Admission(
            self.limits, self.limits.max_connections()
        )
        self._refusals = RefusalLog(log)
        # Channels the broker serves itself get a quarter of the budget on top of connections':
        # all together stay within 5/8 of RLIMIT_NOFILE.
        self._proxy_fd_budget = self._admission.max_connections * FDS_PER_CONNECTION // 4
        self._live: dict[str, list[_Tracked]] = {}  # caller sandbox -> its channels
        self._listener: socket.socket | None = None
        self._connections: set[Connection] = set()
        self._registry: Registry[Connection] = Registry()
        self._next_channel = 1
        self._self_pidfd = -1
        self._tasks: set[asyncio.Task[None]] = set()
        self._remote: Any = None  # RemoteBridge, imported lazily (nats-py only when used)
        self.state_keeper = state_keeper
        self._state_sockets: dict[str, int] = {}  # sandbox -> its open state sockets
        self._connecting: Counter[str] = Counter()  # sandbox -> its connects under way
        # Hand-overs the node agent expects: new sandbox -> the old one it takes over from.
        self._handovers: dict[str, str] = {}
        self._fds_refused = False  # SO_PASSRIGHTS off on the listener (Linux 6.16+)
        # Where agents may send fds (before Linux 6.16): per sandbox, the fds its closer thread
        # closes (a close that blocks holds up that sandbox's closes only, not the others').
        self._closing: dict[str, list[int]] = {}
        self._closing_lock = threading.Lock()
        self.tool_reports: Callable[[str, str, dict[str, Any]], None] | None = None
        """Receives ``tools`` reports: (the connection's sandbox, its agent, the message)."""

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Listen on :attr:`socket_path` (and connect to NATS when ``nats_url`` is set)."""
        loop = asyncio.get_running_loop()
        self.socket_path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.socket_path.unlink()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        try:
            listener.bind(os.fspath(self.socket_path))
            os.chmod(self.socket_path, self._socket_mode)
            # No fds from agents (none sends any): refused by the kernel at their sendmsg, so
            # none is ever queued to the broker. A received fd is closed by whoever holds it
            # last, and the close of a lingering TCP socket blocks: on the node agent's loop
            # that froze every agent's connects for as long as the sender chose.
            try:
                listener.setsockopt(socket.SOL_SOCKET, _SO_PASSRIGHTS, 0)  # (accepted inherit)
                self._fds_refused = True
            except OSError:  # before Linux 6.16: they are closed on a thread of their own
                self._fds_refused = False
                log.warning(
                    "ipc: this kernel cannot refuse the fds agents send (SO_PASSRIGHTS, Linux "
                    "6.16+): the broker closes them on each sandbox's own thread, and a "
                    "state socket still takes them; a sandbox sending lingering sockets can "
                    "hold up its own closes and the node's state reads"
                )
            listener.listen(_BACKLOG)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self._self_pidfd = os.pidfd_open(os.getpid())
        if self.nats_url is not None:
            from dsec_nodeagent.ipc.remote import RemoteBridge

            self._remote = RemoteBridge(self)
            try:
                await self._remote.start(self.nats_url, self.nats_options)
            except BaseException:
                await self.stop()
                raise
        loop.add_reader(listener.fileno(), self._on_accept)
        log.info("ipc broker listening on %s", self.socket_path)

    async def stop(self) -> None:
        """Close every connection, stop the NATS bridge, remove the socket file."""
        loop = asyncio.get_running_loop()
        if self._listener is not None:
            loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                self.socket_path.unlink()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._remote is not None:
            await self._remote.stop()
            self._remote = None
        for conn in list(self._connections):
            self._drop(conn)
        if self._self_pidfd >= 0:
            os.close(self._self_pidfd)
            self._self_pidfd = -1
        for tracked in self._live.values():
            for item in tracked:
                item.header.close()
        self._live.clear()

    async def __aenter__(self) -> Broker:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # ------------------------------------------------------------------ connections
    def _on_accept(self) -> None:
        for _ in range(_ACCEPT_BATCH):
            if not self._accept_one():
                return

    def _accept_one(self) -> bool:
        if self._listener is None:
            return False
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return False
        except OSError as exc:  # EMFILE/ENFILE: the budget keeps the broker far from this
            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                raise
            self._refusals.refused("fd_budget", HOST)
            metrics.REFUSALS.labels("fd_budget").inc()
            return False
        self._admit(sock)
        return True

    def _admit(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        pid, uid, _gid = _UCRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
        )
        # The pidfd first (before a waiting connection is evicted for this one): a process
        # already gone costs nobody else anything. The kernel's pidfd of the peer as of its
        # connect where it has one (Linux 6.5+), so a pid reused since cannot lend its identity.
        pidfd = _peer_pidfd(sock, pid)
        if pidfd < 0:
            self._close_sock(sock, f"pid-{pid}")  # (gone: its sandbox is unknown)
            return
        sandbox = self._sandbox_of(pid, uid) or HOST
        if ch.pidfd_exited(pidfd):  # (the pid looked up may have been another process's by then)
            os.close(pidfd)
            self._close_sock(sock, sandbox)
            return
        reason, victim = self._admission.admit(sandbox)
        if reason is not None:
            os.close(pidfd)
            self._turn_away(sock, sandbox, reason)
            return
        if victim is not None:
            self._refuse(victim, "pending_evicted", "too many connections wait for their hello")
        conn = Connection(sock=sock, pid=pid, uid=uid, pidfd=pidfd, sandbox=sandbox)
        self._connections.add(conn)
        self._admission.add(conn, sandbox)
        loop = asyncio.get_running_loop()
        conn.hello_timer = loop.call_later(self.limits.hello_timeout_s, self._hello_timed_out, conn)
        loop.add_reader(sock.fileno(), self._on_readable, conn)
        self._gauges()

    def _turn_away(self, sock: socket.socket, sandbox: str, reason: str) -> None:
        """Refuse a connection before it costs anything but the accepted socket."""
        metrics.REFUSALS.labels(reason).inc()
        self._refusals.refused(reason, sandbox)
        text = {
            "fd_budget": "the node's IPC connection budget is spent",
            "sandbox_connections": "this sandbox holds its maximum of "
            f"{self.limits.connections_per_sandbox} broker connections",
            "pending_sandbox": "this sandbox has its maximum of "
            f"{self.limits.pending_per_sandbox} connections that have not said hello",
            "pending_total": "too many connections wait for their hello on this node",
        }[reason]
        with contextlib.suppress(OSError):
            control.send(sock, {"op": "error", "code": "refused", "message": f"{text}; retry"})
        self._close_sock(sock, sandbox)

    def _hello_timed_out(self, conn: Connection) -> None:
        conn.hello_timer = None
        if conn in self._connections and conn.key is None:
            timeout = self.limits.hello_timeout_s
            self._refuse(conn, "hello_timeout", f"no hello within {timeout:g} s")

    def _gauges(self) -> None:
        metrics.CONNECTIONS.set(self._admission.connections)
        metrics.PENDING.set(self._admission.pending)

    def _on_readable(self, conn: Connection) -> None:
        # At most READS_PER_TURN messages, then the loop serves everyone else before this
        # connection is read again (its reader is level-triggered: still readable, it is called
        # on the loop's next turn): a sandbox that never stops sending held the node agent's
        # loop for up to 0.25 s at a time.
        for _ in range(READS_PER_TURN):
            try:
                received = control.recv(
                    conn.sock,
                    max_fds=_SCM_MAX_FD,
                    close=functools.partial(self._close_elsewhere, sandbox=conn.sandbox),
                )
            except (BlockingIOError, InterruptedError):
                return
            except (ProtocolError, OSError) as exc:
                log.warning("ipc: dropping %s: %s", conn.name, exc)
                self._drop(conn)
                return
            if received is None:
                self._drop(conn)
                return
            message, fds = received
            if fds:  # (never where the kernel refuses them): no agent sends any
                self._close_elsewhere(fds, conn.sandbox)
                self._refuse(conn, "passed_fds", "agents send no file descriptors")
                return
            try:
                self._dispatch(conn, message)
            except Exception as exc:  # a shape the checks above missed: that connection ends
                log.warning("ipc: dropping %s: %s: %.200s", conn.name, type(exc).__name__, exc)
                self._drop(conn)
                return
            if conn not in self._connections:  # refused and dropped
                return

    def _dispatch(self, conn: Connection, message: dict[str, Any]) -> None:
        op = message["op"]
        if conn.key is None:
            if op != "hello":
                self._reply_error(conn, message, "bad_request", "the first message must be hello")
                return
            self._hello(conn, message)
        elif op == "connect":
            sandbox = conn.sandbox
            if self._connecting[sandbox] >= self.limits.connects_per_sandbox:
                text = (
                    f"this sandbox has {self.limits.connects_per_sandbox} connects under way, "
                    "the most one sandbox may (DSEC_IPC_CONNECTS_PER_SANDBOX); retry when one ends"
                )
                self._refuse_request(conn, message, "connects", "busy", text)
                return
            self._connecting[sandbox] += 1
            self._spawn(self._connect_counted(conn, message))
        elif op == "state":
            self._state(conn, message)
        elif op == "tools":  # tool-call reports (docs/tools.md); never answered
            if self.tool_reports is not None and conn.key is not None:
                self.tool_reports(conn.sandbox, conn.key.agent, message)
        else:
            self._reply_error(conn, message, "bad_request", f"unknown op {op!r}")

    def _hello(self, conn: Connection, message: dict[str, Any]) -> None:
        try:
            key = AgentKey(
                control.check_name("task group", message.get("group")),  # type: ignore[arg-type]
                control.check_name("agent name", message.get("agent")),  # type: ignore[arg-type]
            )
            role = message.get("role")
            if role not in ("caller", "server"):
                raise ValueError(f"role {role!r} is invalid: use 'caller' or 'server'")
            tools = [control.check_tool_name(t) for t in message.get("tools") or []]
        except ValueError as exc:
            self._refuse(conn, "identity", str(exc))
            return
        if self._identify is not None:
            allowed = self._identify(conn.pid, conn.uid, 0)
            if ch.pidfd_exited(conn.pidfd):  # its pid may name another process now: no identity
                self._refuse(conn, "identity", f"process {conn.pid} exited before its hello")
                return
            if allowed is None or (allowed.group, allowed.agent) != (key.group, key.agent):
                self._refuse(conn, "identity", f"process {conn.pid} may not act as {key}")
                return
            key = allowed  # with the tenant of its sandbox's spec
        self._admission.greeted(conn)
        if conn.hello_timer is not None:
            conn.hello_timer.cancel()
            conn.hello_timer = None
        self._gauges()
        conn.key, conn.role, conn.tools = key, role, tools
        metrics.AGENTS.labels(role).inc()
        welcome = {
            "op": "welcome",
            "node": self.node_id,
            "ring_capacity": self.ring_capacity,
            "max_payload": self.max_payload,
        }
        if role == "server":
            expected = self._handovers.get(conn.sandbox)
            owner = self._registry.owner(key)
            migrating_in = expected == conn.sandbox and owner is None
            if expected is not None and (owner == expected or migrating_in):
                # The new version of a hand-over: a standby until switch() points the name here.
                refused = self._registry.standby(key, conn, conn.sandbox)
                if refused is not None:
                    self._refuse(conn, "name_taken", refused)
                    return
                conn.doorbell = ch.new_eventfd()
                self._send(conn, {**welcome, "standby": True}, [conn.doorbell])
                return
            claim = self._registry.claim(
                key, conn, conn.sandbox, takeover=message.get("takeover") is True
            )
            if claim.reason is not None:
                self._refuse(conn, "name_taken", claim.reason)
                return
            if claim.displaced is not None:
                self._refuse(
                    claim.displaced,
                    "taken_over",
                    f"a process of sandbox {conn.sandbox} took over agent {key.agent!r}",
                )
            conn.doorbell = ch.new_eventfd()
            self._send(conn, welcome, [conn.doorbell])
            if self._remote is not None and conn in self._connections:  # (not if it left)
                self._spawn(self._remote.export(key))
        else:
            self._send(conn, welcome)

    def _refuse_request(
        self, conn: Connection, message: dict[str, Any], reason: str, code: str, text: str
    ) -> None:
        """Refuse one request of a connection (it stays open): counted, logged, answered."""
        metrics.REFUSALS.labels(reason).inc()
        self._refusals.refused(reason, conn.sandbox)
        self._reply_error(conn, message, code, text)

    async def _connect_counted(self, conn: Connection, message: dict[str, Any]) -> None:
        """:meth:`_connect`, counted among its sandbox's connects under way until it ends."""
        sandbox = conn.sandbox
        try:
            await self._connect(conn, message)
        finally:
            self._connecting[sandbox] -= 1
            if self._connecting[sandbox] <= 0:
                del self._connecting[sandbox]

    async def _connect(self, conn: Connection, message: dict[str, Any]) -> None:
        assert conn.key is not None
        # The caller may have left since its connect was read (a connect and the caller's close
        # read in one turn, or a close while NATS is asked below): its pidfd is closed then, and
        # an open notice carrying it failed with EBADF, which dropped the agent it called.
        if conn not in self._connections:
            return
        ref = message.get("ref")
        peer = message.get("peer")
        try:
            name = control.check_name("agent name", peer)  # type: ignore[arg-type]
        except ValueError as exc:
            self._reply_error(conn, message, "bad_request", str(exc))
            return
        key = AgentKey(conn.key.group, name, conn.key.tenant)
        # (the other connects under way count too: each may end in a channel)
        under_way = self._connecting[conn.sandbox] - 1
        if self._live_channels(conn.sandbox) + under_way >= self.limits.channels_per_agent:
            text = (
                f"this agent holds {self.limits.channels_per_agent} live channels, the most "
                "one agent may (DSEC_IPC_CHANNELS_PER_AGENT); close some first"
            )
            self._refuse_request(conn, message, "channels", "too_many_channels", text)
            return
        server = self._registry.lookup(key)
        try:
            opened = self.open_channel(server, conn.name, conn.pidfd) if server else None
        except ServerBusy as exc:
            self._refuse_request(conn, message, "server_busy", "busy", str(exc))
            return
        if opened is not None:
            channel_id, caller_fds = opened
            reply = self._channel_reply(ref, channel_id, key.agent, remote=False)
            metrics.CHANNELS_OPENED.labels("local").inc()  # before the caller can use it
            self._track(conn.sandbox, caller_fds[0], server, conn, channel_id)
            self._send(conn, reply, caller_fds)
            control.close_fds(caller_fds)
            return
        if self._remote is not None and await self._remote.locate(key):
            if conn not in self._connections:  # it left while NATS was asked
                return
            if (self._remote.proxy_channels() + 1) * PROXY_FDS > self._proxy_fd_budget:
                text = "the node's budget of channels to other nodes is spent; retry later"
                self._refuse_request(conn, message, "fd_budget", "busy", text)
                return
            share = self.proxy_channels_per_sandbox
            if self._live_proxies(conn.sandbox) >= share:
                text = (
                    f"this sandbox holds {share} channels to agents of other nodes, its share "
                    "of the node's budget (a quarter); close some first"
                )
                self._refuse_request(conn, message, "proxy_channels", "too_many_channels", text)
                return
            channel_id, fds = self._remote.open_proxy(key, conn)
            reply = self._channel_reply(ref, channel_id, key.agent, remote=True)
            metrics.CHANNELS_OPENED.labels("remote").inc()
            self._track(conn.sandbox, fds[0], None)
            self._send(conn, reply, fds)
            control.close_fds(fds)
            return
        where = "this node or any other" if self._remote is not None else "this node"
        self._reply_error(conn, message, "not_found", f"not registered on {where}")

    # ------------------------------------------------------------------ state sockets
    def _state(self, conn: Connection, message: dict[str, Any]) -> None:
        """Hand the agent one end of a socketpair whose other end the state keeper serves for
        the connection's sandbox (after hello; at most ``state_per_sandbox`` at once)."""
        keeper = self.state_keeper
        if keeper is None:
            self._reply_error(conn, message, "unavailable", "this node has no state keeper")
            return
        sandbox = conn.sandbox
        if self._state_sockets.get(sandbox, 0) >= self.limits.state_per_sandbox:
            text = (
                f"this sandbox holds {self.limits.state_per_sandbox} state sockets, the most one "
                "sandbox may; close one first"
            )
            self._refuse_request(conn, message, "state_sockets", "too_many_state_sockets", text)
            return
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(OSError):  # (Linux 6.16+) no fds to the keeper either
            ours.setsockopt(socket.SOL_SOCKET, _SO_PASSRIGHTS, 0)
        try:
            self._send(conn, {"op": "state", "ref": message.get("ref")}, [theirs.fileno()])
        finally:
            theirs.close()
        if conn not in self._connections:  # it died; _send dropped it
            ours.close()
            return
        self._state_sockets[sandbox] = self._state_sockets.get(sandbox, 0) + 1
        self._spawn(self._serve_state(keeper, ours, sandbox))

    async def _serve_state(self, keeper: StateKeeper, sock: socket.socket, sandbox: str) -> None:
        try:
            await keeper.serve(sock, sandbox)
        finally:
            sock.close()
            left = self._state_sockets.get(sandbox, 1) - 1
            if left > 0:
                self._state_sockets[sandbox] = left
            else:
                self._state_sockets.pop(sandbox, None)

    # ------------------------------------------------------------------ channels
    def _track(
        self,
        sandbox: str,
        memfd: int,
        server: Connection | None,
        caller: Connection | None = None,
        channel_id: int = -1,
    ) -> None:
        """Watch a channel handed to ``sandbox`` until one end closes it (or its server leaves)."""
        try:
            header = mmap.mmap(memfd, mmap.PAGESIZE, mmap.MAP_SHARED, mmap.PROT_READ)
        except OSError:
            return
        self._live.setdefault(sandbox, []).append(_Tracked(header, server, caller, channel_id))

    # ------------------------------------------------------------------ hand-over
    def expect_handover(self, new_sandbox: str, old_sandbox: str) -> None:
        """Let the servers of ``new_sandbox`` register the names ``old_sandbox``'s servers hold,
        as standbys, until :meth:`forget_handover` (the node agent, when it starts a hand-over's
        new sandbox)."""
        self._handovers[new_sandbox] = old_sandbox

    def forget_handover(self, new_sandbox: str) -> None:
        """The hand-over into ``new_sandbox`` ended (done or failed)."""
        self._handovers.pop(new_sandbox, None)

    def switch(self, key: AgentKey, to_sandbox: str) -> int:
        """Point ``key`` at the standby server of ``to_sandbox`` (the hand-over's switch, or its
        undo) and tell every local caller holding a channel to the previous server
        ``{"op": "moved", "peer": name}``: a call that server had not read, the caller sends
        again to the new one. Returns how many callers were told."""
        previous = self._registry.switch(key, to_sandbox)
        if previous is None:
            return 0
        told: set[Connection] = set()
        for tracked in self._live.values():
            for item in tracked:
                caller = item.caller
                if item.server is previous and caller is not None and caller not in told:
                    told.add(caller)
        for caller in told:
            if caller in self._connections:
                self._send(caller, {"op": "moved", "peer": key.agent})
        log.info("ipc: %s now served by sandbox %s (%d callers told)", key, to_sandbox, len(told))
        return len(told)

    def release(self, key: AgentKey, from_sandbox: str) -> int:
        """A hand-over switched ``key`` away from ``from_sandbox`` for good (the old server is
        frozen and is stopped next; nothing thaws it any more): tell each local caller with a
        channel to that server which of its channels it was, ``{"op": "moved", "peer": name,
        "channels": [ids]}``. A call waiting there whose request the old server never read goes
        to the new server at once, instead of when the old process is gone (:meth:`switch`'s
        notice names no channel: the switch may still be undone, the old server thawed, and
        the request read after all). The bridge's own channel to that server, which carries
        the calls of other nodes, moves the same way. Returns how many channels were named."""
        standby = self._registry.standby_of(key)
        if standby is None or standby[1] != from_sandbox:
            return 0
        previous = standby[0]
        named: dict[Connection, list[int]] = {}
        for tracked in self._live.values():
            for item in tracked:
                caller = item.caller
                if (
                    item.server is previous
                    and caller is not None
                    and item.channel_id >= 0
                    and not item.closed()
                ):
                    named.setdefault(caller, []).append(item.channel_id)
        for caller, channels in named.items():
            # (a control message holds 64 KiB: however many channels an agent may hold)
            for at in range(0, len(channels), _NOTICE_CHANNELS):
                if caller in self._connections:
                    part = channels[at : at + _NOTICE_CHANNELS]
                    self._send(caller, {"op": "moved", "peer": key.agent, "channels": part})
        count = sum(len(channels) for channels in named.values())
        if self._remote is not None:  # the bridge's channel, for callers on other nodes
            count += self._remote.moved(key, previous)
        log.info(
            "ipc: %s left sandbox %s for good (%d channels of callers told)",
            key,
            from_sandbox,
            count,
        )
        return count

    def promote(self, key: AgentKey, sandbox: str) -> bool:
        """Migration path ``handover``, the target: the standby server of ``sandbox`` (a
        sandbox moving in from another node; no server of ``key`` here) serves ``key`` from
        now on, for this node and, through the bridge, the others. False: no such standby."""
        self._registry.switch(key, sandbox)
        if self._registry.owner(key) != sandbox:
            return False
        if self._remote is not None:
            self._spawn(self._remote.export(key))
        log.info("ipc: %s now served by sandbox %s (moved in)", key, sandbox)
        return True

    async def withdraw(self, key: AgentKey) -> None:
        """Migration path ``handover``, the source: stop answering other nodes for ``key`` now
        (its server was killed; the target serves the name next), before the bridge notices
        the server's socket closing: never two nodes answering one name."""
        if self._remote is not None:
            await self._remote.unexport(key)

    @property
    def proxy_channels_per_sandbox(self) -> int:
        """Channels to agents of other nodes one sandbox may hold: a quarter of the node's
        budget for them (one sandbox took all of it, and no other could call another node)."""
        return max(1, self._proxy_fd_budget // PROXY_FDS // 4)

    def _live_proxies(self, sandbox: str) -> int:
        """Channels to agents of other nodes ``sandbox`` holds (its live channels the broker's
        proxy serves)."""
        return sum(1 for item in self._alive(sandbox) if item.server is None)

    def _live_channels(self, sandbox: str) -> int:
        """Channels of ``sandbox`` still open."""
        return len(self._alive(sandbox))

    def _alive(self, sandbox: str) -> list[_Tracked]:
        """The channels of ``sandbox`` still open (closed ones are forgotten here)."""
        tracked = self._live.get(sandbox)
        if not tracked:
            return []
        alive = []
        for item in tracked:
            gone = item.server is not None and item.server not in self._connections
            if gone or item.closed():
                item.header.close()
            else:
                alive.append(item)
        if alive:
            self._live[sandbox] = alive
        else:
            del self._live[sandbox]
        return alive

    def open_channel(
        self, server: Connection, caller: str, caller_pidfd: int
    ) -> tuple[int, list[int]] | None:
        """Create a channel to ``server`` and announce it there.

        Returns the channel id and the caller's six fds (memfd, overflows, caller eventfd,
        server doorbell, server pidfd), now owned by whoever called this; ``None`` if the server
        turned out to be gone.
        """
        if caller_pidfd < 0:  # a caller already dropped; the notice would fail on *its* fd
            raise ValueError("open_channel: the caller's pidfd is closed")
        fds = ch.create_channel(self.ring_capacity, self.max_payload)
        channel_id = self.new_channel_id()
        opening = {
            "op": "open",
            "channel": channel_id,
            "caller": caller,
            "ring_capacity": self.ring_capacity,
        }
        try:
            control.send(server.sock, opening, [*fds.all(), caller_pidfd])
        except BlockingIOError:
            # Its control socket is full: a server reads it between calls, so a busy one (or
            # one paused for a hand-over) fills up under callers' connects. Busy, not gone:
            # it stays registered (it was dropped here, by any caller connecting often enough).
            fds.close()
            raise ServerBusy(
                f"agent {server.name} has not yet read the channels offered to it (busy "
                "serving); retry"
            ) from None
        except OSError as exc:
            fds.close()
            log.warning("ipc: cannot reach %s (%s); dropping it", server.name, exc)
            self._drop(server)
            return None
        return channel_id, [*fds.all(), os.dup(server.doorbell), os.dup(server.pidfd)]

    def _channel_reply(
        self, ref: Any, channel_id: int, peer: str, *, remote: bool
    ) -> dict[str, Any]:
        return {
            "op": "channel",
            "ref": ref,
            "channel": channel_id,
            "peer": peer,
            "ring_capacity": self.ring_capacity,
            "max_payload": self.max_payload,
            "remote": remote,
        }

    def new_channel_id(self) -> int:
        """A fresh channel id."""
        channel_id = self._next_channel
        self._next_channel += 1
        return channel_id

    @property
    def self_pidfd(self) -> int:
        """A pidfd of this process, handed to agents whose peer is the broker itself."""
        return self._self_pidfd

    def local_server(self, key: AgentKey) -> Connection | None:
        """The connection serving ``key`` on this node."""
        return self._registry.lookup(key)

    # ------------------------------------------------------------------ helpers
    def _send(
        self, conn: Connection, message: dict[str, Any], fds: list[int] | None = None
    ) -> None:
        try:
            control.send(conn.sock, message, fds or ())
        except OSError as exc:
            log.warning("ipc: cannot reach %s (%s); dropping it", conn.name, exc)
            self._drop(conn)

    def _reply_error(self, conn: Connection, request: dict[str, Any], code: str, text: str) -> None:
        metrics.CONNECTS_FAILED.labels(code).inc()
        self._send(conn, {"op": "error", "ref": request.get("ref"), "code": code, "message": text})

    def _refuse(self, conn: Connection, reason: str, text: str) -> None:
        """Tell ``conn`` why (``reason`` from :data:`limits.REASONS`), then close it."""
        if reason in ("identity", "name_taken"):
            metrics.REFUSED.inc()
        metrics.REFUSALS.labels(reason).inc()
        self._refusals.refused(reason, conn.sandbox)
        self._send(conn, {"op": "error", "code": "refused", "message": text})
        self._drop(conn)

    def _close_sock(self, sock: socket.socket, sandbox: str) -> None:
        """Close a connection of ``sandbox`` (fds still queued on it are closed with it: where
        the kernel may have queued some, on that sandbox's closer thread)."""
        if self._fds_refused:
            sock.close()
        else:
            self._close_elsewhere([sock.detach()], sandbox)

    def _close_elsewhere(self, fds: Sequence[int], sandbox: str) -> None:
        """Close ``fds`` (received from ``sandbox``'s agent, or a socket that may hold some) on
        that sandbox's closer thread: never on the loop, where the close of a lingering socket
        blocks, nor behind another sandbox's."""
        if not fds:
            return
        with self._closing_lock:
            queued = self._closing.get(sandbox)
            if queued is not None:  # its thread runs and takes these next
                queued.extend(fds)
                return
            self._closing[sandbox] = list(fds)
        threading.Thread(
            target=self._close_loop, args=(sandbox,), name="dsec-ipc-closer", daemon=True
        ).start()

    def _close_loop(self, sandbox: str) -> None:
        while True:
            with self._closing_lock:
                fds = self._closing[sandbox]
                if not fds:
                    del self._closing[sandbox]
                    return
                self._closing[sandbox] = []
            control.close_fds(fds)

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(_finished)
        task.add_done_callback(self._tasks.discard)

    def _drop(self, conn: Connection) -> None:
        if conn not in self._connections:
            return
        self._connections.discard(conn)
        self._admission.remove(conn)
        self._gauges()
        if conn.hello_timer is not None:
            conn.hello_timer.cancel()
            conn.hello_timer = None
        if conn.key is not None and conn.role:
            metrics.AGENTS.labels(conn.role).dec()
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(conn.sock.fileno())
        self._close_sock(conn.sock, conn.sandbox)
        for key in self._registry.release(conn):
            if self._remote is not None:
                self._spawn(self._remote.unexport(key))
        if self._remote is not None:
            self._remote.forget(conn)
        control.close_fds([fd for fd in (conn.pidfd, conn.doorbell) if fd >= 0])
        conn.pidfd = conn.doorbell = -1


def _finished(task: asyncio.Task[None]) -> None:
    """Log a background task's crash (it would otherwise vanish silently)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("ipc: background task failed", exc_info=task.exception())
