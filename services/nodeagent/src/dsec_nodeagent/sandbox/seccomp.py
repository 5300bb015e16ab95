"""The sandbox's seccomp-BPF filter: an allow-list, assembled here for x86_64 and arm64.

Everything a Python program and its children need is allowed (:data:`ALLOWED_SYSCALLS`); every
other call is refused. Four calls are allowed only for some arguments, read from registers:

* ``socket``: families ``AF_UNIX``, ``AF_INET``, ``AF_INET6`` (streams and datagrams only;
  protocols TCP and UDP only: an ICMP or SCTP socket sends past the egress hooks, an MPTCP one
  connects through the kernel's own sockets, past the count of ports), and
  ``AF_NETLINK`` with protocol ``NETLINK_ROUTE`` only (reading interfaces and routes). Every other
  family (``AF_VSOCK``, ``AF_PACKET``, ``AF_ALG``, ``AF_KEY``, ``AF_BLUETOOTH``, other netlink
  protocols, ...) is refused with ``EAFNOSUPPORT``; ``socketpair`` is ``AF_UNIX`` only.
* ``clone``: no namespace flags. ``clone3`` passes its flags in memory seccomp cannot read: it
  fails with ``ENOSYS`` so libc falls back to ``clone`` (the approach of Docker's profile).
* ``inotify_add_watch``: change events only (no ``IN_ACCESS``, ``IN_OPEN``,
  ``IN_CLOSE_NOWRITE``: ``EPERM``). A watch is on the inode, so a watch through a read-only view
  of the shared runtime or environment saw every neighbour's opens and reads of those files.

What a refused call returns: ``EAFNOSUPPORT`` for a socket family, ``EPERM`` for a call named in
:data:`DENIED_SYSCALLS` (and ``SOCK_RAW``, namespace flags), ``ENOSYS`` for any other call not on
the allow-list, so libc falls back where it can, as on a kernel without that call (``EPERM``
too for an inotify watch on a file's use). A foreign
architecture (32-bit or x32 entry points, whose numbers differ) kills the process, which the
node agent reports as exit reason ``policy``.

System call numbers come from libseccomp's tables (``libseccomp.so.2``, loaded with ctypes in
the node agent only); the program itself is assembled here, so the filter's logic is ours and the
pre-exec stage only installs bytes the parent built. Allowed numbers are matched by a binary
search over ranges (a few comparisons per call, not hundreds).

With ``notify=True`` (what a launched sandbox gets) every refused call returns
``SECCOMP_RET_USER_NOTIF``: the filter is installed with ``SECCOMP_FILTER_FLAG_NEW_LISTENER`` and
the listener goes to the node agent (:mod:`.notify`), which answers each notification with
:func:`refusal_errno` and reports it as a ``policy.violation`` (layer ``kernel``). The decision is
the filter's; the listener only reports it and picks the errno from the same registers, so
reading pointer arguments (and their TOCTOU) never matters. Fail-closed: while the listener is
open and nobody answers (node agent restarting), the call waits (interruptibly) for the next
agent; once no process holds the listener, the kernel fails the call with ``ENOSYS``. Either
way it never runs.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct

from dsec_nodeagent.sandbox import syscalls

# Standard library modules that cost start-up time (typing, functools, collections) are not
# imported: the sandbox's pre-exec stage imports this module to install the program.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterable

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_AARCH64 = 0xC00000B7
ARCHES = {"x86_64": AUDIT_ARCH_X86_64, "aarch64": AUDIT_ARCH_AARCH64}
X32_SYSCALL_BIT = 0x40000000

#: Refused with ``EPERM`` (named, so a refusal reads as a decision, not a missing call).
DENIED_SYSCALLS: tuple[str, ...] = (
    "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp",
    "io_uring_setup", "io_uring_enter", "io_uring_register", "bpf", "perf_event_open",
    "userfaultfd", "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount",
    "fspick", "move_mount", "open_tree", "mount_setattr", "unshare", "setns", "kexec_load",
    "kexec_file_load", "reboot", "init_module", "finit_module", "delete_module", "swapon",
    "swapoff", "acct", "keyctl", "add_key", "request_key", "settimeofday", "clock_settime",
    "clock_adjtime", "adjtimex", "syslog", "open_by_handle_at", "name_to_handle_at",
    "lookup_dcookie", "quotactl", "quotactl_fd", "vhangup", "iopl", "ioperm", "fanotify_init",
    "uselib", "nfsservctl", "_sysctl", "sethostname", "setdomainname", "personality",
    "modify_ldt", "move_pages", "migrate_pages",
)  # fmt: skip

#: What a Python program and its children need (names absent from an architecture are skipped:
#: arm64 has no ``open``, ``fork``, ``stat``...). ``socket``, ``socketpair``, ``clone`` and
#: ``clone3`` are decided by their arguments (module docstring).
ALLOWED_SYSCALLS: tuple[str, ...] = (
    # files and directories
    "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2",
    "pwritev2", "open", "openat", "openat2", "creat", "close", "close_range", "lseek",
    "stat", "fstat", "lstat", "newfstatat", "statx", "statfs", "fstatfs", "access", "faccessat",
    "faccessat2", "getdents", "getdents64", "getcwd", "chdir", "fchdir", "mkdir", "mkdirat",
    "rmdir", "rename", "renameat", "renameat2", "link", "linkat", "unlink", "unlinkat",
    "symlink", "symlinkat", "readlink", "readlinkat", "chmod", "fchmod", "fchmodat",
    "fchmodat2", "chown", "fchown", "lchown", "fchownat", "umask", "truncate", "ftruncate",
    "fallocate", "fadvise64", "readahead", "fsync", "fdatasync", "sync", "syncfs",
    "sync_file_range", "flock", "fcntl", "ioctl", "dup", "dup2", "dup3", "pipe", "pipe2",
    "mknod", "mknodat", "utime", "utimes", "utimensat", "futimesat", "copy_file_range",
    "sendfile", "splice", "tee", "vmsplice", "getxattr", "lgetxattr", "fgetxattr",
    "listxattr", "llistxattr", "flistxattr", "setxattr", "lsetxattr", "fsetxattr",
    "removexattr", "lremovexattr", "fremovexattr", "inotify_init", "inotify_init1",
    "inotify_rm_watch", "fanotify_mark", "memfd_create", "cachestat",
    # memory
    "brk", "mmap", "munmap", "mremap", "mprotect", "madvise", "mincore", "msync", "mlock",
    "mlock2", "munlock", "mlockall", "munlockall", "remap_file_pages", "membarrier",
    "pkey_alloc", "pkey_free", "pkey_mprotect", "get_mempolicy", "set_mempolicy", "mbind",
    "map_shadow_stack", "mseal",
    # processes, threads, signals
    "execve", "execveat", "exit", "exit_group", "fork", "vfork", "wait4", "waitid",
    "kill", "tkill", "tgkill", "rt_sigaction", "rt_sigprocmask", "rt_sigreturn",
    "rt_sigpending", "rt_sigsuspend", "rt_sigtimedwait", "rt_sigqueueinfo",
    "rt_tgsigqueueinfo", "sigaltstack", "signalfd", "signalfd4", "pause", "restart_syscall",
    "set_tid_address", "set_robust_list", "get_robust_list", "rseq", "arch_prctl", "prctl",
    "futex", "futex_waitv", "futex_wake", "futex_wait", "futex_requeue", "pidfd_open",
    "pidfd_send_signal", "process_mrelease", "getpid", "getppid", "gettid", "getuid",
    "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups", "setuid", "setgid",
    "setreuid", "setregid", "setresuid", "setresgid", "setfsuid", "setfsgid", "setgroups",
    "getpgid", "setpgid", "getpgrp", "getsid", "setsid", "capget", "capset", "getpriority",
    "setpriority", "getrlimit", "setrlimit", "prlimit64", "getrusage", "times", "sysinfo",
    "uname", "getcpu", "ioprio_get", "ioprio_set", "sched_yield", "sched_getaffinity",
    "sched_setaffinity", "sched_getparam", "sched_setparam", "sched_getscheduler",
    "sched_setscheduler", "sched_get_priority_max", "sched_get_priority_min",
    "sched_rr_get_interval", "sched_getattr", "sched_setattr", "seccomp",
    "landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self",
    # time and waiting
    "nanosleep", "clock_nanosleep", "clock_gettime", "clock_getres", "gettimeofday", "time",
    "alarm", "getitimer", "setitimer", "timer_create", "timer_settime", "timer_gettime",
    "timer_getoverrun", "timer_delete", "timerfd_create", "timerfd_settime", "timerfd_gettime",
    "poll", "ppoll", "select", "pselect6", "epoll_create", "epoll_create1", "epoll_ctl",
    "epoll_wait", "epoll_pwait", "epoll_pwait2", "eventfd", "eventfd2", "getrandom",
    # (no Linux AIO, io_setup and the other io_* calls: fs.aio-max-nr is one budget for the
    # whole host, and one io_setup(65536) took every context from the node and its neighbours;
    # ENOSYS, from which libraries fall back to threads, as they do for io_uring)
    # networking (socket itself: by family)
    "connect", "accept", "accept4", "bind", "listen", "getsockname", "getpeername",
    "sendto", "recvfrom", "sendmsg", "recvmsg", "sendmmsg", "recvmmsg", "shutdown",
    "setsockopt", "getsockopt",
    # System V IPC and POSIX message queues (private to the sandbox's IPC namespace)
    "shmget", "shmat", "shmdt", "shmctl", "semget", "semop", "semtimedop", "semctl", "msgget",
    "msgsnd", "msgrcv", "msgctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive",
    "mq_notify", "mq_getsetattr",
)  # fmt: skip

AF_UNIX = 1
AF_INET = 2
AF_INET6 = 10
AF_NETLINK = 16
AF_PACKET = 17
NETLINK_ROUTE = 0
SOCK_STREAM = 1
SOCK_DGRAM = 2
SOCK_RAW = 3
SOCK_TYPE_MASK = 0xF
IP_PROTOCOLS = (0, 6, 17)
"""An IP socket's protocols: the default, TCP and UDP (what the egress hooks judge and count).
Not MPTCP: its connections are made by the kernel's own sockets under the sandbox's (subflows),
beyond the count of the host's ports a sandbox holds (Go, curl and others fall back to TCP)."""
_SOCK_TYPES = {4: "SOCK_RDM", 5: "SOCK_SEQPACKET", 6: "SOCK_DCCP", 10: "SOCK_PACKET"}
_IP_PROTOCOL_NAMES = {
    1: "IPPROTO_ICMP",
    58: "IPPROTO_ICMPV6",
    132: "IPPROTO_SCTP",
    262: "IPPROTO_MPTCP",
}
#: Socket families a sandbox may open (``AF_NETLINK``: ``NETLINK_ROUTE`` only).
ALLOWED_FAMILIES = (AF_UNIX, AF_INET, AF_INET6, AF_NETLINK)
CLONE_NS_FLAGS = (
    syscalls.CLONE_NEWNS
    | syscalls.CLONE_NEWCGROUP
    | syscalls.CLONE_NEWUTS
    | syscalls.CLONE_NEWIPC
    | syscalls.CLONE_NEWUSER
    | syscalls.CLONE_NEWPID
    | syscalls.CLONE_NEWNET
    | syscalls.CLONE_NEWTIME
)

