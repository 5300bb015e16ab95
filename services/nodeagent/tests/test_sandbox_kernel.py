"""The kernel refuses what a spec does not grant — each probe runs inside a real sandbox (root).

One probe sandbox runs every escape attempt and every permitted action and prints what it saw;
each test asserts one line of that report, as the user would read it (errno names).
"""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the test kit
from _dsec_sandbox_testkit import (
    Recorder,
    leftover_cgroups,
    managed,
    read_json_output,
    run_to_end,
    snippet_config,
)

from dsec_nodeagent.sandbox import (
    ExitReason,
    Limits,
    Mount,
    SandboxManager,
    SandboxStartError,
    seccomp,
)
from dsec_nodeagent.sandbox.notify import KernelRefusal
from dsec_nodeagent.sandbox.state import is_alive

pytestmark = [pytest.mark.kernel]

PROBE = r"""
import ctypes, errno, json, os, socket, subprocess, sys, threading

libc = ctypes.CDLL(None, use_errno=True)
results = {}

def probe(name, fn):
    try:
        fn()
        results[name] = "ok"
    except OSError as exc:
        results[name] = errno.errorcode.get(exc.errno, str(exc)) if exc.errno else str(exc)

def raw(result):
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))

def syscall(nr, *args):
    raw(libc.syscall(nr, *args))

# permitted actions, same sandbox
probe("write_output", lambda: open("/workspace/output/result.txt", "w").write("done"))
probe("read_input", lambda: open("/workspace/data/input.txt").read())
probe("write_tmp", lambda: open("/tmp/scratch", "w").write("x"))
probe("read_own_environ", lambda: open("/proc/self/environ", "rb").read())
probe("tcp_socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM).close())
probe("thread", lambda: [t := threading.Thread(target=lambda: None), t.start(), t.join()])
def child():
    out = subprocess.run([sys.executable, "-c", "print(6*7)"], capture_output=True, text=True)
    assert out.stdout.strip() == "42", out
probe("subprocess", child)

# filesystem
probe("write_rw_mount_not_allowed", lambda: open("/workspace/scratch/x", "w"))
probe("write_ro_mount", lambda: open("/workspace/data/new.txt", "w"))
def read_submount():  # a mount below a bind's source comes along with it ...
    if open("/workspace/data/inner/hello.txt").read() != "below":
        raise OSError(0, "the mount below /workspace/data is not visible")
probe("read_submount", read_submount)
probe("write_ro_submount", lambda: open("/workspace/data/inner/new.txt", "w"))  # ... read-only
probe("write_code", lambda: open("/workspace/code/evil.py", "w"))
probe("write_root", lambda: open("/evil", "w"))
probe("read_private_mount", lambda: open("/workspace/private/secret.txt").read())
os.symlink("/workspace/private/secret.txt", "/workspace/output/link")
probe("read_via_symlink", lambda: open("/workspace/output/link").read())
probe("read_host_shadow", lambda: open("/etc/shadow").read())
probe("list_root", lambda: os.listdir("/"))
def ctypes_open():
    fd = libc.open(b"/workspace/private/secret.txt", os.O_RDONLY)
    raw(fd)
probe("ctypes_read_private", ctypes_open)
probe("proc_sys_write", lambda: open("/proc/sys/kernel/hostname", "w").write("x"))
probe("init_environ", lambda: open("/proc/1/environ", "rb").read())
other = os.environ.get("OTHER_PID")
if other:
    probe("other_sandbox_environ", lambda: open(f"/proc/{other}/environ", "rb").read())

# system calls
probe("ptrace", lambda: raw(libc.ptrace(16, 1, 0, 0)))          # PTRACE_ATTACH to init
probe("mount", lambda: raw(libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 0, None)))
probe("umount", lambda: raw(libc.umount2(b"/proc", 2)))
probe("bpf", lambda: syscall(321, 0, 0, 0))
probe("unshare_user", lambda: raw(libc.unshare(0x10000000)))
probe("unshare_net", lambda: raw(libc.unshare(0x40000000)))
probe("setns", lambda: raw(libc.setns(0, 0)))
probe("io_uring", lambda: syscall(425, 8, ctypes.create_string_buffer(120)))
probe("perf_event_open", lambda: syscall(298, 0, 0, -1, -1, 0))
probe("keyctl", lambda: syscall(250, 0, 0, 0, 0))
probe("kexec", lambda: syscall(246, 0, 0, 0, 0))
probe("process_vm_readv", lambda: syscall(310, 1, 0, 0, 0, 0, 0))
probe("raw_socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
probe("ping_socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP))
probe("packet_socket", lambda: socket.socket(17, socket.SOCK_RAW, 0))
probe("vsock_socket", lambda: socket.socket(40, socket.SOCK_STREAM))           # AF_VSOCK
probe("netlink_audit", lambda: socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 9))
probe("sysfs", lambda: syscall(139, 3))                            # not on the allow-list
def netlink_route():
    import struct
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0) as nl:  # NETLINK_ROUTE
        nl.bind((0, 0))
        nl.send(struct.pack("=LHHLLB3x", 20, 18, 0x301, 1, 0, 0))  # RTM_GETLINK, dump
        assert nl.recv(65536)
probe("netlink_route", netlink_route)
probe("unix_socket", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).close())
probe("inet6_socket", lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM).close())
probe("unix_socketpair", lambda: [s.close() for s in socket.socketpair()])
probe("sethostname", lambda: raw(libc.sethostname(b"x", 1)))
probe("setuid_root", lambda: os.setuid(0))
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def probe_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the probe sandbox once (and a second sandbox whose environ it tries to read)."""
    tmp = tmp_path_factory.mktemp("probe")

    data = tmp / "data"
    data.mkdir()
    (data / "input.txt").write_text("input")
    inner = data / "inner"  # a host mount below a read-only bind's source
    inner.mkdir()

    async def run() -> dict[str, Any]:
        private = tmp / "private"
        private.mkdir()
        (private / "secret.txt").write_text("top secret")
        scratch = tmp / "scratch"
        scratch.mkdir()
        os.chmod(scratch, 0o777)
        refusals: list[KernelRefusal] = []

        async def on_kernel_refusal(refusal: KernelRefusal) -> None:
            refusals.append(refusal)

        async with managed(tmp / "home", on_kernel_refusal=on_kernel_refusal) as manager:
            # mounted once the node is up (whatever it made ahead), as a volume would be
            mount = await asyncio.create_subprocess_exec(
                "mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(inner)
            )
            assert await mount.wait() == 0
            (inner / "hello.txt").write_text("below")
            other = await manager.launch(
                snippet_config(
                    "probe-other",
                    "import time\ntime.sleep(60)\n",
                    tmp,
                    env={"OTHER_SECRET": "s3cr3t"},
                )
            )
            config = snippet_config(
                "probe-main",
                PROBE,
                tmp,
                mounts=[
                    Mount(source=data, target="/workspace/data"),
                    Mount(source=private, target="/workspace/private"),
                    Mount(source=scratch, target="/workspace/scratch", read_only=False),
                ],
                read_allowed=["/workspace/data", "/workspace/scratch"],
                env={"OTHER_PID": str(other.pid)},
                limits=Limits(memory_bytes=512 << 20, pids=64),
            )
            result = await run_to_end(manager, config)
            report = read_json_output(result)
            report["_exit"] = result.reason.value
            # Every refusal was handled before the exit was reported: no waiting needed.
            report["_refusals"] = Counter(
                r.syscall for r in refusals if r.sandbox_id == "probe-main"
            )
            report["_answers"] = {
                r.syscall: (r.rule_id, r.errno_name)
                for r in refusals
                if r.sandbox_id == "probe-main"
            }
            report["_refusal_pids"] = {r.pid for r in refusals}
            report["_other_refusals"] = [r for r in refusals if r.sandbox_id != "probe-main"]
            report["_output_file"] = (
                tmp
                / "home"
                / "sandboxes"
                / "probe-main"
                / "fs"
                / "workspace__output"
                / "result.txt"
            ).read_text()
            return report

    try:
        return _run_sync(run)
    finally:
        subprocess.run(["umount", "-l", str(inner)], check=False)  # unless the mount failed


