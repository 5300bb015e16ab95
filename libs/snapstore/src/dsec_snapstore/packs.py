"""Pack files: many compressed chunks per S3 object, and the index saying where each one is.

One S3 object per chunk made a cold snapshot of 5,000 files 5,000 PUTs. Chunks are now written
into *packs* (restic/borg style), a few MiB each, and found again through the *pack index*:

- ``packs/<blake3 of the pack>``: the chunks' zstd frames back to back, then a trailer (msgpack
  ``[[chunk id, offset, length], ...]``, its length as 4 bytes little-endian, ``DSECPAK1``), so an
  index could be rebuilt from the packs alone. A chunk is read back with a ranged GET of its
  frame (neighbouring frames are read in one GET); its BLAKE3 is checked after decompression.
- ``pack-index/<blake3 of the document>``: msgpack ``{"v": 1, "packs": {pack key: [[chunk id,
  offset, length], ...]}, "supersedes": [index keys]}``. A snapshot writes one document for the
  packs it added, after they are stored and before its manifest: an index never names a pack
  that is not complete, and a manifest never names a chunk no index holds. GC writes one
  document that replaces (``supersedes``) the ones it read; superseded documents are ignored.

Index documents are immutable and named by their hash, so a reader keeps them in memory and in
a local cache directory, and only lists ``pack-index/`` to learn of new ones.
"""

from __future__ import annotations

import os
import struct
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import blake3
import msgpack

from dsec_snapstore.adapters.objectstore import ObjectMissing, ObjectStore

PACK_PREFIX = "packs/"
PACK_INDEX_PREFIX = "pack-index/"
PACK_TARGET = 4 << 20
"""A pack is sealed once its chunks reach this many (compressed) bytes."""
PACK_MAGIC = b"DSECPAK1"
_TRAILER_LEN = struct.Struct("<I")
RANGE_GAP = 256 << 10
"""Chunks of one pack less than this far apart are read with one ranged GET."""
RANGE_MAX = 16 << 20
"""The largest ranged GET (several chunks) made at once."""


class PackFormatError(ValueError):
    """A pack or index document is not in the format this module writes."""


@dataclass(frozen=True, slots=True)
class Loc:
    """Where a chunk's zstd frame lies: ``length`` bytes at ``offset`` of pack ``pack``."""

    pack: str
    offset: int
    length: int


def pack_key(content_hash: str) -> str:
    """Object key of a pack."""
    return f"{PACK_PREFIX}{content_hash}"


# --- packs ---------------------------------------------------------------------------------


def encode_pack(blobs: Sequence[tuple[str, bytes]]) -> tuple[bytes, list[list[Any]]]:
    """Lay ``(chunk id, frame)`` pairs out as one pack; return its bytes and its entries."""
    entries: list[list[Any]] = []
    offset = 0
    for chunk_id, blob in blobs:
        entries.append([chunk_id, offset, len(blob)])
        offset += len(blob)
    trailer = msgpack.packb(entries, use_bin_type=True)
    body = b"".join([*(b for _, b in blobs), trailer, _TRAILER_LEN.pack(len(trailer)), PACK_MAGIC])
    return body, entries


def decode_trailer(pack: bytes) -> list[tuple[str, int, int]]:
    """The ``(chunk id, offset, length)`` entries a pack's trailer lists.

    Raises:
        PackFormatError: not a pack.
    """
    tail = len(PACK_MAGIC) + _TRAILER_LEN.size
    if len(pack) < tail or pack[-len(PACK_MAGIC) :] != PACK_MAGIC:
        raise PackFormatError("no pack trailer (not a pack, or cut short)")
    (size,) = _TRAILER_LEN.unpack(pack[-tail : -len(PACK_MAGIC)])
    try:
        raw = msgpack.unpackb(pack[-tail - size : -tail], raw=False)
        return [(str(c), int(o), int(n)) for c, o, n in raw]
    except (ValueError, TypeError, msgpack.ExtraData) as exc:
        raise PackFormatError(f"pack trailer unreadable: {exc}") from None


