"""Pack files: many compressed chunks per S3 object, and the index saying where each one is.

One S3 object per chunk made a cold snapshot of 5,000 files 5,000 PUTs. Chunks are now written
into *packs* (restic/borg style), a few MiB each, and found again through the *pack index*:

- ``packs/<blake3 of the pack>``: zstd frames back to back, then a trailer (msgpack
  ``[[chunk id, offset, length], ...]``, its length as 4 bytes little-endian, ``DSECPAK1``), so an
  index could be rebuilt from the packs alone. A chunk is read back with a ranged GET of its
  frame (neighbouring frames are read in one GET); its BLAKE3 is checked after decompression.
  Small chunks (up to :data:`GROUP_CHUNK_MAX`, source files) are compressed together, up to
  :data:`GROUP_LIMIT` bytes to a frame: each frame costs zstd a fixed setup (a 6 KB file alone
  compresses at half the speed and a fifth worse), so such a chunk's row is ``[chunk id,
  offset, length, start, size]``: ``size`` bytes at ``start`` of what the frame decompresses to.
- ``pack-index/<blake3 of the document>``: msgpack ``{"v": 1, "packs": {pack key: [[chunk id,
  offset, length(, start, size)], ...]}, "supersedes": [index keys]}`` (``v`` 2 when some
  row has the grouped form: a reader of version 1 refuses it rather than misread it). A
  snapshot writes one document for the packs it added, after they are stored and before its
  manifest: an index never names a pack that is not complete, and a manifest never names a
  chunk no index holds. GC writes one document that replaces (``supersedes``) the ones it
  read; superseded documents are ignored.

Index documents are immutable and named by their hash, so a reader keeps them in memory and in
a local cache directory, and only lists ``pack-index/`` to learn of new ones.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import blake3
import msgpack
import msgspec

from dsec_snapstore.adapters.objectstore import ObjectMissing, ObjectStore
from dsec_snapstore.fairpool import FairExecutor

log = logging.getLogger(__name__)

PACK_PREFIX = "packs/"
PACK_INDEX_PREFIX = "pack-index/"
PACK_TARGET = 2 << 20
"""A pack is sealed once its chunks reach this many (compressed) bytes. SeaweedFS spent about
13 % less CPU storing 28 MB as 2 MiB objects than as 4 MiB ones, and the last pack of a cold
snapshot, uploaded after the last file is read, is smaller (a cold 50 MB tree: 3 % faster,
7 of 10 paired runs)."""
PACK_MAGIC = b"DSECPAK1"
_TRAILER_LEN = struct.Struct("<I")
RANGE_GAP = 256 << 10
"""Chunks of one pack less than this far apart are read with one ranged GET."""
RANGE_MAX = 16 << 20
"""The largest ranged GET (several chunks) made at once."""
GROUP_CHUNK_MAX = 32 << 10
"""Chunks up to this size are compressed together with their neighbours."""
GROUP_LIMIT = 128 << 10
"""A group frame is closed once its chunks reach this many (plain) bytes; a rollback of one
small file decompresses at most about this much."""


class PackFormatError(ValueError):
    """A pack or index document is not in the format this module writes."""


class Loc(msgspec.Struct, frozen=True, gc=False):
    """Where a chunk's zstd frame lies: ``length`` bytes at ``offset`` of pack ``pack``; with
    ``size >= 0`` the frame holds a group and the chunk is ``size`` bytes at ``start`` of its
    content (``size < 0``: the whole content).

    A msgspec struct, not a dataclass: an index holds one per chunk, and a frozen dataclass
    took ~2 µs to make (11 ms of a 5,000-chunk document's 15 ms), a struct ~0.2."""

    pack: str
    offset: int
    length: int
    start: int = 0
    size: int = -1


_Count = Annotated[int, msgspec.Meta(ge=0)]


class _Row(msgspec.Struct, array_like=True, frozen=True, gc=False, forbid_unknown_fields=True):
    """An index or trailer row as read: ``[chunk id, offset, length]`` or, for a chunk of a
    group frame, ``[chunk id, offset, length, start, size]``. Refused where it is decoded: a
    row of fewer than 3 or more than 5 fields, a field of the wrong type, a negative number,
    and (:func:`_checked`) a whole frame (``size`` -1) with a ``start``: the only row it cannot
    write back as it was. ``[chunk id, offset, length, 0]`` reads as the whole frame it says."""

    chunk: str
    offset: _Count
    length: _Count
    start: _Count = 0
    size: Annotated[int, msgspec.Meta(ge=-1)] = -1

    def as_list(self) -> list[Any]:
        """The row as :func:`encode_pack` lays it out (3 fields for a whole frame)."""
        if self.size < 0:
            return [self.chunk, self.offset, self.length]
        return [self.chunk, self.offset, self.length, self.start, self.size]


class _Document(msgspec.Struct, gc=False):
    v: Literal[1, 2]
    packs: dict[str, list[_Row]]
    supersedes: list[str] = []


_decode_rows = msgspec.msgpack.Decoder(list[_Row]).decode
_decode_document = msgspec.msgpack.Decoder(_Document).decode
_UNDECODABLE = (msgspec.DecodeError, RecursionError)
"""What decoding a document or trailer may raise: msgspec skips a field a struct does not
declare by recursing into it, so a few KB nested a thousand deep raise ``RecursionError``."""


def _checked(row: _Row) -> _Row:
    if row.size < 0 and row.start:
        raise PackFormatError(f"row of chunk {row.chunk!r}: a start ({row.start}) but no size")
    return row


class _RowLists(Mapping[str, list[list[Any]]]):
    """A decoded document's rows by pack, each made a list (as :func:`encode_pack` lays it out)
    when first asked for: a restore reads only the document's chunk map, a GC and
    :meth:`IndexDoc.encode` the rows (two threads at once would make equal lists)."""

    def __init__(self, rows: dict[str, list[_Row]]) -> None:
        self._rows = rows
        self._lists: dict[str, list[list[Any]]] = {}

    def __getitem__(self, pack: str) -> list[list[Any]]:
        lists = self._lists.get(pack)
        if lists is None:
            lists = self._lists[pack] = [row.as_list() for row in self._rows[pack]]
        return lists

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


Member = tuple[str, int, int]
"""A chunk of a group frame: ``(chunk id, start, size)`` in the frame's content."""


def loc_of(pack: str, row: Sequence[Any]) -> Loc:
    """The :class:`Loc` of an index or trailer row (3 or 5 fields)."""
    if len(row) == 5:
        return Loc(pack, int(row[1]), int(row[2]), int(row[3]), int(row[4]))
    return Loc(pack, int(row[1]), int(row[2]))


def pack_key(content_hash: str) -> str:
    """Object key of a pack."""
    return f"{PACK_PREFIX}{content_hash}"


# --- packs ---------------------------------------------------------------------------------


def encode_pack(
    blobs: Sequence[tuple[str | Sequence[Member], bytes]],
) -> tuple[bytes, list[list[Any]]]:
    """Lay ``(chunk id, frame)`` pairs (or ``(members, group frame)``) out as one pack; return
    its bytes and its entries."""
    entries: list[list[Any]] = []
    offset = 0
    for who, blob in blobs:
        if isinstance(who, str):
            entries.append([who, offset, len(blob)])
        else:
            entries.extend([c, offset, len(blob), start, size] for c, start, size in who)
        offset += len(blob)
    trailer = msgpack.packb(entries, use_bin_type=True)
    body = b"".join([*(b for _, b in blobs), trailer, _TRAILER_LEN.pack(len(trailer)), PACK_MAGIC])
    return body, entries


def decode_trailer(pack: bytes) -> list[tuple[Any, ...]]:
    """The ``(chunk id, offset, length[, start, size])`` entries a pack's trailer lists.

    Raises:
        PackFormatError: not a pack.
    """
    return [tuple(r.as_list()) for r in _trailer(pack)]


def trailer_spans(pack: bytes | memoryview) -> set[tuple[str, int, int, int, int]]:
    """A pack's trailer rows as :class:`Span` lists its chunks: ``(chunk id, offset, length,
    start, size)``, ``start`` 0 and ``size`` -1 for a whole frame.

    Raises:
        PackFormatError: not a pack.
    """
    return {(r.chunk, r.offset, r.length, r.start, r.size) for r in _trailer(pack)}


def _trailer(pack: bytes | memoryview) -> list[_Row]:
    tail = len(PACK_MAGIC) + _TRAILER_LEN.size
    if len(pack) < tail or pack[-len(PACK_MAGIC) :] != PACK_MAGIC:
        raise PackFormatError("no pack trailer (not a pack, or cut short)")
    (size,) = _TRAILER_LEN.unpack(pack[-tail : -len(PACK_MAGIC)])
    if size > len(pack) - tail:
        raise PackFormatError("pack trailer unreadable: longer than the pack")
    try:
        return [_checked(row) for row in _decode_rows(pack[-tail - size : -tail])]
    except (*_UNDECODABLE, PackFormatError) as exc:
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
        on_stored: Callable[[str, bytes], None] | None = None,
    ) -> None:
        self._objects = objects
        self._on_stored = on_stored  # (the node's pack cache: a copy of each pack stored)
        self._uploader = uploader
        self._target = target
        self._slots = threading.BoundedSemaphore(max_inflight)
        self._lock = threading.Lock()
        self._open: list[tuple[str | Sequence[Member], bytes]] = []
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
        self._add(chunk_id, 1, blob)

    def add_group(self, members: Sequence[Member], blob: bytes) -> None:
        """Put a group frame of claimed chunks into the open pack (see :func:`add`)."""
        self._add(members, len(members), blob)

    def _add(self, who: str | Sequence[Member], count: int, blob: bytes) -> None:
        with self._lock:
            self._open.append((who, blob))
            self._open_size += len(blob)
            self.chunks += count
            self.bytes += len(blob)
            if self._open_size < self._target:
                return
            sealed, self._open, self._open_size = self._open, [], 0
        self._upload(sealed)

    def _upload(self, blobs: list[tuple[str | Sequence[Member], bytes]]) -> None:
        self._slots.acquire()
        try:
            self._futures.append(self._uploader.submit(self._store, blobs))
        except BaseException:
            self._slots.release()
            raise

    def _store(
        self, blobs: list[tuple[str | Sequence[Member], bytes]]
    ) -> tuple[str, list[list[Any]], int]:
        try:
            body, entries = encode_pack(blobs)
            key = pack_key(blake3.blake3(body).hexdigest())  # the cores are busy compressing
            self._objects.put(key, body, checked_on_read=True)
            if self._on_stored is not None:
                self._on_stored(key, body)
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
    _locations: dict[str, Loc] | None = field(default=None, compare=False, repr=False)

    def locations(self) -> dict[str, Loc]:
        """Where each chunk the document names is (a chunk named twice: its first row)."""
        if self._locations is None:
            found: dict[str, Loc] = {}
            for pack, rows in self.packs.items():
                for row in rows:
                    if row[0] not in found:
                        found[row[0]] = loc_of(pack, row)
            # (a cache of what the immutable rows say: two threads would compute equal maps)
            object.__setattr__(self, "_locations", found)
        assert self._locations is not None
        return self._locations

    def encode(self) -> bytes:
        """The document's bytes (its key is their BLAKE3)."""
        grouped = any(len(e) == 5 for rows in self.packs.values() for e in rows)
        body = {
            "v": 2 if grouped else 1,
            "packs": {k: [list(e) for e in v] for k, v in self.packs.items()},
            "supersedes": list(self.supersedes),
        }
        data: bytes = msgpack.packb(body, use_bin_type=True)
        return data

    @classmethod
    def decode(cls, data: bytes) -> IndexDoc:
        """Parse a document.

        Raises:
            PackFormatError: not an index document of version 1 or 2.
        """
        try:
            raw = _decode_document(data)
            # Where each chunk is, as each row is checked (typed decoding checked the rest).
            found: dict[str, Loc] = {}
            for pack, rows in raw.packs.items():
                for row in rows:
                    _checked(row)
                    if row.chunk not in found:
                        found[row.chunk] = Loc(pack, row.offset, row.length, row.start, row.size)
        except (*_UNDECODABLE, PackFormatError) as exc:
            raise PackFormatError(f"not a version 1 or 2 pack index document: {exc}") from None
        return cls(_RowLists(raw.packs), tuple(raw.supersedes), found)


