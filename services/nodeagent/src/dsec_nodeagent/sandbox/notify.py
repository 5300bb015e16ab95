"""The node agent's end of the seccomp filter: report every system call the kernel refused.

The sandbox's filter (:func:`.seccomp.build_filter` with ``notify=True``) sends denied calls to a
user-notification listener instead of failing them in the filter. The listener is created by the
workload's pre-exec stage, kept by the sandbox's supervisor process at
:data:`.seccomp.SUPERVISOR_LISTENER_FD`, and taken from there with ``pidfd_getfd(2)`` by the
node agent — at launch and again when a restarted agent re-adopts the sandbox.

Every notification is answered at once with an error (never
``SECCOMP_USER_NOTIF_FLAG_CONTINUE``): ``EAFNOSUPPORT`` for a socket family, ``EPERM`` for a named
dangerous call, ``ENOSYS`` for a call off the allow-list (:func:`.seccomp.refusal_errno`, the
errno the filter returns by itself without a listener). The filter made the decision; this
module only reports it, reading nothing but the syscall number and register arguments from the
notification (no target memory, hence no TOCTOU and no need for
``SECCOMP_IOCTL_NOTIF_ID_VALID``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
import select
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from prometheus_client import Counter

from dsec_nodeagent.sandbox import seccomp, syscalls

log = logging.getLogger(__name__)

REFUSALS = Counter(
    "dsec_kernel_refusals_total", "System calls refused by a sandbox's seccomp filter", ["syscall"]
)  # ``syscall``: a name of the filter's fixed table (seccomp.describe), a bounded set

# <linux/seccomp.h>: _IOWR('!', 0, struct seccomp_notif), _IOWR('!', 1, struct seccomp_notif_resp)
SECCOMP_IOCTL_NOTIF_RECV = 0xC0502100
SECCOMP_IOCTL_NOTIF_SEND = 0xC0182101
SYS_PIDFD_GETFD = 438
# struct seccomp_notif: id, pid, flags, then struct seccomp_data (nr, arch, ip, args[6]).
_NOTIF = struct.Struct("<QIIiIQ6Q")
# struct seccomp_notif_resp: id, val, error, flags.
_RESP = struct.Struct("<QqiI")
_LISTENER_LINK = "anon_inode:seccomp notify"
SLICE_BUDGET = 256
"""Notifications answered per :data:`SLICE_S` at most (about 5,000/s per sandbox)."""
SLICE_S = 0.05
THROTTLED = Counter(
    "dsec_kernel_refusals_throttled_total",
    "Times a sandbox's refused system calls were answered more slowly (its budget was spent)",
)


@dataclass(frozen=True)
class KernelRefusal:
    """One system call of a sandbox refused by its seccomp filter.

    Attributes:
        sandbox_id: the sandbox.
        syscall: what was refused, as a user reads it (``ptrace``, ``socket(AF_VSOCK)``).
        nr: the system call number (of this machine's architecture).
        pid: the calling thread, in the node agent's pid namespace.
        errno_name: what the caller got (``EPERM``, ``EAFNOSUPPORT``, ``ENOSYS``).
        rule_id: ``seccomp.socket-family``, ``seccomp.denied`` or ``seccomp.not-allowed``.
    """

    sandbox_id: str
    syscall: str
    nr: int
    pid: int
    errno_name: str = "EPERM"
    rule_id: str = "seccomp.denied"


RefusalHandler = Callable[[KernelRefusal], Awaitable[None]]


def _label(syscall: str) -> str:
    """A bounded metric label: an unnamed socket family (one of 65,536) is ``socket(other)``."""
    return "socket(other)" if syscall.startswith("socket(family ") else syscall


def take_listener(supervisor_pid: int) -> int:
    """Duplicate the listener held by a sandbox's supervisor into this process.

    Raises:
        OSError: the process is gone, or holds no seccomp listener at the agreed fd.
    """
    pidfd = os.pidfd_open(supervisor_pid)
    try:
        target = f"/proc/{supervisor_pid}/fd/{seccomp.SUPERVISOR_LISTENER_FD}"
        # Checked after pidfd_open: a recycled pid would fail pidfd_getfd below, not mislead.
        if os.readlink(target) != _LISTENER_LINK:
            raise OSError(errno.EBADF, f"{target} is not a seccomp listener")
        fd = syscalls.syscall(SYS_PIDFD_GETFD, pidfd, seccomp.SUPERVISOR_LISTENER_FD, 0)
    finally:
        os.close(pidfd)
    os.set_inheritable(fd, False)  # pidfd_getfd sets close-on-exec; keep it explicit
    return fd


class RefusalReporter:
    """Answers a sandbox's seccomp notifications with their errno; hands each to ``handler``.

    Args:
        sandbox_id: the sandbox the listener belongs to.
        fd: the listener (owned from now on: :meth:`close` closes it).
        handler: awaited with every :class:`KernelRefusal` (publish ``policy.violation``).
    """

    def __init__(self, sandbox_id: str, fd: int, handler: RefusalHandler | None) -> None:
        self.sandbox_id = sandbox_id
        self.fd = fd
        self.handler = handler
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()
        self._slice_start = 0.0
        self._slice_used = 0
        self._resume: asyncio.TimerHandle | None = None
        self._loop.add_reader(fd, self._readable)
        self._watching = True

    def _readable(self) -> None:
        # A bounded budget per time slice: a sandbox looping on a denied call must not starve
        # the node agent's other work. Its callers simply wait for their EPERM meanwhile (each
        # blocked thread is one pending notification in the kernel), so the flood slows itself
        # down to this budget instead of queueing anything here.
        now = self._loop.time()
        if now - self._slice_start >= SLICE_S:
            self._slice_start, self._slice_used = now, 0
        while self._slice_used < SLICE_BUDGET:
            events = dict(self._poll.poll(0)).get(self.fd, 0)
            if events & select.POLLIN:
                self._answer_one()
                self._slice_used += 1
                continue
            if events & (select.POLLHUP | select.POLLERR | select.POLLNVAL):
                # Every task of the filter is gone: the fd stays "readable" (POLLHUP), so stop
                # watching, or the loop would spin until the sandbox's cleanup.
                self._unwatch()
            return
        THROTTLED.inc()
        self._unwatch()
        self._resume = self._loop.call_at(self._slice_start + SLICE_S, self._rewatch)

    def _unwatch(self) -> None:
        if self._watching:
            self._loop.remove_reader(self.fd)
            self._watching = False

    def _rewatch(self) -> None:
        self._resume = None
        if self.fd >= 0 and not self._watching:
            self._loop.add_reader(self.fd, self._readable)
            self._watching = True

    def _answer_one(self) -> None:
        buf = bytearray(_NOTIF.size)  # the kernel insists on a zeroed buffer
        try:
            # POLLIN means a pending notification, so this never blocks the loop.
            fcntl.ioctl(self.fd, SECCOMP_IOCTL_NOTIF_RECV, buf, True)
        except OSError as exc:
            if exc.errno not in (errno.ENOENT, errno.EINTR):  # ENOENT: the caller was killed
                log.warning("sandbox %s: seccomp notification: %s", self.sandbox_id, exc)
            return
        notif_id, pid, _flags, nr, _arch, _ip, *args = _NOTIF.unpack(buf)
        registers = tuple(args)
        code = seccomp.refusal_errno(nr, registers)
        with contextlib.suppress(OSError):  # ENOENT: the caller died meanwhile; still report
            fcntl.ioctl(self.fd, SECCOMP_IOCTL_NOTIF_SEND, _RESP.pack(notif_id, 0, -code, 0))
        refusal = KernelRefusal(
            self.sandbox_id,
            seccomp.describe(nr, registers),
            nr,
            pid,
            errno.errorcode.get(code, str(code)),
            seccomp.rule_id(nr, registers),
        )
        REFUSALS.labels(_label(refusal.syscall)).inc()
        if self.handler is not None:
            task = asyncio.ensure_future(self.handler(refusal))
            self._tasks.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "sandbox %s: refusal handler failed", self.sandbox_id, exc_info=task.exception()
            )

    async def close(self) -> None:
        """Answer what is pending, stop watching, let running handlers finish, close the fd."""
        if self.fd < 0:
            return
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        self._slice_start, self._slice_used = -SLICE_S, 0  # answer what is pending now
        self._readable()
        self._unwatch()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        os.close(self.fd)
        self.fd = -1
