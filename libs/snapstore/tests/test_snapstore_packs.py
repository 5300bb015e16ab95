"""Pack files and their index, on an in-memory object store: layout, ranged reads, dedup across
snapshots and stores, GC repacking (and a crash at each of its steps), old one-object-per-chunk
snapshots."""

from __future__ import annotations

import os
import random
import socket
import struct
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zstandard
from nacl.signing import SigningKey

from dsec_snapstore import SnapshotInputs, SnapshotStore, packs
from dsec_snapstore.adapters.objectstore import ObjectExists, ObjectInfo, ObjectMissing
from dsec_snapstore.errors import SnapshotError, StoreBusy, StoreUnavailable, VerificationFailed
from dsec_snapstore.locks import LOCK_PREFIX, STALE_AFTER, StoreLocks
from dsec_snapstore.manifest import GpuRecord, chunk_key, summary_key
from dsec_snapstore.packcache import OWN
from dsec_snapstore.packs import (
    GROUP_CHUNK_MAX,
    PACK_INDEX_PREFIX,
    PACK_MAGIC,
    PACK_PREFIX,
    IndexDoc,
    Loc,
    PackFormatError,
    PackIndex,
    decode_trailer,
    encode_pack,
    index_key,
    plan_reads,
)

KEY = SigningKey.generate()


class Crash(Exception):
    """A simulated crash of the process between two steps."""


@dataclass
class MemoryObjects:
    """An ObjectStore in a dict; ``fail`` is asked before each write and may raise."""

    data: dict[str, tuple[bytes, datetime]] = field(default_factory=dict)
    fail: Callable[[str, str], None] = lambda op, key: None
    puts: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def identity(self) -> str:
        return f"memory/{id(self)}"

    def put(
        self, key: str, data: bytes, *, checked_on_read: bool = False, if_absent: bool = False
    ) -> None:
        self.fail("put", key)
        with self.lock:
            if if_absent and key in self.data:
                raise ObjectExists(key)
            self.data[key] = (bytes(data), datetime.now(UTC))
            self.puts.append(key)

    def get(self, key: str) -> bytes:
        return self.get_range(key, 0, 0)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        try:
            body = self.data[key][0]
        except KeyError:
            raise ObjectMissing(key) from None
        return body[offset : offset + length] if length else body[offset:]

    def exists(self, key: str) -> bool:
        return key in self.data

    def present(self, keys: Collection[str], prefix: str, pool: Executor) -> set[str]:
        return {k for k in keys if k in self.data}

    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        with self.lock:
            items = list(self.data.items())
        return {k: ObjectInfo(len(v), t) for k, (v, t) in items if k.startswith(prefix)}

    def delete_many(self, keys: Iterable[str]) -> None:
        keys = list(keys)
        for key in keys:
            self.fail("delete", key)
        with self.lock:
            for key in keys:
                self.data.pop(key, None)

    def under(self, prefix: str) -> list[str]:
        return sorted(k for k in self.data if k.startswith(prefix))


def make_store(objects: MemoryObjects, cache: Path | None = None) -> SnapshotStore:
    # Small packs, so a few files already make several; one worker, so what goes into which
    # pack is the same on every run.
    return SnapshotStore(objects, signing_key=KEY, cache_dir=cache, workers=1, pack_target=16 << 10)


def inputs(root: Path) -> SnapshotInputs:
    return SnapshotInputs(code_dir=root, kernel={}, gpu=GpuRecord(present=False, reason="test"))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "code"
    rng = random.Random(19)
    for i in range(40):
        path = root / f"pkg{i % 4}" / f"mod{i}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"VALUE_{i} = {rng.randbytes(3000).hex()!r}\n")  # ~3 KB compressed
    (root / "big.bin").write_bytes(rng.randbytes(900_000))  # several CDC chunks
    (root / "empty.txt").write_bytes(b"")
    (root / "link.py").symlink_to("pkg0/mod0.py")
    return root


@pytest.fixture
def objects() -> MemoryObjects:
    return MemoryObjects()


@pytest.fixture
def store(objects: MemoryObjects) -> Iterator[SnapshotStore]:
    with make_store(objects) as s:
        yield s


def aged(root: Path) -> None:
    """Date every file of ``root`` an hour back (files written just now are never trusted
    from a stat cache)."""
    hour_ago = time.time() - 3600
    for path in root.rglob("*"):
        os.utime(path, (hour_ago, hour_ago), follow_symlinks=False)


def same_tree(a: Path, b: Path) -> bool:
    def listing(root: Path) -> dict[str, bytes | str]:
        out: dict[str, bytes | str] = {}
        for path in sorted(root.rglob("*")):
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = "->" + os.readlink(path)
            elif path.is_file():
                out[rel] = path.read_bytes()
        return out

    return listing(a) == listing(b)


# --- layout --------------------------------------------------------------------------------


def test_a_pack_lists_its_chunks_in_a_trailer() -> None:
    comp = zstandard.ZstdCompressor()
    blobs = [(f"id{i}", comp.compress(bytes([i]) * 1000)) for i in range(3)]
    body, entries = encode_pack(blobs)
    assert decode_trailer(body) == [tuple(e) for e in entries]
    _, offset, length = entries[1]
    assert body[offset : offset + length] == blobs[1][1]


def test_near_chunks_are_read_with_one_ranged_get_far_ones_apart() -> None:
    wanted = [
        ("a", Loc("packs/p", 0, 100)),
        ("b", Loc("packs/p", 150, 100)),  # 50 bytes after a: same read
        ("c", Loc("packs/p", 10_000, 100)),  # far: its own read
        ("d", Loc("packs/q", 0, 10)),  # another pack
    ]
    spans = plan_reads(wanted, gap=1000, limit=1 << 20)
    got = {(s.pack, s.start, s.end, tuple(c for c, *_ in s.chunks)) for s in spans}
    assert got == {
        ("packs/p", 0, 250, ("a", "b")),
        ("packs/p", 10_000, 10_100, ("c",)),
        ("packs/q", 0, 10, ("d",)),
    }
    assert len(plan_reads(wanted[:2], gap=1000, limit=200)) == 2  # a read is capped


# --- create, dedup, restore ----------------------------------------------------------------


