"""A sandbox's own bounds, as its workload meets them (root): open files, disk, output logs."""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the test kit
from _dsec_sandbox_testkit import managed, read_json_output, run_to_end, snippet_config

from dsec_nodeagent.sandbox import ExitReason, Limits, domain

pytestmark = [pytest.mark.kernel]

MiB = 2**20


def _mounted(path: Path) -> bool:
    return any(
        line.split()[1] == str(path) for line in Path("/proc/mounts").read_text().splitlines()
    )


async def test_sandbox_gets_its_own_low_open_files_limit_not_the_agents(tmp_path: Path) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 20_000), max(hard, 20_000)))
    try:
        code = (
            "import json, os, resource, errno\n"
            "fds = []\n"
            "try:\n"
            "    while True: fds.append(os.open('/dev/null', os.O_RDONLY))\n"
            "except OSError as e: err = errno.errorcode[e.errno]\n"
            "print(json.dumps({'limit': resource.getrlimit(resource.RLIMIT_NOFILE),"
            " 'opened': len(fds), 'err': err}))\n"
        )
        async with managed(tmp_path / "home") as manager:
            cfg = snippet_config("nofile", code, tmp_path, limits=Limits(files=256))
            result = await run_to_end(manager, cfg)
        seen = read_json_output(result)
        assert seen["limit"] == [256, 256]
        assert seen["err"] == "EMFILE" and seen["opened"] < 256
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_writing_past_the_disk_quota_fails_with_enospc_and_exits_reason_disk(
    tmp_path: Path,
) -> None:
    code = (
        "import sys\n"
        "chunk = b'x' * (1 << 20)\n"
        "with open('/workspace/output/big', 'wb') as fh:\n"
        "    for _ in range(200): fh.write(chunk)\n"  # 200 MiB into a 24 MiB quota
    )
    home = tmp_path / "home"
    async with managed(home) as manager:
        cfg = snippet_config("diskfull", code, tmp_path, limits=Limits(disk_bytes=24 * MiB))
        await manager.launch(cfg)
        data = home / "sandboxes" / "diskfull"
        assert _mounted(data / "fs")  # while it runs, its outputs live on the quota fs
        result = await manager.wait("diskfull")
    assert result.reason == ExitReason.DISK and result.disk_full
    assert "disk quota full" in result.detail and "/workspace/output" in result.detail
    assert "No space left on device" in Path(result.stderr_path).read_text()
    output = data / "fs" / "workspace__output" / "big"
    assert 16 * MiB < output.stat().st_size <= 24 * MiB  # kept on the host, bounded
    assert not _mounted(data / "fs") and not (data / "disk.img").exists()


async def test_outputs_under_the_quota_are_kept_and_the_exit_is_ok(tmp_path: Path) -> None:
    code = "open('/workspace/output/result.txt', 'w').write('done')\n"
    home = tmp_path / "home"
    async with managed(home) as manager:
        result = await run_to_end(manager, snippet_config("diskok", code, tmp_path))
    assert result.reason == ExitReason.OK and not result.disk_full
    out = home / "sandboxes" / "diskok" / "fs" / "workspace__output" / "result.txt"
    assert out.read_text() == "done"
    assert os.stat(out.parent).st_uid == os.stat(out).st_uid != 0


async def test_a_sandbox_started_again_with_its_id_finds_its_outputs_and_keeps_both(
    tmp_path: Path,
) -> None:
    """What a restart in place does (a stateful sandbox that died): the same config launched
    again after the exit. The outputs the first attempt left are on the new quota filesystem,
    not hidden under it, and both attempts' outputs are kept after the second exit."""
    code = (
        "import os, sys\n"
        "out = '/workspace/output'\n"
        "seen = sorted(os.listdir(out))\n"
        "open(f'{out}/attempt{len(seen)}.txt', 'w').write(','.join(seen))\n"
        "sys.exit(1)\n"
    )
    home = tmp_path / "home"
    async with managed(home) as manager:
        cfg = snippet_config("again", code, tmp_path)
        first = await run_to_end(manager, cfg)
        second = await run_to_end(manager, cfg)
    assert first.exit_code == second.exit_code == 1
    outputs = home / "sandboxes" / "again" / "fs" / "workspace__output"
    assert sorted(p.name for p in outputs.iterdir()) == ["attempt0.txt", "attempt1.txt"]
    assert (outputs / "attempt1.txt").read_text() == "attempt0.txt"
    assert not _mounted(outputs.parent) and not (outputs.parent.parent / ".fs.previous").exists()