class Packer:
    """Collects compressed chunks into packs and uploads each one as soon as it is full.

    Thread-safe: many workers :meth:`add` while earlier packs upload on ``uploader``; at most
    ``max_inflight`` sealed packs wait in memory (a worker blocks until one is stored).
    """

    def __init__(
        self,
        objects: ObjectStore,
        uploader: Executor,
        *,
        target: int = PACK_TARGET,
        max_inflight: int = 4,
    ) -> None:
        self._objects = objects
        self._uploader = uploader
        self._target = target
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._lock = threading.Lock()
        self._open: list[tuple[str, bytes]] = []
        self._open_size = 0
        self._claimed: set[str] = set()
        self._futures: list[Future[tuple[str, list[list[Any]], int]]] = []
        self.chunks = 0
        self.bytes = 0
        self.sizes: dict[str, int] = {}
        """Bytes of each pack stored (after :meth:`finish`)."""

    def claim(self, chunk_id: str) -> bool:
        """True for the first caller with ``chunk_id`` (it then owes an :meth:`add`)."""
        with self._lock:
            if chunk_id in self._claimed:
                return False
            self._claimed.add(chunk_id)
            return True

    def add(self, chunk_id: str, blob: bytes) -> None:
        """Put a claimed chunk's frame into the open pack; seal and upload it when full."""
        with self._lock:
            self._open.append((chunk_id, blob))
            self._open_size += len(blob)
            self.chunks += 1
            self.bytes += len(blob)
            if self._open_size < self._target:
                return
            sealed, self._open, self._open_size = self._open, [], 0
        self._upload(sealed)

    def _upload(self, blobs: list[tuple[str, bytes]]) -> None:
        self._slots.acquire()
        try:
            self._futures.append(self._uploader.submit(self._store, blobs))
        except BaseException:
            self._slots.release()
            raise

    def _store(self, blobs: list[tuple[str, bytes]]) -> tuple[str, list[list[Any]], int]:
        try:
            body, entries = encode_pack(blobs)
            key = pack_key(blake3.blake3(body, max_threads=blake3.blake3.AUTO).hexdigest())
            self._objects.put(key, body)
            return key, entries, len(body)
        finally:
            self._slots.release()

    def seal(self) -> None:
        """Start uploading the open pack now (when no more chunks come), without waiting."""
        with self._lock:
            sealed, self._open, self._open_size = self._open, [], 0
        if sealed:
            self._upload(sealed)

    def finish(self) -> dict[str, list[list[Any]]]:
        """Seal the last pack, wait for every upload; return ``{pack key: entries}``.

        Raises whatever an upload raised (the packs stored meanwhile are orphans GC removes).
        """
        self.seal()
        out: dict[str, list[list[Any]]] = {}
        for future in self._futures:
            key, entries, size = future.result()
            out[key] = entries
            self.sizes[key] = size
        return out


# --- the index -----------------------------------------------------------------------------


@dataclass(frozen=True)
class IndexDoc:
    """One ``pack-index/`` document."""

    packs: Mapping[str, Sequence[Sequence[Any]]]
    supersedes: tuple[str, ...] = ()

    def encode(self) -> bytes:
        """The document's bytes (its key is their BLAKE3)."""
        body = {
            "v": 1,
            "packs": {k: [list(e) for e in v] for k, v in self.packs.items()},
            "supersedes": list(self.supersedes),
        }
        data: bytes = msgpack.packb(body, use_bin_type=True)
        return data

    @classmethod
    def decode(cls, data: bytes) -> IndexDoc:
        """Parse a document.

        Raises:
            PackFormatError: not an index document of version 1.
        """
        try:
            raw = msgpack.unpackb(data, raw=False)
        except (ValueError, msgpack.ExtraData) as exc:
            raise PackFormatError(f"not msgpack: {exc}") from None
        if not isinstance(raw, dict) or raw.get("v") != 1 or not isinstance(raw.get("packs"), dict):
            raise PackFormatError("not a version 1 pack index document")
        return cls(raw["packs"], tuple(raw.get("supersedes", ())))


def index_key(data: bytes) -> str:
    """The key an index document is stored under."""
    return f"{PACK_INDEX_PREFIX}{blake3.blake3(data).hexdigest()}"


