"""The node's copies of packs (dsec_snapstore.packcache): bounded, least recently used first out,
only pack names, prefixes honoured, nothing half-written."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from dsec_snapstore.packcache import PackCache

BLOCK = 4096


def key(n: int) -> str:
    return f"packs/{n:064x}"


def test_a_copy_is_read_back_by_range_and_a_read_past_its_end_is_a_miss(tmp_path: Path) -> None:
    cache = PackCache(tmp_path / "packs", 1 << 20)
    body = os.urandom(1000)
    cache.put(key(1), body[:600])  # a prefix: the frames a restore read, without the trailer
    assert cache.read(key(1), 100, 200) == body[100:300]
    assert cache.read(key(1), 0, 600) == body[:600]
    assert cache.read(key(1), 500, 200) is None  # reaches past the copy
    assert cache.read(key(2), 0, 10) is None  # never stored
    cache.put(key(1), body)  # a longer copy replaces it; a shorter one does not
    cache.put(key(1), body[:10])
    assert cache.read(key(1), 900, 100) == body[900:]
    assert cache.size == 4096  # (counted in the blocks it takes on disk)


def test_only_pack_names_are_kept(tmp_path: Path) -> None:
    cache = PackCache(tmp_path / "packs", 1 << 20)
    for hostile in (
        "packs/../../etc/passwd",
        "manifests/abc",
        "packs/" + "g" * 64,
        "packs/" + "a" * 63,
        "packs/" + "A" * 64,
        key(1) + "/x",
    ):
        cache.put(hostile, b"data")
        assert cache.read(hostile, 0, 4) is None
    assert not (tmp_path / "packs").exists() or not any((tmp_path / "packs").iterdir())


def test_the_cache_stays_within_its_limit_least_recently_used_out_first(tmp_path: Path) -> None:
    directory = tmp_path / "packs"
    cache = PackCache(directory, 5 * BLOCK)
    for n in range(5):
        cache.put(key(n), bytes([n]) * BLOCK)  # at the limit, not over it
    assert cache.read(key(0), 0, 10) == b"\0" * 10  # 0 used again: 1 is now the oldest
    cache.put(key(5), b"\5" * BLOCK)  # over: the least recently used goes
    assert cache.size == 5 * BLOCK
    assert cache.read(key(1), 0, 10) is None and not (directory / key(1)[6:]).exists()
    assert all(cache.read(key(n), 0, BLOCK) is not None for n in (0, 2, 3, 4, 5))
    cache.put(key(6), b"\6" * (5 * BLOCK // 4 + 1))  # over a quarter of the cache: never kept
    assert cache.read(key(6), 0, 10) is None and not (directory / key(6)[6:]).exists()


def test_tiny_copies_count_the_blocks_they_take(tmp_path: Path) -> None:
    directory = tmp_path / "packs"
    cache = PackCache(directory, 100 * BLOCK)
    for n in range(200):  # packs of a few small edits: ~95 bytes each
        cache.put(key(n), b"x" * 95)
    assert cache.size == 100 * BLOCK
    assert len(list(directory.iterdir())) == 100


def test_a_new_process_finds_the_copies_in_their_order_of_use_under_a_lowered_limit(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "packs"
    first = PackCache(directory, 1 << 20)
    now = time.time()
    for n in range(4):
        first.put(key(n), bytes([n]) * 100)
        os.utime(directory / key(n)[6:], (now - 100 + n, now - 100 + n))
    first.read(key(0), 0, 1)  # used last: its mtime is now
    (directory / f"{key(9)[6:]}.tmp123.456").write_bytes(b"half")  # a crashed writer's
    os.utime(directory / f"{key(9)[6:]}.tmp123.456", (now - 3600, now - 3600))
    second = PackCache(directory, 2 * BLOCK + 100)  # room for two
    assert second.size == 2 * BLOCK
    assert sorted(p.name for p in directory.iterdir()) == sorted([key(3)[6:], key(0)[6:]])


def test_a_copy_removed_or_cut_short_behind_the_caches_back_is_a_miss(tmp_path: Path) -> None:
    directory = tmp_path / "packs"
    cache = PackCache(directory, 10_000)
    cache.put(key(1), b"x" * 100)
    cache.put(key(2), b"y" * 100)
    (directory / key(1)[6:]).unlink()
    assert cache.read(key(1), 0, 10) is None
    (directory / key(2)[6:]).write_bytes(b"y" * 10)
    assert cache.read(key(2), 50, 10) is None
    assert cache.size == 0


def test_without_room_to_write_nothing_is_kept_and_nothing_is_left_behind(tmp_path: Path) -> None:
    directory = tmp_path / "packs"
    directory.mkdir(mode=0o500)  # not writable
    cache = PackCache(directory, 10_000)
    if os.geteuid() == 0:  # root writes anyway: a file where the directory should be instead
        directory.rmdir()
        directory.write_bytes(b"")
    cache.put(key(1), b"x" * 100)
    assert cache.read(key(1), 0, 10) is None
    assert cache.size == 0


def test_a_copy_kept_behind_is_read_from_memory_then_from_its_file(tmp_path: Path) -> None:
    directory = tmp_path / "packs"
    cache = PackCache(directory, 1 << 20)
    body = os.urandom(1000)
    cache.keep(key(1), body)
    got = cache.read(key(1), 10, 20)  # from memory or, once written, from the file
    assert got is not None and bytes(got) == body[10:30]
    assert cache.flush(10)
    assert (directory / key(1)[6:]).read_bytes() == body
    assert cache.read(key(1), 990, 10) == body[990:]
    cache.close()
    cache.keep(key(2), body)  # closed: nothing more is kept
    assert cache.read(key(2), 0, 10) is None and not (directory / key(2)[6:]).exists()


def test_copies_waiting_beyond_the_pending_limit_are_not_kept(tmp_path: Path) -> None:
    directory = tmp_path / "packs"
    cache = PackCache(directory, 1 << 20, pending_limit=250)
    gate = threading.Event()  # the writer thread waits here: the copies stay in memory
    write = cache.put

    def slow_put(key: str, data: bytes | memoryview, *, own: bool = False) -> None:
        gate.wait(10)
        write(key, data, own=own)

    cache.put = slow_put  # type: ignore[method-assign]
    cache.keep(key(1), b"a" * 100)
    cache.keep(key(2), b"b" * 100)
    cache.keep(key(3), b"c" * 100)  # 300 > 250 bytes would wait: not kept
    assert cache.read(key(2), 0, 3) == b"bbb"
    assert cache.read(key(3), 0, 3) is None
    gate.set()
    assert cache.flush(10)
    assert sorted(p.name for p in directory.iterdir()) == [key(1)[6:], key(2)[6:]]
    cache.close()


def test_close_writes_every_copy_still_waiting(tmp_path: Path) -> None:
    directory = tmp_path / "packs"
    cache = PackCache(directory, 1 << 30)
    bodies = {n: os.urandom(200_000) for n in range(20)}
    for n, body in bodies.items():
        cache.keep(key(n), body)
    cache.close()
    for n, body in bodies.items():
        assert (directory / key(n)[6:]).read_bytes() == body


def test_a_dropped_copy_waiting_to_be_written_is_never_read(tmp_path: Path) -> None:
    cache = PackCache(tmp_path / "packs", 1 << 20)
    cache.keep(key(1), b"x" * 100)
    cache.drop(key(1))
    assert cache.flush(10)
    assert cache.read(key(1), 0, 10) is None
    cache.close()


def _until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
    """Poll ``condition`` (a state of the writer thread, which runs at nice +10) until true."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the writer thread never got there"
        time.sleep(0.005)


