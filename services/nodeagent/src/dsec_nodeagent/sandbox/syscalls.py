"""Thin ctypes wrappers over the Linux calls Python 3.11 lacks (mount, pivot_root, unshare, setns).

Standard library only: this module is imported by the sandbox's pre-exec stage, whose start
latency counts toward ``sandbox.ready`` (pydantic alone would cost more than the whole budget).
"""

from __future__ import annotations

import ctypes
import errno
import os

_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long

# x86_64 and arm64 (asm-generic) numbers; calls from 424 on have one number on every
# architecture. The sandbox refuses to start on others (check_arch).
_MACHINE = os.uname().machine
SYS_PIVOT_ROOT = 41 if _MACHINE == "aarch64" else 155
SYS_SECCOMP = 277 if _MACHINE == "aarch64" else 317
SYS_LANDLOCK_CREATE_RULESET = 444
SYS_LANDLOCK_ADD_RULE = 445
SYS_LANDLOCK_RESTRICT_SELF = 446
SYS_MOUNT_SETATTR = 442
SYS_OPENAT2 = 437
RESOLVE_IN_ROOT = 0x10
SUPPORTED_MACHINES = ("x86_64", "aarch64")

CLONE_NEWNS = 0x00020000
CLONE_NEWCGROUP = 0x02000000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
CLONE_NEWTIME = 0x00000080

MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_NOATIME = 0x400
MS_NODIRATIME = 0x800
MS_RELATIME = 0x200000
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MNT_DETACH = 0x2
AT_FDCWD = -100
AT_RECURSIVE = 0x8000
MOUNT_ATTR_RDONLY = 0x1
MOUNT_ATTR_NOSUID = 0x2
MOUNT_ATTR_NODEV = 0x4

PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
PR_SET_NO_NEW_PRIVS = 38
PR_CAPBSET_DROP = 24
PR_SET_CHILD_SUBREAPER = 36
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4


def check_arch() -> None:
    """Raise unless this is x86_64 or arm64, the syscall tables this module carries."""
    if _MACHINE not in SUPPORTED_MACHINES:
        raise OSError(f"sandbox supports x86_64 and aarch64 only, this machine is {_MACHINE}")


def _check(result: int, what: str) -> int:
    if result < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return result


def mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    """mount(2)."""
    _check(
        _libc.mount(
            source.encode() if source else None,
            target.encode(),
            fstype.encode() if fstype else None,
            ctypes.c_ulong(flags),
            data.encode() if data else None,
        ),
        f"mount {source or fstype} on {target}",
    )


def umount2(target: str, flags: int) -> None:
    """umount2(2)."""
    _check(_libc.umount2(target.encode(), flags), f"umount {target}")


def pivot_root(new_root: str, put_old: str) -> None:
    """pivot_root(2) (no glibc wrapper)."""
    _check(_syscall(SYS_PIVOT_ROOT, new_root.encode(), put_old.encode()), "pivot_root")


def unshare(flags: int) -> None:
    """unshare(2)."""
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    """setns(2)."""
    _check(_libc.setns(fd, nstype), "setns")


def sethostname(name: str) -> None:
    """sethostname(2)."""
    raw = name.encode()
    _check(_libc.sethostname(raw, len(raw)), "sethostname")


def prctl(option: int, arg2: int = 0, arg3: int = 0, arg4: int = 0, arg5: int = 0) -> int:
    """prctl(2)."""
    return _check(
        _libc.prctl(
            option,
            ctypes.c_ulong(arg2),
            ctypes.c_ulong(arg3),
            ctypes.c_ulong(arg4),
            ctypes.c_ulong(arg5),
        ),
        f"prctl({option})",
    )


def syscall(number: int, *args: int | bytes | ctypes.c_void_p | None) -> int:
    """A raw syscall; raises OSError with errno on failure."""
    return _check(_syscall(number, *args), f"syscall {number}")


def drop_capabilities(last_cap: int) -> None:
    """Empty the bounding and ambient sets so nothing exec'd can regain a capability.

    Args:
        last_cap: the host's ``/proc/sys/kernel/cap_last_cap`` (read by the parent, since the
            child may no longer see the host's /proc).
    """
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    for cap in range(last_cap + 1):
        prctl(PR_CAPBSET_DROP, cap)


