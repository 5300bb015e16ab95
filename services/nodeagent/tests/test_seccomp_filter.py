"""The seccomp program itself, run by a small classic-BPF interpreter, for x86_64 and arm64.

The kernel behaviour (the errno a sandboxed process sees, the event that arrives) is tested in
test_sandbox_kernel.py; here every syscall number of both architectures goes through the program,
which a kernel test on one machine cannot do.
"""

from __future__ import annotations

import errno
import struct

import pytest

from dsec_nodeagent.sandbox import seccomp

pytestmark = pytest.mark.unit

X86 = seccomp.AUDIT_ARCH_X86_64
ARM = seccomp.AUDIT_ARCH_AARCH64
ALLOW = seccomp.RET_ALLOW
NOTIF = seccomp.RET_USER_NOTIF
KILL = seccomp.RET_KILL_PROCESS
AF_VSOCK = 40
NETLINK_AUDIT = 9
SOCK_STREAM = 1


def errno_ret(code: int) -> int:
    return seccomp.RET_ERRNO | code


def run_bpf(program: bytes, nr: int, arch: int, args: tuple[int, ...] = (0,) * 6) -> int:
    """Interpret a seccomp cBPF program over ``struct seccomp_data`` (little endian)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    insns = [struct.unpack("<HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    for _ in range(len(insns) + 1):  # no loops in cBPF: every run ends within len(insns)
        code, jt, jf, k = insns[pc]
        pc += 1
        if code == 0x20:  # ld w abs
            acc = struct.unpack_from("<I", data, k)[0]
        elif code == 0x54:  # and k
            acc &= k
        elif code == 0x05:  # ja
            pc += k
        elif code in (0x15, 0x25, 0x35):  # jeq, jgt, jge
            taken = {0x15: acc == k, 0x25: acc > k, 0x35: acc >= k}[code]
            pc += jt if taken else jf
        elif code == 0x06:  # ret k
            return int(k)
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")
    raise AssertionError("program did not return")


@pytest.fixture(scope="module", params=[X86, ARM], ids=["x86_64", "arm64"])
def arch(request: pytest.FixtureRequest) -> int:
    return int(request.param)


def test_every_number_is_allowed_exactly_when_on_the_allow_list(arch: int) -> None:
    table = seccomp.table(arch)
    program = seccomp.build_filter(arch=arch)
    allowed = {n for name in seccomp.ALLOWED_SYSCALLS if (n := table.nr(name)) is not None}
    special = {
        table.nr(name) for name in ("socket", "socketpair", "clone", "clone3", "inotify_add_watch")
    }
    for nr in range(0, 1100):
        if nr in special:
            continue
        verdict = run_bpf(program, nr, arch)
        if nr in allowed:
            assert verdict == ALLOW, (table.name(nr), nr)
        elif table.name(nr) in seccomp.DENIED_SYSCALLS:
            assert verdict == errno_ret(errno.EPERM), (table.name(nr), nr)
        else:
            assert verdict == errno_ret(errno.ENOSYS), (table.name(nr), nr)


def test_python_essentials_are_allowed_on_both_architectures(arch: int) -> None:
    table = seccomp.table(arch)
    program = seccomp.build_filter(arch=arch)
    for name in ("read", "openat", "mmap", "execve", "futex", "exit_group", "rt_sigreturn"):
        nr = table.nr(name)
        assert nr is not None and run_bpf(program, nr, arch) == ALLOW, name


SOCKETS = [
    # (family, type, protocol) -> errno (0: allowed)
    ((1, SOCK_STREAM, 0), 0),  # AF_UNIX
    ((2, SOCK_STREAM, 0), 0),  # AF_INET
    ((10, 2 | 0o2000000, 0), 0),  # AF_INET6, SOCK_DGRAM | SOCK_CLOEXEC
    ((16, 3, 0), 0),  # AF_NETLINK, SOCK_RAW, NETLINK_ROUTE
    ((16, 3, NETLINK_AUDIT), errno.EAFNOSUPPORT),
    ((16, 3, 16), errno.EAFNOSUPPORT),  # NETLINK_GENERIC
    ((AF_VSOCK, SOCK_STREAM, 0), errno.EAFNOSUPPORT),
    ((17, 3, 0), errno.EAFNOSUPPORT),  # AF_PACKET
    ((38, 5, 0), errno.EAFNOSUPPORT),  # AF_ALG
    ((15, 3, 2), errno.EAFNOSUPPORT),  # AF_KEY
    ((31, 1, 0), errno.EAFNOSUPPORT),  # AF_BLUETOOTH
    ((2, 3, 1), errno.EPERM),  # AF_INET, SOCK_RAW
    ((2, SOCK_STREAM, 6), 0),  # IPPROTO_TCP
    ((10, 2, 17), 0),  # AF_INET6, SOCK_DGRAM, IPPROTO_UDP
    # MPTCP connects through the kernel's own sockets (subflows), past the count of ports
    ((2, SOCK_STREAM, 262), errno.EPERM),  # IPPROTO_MPTCP
    # ICMP "ping" sockets send to any address past the egress hooks (where the host's
    # net.ipv4.ping_group_range admits the sandbox's gid, as systemd's default does)
    ((2, 2, 1), errno.EPERM),  # AF_INET, SOCK_DGRAM, IPPROTO_ICMP
    ((10, 2 | 0o2000000, 58), errno.EPERM),  # AF_INET6, SOCK_DGRAM, IPPROTO_ICMPV6
    ((2, SOCK_STREAM, 132), errno.EPERM),  # IPPROTO_SCTP
    ((2, 5, 0), errno.EPERM),  # SOCK_SEQPACKET, protocol 0: SCTP where sctp.ko is loaded
    ((10, 5 | 0o4000, 0), errno.EPERM),  # AF_INET6, SOCK_SEQPACKET | SOCK_NONBLOCK
]


@pytest.mark.parametrize(("args", "refused"), SOCKETS)
def test_socket_families(arch: int, args: tuple[int, int, int], refused: int) -> None:
    nr = seccomp.table(arch).nr("socket")
    assert nr is not None
    expected = ALLOW if refused == 0 else errno_ret(refused)
    assert run_bpf(seccomp.build_filter(arch=arch), nr, arch, args) == expected
    notified = run_bpf(seccomp.build_filter(arch=arch, notify=True), nr, arch, args)
    assert notified == (ALLOW if refused == 0 else NOTIF)
    if refused:  # what the listener answers is what the filter alone returns
        assert seccomp.refusal_errno(nr, args, arch) == refused


def test_socketpair_is_unix_only(arch: int) -> None:
    nr = seccomp.table(arch).nr("socketpair")
    assert nr is not None
    program = seccomp.build_filter(arch=arch)
    assert run_bpf(program, nr, arch, (1, SOCK_STREAM, 0)) == ALLOW
    assert run_bpf(program, nr, arch, (AF_VSOCK, SOCK_STREAM, 0)) == errno_ret(errno.EAFNOSUPPORT)


def test_clone_without_namespaces_only_and_clone3_falls_back(arch: int) -> None:
    table = seccomp.table(arch)
    clone, clone3 = table.nr("clone"), table.nr("clone3")
    assert clone is not None and clone3 is not None
    notify = seccomp.build_filter(arch=arch, notify=True)
    assert run_bpf(notify, clone, arch, (0x3D0F00,)) == ALLOW  # pthread_create's flags
    assert run_bpf(notify, clone, arch, (0x10000000 | 17,)) == NOTIF  # CLONE_NEWUSER
    assert seccomp.refusal_errno(clone, (0x10000000 | 17,), arch) == errno.EPERM
    assert run_bpf(notify, clone3, arch) == errno_ret(errno.ENOSYS)  # silent, not notified


IN_MODIFY, IN_CLOSE_WRITE, IN_CREATE, IN_DELETE, IN_MOVED_TO = 0x2, 0x8, 0x100, 0x200, 0x80


def test_an_inotify_watch_may_follow_changes_but_not_a_files_use(arch: int) -> None:
    """A watch is on the inode: through a read-only view of the shared runtime a sandbox saw
    every neighbour's opens and reads (each module it imported, with the time). Change events
    (what file watchers and reloaders ask for) stay; open, access and close-without-write are
    refused, with every other bit set or not."""
    nr = seccomp.table(arch).nr("inotify_add_watch")
    assert nr is not None
    notify = seccomp.build_filter(arch=arch, notify=True)
    changes = IN_MODIFY | IN_CLOSE_WRITE | IN_CREATE | IN_DELETE | IN_MOVED_TO
    assert run_bpf(notify, nr, arch, (3, 0, changes)) == ALLOW
    assert run_bpf(notify, nr, arch, (3, 0, changes | 0x01000000)) == ALLOW  # IN_ONLYDIR
    for use in (0x1, 0x10, 0x20, 0xFFF):  # IN_ACCESS, IN_CLOSE_NOWRITE, IN_OPEN, IN_ALL_EVENTS
        assert run_bpf(notify, nr, arch, (3, 0, use)) == NOTIF, hex(use)
        assert run_bpf(notify, nr, arch, (3, 0, changes | use)) == NOTIF, hex(use)
        assert seccomp.refusal_errno(nr, (3, 0, use), arch) == errno.EPERM
        alone = seccomp.build_filter(arch=arch)
        assert run_bpf(alone, nr, arch, (3, 0, use)) == errno_ret(errno.EPERM)
    assert seccomp.rule_id(nr, (3, 0, 0x20), arch) == "seccomp.denied"
    assert seccomp.describe(nr, (3, 0, 0x21 | changes), arch) == (
        "inotify_add_watch(IN_ACCESS|IN_OPEN: a file's use, not its change)"
    )


def test_foreign_architecture_and_x32_are_killed() -> None:
    x86, arm = seccomp.build_filter(arch=X86), seccomp.build_filter(arch=ARM)
    assert run_bpf(x86, 0, ARM) == KILL
    assert run_bpf(arm, 63, X86) == KILL
    assert run_bpf(x86, 0, 0x40000003) == KILL  # AUDIT_ARCH_I386
    assert run_bpf(x86, seccomp.X32_SYSCALL_BIT | 0, X86) == KILL  # x32 read


def test_refusals_are_named_and_given_a_rule() -> None:
    t = seccomp.table(X86)
    sock = t.nr("socket")
    assert sock is not None
    assert seccomp.describe(sock, (AF_VSOCK, 1, 0), X86) == "socket(AF_VSOCK)"
    assert (
        seccomp.describe(sock, (16, 3, NETLINK_AUDIT), X86) == "socket(AF_NETLINK, NETLINK_AUDIT)"
    )
    assert seccomp.rule_id(sock, (AF_VSOCK, 1, 0), X86) == "seccomp.socket-family"
    assert seccomp.rule_id(sock, (2, 3, 1), X86) == "seccomp.denied"
    assert seccomp.describe(sock, (2, 3, 1), X86) == "socket(AF_INET, SOCK_RAW)"
    assert seccomp.describe(sock, (2, 2, 1), X86) == "socket(AF_INET, IPPROTO_ICMP)"
    assert seccomp.rule_id(sock, (10, 2, 58), X86) == "seccomp.denied"
    assert seccomp.describe(sock, (2, 5, 0), X86) == "socket(AF_INET, SOCK_SEQPACKET)"
    assert seccomp.rule_id(101, (16, 1), X86) == "seccomp.denied"  # ptrace
    assert seccomp.describe(135, (0,), X86) == "personality"
    unlisted = 134  # uselib: denied by name; 212 lookup_dcookie likewise
    assert seccomp.refusal_errno(unlisted, (0,), X86) == errno.EPERM
    assert seccomp.rule_id(999, (0,), X86) == "seccomp.not-allowed"
    assert seccomp.refusal_errno(999, (0,), X86) == errno.ENOSYS
    assert seccomp.describe(999, (0,), X86) == "syscall 999"
    arm_sock = seccomp.table(ARM).nr("socket")
    assert arm_sock == 198
    assert seccomp.describe(198, (AF_VSOCK, 1, 0), ARM) == "socket(AF_VSOCK)"


def test_the_pre_exec_stage_numbers_match_libseccomp_on_both_architectures() -> None:
    # syscalls.py carries the few numbers the pre-exec stage calls itself, for both machines.
    x86, arm = seccomp.table(X86), seccomp.table(ARM)
    assert (x86.nr("pivot_root"), arm.nr("pivot_root")) == (155, 41)
    assert (x86.nr("seccomp"), arm.nr("seccomp")) == (317, 277)
    for name, number in (
        ("landlock_create_ruleset", 444),
        ("landlock_add_rule", 445),
        ("landlock_restrict_self", 446),
        ("pidfd_getfd", 438),
    ):
        assert x86.nr(name) == arm.nr(name) == number, name