@dataclass
class PackIndex:
    """The chunk -> pack map of one store, as of the documents read so far. Thread-safe."""

    objects: ObjectStore
    cache_dir: Path | None = None
    docs: dict[str, IndexDoc] = field(default_factory=dict)
    _by_chunk: dict[str, Loc] = field(default_factory=dict)
    _effective: list[str] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def lookup(self, chunk_id: str) -> Loc | None:
        """Where ``chunk_id`` is, if a document read so far says."""
        return self._by_chunk.get(chunk_id)

    def __contains__(self, chunk_id: object) -> bool:
        return chunk_id in self._by_chunk

    @property
    def effective(self) -> list[str]:
        """Keys of the documents in force (read and not superseded)."""
        return list(self._effective)

    def refresh(self, pool: Executor | None = None) -> None:
        """List ``pack-index/`` and read the documents not read yet (local cache first).

        Raises:
            StoreUnavailable: S3 failed.
        """
        listed = set(self.objects.list(PACK_INDEX_PREFIX))
        new = sorted(listed - self.docs.keys())
        runner: Callable[[Callable[[str], IndexDoc | None], Iterable[str]], Iterable[Any]]
        runner = pool.map if pool is not None and len(new) > 4 else map
        fetched = dict(zip(new, runner(self._read_doc, new), strict=True))
        with self._lock:
            changed = bool(new) or bool(self.docs.keys() - listed)
            for key in list(self.docs):
                if key not in listed:
                    del self.docs[key]
            for key, doc in fetched.items():
                if doc is not None:
                    self.docs[key] = doc
            if changed:
                self._rebuild()

    def add(self, key: str, doc: IndexDoc, data: bytes | None = None) -> None:
        """Take a document this process just stored (and cache it locally)."""
        if data is not None:
            self._cache_put(key, data)
        with self._lock:
            self.docs[key] = doc
            self._rebuild()

    def write(self, doc: IndexDoc) -> str:
        """Store ``doc`` and take it; return its key."""
        data = doc.encode()
        key = index_key(data)
        self.objects.put(key, data)
        self.add(key, doc, data)
        return key

    def _rebuild(self) -> None:
        superseded = {s for doc in self.docs.values() for s in doc.supersedes}
        effective = sorted(k for k in self.docs if k not in superseded)
        by_chunk: dict[str, Loc] = {}
        for key in effective:
            for pack, entries in self.docs[key].packs.items():
                for chunk_id, offset, length in entries:
                    by_chunk.setdefault(chunk_id, Loc(pack, offset, length))
        self._by_chunk = by_chunk
        self._effective = effective

    def _read_doc(self, key: str) -> IndexDoc | None:
        digest = key[len(PACK_INDEX_PREFIX) :]
        data = self._cache_get(digest)
        if data is None:
            try:
                data = self.objects.get(key)
            except ObjectMissing:
                return None  # removed by a GC meanwhile
            if blake3.blake3(data).hexdigest() != digest:
                return None  # altered: ignored (the chunks it names would not verify)
            self._cache_put(key, data)
        try:
            return IndexDoc.decode(data)
        except PackFormatError:
            return None

    def _cache_path(self, digest: str) -> Path | None:
        if self.cache_dir is None or not digest.isalnum():
            return None
        return self.cache_dir / digest

    def _cache_get(self, digest: str) -> bytes | None:
        path = self._cache_path(digest)
        if path is None:
            return None
        try:
            data = path.read_bytes()
        except OSError:
            return None
        return data if blake3.blake3(data).hexdigest() == digest else None

    def _cache_put(self, key: str, data: bytes) -> None:
        path = self._cache_path(key[len(PACK_INDEX_PREFIX) :])
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError:
            pass  # a cache: reading from S3 next time is fine


# --- ranged reads ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Span:
    """One ranged GET of a pack, covering ``chunks`` (id, offset in the pack, length)."""

    pack: str
    start: int
    end: int
    chunks: tuple[tuple[str, int, int], ...]


def plan_reads(
    wanted: Iterable[tuple[str, Loc]], *, gap: int = RANGE_GAP, limit: int = RANGE_MAX
) -> list[Span]:
    """Group chunk reads into few ranged GETs: per pack, by offset, merging near neighbours."""
    by_pack: dict[str, list[tuple[int, int, str]]] = {}
    for chunk_id, loc in wanted:
        by_pack.setdefault(loc.pack, []).append((loc.offset, loc.length, chunk_id))
    spans: list[Span] = []
    for pack, items in by_pack.items():
        items.sort()
        current: list[tuple[str, int, int]] = []
        start = end = 0
        for offset, length, chunk_id in items:
            if current and (offset - end > gap or offset + length - start > limit):
                spans.append(Span(pack, start, end, tuple(current)))
                current = []
            if not current:
                start = offset
            current.append((chunk_id, offset, length))
            end = max(end, offset + length)
        if current:
            spans.append(Span(pack, start, end, tuple(current)))
    spans.sort(key=lambda s: s.end - s.start, reverse=True)  # big reads first: less tail
    return spans


def default_uploader() -> ThreadPoolExecutor:
    """The executor packs are uploaded on (separate from the hashing workers: no deadlock)."""
    return ThreadPoolExecutor(max_workers=4, thread_name_prefix="snap-pack")