def _run_sync(factory: Any) -> dict[str, Any]:
    loop = asyncio.new_event_loop()
    try:
        result: dict[str, Any] = loop.run_until_complete(factory())
        return result
    finally:
        loop.close()


PERMITTED = [
    "netlink_route",
    "unix_socket",
    "inet6_socket",
    "unix_socketpair",
    "write_output",
    "read_input",
    "read_submount",
    "write_tmp",
    "read_own_environ",
    "tcp_socket",
    "thread",
    "subprocess",
]


@pytest.mark.parametrize("action", PERMITTED)
def test_permitted_action_works_in_the_same_sandbox(
    probe_report: dict[str, Any], action: str
) -> None:
    assert probe_report[action] == "ok"


def test_the_probe_sandbox_exits_ok_and_its_output_stays_on_the_host(
    probe_report: dict[str, Any],
) -> None:
    assert probe_report["_exit"] == "ok"
    assert probe_report["_output_file"] == "done"


@pytest.mark.parametrize(
    ("action", "errno_name"),
    [
        ("write_rw_mount_not_allowed", "EACCES"),  # Landlock: writable mount, not write_allowed
        ("write_ro_mount", "EROFS"),
        ("write_ro_submount", "EROFS"),  # the whole bind is read-only, not just its top mount
        ("write_code", "EROFS"),
        ("write_root", "EROFS"),
        ("read_private_mount", "EACCES"),  # Landlock: mounted but not read_allowed
        ("read_via_symlink", "EACCES"),
        ("ctypes_read_private", "EACCES"),  # no semantic layer involved: the kernel refuses
        ("read_host_shadow", "ENOENT"),  # not in the root view at all
        ("list_root", "EACCES"),
        ("proc_sys_write", "EROFS"),
        ("init_environ", "EACCES"),
        ("other_sandbox_environ", "ENOENT"),  # another pid namespace: the pid does not exist
    ],
)
def test_filesystem_escape_is_refused(
    probe_report: dict[str, Any], action: str, errno_name: str
) -> None:
    assert probe_report[action] == errno_name


