"""A small seccomp-BPF deny-list, assembled here; standard library only.

Why not libseccomp: its Python binding is a Debian package built for the system interpreter, and
the filter needed is a few dozen instructions. Assembling it here keeps the pre-exec stage free of
native dependencies and lets the parent build the program once and hand the bytes to the child.

Denied calls fail with ``EPERM`` (what a user can read in an error message) rather than killing
the process; a foreign architecture (32-bit or x32 entry points that would bypass the numbers
below) kills the process, which the node agent reports as exit reason ``policy``.

With ``notify=True`` (what a launched sandbox gets) a denied call returns ``SECCOMP_RET_USER_NOTIF``
instead of ``ERRNO(EPERM)``: the filter is installed with ``SECCOMP_FILTER_FLAG_NEW_LISTENER`` and
the listener goes to the node agent (:mod:`.notify`), which answers every notification with
``EPERM`` and reports it as a ``policy.violation`` (layer ``kernel``). The decision is the
filter's; the listener only reports it, so reading pointer arguments (and their TOCTOU) never
matters. Fail-closed: while the listener is open and nobody answers (node agent restarting), the
call waits (interruptibly) for the next agent; once no process holds the listener, the kernel
fails the call with ``ENOSYS``. Either way it never runs.
"""

from __future__ import annotations

import ctypes
import errno
import struct

from dsec_nodeagent.sandbox import syscalls

AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

# x86_64 syscall numbers (asm/unistd_64.h).
DENIED_SYSCALLS: dict[str, int] = {
    "ptrace": 101,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "pidfd_getfd": 438,
    "kcmp": 312,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "bpf": 321,
    "perf_event_open": 298,
    "userfaultfd": 323,
    "mount": 165,
    "umount2": 166,
    "pivot_root": 155,
    "chroot": 161,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "move_mount": 429,
    "open_tree": 428,
    "mount_setattr": 442,
    "unshare": 272,
    "setns": 308,
    "kexec_load": 246,
    "kexec_file_load": 320,
    "reboot": 169,
    "init_module": 175,
    "finit_module": 313,
    "delete_module": 176,
    "swapon": 167,
    "swapoff": 168,
    "acct": 163,
    "keyctl": 250,
    "add_key": 248,
    "request_key": 249,
    "settimeofday": 164,
    "clock_settime": 227,
    "clock_adjtime": 305,
    "adjtimex": 159,
    "syslog": 103,
    "open_by_handle_at": 304,
    "name_to_handle_at": 303,
    "lookup_dcookie": 212,
    "quotactl": 179,
    "quotactl_fd": 443,
    "vhangup": 153,
    "iopl": 172,
    "ioperm": 173,
    "fanotify_init": 300,
    "uselib": 134,
    "nfsservctl": 180,
    "_sysctl": 156,
    "sethostname": 170,
    "setdomainname": 171,
}
NR_SOCKET = 41
NR_CLONE = 56
NR_CLONE3 = 435
AF_PACKET = 17
SOCK_RAW = 3
SOCK_TYPE_MASK = 0xF
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
_JEQ_K = 0x15
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

SECCOMP_SET_MODE_FILTER = 1
SECCOMP_FILTER_FLAG_NEW_LISTENER = 1 << 3
# Where the sandbox's supervisor process (init.py ``run``, root, outside the sandbox) keeps its
# copy of the listener, so that a restarted node agent can take it back with pidfd_getfd(2).
SUPERVISOR_LISTENER_FD = 1000


class _Assembler:
    """Collects instructions whose jump targets are labels, resolved at the end."""

    def __init__(self) -> None:
        self._code: list[tuple[int, str | int, str | int, int]] = []
        self._labels: dict[str, int] = {}

    def label(self, name: str) -> None:
        self._labels[name] = len(self._code)

    def op(self, code: int, k: int, jt: str | int = 0, jf: str | int = 0) -> None:
        self._code.append((code, jt, jf, k))

    def assemble(self) -> bytes:
        out = bytearray()
        for pc, (code, jt, jf, k) in enumerate(self._code):
            out += struct.pack("<HBBI", code, self._rel(pc, jt), self._rel(pc, jf), k)
        return bytes(out)

    def _rel(self, pc: int, target: str | int) -> int:
        if isinstance(target, int):
            return target
        offset = self._labels[target] - pc - 1
        if not 0 <= offset <= 255:
            raise ValueError(f"seccomp jump to {target} out of range ({offset})")
        return offset


