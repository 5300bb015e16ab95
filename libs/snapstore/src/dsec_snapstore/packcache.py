"""The node's copy of pack bytes: a restore or rollback on a node that took the snapshot (or read
it once already) reads its packs from local disk instead of the object store.

Packs are immutable and named by the BLAKE3 of their content (``packs/<hex>``), so a cached
copy never goes stale: a pack GC rewrote has a new name, and the old copy is only unused
bytes until it is evicted. What a file holds is a prefix of its pack (the whole pack when
the packer or a whole-pack read put it there; the frames without the trailer after a restore's
read), and a read that reaches past it is a miss.

Nothing read from here is trusted more than what S3 sends: every chunk is decompressed and its
BLAKE3 checked against the signed manifest as before (:meth:`.SnapshotStore._read_span`), and a
copy whose chunks do not check is dropped and the pack read from the object store again. A
copy is written only after its chunks checked (a restore) or from the bytes just uploaded (a
snapshot), with mode 0600 in a 0700 directory, through a temporary file renamed into place,
so a crash or a second process never leaves a half-written copy under a pack's name.

Copies are written behind (:meth:`PackCache.keep`): a thread of lower priority writes them
after the snapshot or restore that brought the bytes, which does not wait for it (writing 28 MB
into new files costs ~30 ms of CPU on a 2-vCPU VM: 9 % of a cold snapshot of 50 MB, measured
alternating with the cache off). Until it is written, a copy is read from memory; at most
``pending_limit`` bytes wait (more are not kept), and :meth:`PackCache.close` writes what waits.

The cache is bounded (``limit`` bytes, ``DSEC_SNAPSHOT_PACK_CACHE_MB``): the least recently used
copies are removed once it is over. Its bookkeeping is per process; the directory is the
caller's own (one per store, under its ``cache_dir``), so no two services share it. Every
``OSError`` here is a miss or a copy not kept: the object store is always there behind it.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from collections import OrderedDict
from pathlib import Path

from prometheus_client import Counter

PACK_READS = Counter(
    "dsec_snapshot_pack_reads_total",
    "Pack reads of restores and rollbacks, by source: cache (the node's copy) or store (S3)",
    ["source"],
)
_FROM_CACHE = PACK_READS.labels("cache")
_FROM_STORE = PACK_READS.labels("store")

_NAME = re.compile(r"packs/([0-9a-f]{64})")
_TMP_MARK = ".tmp"
PENDING_LIMIT = 64 << 20
"""Bytes of copies waiting to be written at most (a snapshot larger than that is partly kept)."""
_WRITER_NICE = 10
_STALE_TMP_S = 600.0
"""A temporary file older than this is a crashed writer's: removed when the cache is loaded."""


def count_store_read() -> None:
    """Count a pack read the object store served (the cache missed or is off)."""
    _FROM_STORE.inc()