async def test_output_beyond_log_bytes_keeps_head_and_tail_and_says_so(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "line = b'y' * 1023 + b'\\n'\n"
        "sys.stdout.buffer.write(b'FIRST LINE\\n')\n"
        "for _ in range(8 * 1024): sys.stdout.buffer.write(line)\n"  # 8 MiB
        "sys.stdout.buffer.write(b'LAST LINE\\n')\n"
        "sys.stderr.write('small\\n')\n"
    )
    home = tmp_path / "home"
    async with managed(home) as manager:
        cfg = snippet_config("bigout", code, tmp_path, limits=Limits(log_bytes=1 * MiB))
        result = await run_to_end(manager, cfg)
    stdout = Path(result.stdout_path)
    text = stdout.read_bytes()
    assert len(text) <= 1 * MiB + 512
    assert text.startswith(b"FIRST LINE\n") and text.endswith(b"LAST LINE\n")
    assert b"bytes of output dropped here" in text
    assert result.log_dropped_bytes["stdout"] > 6 * MiB
    assert "stderr" not in result.log_dropped_bytes
    assert Path(result.stderr_path).read_text() == "small\n"
    assert "resources.log_bytes" in result.detail
    assert list(stdout.parent.glob("*.tail.*")) == []


@pytest.mark.unit
def test_truncation_is_described_per_stream() -> None:
    logs = {"stdout": {"bytes": 10, "dropped": 4}, "stderr": {"bytes": 1, "dropped": 0}}
    assert domain.log_truncation(logs) == {"stdout": 4}
    assert "stdout 4 bytes" in domain.describe_truncation({"stdout": 4})
    assert domain.log_truncation(None) == {}


@pytest.mark.unit
def test_a_full_disk_is_reason_disk_unless_the_workload_handled_it() -> None:
    full = "disk quota full: ..."
    assert domain.classify_exit(None, 1, None, 0, 0, full)[0] == ExitReason.DISK
    reason, detail = domain.classify_exit(None, 0, None, 0, 0, full)
    assert reason == ExitReason.OK and "disk quota full" in detail
    assert domain.classify_exit(None, 137, 9, 2, 0, full)[0] == ExitReason.OOM


_OLD_SPEC = """version: "1.2"
name: old-agent
base: dsec/python311:latest
entrypoint: [python, agent.py]
resources: {cpu: 1, memory: 512MiB}
"""


def _plan_of(spec_yaml: str) -> Any:
    from dsec_core.spec import compile_plan, load_spec

    loaded = load_spec(spec_yaml, "dsec.yaml")
    assert loaded.spec is not None, loaded.errors
    return compile_plan(loaded.spec).resources


@pytest.mark.unit
def test_an_old_spec_gets_the_safe_defaults_and_a_node_maximum_refuses_more() -> None:
    from dsec_core.settings import Settings

    from dsec_nodeagent.agent import StartRefused, node_limits

    res = _plan_of(_OLD_SPEC)
    assert (res.files, res.disk_bytes, res.log_bytes) == (1024, 256 * MiB, 64 * MiB)
    limits = node_limits(res, Settings())
    assert (limits.files, limits.disk_bytes, limits.log_bytes) == (1024, 256 * MiB, 64 * MiB)
    big = _plan_of(_OLD_SPEC.replace("memory: 512MiB}", "memory: 512MiB, files: 100000}"))
    with pytest.raises(StartRefused, match=r"resources.files = 100000 exceeds .* 65536"):
        node_limits(big, Settings())
    assert node_limits(big, Settings(sandbox_max_files=200_000)).files == 100_000
    # a spec may ask up to 4,194,304 pids; a node gives at most DSEC_SANDBOX_MAX_PIDS (before,
    # one sandbox could take the host's whole pid table: 32,768 here)
    many = _plan_of(_OLD_SPEC.replace("memory: 512MiB}", "memory: 512MiB, pids: 100000}"))
    with pytest.raises(StartRefused, match=r"resources.pids = 100000 exceeds .* 16384"):
        node_limits(many, Settings())
    assert node_limits(many, Settings(sandbox_max_pids=200_000)).pids == 100_000


