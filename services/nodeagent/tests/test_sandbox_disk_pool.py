"""The disk quota's images formatted, attached and mounted ahead (root, real kernel): a start
takes one with a rename and a bind mount, the quota still holds, and nothing — loop device,
mount, file — outlives the node agent, even one that died with images mounted."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the test kit
from _dsec_sandbox_testkit import managed, run_to_end, snippet_config

from dsec_nodeagent.sandbox import ExitReason, Limits, quota

pytestmark = [pytest.mark.kernel]

MiB = 2**20


def _mounts_under(root: Path) -> list[str]:
    with open("/proc/self/mountinfo") as fh:
        points = [line.split()[4] for line in fh]
    return [p for p in points if p == str(root) or p.startswith(f"{root}/")]


def _loops_under(root: Path) -> list[str]:
    """Loop devices whose backing file lies under ``root`` (deleted or not)."""
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            path = backing.read_text().strip()
        except OSError:  # detached meanwhile
            continue
        if path.startswith(f"{root}/"):
            found.append(f"{backing.parent.parent.name}: {path}")
    return found


def _left_behind(root: Path, pool: Path, timeout_s: float = 30.0) -> dict[str, list[str]]:
    """What stays of the pool under ``root``; waits (with a deadline) for the kernel's
    asynchronous release of auto-cleared loop devices."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = sorted(str(p) for p in pool.rglob("*") if p.is_file()) if pool.exists() else []
        found = {"mounts": _mounts_under(root), "loops": _loops_under(root), "files": files}
        if not any(found.values()) or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_a_pooled_image_is_mounted_ahead_taken_by_a_bind_and_cleared(tmp_path: Path) -> None:
    pool = quota.ImagePool(tmp_path / "pool", per_size=1)
    assert pool.take(16 * MiB, tmp_path / "none.img") is None  # nothing ready yet
    assert pool.fill(16 * MiB) == 1 and pool.fill(16 * MiB) == 0
    assert pool.has_mounted(16 * MiB)
    data = tmp_path / "sandboxes" / "s1"
    assert quota.take_mounted(data, 16 * MiB, pool)
    target = quota.mount_point(data)
    assert _mounts_under(target) == [str(target)] and not list(target.iterdir())
    assert (data / quota.IMAGE_NAME).stat().st_size == 16 * MiB
    (target / "out.txt").write_text("kept")
    assert not quota.take_mounted(tmp_path / "sandboxes" / "s2", 16 * MiB, pool)  # none left
    pool.fill(16 * MiB)  # detaches the pool's own mount of the image taken before
    assert quota.is_mounted(data) and (target / "out.txt").read_text() == "kept"
    quota.release(data)
    assert (target / "out.txt").read_text() == "kept" and not quota.is_mounted(data)
    pool.fill(32 * MiB)
    pool.prune({16 * MiB})  # the 32 MiB image goes, with its mount
    assert [p.name.split("-")[0] for p in pool.directory.glob("*.img")] == [str(16 * MiB)]
    pool.clear()
    assert _left_behind(tmp_path, pool.directory) == {"mounts": [], "loops": [], "files": []}


