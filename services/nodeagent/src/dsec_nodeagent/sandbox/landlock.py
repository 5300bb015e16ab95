"""Landlock rulesets through raw syscalls (ctypes), standard library only.

Why not the ``landlock`` package on PyPI: its 1.0.0.dev5 (alpha) knows only
``handled_access_fs`` — no TCP port rules (ABI 4), no ``ioctl_dev`` (ABI 5) and no scoping of
abstract UNIX sockets and signals (ABI 6), which the sandbox uses to keep a process from talking
to the host's abstract sockets or signalling its own init. The kernel interface is three syscalls
and two structs, so this module stays small and follows the kernel's best-effort rule: it asks
only for what the running ABI knows.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat

from dsec_nodeagent.sandbox import syscalls

FS_EXECUTE = 1 << 0
FS_WRITE_FILE = 1 << 1
FS_READ_FILE = 1 << 2
FS_READ_DIR = 1 << 3
FS_REMOVE_DIR = 1 << 4
FS_REMOVE_FILE = 1 << 5
FS_MAKE_CHAR = 1 << 6
FS_MAKE_DIR = 1 << 7
FS_MAKE_REG = 1 << 8
FS_MAKE_SOCK = 1 << 9
FS_MAKE_FIFO = 1 << 10
FS_MAKE_BLOCK = 1 << 11
FS_MAKE_SYM = 1 << 12
FS_REFER = 1 << 13  # ABI 2
FS_TRUNCATE = 1 << 14  # ABI 3
FS_IOCTL_DEV = 1 << 15  # ABI 5

NET_BIND_TCP = 1 << 0  # ABI 4
NET_CONNECT_TCP = 1 << 1

SCOPE_ABSTRACT_UNIX_SOCKET = 1 << 0  # ABI 6
SCOPE_SIGNAL = 1 << 1

# landlock_restrict_self(2) flags (ABI 7).
RESTRICT_SELF_LOG_SAME_EXEC_OFF = 1 << 0
RESTRICT_SELF_LOG_NEW_EXEC_ON = 1 << 1
RESTRICT_SELF_LOG_SUBDOMAINS_OFF = 1 << 2

RULE_PATH_BENEATH = 1
RULE_NET_PORT = 2
CREATE_RULESET_VERSION = 1

READ = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR
"""Rights granted beneath a readable path (executing is reading code)."""

_WRITE_ONLY = (
    FS_WRITE_FILE
    | FS_REMOVE_DIR
    | FS_REMOVE_FILE
    | FS_MAKE_DIR
    | FS_MAKE_REG
    | FS_MAKE_SOCK
    | FS_MAKE_FIFO
    | FS_MAKE_SYM
    | FS_REFER
    | FS_TRUNCATE
)
WRITE = READ | _WRITE_ONLY
"""Rights granted beneath a writable path (no device nodes)."""

FILE_RIGHTS = FS_EXECUTE | FS_READ_FILE | FS_WRITE_FILE | FS_TRUNCATE | FS_IOCTL_DEV
"""The only rights the kernel accepts on a rule whose path is not a directory."""


class _RulesetAttr(ctypes.Structure):
    _fields_ = (
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    )


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = (("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32))


class _NetPortAttr(ctypes.Structure):
    _fields_ = (("allowed_access", ctypes.c_uint64), ("port", ctypes.c_uint64))


def abi_version() -> int:
    """The Landlock ABI of the running kernel; 0 when Landlock is off."""
    try:
        return syscalls.syscall(
            syscalls.SYS_LANDLOCK_CREATE_RULESET, None, 0, CREATE_RULESET_VERSION
        )
    except OSError:
        return 0


def handled_fs(abi: int) -> int:
    """Every filesystem right the given ABI can restrict."""
    rights = (1 << 13) - 1
    if abi >= 2:
        rights |= FS_REFER
    if abi >= 3:
        rights |= FS_TRUNCATE
    if abi >= 5:
        rights |= FS_IOCTL_DEV
    return rights


def restrict_flags(abi: int) -> int:
    """``landlock_restrict_self`` flags: also log the denials of the program this one execs.

    By default (ABI 7) the kernel logs only denials made before the next ``execve``, i.e. those
    of the sandbox's pre-exec stage; the workload is what the node agent reports (:mod:`.audit`).
    Older ABIs know no flags (and log nothing).
    """
    return RESTRICT_SELF_LOG_NEW_EXEC_ON if abi >= 7 else 0


def build_ruleset(
    read_paths: list[str],
    write_paths: list[str],
    tcp_connect_ports: list[int] | None,
    abi: int,
    scope_abstract_unix: bool = True,
    root_fd: int | None = None,
    scope_signal: bool = True,
) -> int:
    """A ruleset, not yet enforced (:func:`enforce`): a new fd (close it).

    Args:
        read_paths: paths (files or dirs) granted ``READ`` beneath them; missing ones are skipped.
        write_paths: paths granted ``WRITE`` beneath them.
        tcp_connect_ports: the only TCP ports ``connect`` may reach, or ``None`` to leave TCP
            connects to the eBPF egress layer.
        abi: the kernel's Landlock ABI (from :func:`abi_version`, computed once by the parent).
        scope_abstract_unix: scope abstract unix sockets to the domain (ABI 6). Off only for a
            checkpointable sandbox: CRIU's parasite, run inside the workload, connects to one
            that CRIU made (docs/migration.md).
        scope_signal: no signal to a process outside the domain (a checkpointable sandbox's
            reaper, pid 1, goes without: its stop goes to the workload, whose domain is
            another; the workload still cannot signal it).
        root_fd: resolve the paths inside this directory, as if it were ``/`` (``openat2``'s
            ``RESOLVE_IN_ROOT``: no symlink on the way leads out of it): a detached copy of a
            root view before its ``pivot_root``. A rule binds the inode it names, not the path,
            so it holds the same once that view is ``/``. ``None``: as the caller sees them.

    Raises:
        OSError: Landlock unavailable (ABI < 1), a syscall failed, or (``root_fd``) ``openat2``
            is missing (``ENOSYS``, kernels before 5.6).
    """
    if abi < 1:
        raise OSError("Landlock is not enabled on this kernel; refusing to start unconfined")
    fs = handled_fs(abi)
    attr = _RulesetAttr(handled_access_fs=fs)
    size = 8
    if abi >= 4:
        size = 16
        attr.handled_access_net = NET_CONNECT_TCP if tcp_connect_ports is not None else 0
    if abi >= 6:
        size = 24
        attr.scoped = (SCOPE_SIGNAL if scope_signal else 0) | (
            SCOPE_ABSTRACT_UNIX_SOCKET if scope_abstract_unix else 0
        )
    ruleset_fd = syscalls.syscall(
        syscalls.SYS_LANDLOCK_CREATE_RULESET, ctypes.c_void_p(ctypes.addressof(attr)), size, 0
    )
    try:
        for path in read_paths:
            _add_path_rule(ruleset_fd, path, READ & fs, root_fd)
        for path in write_paths:
            _add_path_rule(ruleset_fd, path, WRITE & fs, root_fd)
        if abi >= 4 and tcp_connect_ports is not None:
            for port in tcp_connect_ports:
                net = _NetPortAttr(allowed_access=NET_CONNECT_TCP, port=port)
                syscalls.syscall(
                    syscalls.SYS_LANDLOCK_ADD_RULE,
                    ruleset_fd,
                    RULE_NET_PORT,
                    ctypes.c_void_p(ctypes.addressof(net)),
                    0,
                )
    except BaseException:
        os.close(ruleset_fd)
        raise
    return ruleset_fd


def enforce(ruleset_fd: int, abi: int) -> None:
    """Restrict the calling thread and its future children to ``ruleset_fd``; irreversible.
    ``no_new_privs`` must be set."""
    syscalls.syscall(syscalls.SYS_LANDLOCK_RESTRICT_SELF, ruleset_fd, restrict_flags(abi))


def _add_path_rule(ruleset_fd: int, path: str, rights: int, root_fd: int | None = None) -> None:
    try:
        if root_fd is None:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        else:
            # (RESOLVE_IN_ROOT refuses magic links, /proc/self/fd/N: ELOOP. Such a rule named
            # a pipe or a socket, which Landlock's path rights never govern: skipped too.)
            fd = syscalls.open_in_root(root_fd, path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    except OSError as exc:
        if root_fd is None or exc.errno != errno.ELOOP:
            raise
        return
    try:
        if not stat.S_ISDIR(os.fstat(fd).st_mode):
            rights &= FILE_RIGHTS
        rule = _PathBeneathAttr(allowed_access=rights, parent_fd=fd)
        syscalls.syscall(
            syscalls.SYS_LANDLOCK_ADD_RULE,
            ruleset_fd,
            RULE_PATH_BENEATH,
            ctypes.c_void_p(ctypes.addressof(rule)),
            0,
        )
    finally:
        os.close(fd)