class _MountAttr(ctypes.Structure):
    _fields_ = [  # struct mount_attr (linux/mount.h), MOUNT_ATTR_SIZE_VER0
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class _OpenHow(ctypes.Structure):
    _fields_ = [  # struct open_how (linux/openat2.h)
        ("flags", ctypes.c_uint64),
        ("mode", ctypes.c_uint64),
        ("resolve", ctypes.c_uint64),
    ]


SYS_OPEN_TREE = 428
OPEN_TREE_CLONE = 1


def open_tree_clone(path: str) -> int:
    """``open_tree(path, OPEN_TREE_CLONE | AT_RECURSIVE | OPEN_TREE_CLOEXEC)``: an fd of a
    detached copy of the mount tree at ``path`` (gone when the fd closes).

    Raises:
        OSError: errno ``ENOSYS`` on kernels before 5.2.
    """
    flags = OPEN_TREE_CLONE | AT_RECURSIVE | os.O_CLOEXEC
    return _check(_syscall(SYS_OPEN_TREE, AT_FDCWD, os.fsencode(path), flags), f"open_tree {path}")


def open_in_root(root_fd: int, path: str, flags: int) -> int:
    """``openat2(root_fd, path, flags, RESOLVE_IN_ROOT)``: ``path`` (absolute or not)
    and every symlink on its way resolve as if ``root_fd`` were ``/``; a new fd. ``root_fd``
    should be the root of a detached mount tree (``open_tree``): a ``..`` that reaches the
    root steps into whatever is mounted over it.

    Raises:
        OSError: errno ``ENOSYS`` on kernels before 5.6; ``EAGAIN`` when a lookup through
            ``..`` was interrupted :data:`_OPENAT2_TRIES` times; as ``open(2)`` otherwise.
    """
    how = _OpenHow(flags=flags, mode=0, resolve=RESOLVE_IN_ROOT)
    name = os.fsencode(path)
    for _ in range(_OPENAT2_TRIES):
        fd = _syscall(
            SYS_OPENAT2, root_fd, name, ctypes.c_void_p(ctypes.addressof(how)), ctypes.sizeof(how)
        )
        if fd >= 0 or ctypes.get_errno() != errno.EAGAIN:
            break
    return _check(fd, f"openat2 {path}")


_OPENAT2_TRIES = 16
"""A scoped lookup through ``..`` fails with EAGAIN when any mount or rename on the host
happened meanwhile; it is tried again this often (then the EAGAIN is the caller's)."""


def mount_setattr_recursive(target: str, attr_set: int) -> None:
    """Set ``attr_set`` (MOUNT_ATTR_*) on ``target`` and every mount below it, in one call
    (Linux 5.12+). Raises OSError(ENOSYS) on older kernels; the caller falls back."""
    attr = _MountAttr(attr_set, 0, 0, 0)
    _check(
        _syscall(
            SYS_MOUNT_SETATTR,
            ctypes.c_int(AT_FDCWD),
            target.encode(),
            ctypes.c_uint(AT_RECURSIVE),
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
        ),
        f"mount_setattr {target}",
    )


def mounts_below(target: str, flags: dict[str, int] | None = None) -> list[str]:
    """Mount points strictly below ``target`` in this mount namespace (from mountinfo,
    octal escapes decoded, or from ``flags``: :func:`mount_flags` read already), parents
    before children."""
    prefix = target.rstrip("/") + "/"
    found = {
        point for point in (mount_flags() if flags is None else flags) if point.startswith(prefix)
    }
    return sorted(found, key=lambda p: p.count("/"))


# per-mount options (mountinfo's sixth field) a bind remount would otherwise clear
_KEPT_OPTIONS = {
    "ro": MS_RDONLY,
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
}


def mount_flags() -> dict[str, int]:
    """Each mount point of this mount namespace and the ``MS_*`` flags of the mount on top of
    it (mountinfo lists mounts in the order made), as ``MS_REMOUNT | MS_BIND`` would need to
    keep them: such a remount sets the mount's flags to exactly those it is given."""
    flags: dict[str, int] = {}
    with open("/proc/self/mountinfo", "rb") as info:
        for line in info:
            fields = line.split(b" ", 6)
            point = os.fsdecode(fields[4].decode("unicode_escape").encode("latin-1"))
            options = fields[5].decode("ascii", "replace").split(",")
            flags[point] = sum(_KEPT_OPTIONS.get(option, 0) for option in set(options))
    return flags


MADV_POPULATE_WRITE = 23  # Linux 5.14
_madvise = _libc.madvise
_madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_madvise.restype = ctypes.c_int


def populate_write(start: int, length: int) -> int:
    """``madvise(MADV_POPULATE_WRITE)``: fault the range in writable now (a page shared
    copy-on-write with the parent is copied). 0, or the errno: ``EINVAL`` before Linux 5.14
    or for a mapping it cannot populate, ``ENOMEM``/``EFAULT`` where memory ran short."""
    if _madvise(start, length, MADV_POPULATE_WRITE) == 0:
        return 0
    return ctypes.get_errno()


def current_cpu() -> int:
    """The CPU this thread runs on (``sched_getcpu``), -1 where libc lacks it."""
    try:
        return int(_libc.sched_getcpu())
    except AttributeError:
        return -1
