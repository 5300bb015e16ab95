"""The node agent's end of Landlock's audit records: report every file access Landlock refused.

Landlock (ABI 7, with ``LANDLOCK_RESTRICT_SELF_LOG_NEW_EXEC_ON`` set by :mod:`.landlock`) logs
each denial through the kernel's audit subsystem: an ``AUDIT_LANDLOCK_ACCESS`` record (1423: the
domain, the blocked rights, the path), the first time a domain shows up an
``AUDIT_LANDLOCK_DOMAIN`` record (1424: the domain, the pid and uid that created it), then the
system call's own records (1300 ``SYSCALL``: pid, uid; ``EOE`` ends the event). One reader per
node agent joins the read-only multicast group of ``NETLINK_AUDIT`` (``AUDIT_NLGRP_READLOG``,
which takes nothing from auditd when one runs) and turns each 1423 record into a
:class:`LandlockRefusal`.

**It changes a system-wide setting.** Audit records exist only while audit is enabled; when it is
disabled, :meth:`LandlockAudit.start` enables it (``AUDIT_SET``, ``AUDIT_STATUS_ENABLED``), and
:meth:`LandlockAudit.close` restores the previous state (shared by the readers of every process
of the host through ``/run/dsec-audit``, so the node agents of one machine never switch it off
under each other; restored when the last one closes, and only if nobody changed it meanwhile).
When it enables audit itself (nobody configured it: no auditd), it also raises the backlog limit to
:data:`BACKLOG_LIMIT` and sets the backlog wait time to 0, so that a sandbox looping on a denied
call can make records be dropped (counted in ``lost``) but never make a process on the node sleep
in ``audit_log_start``; the kernel log gets the records too (no auditd to take them), bounded by
printk's own rate limit. It never enables audit whose failure mode is ``panic``.

A sandbox is found from the uid (each sandbox has its own) or pid in the records, through a
``resolve`` callable of the manager; a domain once resolved stays known until Landlock logs its
deallocation, so a refusal is attributed even after the process that made it is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import json
import logging
import os
import re
import socket
import struct
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prometheus_client import Counter

log = logging.getLogger(__name__)

LANDLOCK_REFUSALS = Counter(
    "dsec_landlock_refusals_total", "Accesses refused by a sandbox's Landlock domain", ["operation"]
)

RECORDS_HUSHED = Counter(
    "dsec_landlock_hushed_total",
    "Times a sandbox's audit records were dropped in the kernel for a while (more than "
    "FLOOD_PER_S Landlock refusals a second)",
)

RECORDS_LOST = Counter(
    "dsec_landlock_records_lost_total",
    "Times the audit socket overflowed (Landlock records dropped while the reader kept to its "
    "budget; the sandboxes still got EACCES)",
)

NETLINK_AUDIT = 9
AUDIT_GET = 1000
AUDIT_SET = 1001
AUDIT_SYSCALL = 1300
AUDIT_EOE = 1320
AUDIT_LANDLOCK_ACCESS = 1423
AUDIT_LANDLOCK_DOMAIN = 1424
AUDIT_NLGRP_READLOG = 1
AUDIT_STATUS_ENABLED = 0x1
AUDIT_STATUS_BACKLOG_LIMIT = 0x10
AUDIT_STATUS_BACKLOG_WAIT_TIME = 0x20
AUDIT_FAIL_PANIC = 2
NLMSG_ERROR = 2
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
AUDIT_ADD_RULE = 1011
AUDIT_DEL_RULE = 1012
AUDIT_FILTER_EXCLUDE = 0x05
AUDIT_ALWAYS = 2
AUDIT_UID = 1
AUDIT_MSGTYPE = 12
AUDIT_EQUAL = 0x40000000
AUDIT_BITMASK_SIZE = 64
AUDIT_MAX_FIELDS = 64
FLOOD_PER_S = 200
"""Landlock refusals a second past which one sandbox's audit records are dropped in the kernel
for a while (:data:`QUIET_S`): what one sandbox floods, the shared queue and reader lose for
every neighbour (their refusals went unreported) and kauditd spends host CPU on."""
QUIET_S = 10.0
"""How long a flooding sandbox's records are dropped first (doubling while it floods again, up
to :data:`QUIET_MAX_S`)."""
QUIET_MAX_S = 120.0
BACKLOG_LIMIT = 2048
"""Records the kernel queues before dropping (its default, 64, is meant for auditd). Not more:
what one sandbox floods into it before its exclude rule (:data:`FLOOD_PER_S`) is drained
before anyone's next record is queued (with 8,192, a neighbour's first refusals in the
second after a flood began were dropped)."""
RCVBUF = 4 << 20
MAX_BATCH = 256
"""Netlink messages read per :data:`SLICE_S` at most."""
SKIP_WEIGHT = 16
"""What a parsed record costs of the budget, against 1 for one a hushed sandbox made before
its exclude rule (read past unparsed): the queue it filled drains 16 times faster."""
SLICE_S = 0.05
EVENT_GRACE_S = 0.2
"""How long an event without ``EOE`` (a denial outside a system call context) waits for more."""

_NLMSG = struct.Struct("=IHHII")
# struct audit_status: mask, enabled, failure, pid, rate_limit, backlog_limit, lost, backlog,
# feature_bitmap, backlog_wait_time, backlog_wait_time_actual.
_STATUS = struct.Struct("=11I")
_HEADER = re.compile(r"audit\(\d+\.\d+:(\d+)\):\s?")
_FIELD = re.compile(r'(\w+)=("[^"]*"|\S+)')
_HEX = re.compile(r"(?:[0-9A-F]{2})+")
_DOMAIN = re.compile(rb"\): domain=([0-9a-f]+) ")

# Landlock's names of the rights (security/landlock/audit.c) -> what a user calls the operation.
OPERATIONS = {
    "fs.execute": "execute",
    "fs.write_file": "write",
    "fs.read_file": "read",
    "fs.read_dir": "read",
    "fs.remove_dir": "remove",
    "fs.remove_file": "remove",
    "fs.make_char": "create",
    "fs.make_dir": "create",
    "fs.make_reg": "create",
    "fs.make_sock": "create",
    "fs.make_fifo": "create",
    "fs.make_block": "create",
    "fs.make_sym": "create",
    "fs.refer": "rename",
    "fs.truncate": "truncate",
    "fs.ioctl_dev": "ioctl",
    "fs.change_topology": "mount",
    "net.bind_tcp": "bind",
    "net.connect_tcp": "connect",
    "scope.abstract_unix_socket": "connect",
    "scope.signal": "signal",
}
_READ_RIGHTS = frozenset({"fs.read_file", "fs.read_dir", "fs.execute"})


@dataclass(frozen=True)
class LandlockRefusal:
    """One access of a sandbox refused by its Landlock domain (the caller got ``EACCES``).

    Attributes:
        sandbox_id: the sandbox.
        operation: what was refused, as a user reads it (``write``, ``read``, ``create``, ...).
        blockers: Landlock's names of the missing rights (``fs.write_file``, ``fs.make_reg``).
        target: the path as the sandbox sees it (or the port, peer, ... of a non-file denial).
        pid: the calling process in the node agent's pid namespace, when the records name it.
        domain: Landlock's id of the refusing domain (hex, as audit writes it).
        quiet_s: > 0 when this refusal passed :data:`FLOOD_PER_S`: the sandbox's further
            audit records are dropped in the kernel for that long (it still gets EACCES).
    """

    sandbox_id: str
    operation: str
    blockers: tuple[str, ...]
    target: str
    pid: int | None
    domain: str
    quiet_s: float = 0.0


LandlockHandler = Callable[[LandlockRefusal], Awaitable[None]]
Resolver = Callable[[int | None, int | None], str | None]
"""``(pid, uid) -> sandbox id`` of a sandbox this node agent watches, or ``None``."""


# ----------------------------------------------------------------------------- pure parsing


def parse_record(text: str) -> tuple[int, dict[str, str]] | None:
    """``(event serial, fields)`` of one audit record's text, or ``None`` when it has no header.

    Quoted values lose their quotes; values audit hex-encoded (an untrusted string with spaces,
    quotes or control characters) are decoded.
    """
    header = _HEADER.match(text)
    if header is None:
        return None
    fields: dict[str, str] = {}
    for key, value in _FIELD.findall(text, header.end()):
        if value.startswith('"'):
            fields[key] = value[1:-1]
        elif key in ("path", "exe", "comm", "name") and _HEX.fullmatch(value):
            fields[key] = bytes.fromhex(value).decode("utf-8", "replace")
        else:
            fields[key] = value
    return int(header.group(1)), fields


def operation_of(blockers: tuple[str, ...]) -> str:
    """The user's word for a denial: from its first blocked right (``fs.make_reg`` -> create)."""
    return OPERATIONS.get(blockers[0], blockers[0]) if blockers else "access"


