"""Local files: content-defined chunking with BLAKE3 ids, and the stat -> hash cache.

Files up to :data:`MIN_CHUNK` are one chunk whose id is the file's own BLAKE3, so the common
case (source files) hashes once. Larger files are cut by FastCDC, so an edit in the middle of a
big file stores only the chunks around it.
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import fastcdc
import msgpack
from dsec_core.codebundle import TreeEntry

MIN_CHUNK = 256 << 10
AVG_CHUNK = 1 << 20
MAX_CHUNK = 4 << 20
_RACY_NS = 50_000_000
"""A file modified this close to the cache write may change again unseen in the same tick."""


class FileChanged(Exception):
    """A file changed while it was being snapshotted."""


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """Where a chunk of a local file lies."""

    id: str
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class HashedFile:
    """A file's BLAKE3 and its chunks (empty for an empty file)."""

    blake3: str
    size: int
    chunks: tuple[ChunkRef, ...]


ChunkSink = Callable[["ChunkRef", "bytes | memoryview"], None]
"""Called with each chunk and its bytes while a file is read (valid only during the call)."""


def hash_and_chunk(
    path: str | Path, on_chunk: ChunkSink | None = None, *, listed_size: int | None = None
) -> HashedFile:
    """Hash ``path`` (never following a final symlink) and cut it into chunks.

    ``on_chunk`` sees every chunk's bytes as they are read, so a snapshot compresses and packs
    what it hashed without reading the file a second time. ``listed_size``: the size the
    listing saw; a small file that still has it is read without an ``fstat`` first (one
    syscall less per file), any other is measured again.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        if listed_size is not None and 0 < listed_size <= MIN_CHUNK:
            data = os.pread(fd, listed_size + 1, 0)
            if len(data) == listed_size:  # neither shorter nor longer: all of it
                return _small(data, on_chunk)
        size = os.fstat(fd).st_size
        if size == 0:
            return HashedFile(blake3.blake3(b"").hexdigest(), 0, ())
        if size <= MIN_CHUNK:
            data = os.pread(fd, size + 1, 0)
            if len(data) != size:
                raise FileChanged(f"{path}: size changed while reading")
            return _small(data, on_chunk)
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as view:
            return _chunk_large(view, size, on_chunk)
    finally:
        os.close(fd)


def _small(data: bytes, on_chunk: ChunkSink | None) -> HashedFile:
    """A file of at most :data:`MIN_CHUNK` bytes (not empty): one chunk, its id the file's
    hash."""
    digest = blake3.blake3(data).hexdigest()
    ref = ChunkRef(digest, 0, len(data))
    if on_chunk is not None:
        on_chunk(ref, data)
    return HashedFile(digest, len(data), (ref,))


def _chunk_large(view: mmap.mmap, size: int, on_chunk: ChunkSink | None) -> HashedFile:
    cuts = fastcdc.fastcdc(
        view, min_size=MIN_CHUNK, avg_size=AVG_CHUNK, max_size=MAX_CHUNK, fat=False, hf=None
    )
    # Each chunk is copied out of the mapping once, then hashed, added to the file's hash and
    # handed on: what is stored is exactly what was hashed, even if the file changes meanwhile.
    # One thread per file (files are hashed in parallel already: more threads only contend),
    # and a file that is one chunk is hashed once (its chunk id is the file's hash).
    whole = blake3.blake3()
    only: str | None = None
    chunks: list[ChunkRef] = []
    end = 0
    for c in cuts:
        part = view[c.offset : c.offset + c.length]
        digest = blake3.blake3(part).hexdigest()
        if c.offset == 0 and c.length == size:
            only = digest
        else:
            whole.update(part)
        ref = ChunkRef(digest, c.offset, c.length)
        if on_chunk is not None:
            on_chunk(ref, part)
        chunks.append(ref)
        end = c.offset + c.length
    if end != size:
        raise FileChanged("chunks do not cover the file")
    return HashedFile(only or whole.hexdigest(), size, tuple(chunks))


def read_chunk(path: Path, ref: ChunkRef) -> bytes:
    """Read one chunk back and check it still has its id.

    Raises:
        FileChanged: the bytes at that place are not the ones hashed.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        data = os.pread(fd, ref.length, ref.offset)
    finally:
        os.close(fd)
    if len(data) != ref.length or blake3.blake3(data).hexdigest() != ref.id:
        raise FileChanged(f"{path}: changed while it was being snapshotted")
    return data


def stat_key(entry: TreeEntry) -> tuple[int, int, int, int, int]:
    """What must be equal for a cached hash of ``entry`` to be trusted."""
    return (entry.size, entry.mtime_ns, entry.ctime_ns, entry.ino, entry.dev)