def _gated(cache: PackCache) -> threading.Event:
    """Make the writer thread wait at each copy until the returned event is set."""
    gate = threading.Event()
    write = cache.put

    def slow_put(key: str, data: bytes | memoryview, *, own: bool = False) -> None:
        gate.wait(10)
        write(key, data, own=own)

    cache.put = slow_put  # type: ignore[method-assign]
    return gate


def test_a_copy_dropped_while_it_is_written_is_removed_and_a_newer_one_written(
    tmp_path: Path,
) -> None:
    directory = tmp_path / "packs"
    cache = PackCache(directory, 1 << 20)
    gate = _gated(cache)
    remove = cache._remove

    def slow_remove(files: list[str]) -> None:  # a wide window between written and removed
        time.sleep(0.2)
        remove(files)

    cache._remove = slow_remove  # type: ignore[method-assign]
    cache.keep(key(1), b"old" * 100)
    _until(lambda: cache._writing is not None)  # the writer thread has taken it
    assert not cache.flush(0.05)  # a write under way is waited for
    cache.drop(key(1))  # (a GC deleted the pack; its copy did not check)
    gate.set()
    assert cache.flush(10)  # ... and its removal too (flush used to return before it)
    assert not (directory / key(1)[6:]).exists() and cache.read(key(1), 0, 3) is None
    assert cache._pending_bytes == 0
    gate.clear()
    cache.keep(key(1), b"old" * 100)
    _until(lambda: cache._writing is not None)
    cache.drop(key(1))
    cache.keep(key(1), b"new" * 1000)  # kept again meanwhile: this one is written
    gate.set()
    assert cache.flush(10)
    assert (directory / key(1)[6:]).read_bytes() == b"new" * 1000
    assert cache._pending_bytes == 0
    cache.close()