@pytest.mark.parametrize(
    "action",
    [
        "ptrace",
        "mount",
        "umount",
        "bpf",
        "unshare_user",
        "unshare_net",
        "setns",
        "io_uring",
        "perf_event_open",
        "keyctl",
        "kexec",
        "process_vm_readv",
        "raw_socket",
        "ping_socket",
        "sethostname",
        "setuid_root",
    ],
)
def test_dangerous_system_call_gets_eperm(probe_report: dict[str, Any], action: str) -> None:
    assert probe_report[action] == "EPERM"


# probe -> (what the refusal names, how many attempts the probe makes)
KERNEL_REFUSALS = {
    "ptrace": ("ptrace", 1),
    "mount": ("mount", 1),
    "umount": ("umount2", 1),
    "bpf": ("bpf", 1),
    "unshare_user": ("unshare", 2),  # with unshare_net: two attempts
    "setns": ("setns", 1),
    "io_uring": ("io_uring_setup", 1),
    "perf_event_open": ("perf_event_open", 1),
    "keyctl": ("keyctl", 1),
    "kexec": ("kexec_load", 1),
    "process_vm_readv": ("process_vm_readv", 1),
    "raw_socket": ("socket(AF_INET, SOCK_RAW)", 1),
    "ping_socket": ("socket(AF_INET, IPPROTO_ICMP)", 1),
    "packet_socket": ("socket(AF_PACKET)", 1),
    "vsock_socket": ("socket(AF_VSOCK)", 1),
    "netlink_audit": ("socket(AF_NETLINK, NETLINK_AUDIT)", 1),
    "sysfs": ("sysfs", 1),
    "sethostname": ("sethostname", 1),
}
# probe -> (the errno the workload sees, the rule the refusal reports)
ANSWERS = {
    "packet_socket": ("EAFNOSUPPORT", "seccomp.socket-family"),
    "vsock_socket": ("EAFNOSUPPORT", "seccomp.socket-family"),
    "netlink_audit": ("EAFNOSUPPORT", "seccomp.socket-family"),
    "sysfs": ("ENOSYS", "seccomp.not-allowed"),
}


@pytest.mark.parametrize("action", sorted(KERNEL_REFUSALS))
def test_denied_system_call_is_reported_once_per_attempt(
    probe_report: dict[str, Any], action: str
) -> None:
    syscall, attempts = KERNEL_REFUSALS[action]
    errno_name, rule = ANSWERS.get(action, ("EPERM", "seccomp.denied"))
    assert probe_report[action] == errno_name
    assert probe_report["_refusals"][syscall] == attempts
    assert probe_report["_answers"][syscall] == (rule, errno_name)


