"""A sandbox's own bounds, as its workload meets them (root): open files, disk, output logs."""

from __future__ import annotations

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