def test_a_cold_snapshot_writes_few_packs_and_restores(
    store: SnapshotStore, objects: MemoryObjects, tree: Path, tmp_path: Path
) -> None:
    result = store.create("s1", inputs(tree))
    packs = objects.under(PACK_PREFIX)
    assert result.chunks_uploaded == result.chunks_total > 40
    # packs are sealed when full: every pack but the one sealed last holds at least the
    # target (16 KiB here), so there are far fewer objects than chunks
    sizes = sorted(len(objects.get(name)) for name in packs)
    assert len(packs) > 1 and all(size >= 16 << 10 for size in sizes[1:])
    assert len(packs) * 4 <= result.chunks_total
    assert objects.under("chunks/") == []
    assert len(objects.under(PACK_INDEX_PREFIX)) == 1
    store.restore("s1", tmp_path / "out")
    assert same_tree(tree, tmp_path / "out")
    assert store.verify("s1").ok


def test_small_files_share_group_frames_and_a_rollback_reads_one_back(
    store: SnapshotStore, objects: MemoryObjects, tree: Path, tmp_path: Path
) -> None:
    result = store.create("s", inputs(tree))
    rows = [r for p in objects.under(PACK_PREFIX) for r in decode_trailer(objects.get(p))]
    grouped = [r for r in rows if len(r) == 5]
    small = {
        f.blake3
        for f in result.manifest.code.files
        if f.kind == "file" and 0 < f.size <= GROUP_CHUNK_MAX
    }
    assert {r[0] for r in grouped} <= small and len(grouped) >= len(small) // 2
    assert len({(r[1], r[2]) for r in grouped}) < len(grouped) / 4  # many chunks per frame
    assert not any(len(r) == 5 for r in rows if r[0] not in small)  # big chunks: alone
    (tree / "pkg1" / "mod1.py").write_text("CHANGED = 1\n")
    back = store.restore("s", tree, sync=True)  # out of its group frame, checked
    assert back.files_written == 1
    store.restore("s", tmp_path / "out")
    assert same_tree(tree, tmp_path / "out")


def test_dedup_across_snapshots_and_stores_survives_packing(
    objects: MemoryObjects, tree: Path, tmp_path: Path
) -> None:
    with make_store(objects) as first:
        first.create("s1", inputs(tree))
    (tree / "new.py").write_text("NEW = 1\n")
    packs_before = set(objects.under(PACK_PREFIX))
    # Another store (another node, no stat cache, nothing in memory): only the new file's
    # chunk is stored, in one new pack.
    with make_store(objects, tmp_path / "cache") as second:
        result = second.create("s2", inputs(tree))
        assert result.chunks_uploaded == 1
        assert len(set(objects.under(PACK_PREFIX)) - packs_before) == 1
        second.restore("s2", tmp_path / "out")
    assert same_tree(tree, tmp_path / "out")