def test_only_the_denied_calls_are_reported(probe_report: dict[str, Any]) -> None:
    # Permitted actions, interpreter start-up, threads and subprocesses report nothing: the
    # allow-list holds everything they need.
    assert probe_report["_refusals"] == Counter(dict(KERNEL_REFUSALS.values()))
    assert probe_report["_other_refusals"] == []
    assert 0 not in probe_report["_refusal_pids"]


def test_denied_call_fails_with_enosys_when_no_listener_remains() -> None:
    # Fail-closed: a notifying filter whose listener is closed still refuses (the kernel's
    # ENOSYS), while a permitted call goes through.
    code = (
        "import ctypes, os\n"
        "from dsec_nodeagent.sandbox import seccomp, syscalls\n"
        "syscalls.prctl(syscalls.PR_SET_NO_NEW_PRIVS, 1)\n"
        "os.close(seccomp.install(seccomp.build_filter(notify=True), listener=True))\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.ptrace(0, 0, 0, 0), ctypes.get_errno(), os.getpid() > 0)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=True
    )
    assert out.stdout.split() == ["-1", str(errno.ENOSYS), "True"]


@pytest.mark.unit
def test_refused_calls_are_named_from_their_registers() -> None:
    assert seccomp.describe(101, (16, 1, 0, 0, 0, 0)) == "ptrace"
    assert seccomp.describe(41, (17, 3, 0, 0, 0, 0)) == "socket(AF_PACKET)"
    assert seccomp.describe(41, (10, 3 | 0o2000000, 0, 0, 0, 0)) == "socket(AF_INET6, SOCK_RAW)"
    assert seccomp.describe(56, (0x10000000 | 17, 0, 0, 0, 0, 0)) == "clone(CLONE_NEWUSER)"
    assert seccomp.describe(9999, (0,) * 6) == "syscall 9999"


async def test_fork_bomb_ends_with_reason_pids(tmp_path: Path) -> None:
    code = "import os\nwhile True:\n    os.fork()\n"
    async with managed(tmp_path / "home") as manager:
        result = await run_to_end(
            manager,
            snippet_config("forkbomb", code, tmp_path, limits=Limits(pids=32), timeout_s=30),
        )
    assert result.reason is ExitReason.PIDS
    assert result.pids_limit_hits > 0
    assert "pids limit" in result.detail


async def test_memory_bomb_ends_with_reason_oom(tmp_path: Path) -> None:
    code = "blocks = []\nwhile True:\n    blocks.append(bytearray(16 << 20))\n"
    async with managed(tmp_path / "home") as manager:
        result = await run_to_end(
            manager,
            snippet_config(
                "membomb", code, tmp_path, limits=Limits(memory_bytes=96 << 20), timeout_s=30
            ),
        )
    assert result.reason is ExitReason.OOM
    assert result.oom_kills >= 1
    assert result.signal == 9


async def test_ready_reports_every_layer_and_the_cgroup_for_ebpf(tmp_path: Path) -> None:
    hooked: list[tuple[str, Path, int, list[int]]] = []

    async def attach_egress(sid: str, cgroup_dir: Path, cgroup_id: int) -> None:
        procs = [int(p) for p in (cgroup_dir / "cgroup.procs").read_text().split()]
        hooked.append((sid, cgroup_dir, cgroup_id, procs))

    async with managed(tmp_path / "home") as manager:
        ready = await manager.launch(
            snippet_config("layers", "print('hi')", tmp_path), before_start=attach_egress
        )
        assert hooked == [("layers", Path(ready.cgroup_path), ready.cgroup_id, [])]
        # under the node's own cgroup parent (several node agents may share one machine)
        assert Path(ready.cgroup_path) == Path("/sys/fs/cgroup/unified/dsec/node-1/layers")
        assert os.stat(ready.cgroup_path).st_ino == ready.cgroup_id
        result = await manager.wait("layers")
    assert set(ready.timings_ms) == {
        "plan",
        "cgroup",
        "spawn",
        "fork",
        "cgroup_join",
        "namespaces",
        "mounts",
        "credentials",
        "landlock",
        "seccomp",
        "exec",
    }
    assert result.reason is ExitReason.OK
    assert Path(result.stdout_path).read_text() == "hi\n"
    assert leftover_cgroups(["layers"]) == []