class StatCache:
    """``path -> (stat, hash, chunks)`` of one directory, as of the last snapshot taken of it.

    ``snapshot`` names that snapshot: while it exists, every chunk listed here is known to be
    stored, so an unchanged file is neither re-read nor checked for existence.
    """

    def __init__(self, path: Path | None, memo: StatCacheMemo | None = None) -> None:
        """``path=None``: a cache that remembers nothing (a store without a cache directory).

        ``memo``: what this process wrote last to each cache file; a file still the one
        written (same inode, size and times) is not read and decoded again.
        """
        self.path = path
        self.snapshot: str | None = None
        self.snapshot_id: str | None = None
        """The id of that snapshot: a snapshot deleted and taken again under its name is
        another, whose chunks are not those listed here (``None``: not known, not trusted)."""
        self._entries: dict[str, list[Any]] = {}
        self._memo = memo
        if path is None:
            return
        known = memo.get(path) if memo is not None else None
        if known is not None:
            self.snapshot, self.snapshot_id, self._entries = known
            return
        try:
            raw = msgpack.unpackb(path.read_bytes(), raw=False)
        except (OSError, ValueError, msgpack.ExtraData):
            return  # no cache (or a damaged one): everything is rehashed
        if isinstance(raw, dict) and raw.get("v") == 1:
            self.snapshot = raw.get("snapshot")
            self.snapshot_id = raw.get("snapshot_id")
            self._entries = raw.get("entries", {})

    def lookup(self, entry: TreeEntry) -> HashedFile | None:
        """The cached hash of ``entry`` if its stat data is unchanged."""
        row = self._fresh_row(entry)
        if row is None:
            return None
        digest, chunks = row[1], row[2]
        return HashedFile(digest, entry.size, tuple(ChunkRef(*c) for c in chunks))

    def digest(self, entry: TreeEntry) -> str | None:
        """Only the cached BLAKE3 of ``entry`` if its stat data is unchanged (no chunk list)."""
        row = self._fresh_row(entry)
        return None if row is None else str(row[1])

    def _fresh_row(self, entry: TreeEntry) -> list[Any] | None:
        """``entry``'s row when its stat data is unchanged (:func:`stat_key`'s fields, a list as
        saved and decoded: compared without building the tuple)."""
        row = self._entries.get(entry.path)
        if row is None or row[0] != [
            entry.size,
            entry.mtime_ns,
            entry.ctime_ns,
            entry.ino,
            entry.dev,
        ]:
            return None
        return row

    def forget(self) -> None:
        """Remove the cache file (its snapshot was not stored after all)."""
        if self.path is not None:
            if self._memo is not None:
                self._memo.drop(self.path)
            self.path.unlink(missing_ok=True)

    def save(
        self,
        snapshot: str,
        hashed: dict[str, tuple[TreeEntry, HashedFile]],
        now_ns: int,
        rehashed: set[str] | None = None,
        *,
        snapshot_id: str,
    ) -> None:
        """Replace the cache with ``hashed`` as of ``snapshot`` (atomically; ``snapshot_id``:
        its id).

        Rows of files not in ``rehashed`` (cache hits) are carried over as they are.
        """
        if self.path is None:
            return
        old = self._entries if rehashed is not None else {}
        entries: dict[str, list[Any]] = {}
        for path, (entry, h) in hashed.items():
            if entry.kind != "file" or entry.mtime_ns >= now_ns - _RACY_NS:
                continue  # links are cheap; racily clean files are rehashed next time
            row = old.get(path) if rehashed is not None and path not in rehashed else None
            entries[path] = row or [
                list(stat_key(entry)),
                h.blake3,
                [[c.id, c.offset, c.length] for c in h.chunks],
            ]
        data = msgpack.packb(
            {"v": 1, "snapshot": snapshot, "snapshot_id": snapshot_id, "entries": entries},
            use_bin_type=True,
        )
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(data)
        if self._memo is None:
            os.replace(tmp, self.path)
            return
        self._memo.drop(self.path)
        written = StatCacheMemo.identity(tmp)  # (a rename changes the ctime, not these)
        os.replace(tmp, self.path)
        if written is not None:
            self._memo.put(self.path, written, (snapshot, snapshot_id, entries))


_Written = tuple[str, str | None, dict[str, list[Any]]]
"""A stat cache as written: its snapshot's name and id, its rows."""


class StatCacheMemo:
    """The stat caches this process wrote, decoded, by file (a few per store: one per code
    directory snapshotted). An entry holds only while the file is the one written: its
    inode, size and times are compared on each use. Thread-safe."""

    def __init__(self, limit: int = 16) -> None:
        self._limit = limit
        self._lock = threading.Lock()
        self._known: dict[Path, tuple[tuple[int, ...], _Written]] = {}

    @staticmethod
    def identity(path: Path) -> tuple[int, ...] | None:
        """What tells the file at ``path`` from any other: device, inode, size, mtime (an
        inode number is not reused while the file holding it exists)."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def get(self, path: Path) -> _Written | None:
        """The snapshot, its id and the rows written to ``path`` when it is still that file."""
        with self._lock:
            known = self._known.get(path)
        if known is None or self.identity(path) != known[0]:
            return None
        return known[1]

    def put(
        self,
        path: Path,
        identity: tuple[int, ...],
        written: _Written,
    ) -> None:
        """Remember what was just written to ``path`` (the file of ``identity``; its rows are
        never changed after)."""
        with self._lock:
            self._known.pop(path, None)
            while len(self._known) >= self._limit:
                del self._known[next(iter(self._known))]
            self._known[path] = (identity, written)

    def drop(self, path: Path) -> None:
        """Forget ``path`` (about to be replaced or removed)."""
        with self._lock:
            self._known.pop(path, None)
