"""The node agent's end of the pre-forked launcher (the *zygote*).

Starting the pre-exec stage as a fresh interpreter costs ~15 ms a sandbox (interpreter start and
imports), more than every isolation layer together. The zygote is that interpreter started once
per node agent — spawned exactly like the pre-exec stage (``-I -S``, a clean environment, no fd
but its control socket) — which forks one supervisor per sandbox. The fork then goes on exactly
as a spawned pre-exec stage would: it reads the plan from its own pipe and applies every layer.

The zygote never sees a plan (no secret passes through it), and each child closes everything it
inherited but its four fds before reading one; see :func:`.init.zygote` and
``docs/architecture.md`` ("Sandbox launch").
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import select
import socket
import sys
from pathlib import Path

from dsec_nodeagent.sandbox import cpuhint

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0


class ZygoteError(RuntimeError):
    """The zygote could not fork a supervisor (after one restart)."""


class _Gone(Exception):
    """The zygote died or closed its socket: start a new one."""


class Zygote:
    """Starts the zygote on first use, restarts it when it died, forks supervisors through it.

    Args:
        python: the interpreter of the pre-exec stage.
        bootstrap: the ``-c`` program that imports :mod:`.init` and calls its ``main``.
        env: the zygote's whole environment (nothing of the node agent's).
        root: an empty directory only the node agent writes: each forked sandbox's init mounts
            its root tmpfs there, in a mount namespace of its own, before its plan (which names
            the sandbox's own run directory) has come.
    """

    def __init__(self, python: Path, bootstrap: str, env: dict[str, str], root: Path) -> None:
        self.python = python
        self.bootstrap = bootstrap
        self.env = env
        self.root = root
        self.starts = 0  # how many zygotes this node agent started (1 unless one died)
        self._process: asyncio.subprocess.Process | None = None
        self._sock: socket.socket | None = None
        self._lock = asyncio.Lock()  # held while a zygote is started or discarded
        # The answers still due, in the order their requests were sent.
        self._replies: collections.deque[asyncio.Future[tuple[int, int]]] = collections.deque()

    @property
    def pid(self) -> int | None:
        """The running zygote's pid (None before the first launch or after it died)."""
        if self._process is None or self._process.returncode is not None:
            return None
        return self._process.pid

    def fork(self) -> PendingFork:
        """Have a supervisor forked now; give it its plan later (:meth:`PendingFork.hand_over`)."""
        self.root.mkdir(mode=0o755, parents=True, exist_ok=True)  # its init mounts its root here
        return PendingFork(self)

    def send_now(self, channel_fd: int) -> asyncio.Future[tuple[int, int]] | None:
        """Ask the running zygote for a fork at once, without waiting for the event loop (the
        launch plans meanwhile without yielding); the answer resolves the returned future.
        ``None``: no zygote runs yet, or it is being restarted (then :meth:`spawn` starts one).

        The request is a non-blocking ``sendmsg`` on the control socket; answers come back in
        the order of the requests (the zygote serves one at a time) and are matched to them by
        that order.
        """
        sock = self._sock
        if sock is None or self.pid is None or self._lock.locked():
            return None
        payload = channel_fd.to_bytes(4, sys.byteorder)
        try:
            sock.sendmsg([b"fork"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, payload)])
        except OSError:
            return None  # spawn() finds it gone and starts another
        reply: asyncio.Future[tuple[int, int]] = asyncio.get_running_loop().create_future()
        self._replies.append(reply)
        return reply

    async def spawn(
        self, channel_fd: int, sent: asyncio.Future[tuple[int, int]] | None = None
    ) -> tuple[int, int]:
        """Fork a supervisor that waits for its plan on ``channel_fd`` (which stays open here);
        ``(pid, pidfd)`` of it. ``sent``: the answer to a request :meth:`send_now` made already.

        Raises:
            ZygoteError: no zygote could fork one, even after a restart.
        """
        for attempt in range(2):
            try:
                reply = sent if attempt == 0 else None
                if reply is None:
                    async with self._lock:
                        if self.pid is None or self._sock is None:
                            await self._start()
                    reply = self.send_now(channel_fd)
                    if reply is None:
                        raise _Gone("its control socket is closed")
                return await asyncio.wait_for(reply, REQUEST_TIMEOUT_S)
            except (_Gone, TimeoutError, OSError) as exc:
                await self._discard()
                if attempt:
                    raise ZygoteError(f"the sandbox launcher (zygote) failed: {exc}") from exc
                log.warning("the sandbox launcher (zygote) is gone (%s); starting a new one", exc)
        raise AssertionError("unreachable")

    async def prestart(self) -> None:
        """Start the zygote now rather than at the first launch (errors: at that launch)."""
        async with self._lock:
            if self.pid is None:
                try:
                    await self._start()
                except OSError as exc:
                    log.warning("the sandbox launcher (zygote) cannot start: %s", exc)

    async def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._process = await asyncio.create_subprocess_exec(
                str(self.python),
                "-I",
                "-S",
                "-c",
                self.bootstrap,
                "zygote",
                str(theirs.fileno()),
                str(self.root),
                pass_fds=(theirs.fileno(),),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.DEVNULL,
                stderr=None,  # a crash of the zygote shows in the node agent's log
                start_new_session=True,
                env=self.env,
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock = ours
        self.starts += 1
        asyncio.get_running_loop().add_reader(ours.fileno(), self._on_answers, ours)

    def _on_answers(self, sock: socket.socket) -> None:
        """Match each answer on the control socket to the oldest request still due."""
        while True:
            try:
                msg, ancillary, _flags, _addr = sock.recvmsg(
                    64, socket.CMSG_SPACE(4), socket.MSG_CMSG_CLOEXEC
                )
            except BlockingIOError:
                return
            except OSError as exc:
                self._fail_all(_Gone(str(exc)), sock)
                return
            received = _received_fds(ancillary)
            if not msg:
                self._fail_all(_Gone("it closed its socket"), sock)
                return
            reply = self._replies.popleft() if self._replies else None
            if reply is None or reply.done():  # nobody waits for it (given up): release it
                for fd in received:
                    os.close(fd)
                continue
            if not msg.isdigit() or len(received) != 1:
                for fd in received:
                    os.close(fd)
                reply.set_exception(ZygoteError(f"the sandbox launcher answered {msg[:64]!r}"))
                continue
            reply.set_result((int(msg), received[0]))

    def _fail_all(self, exc: Exception, sock: socket.socket) -> None:
        with contextlib.suppress(ValueError, OSError):
            asyncio.get_running_loop().remove_reader(sock.fileno())
        while self._replies:
            reply = self._replies.popleft()
            if not reply.done():
                reply.set_exception(exc)

    async def _discard(self) -> None:
        self._close_sock(_Gone("the sandbox launcher was restarted"))
        process, self._process = self._process, None
        if process is not None and process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()

    def _close_sock(self, exc: Exception) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            self._fail_all(exc, sock)
            sock.close()

    async def close(self) -> None:
        """End the zygote. Sandboxes it forked keep running: each supervisor is in a session of
        its own, and the node agent watches it by pidfd, not as a child."""
        async with self._lock:
            self._close_sock(ZygoteError("the sandbox launcher was closed"))  # EOF: it returns
            process, self._process = self._process, None
            if process is not None and process.returncode is None:
                try:
                    await asyncio.wait_for(process.wait(), 2.0)
                except TimeoutError:
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
                    await process.wait()


MOUNT_NOW = b"m"  # init.MOUNT_NOW (not imported: init is the zygote's module, not the agent's)
MOUNT_SHARED = b"M"  # init.MOUNT_SHARED
SHARED_MAX = 1 << 20  # init.SHARED_MAX


def mount_word(shared: bytes) -> bytes:
    """What init reads at :meth:`PendingFork.mount_now`: :data:`MOUNT_SHARED` with the shared
    entries, or plain :data:`MOUNT_NOW` when there are none or more than init takes (it would
    refuse them and fail the launch; without them it binds every entry after the plan)."""
    if not shared or len(shared) > SHARED_MAX:
        return MOUNT_NOW
    return MOUNT_SHARED + len(shared).to_bytes(4, "big") + shared


class PendingFork:
    """A supervisor forked ahead of its plan — at the start of its launch, or before it (the
    manager keeps one made ahead) — with its init, in new pid, IPC and UTS namespaces.

    Until :meth:`mount_now` init holds no copy of the host's mount tree; until :meth:`hand_over`
    the child holds nothing but its end of ``channel`` (and /dev/null on 0-2). Each is used by
    one launch only; :meth:`discard` (closing the sockets without a plan) makes both exit.
    """

    def __init__(self, zygote: Zygote) -> None:
        self.channel, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.channel.setblocking(False)
        self.pid: int | None = None  # the child's, once forked
        self._handed = False  # hand_over() owns the pidfd from then on
        self._init: socket.socket | None = None  # init's plan socket, from the child
        self._init_pid = 0  # (host pid namespace), from the child with that socket
        self._child_pidfd = -1  # the child's pidfd, until hand_over() or discard() takes it
        self._mount = False
        self._shared = b""
        # Sent now, not at the event loop's next turn: the zygote forks while the launch plans.
        sent = zygote.send_now(theirs.fileno())
        self._task = asyncio.ensure_future(self._fork(zygote, theirs, sent))

    async def _fork(
        self, zygote: Zygote, theirs: socket.socket, sent: asyncio.Future[tuple[int, int]] | None
    ) -> tuple[int, int]:
        try:
            pid, pidfd = await zygote.spawn(theirs.fileno(), sent)
        finally:
            theirs.close()
        self.pid = pid
        self._child_pidfd = pidfd
        try:
            self._init, self._init_pid = await _receive_socket(self.channel)
        except asyncio.CancelledError:
            self._child_pidfd = -1
            os.close(pidfd)
            raise
        except (ZygoteError, OSError):
            pass  # hand_over() finds no init and fails
        else:
            if self._mount:
                self._send_mount()
        return pid, pidfd

    async def forked(self) -> None:
        """Return once the child and its init exist (or the fork failed: see :attr:`failed`)."""
        await asyncio.gather(asyncio.shield(self._task), return_exceptions=True)

    @property
    def failed(self) -> bool:
        """The fork or its init failed: no launch can use it."""
        if not self._task.done():
            return False
        return self._task.cancelled() or self._task.exception() is not None or self._init is None

    def mount_now(self, shared: bytes = b"") -> None:
        """Have init copy the host's mount tree now (as soon as it exists): call once every
        mount the sandbox needs (its disk quota) is made. ``shared``: the marshalled layout
        entries init binds at once, beside the planning (the ``shared`` entries of the
        previous plan of the same runtime; init keeps them only where the plan names the
        same)."""
        self._mount = True
        self._shared = shared
        if self._init is not None:
            self._send_mount()

    def _send_mount(self) -> None:
        assert self._init is not None
        # Init's pid is still its own while the child lives: init is the child's child, which
        # reaps it only after the hand-over (a dead init stays a zombie until then).
        if self._child_pidfd >= 0 and self._init_pid > 0 and not ended(self._child_pidfd):
            with contextlib.suppress(OSError):  # (a hint: init works without it)
                cpuhint.elsewhere(self._init_pid)
        with contextlib.suppress(OSError):  # init is gone: hand_over() fails on its socket
            self._init.sendall(mount_word(self._shared))

    def drop_failed(self) -> None:
        """Release a :attr:`failed` one (its task is over)."""
        assert self.failed
        self._child_pidfd = -1
        self._close_sockets()
        if not self._task.cancelled() and self._task.exception() is None:
            os.close(self._task.result()[1])

    async def hand_over(
        self,
        plan: bytes,
        supervisor_plan: bytes,
        report_w: int,
        stdout_fd: int,
        stderr_fd: int,
        go_r: int,
    ) -> tuple[int, int]:
        """Send the child and its init their fds and the plan; ``(pid, pidfd)`` of the child.

        Init gets the plan first and directly, on the socket the child sent here once it had
        forked init (no hop through the child on the start path), with the report pipe's write
        end and ``go_r``: the pipe it waits on before joining the sandbox's cgroups (see
        ``SandboxManager._spawn``). The child, the sandbox's supervisor, gets only its part of
        the plan (``supervisor_plan``: :func:`.init.supervisor_plan`, marshalled: where the logs
        go, how much of them, where the outcome goes, what to reap; never the sandbox's
        environment and its secrets), the report pipe and the log files.

        Raises:
            ZygoteError: there is no child (the zygote failed even after a restart), or it
                failed before its init existed.
        """
        self._handed = True
        if not self._mount:
            self.mount_now()
        pid, pidfd = await self._task
        self._child_pidfd = -1  # the caller's from here on
        sock = self.channel
        init, self._init = self._init, None
        try:
            if init is None:
                raise ZygoteError("the sandbox launcher's child failed before its init")
            if ended(pidfd):  # a shell made ahead died meanwhile
                raise ZygoteError("the sandbox launcher's child ended before its plan")
            try:
                await _send(init, plan, (report_w, go_r))
            except OSError as exc:
                raise ZygoteError(f"the sandbox launcher's init is gone: {exc}") from exc
            finally:
                init.close()  # EOF: init's plan is complete
            await _send(sock, supervisor_plan, (report_w, stdout_fd, stderr_fd))
        except BaseException:
            os.close(pidfd)
            raise
        finally:
            sock.close()  # EOF: the plan is complete
        return pid, pidfd

    async def discard(self) -> None:
        """The launch was given up before its plan (or the shell made ahead is not wanted): the
        child and its init exit at the EOF."""
        if self._handed:
            self.channel.close()
            return
        self._task.cancel()  # (no-op once forked and init's socket came)
        try:
            _pid, pidfd = await self._task
        except (ZygoteError, OSError, asyncio.CancelledError):
            return
        finally:
            self._child_pidfd = -1
            self._close_sockets()
        os.close(pidfd)

    def _close_sockets(self) -> None:
        """EOF to the child and to its init (before their plan: both exit)."""
        self.channel.close()
        if self._init is not None:
            self._init.close()
            self._init = None


def ended(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has ended (its pidfd is readable). ``poll``, not
    ``select``: a node agent's fds pass 1,024 (its IPC broker alone may hold 4,096), and
    ``select`` refuses those with ``ValueError``."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


async def _send(sock: socket.socket, data: bytes, fds: tuple[int, ...]) -> None:
    """``data`` with ``fds`` (SCM_RIGHTS, with its first bytes) on the non-blocking ``sock``."""
    payload = b"".join(fd.to_bytes(4, sys.byteorder) for fd in fds)
    sock.setblocking(False)
    first = sock.sendmsg([data[:4096]], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, payload)])
    await asyncio.get_running_loop().sock_sendall(sock, data[first:])