# classic BPF opcodes
_LD_W_ABS = 0x20
_JA = 0x05
_JEQ_K = 0x15
_JGT_K = 0x25
_JGE_K = 0x35
_AND_K = 0x54
_RET_K = 0x06

RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
RET_USER_NOTIF = 0x7FC00000

# offsets in struct seccomp_data
_OFF_NR = 0
_OFF_ARCH = 4
_OFF_ARG0 = 16
_OFF_ARG1 = 24
_OFF_ARG2 = 32

SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
# Where the sandbox's supervisor process (init.py ``run``, root, outside the sandbox) keeps its
# copy of the listener, so that a restarted node agent can take it back with pidfd_getfd(2).
SUPERVISOR_LISTENER_FD = 1000
_LEAF = 3  # ranges tested linearly at a leaf of the search tree


# ----------------------------------------------------------------------------- syscall tables


class SyscallTable:
    """One architecture's numbers for the names this module uses.

    Attributes:
        arch: the audit architecture the filter checks (``AUDIT_ARCH_X86_64``...).
        numbers: name -> number, for the names the architecture has.
    """

    def __init__(self, arch: int, numbers: dict[str, int]) -> None:
        self.arch = arch
        self.numbers = dict(numbers)
        self._names = {number: name for name, number in numbers.items()}

    def nr(self, name: str) -> int | None:
        """The number of ``name``, or None when this architecture lacks it."""
        return self.numbers.get(name)

    def name(self, nr: int) -> str | None:
        """The name of ``nr`` (any call libseccomp knows), or None."""
        known = self._names.get(nr)
        return known if known is not None else _resolve_num(self.arch, nr)