class PackCache:
    """Bounded copies of packs under ``directory`` (see the module's docstring).

    Thread-safe. ``limit`` is in bytes; a pack larger than a quarter of it is never kept.
    """

    def __init__(self, directory: Path, limit: int, pending_limit: int = PENDING_LIMIT) -> None:
        self.directory = directory
        self.limit = limit
        self.pending_limit = pending_limit
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] | None = None  # name -> bytes, oldest use first
        self._total = 0
        # Copies waiting for the writer thread (name -> (key, bytes)), in the order kept.
        self._pending: dict[str, tuple[str, bytes]] = {}
        self._pending_bytes = 0
        self._changed = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self._closed = False

    # ------------------------------------------------------------------------------ reading

    def read(self, key: str, start: int, length: int) -> bytes | memoryview | None:
        """``length`` bytes of pack ``key`` from ``start``, or ``None`` (not here, shorter
        than that, unreadable)."""
        name = _name_of(key)
        if name is None or length <= 0:
            return None
        with self._lock:
            waiting = self._pending.get(name)
            if waiting is not None and start + length <= len(waiting[1]):
                _FROM_CACHE.inc()
                return memoryview(waiting[1])[start : start + length]
            sizes = self._loaded()
            size = sizes.get(name)
            if size is None or start + length > size:
                return None
            sizes.move_to_end(name)
        try:
            fd = os.open(self.directory / name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            self._forget(name)
            return None
        try:
            data = os.pread(fd, length, start)
            os.utime(fd)  # the order of use survives a restart (loaded by mtime)
        except OSError:
            return None
        finally:
            os.close(fd)
        if len(data) != length:  # truncated behind our back: not a copy of the pack
            self.drop(key)
            return None
        _FROM_CACHE.inc()
        return data

    # ------------------------------------------------------------------------------ writing

    def keep(self, key: str, data: bytes) -> None:
        """Keep ``data`` (see :meth:`put`), written behind by the writer thread; read from
        memory until then. Not kept when ``pending_limit`` bytes wait already."""
        name = _name_of(key)
        size = len(data)
        if name is None or size == 0 or size > self.limit // 4:
            return
        with self._lock:
            if (
                self._closed
                or name in self._pending
                or self._pending_bytes + size > self.pending_limit
                or self._loaded().get(name, -1) >= size
            ):
                return
            self._pending[name] = (key, data)
            self._pending_bytes += size
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_behind, name="snap-pack-cache", daemon=True
                )
                self._writer.start()
            self._changed.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every copy kept so far is written; False when ``timeout_s`` ran out."""
        with self._lock:
            return self._changed.wait_for(lambda: not self._pending, timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what waits, then stop the writer thread (nothing is kept after this)."""
        with self._lock:
            self._closed = True
            self._changed.notify_all()
            writer = self._writer
        if writer is not None:
            writer.join(timeout_s)

    def _write_behind(self) -> None:
        # Below the threads that compress, hash and write a restore (on Linux a thread has its
        # own nice value); raising it needs no privilege.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _WRITER_NICE)
        while True:
            with self._lock:
                self._changed.wait_for(lambda: bool(self._pending) or self._closed)
                if not self._pending:
                    self._writer = None
                    return
                name = next(iter(self._pending))
                key, data = self._pending[name]
            try:
                self.put(key, data)
            finally:
                with self._lock:
                    if self._pending.pop(name, None) is not None:
                        self._pending_bytes -= len(data)
                    self._changed.notify_all()

    def put(self, key: str, data: bytes | memoryview) -> None:
        """Keep ``data``, the first ``len(data)`` bytes of pack ``key`` (checked already), unless
        as long a copy is here or it is too large for the cache."""
        name = _name_of(key)
        size = len(data)
        if name is None or size == 0 or size > self.limit // 4:
            return
        with self._lock:
            if self._loaded().get(name, -1) >= size:
                return
        tmp = self.directory / f"{name}{_TMP_MARK}{os.getpid()}.{threading.get_ident()}"
        try:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
            )
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, self.directory / name)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return
        with self._lock:
            sizes = self._loaded()
            self._total += size - sizes.pop(name, 0)
            sizes[name] = size
            doomed = self._over_limit(sizes)
        self._remove(doomed)

    def drop(self, key: str) -> None:
        """Forget pack ``key`` and remove its copy (GC removed it; its copy did not check)."""
        name = _name_of(key)
        if name is None:
            return
        with self._lock:
            waiting = self._pending.pop(name, None)
            if waiting is not None:
                self._pending_bytes -= len(waiting[1])
                self._changed.notify_all()
        if self._forget(name):
            self._remove([name])

    @property
    def size(self) -> int:
        """Bytes held (as this process knows them)."""
        with self._lock:
            self._loaded()
            return self._total

    # ------------------------------------------------------------------------------ internals

    def _forget(self, name: str) -> bool:
        with self._lock:
            size = self._loaded().pop(name, None)
            if size is None:
                return False
            self._total -= size
            return True

    def _over_limit(self, sizes: OrderedDict[str, int]) -> list[str]:
        doomed: list[str] = []
        while self._total > self.limit and sizes:
            name, size = sizes.popitem(last=False)
            self._total -= size
            doomed.append(name)
        return doomed

    def _remove(self, names: list[str]) -> None:
        for name in names:
            with contextlib.suppress(OSError):
                os.unlink(self.directory / name)

    def _loaded(self) -> OrderedDict[str, int]:
        """What the directory holds, oldest use first (read once; the lock is held)."""
        if self._sizes is not None:
            return self._sizes
        found: list[tuple[float, str, int]] = []
        stale: list[str] = []
        now = time.time()
        try:
            with os.scandir(self.directory) as listing:
                for item in listing:
                    if not item.is_file(follow_symlinks=False):
                        continue
                    info = item.stat(follow_symlinks=False)
                    if _TMP_MARK in item.name:
                        if now - info.st_mtime > _STALE_TMP_S:
                            stale.append(item.name)
                    elif _NAME.fullmatch("packs/" + item.name):
                        found.append((info.st_mtime, item.name, info.st_size))
        except OSError:
            pass
        found.sort()
        self._sizes = OrderedDict((name, size) for _, name, size in found)
        self._total = sum(self._sizes.values())
        self._remove(stale + self._over_limit(self._sizes))  # (a lowered limit applies now)
        return self._sizes


def _name_of(key: str) -> str | None:
    match = _NAME.fullmatch(key)
    return match.group(1) if match else None