def test_an_altered_pack_is_named_and_nothing_is_restored(
    store: SnapshotStore, objects: MemoryObjects, tree: Path, tmp_path: Path
) -> None:
    result = store.create("s", inputs(tree))
    entry = result.manifest.code.by_path()["pkg1/mod1.py"]
    loc = store.index.lookup(entry.blake3)
    assert loc is not None
    body = bytearray(objects.get(loc.pack))
    body[loc.offset + loc.length - 5] ^= 0xFF
    objects.data[loc.pack] = (bytes(body), datetime.now(UTC))
    report = store.verify("s")
    # The altered frame (small files share a group frame) is named, with the file whose bytes
    # no longer match; nothing else is.
    in_frame = {
        f.path
        for f in result.manifest.code.files
        if (other := store.index.lookup(f.blake3)) and other.offset == loc.offset
    }
    assert "pkg1/mod1.py" in in_frame and report.problems
    for problem in report.problems:
        assert f"{loc.pack}@{loc.offset}:" in problem
        assert any(f"used by {path}" in problem for path in in_frame)
    with pytest.raises(VerificationFailed, match=loc.pack):
        store.restore("s", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_crash_while_packing_leaves_no_snapshot_and_gc_removes_the_packs(
    objects: MemoryObjects, tree: Path
) -> None:
    puts = 0

    def fail(op: str, key: str) -> None:
        nonlocal puts
        if op == "put" and key.startswith(PACK_PREFIX):
            puts += 1
            if puts == 3:
                raise Crash(key)

    objects.fail = fail
    with make_store(objects) as store, pytest.raises(Crash):
        store.create("s", inputs(tree))
    assert objects.under(PACK_INDEX_PREFIX) == [] and objects.under("snapshots/") == []
    objects.fail = lambda op, key: None
    with make_store(objects) as store:
        store.gc(grace=timedelta(0))
    assert objects.under(PACK_PREFIX) == []


# --- GC ------------------------------------------------------------------------------------


def two_snapshots(store: SnapshotStore, tree: Path) -> tuple[set[str], set[str]]:
    s1 = store.create("s1", inputs(tree)).manifest
    (tree / "big.bin").write_bytes(random.Random(2).randbytes(900_000))
    for i in range(0, 40, 3):  # dead chunks beside live ones in s1's packs
        (tree / f"pkg{i % 4}" / f"mod{i}.py").write_text(f"CHANGED = {i}\n")
    s2 = store.create("s2", inputs(tree)).manifest
    return s1.all_chunks(), s2.all_chunks()


def test_gc_repacks_mostly_dead_packs_and_keeps_every_live_chunk(
    store: SnapshotStore, objects: MemoryObjects, tree: Path, tmp_path: Path
) -> None:
    only_s1, in_s2 = (lambda a, b: (a - b, b))(*two_snapshots(store, tree))
    store.delete("s1")
    before = set(objects.under(PACK_PREFIX))
    report = store.gc(grace=timedelta(0), repack_below=0.99)
    assert report.chunks_removed == len(only_s1)
    assert report.packs_repacked >= 1 and report.bytes_freed > 0
    assert set(report.deleted) <= before
    assert len(objects.under(PACK_INDEX_PREFIX)) == 1  # one document supersedes the others
    stored = set()
    for pack in objects.under(PACK_PREFIX):
        stored |= {c for c, *_ in decode_trailer(objects.get(pack))}
    assert in_s2 <= stored and not (only_s1 & stored)
    with make_store(objects) as fresh:  # reads the new index from scratch
        assert fresh.verify("s2").ok
        fresh.restore("s2", tmp_path / "out")
    assert same_tree(tree, tmp_path / "out")
    assert store.verify("s2").ok  # its in-memory index is current too


def _copies(store: SnapshotStore) -> set[str]:
    """The packs ``store``'s node holds copies of (once every copy waiting is written)."""
    assert store.pack_cache is not None and store.pack_cache.flush(10)
    return {
        f"{PACK_PREFIX}{p.name.removesuffix(OWN)}" for p in store.pack_cache.directory.iterdir()
    }


@pytest.mark.parametrize("where", ["the node's own process", "another process"])
def test_copies_of_the_packs_a_gc_deleted_leave_the_node(
    objects: MemoryObjects, tree: Path, tmp_path: Path, where: str
) -> None:
    with make_store(objects, tmp_path / "node") as node:
        two_snapshots(node, tree)
        assert _copies(node) == set(objects.under(PACK_PREFIX))
        if where == "another process":
            with make_store(objects) as service:  # (the snapshot service: no copies of its own)
                service.delete("s1")
                report = service.gc(grace=timedelta(0), repack_below=0.99)
            deleted = [k for k in report.deleted if k.startswith(PACK_PREFIX)]
            assert node.prune_pack_cache(min_age_s=3600) == 0  # too young to judge yet
            assert node.prune_pack_cache(min_age_s=0) == len(deleted)
        else:  # the GC drops them itself
            node.delete("s1")
            report = node.gc(grace=timedelta(0), repack_below=0.99)
        gone = {k for k in report.deleted if k.startswith(PACK_PREFIX)}
        kept = _copies(node)
        assert gone and kept and not (kept & gone) and kept <= set(objects.under(PACK_PREFIX))
        node.restore("s2", tmp_path / "out")
    assert same_tree(tree, tmp_path / "out")


def test_gc_dry_run_and_grace_delete_nothing(
    store: SnapshotStore, objects: MemoryObjects, tree: Path
) -> None:
    two_snapshots(store, tree)
    store.delete("s1")
    stored = dict(objects.data)
    assert store.gc(grace=timedelta(0), dry_run=True).chunks_removed > 0
    assert store.gc(grace=timedelta(hours=1)).deleted == ()
    assert objects.under(PACK_PREFIX) == sorted(k for k in stored if k.startswith(PACK_PREFIX))


@pytest.mark.parametrize(
    "crash_at",
    [
        ("put", PACK_PREFIX),  # step 1: a new pack
        ("put", PACK_INDEX_PREFIX),  # step 2: the new index
        ("delete", PACK_INDEX_PREFIX),  # step 3: the superseded documents
        ("delete", PACK_PREFIX),  # step 4: the old packs
    ],
    ids=["new-pack", "new-index", "old-index", "old-packs"],
)
def test_a_gc_crash_at_any_step_loses_no_live_chunk(
    store: SnapshotStore, objects: MemoryObjects, tree: Path, crash_at: tuple[str, str]
) -> None:
    two_snapshots(store, tree)
    store.delete("s1")

    def fail(op: str, key: str) -> None:
        if (op, key[: len(crash_at[1])]) == crash_at:
            raise Crash(f"{op} {key}")

    objects.fail = fail
    with pytest.raises(Crash):
        store.gc(grace=timedelta(0), repack_below=0.99)
    objects.fail = lambda op, key: None
    with make_store(objects) as fresh:
        assert fresh.verify("s2").ok  # after the crash: every chunk reachable and intact
        fresh.gc(grace=timedelta(0), repack_below=0.99)  # the next GC finishes the job
        assert fresh.verify("s2").ok
        assert fresh.index.effective == objects.under(PACK_INDEX_PREFIX)  # one, in force
        indexed = {p for d in fresh.index.docs.values() for p in d.packs}
    assert set(objects.under(PACK_PREFIX)) == indexed  # no orphan left, none missing


def test_gc_stops_before_deleting_when_a_live_chunk_does_not_check(
    store: SnapshotStore, objects: MemoryObjects, tree: Path
) -> None:
    _, in_s2 = two_snapshots(store, tree)
    store.delete("s1")
    live = sorted(in_s2)[0]
    loc = store.index.lookup(live)
    assert loc is not None
    body = bytearray(objects.get(loc.pack))
    body[loc.offset + 3] ^= 0xFF
    objects.data[loc.pack] = (bytes(body), datetime.now(UTC))
    stored = set(objects.under(PACK_PREFIX))
    with pytest.raises(SnapshotError, match="do not check"):
        store.gc(grace=timedelta(0), repack_below=1.1)  # everything is repacked
    assert set(objects.under(PACK_PREFIX)) >= stored


# --- the index in memory ----------------------------------------------------------------------


def _doc(pack: str, chunks: Iterable[str], supersedes: tuple[str, ...] = ()) -> IndexDoc:
    return IndexDoc({pack: [[c, 100 * n, 100] for n, c in enumerate(chunks)]}, supersedes)


def _where(index: PackIndex, chunks: Iterable[str]) -> dict[str, str | None]:
    return {c: loc.pack if (loc := index.lookup(c)) else None for c in chunks}


def _nested(depth: int) -> bytes:
    """MessagePack of ``[[[...0...]]]``, ``depth`` arrays deep (msgpack's packer stops at 512)."""
    return b"\x91" * depth + b"\x00"


def _pack(*items: Any) -> bytes:
    return b"".join(item if isinstance(item, bytes) else msgpack.packb(item) for item in items)


@pytest.mark.parametrize(
    "body",
    [
        {"v": 1, "packs": {"packs/x": [["c1", "0", 10]]}},  # an offset that is a string
        {"v": 1, "packs": {"packs/x": [["c1", -5, 10]]}},  # a negative offset
        {"v": 1, "packs": {"packs/x": [["c1", 0]]}},  # a row too short
        {"v": 2, "packs": {"packs/x": [["c1", 0, 10, 0, 5, 9]]}},  # a row too long
        {"v": 1, "packs": {"packs/x": [[7, 0, 10]]}},  # a chunk id that is no string
        {"v": 3, "packs": {}},  # a version this reader does not know
        {"v": 1, "packs": [["c1", 0, 10]]},  # packs that are no map
        {"v": 2, "packs": {"packs/x": [["c1", 0, 10, 7, -1]]}},  # a start without a size
        pytest.param(  # a field this reader does not know, nested deeper than its stack
            b"\x83" + _pack("v", 1, "packs", {}, "x", _nested(2000)), id="deep-unknown-field"
        ),
    ],
)
def test_a_malformed_index_document_is_ignored_and_the_others_still_serve(
    objects: MemoryObjects,
    body: dict[str, Any] | bytes,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An index document under its right key (anyone who can write the bucket can make one) is
    still read with suspicion: a row of the wrong shape makes the whole document ignored, as an
    altered one is, instead of failing every later read of the index."""
    PackIndex(objects).write(_doc("packs/a", ["a1", "a2"]))
    bad = body if isinstance(body, bytes) else msgpack.packb(body, use_bin_type=True)
    objects.put(index_key(bad), bad)
    with pytest.raises(PackFormatError, match="not a version 1 or 2 pack index document"):
        IndexDoc.decode(bad)
    reader = PackIndex(objects, tmp_path / "index-cache")
    with caplog.at_level("WARNING", logger="dsec_snapstore.packs"):
        reader.refresh()
    assert f"pack index document {index_key(bad)} ignored: " in caplog.text  # (said once)
    assert _where(reader, ["a1", "a2", "c1"]) == {"a1": "packs/a", "a2": "packs/a", "c1": None}
    assert reader.effective == [k for k in objects.under(PACK_INDEX_PREFIX) if k != index_key(bad)]
    # Its bytes are its name, so they never decode: not read again, not kept in the cache.
    read: list[str] = []
    get = objects.get
    objects.get = lambda key: read.append(key) or get(key)  # type: ignore[method-assign]
    caplog.clear()
    reader.refresh()
    assert read == [] and "ignored" not in caplog.text
    cached = tmp_path / "index-cache" / index_key(bad)[len(PACK_INDEX_PREFIX) :]
    assert not cached.exists()
    cached.write_bytes(bad)  # as an older version kept it (it cached before it decoded)
    again = PackIndex(objects, tmp_path / "index-cache")
    again.refresh()
    assert not cached.exists() and _where(again, ["a1", "c1"]) == {"a1": "packs/a", "c1": None}


@pytest.mark.parametrize(
    "rows",
    [
        [["c1", 0, 10], ["c2", "10", 10]],  # an offset that is a string
        [["c1", 0, 10], ["c2", 10, 10, 5, -1]],  # a start without a size
        pytest.param(  # a sixth field, nested deeper than the stack
            b"\x92" + _pack(["c1", 0, 10]) + b"\x96" + _pack("c2", 10, 10, 0, 5, _nested(2000)),
            id="deep-sixth-field",
        ),
    ],
)
def test_a_pack_trailer_with_a_malformed_row_is_refused(rows: list[Any] | bytes) -> None:
    trailer = rows if isinstance(rows, bytes) else msgpack.packb(rows, use_bin_type=True)
    body = b"x" * 20 + trailer + struct.pack("<I", len(trailer)) + PACK_MAGIC
    with pytest.raises(PackFormatError, match="pack trailer unreadable"):
        decode_trailer(body)
    long = b"x" * 20 + struct.pack("<I", 1 << 20) + PACK_MAGIC  # claims more than there is
    with pytest.raises(PackFormatError, match="pack trailer unreadable"):
        decode_trailer(long)


def test_each_new_index_document_costs_its_own_rows_not_the_stores(
    objects: MemoryObjects, monkeypatch: pytest.MonkeyPatch
) -> None:
    index = PackIndex(objects)
    index.write(_doc("packs/a", (f"a{n}" for n in range(5000))))
    seen: list[tuple[str, int]] = []  # every location made: (pack, offset)
    real = packs.Loc

    def counted(pack: str, offset: int, *rest: int) -> Loc:
        seen.append((pack, offset))
        return real(pack, offset, *rest)

    monkeypatch.setattr(packs, "Loc", counted)
    rebuilt: list[None] = []
    rebuild = PackIndex._rebuild

    def rebuilding(self: PackIndex) -> None:
        rebuilt.append(None)
        rebuild(self)

    monkeypatch.setattr(PackIndex, "_rebuild", rebuilding)
    index.write(_doc("packs/b", ["b1", "b2", "a7"]))  # a7: stored already (a race of two writers)
    other = PackIndex(objects)
    other.refresh()  # a second process reads both documents
    seen.clear()
    third = _doc("packs/c", ["c1"]).encode()
    objects.put(index_key(third), third)
    other.refresh()  # and then a third one another process wrote
    assert seen == [("packs/c", 0)]
    assert not rebuilt
    assert _where(index, ["a0", "a4999", "b1", "b2", "a7"]) == {
        "a0": "packs/a", "a4999": "packs/a", "b1": "packs/b", "b2": "packs/b", "a7": "packs/a",
    }  # fmt: skip
    assert _where(other, ["a0", "b2", "c1"]) == {"a0": "packs/a", "b2": "packs/b", "c1": "packs/c"}
    assert _where(other, ["a7"])["a7"] in ("packs/a", "packs/b")  # either copy reads back
    assert len(other.effective) == 3


def test_a_document_that_supersedes_others_moves_their_chunks_and_a_late_superseded_one_is_ignored(
    objects: MemoryObjects,
) -> None:
    index = PackIndex(objects)
    first = index.write(_doc("packs/a", ["x", "y", "gone"]))
    second = index.write(_doc("packs/b", ["z"]))
    repacked = index.write(_doc("packs/r", ["x", "y", "z"], supersedes=(first, second)))
    assert index.effective == [repacked]
    assert _where(index, ["x", "y", "z", "gone"]) == {
        "x": "packs/r", "y": "packs/r", "z": "packs/r", "gone": None,
    }  # fmt: skip
    # A process that read only the GC's document, and then lists one it superseded (written
    # before the GC, not yet deleted): that one names packs about to go and is not taken.
    objects.delete_many([first])
    late = PackIndex(objects)
    late.refresh()
    objects.put(first, _doc("packs/a", ["x", "y", "gone"]).encode())
    late.refresh()
    assert late.effective == [repacked]
    assert _where(late, ["x", "gone"]) == {"x": "packs/r", "gone": None}
    objects.delete_many([repacked])  # a document removed: the map is read again from the rest
    late.refresh()
    assert sorted(late.effective) == sorted([first, second])
    assert _where(late, ["x", "z", "gone"]) == {"x": "packs/a", "z": "packs/b", "gone": "packs/a"}


def test_a_listing_older_than_a_gc_does_not_undo_it(
    objects: MemoryObjects, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two threads refresh at once; the one whose listing predates a GC applies it last. It
    must neither drop the GC's document nor bring back the one it superseded (whose packs the
    GC deletes): a snapshot would then name chunks stored nowhere."""
    index = PackIndex(objects)
    old = index.write(_doc("packs/a", ["x", "y"]))
    stale = set(objects.list(PACK_INDEX_PREFIX))  # a listing taken now...
    repacked = _doc("packs/r", ["x", "y"], supersedes=(old,)).encode()
    objects.put(index_key(repacked), repacked)  # ...then a GC (another process) repacks
    objects.delete_many([old])
    real_list = objects.list
    calls: list[str] = []

    def listing(prefix: str) -> dict[str, ObjectInfo]:
        calls.append(prefix)
        if len(calls) == 1:  # the slow thread's listing: meanwhile the other one refreshes
            index.refresh()
            return {k: v for k, v in real_list(prefix).items() if k in stale} | {
                old: ObjectInfo(1, datetime.now(UTC))
            }
        return real_list(prefix)

    monkeypatch.setattr(objects, "list", listing)
    index.refresh()
    assert index.effective == [index_key(repacked)]
    assert _where(index, ["x", "y"]) == {"x": "packs/r", "y": "packs/r"}
    docs, effective = index.read()
    assert effective == [index_key(repacked)] and set(effective) <= docs.keys()


# --- snapshots from before packs -----------------------------------------------------------


def test_a_snapshot_of_one_object_per_chunk_still_restores_and_is_collected_as_before(
    objects: MemoryObjects, tree: Path, tmp_path: Path
) -> None:
    with make_store(objects) as store:
        old = store.create("old", inputs(tree)).manifest
    # Rewrite it in the old layout: each chunk its own zstd object under chunks/, no packs.
    for pack in objects.under(PACK_PREFIX):
        body = objects.get(pack)
        for chunk_id, offset, length, *inner in decode_trailer(body):
            frame = body[offset : offset + length]
            if inner:  # a chunk of a group frame: compressed alone, as it used to be
                data = zstandard.ZstdDecompressor().decompress(frame)
                frame = zstandard.ZstdCompressor().compress(data[inner[0] : inner[0] + inner[1]])
            objects.put(chunk_key(chunk_id), frame)
    objects.delete_many(objects.under(PACK_PREFIX) + objects.under(PACK_INDEX_PREFIX))
    objects.put(chunk_key("0" * 64), zstandard.ZstdCompressor().compress(b"unreferenced"))
    with make_store(objects, tmp_path / "cache") as store:
        store.restore("old", tmp_path / "out")
        assert same_tree(tree, tmp_path / "out")
        assert store.verify("old").ok
        report = store.gc(grace=timedelta(0))
        assert report.deleted == (chunk_key("0" * 64),)
        (tree / "new.py").write_text("NEW = 2\n")
        new = store.create("new", inputs(tree))  # new chunks go into packs
        assert objects.under(PACK_PREFIX) and new.chunks_uploaded == new.chunks_total
    assert {chunk_key(c) for c in old.all_chunks()} <= set(objects.under("chunks/"))


def test_a_manifest_write_retried_after_its_first_try_was_stored_is_the_snapshot_not_a_clash(
    objects: MemoryObjects, tree: Path
) -> None:
    """S3 clients retry a PUT whose answer was lost (or a 5xx); the retry of a create-only
    write then finds the object its first try stored. That is this snapshot, not another of
    its name: the create succeeds, with its listing row and everything else."""
    real_put = objects.put

    def put_twice(key: str, data: bytes, **kwargs: bool) -> None:
        if key.startswith("snapshots/"):
            real_put(key, data, **kwargs)  # stored; the answer lost, the client tries again
        real_put(key, data, **kwargs)

    objects.put = put_twice  # type: ignore[method-assign]
    with make_store(objects) as store:
        taken = store.create("s1", inputs(tree))
        assert [s.name for s in store.list_snapshots()] == ["s1"]
        assert store.load("s1").id == taken.manifest.id
        assert store.verify("s1").ok


def test_a_parent_deleted_collected_and_taken_again_under_its_name_is_not_trusted(
    objects: MemoryObjects, tree: Path, tmp_path: Path
) -> None:
    """A directory's stat cache lists the chunks of its last snapshot, trusted while that
    snapshot exists. Deleted, its chunks collected and its name taken by a snapshot of another
    directory, it does not: the next snapshot of the first directory reads its files again and
    stores what it names."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "main.py").write_text("print('another tree')\n")
    aged(tree)
    with make_store(objects, tmp_path / "cache") as store:
        store.create("base", inputs(tree))
        store.delete("base")
        store.gc(grace=timedelta(0))
        store.create("base", inputs(other))  # the name again, another tree
        (tree / "pkg0" / "mod0.py").write_text("CHANGED = 1\n")
        taken = store.create("next", inputs(tree))
        assert taken.files_rehashed == taken.files - 1  # (all but the link: nothing trusted)
        assert store.verify("next").ok
        store.restore("next", tmp_path / "out")
    assert same_tree(tree, tmp_path / "out")


def test_a_snapshot_deleted_while_gc_reads_the_manifests_is_collected_not_an_error(
    store: SnapshotStore, objects: MemoryObjects, tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """GC lists the manifests, then reads each; one deleted in between (a user's rm) is a
    snapshot that no longer keeps its chunks, not a reason to stop collecting."""
    s1, s2 = two_snapshots(store, tree)
    real_get = objects.get

    def get(key: str) -> bytes:
        if key == "snapshots/s1.json":  # deleted just after the listing (as rm does)
            objects.delete_many([key, "snapshot-index/s1.json"])
        return real_get(key)

    monkeypatch.setattr(objects, "get", get)
    report = store.gc(grace=timedelta(0), repack_below=0.99)
    assert report.chunks_removed == len(s1 - s2) > 0
    assert store.verify("s2").ok


def test_a_listing_row_left_without_its_manifest_does_not_vouch_for_a_stat_cache(
    objects: MemoryObjects, tree: Path, tmp_path: Path
) -> None:
    """A delete removes the manifest and the listing row in one request, which S3 may carry out
    in part. A row left alone (its id matching the cache's) proves nothing: the chunks were
    collected with the manifest gone, and the next snapshot reads the directory again."""
    aged(tree)
    with make_store(objects, tmp_path / "cache") as store:
        store.create("base", inputs(tree))
        objects.delete_many(["snapshots/base.json"])  # the row stays
        store.gc(grace=timedelta(0))
        (tree / "pkg0" / "mod0.py").write_text("CHANGED = 1\n")
        taken = store.create("next", inputs(tree))
        assert taken.files_rehashed == taken.files - 1
        assert store.verify("next").ok


def test_a_listing_row_nested_past_the_stack_does_not_vouch_for_a_stat_cache_or_fail_a_create(
    objects: MemoryObjects, tree: Path, tmp_path: Path
) -> None:
    """Anyone who writes the bucket can replace a listing row with JSON nested deeper than the
    parser's stack: the next create reads the directory again, it does not fail."""
    aged(tree)
    with make_store(objects, tmp_path / "cache") as store:
        store.create("base", inputs(tree))
        objects.put(summary_key("base"), b"[" * 100_000)
        (tree / "pkg0" / "mod0.py").write_text("CHANGED = 1\n")
        taken = store.create("next", inputs(tree))
        assert taken.files_rehashed == taken.files - 1  # (read again: as the test above)
        assert store.verify("next").ok


# --- a GC and the creates of other processes (locks in the store) ----------------------------


def _other_process(objects: MemoryObjects, **waits: float) -> SnapshotStore:
    """Another SnapshotStore on the same objects: what another process (the CLI, another node's
    snapshot service) is to this one; nothing in memory is shared."""
    return SnapshotStore(
        objects,
        signing_key=KEY,
        workers=1,
        pack_target=16 << 10,
        **waits,  # type: ignore[arg-type]
    )


def test_a_gc_in_another_process_never_deletes_a_chunk_a_running_create_reuses(
    store: SnapshotStore, objects: MemoryObjects, tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """s1 is deleted; its chunks are dead and their packs old enough to go. A create of the
    same tree reuses them (dedup) while another process's GC runs: without the store's lock the
    GC deleted those packs and the create stored a snapshot naming chunks stored nowhere."""
    store.create("s1", inputs(tree))
    store.delete("s1")
    hashed = threading.Event()
    go_on = threading.Event()
    real_hash_all = store._hash_all

    def paused(*args: object, **kwargs: object) -> object:
        result = real_hash_all(*args, **kwargs)  # type: ignore[arg-type]
        hashed.set()  # the chunks are found stored already: nothing uploaded for them
        assert go_on.wait(30)
        return result

    monkeypatch.setattr(store, "_hash_all", paused)
    creating = ThreadPoolExecutor(1).submit(store.create, "s2", inputs(tree))
    assert hashed.wait(30)
    with _other_process(objects, gc_wait_s=0.2) as other:
        packs_before = objects.under(PACK_PREFIX)
        with pytest.raises(StoreBusy, match=r"locked by locks/shared-.*snapshot create 's2'"):
            other.gc(grace=timedelta(0))
        assert objects.under(PACK_PREFIX) == packs_before  # nothing collected
        go_on.set()
        assert creating.result(30).chunks_uploaded == 0  # every chunk reused
        assert objects.under(LOCK_PREFIX) == []  # released
        other.gc(grace=timedelta(0))  # now it runs, and keeps what s2 names
    assert store.verify("s2").ok
    restored = store.restore("s2", tree.parent / "back")
    assert same_tree(tree, restored.dest)


def test_a_create_waits_for_another_processs_gc_then_goes_on(
    store: SnapshotStore, objects: MemoryObjects, tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lock_lists = threading.Semaphore(0)
    real_list = objects.list

    def counted(prefix: str) -> dict[str, ObjectInfo]:
        if prefix == LOCK_PREFIX:
            lock_lists.release()
        return real_list(prefix)

    monkeypatch.setattr(objects, "list", counted)
    with _other_process(objects) as other, other.locks.exclusive(1.0):
        creating = ThreadPoolExecutor(1).submit(store.create, "s", inputs(tree))
        for _ in range(4):  # (the GC's own listing, then) it tried, stepped back, looked again
            assert lock_lists.acquire(timeout=30)
        assert not creating.done() and objects.under("snapshots/") == []
    assert creating.result(30).files > 0  # the GC's lock released: the create went on
    assert store.verify("s").ok and objects.under(LOCK_PREFIX) == []


def test_a_create_that_waited_too_long_says_who_holds_the_store_and_leaves_nothing(
    objects: MemoryObjects, tree: Path
) -> None:
    with _other_process(objects) as gc_side, gc_side.locks.exclusive(1.0) as held:
        with (
            _other_process(objects, create_wait_s=0.1) as store,
            pytest.raises(StoreBusy) as caught,
        ):
            store.create("s", inputs(tree))
        text = str(caught.value)
        assert "snapshot create 's'" in text and held in text
        assert f"snapshot gc by {socket.gethostname()}:{os.getpid()}" in text
        assert "Try again later" in text
        assert objects.under(LOCK_PREFIX) == [held]  # its own lock removed
        assert objects.under(PACK_PREFIX) == [] and objects.under("snapshots/") == []


def test_a_crashed_holders_lock_is_ignored_once_stale_and_removed_by_the_next_gc(
    store: SnapshotStore, objects: MemoryObjects, tree: Path
) -> None:
    stale = datetime.now(UTC) - STALE_AFTER - timedelta(seconds=5)
    objects.data[LOCK_PREFIX + "exclusive-crashed.json"] = (b"{}", stale)
    objects.data[LOCK_PREFIX + "shared-crashed.json"] = (b"{}", stale)
    store.create("s", inputs(tree))  # not held back by the dead GC's lock
    store.gc(grace=timedelta(0))  # nor the GC by the dead create's; both removed
    assert objects.under(LOCK_PREFIX) == []
    assert store.verify("s").ok


def test_two_gcs_in_two_processes_do_not_run_at_once(objects: MemoryObjects, tree: Path) -> None:
    with (
        _other_process(objects, gc_wait_s=0.1) as first,
        _other_process(objects, gc_wait_s=0.1) as second,
    ):
        first.create("s", inputs(tree))
        with first.locks.exclusive(1.0), pytest.raises(StoreBusy, match="snapshot gc"):
            second.gc(grace=timedelta(0))
        second.gc(grace=timedelta(0))


def _paused_hash(
    store: SnapshotStore, monkeypatch: pytest.MonkeyPatch
) -> tuple[threading.Event, threading.Event]:
    hashed, go_on = threading.Event(), threading.Event()
    real = store._hash_all

    def paused(*args: object, **kwargs: object) -> object:
        result = real(*args, **kwargs)  # type: ignore[arg-type]
        hashed.set()
        assert go_on.wait(30)
        return result

    monkeypatch.setattr(store, "_hash_all", paused)
    return hashed, go_on


def test_a_create_whose_lock_could_not_be_refreshed_stores_no_manifest(
    store: SnapshotStore, objects: MemoryObjects, tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store went away from this create long enough for its lock to look stale to others
    (a GC elsewhere may have removed it and run): it must not write a manifest naming chunks
    that GC may have deleted."""
    store.locks = StoreLocks(objects, stale_after=timedelta(seconds=0.2), refresh_s=0.01)
    hashed, go_on = _paused_hash(store, monkeypatch)
    failed_refreshes = threading.Semaphore(0)

    def refresh_fails(op: str, key: str) -> None:
        if op == "put" and key.startswith(LOCK_PREFIX) and hashed.is_set():
            failed_refreshes.release()
            raise StoreUnavailable("S3 unreachable from here")

    creating = ThreadPoolExecutor(1).submit(store.create, "s", inputs(tree))
    assert hashed.wait(30)
    objects.fail = refresh_fails
    assert failed_refreshes.acquire(timeout=30)  # the store is gone from here
    time.sleep(0.25)  # (time for the lock to go unwritten past its margin: what is tested)
    go_on.set()
    with pytest.raises(StoreUnavailable, match=r"went unwritten for \d+ s or more"):
        creating.result(30)
    assert objects.under("snapshots/") == []  # no manifest: the packs are orphans GC removes
    assert objects.under(LOCK_PREFIX) == []  # (deletes still worked: released)


def test_a_lock_that_the_listing_does_not_show_is_not_taken(
    objects: MemoryObjects, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A store whose listing lags its writes would let two parties each miss the other."""
    real_list = objects.list
    monkeypatch.setattr(
        objects, "list", lambda prefix: {} if prefix == LOCK_PREFIX else real_list(prefix)
    )
    with pytest.raises(StoreUnavailable, match="written but is not listed"):
        StoreLocks(objects).acquire("shared", 1.0, "snapshot create")
    assert objects.under(LOCK_PREFIX) == []


def test_a_lock_whose_write_answer_was_lost_is_removed(
    objects: MemoryObjects, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_put = objects.put

    def stored_then_failed(key: str, data: bytes, **kwargs: bool) -> None:
        real_put(key, data, **kwargs)
        raise StoreUnavailable("connection reset (the object was stored)")

    monkeypatch.setattr(objects, "put", stored_then_failed)
    with pytest.raises(StoreUnavailable, match="connection reset"):
        StoreLocks(objects).acquire("exclusive", 1.0, "snapshot gc")
    assert objects.under(LOCK_PREFIX) == []


def test_a_release_that_fails_once_is_tried_again(objects: MemoryObjects) -> None:
    failures = [StoreUnavailable("503 slow down")]

    def once(op: str, key: str) -> None:
        if op == "delete" and failures:
            raise failures.pop()

    with StoreLocks(objects).shared(1.0):
        objects.fail = once
    assert not failures and objects.under(LOCK_PREFIX) == []


def test_a_waiting_gc_holds_new_creates_back_so_overlapping_creates_cannot_starve_it(
    objects: MemoryObjects, tree: Path
) -> None:
    """Creates that overlap one another would always leave a shared lock in the store: a GC
    that waits says so (``locks/waiting-…``) and new creates step back for it."""
    running = StoreLocks(objects)
    first = running.acquire("shared", 1.0, "snapshot create 'long'")  # a create running
    waiting_written = threading.Event()
    objects.fail = lambda op, key: (
        waiting_written.set() if op == "put" and key.startswith(LOCK_PREFIX + "waiting-") else None
    )
    with (
        _other_process(objects, gc_wait_s=30) as gc_side,
        _other_process(objects, create_wait_s=0.1) as creator,
    ):
        collecting = ThreadPoolExecutor(1).submit(gc_side.gc, grace=timedelta(0))
        assert waiting_written.wait(30)
        with pytest.raises(StoreBusy, match=r"locks/waiting-.*snapshot gc by"):
            creator.create("new", inputs(tree))  # a new create waits for the GC
        assert not collecting.done()
        first.release()  # the running create ends: the GC goes on
        collecting.result(30)
        assert objects.under(LOCK_PREFIX) == []  # its lock and its waiting marker gone
        creator.create("new", inputs(tree))
    assert objects.under("snapshots/") == ["snapshots/new.json"]


def test_a_held_lock_is_written_again_until_released(objects: MemoryObjects) -> None:
    locks = StoreLocks(objects, refresh_s=0.01)
    written = threading.Semaphore(0)
    objects.fail = lambda op, key: written.release() if op == "put" else None
    with locks.shared(1.0) as key:
        for _ in range(3):  # the first write, then two refreshes
            assert written.acquire(timeout=30)
        assert objects.under(LOCK_PREFIX) == [key]
    assert objects.under(LOCK_PREFIX) == []


def test_a_lock_written_again_after_a_gap_is_still_lost(
    store: SnapshotStore, objects: MemoryObjects, tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The create's refreshes fail past stale_after (the network cut, or the process paused): a
    GC elsewhere takes it for crashed, removes its lock and collects the packs it reuses. The
    network comes back: a later write of the lock must not make the create go on."""
    store.create("s1", inputs(tree))
    store.delete("s1")
    store.locks = StoreLocks(objects, stale_after=timedelta(seconds=0.3), refresh_s=0.02)
    hashed, go_on = _paused_hash(store, monkeypatch)
    creating = ThreadPoolExecutor(1).submit(store.create, "s2", inputs(tree))
    assert hashed.wait(30)
    cut = threading.Event()
    cut.set()

    def refresh_fails(op: str, key: str) -> None:
        if cut.is_set() and op == "put" and key.startswith(LOCK_PREFIX + "shared-"):
            raise StoreUnavailable("S3 unreachable from here")

    objects.fail = refresh_fails
    time.sleep(0.6)  # (time for the lock to age past stale_after: what is being tested)
    with _other_process(objects, gc_wait_s=1.0) as other:
        other.locks = StoreLocks(objects, stale_after=timedelta(seconds=0.3))
        assert other.gc(grace=timedelta(0)).chunks_removed > 0  # the create's lock was stale
    cut.clear()  # back: the old code's next refresh made the lock young again
    time.sleep(0.1)
    go_on.set()
    with pytest.raises(StoreUnavailable, match="went unwritten"):
        creating.result(30)
    assert "snapshots/s2.json" not in objects.data


def test_a_manifest_write_that_outlasts_the_lock_is_taken_back(
    store: SnapshotStore, objects: MemoryObjects, tree: Path
) -> None:
    """The check before the manifest passes; then its PUT takes longer than the lock's margin
    while refreshes fail, and a GC elsewhere runs meanwhile: the manifest must not stay."""
    store.create("s1", inputs(tree))
    store.delete("s1")
    store.locks = StoreLocks(objects, stale_after=timedelta(seconds=0.3), refresh_s=0.02)
    cut = threading.Event()
    collected: list[int] = []

    def slow_manifest_put(op: str, key: str) -> None:
        if cut.is_set() and op == "put" and key.startswith(LOCK_PREFIX + "shared-"):
            raise StoreUnavailable("S3 unreachable from here")
        if op == "put" and key == "snapshots/s2.json" and not cut.is_set():
            cut.set()  # the PUT is slow (retried), refreshes fail meanwhile
            time.sleep(0.6)
            with _other_process(objects, gc_wait_s=1.0) as other:
                other.locks = StoreLocks(objects, stale_after=timedelta(seconds=0.3))
                collected.append(other.gc(grace=timedelta(0)).chunks_removed)

    objects.fail = slow_manifest_put
    with pytest.raises(StoreUnavailable, match="went unwritten"):
        store.create("s2", inputs(tree))
    assert collected and collected[0] > 0  # the GC did run, and deleted s1's chunks
    assert "snapshots/s2.json" not in objects.data  # taken back: it named deleted chunks


def test_creates_waiting_for_this_processs_gc_hold_no_pool_worker_it_needs(
    objects: MemoryObjects, tree: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create waiting for the store's lock while this process's GC holds it must not sleep
    on the worker pool the GC's own reads need (it did: the GC waited for the create to give
    up, and the create failed although the GC needed milliseconds)."""
    with SnapshotStore(
        objects, signing_key=KEY, workers=2, pack_target=16 << 10, create_wait_s=3.0
    ) as store:
        store.create("s0", inputs(tree))
        locked, go_gc = threading.Event(), threading.Event()
        real_stale = store.locks.stale

        def paused_stale() -> list[str]:
            locked.set()
            assert go_gc.wait(30)
            return real_stale()

        monkeypatch.setattr(store.locks, "stale", paused_stale)
        pool = ThreadPoolExecutor(2)
        collecting = pool.submit(store.gc, grace=timedelta(0))
        assert locked.wait(30)
        tried = threading.Event()
        objects.fail = lambda op, key: (
            tried.set() if op == "put" and key.startswith(LOCK_PREFIX + "shared-") else None
        )
        creating = pool.submit(store.create, "s1", inputs(tree))
        assert tried.wait(30)  # it waits for the GC's lock
        go_gc.set()
        collecting.result(30)
        assert creating.result(30).files > 0
        assert store.verify("s1").ok


def test_a_create_that_stepped_back_looks_before_it_writes_again(
    objects: MemoryObjects, tree: Path
) -> None:
    """While a GC holds the store, a waiting create lists the locks and writes none of its own
    until the GC is gone (a create polling with writes keeps showing a GC a shared lock)."""
    puts: list[str] = []
    objects.fail = lambda op, key: (
        puts.append(key) if op == "put" and key.startswith(LOCK_PREFIX + "shared-") else None
    )
    gc_side = StoreLocks(objects)
    gc_lock = gc_side.acquire("exclusive", 1.0, "snapshot gc")
    with _other_process(objects, create_wait_s=0.5) as creator, pytest.raises(StoreBusy):
        creator.create("s", inputs(tree))
    assert len(puts) == 1  # the first try only; then it looked, and waited
    gc_lock.release()
    assert objects.under(LOCK_PREFIX) == []


def test_a_waiting_marker_left_by_a_gc_that_went_away_holds_creates_back_30_s_only(
    objects: MemoryObjects, tree: Path
) -> None:
    """A GC killed while it waited leaves its marker: creates wait for it no longer than a
    GC's wait could have lasted (not the 5 minutes of a lock)."""
    old = datetime.now(UTC) - timedelta(seconds=31)
    objects.data[LOCK_PREFIX + "waiting-gone.json"] = (b"{}", old)
    with _other_process(objects, create_wait_s=0.2) as creator:
        creator.create("s", inputs(tree))
        objects.data[LOCK_PREFIX + "waiting-recent.json"] = (b"{}", datetime.now(UTC))
        with pytest.raises(StoreBusy, match="waiting-recent"):
            creator.create("t", inputs(tree))


def test_a_refresh_that_lands_after_stale_after_loses_the_lock(objects: MemoryObjects) -> None:
    """A refresh sent in time (0.6 s after the last write, under 80 % of 1 s) but landing 0.7 s
    later: for a while the lock was stale by the store's clock, and a GC took the store. The
    write's success must not make the lock look held."""
    locks = StoreLocks(objects, stale_after=timedelta(seconds=1), refresh_s=0.6)
    slow, landed = threading.Event(), threading.Event()

    def slow_refresh(op: str, key: str) -> None:
        if op == "put" and key.startswith(LOCK_PREFIX + "shared") and slow.is_set():
            time.sleep(0.7)
            landed.set()

    objects.fail = slow_refresh
    held = locks.acquire("shared", 1.0, "snapshot create")
    slow.set()
    time.sleep(1.1)  # (the refresh sent at 0.6 s is in flight; the lock is stale meanwhile)
    taken = StoreLocks(objects, stale_after=timedelta(seconds=1)).acquire("exclusive", 0.2, "gc")
    taken.release()  # a GC ran meanwhile
    assert landed.wait(30)
    slow.clear()
    with pytest.raises(StoreUnavailable, match="went unwritten"):
        held.check("snapshot create")
    held.release()


def test_a_create_that_fails_before_it_starts_takes_no_lock(
    objects: MemoryObjects, tree: Path
) -> None:
    """A closed store refuses the create's first reads: no lock thread may be left to take a
    lock that no one would release (every GC would find the store busy)."""
    store = make_store(objects)
    store.close()
    with pytest.raises(RuntimeError, match="after shutdown"):
        store.create("x", inputs(tree))
    assert not [t for t in threading.enumerate() if t.name == "snap-lock-take"]
    assert objects.under(LOCK_PREFIX) == []