class SeccompUnavailable(OSError):
    """libseccomp (its syscall tables) is missing or does not know this architecture."""


_LOADED: dict[str, ctypes.CDLL] = {}


def _libseccomp() -> ctypes.CDLL:
    if "seccomp" in _LOADED:
        return _LOADED["seccomp"]
    # Imported here: the pre-exec stage imports this module only to install a program, and
    # ctypes.util pulls in subprocess (start-up time counts toward sandbox.ready).
    import ctypes.util

    path = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        raise SeccompUnavailable(
            f"libseccomp is missing ({exc}); install the Debian package libseccomp2"
        ) from None
    lib.seccomp_syscall_resolve_name_arch.argtypes = (ctypes.c_uint32, ctypes.c_char_p)
    lib.seccomp_syscall_resolve_name_arch.restype = ctypes.c_int
    lib.seccomp_syscall_resolve_num_arch.argtypes = (ctypes.c_uint32, ctypes.c_int)
    lib.seccomp_syscall_resolve_num_arch.restype = ctypes.c_void_p  # malloc'd: we free it
    _LOADED["seccomp"] = lib
    return lib


def _resolve_num(arch: int, nr: int) -> str | None:
    if not 0 <= nr < 1 << 20:
        return None
    raw = _libseccomp().seccomp_syscall_resolve_num_arch(arch, nr)
    if not raw:
        return None
    try:
        return ctypes.string_at(raw).decode()
    finally:
        _free(raw)