async def test_starts_take_pooled_images_the_quota_holds_and_shutdown_leaves_nothing(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    pool_dir = home / "cache" / "disk-images"
    fill = (
        "import errno\n"
        "try:\n"
        "    with open('/workspace/output/big', 'wb') as fh:\n"
        "        for _ in range(64): fh.write(b'x' * (1 << 20))\n"  # 64 MiB into 24
        "except OSError as exc:\n"
        "    print(errno.errorcode[exc.errno], flush=True)\n"
        "    raise\n"
    )
    limits = Limits(disk_bytes=24 * MiB)
    async with managed(home) as manager:
        first = await run_to_end(manager, snippet_config("first", "print('hi')", tmp_path))
        assert first.reason is ExitReason.OK
        await manager.launch(snippet_config("warm", "print('hi')", tmp_path, limits=limits))
        await manager.wait("warm")
        pool = quota.ImagePool(pool_dir)
        # the images of the sizes just used were formatted and mounted in the background
        await _until(lambda: pool.has_mounted(24 * MiB))
        result = await run_to_end(manager, snippet_config("full", fill, tmp_path, limits=limits))
        assert result.reason is ExitReason.DISK and result.disk_full
        assert "ENOSPC" in Path(result.stdout_path).read_text()
        big = home / "sandboxes" / "full" / "fs" / "workspace__output" / "big"
        assert 16 * MiB < big.stat().st_size <= 24 * MiB
        assert _mounts_under(pool_dir)  # images wait, mounted, for the next starts
    # shutdown (and the cleanup manager's start) removed every image mounted ahead
    assert _left_behind(home, pool_dir) == {"mounts": [], "loops": [], "files": []}


async def test_the_pool_refills_only_after_a_start_and_settle_waits_for_it(tmp_path: Path) -> None:
    """The pool's next image is formatted and mounted a moment after a start, not during it
    (mkfs and the mount would share the CPUs with the start and its workload's interpreter);
    ``settle()`` returns once that background work is done."""
    from dsec_nodeagent.sandbox.manager import IMAGE_REFILL_DELAY_S

    home = tmp_path / "home"
    pool = quota.ImagePool(home / "cache" / "disk-images")
    limits = Limits(disk_bytes=20 * MiB)
    async with managed(home) as manager:

        def ready() -> int:
            return len(list(pool.directory.glob(f"{20 * MiB}-*.img")))

        await run_to_end(manager, snippet_config("one", "print('hi')", tmp_path, limits=limits))
        await manager.settle()
        full = ready()
        assert full >= 1 and pool.has_mounted(20 * MiB)  # the refill after the first start
        taken = time.monotonic()
        await manager.launch(snippet_config("two", "print('hi')", tmp_path, limits=limits))
        if time.monotonic() - taken < IMAGE_REFILL_DELAY_S / 2:  # (a slow machine: no claim)
            assert ready() == full - 1  # the start took one; none formatted yet
            assert manager._image_fill is None or manager._image_fill.done()
        await manager.settle()
        assert ready() == full
        assert manager._image_timer is None and manager._shell is not None
        assert manager._shell.pid is not None  # the next launch's shell, forked
        await manager.wait("two")


async def test_a_size_asked_for_during_a_fill_gets_its_images_in_the_next_round(
    tmp_path: Path,
) -> None:
    """A start that asks for images of a size while the pool is filling others (its round has
    already listed the sizes it fills) is not forgotten: another round follows."""
    home = tmp_path / "home"
    pool = quota.ImagePool(home / "cache" / "disk-images")
    async with managed(home) as manager:
        started, release = threading.Event(), threading.Event()
        real_fill = manager._images.fill

        def held_fill(size: int) -> int:
            started.set()
            release.wait(30)
            return real_fill(size)

        manager._images.fill = held_fill  # type: ignore[method-assign]
        manager._refill_images(20 * MiB)
        manager._fill_images()  # the round starts now (no delay): it fills 20 MiB only
        assert await asyncio.to_thread(started.wait, 30)
        manager._refill_images(28 * MiB)  # a start asks for another size meanwhile
        release.set()
        await manager.settle()
        assert pool.has_mounted(20 * MiB) and pool.has_mounted(28 * MiB)


async def test_images_a_dead_node_agent_mounted_ahead_are_released_at_the_next_start(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    pool_dir = home / "cache" / "disk-images"
    quota.ImagePool(pool_dir).fill(16 * MiB)  # an agent died with these mounted
    assert len(_mounts_under(pool_dir)) == 2 and len(_loops_under(home)) == 2
    async with managed(home) as manager:
        await manager.reconcile()
        assert _left_behind(home, pool_dir) == {"mounts": [], "loops": [], "files": []}
        assert not pool_dir.exists() or not list(pool_dir.glob("*.img"))


async def _until(check: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not within the deadline"
        await asyncio.sleep(0.05)