def target_of(fields: dict[str, str]) -> str:
    """What the denial was about: the path, else the network or signal peer named in the record."""
    if "path" in fields:
        return fields["path"]
    for keys in (("daddr", "dest"), ("saddr", "src"), ("opid", "ocomm")):
        found = [f"{k}={fields[k]}" for k in keys if k in fields]
        if found:
            return " ".join(found)
    return fields.get("name", "")


def describe(refusal: LandlockRefusal) -> str:
    """What a user reads about a refusal: what was refused, the blocked rights, the list to change.

    E.g. ``Landlock refused write of /etc/x (pid 7; blocked right fs.write_file) with EACCES: the
    path is outside the spec's write_allowed``.
    """
    rights = ", ".join(refusal.blockers) or "unknown"
    by = f"pid {refusal.pid}; " if refusal.pid is not None else ""
    what = f"{refusal.operation} of {refusal.target}"
    if refusal.operation == "create":
        what = f"creating a file in {refusal.target}"
    hint = ""
    if refusal.blockers and all(b.startswith("fs.") for b in refusal.blockers):
        reading = all(b in _READ_RIGHTS for b in refusal.blockers)
        hint = f": the path is outside the spec's {'read' if reading else 'write'}_allowed"
    # Scoped IPC (signals, abstract sockets) fails with EPERM; file and port accesses with EACCES.
    errno_name = "EPERM" if rights.startswith("scope.") else "EACCES"
    said = f"Landlock refused {what} ({by}blocked right {rights}) with {errno_name}{hint}"
    if refusal.quiet_s > 0:
        said += (
            f"; more than {FLOOD_PER_S} refusals a second: the sandbox's next "
            f"{refusal.quiet_s:.0f} s of Landlock records are dropped in the kernel (each access "
            "is still refused)"
        )
    return said


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