def _free(pointer: int) -> None:
    if "libc" not in _LOADED:
        _LOADED["libc"] = ctypes.CDLL(None)
        _LOADED["libc"].free.argtypes = (ctypes.c_void_p,)
        _LOADED["libc"].free.restype = None
    _LOADED["libc"].free(pointer)


_SPECIAL = ("socket", "socketpair", "clone", "clone3", "inotify_add_watch")


_TABLES: dict[int, SyscallTable] = {}


def table(arch: int | None = None) -> SyscallTable:
    """The syscall table of ``arch`` (default: this machine's), from libseccomp.

    Raises:
        SeccompUnavailable: libseccomp missing, or an architecture this module does not filter.
    """
    if arch is None:
        machine = os.uname().machine
        if machine not in ARCHES:
            raise SeccompUnavailable(f"no seccomp filter for architecture {machine}")
        arch = ARCHES[machine]
    if arch not in ARCHES.values():
        raise SeccompUnavailable(f"no seccomp filter for audit architecture {arch:#x}")
    if arch in _TABLES:
        return _TABLES[arch]
    lib = _libseccomp()
    numbers: dict[str, int] = {}
    for name in (*ALLOWED_SYSCALLS, *DENIED_SYSCALLS, *_SPECIAL):
        nr = lib.seccomp_syscall_resolve_name_arch(arch, name.encode())
        if nr >= 0:  # negative: a pseudo-number, the architecture lacks the call
            numbers[name] = nr
    if "socket" not in numbers or "read" not in numbers:
        raise SeccompUnavailable("libseccomp returned no numbers for basic calls")
    _TABLES[arch] = SyscallTable(arch, numbers)
    return _TABLES[arch]


# ----------------------------------------------------------------------------- the program


class _Assembler:
    """Collects instructions whose jump targets are labels, resolved at the end."""

    def __init__(self) -> None:
        self._code: list[tuple[int, str | int, str | int, int | str]] = []
        self._labels: dict[str, int] = {}
        self._fresh = 0

    def fresh(self, prefix: str) -> str:
        self._fresh += 1
        return f"{prefix}{self._fresh}"

    def label(self, name: str) -> None:
        self._labels[name] = len(self._code)

    def op(self, code: int, k: int, jt: str | int = 0, jf: str | int = 0) -> None:
        self._code.append((code, jt, jf, k))

    def jump(self, target: str) -> None:
        """An unconditional jump (32-bit offset: any distance)."""
        self._code.append((_JA, 0, 0, target))

    def assemble(self) -> bytes:
        out = bytearray()
        for pc, (code, jt, jf, k) in enumerate(self._code):
            if isinstance(k, str):
                k = self._labels[k] - pc - 1
            out += struct.pack("<HBBI", code, self._rel(pc, jt), self._rel(pc, jf), k)
        return bytes(out)

    def _rel(self, pc: int, target: str | int) -> int:
        if isinstance(target, int):
            return target
        offset = self._labels[target] - pc - 1
        if not 0 <= offset <= 255:
            raise ValueError(f"seccomp jump to {target} out of range ({offset})")
        return offset


