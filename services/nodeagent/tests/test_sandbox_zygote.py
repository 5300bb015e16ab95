"""Sandboxes forked by the pre-forked launcher (the zygote) keep every layer and inherit nothing
of the node agent; a dead zygote is replaced at the next launch (root, real kernel).

The probe tests of ``test_sandbox_kernel.py`` run through the zygote too (it is the default);
these check what the zygote could add: fds, environment and state of the node agent or of the
zygote leaking into a sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import marshal
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the test kit
from _dsec_sandbox_testkit import managed, read_json_output, run_to_end, snippet_config

from dsec_nodeagent.sandbox import (
    ExitReason,
    Limits,
    SandboxConfig,
    SandboxManager,
    init,
    syscalls,
)
from dsec_nodeagent.sandbox.models import Mount
from dsec_nodeagent.sandbox.zygote import PendingFork

pytestmark = [pytest.mark.kernel]

PROBE = r"""
import json, locale, os
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return line.split(":", 1)[1].strip()
def can_read(path):
    try:
        open(path, "rb").close()
        return "yes"
    except OSError as exc:
        return type(exc).__name__
fds = sorted(int(fd) for fd in os.listdir("/proc/self/fd"))
print(json.dumps({
    "fd_targets": {str(fd): os.readlink(f"/proc/self/fd/{fd}") for fd in fds if fd > 2
                   and os.path.exists(f"/proc/self/fd/{fd}")},
    "token": os.environ.get("DSEC_TEST_AGENT_TOKEN"),
    "host_file": can_read(os.environ["HOST_FILE"]),
    "etc_shadow": can_read("/etc/shadow"),
    "seccomp": status("Seccomp"),
    "no_new_privs": status("NoNewPrivs"),
    "cap_eff": status("CapEff"),
    "uid": os.getuid(),
    "cgroup": open("/proc/self/cgroup").read(),
    "ctype": locale.setlocale(locale.LC_CTYPE, ""),
    "dev": sorted(os.listdir("/dev")),
    "nodes": {n: [os.stat("/dev/" + n).st_rdev, os.stat("/dev/" + n).st_mode]
              for n in ("null", "zero", "full", "random", "urandom", "tty")},
    "io": [open("/dev/null", "wb").write(b"x"), len(open("/dev/urandom", "rb").read(16)),
           open("/dev/zero", "rb").read(4).hex()],
}), flush=True)
"""


def _socket_inodes(pid: int) -> set[str]:
    found = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:
            continue
        if target.startswith("socket:"):
            found.add(target)
    return found


def _parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("PPid:"):
                return int(line.split()[1])
    raise AssertionError(f"no PPid for {pid}")


async def _output(path: Path, text: str = "", timeout_s: float = 60.0) -> str:
    """The log at ``path`` once it holds ``text`` (any output: ``""``), or at the timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = path.read_text()
        if out.strip() and text in out:
            return out
        await asyncio.sleep(0.05)
    return path.read_text()