def _merge(by_chunk: dict[str, Loc], found: Mapping[str, Loc]) -> None:
    """Add ``found``'s locations of chunks ``by_chunk`` does not place yet (the first place a
    chunk was seen stays). A loop over ``found``, not a set difference: that walks
    ``by_chunk``, the whole store's map, for each document."""
    for chunk_id, loc in found.items():
        if chunk_id not in by_chunk:
            by_chunk[chunk_id] = loc


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
    _superseded: set[str] = field(default_factory=set)
    _refused: set[str] = field(default_factory=set)
    """Listed documents that hash to their key yet do not decode: immutable, so never read
    again while listed (an attacker's document is not fetched and parsed on every refresh)."""
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

    def pack_keys(self) -> set[str]:
        """Every pack the documents in force name."""
        with self._lock:
            return {pack for key in self._effective for pack in self.docs[key].packs}

    def read(self) -> tuple[dict[str, IndexDoc], list[str]]:
        """Every document read and the keys of those in force, at one moment (what a GC
        works from: a document taken between reading the two would be in force but unread)."""
        with self._lock:
            return dict(self.docs), list(self._effective)

    def refresh(self, pool: Executor | None = None) -> None:
        """List ``pack-index/`` and read the documents not read yet (local cache first).

        Raises:
            StoreUnavailable: S3 failed.
        """
        with self._lock:
            known = set(self.docs)  # read before the listing: what it can say is gone
        listed = set(self.objects.list(PACK_INDEX_PREFIX))
        with self._lock:
            self._refused &= listed  # (forgotten once deleted)
            new = sorted(listed - known - self._refused)
        runner: Callable[[Callable[[str], IndexDoc | None], Iterable[str]], Iterable[Any]]
        runner = pool.map if pool is not None and len(new) > 4 else map
        fetched = dict(zip(new, runner(self._read_doc, new), strict=True))
        with self._lock:
            # Only a document read before this listing and absent from it is gone: one that a
            # later refresh (after a GC) or add() took meanwhile stays, whatever this older
            # listing says (a GC's document would be lost, the ones it superseded come back).
            removed = [key for key in known - listed if key in self.docs]
            for key in removed:
                del self.docs[key]
            added = {key: doc for key, doc in fetched.items() if doc is not None}
            self.docs.update(added)
            self._take(added, rebuild=bool(removed))

    def add(self, key: str, doc: IndexDoc, data: bytes | None = None) -> None:
        """Take a document this process just stored (and cache it locally)."""
        if data is not None:
            self._cache_put(key, data)
        with self._lock:
            self.docs[key] = doc
            self._take({key: doc})

    def write(self, doc: IndexDoc) -> str:
        """Store ``doc`` and take it; return its key."""
        data = doc.encode()
        key = index_key(data)
        self.objects.put(key, data, checked_on_read=True)
        self.add(key, doc, data)
        return key

    def _take(self, added: Mapping[str, IndexDoc], *, rebuild: bool = False) -> None:
        """Bring the chunk map up to date with ``added`` (in ``docs`` already): merged into it
        when they only add locations, which is every snapshot's document, so a snapshot's cost
        does not grow with the store; rebuilt from every document when ``rebuild`` (some were
        removed) or the documents in force change otherwise (a GC's document supersedes
        others, or one arrives that an earlier one superseded). Under ``_lock``."""
        if rebuild or any(d.supersedes for d in added.values()) or added.keys() & self._superseded:
            self._rebuild()
            return
        by_chunk = self._by_chunk  # readers see it grow, never a chunk's location vanish
        for key, doc in added.items():
            index = bisect.bisect_left(self._effective, key)
            if index < len(self._effective) and self._effective[index] == key:
                continue  # taken already (a document's key is the hash of its bytes)
            self._effective.insert(index, key)
            _merge(by_chunk, doc.locations())

    def _rebuild(self) -> None:
        superseded = {s for doc in self.docs.values() for s in doc.supersedes}
        effective = sorted(k for k in self.docs if k not in superseded)
        by_chunk: dict[str, Loc] = {}
        for key in effective:
            _merge(by_chunk, self.docs[key].locations())
        self._by_chunk = by_chunk
        self._effective = effective
        self._superseded = superseded

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
            fetched = True
        else:
            fetched = False
        try:
            doc = IndexDoc.decode(data)
        except PackFormatError as exc:
            with self._lock:
                self._refused.add(key)  # (its bytes are its name: they never decode)
            # (once per process: remembered above; the reason is ours, bounded, not its bytes)
            log.warning("pack index document %s ignored: %.300s", key, exc)
            path = self._cache_path(digest)
            if not fetched and path is not None:  # (an older version cached before decoding)
                with contextlib.suppress(OSError):
                    path.unlink()
            return None
        if fetched:
            self._cache_put(key, data)  # (only a document that decodes is kept)
        return doc

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
    """One ranged GET of a pack, covering ``chunks`` (id, frame offset in the pack, frame
    length, start and size in a group frame's content or 0, -1), in offset order."""

    pack: str
    start: int
    end: int
    chunks: tuple[tuple[str, int, int, int, int], ...]