@pytest.mark.unit
def test_the_hosts_sandboxes_together_hold_at_most_three_quarters_of_the_pid_table(
    tmp_path: Path,
) -> None:
    from dsec_nodeagent.sandbox import cgroups

    (tmp_path / "pid_max").write_text("32768\n")
    assert cgroups.node_pids_max(tmp_path / "pid_max") == 24_576
    assert cgroups.node_pids_max(tmp_path / "missing") is None
    hierarchy = cgroups.Hierarchy(tmp_path / "unified", frozenset({"pids"}), {})
    (tmp_path / "unified").mkdir()
    group = cgroups.SandboxCgroup.create(hierarchy, "sb-1", Limits(pids=100), node="node-7")
    every_sandbox = tmp_path / "unified" / "dsec"
    assert (every_sandbox / "pids.max").read_text() == str(cgroups.node_pids_max())
    assert (group.v2_dir / "pids.max").read_text() == "101"


async def test_a_sandbox_takes_no_aio_context_from_the_host(tmp_path: Path) -> None:
    """``fs.aio-max-nr`` is one budget for the whole host: one ``io_setup(65536)`` from a sandbox
    left the node and every neighbour none (EAGAIN) until it ended. Linux AIO is not there for
    a sandbox (ENOSYS, as on a kernel without it), and the host's count does not move."""
    code = (
        "import ctypes, errno, json, platform\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "nr = {'x86_64': 206, 'aarch64': 0}[platform.machine()]\n"
        "ctx = ctypes.c_ulong(0)\n"
        "rc = libc.syscall(nr, ctypes.c_uint(65536), ctypes.byref(ctx))\n"
        "print(json.dumps({'rc': rc, 'err': errno.errorcode.get(ctypes.get_errno(), '')}))\n"
    )
    before = int(Path("/proc/sys/fs/aio-nr").read_text())
    async with managed(tmp_path / "home") as manager:
        result = await run_to_end(manager, snippet_config("aio", code, tmp_path))
    seen = read_json_output(result)
    assert seen == {"rc": -1, "err": "ENOSYS"}
    assert int(Path("/proc/sys/fs/aio-nr").read_text()) <= before


@pytest.mark.unit
def test_a_spec_bounds_block_io_by_default_and_a_node_maximum_refuses_more() -> None:
    """Disk bandwidth is one of the node's shared resources: a spec without ``disk_*`` fields
    gets bounds (256 MiB/s read, 128 MiB/s written, 4,096 operations/s each way); a spec may
    write them as ``128MiB/s`` or ``128MiB``; more than a node's maximum is refused at start."""
    from dsec_core.settings import Settings
    from dsec_core.spec import load_spec

    from dsec_nodeagent.agent import StartRefused, node_limits

    limits = node_limits(_plan_of(_OLD_SPEC), Settings())
    assert (limits.disk_read_bps, limits.disk_write_bps, limits.disk_iops) == (
        256 * MiB,
        128 * MiB,
        4096,
    )
    asked = _OLD_SPEC.replace(
        "memory: 512MiB}",
        "memory: 512MiB, disk_read_rate: 64MiB/s, disk_write_rate: 32MiB, disk_iops: 500}",
    )
    limits = node_limits(_plan_of(asked), Settings())
    assert (limits.disk_read_bps, limits.disk_write_bps, limits.disk_iops) == (
        64 * MiB,
        32 * MiB,
        500,
    )
    fast = _plan_of(_OLD_SPEC.replace("memory: 512MiB}", "memory: 512MiB, disk_iops: 2000000}"))
    with pytest.raises(StartRefused, match=r"resources.disk_iops = 2000000 exceeds .* 1000000"):
        node_limits(fast, Settings())
    bad = load_spec(_OLD_SPEC.replace("memory: 512MiB}", "memory: 512MiB, disk_read_rate: 1GiB/h}"))
    assert bad.spec is None
    assert "resources.disk_read_rate" in str(bad.errors) and "per second" in str(bad.errors)


def _root_blkio() -> Path | None:
    from dsec_nodeagent.sandbox import cgroups

    hierarchy = cgroups.detect()
    return None if hierarchy.backend("io") != "v1" else hierarchy.v1["io"]