async def test_a_zygote_sandbox_keeps_every_layer_and_inherits_nothing_of_the_agent(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = tmp_path / "agent-secret.txt"
    secret.write_text("the node agent's secret")
    leaked = os.open(secret, os.O_RDONLY)  # an fd of the node agent a child could inherit
    os.set_inheritable(leaked, True)
    monkeypatch.setenv("DSEC_TEST_AGENT_TOKEN", "agent-token")
    host_file = tmp_path / "host-only.txt"
    host_file.write_text("host")
    try:
        async with managed(tmp_path / "home") as manager:
            assert manager.zygote is not None
            await manager.launch(
                snippet_config(
                    "zyg-probe",
                    PROBE + "import time; time.sleep(60)\n",
                    tmp_path,
                    env={"HOST_FILE": str(host_file)},
                )
            )
            zygote_pid = manager.zygote.pid
            assert zygote_pid is not None
            state = manager.states.read("zyg-probe")
            assert state is not None
            supervisor, init = state["supervisor_pid"], state["init_pid"]
            assert _parent_of(supervisor) == zygote_pid  # forked by the zygote, not spawned
            # Neither the supervisor nor pid 1 of the sandbox holds the zygote's control socket.
            control = _socket_inodes(zygote_pid)
            assert control
            assert not control & _socket_inodes(supervisor)
            assert not control & _socket_inodes(init)
            for pid in (supervisor, init):
                targets = {
                    os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")
                }
                assert str(secret) not in targets
            stdout = Path(manager.log_paths("zyg-probe")[0])
            await _output(stdout)
            result = await manager.stop("zyg-probe", grace_s=1.0)
    finally:
        os.close(leaked)
    assert result.reason is ExitReason.STOPPED
    report = read_json_output(result)
    assert report["fd_targets"] == {}  # 0-2 only (the listing's own fd is gone by then)
    assert report["token"] is None
    assert report["host_file"] == "FileNotFoundError"  # not in its root view at all
    assert report["etc_shadow"] in ("FileNotFoundError", "PermissionError")
    assert report["seccomp"] == "2"  # filter mode
    assert report["no_new_privs"] == "1"
    assert int(report["cap_eff"], 16) == 0
    assert report["uid"] != 0
    assert "/dsec/node-1/zyg-probe" in report["cgroup"]
    # its /dev: the standard nodes (the host's device numbers and modes), nothing else of it
    nodes = ["null", "zero", "full", "random", "urandom", "tty"]
    assert report["dev"] == sorted([*nodes, "fd", "stdin", "stdout", "stderr", "shm"])
    for name, (rdev, mode) in report["nodes"].items():
        host = os.stat(f"/dev/{name}")
        assert (rdev, mode) == (host.st_rdev, host.st_mode), name
    assert report["io"] == [1, 16, "00000000"]
    if os.path.isdir("/usr/lib/locale/C.utf8"):  # the LANG it is given exists in its view
        assert report["ctype"] == "C.UTF-8"


def _memory_holds(pid: int, needle: bytes) -> bool:
    """Whether any readable private mapping of ``pid`` holds ``needle`` (root reads any)."""
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
        for line in maps:
            fields = line.split()
            if not fields[1].startswith("r") or (len(fields) > 5 and fields[5].startswith("/")):
                continue  # unreadable, or a file's mapping (code, not data)
            start, end = (int(x, 16) for x in fields[0].split("-"))
            try:
                mem.seek(start)
                if needle in mem.read(end - start):
                    return True
            except OSError:  # [vvar] and the like
                continue
    return False


async def test_a_sandboxs_supervisor_never_holds_its_secrets(tmp_path: Path) -> None:
    # The supervisor (outside the sandbox, alive for its whole life) gets only what it uses of
    # the plan: where the logs and the outcome go, what to reap. Not the environment.
    secret = "s3cr3t-" + os.urandom(8).hex()
    async with managed(tmp_path / "home") as manager:
        await manager.launch(
            snippet_config(
                "zyg-secret",
                "import os, time; print(len(os.environ['API_KEY']), flush=True); time.sleep(60)\n",
                tmp_path,
                secret_env={"API_KEY": secret},
            )
        )
        state = manager.states.read("zyg-secret")
        assert state is not None
        stdout = Path(manager.log_paths("zyg-secret")[0])
        assert (await _output(stdout)).strip() == str(len(secret))  # the workload has it
        assert not _memory_holds(state["supervisor_pid"], secret.encode())
        await manager.stop("zyg-secret", grace_s=0.5)


async def test_sandboxes_run_on_every_cpu_the_node_agent_may_use(tmp_path: Path) -> None:
    # The launch keeps init off the node agent's CPU for one wake-up, and init keeps the
    # workload's process off its own for another (cpuhint.elsewhere, both); each widens its
    # mask again as it wakes. A shell made ahead copies its pages at SCHED_IDLE
    # while it waits (init._prefault); its waker sets it back. No process of the sandbox keeps
    # a narrowed mask or the idle policy: the first launch (its init forked at the launch) and
    # the next ones (init forked ahead) alike.
    cpus = sorted(os.sched_getaffinity(0))
    code = (
        "import json, os\n"
        "print(json.dumps([sorted(os.sched_getaffinity(0)), os.sched_getscheduler(0)]),"
        " flush=True)\n"
    )
    async with managed(tmp_path / "home") as manager:
        for index in range(3):
            sid = f"zyg-cpus-{index}"
            await manager.launch(
                snippet_config(sid, code + "import time; time.sleep(60)\n", tmp_path)
            )
            state = manager.states.read(sid)
            assert state is not None
            assert sorted(os.sched_getaffinity(state["init_pid"])) == cpus
            for pid in (state["init_pid"], state["supervisor_pid"]):
                assert os.sched_getscheduler(pid) == os.SCHED_OTHER
            stdout = Path(manager.log_paths(sid)[0])
            assert json.loads(await _output(stdout)) == [cpus, os.SCHED_OTHER]
            await manager.stop(sid, grace_s=0.5)
            await manager.settle()  # the next launch takes the shell forked ahead


def _in_child(work: Callable[[], Any]) -> Any:
    """``work()`` in a child forked from this process (which keeps this one's memory shared
    copy-on-write); its result, through JSON."""
    out_r, out_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(out_r)
            os.write(out_w, json.dumps(work()).encode())
        finally:
            os._exit(0)
    os.close(out_w)
    chunks = []
    while chunk := os.read(out_r, 4096):
        chunks.append(chunk)
    os.close(out_r)
    os.waitpid(pid, 0)
    return json.loads(b"".join(chunks))


def _faults_writing(
    data: mmap.mmap, prefault: bool, wake: bool, uid: int | None = None, policy: int | None = None
) -> tuple[int, int]:
    """In a child forked now (as ``uid``, at ``policy``): ``init._prefault`` on a pipe (with a
    byte in it: ``wake``), then one write to every page of ``data`` (the parent's, shared
    copy-on-write); ``(the minor faults those writes took, the child's scheduling policy
    after _prefault)``."""
    import resource

    from dsec_nodeagent.sandbox import init

    wake_r, wake_w = os.pipe()
    if wake:
        os.write(wake_w, b"m")

    def work() -> tuple[int, int]:
        if policy is not None:
            os.sched_setscheduler(0, policy, os.sched_param(0))
        if uid is not None:
            os.setuid(uid)  # (no capability left: CAP_SYS_NICE neither)
        if prefault:
            init._prefault(wake_r)
        after = os.sched_getscheduler(0)
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for offset in range(0, len(data), 4096):
            data[offset] = 7
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, after

    try:
        faults, after = _in_child(work)
    finally:
        os.close(wake_r)
        os.close(wake_w)
    return faults, after


def test_a_process_made_ahead_copies_its_shared_pages_while_it_waits() -> None:
    # 16 MiB of the parent's memory in a private mapping of its own (malloc could put a block
    # this large in the heap, which after a long test session is larger than what is copied),
    # shared copy-on-write with a child: every page the child writes first is a fault, unless
    # the child copied it while it waited. Once its wake-up word is there, it copies nothing
    # more. It copies at SCHED_IDLE, and only where it may leave it again (CAP_SYS_NICE); its
    # policy is then put back as it was (the operator's, not always SCHED_OTHER).
    data = mmap.mmap(-1, 16 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    data.write(os.urandom(16 << 20))
    pages = len(data) // 4096
    copied, policy = _faults_writing(data, prefault=True, wake=False)
    shared, _ = _faults_writing(data, prefault=False, wake=False)
    woken, woken_policy = _faults_writing(data, prefault=True, wake=True)
    assert shared >= pages  # the test's premise: each first write a fault
    assert copied < pages // 20
    assert woken >= pages
    assert policy == woken_policy == os.SCHED_OTHER  # SCHED_IDLE only while it copied
    batch_copied, batch_policy = _faults_writing(
        data, prefault=True, wake=False, policy=os.SCHED_BATCH
    )
    assert batch_copied < pages // 20
    assert batch_policy == os.SCHED_BATCH
    unprivileged, unprivileged_policy = _faults_writing(data, prefault=True, wake=False, uid=65534)
    assert unprivileged >= pages  # could not leave SCHED_IDLE: copies nothing
    assert unprivileged_policy == os.SCHED_OTHER


@pytest.mark.parametrize(
    ("policy", "priority", "seen"),
    [(os.SCHED_BATCH, 0, os.SCHED_BATCH), (os.SCHED_RR, 1, os.SCHED_OTHER)],
    ids=["batch-kept", "realtime-dropped"],
)
async def test_a_sandbox_keeps_the_scheduling_policy_the_node_agent_runs_at(
    tmp_path: Path, policy: int, priority: int, seen: int
) -> None:
    # An operator's SCHED_BATCH (systemd's CPUSchedulingPolicy=, chrt) reaches the sandbox
    # through the zygote and the shell made ahead, whose copying at SCHED_IDLE is undone. A
    # realtime one does not: the pre-exec stage drops it first (with realtime group scheduling
    # a realtime init could not even join the sandbox's cgroup: every launch failed).
    code = "import os; print(os.sched_getscheduler(0), flush=True)\n"
    os.sched_setscheduler(0, policy, os.sched_param(priority))
    try:
        async with managed(tmp_path / "home") as manager:
            for index in range(3):
                sid = f"zyg-policy-{index}"
                result = await run_to_end(manager, snippet_config(sid, code, tmp_path))
                assert Path(result.stdout_path).read_text() == f"{seen}\n"
                await manager.settle()  # the next launch takes the shell forked ahead
    finally:
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


def test_the_workload_never_keeps_idle_or_realtime_scheduling() -> None:
    # Set before the uid drop (after it the workload may not change it): the policy it had
    # before copying its pages at SCHED_IDLE; and every pre-exec stage drops a realtime one as
    # it starts (a node agent's may be; a sandbox's code must not take a CPU from the node).
    from dsec_nodeagent.sandbox import init

    def idle_then_batch() -> int:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        init._POLICY_BEFORE = (os.SCHED_BATCH, os.sched_param(0))
        init._settle_scheduling()
        return os.sched_getscheduler(0)

    assert _in_child(idle_then_batch) == os.SCHED_BATCH

    def realtime() -> tuple[int, int]:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
        init._no_realtime()
        init._settle_scheduling()
        return os.sched_getscheduler(0), os.sched_getparam(0).sched_priority

    assert tuple(_in_child(realtime)) == (os.SCHED_OTHER, 0)

    def batch() -> int:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        init._no_realtime()
        init._settle_scheduling()
        return os.sched_getscheduler(0)

    assert _in_child(batch) == os.SCHED_BATCH


def _ignored_after_exec(defaults: bool) -> int:
    """The ``SigIgn`` mask of a program exec'd by a child that ignores ``SIGPIPE`` and
    ``SIGXFSZ`` (as the pre-exec stage's interpreter does), after ``init._default_signals``
    when ``defaults``."""
    import subprocess

    from dsec_nodeagent.sandbox import init

    def before() -> None:
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        if defaults:
            init._default_signals()

    status = subprocess.run(
        ["cat", "/proc/self/status"],
        preexec_fn=before,
        restore_signals=False,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(line for line in status.splitlines() if line.startswith("SigIgn:"))
    return int(line.split()[1], 16)


def test_the_workload_is_execd_with_sigpipe_and_sigxfsz_at_their_defaults() -> None:
    # An ignored signal stays ignored across execve, and the pre-exec stage's interpreter
    # ignores both at its start: a sandbox's `producer | head` got EPIPE errors instead of
    # ending quietly. What an exec'd program sees: its SigIgn mask (bits 13 and 25).
    pipe, xfsz = 1 << (signal.SIGPIPE - 1), 1 << (signal.SIGXFSZ - 1)
    ignored = _ignored_after_exec(defaults=False)
    assert ignored & pipe and ignored & xfsz  # the premise: they would stay ignored
    assert _ignored_after_exec(defaults=True) & (pipe | xfsz) == 0


@pytest.mark.parametrize("network", [True, False], ids=["forked-ahead", "forked-after-plan"])
async def test_each_stage_of_a_start_is_reported_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, network: bool
) -> None:
    # A workload process forked after the plan (its own network namespace) is a child of init,
    # which holds its stage records to write them together: the child must not write init's
    # again (its namespaces stage then counted twice in sandbox.ready's timings).
    from dsec_nodeagent.sandbox import domain

    seen: list[list[str]] = []
    timings = domain.stage_timings

    def spy(t0: int, marks: dict[str, int], records: list[dict[str, object]], ready: int) -> object:
        seen.append([str(r.get("stage")) for r in records])
        return timings(t0, marks, records, ready)

    monkeypatch.setattr(domain, "stage_timings", spy)
    async with managed(tmp_path / "home") as manager:
        for index in range(2):  # the second takes the shell forked ahead
            config = snippet_config(f"zyg-once-{index}", "print(1)\n", tmp_path, network=network)
            result = await run_to_end(manager, config)
            assert result.reason is ExitReason.OK
            await manager.settle()
    assert len(seen) == 2
    for stages in seen:
        for stage in ("fork", "spawn", "namespaces", "cgroup_join", "mounts", "seccomp", "exec"):
            assert stages.count(stage) == 1, (stage, stages)


async def test_a_dead_zygote_is_replaced_and_its_sandboxes_live_on(tmp_path: Path) -> None:
    async with managed(tmp_path / "home") as manager:
        assert manager.zygote is not None
        await manager.launch(snippet_config("zyg-long", "import time; time.sleep(60)\n", tmp_path))
        first = manager.zygote.pid
        assert first is not None
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while manager.zygote.pid is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert manager.zygote.pid is None
        await manager.launch(snippet_config("zyg-next", "print('next')\n", tmp_path))
        result = await asyncio.wait_for(manager.wait("zyg-next"), 60)
        assert result.reason is ExitReason.OK
        assert Path(result.stdout_path).read_text() == "next\n"
        assert manager.zygote.pid not in (None, first)
        assert manager.zygote.starts == 2
        # The sandbox forked by the dead zygote still runs and is still watched.
        assert manager.running() == ["zyg-long"]
        stopped = await manager.stop("zyg-long", grace_s=1.0)
        assert stopped.reason is ExitReason.STOPPED


async def test_the_zygote_refuses_a_request_it_does_not_understand_and_forks_nothing(
    tmp_path: Path,
) -> None:
    from dsec_nodeagent.sandbox.manager import BOOTSTRAP, _init_env
    from dsec_nodeagent.sandbox.zygote import Zygote

    zygote = Zygote(Path(sys.executable), BOOTSTRAP, _init_env(), tmp_path / "root")
    await zygote.prestart()
    try:
        assert zygote.pid is not None
        sock = zygote._sock
        assert sock is not None
        sock.setblocking(True)
        spare = [os.open("/dev/null", os.O_RDONLY) for _ in range(2)]
        try:
            sock.sendmsg([b"exec"])  # not a word it knows, and no fd
            assert sock.recv(64).startswith(b"error")
            payload = b"".join(fd.to_bytes(4, sys.byteorder) for fd in spare)
            sock.sendmsg([b"fork"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, payload)])  # 2 fds
            assert sock.recv(64).startswith(b"error")
        finally:
            for fd in spare:
                os.close(fd)
        children = Path(f"/proc/{zygote.pid}/task/{zygote.pid}/children").read_text().split()
        assert children == []
        sock.setblocking(False)
    finally:
        await zygote.close()
    assert zygote.pid is None


def _children(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/task/{pid}/children").read_text().split()


def _writes_to_a_shared_mount(sandbox_id: str, tmp_path: Path) -> tuple[Path, SandboxConfig]:
    """A host directory, and a sandbox that writes ``ran`` into it if any of its code runs."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    config = snippet_config(
        sandbox_id,
        "open('/mnt/shared/ran', 'w').write('ran')\n",
        tmp_path,
        mounts=[Mount(source=shared, target="/mnt/shared", read_only=False)],
        write_allowed=["/tmp", "/workspace/output", "/mnt/shared"],
    )
    return shared, config


async def test_a_launch_failing_after_its_plan_was_handed_over_runs_nothing_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """The zygote's child gets its plan before the sandbox's cgroups exist (its init binds the
    root view meanwhile); when making them fails, init never gets its go and exits having run
    nothing of the sandbox, and its supervisor with it."""
    from dsec_nodeagent.sandbox import SandboxStartError

    shared, config = _writes_to_a_shared_mount("zyg-nogo", tmp_path)
    seen: list[list[str]] = []
    async with managed(tmp_path / "home") as manager:
        assert manager.zygote is not None
        await manager.zygote.prestart()
        zygote_pid = manager.zygote.pid
        assert zygote_pid is not None

        async def refuse(sandbox_id: str, cgroup_dir: Path, inode: int) -> None:
            assert cgroup_dir.is_dir()
            seen.append(_children(zygote_pid))  # the supervisor, forked and handed its plan
            raise RuntimeError("the egress programs cannot be attached")

        with pytest.raises(SandboxStartError) as failed:
            await manager.launch(config, before_start=refuse)
        assert failed.value.stage == "cgroup"
        assert "egress programs" in str(failed.value)
        assert len(seen) == 1 and len(seen[0]) == 1
        launched = seen[0][0]
        # Its supervisor is gone; what the zygote still has is the next launch's shell.
        await _only_the_next_shell_left(manager, zygote_pid)
        assert launched not in _children(zygote_pid)
        assert not (shared / "ran").exists()
        assert manager.states.read("zyg-nogo") is None
        after = snippet_config("zyg-after", "print('after')\n", tmp_path)
        await manager.launch(after)
        result = await asyncio.wait_for(manager.wait("zyg-after"), 60)
        assert result.reason is ExitReason.OK
        assert Path(result.stdout_path).read_text() == "after\n"


async def test_a_launch_given_up_before_its_plan_leaves_no_process(tmp_path: Path) -> None:
    """The fork is asked for before the launch plans; a plan that fails gives the child (and
    the init it made, whose plan socket was sent to the node agent) up: both exit."""
    from dsec_nodeagent.sandbox import SandboxStartError

    async with managed(tmp_path / "home") as manager:
        assert manager.zygote is not None
        await manager.zygote.prestart()
        zygote_pid = manager.zygote.pid
        assert zygote_pid is not None
        config = snippet_config(
            "zyg-noplan", "print('never')\n", tmp_path, extra_ro_paths=[tmp_path / "missing"]
        )
        with pytest.raises(SandboxStartError) as failed:
            await manager.launch(config)
        assert failed.value.stage == "plan"
        await _only_the_next_shell_left(manager, zygote_pid)
        result = await run_to_end(manager, snippet_config("zyg-planned", "print('ok')\n", tmp_path))
        assert Path(result.stdout_path).read_text() == "ok\n"


async def test_a_seccomp_filter_the_kernel_refuses_fails_the_launch_before_any_sandbox_code(
    tmp_path: Path,
) -> None:
    """The workload's process installs its seccomp filter while init binds the root view; a
    filter the kernel refuses fails the launch at that layer, the workload never run, and
    leaves no cgroup, state or process."""
    from dsec_nodeagent.sandbox import SandboxStartError

    shared, config = _writes_to_a_shared_mount("zyg-badfilter", tmp_path)
    async with managed(tmp_path / "home") as manager:
        assert manager.zygote is not None
        await manager.zygote.prestart()
        zygote_pid = manager.zygote.pid
        assert zygote_pid is not None
        abi, last_cap, program = manager._kernel_facts()
        # BPF_LD|BPF_IMM with an unknown mode bit: the kernel's checker refuses it (EINVAL).
        manager._facts = (abi, last_cap, b"\xff\xff\x00\x00\x00\x00\x00\x00")
        with pytest.raises(SandboxStartError) as failed:
            await manager.launch(config)
        assert failed.value.stage == "seccomp"
        assert "Invalid argument" in str(failed.value)
        assert not (shared / "ran").exists()
        assert manager.states.read("zyg-badfilter") is None
        planned = manager._planned_cgroup(config)
        assert not planned.v2_dir.exists()
        assert not any(d.exists() for d in planned.dirs.values())
        await _only_the_next_shell_left(manager, zygote_pid)
        manager._facts = (abi, last_cap, program)
        result = await run_to_end(manager, snippet_config("zyg-good", "print('ok')\n", tmp_path))
        assert Path(result.stdout_path).read_text() == "ok\n"


async def _only_the_next_shell_left(manager: SandboxManager, zygote_pid: int) -> None:
    """Poll until the zygote's only child is the shell made ahead for the next launch."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        shell = manager._shell
        expected = [str(shell.pid)] if shell is not None and shell.pid is not None else None
        if expected is not None and _children(zygote_pid) == expected:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"zygote children {_children(zygote_pid)}, shell {manager._shell}")


async def _next_shell(manager: SandboxManager) -> PendingFork:
    """The shell forked ahead for the next launch (a moment after the last one)."""
    deadline = time.monotonic() + 30
    while manager._shell is None and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert manager._shell is not None
    return manager._shell


def _mount_ns(pid: int | str) -> str:
    return os.readlink(f"/proc/{pid}/ns/mnt")


async def test_a_shell_made_ahead_holds_no_mounts_serves_one_launch_and_goes_at_shutdown(
    tmp_path: Path,
) -> None:
    """After a launch the manager has the next launch's supervisor and init forked; until that
    launch, init has no mount namespace of its own (no copy of the host's mounts, nothing
    stale); the launch uses it, the one after gets another; shutdown ends the spare one."""
    async with managed(tmp_path / "home") as manager:
        assert manager.zygote is not None
        await run_to_end(manager, snippet_config("zyg-first", "print('1')\n", tmp_path))
        shell = await _next_shell(manager)
        deadline = time.monotonic() + 30
        while (shell.pid is None or not _children(shell.pid)) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        assert shell.pid is not None
        (init,) = _children(shell.pid)
        assert _mount_ns(init) == _mount_ns(os.getpid())  # the host's: not copied yet
        assert os.readlink(f"/proc/{init}/ns/pid") != os.readlink(f"/proc/{os.getpid()}/ns/pid")
        await manager.launch(
            snippet_config("zyg-second", "import time; time.sleep(60)\n", tmp_path)
        )
        state = manager.states.read("zyg-second")
        assert state is not None
        assert state["supervisor_pid"] == shell.pid  # the shell made ahead
        assert _mount_ns(state["init_pid"]) != _mount_ns(os.getpid())
        await manager.stop("zyg-second", grace_s=1.0)
        await manager.launch(snippet_config("zyg-third", "import time; time.sleep(60)\n", tmp_path))
        third = manager.states.read("zyg-third")
        assert third is not None
        assert third["supervisor_pid"] != shell.pid  # one launch per shell
        await manager.stop("zyg-third", grace_s=1.0)
        spare = await _next_shell(manager)
        assert spare is not shell
        await spare.forked()  # (made by a timer: its fork may still be on its way)
    assert spare.pid is not None
    deadline = time.monotonic() + 30
    while os.path.exists(f"/proc/{spare.pid}") and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert not os.path.exists(f"/proc/{spare.pid}")


def _same_uid_start(prefix: str) -> tuple[str, str]:
    """Two sandbox ids whose uids would start at the same place (allocate_uid's first choice)."""
    from dsec_nodeagent.sandbox.domain import allocate_uid

    seen: dict[int, str] = {}
    for n in range(100_000):
        sid = f"{prefix}-{n}"
        start = allocate_uid(sid, set())
        if start in seen:
            return seen[start], sid
        seen[start] = sid
    raise AssertionError("no two ids with the same start")


async def test_launches_under_way_at_once_never_share_a_uid(tmp_path: Path) -> None:
    """Each sandbox runs under a uid of its own; two launches under way at the same time, whose
    ids hash to the same first choice, still get two."""
    first, second = _same_uid_start("zyg-uid")
    async with managed(tmp_path / "home") as manager:
        # (one launch first: the runtime is inspected once, then both plan without waiting)
        await run_to_end(manager, snippet_config("zyg-uid-warm", "print('w')\n", tmp_path))
        ready = await asyncio.gather(
            manager.launch(snippet_config(first, "print('a')\n", tmp_path)),
            manager.launch(snippet_config(second, "print('b')\n", tmp_path)),
        )
        assert ready[0].uid != ready[1].uid
        for sid in (first, second):
            assert (await asyncio.wait_for(manager.wait(sid), 60)).reason is ExitReason.OK


async def test_a_second_launch_of_an_id_under_way_is_refused_and_leaves_the_first_intact(
    tmp_path: Path,
) -> None:
    """The same launch asked for twice at once (a request delivered again): the second is
    refused at once, and its failure removes nothing of the first (run directory, disk quota,
    state), which runs and writes its output."""
    from dsec_nodeagent.sandbox import SandboxStartError

    code = (
        "import time; time.sleep(0.2)\n"  # (the second launch's failure is over by then)
        "open('/workspace/output/done', 'w').write('yes')\n"
        "print(open('/workspace/output/done').read())\n"
    )
    config = snippet_config("zyg-twice", code, tmp_path)
    async with managed(tmp_path / "home") as manager:
        first, second = await asyncio.gather(
            manager.launch(config), manager.launch(config), return_exceptions=True
        )
        assert not isinstance(first, BaseException), first
        assert isinstance(second, SandboxStartError) and "already exists" in str(second)
        assert manager.states.read("zyg-twice") is not None
        result = await asyncio.wait_for(manager.wait("zyg-twice"), 60)
        assert result.reason is ExitReason.OK, Path(result.stderr_path).read_text()[-500:]
        assert Path(result.stdout_path).read_text() == "yes\n"


async def test_a_launch_cancelled_midway_leaves_nothing_and_its_uid_was_reserved_meanwhile(
    tmp_path: Path,
) -> None:
    """A launch cancelled while under way (the node agent stopping, a migration given up)
    cleans up as a failed one does: no cgroup, state file, run directory or process stays
    (``managed`` checks at its end). Until then its state file names its uid."""
    shared, config = _writes_to_a_shared_mount("zyg-cancel", tmp_path)
    seen: list[object] = []
    held = asyncio.Event()
    async with managed(tmp_path / "home") as manager:

        async def hold(sandbox_id: str, cgroup_dir: Path, inode: int) -> None:
            seen.append((manager.states.read(sandbox_id) or {}).get("uid"))
            held.set()
            await asyncio.Event().wait()  # until cancelled

        launch = asyncio.ensure_future(manager.launch(config, before_start=hold))
        await asyncio.wait_for(held.wait(), 60)
        assert isinstance(seen[0], int) and seen[0] in manager._uids_in_use()
        launch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await launch
        assert manager.states.read("zyg-cancel") is None
        assert not (manager.run_dir / "zyg-cancel").exists()
        assert not manager._planned_cgroup(config).v2_dir.exists()
        assert not (shared / "ran").exists()
        result = await run_to_end(manager, snippet_config("zyg-next", "print('ok')\n", tmp_path))
        assert Path(result.stdout_path).read_text() == "ok\n"


def _pidfds() -> int:
    """How many pidfds this process holds."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own fd)
            count += os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
    return count


async def _steady_pidfds(manager: SandboxManager, sandbox_id: str, tmp_path: Path) -> int:
    """The pidfds held once a first launch ran and the node settled (a shell forked ahead
    holds one): the count a cancelled launch must leave."""
    assert manager.zygote is not None
    await run_to_end(manager, snippet_config(sandbox_id, "print('ok')\n", tmp_path))
    await manager.settle()
    return _pidfds()


async def test_a_launch_cancelled_while_it_waits_for_its_ready_signal_keeps_no_pidfd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled after the zygote handed the sandbox's supervisor over (the node agent holds its
    pidfd) and before the workload's execve: the launch cleans up as a failed one, and the node
    agent keeps no pidfd of the killed supervisor (one leaked fd per cancelled launch)."""
    from dsec_nodeagent.sandbox import manager as manager_module

    reading = asyncio.Event()

    async def no_ready_signal(fd: int, timeout_s: float) -> object:
        reading.set()
        try:
            await asyncio.Event().wait()  # until cancelled
        finally:
            os.close(fd)
        raise AssertionError("not reached")

    config = snippet_config("zyg-cancel-reports", "print('never')\n", tmp_path)
    async with managed(tmp_path / "home") as manager:
        before = await _steady_pidfds(manager, "zyg-steady", tmp_path)
        monkeypatch.setattr(manager_module, "_read_reports", no_ready_signal)
        launch = asyncio.ensure_future(manager.launch(config))
        await asyncio.wait_for(reading.wait(), 60)
        launch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await launch
        await manager.settle()
        assert manager.states.read("zyg-cancel-reports") is None
        assert not manager._planned_cgroup(config).v2_dir.exists()
        assert _pidfds() == before


async def test_a_launch_cancelled_twice_while_its_hook_runs_keeps_no_pidfd(
    tmp_path: Path,
) -> None:
    """A second cancel that lands while the launch waits for its supervisor to go (after the
    first cancel ended its hook on the cgroup): the wait is cut short and the supervisor's
    pidfd is still closed. Before, the wait was a task of ``wait_for``, cancelled before it
    ran, and its close never happened."""
    held = asyncio.Event()
    config = snippet_config("zyg-cancel-twice", "print('never')\n", tmp_path)
    async with managed(tmp_path / "home") as manager:
        before = await _steady_pidfds(manager, "zyg-steady-2", tmp_path)

        async def hold(sandbox_id: str, cgroup_dir: Path, inode: int) -> None:
            held.set()
            await asyncio.Event().wait()  # until cancelled

        launch = asyncio.ensure_future(manager.launch(config, before_start=hold))
        await asyncio.wait_for(held.wait(), 60)
        launch.cancel()
        await asyncio.sleep(0)  # the launch takes the cancel, then waits for its supervisor
        launch.cancel()
        with pytest.raises(asyncio.CancelledError):
            await launch
        await manager.settle()
        assert manager.states.read("zyg-cancel-twice") is None
        assert _pidfds() == before


async def test_purging_a_sandbox_whose_launch_is_under_way_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Purge deletes an ended sandbox's outputs; asked for an id being launched, before its
    state file exists (here: while its semantic layer's channel opens), it is refused and the
    sandbox runs with its outputs."""
    from dsec_nodeagent.sandbox import manager as manager_module
    from dsec_nodeagent.semantic import compile_rules

    opening = asyncio.Event()
    go = asyncio.Event()
    real_open = manager_module.DecisionChannel.open

    async def slow_open(*args: object, **kwargs: object) -> object:
        opening.set()
        await go.wait()
        return await real_open(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(manager_module.DecisionChannel, "open", slow_open)
    rules = compile_rules(
        {"rules": [{"name": "n", "on": "open", "match": {"path": "/etc/*"}, "action": "deny"}]}
    )
    code = (
        "open('/workspace/output/done', 'w').write('yes')\n"
        "print(open('/workspace/output/done').read())\n"
    )
    config = snippet_config("zyg-purge", code, tmp_path, semantic_rules=rules)
    async with managed(tmp_path / "home") as manager:
        launch = asyncio.ensure_future(manager.launch(config))
        await asyncio.wait_for(opening.wait(), 60)
        assert manager.states.read("zyg-purge") is None  # no state file yet
        with pytest.raises(RuntimeError, match="still runs"):
            await manager.purge("zyg-purge")
        go.set()
        await launch
        result = await asyncio.wait_for(manager.wait("zyg-purge"), 60)
        assert Path(result.stdout_path).read_text() == "yes\n"


# A workload whose first instructions ask what a user's program may ask at once: its parent, a
# parent-death signal (set before anything else), its session; then whether it is still alive.
FIRST_INSTRUCTIONS = r"""
#include <stdio.h>
#include <signal.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
int main(int argc, char **argv) {
    pid_t parent = getppid();
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (argc > 1 && strcmp(argv[1], "now") == 0) return 7;  /* ends at once */
    if (argc > 1 && strcmp(argv[1], "signals") == 0) {  /* stop and kill all it may, 50 ms */
        struct timespec start, now;
        clock_gettime(CLOCK_MONOTONIC, &start);
        do {
            kill(-1, SIGSTOP);
            kill(-1, SIGKILL);
            clock_gettime(CLOCK_MONOTONIC, &now);
        } while ((now.tv_sec - start.tv_sec) * 1000000000L + now.tv_nsec - start.tv_nsec
                 < 50000000L);
        return 3;
    }
    if (argc > 1 && strcmp(argv[1], "fork") == 0) {  /* two children at once */
        for (int i = 0; i < 2; i++) {
            pid_t child = fork();
            if (child < 0) return 9;
            if (child == 0) { usleep(100000); _exit(0); }
        }
        while (wait(NULL) > 0) {}
        return 0;
    }
    usleep(300000);  /* long past the pre-exec stage's end */
    printf("{\"ppid\": %d, \"pid\": %d, \"sid\": %d, \"pgid\": %d}\n",
           (int)parent, (int)getpid(), (int)getsid(0), (int)getpgid(0));
    return 0;
}
"""


def _static_binary(tmp_path: Path) -> Path:
    code = tmp_path / "first-code"
    code.mkdir()
    source = tmp_path / "first.c"
    source.write_text(FIRST_INSTRUCTIONS)
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler (the project's extensions need one too)"
    subprocess.run([cc, "-static", "-O1", "-o", str(code / "first"), str(source)], check=True)
    return code


async def test_the_workload_is_inits_child_from_its_first_instruction_in_a_session_of_its_own(
    tmp_path: Path,
) -> None:
    code = _static_binary(tmp_path)
    async with managed(tmp_path / "home") as manager:
        report = read_json_output(
            await run_to_end(
                manager,
                SandboxConfig(
                    sandbox_id="first-insn",
                    argv=["/workspace/code/first"],
                    runtime=Path(sys.executable),
                    code_dir=code,
                ),
            )
        )
        # no process between init and the workload: the pre-exec stage's end changes nothing
        # it can see (its parent-death signal never fires)
        assert report["ppid"] == 1
        assert report["sid"] == report["pid"] == report["pgid"]
        # A workload that ends at once: its exit code, not a lost one. One that stops and
        # kills every process it may at once: the process that started it keeps root until it
        # told init the workload's pid (before, init hung, or took that process's SIGKILL for
        # the workload's end). One that forks twice at once with the smallest pids limit: the
        # starter still there does not take one of them.
        for attempt, (mode, limits, ended) in enumerate(
            [
                ("now", Limits(), (ExitReason.ERROR, 7)),
                ("now", Limits(), (ExitReason.ERROR, 7)),
                ("signals", Limits(), (ExitReason.ERROR, 3)),
                ("signals", Limits(), (ExitReason.ERROR, 3)),
                ("fork", Limits(pids=4), (ExitReason.OK, 0)),
                ("fork", Limits(pids=4), (ExitReason.OK, 0)),
            ]
        ):
            result = await asyncio.wait_for(
                run_to_end(
                    manager,
                    SandboxConfig(
                        sandbox_id=f"first-{mode}-{attempt}",
                        argv=["/workspace/code/first", mode],
                        runtime=Path(sys.executable),
                        code_dir=code,
                        limits=limits,
                    ),
                ),
                60,
            )
            assert (result.reason, result.exit_code) == ended, (mode, result)


def test_entries_bound_ahead_stay_only_where_the_plan_shares_them(tmp_path: Path) -> None:
    runtime, other, code = tmp_path / "runtime", tmp_path / "other", tmp_path / "code"
    for directory in (runtime, other, code):
        directory.mkdir()
    (runtime / "from-runtime").write_text("x")
    ahead = {"kind": "bind", "src": str(runtime), "path": "/opt/rt", "ro": True}
    own = {"kind": "bind", "src": str(code), "path": "/workspace/code", "ro": True}

    def root_view(layout: list[dict[str, Any]], shared: list[int]) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            syscalls.unshare(syscalls.CLONE_NEWNS)
            root = str(tmp_path / f"root-{os.getpid()}")
            os.mkdir(root)
            init.prepare_root(root)
            prebound = init._prebind(root, marshal.dumps([ahead]))
            the_plan = {"layout": layout, "shared": shared}
            kept = init._prebound_kept(the_plan, prebound)
            if prebound and kept is None:
                init._prepare_again(root)
            init.bind_root(the_plan, root, kept)
            with open("/proc/self/mountinfo") as info:
                mounts = [line.split()[4] for line in info]
            return {
                "kept": sorted(kept) if kept is not None else None,
                "opt": os.listdir(f"{root}/opt") if os.path.isdir(f"{root}/opt") else None,
                "rt": os.listdir(f"{root}/opt/rt") if os.path.isdir(f"{root}/opt/rt") else None,
                "mounts": sorted(m[len(root) :] for m in mounts if m.startswith(root + "/")),
            }

        result: dict[str, Any] = _in_child(work)
        return result

    same = root_view([ahead, own], [0])
    assert same["kept"] == [0]
    assert same["rt"] == ["from-runtime"]
    assert same["mounts"].count("/opt/rt") == 1  # bound once, ahead
    assert "/workspace/code" in same["mounts"]
    # another runtime's directory at the same place: the view made again, only the plan's
    moved = root_view([{**ahead, "src": str(other)}, own], [0])
    assert moved["kept"] is None
    assert moved["rt"] == []  # the plan's (empty) source, not the one bound ahead
    assert moved["mounts"].count("/opt/rt") == 1
    # a plan without it: nothing of it left, not even its mount point
    without = root_view([own], [])
    assert without["kept"] is None and without["opt"] is None
    assert "/opt/rt" not in without["mounts"]
    assert {"/proc", "/dev", "/workspace/code"} <= set(without["mounts"])


# A library the sandbox's own files make every dynamically linked program load: it writes what
# pid 1 is, when it runs in pid 1 (a checkpointable sandbox's init execs the runtime's
# interpreter from the sandbox's view as its reaper).
PRELOADED = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void where(void) {
    if (getpid() != 1) return;
    FILE *in = fopen("/proc/self/status", "r"), *out = fopen("/tmp/pid1-status", "w");
    char line[256];
    while (in && out && fgets(line, sizeof line, in)) fputs(line, out);
    if (out) fclose(out);
    if (in) fclose(in);
}
"""

PID1_PROBE = r"""
import json, os, time
deadline = time.monotonic() + 20
while time.monotonic() < deadline and not os.path.exists("/tmp/pid1-status"):
    time.sleep(0.02)
time.sleep(0.1)  # (written whole by then)
status = dict(line.split(":", 1) for line in open("/tmp/pid1-status"))
print(json.dumps({k: status[k].split() for k in ("Uid", "CapEff", "CapBnd", "NoNewPrivs",
                                               "Seccomp")} | {"me": os.getuid()}))
"""


async def test_a_checkpointable_sandboxs_reaper_runs_as_the_sandboxs_uid_confined(
    tmp_path: Path,
) -> None:
    # A review made pid 1 load a tenant's library (/etc/ld.so.preload in the sandbox's view)
    # as root with every capability, and mount the host's disk from there.
    code = tmp_path / "pid1-code"
    code.mkdir()
    (tmp_path / "preloaded.c").write_text(PRELOADED)
    cc = shutil.which("cc") or shutil.which("gcc")
    assert cc, "a C compiler (the project's extensions need one too)"
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-O1",
            "-o",
            str(code / "preloaded.so"),
            str(tmp_path / "preloaded.c"),
        ],
        check=True,
    )
    (code / "main.py").write_text(PID1_PROBE)
    preload = tmp_path / "ld.so.preload"
    preload.write_text("/workspace/code/preloaded.so\n")
    async with managed(tmp_path / "home") as manager:
        result = await run_to_end(
            manager,
            SandboxConfig(
                sandbox_id="pid1-probe",
                argv=["python", "/workspace/code/main.py"],
                runtime=Path(sys.executable),
                code_dir=code,
                write_allowed=["/tmp"],
                mounts=[Mount(source=preload, target="/etc/ld.so.preload")],
                # (readable: the library loads wherever the sandbox's own rules let it)
                read_allowed=["/etc/ld.so.preload", "/workspace/code"],
                checkpointable=True,
            ),
        )
    report = read_json_output(result)
    assert result.reason is ExitReason.OK
    assert report["Uid"] == [str(report["me"])] * 4  # the sandbox's uid, not root
    assert int(report["CapEff"][0], 16) == 0
    assert int(report["CapBnd"][0], 16) == 0
    assert report["NoNewPrivs"] == ["1"] and report["Seccomp"] == ["2"]