def plan_reads(
    wanted: Iterable[tuple[str, Loc]], *, gap: int = RANGE_GAP, limit: int = RANGE_MAX
) -> list[Span]:
    """Group chunk reads into few ranged GETs: per pack, by offset, merging near neighbours."""
    by_pack: dict[str, list[tuple[int, int, int, int, str]]] = {}
    for chunk_id, loc in wanted:
        row = (loc.offset, loc.length, loc.start, loc.size, chunk_id)
        rows = by_pack.get(loc.pack)
        if rows is None:
            by_pack[loc.pack] = [row]
        else:
            rows.append(row)
    spans: list[Span] = []
    for pack, items in by_pack.items():
        items.sort()
        current: list[tuple[str, int, int, int, int]] = []
        start = end = 0
        for offset, length, inner, size, chunk_id in items:
            stop = offset + length
            # (offset < end: a frame already read)
            if current and offset >= end and (offset - end > gap or stop - start > limit):
                spans.append(Span(pack, start, end, tuple(current)))
                current = []
            if not current:
                start = offset
            current.append((chunk_id, offset, length, inner, size))
            if stop > end:
                end = stop
        if current:
            spans.append(Span(pack, start, end, tuple(current)))
    spans.sort(key=lambda s: s.end - s.start, reverse=True)  # big reads first: less tail
    return spans


def default_uploader() -> FairExecutor:
    """The executor packs are uploaded on (separate from the hashing workers: no deadlock).
    Each snapshot's uploads take turns with the others' (:meth:`FairExecutor.queue`): a small
    snapshot's one pack does not wait behind every pack large ones queued before it."""
    return FairExecutor(4, name="snap-pack")