async def test_a_sandbox_reads_and_writes_its_disk_no_faster_than_its_bounds(
    tmp_path: Path,
) -> None:
    """Before, a sandbox had no block I/O bound: one could take the whole disk's bandwidth
    (here 1.6 GB/s written, 1.1 GB/s read) from its neighbours and the node. Now its reads
    (direct or through the page cache), its writes (write-back too: fsync waits for it) and
    its operations per second are bounded on its disk; the bounds on the loop device are
    gone when it ends."""
    code = (
        "import json, mmap, os, time\n"
        "out = '/workspace/output/blob'\n"
        "data = os.urandom(4 << 20)\n"
        "t = time.monotonic()\n"
        "with open(out, 'wb') as f:\n"
        "    f.write(data); f.flush(); os.fsync(f.fileno())\n"
        "write_s = time.monotonic() - t\n"
        "buf = mmap.mmap(-1, 1 << 20)\n"
        "fd = os.open(out, os.O_RDONLY | os.O_DIRECT)\n"
        "t = time.monotonic()\n"
        "for i in range(4):\n"
        "    os.preadv(fd, [buf], i << 20)\n"
        "read_s = time.monotonic() - t\n"
        "small = mmap.mmap(-1, 4096)\n"
        "t = time.monotonic()\n"
        "for i in range(150):\n"
        "    os.preadv(fd, [small], (i * 7 % 1024) * 4096)\n"
        "ops_s = time.monotonic() - t\n"
        "dev = os.stat('/workspace/output').st_dev\n"
        "print(json.dumps({'write_s': write_s, 'read_s': read_s, 'ops_s': ops_s,\n"
        "                  'disk': f'{os.major(dev)}:{os.minor(dev)}'}))\n"
    )
    limits = Limits(disk_read_bps=4 * MiB, disk_write_bps=4 * MiB, disk_iops=100)
    async with managed(tmp_path / "home") as manager:
        result = await run_to_end(manager, snippet_config("io", code, tmp_path, limits=limits))
    seen = read_json_output(result)
    # 4 MiB at 4 MiB/s, each way; 150 small reads at 100 a second (the bound's first slice
    # may let a little through at once: at least 3/4 of the time each takes)
    assert seen["write_s"] >= 0.75, seen
    assert seen["read_s"] >= 0.75, seen
    assert seen["ops_s"] >= 1.1, seen
    root = _root_blkio()
    if root is not None:  # (v1: write-back is the root group's, bounded there while it runs)
        for name in ("blkio.throttle.write_bps_device", "blkio.throttle.write_iops_device"):
            rules = (root / name).read_text().split("\n")
            assert not any(rule.startswith(seen["disk"] + " ") for rule in rules), rules


@pytest.mark.unit
@pytest.mark.parametrize("backend", ["v1", "v2"])
def test_the_io_bounds_go_to_the_sandboxs_disk_and_the_v1_root_loses_them_at_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """Where the io controller lives decides the files: v2's ``io.max`` (write-back is the
    sandbox's own there), or v1's ``blkio.throttle.*`` in the sandbox's group and, for writes
    on its disk, in the root group (v1 has no cgroup write-back), taken back at removal."""
    from dsec_nodeagent.sandbox import cgroups

    monkeypatch.setattr(cgroups, "host_disks", lambda: ["254:0"])
    (tmp_path / "unified").mkdir()
    blkio = tmp_path / "blkio"
    if backend == "v2":
        hierarchy = cgroups.Hierarchy(tmp_path / "unified", frozenset({"pids", "io"}), {})
    else:
        hierarchy = cgroups.Hierarchy(tmp_path / "unified", frozenset({"pids"}), {"io": blkio})
    group = cgroups.SandboxCgroup.planned(hierarchy, "sb-1", node="node-7")
    group.disk = "7:3"
    limits = Limits(pids=10, disk_read_bps=8 * MiB, disk_write_bps=4 * MiB, disk_iops=300)
    written: list[tuple[str, str]] = []
    real_write = Path.write_text

    def record(path: Path, text: str, *args: Any, **kwargs: Any) -> int:
        written.append((str(path.relative_to(tmp_path)), text))
        return real_write(path, text, *args, **kwargs)

    monkeypatch.setattr(Path, "write_text", record)
    group.make(hierarchy, limits)
    io = [(path.rsplit("/", 1)[-1], text) for path, text in written if "io" in path]
    if backend == "v2":
        assert io == [
            ("io.max", "254:0 rbps=8388608 riops=300"),
            ("io.max", "7:3 rbps=8388608 riops=300 wbps=4194304 wiops=300"),
        ]
    else:
        mine = [w for w in written if w[0].startswith("blkio/dsec/node-7/sb-1/blkio")]
        root = [w for w in written if w[0].startswith("blkio/blkio")]
        assert sorted(text for _, text in mine) == sorted(
            ["254:0 8388608", "7:3 8388608", "254:0 300", "7:3 300", "7:3 4194304", "7:3 300"]
        )
        assert root == [
            ("blkio/blkio.throttle.write_bps_device", "7:3 4194304"),
            ("blkio/blkio.throttle.write_iops_device", "7:3 300"),
        ]
    assert cgroups.SandboxCgroup.from_state(group.to_state()).disk == "7:3"
    written.clear()
    with pytest.raises(cgroups.CgroupError):  # (a plain tree: its files keep its directories)
        group.remove(timeout_s=0)
    cleared = [w for w in written if w[0].startswith("blkio/blkio")]
    assert cleared == (
        []
        if backend == "v2"
        else [
            ("blkio/blkio.throttle.write_bps_device", "7:3 0"),
            ("blkio/blkio.throttle.write_iops_device", "7:3 0"),
        ]
    )