async def test_stopping_a_checkpointable_sandbox_sends_its_workload_sigterm(tmp_path: Path) -> None:
    # Its reaper (pid 1, confined) forwards the stop; with Landlock's signal scope it could not
    # reach the workload's domain, and every stop waited out its grace for a SIGKILL.
    async with managed(tmp_path / "home") as manager:
        await manager.launch(
            snippet_config(
                "ckpt-stop",
                "import time\nprint('up', flush=True)\ntime.sleep(120)\n",
                tmp_path,
                checkpointable=True,
            )
        )
        stdout = Path(manager.log_paths("ckpt-stop")[0])
        assert "up" in await _output(stdout, "up")
        result = await manager.stop("ckpt-stop", grace_s=20.0)
    assert result.reason is ExitReason.STOPPED
    assert result.signal == signal.SIGTERM, result


@pytest.mark.parametrize("checkpointable", [True, False])
async def test_a_stop_right_after_the_launch_is_not_lost(
    tmp_path: Path, checkpointable: bool
) -> None:
    """A stop sent before the sandbox's pid 1 had its forwarding handler was dropped (pid 1
    ignores a signal it has no handler for; a checkpointable sandbox's reaper installs its own
    only after it exec'd a new interpreter), and the stop waited out its grace for a SIGKILL:
    a CI run under load saw exactly this. Held blocked until the handler is in place, it is
    delivered."""
    async with managed(tmp_path / "home") as manager:
        await manager.launch(
            snippet_config(
                "stop-early", "import time\ntime.sleep(120)\n", tmp_path,
                checkpointable=checkpointable,
            )
        )  # fmt: skip
        started = time.monotonic()
        result = await manager.stop("stop-early", grace_s=30.0)
    assert result.signal == signal.SIGTERM, result
    assert time.monotonic() - started < 15  # not the grace's SIGKILL