# ----------------------------------------------------------------------------- audit status


@dataclass
class AuditStatus:
    """The fields of ``struct audit_status`` this module reads or restores."""

    enabled: int
    failure: int
    backlog_limit: int
    backlog_wait_time: int
    lost: int


def _request(sock: socket.socket, msg_type: int, payload: bytes, seq: int, reply: int) -> bytes:
    """Send one audit request; return the payload of its ``reply`` message (or of the ACK).

    The kernel answers ``AUDIT_GET`` from a helper thread, so its reply may follow the ACK:
    wait for the message asked for, failing only on an error ACK.
    """
    flags = NLM_F_REQUEST | (NLM_F_ACK if reply == NLMSG_ERROR else 0)
    sock.send(_NLMSG.pack(_NLMSG.size + len(payload), msg_type, flags, seq, 0) + payload)
    while True:
        data = sock.recv(65536)
        offset = 0
        while offset + _NLMSG.size <= len(data):
            length, kind, _flags, reply_seq, _pid = _NLMSG.unpack_from(data, offset)
            body = data[offset + _NLMSG.size : offset + length]
            offset += (length + 3) & ~3
            if reply_seq != seq:
                continue
            if kind == NLMSG_ERROR:
                (code,) = struct.unpack_from("=i", body)
                if code:
                    raise OSError(-code, f"audit request {msg_type}: {os.strerror(-code)}")
            if kind == reply:
                return body