def build_filter(denied: dict[str, int] | None = None, *, notify: bool = False) -> bytes:
    """Assemble the sandbox's filter program (``struct sock_filter`` array bytes).

    Args:
        denied: syscall name -> x86_64 number (default :data:`DENIED_SYSCALLS`).
        notify: denied calls go to the user-notification listener (which answers ``EPERM`` and
            reports them) instead of failing with ``EPERM`` in the filter itself.
    """
    numbers = sorted(set((denied or DENIED_SYSCALLS).values()))
    asm = _Assembler()
    asm.op(_LD_W_ABS, _OFF_ARCH)
    asm.op(_JEQ_K, AUDIT_ARCH_X86_64, 0, "kill")
    asm.op(_LD_W_ABS, _OFF_NR)
    asm.op(_JGE_K, X32_SYSCALL_BIT, "kill", 0)
    for number in numbers:
        asm.op(_JEQ_K, number, "eperm", 0)
    asm.op(_JEQ_K, NR_SOCKET, "socket", 0)
    asm.op(_JEQ_K, NR_CLONE, "clone", 0)
    asm.op(_JEQ_K, NR_CLONE3, "enosys", 0)
    asm.op(_RET_K, RET_ALLOW)
    asm.label("socket")
    asm.op(_LD_W_ABS, _OFF_ARG0)
    asm.op(_JEQ_K, AF_PACKET, "eperm", 0)
    asm.op(_LD_W_ABS, _OFF_ARG1)
    asm.op(_AND_K, SOCK_TYPE_MASK)
    asm.op(_JEQ_K, SOCK_RAW, "eperm", 0)
    asm.op(_RET_K, RET_ALLOW)
    asm.label("clone")
    asm.op(_LD_W_ABS, _OFF_ARG0)
    asm.op(_AND_K, CLONE_NS_FLAGS)
    asm.op(_JEQ_K, 0, 0, "eperm")
    asm.op(_RET_K, RET_ALLOW)
    # clone3 passes its flags in memory seccomp cannot read: answer ENOSYS so libc falls back
    # to clone, whose flags the rule above checks (the approach of Docker's default profile).
    asm.label("enosys")
    asm.op(_RET_K, RET_ERRNO | errno.ENOSYS)
    asm.label("eperm")
    asm.op(_RET_K, RET_USER_NOTIF if notify else RET_ERRNO | errno.EPERM)
    asm.label("kill")
    asm.op(_RET_K, RET_KILL_PROCESS)
    return asm.assemble()


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


_NAMES = {number: name for name, number in DENIED_SYSCALLS.items()}
_FAMILIES = {1: "AF_UNIX", 2: "AF_INET", 10: "AF_INET6", 16: "AF_NETLINK", AF_PACKET: "AF_PACKET"}
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


def describe(nr: int, args: tuple[int, ...]) -> str:
    """A refused call as a user reads it: ``ptrace``, ``socket(AF_PACKET)``, ``clone(...)``.

    Only the register arguments the filter itself tested are used (never memory: the
    notification is a report, not a decision).
    """
    if nr == NR_SOCKET:
        family = args[0] & 0xFFFF
        if family == AF_PACKET:
            return "socket(AF_PACKET)"
        return f"socket({_FAMILIES.get(family, f'family {family}')}, SOCK_RAW)"
    if nr == NR_CLONE:
        flags = [name for bit, name in _CLONE_FLAG_NAMES if args[0] & bit]
        return f"clone({'|'.join(flags)})"
    return _NAMES.get(nr, f"syscall {nr}")
