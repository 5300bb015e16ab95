"""A sandbox that ends while no node agent watches it (``dsec down --keep-sandboxes``, an agent
stopped for a restart) removes its own cgroups — and with them the egress programs attached
there — and still gets its exit classified at the next start (root)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the test kit
from _dsec_sandbox_testkit import Recorder, leftover_cgroups, managed, snippet_config

from dsec_nodeagent.sandbox import ExitReason, Limits, SandboxManager
from dsec_nodeagent.sandbox.state import is_alive

pytestmark = [pytest.mark.kernel]

WAIT_THEN_EXHAUST_MEMORY = (
    "import os, time\n"
    "while not os.path.exists('/workspace/output/go'):\n"
    "    time.sleep(0.02)\n"
    "hog = [bytearray(1 << 20) for _ in range(512)]\n"
)


async def _until(condition: object, timeout_s: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():  # type: ignore[operator]
        assert loop.time() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_an_unwatched_sandbox_removes_its_cgroup_and_its_oom_is_still_reported(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    first = SandboxManager(home)
    cfg = snippet_config(
        "orphan", WAIT_THEN_EXHAUST_MEMORY, tmp_path, limits=Limits(memory_bytes=64 * 2**20)
    )
    ready = await first.launch(cfg)
    cgroup = Path(ready.cgroup_path)
    supervisor = first.states.read("orphan")["supervisor_pid"]  # type: ignore[index]
    await first.shutdown()  # the node agent is gone; the sandbox keeps running
    assert first.unwatched_marker.exists() and cgroup.is_dir()

    (home / "sandboxes" / "orphan" / "fs" / "workspace__output" / "go").write_text("")
    await _until(lambda: not is_alive(supervisor, None))
    assert not cgroup.exists()  # the sandbox ended and took its cgroup along
    assert leftover_cgroups(["orphan"]) == []

    recorder = Recorder()
    async with managed(home, recorder) as second:
        report = await second.reconcile()
        assert not second.unwatched_marker.exists()
    (result,) = report.cleaned
    assert (result.sandbox_id, result.reason) == ("orphan", ExitReason.OOM)
    assert result.oom_kills >= 1


async def test_a_watched_sandbox_leaves_its_cgroup_to_the_node_agent(tmp_path: Path) -> None:
    async with managed(tmp_path / "home") as manager:
        await manager.launch(snippet_config("watched", "print('hi')", tmp_path))
        result = await manager.wait("watched")
        assert not manager.unwatched_marker.exists()
    assert result.reason is ExitReason.OK


async def test_a_quota_mount_no_sandbox_state_accounts_for_is_released_at_start(
    tmp_path: Path,
) -> None:
    from dsec_nodeagent.sandbox import quota

    home = tmp_path / "home"
    data = home / "sandboxes" / "stray"
    target = quota.create(data, 16 * 2**20)  # an agent died right after mounting it
    (target / "workspace__output").mkdir()
    (target / "workspace__output" / "kept.txt").write_text("x")
    async with managed(home) as manager:
        await manager.reconcile()
    assert not quota.is_mounted(data) and not (data / "disk.img").exists()
    assert (data / "fs" / "workspace__output" / "kept.txt").read_text() == "x"