def get_status(sock: socket.socket) -> AuditStatus:
    """The kernel's audit status (``AUDIT_GET``)."""
    body = _request(sock, AUDIT_GET, b"", 1, AUDIT_GET)
    values = _STATUS.unpack(body[: _STATUS.size].ljust(_STATUS.size, b"\0"))
    return AuditStatus(
        enabled=values[1],
        failure=values[2],
        backlog_limit=values[5],
        backlog_wait_time=values[9],
        lost=values[6],
    )


def set_status(sock: socket.socket, mask: int, status: AuditStatus) -> None:
    """Set the fields of ``status`` named by ``mask`` (``AUDIT_SET``)."""
    values = [0] * 11
    values[0], values[1] = mask, status.enabled
    values[5], values[9] = status.backlog_limit, status.backlog_wait_time
    _request(sock, AUDIT_SET, _STATUS.pack(*values), 2, NLMSG_ERROR)


def uid_rule(uid: int) -> bytes:
    """``struct audit_rule_data`` of "exclude the Landlock denial records of a task whose uid
    is ``uid``" (``auditctl -a exclude,always -F uid=UID -F msgtype=LANDLOCK_ACCESS``; the
    exclude list is checked in ``audit_log_start``, before a record is queued; the system
    call's own records then go too, while its other audit records, an operator's auditd's,
    stay)."""
    fields = [0] * AUDIT_MAX_FIELDS
    values = [0] * AUDIT_MAX_FIELDS
    flags = [0] * AUDIT_MAX_FIELDS
    fields[0], values[0], flags[0] = AUDIT_UID, uid, AUDIT_EQUAL
    fields[1], values[1], flags[1] = AUDIT_MSGTYPE, AUDIT_LANDLOCK_ACCESS, AUDIT_EQUAL
    return struct.pack(
        f"=3I{AUDIT_BITMASK_SIZE}I{AUDIT_MAX_FIELDS}I{AUDIT_MAX_FIELDS}I{AUDIT_MAX_FIELDS}II",
        AUDIT_FILTER_EXCLUDE,
        AUDIT_ALWAYS,
        2,
        *([0xFFFFFFFF] * AUDIT_BITMASK_SIZE),
        *fields,
        *values,
        *flags,
        0,
    )


def _control_socket() -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_AUDIT)
    sock.settimeout(2.0)  # requests are answered synchronously by the kernel; this never waits
    sock.bind((0, 0))
    return sock


HOST_DIR = Path("/run/dsec-audit")
"""Host-wide bookkeeping of the audit switch (tmpfs: gone at reboot, like the setting): a lock,
one file per process reading Landlock records, and the state to restore after the last one."""


