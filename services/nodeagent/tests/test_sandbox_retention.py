"""Retention of ended sandboxes' directories: ``dsec sandbox gc`` and the node agent's policy."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dsec_core import retention

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the test kit
from _dsec_sandbox_testkit import managed, run_to_end, snippet_config


def _entry(sid: str, ended_at: float | None) -> retention.SandboxDir:
    return retention.SandboxDir(sid, Path("/x") / sid, ended_at)


@pytest.mark.unit
def test_choose_takes_only_ended_sandboxes_by_age_and_count() -> None:
    now = 100_000.0
    entries = [
        _entry("running", None),
        _entry("old", now - 90_000),
        _entry("mid", now - 50),
        _entry("new", now - 10),
    ]
    by_age = retention.choose(entries, now, older_than_s=86_400)
    assert [(r.entry.sandbox_id, r.why) for r in by_age] == [("old", "ended 1.0 d ago")]
    by_count = retention.choose(entries, now, older_than_s=None, keep_max=1)
    assert [r.entry.sandbox_id for r in by_count] == ["old", "mid"]
    everything = retention.choose(entries, now, older_than_s=0)
    assert "running" not in [r.entry.sandbox_id for r in everything]


@pytest.mark.unit
def test_an_unmarked_directory_counts_as_ended_only_when_untouched_for_an_hour(
    tmp_path: Path,
) -> None:
    fresh = tmp_path / "sandboxes" / "starting" / "code"
    fresh.mkdir(parents=True)
    stale = tmp_path / "sandboxes" / "legacy"
    stale.mkdir()
    hours_ago = time.time() - 2 * 3600
    os.utime(stale, (hours_ago, hours_ago))
    found = {d.sandbox_id: d.ended_at for d in retention.scan(tmp_path, time.time())}
    assert found["starting"] is None
    assert found["legacy"] == pytest.approx(hours_ago)


@pytest.mark.unit
def test_a_tree_deeper_than_pythons_recursion_is_scanned_and_removed(tmp_path: Path) -> None:
    """A sandbox can leave a tree 2,000 levels deep in its directory: ``os.walk`` and
    ``shutil.rmtree`` recursed once per level, raised RecursionError, and the sweep stopped for
    every sandbox of the node. Walked without recursion, removed with ``rm``."""
    root = tmp_path / "sandboxes" / "deep"
    root.mkdir(parents=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(2000):  # relative to a dir fd: no path grows past PATH_MAX
            os.mkdir("d", dir_fd=fd)
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as fh:
            fh.write(b"x" * 8192)
    finally:
        os.close(fd)
    try:
        old = time.time() - 2 * 3600
        os.utime(root, (old, old))
        [entry] = retention.scan(tmp_path, time.time())
        assert entry.ended_at is None  # walked to the bottom: the file there is new, in use
        removal = retention.Removal(retention.SandboxDir("deep", root, old), "test")
        assert retention.remove(tmp_path, removal) == 8192
        assert not root.exists()
    finally:  # pytest's own clean-up of old tmp dirs recurses too
        subprocess.run(["rm", "-rf", "--", str(root)], check=False)


@pytest.mark.kernel
async def test_node_agent_retention_keeps_at_most_the_newest_ended(tmp_path: Path) -> None:
    from dsec_core.settings import Settings

    from dsec_nodeagent.agent import NodeAgent

    home = tmp_path / "home"
    async with managed(home) as manager:
        for n in range(3):
            await run_to_end(manager, snippet_config(f"e{n}", "print(1)", tmp_path))
            await asyncio.sleep(0.01)  # distinct end times
    settings = Settings(home=home, sandbox_keep_max=1, sandbox_keep_hours=1000)

    async def publish(*_: object) -> None:
        raise AssertionError("retention publishes nothing")

    agent = NodeAgent(settings, publish, lambda: None)  # type: ignore[arg-type,return-value]
    removed = await agent.collect_garbage()
    assert sorted(r.entry.sandbox_id for r in removed) == ["e0", "e1"]
    assert sorted(p.name for p in (home / "sandboxes").iterdir()) == ["e2"]