def _received_fds(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The fds a ``recvmsg`` received (SCM_RIGHTS)."""
    return [
        int.from_bytes(data[i : i + 4], sys.byteorder)
        for level, kind, data in ancillary
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS
        for i in range(0, len(data) - len(data) % 4, 4)
    ]


async def _receive_socket(sock: socket.socket) -> tuple[socket.socket, int]:
    """The one socket the child sends on ``sock`` (its init's plan socket), and init's pid."""
    while True:
        try:
            msg, ancillary, _flags, _addr = sock.recvmsg(
                16, socket.CMSG_SPACE(4), socket.MSG_CMSG_CLOEXEC
            )
            break
        except BlockingIOError:
            await _readable(sock.fileno())
    received = _received_fds(ancillary)
    word, _, pid = msg.partition(b" ")
    if word != b"init" or len(received) != 1 or not pid.isdigit():
        for fd in received:
            os.close(fd)
        raise ZygoteError(f"the sandbox launcher's child failed before its init ({msg!r})")
    return socket.socket(fileno=received[0]), int(pid)


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(fd, wake)
    try:
        await ready
    finally:
        loop.remove_reader(fd)


async def wait_pidfd(pidfd: int) -> None:
    """Wait until the process of ``pidfd`` has ended; closes ``pidfd``."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not done.done():
            done.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await done
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