# Modules a stage running as root could import lazily, planted where the node agent's own
# interpreter looks for them: once inside a sandbox whose runtime is another interpreter, those
# paths name the sandbox's files.
PLANT = r"""
import os, sys
stdlib = sys.argv[1]
os.makedirs(stdlib, exist_ok=True)
for name in ("resource", "select", "fcntl", "termios", "json", "_socket", "gc", "signal"):
    with open(os.path.join(stdlib, name + ".py"), "w") as fh:
        fh.write("open('/root/planted-ran', 'w').write(str(__import__('os').getuid()))\n")
print("planted", flush=True)
import time
time.sleep(120)
"""


async def test_exec_into_a_sandbox_of_another_runtime_loads_nothing_of_its_view(
    tmp_path: Path,
) -> None:
    other = Path("/usr/bin/python3")
    assert other.resolve() != Path(sys.executable).resolve()
    stdlib = sysconfig.get_paths()["stdlib"]  # the node agent's interpreter's, which exec runs
    async with managed(tmp_path / "home") as manager:
        config = snippet_config(
            "other-rt",
            PLANT,
            tmp_path,
            runtime=other,
            argv=["python3", "/workspace/code/main.py", stdlib],
            write_allowed=["/tmp", "/root"],
        )
        await manager.launch(config)
        stdout = Path(manager.log_paths("other-rt")[0])
        stderr = Path(manager.log_paths("other-rt")[1])
        assert "planted" in await _output(stdout, "planted"), stderr.read_text()
        code = await manager.exec("other-rt", ["python3", "-c", "print('exec ran')"])
        kept = manager.data_root / "other-rt" / "fs" / "root"
        ran = (kept / "planted-ran").exists()
        await manager.stop("other-rt", grace_s=1.0)
    assert not ran  # no planted module ran, as root or otherwise
    assert code == 0