def _start_time(pid: int) -> str | None:
    """A process's start time (field 22 of ``/proc/PID/stat``): a pid plus this names one
    process even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


class _AuditSwitch:
    """Enables audit for every Landlock reader of the *host*; restores the state after the last.

    Several node agents may run on one machine (``dsec up --nodes``), each reading the read-log
    multicast group (any number of readers may join it). The switch is shared through
    :data:`HOST_DIR`: whoever enables audit records the state before; a reader that stops
    restores it only when no other live process still reads (a crashed reader's entry is ignored
    once its process is gone).
    """

    def __init__(self, host_dir: Path = HOST_DIR) -> None:
        self.users = 0
        self.host_dir = host_dir

    @contextlib.contextmanager
    def _host(self) -> Iterator[Path]:
        holders = self.host_dir / "readers"
        holders.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.host_dir / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            for entry in holders.iterdir():  # readers that died without releasing
                pid = int(entry.name) if entry.name.isdigit() else -1
                if _start_time(pid) != entry.read_text().strip():
                    entry.unlink(missing_ok=True)
            yield holders
        finally:
            os.close(fd)

    def acquire(self) -> None:
        if self.users == 0:
            with self._host() as holders, contextlib.closing(_control_socket()) as sock:
                status = get_status(sock)
                if status.enabled == 0:
                    if status.failure == AUDIT_FAIL_PANIC:
                        raise OSError(
                            errno.EPERM,
                            "audit is disabled with failure=panic; "
                            "not enabling it (a lost record would panic the node)",
                        )
                    mask = (
                        AUDIT_STATUS_ENABLED
                        | AUDIT_STATUS_BACKLOG_LIMIT
                        | AUDIT_STATUS_BACKLOG_WAIT_TIME
                    )
                    wanted = AuditStatus(
                        1, status.failure, max(status.backlog_limit, BACKLOG_LIMIT), 0, 0
                    )
                    set_status(sock, mask, wanted)
                    (self.host_dir / "previous.json").write_text(json.dumps(asdict(status)))
                    log.info("audit enabled for Landlock refusals (was disabled; restored on exit)")
                pid = os.getpid()
                (holders / str(pid)).write_text(_start_time(pid) or "")
        self.users += 1

    def release(self) -> None:
        self.users -= 1
        if self.users > 0:
            return
        with self._host() as holders:
            (holders / str(os.getpid())).unlink(missing_ok=True)
            previous_file = self.host_dir / "previous.json"
            if any(holders.iterdir()) or not previous_file.is_file():
                return  # another reader still needs it, or nobody here enabled it
            previous = AuditStatus(**json.loads(previous_file.read_text()))
            previous_file.unlink()
            with contextlib.closing(_control_socket()) as sock:
                if get_status(sock).enabled != 1:
                    return  # somebody else changed it meanwhile: theirs to keep
                mask = (
                    AUDIT_STATUS_ENABLED
                    | AUDIT_STATUS_BACKLOG_LIMIT
                    | AUDIT_STATUS_BACKLOG_WAIT_TIME
                )
                set_status(sock, mask, previous)


_SWITCH = _AuditSwitch()


def _change_rule(kind: int, uid: int) -> None:
    """Add (``AUDIT_ADD_RULE``) or delete (``AUDIT_DEL_RULE``) :func:`uid_rule` of ``uid``."""
    with contextlib.closing(_control_socket()) as sock:
        _request(sock, kind, uid_rule(uid), 3, NLMSG_ERROR)


class _QuietRules:
    """The kernel's exclude rules this process added for flooding sandboxes, kept on the host
    (``HOST_DIR/quiet/<uid>``: the owning process and its start time) so that rules a crashed
    node agent left are deleted by the next reader to start: a uid given to a new sandbox must
    not stay unheard."""

    def __init__(self, host_dir: Path = HOST_DIR) -> None:
        self.dir = host_dir / "quiet"

    def add(self, uid: int) -> None:
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        pid = os.getpid()
        (self.dir / str(uid)).write_text(f"{pid} {_start_time(pid) or ''}")
        try:
            _change_rule(AUDIT_ADD_RULE, uid)
        except OSError as exc:
            if exc.errno != errno.EEXIST:
                with contextlib.suppress(OSError):  # (applied, its answer lost: taken back)
                    self.delete(uid)
                raise

    def held(self, uid: int) -> bool:
        """Whether a rule of ``uid`` is on record here (its delete may have failed)."""
        return (self.dir / str(uid)).exists()

    def delete(self, uid: int) -> None:
        try:
            _change_rule(AUDIT_DEL_RULE, uid)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                raise
        (self.dir / str(uid)).unlink(missing_ok=True)

    def sweep(self) -> None:
        """Delete the rules of readers that are gone."""
        if not self.dir.is_dir():
            return
        for entry in self.dir.iterdir():
            if not entry.name.isdigit():
                continue
            pid, _, started = entry.read_text().partition(" ")
            if pid.isdigit() and _start_time(int(pid)) == started.strip():
                continue  # (a live reader's)
            with contextlib.suppress(OSError):
                self.delete(int(entry.name))


_QUIET = _QuietRules()


# ----------------------------------------------------------------------------- the reader


@dataclass
class _Event:
    records: list[tuple[int, dict[str, str]]] = field(default_factory=list)
    timer: asyncio.TimerHandle | None = None


MAX_DOMAINS = 4096
"""Landlock domains whose sandbox the reader remembers (the most recent)."""


class LandlockAudit:
    """Reads the audit multicast group and hands each Landlock refusal of a sandbox to ``handler``.

    Args:
        resolve: ``(pid, uid) -> sandbox id`` for the sandboxes of this node agent.
        handler: awaited with every :class:`LandlockRefusal` (publish ``policy.violation``).
    """

    def __init__(self, resolve: Resolver, handler: LandlockHandler | None) -> None:
        self.resolve = resolve
        self.handler = handler
        self.sock: socket.socket | None = None
        self._domains: dict[str, str | None] = {}
        self._events: dict[int, _Event] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._switched = False
        self._watching = False
        self._slice_start = 0.0
        self._slice_used = 0
        self._counts: dict[str, tuple[float, int]] = {}  # sandbox -> (second, refusals in it)
        self._quiet: dict[int, tuple[asyncio.TimerHandle, str]] = {}  # uid -> (end, sandbox)
        self._quiet_next: dict[int, float] = {}  # uid -> its next quiet's length
        # (of _quiet, for _hushed_record: each SYSCALL record's " uid=<uid> ", the sandboxes)
        self._quiet_marks: tuple[bytes, ...] = ()
        self._quiet_sandboxes: frozenset[str] = frozenset()

    def start(self) -> None:
        """Enable audit if needed, join the read-log group, watch it from the running loop.

        Raises:
            OSError: not root in the initial namespaces, audit locked off, or failure=panic.
        """
        self._loop = asyncio.get_running_loop()
        _SWITCH.acquire()
        self._switched = True
        try:
            sock = socket.socket(
                socket.AF_NETLINK,
                socket.SOCK_RAW | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC,
                NETLINK_AUDIT,
            )
            try:
                with contextlib.suppress(OSError):  # needs CAP_NET_ADMIN; the default is smaller
                    sock.setsockopt(socket.SOL_SOCKET, 33, RCVBUF)  # SO_RCVBUFFORCE
                sock.bind((0, 1 << (AUDIT_NLGRP_READLOG - 1)))
            except OSError:
                sock.close()
                raise
        except OSError:
            self._switched = False
            _SWITCH.release()
            raise
        self.sock = sock
        self._loop.add_reader(sock.fileno(), self._readable)
        self._watching = True
        try:
            _QUIET.sweep()  # (rules a crashed node agent left)
        except OSError as exc:
            log.warning("audit: could not delete exclude rules left by another process: %s", exc)

    def _readable(self) -> None:
        # A bounded budget of messages per time slice: a sandbox looping on a denied access must
        # not starve the node agent's other work. While the budget is spent the socket is not
        # read; what overflows its buffer the kernel drops (ENOBUFS, counted in
        # ``dsec_landlock_records_lost_total``), and the sandbox still got its EACCES.
        assert self.sock is not None and self._loop is not None
        now = self._loop.time()
        if now - self._slice_start >= SLICE_S:
            self._slice_start, self._slice_used = now, 0
        while self._slice_used < MAX_BATCH * SKIP_WEIGHT:
            try:
                data = self.sock.recv(65536)
            except BlockingIOError:
                return
            except OSError as exc:
                if exc.errno == errno.ENOBUFS:  # the socket overflowed: records were lost
                    RECORDS_LOST.inc()
                    continue
                raise
            if self._hushed_record(data):
                # A record a hushed sandbox made before its rule: queued ahead of everyone
                # else's, read past at a fraction of a parse's cost (one substring search).
                self._slice_used += 1
                continue
            self._slice_used += SKIP_WEIGHT
            self._feed(data)
        if self._watching:
            self._loop.remove_reader(self.sock.fileno())
            self._watching = False
        self._loop.call_at(self._slice_start + SLICE_S, self._rewatch)

    def _hushed_record(self, data: bytes) -> bool:
        """Whether ``data`` (one netlink message) is a record of a hushed sandbox: its
        ``SYSCALL`` record (its uid) or its ``LANDLOCK_ACCESS`` record (one of its domains)."""
        if not self._quiet or len(data) < _NLMSG.size:
            return False
        kind = _NLMSG.unpack_from(data)[1]
        if kind == AUDIT_SYSCALL:
            return any(mark in data for mark in self._quiet_marks)
        if kind == AUDIT_LANDLOCK_ACCESS:
            found = _DOMAIN.search(data, _NLMSG.size, _NLMSG.size + 96)  # (it comes first)
            if found is None:
                return False
            return self._domains.get(found.group(1).decode()) in self._quiet_sandboxes
        return False

    def _rewatch(self) -> None:
        if self.sock is not None and self._loop is not None and not self._watching:
            self._loop.add_reader(self.sock.fileno(), self._readable)
            self._watching = True

    def _feed(self, data: bytes) -> None:
        offset = 0
        while offset + _NLMSG.size <= len(data):
            length, kind, _flags, _seq, _pid = _NLMSG.unpack_from(data, offset)
            body = data[offset + _NLMSG.size : offset + max(length, _NLMSG.size)]
            offset += (max(length, _NLMSG.size) + 3) & ~3
            if kind in (AUDIT_LANDLOCK_ACCESS, AUDIT_LANDLOCK_DOMAIN, AUDIT_SYSCALL, AUDIT_EOE):
                self.add_record(kind, body.rstrip(b"\0").decode("utf-8", "replace"))

    def add_record(self, kind: int, text: str) -> None:
        """Take one record's text (the reader's input; also how tests feed records)."""
        parsed = parse_record(text)
        if parsed is None:
            return
        serial, fields = parsed
        event = self._events.get(serial)
        if event is None:
            if kind in (AUDIT_SYSCALL, AUDIT_EOE):
                return  # a syscall event without any Landlock record: not ours
            event = self._events[serial] = _Event()
            loop = self._loop or asyncio.get_running_loop()
            event.timer = loop.call_later(EVENT_GRACE_S, self._complete, serial)
        event.records.append((kind, fields))
        if kind == AUDIT_EOE:
            self._complete(serial)

    def _complete(self, serial: int) -> None:
        # Events are reported in the order they began: older pending ones go first.
        for pending in list(self._events):
            if pending > serial:
                continue
            event = self._events.pop(pending)
            if event.timer is not None:
                event.timer.cancel()
            self._report(event)

    def _report(self, event: _Event) -> None:
        syscall = next((f for k, f in event.records if k == AUDIT_SYSCALL), None)
        for kind, fields in event.records:
            if kind == AUDIT_LANDLOCK_DOMAIN and fields.get("status") == "allocated":
                sandbox_id = self.resolve(_int(fields.get("pid")), _int(fields.get("uid")))
                if sandbox_id is not None:  # (another process's: nothing to remember)
                    self._remember(fields.get("domain", ""), sandbox_id)
        for kind, fields in event.records:
            if kind == AUDIT_LANDLOCK_ACCESS:
                self._refused(fields, syscall)
        for kind, fields in event.records:
            if kind == AUDIT_LANDLOCK_DOMAIN and fields.get("status") == "deallocated":
                self._domains.pop(fields.get("domain", ""), None)

    def _remember(self, domain: str, sandbox_id: str) -> None:
        """Note ``domain``'s sandbox, forgetting the oldest beyond :data:`MAX_DOMAINS`: its
        "deallocated" record may be lost (a flood past the read budget) while a sandbox makes
        domains without end (the Landlock calls are allowed), so the table is bounded."""
        self._domains.pop(domain, None)
        self._domains[domain] = sandbox_id
        while len(self._domains) > MAX_DOMAINS:
            del self._domains[next(iter(self._domains))]

    def _refused(self, fields: dict[str, str], syscall: dict[str, str] | None) -> None:
        domain = fields.get("domain", "")
        pid = _int(syscall.get("pid")) if syscall else None
        sandbox_id = self._domains.get(domain)
        if sandbox_id is None and syscall is not None:
            sandbox_id = self.resolve(pid, _int(syscall.get("uid")))
            if sandbox_id is not None:
                self._remember(domain, sandbox_id)
        if sandbox_id is None:
            return  # a Landlock domain of another program on this node
        blockers = tuple(b for b in fields.get("blockers", "").split(",") if b)
        refusal = LandlockRefusal(
            sandbox_id, operation_of(blockers), blockers, target_of(fields), pid, domain
        )
        LANDLOCK_REFUSALS.labels(refusal.operation).inc()
        uid = _int(syscall.get("uid")) if syscall else None
        # (hushed by the sandbox's own uid: a denial raised in another task's context, a
        # scoped signal's, names the refusing domain but the other task's uid)
        if uid is not None and self._flooding(sandbox_id) and self.resolve(None, uid) == sandbox_id:
            refusal = dataclasses.replace(refusal, quiet_s=self._hush(uid, sandbox_id))
        if self.handler is not None:
            task = asyncio.ensure_future(self.handler(refusal))
            self._tasks.add(task)
            task.add_done_callback(self._done)

    def _flooding(self, sandbox_id: str) -> bool:
        """Count one refusal of ``sandbox_id``; whether it is past :data:`FLOOD_PER_S` in this
        second."""
        assert self._loop is not None
        now = self._loop.time()
        start, count = self._counts.get(sandbox_id, (now, 0))
        if now - start >= 1.0:
            start, count = now, 0
        count += 1
        self._counts[sandbox_id] = (start, count)
        if len(self._counts) > MAX_DOMAINS:  # (bounded: the oldest sandboxes' counts go)
            del self._counts[next(iter(self._counts))]
        return count > FLOOD_PER_S

    def _hush(self, uid: int, sandbox_id: str) -> float:
        """Drop ``uid``'s audit records in the kernel for a while; how long (0: not done)."""
        assert self._loop is not None
        if uid in self._quiet or uid == 0:
            return 0.0
        quiet = self._quiet_next.get(uid, QUIET_S)
        try:
            _QUIET.add(uid)
        except OSError as exc:
            log.warning("audit: %s floods Landlock refusals; no exclude rule: %s", sandbox_id, exc)
            return 0.0
        RECORDS_HUSHED.inc()
        log.warning(
            "%s: more than %d Landlock refusals a second: its audit records are dropped for %.0f s",
            sandbox_id,
            FLOOD_PER_S,
            quiet,
        )
        self._quiet[uid] = (self._loop.call_later(quiet, self._unhush, uid), sandbox_id)
        self._quiet_changed()
        self._quiet_next[uid] = min(quiet * 2, QUIET_MAX_S)
        return quiet

    def _quiet_changed(self) -> None:
        self._quiet_marks = tuple(f" uid={uid} ".encode() for uid in self._quiet)
        self._quiet_sandboxes = frozenset(sandbox for _, sandbox in self._quiet.values())

    def _unhush(self, uid: int) -> None:
        hushed = self._quiet.pop(uid, None)
        if hushed is not None:
            hushed[0].cancel()
            self._quiet_changed()
        elif not _QUIET.held(uid):
            return
        try:
            _QUIET.delete(uid)
        except OSError as exc:  # tried again in a second: a rule left on would deafen the uid
            log.warning("audit: could not delete the exclude rule of uid %d: %s", uid, exc)
            if self._loop is not None and self.sock is not None:
                self._loop.call_later(1.0, self._unhush, uid)

    def release_uid(self, uid: int) -> None:
        """``uid``'s sandbox ended (or the uid goes to a new one): its records are heard
        again, and a new sandbox under it starts with the first quiet's length."""
        self._unhush(uid)
        self._quiet_next.pop(uid, None)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("Landlock refusal handler failed", exc_info=task.exception())

    async def close(self) -> None:
        """Report what is pending, stop reading, let handlers finish, restore audit's state."""
        if self.sock is not None:
            assert self._loop is not None
            self._slice_start, self._slice_used = -SLICE_S, 0  # read what is pending now
            self._readable()
            if self._watching:
                self._loop.remove_reader(self.sock.fileno())
                self._watching = False
            self.sock.close()
            self.sock = None
        if self._events:
            self._complete(max(self._events))
        for uid in list(self._quiet):
            self._unhush(uid)
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._switched:
            self._switched = False
            try:
                _SWITCH.release()
            except OSError as exc:
                log.warning("audit: could not restore the previous state: %s", exc)