async def test_a_sandbox_may_watch_changes_but_not_its_neighbours_use_of_shared_files(
    tmp_path: Path,
) -> None:
    """An inotify watch is on the inode: a sandbox watching the shared runtime's files for
    IN_OPEN/IN_ACCESS (through its read-only view) saw each module its neighbours imported.
    Those watches are refused (EPERM); change events on its own files still work."""
    code = (
        "import ctypes, errno, json, os, sys\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = libc.inotify_init1(0)\n"
        "def watch(path, mask):\n"
        "    rc = libc.inotify_add_watch(fd, path.encode(), ctypes.c_uint32(mask))\n"
        "    return 'ok' if rc >= 0 else errno.errorcode[ctypes.get_errno()]\n"
        "lib = os.path.dirname(os.__file__).encode().decode()\n"
        "seen = {'open': watch(lib, 0x20), 'access': watch(lib, 0x1),\n"
        "        'all': watch(lib, 0xFFF), 'changes': watch('/workspace/output', 0x2 | 0x100)}\n"
        "open('/workspace/output/f', 'w').write('x')\n"
        "seen['event'] = len(os.read(fd, 4096)) > 0\n"
        "print(json.dumps(seen))\n"
    )
    async with managed(tmp_path / "home") as manager:
        result = await run_to_end(manager, snippet_config("inotify", code, tmp_path))
    seen = read_json_output(result)
    assert seen == {
        "open": "EPERM",
        "access": "EPERM",
        "all": "EPERM",
        "changes": "ok",
        "event": True,
    }


def test_a_bound_left_on_a_free_loop_device_is_cleared_at_the_next_start(tmp_path: Path) -> None:
    """A node agent that died while a sandbox arrived by CRIU left the v1 root group's write
    bound on its quota's loop device (freed by the next start): the next user of that device
    would be slowed. The next start clears bounds on loop devices no file backs; an attached
    one (maybe another node agent's live sandbox) keeps its bound."""
    import subprocess

    from dsec_nodeagent.sandbox import cgroups

    root = _root_blkio()
    if root is None:  # (io on cgroup v2: io.max per cgroup, no root-group bound to leave)
        assert cgroups.clear_detached_root_io(cgroups.detect()) == []
        return
    image = tmp_path / "img"
    image.write_bytes(b"\0" * (1 << 20))
    attached = subprocess.run(
        ["losetup", "--find", "--show", str(image)], capture_output=True, text=True, check=True
    ).stdout.strip()
    free = subprocess.run(["losetup", "--find"], capture_output=True, text=True, check=True)
    devices = {}
    for path in (attached, free.stdout.strip()):
        st = os.stat(path)
        devices[path] = f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
    rules = root / "blkio.throttle.write_bps_device"
    try:
        for dev in devices.values():
            rules.write_text(f"{dev} 1048576")
        cleared = cgroups.clear_detached_root_io(cgroups.detect())
        left = rules.read_text()
        assert devices[free.stdout.strip()] in cleared
        assert f"{devices[free.stdout.strip()]} " not in left
        assert f"{devices[attached]} 1048576" in left
    finally:
        for dev in devices.values():
            with contextlib.suppress(OSError):
                rules.write_text(f"{dev} 0")
        subprocess.run(["losetup", "-d", attached], check=False)