async def test_exec_joins_the_running_sandbox_with_its_confinement(tmp_path: Path) -> None:
    private = tmp_path / "private"
    private.mkdir()
    (private / "secret.txt").write_text("x")
    async with managed(tmp_path / "home") as manager:
        ready = await manager.launch(
            snippet_config(
                "execme",
                "import time\ntime.sleep(60)\n",
                tmp_path,
                mounts=[Mount(source=private, target="/workspace/private")],
            )
        )
        out_r, out_w = os.pipe()
        code = await manager.exec(
            "execme",
            [
                "python",
                "-c",
                "import os, socket\n"
                "print(os.getuid(), socket.gethostname(),\n"
                "      open('/proc/1/cmdline','rb').read()[:6])\n"
                "try:\n open('/workspace/private/secret.txt')\n"
                "except PermissionError as e:\n print('refused', e.errno)\n",
            ],
            stdout=out_w,
        )
        os.close(out_w)
        output = os.read(out_r, 4096).decode()
        os.close(out_r)
        stopped = await manager.stop("execme", grace_s=2)
    assert code == 0
    uid, hostname, *_ = output.split()
    assert int(uid) == ready.uid
    assert hostname == "execme"
    assert f"refused {errno.EACCES}" in output
    assert stopped.reason is ExitReason.STOPPED


async def test_timeout_stops_the_sandbox_with_reason_timeout(tmp_path: Path) -> None:
    async with managed(tmp_path / "home") as manager:
        result = await run_to_end(
            manager,
            snippet_config("sleepy", "import time\ntime.sleep(60)\n", tmp_path, timeout_s=0.5),
        )
    assert result.reason is ExitReason.TIMEOUT


async def test_start_failure_names_the_stage_and_leaves_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    async with managed(home) as manager:
        config = snippet_config("broken", "", tmp_path, argv=["/no/such/binary"])
        with pytest.raises(SandboxStartError) as info:
            await manager.launch(config)
    assert info.value.stage == "exec"
    assert "/no/such/binary" in str(info.value)
    assert leftover_cgroups(["broken"]) == []
    assert not (home / "run" / "sandboxes" / "broken.json").exists()


async def test_restart_readopts_running_and_cleans_up_ended_sandboxes(tmp_path: Path) -> None:
    home = tmp_path / "home"
    recorder = Recorder()
    first = SandboxManager(home)
    try:
        await first.launch(snippet_config("keeper", "import time\ntime.sleep(60)\n", tmp_path))
        await first.launch(snippet_config("quick", "print('bye')", tmp_path))
        supervisor = first.states.read("quick")["supervisor_pid"]  # type: ignore[index]
        await first.shutdown()  # the node agent "dies": sandboxes keep running
        await _wait_gone(supervisor)
        async with managed(home, recorder) as second:
            report = await second.reconcile()
            assert report.adopted == ["keeper"]
            assert [(r.sandbox_id, r.reason) for r in report.cleaned] == [("quick", ExitReason.OK)]
            stopped = await second.stop("keeper", grace_s=2)
            assert stopped.reason is ExitReason.STOPPED
    finally:
        await first.shutdown()
    assert leftover_cgroups(["keeper", "quick"]) == []