def ranges(numbers: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted numbers as inclusive ``(low, high)`` runs."""
    out: list[tuple[int, int]] = []
    for n in sorted(set(numbers)):
        if out and out[-1][1] == n - 1:
            out[-1] = (out[-1][0], n)
        else:
            out.append((n, n))
    return out


def _search(asm: _Assembler, runs: list[tuple[int, int]], allow: str, miss: str) -> None:
    """Binary search over ``runs`` for the number in the accumulator: ``allow`` or ``miss``."""
    if len(runs) <= _LEAF:
        local = asm.fresh("allow")
        for low, high in runs:
            skip = asm.fresh("next")
            if low == high:
                asm.op(_JEQ_K, low, local, 0)
            else:
                asm.op(_JGE_K, low, 0, skip)
                asm.op(_JGT_K, high, skip, local)
            asm.label(skip)
        asm.jump(miss)
        asm.label(local)
        asm.jump(allow)
        return
    middle = len(runs) // 2
    right = asm.fresh("right")
    asm.op(_JGE_K, runs[middle][0], 0, 1)
    asm.jump(right)
    _search(asm, runs[:middle], allow, miss)
    asm.label(right)
    _search(asm, runs[middle:], allow, miss)


def build_filter(*, notify: bool = False, arch: int | None = None) -> bytes:
    """Assemble the sandbox's filter program (``struct sock_filter`` array bytes).

    Args:
        notify: refused calls go to the user-notification listener (which answers with
            :func:`refusal_errno` and reports them) instead of failing in the filter itself.
        arch: the audit architecture to build for (default: this machine's).
    """
    t = table(arch)
    allowed = [n for name in ALLOWED_SYSCALLS if (n := t.nr(name)) is not None]
    denied = sorted({n for name in DENIED_SYSCALLS if (n := t.nr(name)) is not None})
    asm = _Assembler()
    asm.op(_LD_W_ABS, _OFF_ARCH)
    asm.op(_JEQ_K, t.arch, 1, 0)
    asm.jump("kill")
    asm.op(_LD_W_ABS, _OFF_NR)
    if t.arch == AUDIT_ARCH_X86_64:
        asm.op(_JGE_K, X32_SYSCALL_BIT, 0, 1)
        asm.jump("kill")
    _search(asm, ranges(allowed), "allow", "special")
    asm.label("special")
    asm.op(_JEQ_K, t.numbers["socket"], 0, 1)
    asm.jump("socket")
    asm.op(_JEQ_K, t.numbers["socketpair"], 0, 1)
    asm.jump("socketpair")
    asm.op(_JEQ_K, t.numbers["clone"], 0, 1)
    asm.jump("clone")
    asm.op(_JEQ_K, t.numbers["clone3"], 0, 1)
    asm.jump("enosys_silent")
    asm.op(_JEQ_K, t.numbers["inotify_add_watch"], 0, 1)
    asm.jump("inotify_add_watch")
    for number in denied:  # reached only by calls that are not allowed: cost off the hot path
        asm.op(_JEQ_K, number, 0, 1)
        asm.jump("eperm")
    asm.jump("enosys")
    _socket_blocks(asm)
    # inotify_add_watch: change events only. A watch is on the inode, so one placed through a
    # read-only view fired for every process of the host opening or reading that file: a
    # sandbox watching the shared runtime's or environment's files saw each module its
    # neighbours imported, with the time.
    asm.label("inotify_add_watch")
    asm.op(_LD_W_ABS, _OFF_ARG2)
    asm.op(_AND_K, INOTIFY_USE_EVENTS)
    asm.op(_JEQ_K, 0, "allow", "eperm")
    asm.label("clone")
    asm.op(_LD_W_ABS, _OFF_ARG0)
    asm.op(_AND_K, CLONE_NS_FLAGS)
    asm.op(_JEQ_K, 0, "allow", "eperm")
    # clone3 passes its flags in memory seccomp cannot read: answer ENOSYS (not reported: glibc
    # tries it on every thread and process start) so libc falls back to clone, checked above.
    asm.label("enosys_silent")
    asm.op(_RET_K, RET_ERRNO | errno.ENOSYS)
    asm.label("allow")
    asm.op(_RET_K, RET_ALLOW)
    refuse = RET_USER_NOTIF if notify else None
    for label, code in (("eperm", errno.EPERM), ("enosys", errno.ENOSYS)):
        asm.label(label)
        asm.op(_RET_K, refuse if refuse is not None else RET_ERRNO | code)
    asm.label("eafnosupport")
    asm.op(_RET_K, refuse if refuse is not None else RET_ERRNO | errno.EAFNOSUPPORT)
    asm.label("kill")
    asm.op(_RET_K, RET_KILL_PROCESS)
    return asm.assemble()


def _socket_blocks(asm: _Assembler) -> None:
    """``socket``: allowed families (no ``SOCK_RAW`` for IP; netlink: route only);
    ``socketpair``: ``AF_UNIX`` only."""
    asm.label("socket")
    asm.op(_LD_W_ABS, _OFF_ARG0)
    asm.op(_JEQ_K, AF_UNIX, "allow_socket", 0)
    asm.op(_JEQ_K, AF_NETLINK, "netlink", 0)
    asm.op(_JEQ_K, AF_INET, "ip", 0)
    asm.op(_JEQ_K, AF_INET6, "ip", 0)
    asm.jump("eafnosupport")
    asm.label("ip")
    asm.op(_LD_W_ABS, _OFF_ARG1)
    asm.op(_AND_K, SOCK_TYPE_MASK)
    # streams and datagrams only (SOCK_SEQPACKET with protocol 0 is SCTP where it is loaded),
    # and of those the transports the egress hooks judge: an ICMP "ping" socket (SOCK_DGRAM,
    # IPPROTO_ICMP, open to unprivileged users where net.ipv4.ping_group_range allows) sends to
    # any address past the cgroup sendmsg hooks
    asm.op(_JEQ_K, SOCK_STREAM, "ip_protocol", 0)
    asm.op(_JEQ_K, SOCK_DGRAM, "ip_protocol", "eperm")
    asm.label("ip_protocol")
    asm.op(_LD_W_ABS, _OFF_ARG2)
    for protocol in IP_PROTOCOLS:
        asm.op(_JEQ_K, protocol, "allow_socket", 0)
    asm.jump("eperm")
    asm.label("netlink")
    asm.op(_LD_W_ABS, _OFF_ARG2)
    asm.op(_JEQ_K, NETLINK_ROUTE, "allow_socket", 0)
    asm.jump("eafnosupport")
    asm.label("socketpair")
    asm.op(_LD_W_ABS, _OFF_ARG0)
    asm.op(_JEQ_K, AF_UNIX, "allow_socket", 0)
    asm.jump("eafnosupport")
    asm.label("allow_socket")
    asm.op(_RET_K, RET_ALLOW)


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def install(program: bytes, *, listener: bool = False) -> int:
    """Load ``program`` for the calling thread; needs ``no_new_privs`` (or CAP_SYS_ADMIN).

    Args:
        listener: also create the user-notification listener (for a ``notify`` program).

    Returns:
        The listener fd (close-on-exec), or -1 without ``listener``.
    """
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len=len(program) // 8, filter=ctypes.addressof(buf))
    flags = SECCOMP_FILTER_FLAG_NEW_LISTENER if listener else 0
    program_ptr = ctypes.c_void_p(ctypes.addressof(prog))
    fd = syscalls.syscall(syscalls.SYS_SECCOMP, SECCOMP_SET_MODE_FILTER, flags, program_ptr)
    return fd if listener else -1


# ----------------------------------------------------------------------------- refusals


_FAMILIES = {
    AF_UNIX: "AF_UNIX", AF_INET: "AF_INET", AF_INET6: "AF_INET6", AF_NETLINK: "AF_NETLINK",
    AF_PACKET: "AF_PACKET", 3: "AF_AX25", 4: "AF_IPX", 5: "AF_APPLETALK", 9: "AF_X25",
    15: "AF_KEY", 21: "AF_RDS", 29: "AF_CAN", 30: "AF_TIPC", 31: "AF_BLUETOOTH", 38: "AF_ALG",
    40: "AF_VSOCK", 42: "AF_QIPCRTR", 44: "AF_XDP", 45: "AF_MCTP",
}  # fmt: skip
_NETLINK = {0: "NETLINK_ROUTE", 4: "NETLINK_SOCK_DIAG", 9: "NETLINK_AUDIT", 16: "NETLINK_GENERIC"}
_CLONE_FLAG_NAMES = (
    (syscalls.CLONE_NEWNS, "CLONE_NEWNS"),
    (syscalls.CLONE_NEWCGROUP, "CLONE_NEWCGROUP"),
    (syscalls.CLONE_NEWUTS, "CLONE_NEWUTS"),
    (syscalls.CLONE_NEWIPC, "CLONE_NEWIPC"),
    (syscalls.CLONE_NEWUSER, "CLONE_NEWUSER"),
    (syscalls.CLONE_NEWPID, "CLONE_NEWPID"),
    (syscalls.CLONE_NEWNET, "CLONE_NEWNET"),
    (syscalls.CLONE_NEWTIME, "CLONE_NEWTIME"),
)


IN_ACCESS, IN_CLOSE_NOWRITE, IN_OPEN = 0x1, 0x10, 0x20
INOTIFY_USE_EVENTS = IN_ACCESS | IN_CLOSE_NOWRITE | IN_OPEN
"""inotify events that tell a file's use, not its change: a sandbox may not watch for them."""
_INOTIFY_NAMES = (
    (IN_ACCESS, "IN_ACCESS"),
    (IN_OPEN, "IN_OPEN"),
    (IN_CLOSE_NOWRITE, "IN_CLOSE_NOWRITE"),
)


def _family(args: tuple[int, ...]) -> int:
    return args[0] & 0xFFFFFFFF


def _is_family_refusal(t: SyscallTable, nr: int, args: tuple[int, ...]) -> bool:
    if nr == t.nr("socketpair"):
        return True
    return nr == t.nr("socket") and _family(args) not in (AF_INET, AF_INET6)


def refusal_errno(nr: int, args: tuple[int, ...], arch: int | None = None) -> int:
    """The errno a refused call gets (what the filter itself returns without a listener).

    Only called for calls the filter refused, with the registers it tested.
    """
    t = table(arch)
    if _is_family_refusal(t, nr, args):
        return errno.EAFNOSUPPORT
    name = t.name(nr)
    if name in DENIED_SYSCALLS or nr in (t.nr("socket"), t.nr("clone"), t.nr("inotify_add_watch")):
        return errno.EPERM
    return errno.ENOSYS


def rule_id(nr: int, args: tuple[int, ...], arch: int | None = None) -> str:
    """The rule a refusal reports: ``seccomp.socket-family``, ``seccomp.denied`` (a named
    dangerous call, ``SOCK_RAW``, namespace flags) or ``seccomp.not-allowed``."""
    t = table(arch)
    if _is_family_refusal(t, nr, args):
        return "seccomp.socket-family"
    if refusal_errno(nr, args, arch) == errno.EPERM:
        return "seccomp.denied"
    return "seccomp.not-allowed"


def describe(nr: int, args: tuple[int, ...], arch: int | None = None) -> str:
    """A refused call as a user reads it: ``ptrace``, ``socket(AF_VSOCK)``, ``clone(...)``.

    Only the register arguments the filter itself tested are used (never memory: the
    notification is a report, not a decision).
    """
    t = table(arch)
    if nr in (t.nr("socket"), t.nr("socketpair")):
        call = "socket" if nr == t.nr("socket") else "socketpair"
        family = _family(args)
        name = _FAMILIES.get(family, f"family {family}")
        if call == "socket" and family == AF_NETLINK:
            protocol = args[2] & 0xFFFFFFFF
            return f"socket(AF_NETLINK, {_NETLINK.get(protocol, f'protocol {protocol}')})"
        if call == "socket" and family in (AF_INET, AF_INET6):
            kind = args[1] & SOCK_TYPE_MASK
            if kind == SOCK_RAW:
                return f"socket({name}, SOCK_RAW)"
            if kind not in (SOCK_STREAM, SOCK_DGRAM):
                return f"socket({name}, {_SOCK_TYPES.get(kind, f'type {kind}')})"
            protocol = args[2] & 0xFFFFFFFF
            return f"socket({name}, {_IP_PROTOCOL_NAMES.get(protocol, f'protocol {protocol}')})"
        return f"{call}({name})"
    if nr == t.nr("clone"):
        flags = [name for bit, name in _CLONE_FLAG_NAMES if args[0] & bit]
        return f"clone({'|'.join(flags)})"
    if nr == t.nr("inotify_add_watch"):
        events = [name for bit, name in _INOTIFY_NAMES if args[2] & bit]
        return f"inotify_add_watch({'|'.join(events)}: a file's use, not its change)"
    return t.name(nr) or f"syscall {nr}"