def test_a_failed_removal_of_a_revoked_copy_does_not_leave_flush_waiting(tmp_path: Path) -> None:
    cache = PackCache(tmp_path / "packs", 1 << 20)
    gate = _gated(cache)

    def broken(file: str) -> None:
        raise MemoryError("the removal failed")

    cache.keep(key(1), b"old" * 100)
    _until(lambda: cache._writing is not None)
    cache.drop(key(1))
    cache._discard = broken  # type: ignore[method-assign]  # (the writer's own removal)
    gate.set()
    assert cache.flush(10)  # (it waited forever: the writer died with _writing still set)
    assert cache._writing is None
    cache.keep(key(2), b"next" * 100)  # and the writer goes on
    assert cache.flush(10) and cache.read(key(2), 0, 4) == b"next"
    cache.close()


def test_retain_removes_copies_no_index_names_once_old_enough(tmp_path: Path) -> None:
    directory = tmp_path / "packs"
    cache = PackCache(directory, 1 << 20)
    for n in range(4):
        cache.put(key(n), b"x" * 10)
    old = time.time() - 7200
    for n in (0, 1, 2):
        os.utime(directory / key(n)[6:], (old, old))
    assert cache.retain({key(0)}, min_age_s=3600) == 2  # 1 and 2; 3 is too young to judge
    assert sorted(p.name for p in directory.iterdir()) == sorted([key(0)[6:], key(3)[6:]])
    assert cache.read(key(1), 0, 1) is None


def test_without_a_thread_to_write_nothing_is_kept_and_nothing_raises(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = PackCache(tmp_path / "packs", 1 << 20)

    def refuse(_self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    cache.keep(key(1), b"x" * 100)
    assert cache.read(key(1), 0, 1) is None
    assert cache.flush(1)
    cache.close()


def test_a_copy_whose_time_cannot_be_touched_is_still_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = PackCache(tmp_path / "packs", 1 << 20)
    cache.put(key(1), b"abc" * 100)

    def read_only(*_args: object, **_kwargs: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "utime", read_only)
    assert cache.read(key(1), 3, 3) == b"abc"


def test_an_own_copy_kept_from_a_mutable_buffer_is_a_snapshot_of_it(tmp_path: Path) -> None:
    cache = PackCache(tmp_path / "packs", 1 << 20)
    buffer = bytearray(b"A" * 100)
    cache.keep(key(1), buffer, own=True)  # type: ignore[arg-type]
    buffer[:] = b"B" * 100
    found = cache.read_own(key(1))
    assert found is not None and bytes(found[0]) == b"A" * 100
    cache.close()