async def _wait_gone(pid: int, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while is_alive(pid, None) and loop.time() < deadline:
        await asyncio.sleep(0.02)


async def test_logs_can_be_followed_until_exit_and_are_kept_after(tmp_path: Path) -> None:
    code = (
        "import time\nfor i in range(3):\n    print('line', i, flush=True)\n    time.sleep(0.1)\n"
    )
    async with managed(tmp_path / "home") as manager:
        await manager.launch(snippet_config("talker", code, tmp_path))
        lines = [line async for line in manager.follow_logs("talker")]
        result = await manager.wait("talker")
        kept = [line async for line in manager.follow_logs("talker", follow=False)]
    assert lines == kept == ["line 0\n", "line 1\n", "line 2\n"]
    assert result.reason is ExitReason.OK


async def test_readopted_sandbox_still_gets_eperm_and_its_refusals_are_reported(
    tmp_path: Path,
) -> None:
    # The supervisor keeps the seccomp listener: a call made while no node agent runs waits for
    # the next one, which answers EPERM and reports it.
    code = (
        "import ctypes, os, time\n"
        "deadline = time.monotonic() + 30\n"
        "while not os.path.exists('/workspace/output/go') and time.monotonic() < deadline:\n"
        "    time.sleep(0.01)\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.ptrace(16, 1, 0, 0), ctypes.get_errno(), flush=True)\n"
    )
    home = tmp_path / "home"
    first_seen: list[KernelRefusal] = []
    second_seen: list[KernelRefusal] = []

    async def first_report(refusal: KernelRefusal) -> None:
        first_seen.append(refusal)

    async def second_report(refusal: KernelRefusal) -> None:
        second_seen.append(refusal)

    first = SandboxManager(home, on_kernel_refusal=first_report)
    try:
        await first.launch(snippet_config("readopt", code, tmp_path))
        await first.shutdown()  # the node agent "dies"; the sandbox keeps running
        (home / "sandboxes" / "readopt" / "fs" / "workspace__output" / "go").write_text("")
        async with managed(home, on_kernel_refusal=second_report) as second:
            assert (await second.reconcile()).adopted == ["readopt"]
            result = await asyncio.wait_for(second.wait("readopt"), 60)
    finally:
        await first.shutdown()
    assert result.reason is ExitReason.OK
    assert Path(result.stdout_path).read_text().split() == ["-1", str(errno.EPERM)]
    assert first_seen == []
    assert [(r.sandbox_id, r.syscall) for r in second_seen] == [("readopt", "ptrace")]


async def test_a_link_in_a_bound_tree_is_never_followed_by_the_pre_exec_stage(
    tmp_path: Path,
) -> None:
    # The node agent refuses this before launch (agent._mountpoints); here the pre-exec stage
    # itself, root before pivot_root, meets a code tree whose `out` links to a host directory
    # and a writable path below it: it refuses instead of creating (and mounting on) host/x.
    host_dir = tmp_path / "host-dir"
    (host_dir / "x").mkdir(parents=True)  # exists, so the plan's overlap check lets it through
    home = tmp_path / "home"
    async with managed(home) as manager:
        config = snippet_config(
            "linked", "print('never')", tmp_path, write_allowed=["/tmp", "/workspace/code/out/x"]
        )
        assert config.code_dir is not None
        (config.code_dir / "out").symlink_to(host_dir)
        with pytest.raises(SandboxStartError) as info:
            await manager.launch(config)
    assert "/workspace/code/out is a symlink or not a directory; not followed" in str(info.value)
    assert info.value.stage == "init"
    assert [p.name for p in host_dir.iterdir()] == ["x"] and list((host_dir / "x").iterdir()) == []
    assert leftover_cgroups(["linked"]) == []


def test_mounts_below_a_path_are_found_with_odd_names(tmp_path: Path) -> None:
    # The fallback for kernels without mount_setattr remounts each of these read-only.
    from dsec_nodeagent.sandbox import syscalls

    odd = tmp_path / "a b\tc" / "deeper"
    odd.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(odd)], check=True)
    try:
        assert syscalls.mounts_below(str(tmp_path)) == [str(odd)]
        assert syscalls.mounts_below(str(odd)) == []
    finally:
        subprocess.run(["umount", "-l", str(odd)], check=True)


_FALLBACK_BIND = r"""
import errno, os, sys
from dsec_nodeagent.sandbox import init, syscalls

def no_mount_setattr(target, attrs):
    raise OSError(errno.ENOSYS, "mount_setattr: not on this kernel")

if sys.argv[1] == "fallback":
    syscalls.mount_setattr_recursive = no_mount_setattr
src, dst = sys.argv[2], sys.argv[3]
os.makedirs(dst)
init._bind(src, dst, ro=False)
try:
    open(os.path.join(dst, "inner", "new.txt"), "w").close()
    print("writable")
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""


@pytest.mark.parametrize("kernel", ["mount_setattr", "fallback"])
def test_a_writable_bind_keeps_a_read_only_mount_below_its_source_read_only(
    tmp_path: Path, kernel: str
) -> None:
    # The host made a mount below the source read-only (per mount, its filesystem writable):
    # binding the source writable must not lift that, with mount_setattr (5.12+) or without.
    src = tmp_path / "src"
    (src / "inner").mkdir(parents=True)
    script = (
        f"mount -t tmpfs -o size=1m tmpfs {src}/inner && "
        f"mount -o remount,bind,ro {src}/inner && "
        f"{sys.executable} -c '{_FALLBACK_BIND}' {kernel} {src} {tmp_path}/dst"
    )
    done = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "EROFS"
