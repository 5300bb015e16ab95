"""The node's copy of pack bytes: a restore or rollback on a node that took the snapshot (or read
it once already) reads its packs from local disk instead of the object store.

Packs are immutable and named by the BLAKE3 of their content (``packs/<hex>``), so a cached
copy never goes stale: a pack GC rewrote has a new name, and the old copy is only unused
bytes until it is removed (:meth:`PackCache.retain`, or evicted). What a file holds is a prefix
of its pack (the whole pack when the packer put it there; the bytes a restore's first read of
the pack brought otherwise, exactly as long as asked for), and a read that reaches past it is a
miss.

Two kinds of copy: a pack this node's packer made is kept whole (``<hash>.own``), and a read
of most of it is checked once, as a whole, against the pack's name and the trailer this node
wrote (:func:`.store._own_pack`): every chunk in it is what the packer compressed, whose id it
computed from the bytes it compressed, so none needs hashing again. A copy of what a restore
read from S3 (``<hash>``) is trusted no more than S3: every chunk a read uses is decompressed
and its BLAKE3 checked against the signed manifest (:meth:`.SnapshotStore._read_span`), as is
every chunk of a small read of an own copy. A copy in which a chunk does not check, or does not
even decompress, or whose hash is not its name, is dropped and the pack read from the object
store again. A restore keeps a copy only of a read in which every chunk it used checked (bytes
between those chunks are kept unchecked: they are checked when a later read uses them, and
dropped then if they are bad).
Copies are written with mode 0600 in a 0700 directory, through a temporary file renamed into
place, so a crash or a second process never leaves a half-written copy under a pack's name.

Copies are written behind (:meth:`PackCache.keep`): a thread of lower priority writes them
after the snapshot or restore that brought the bytes, which does not wait for it (writing 28 MB
into new files costs ~30 ms of CPU on a 2-vCPU VM: 9 % of a cold snapshot of 50 MB, measured
alternating with the cache off). Until it is written, a copy is read from memory; at most
``pending_limit`` bytes wait (more are not kept), and :meth:`PackCache.close` writes what waits.

The cache is bounded (``limit`` bytes, ``DSEC_SNAPSHOT_PACK_CACHE_MB``, each copy counted in
whole 4 KiB blocks): the least recently used copies are removed once it is over, and a pack
larger than a quarter of the limit is never kept. Its bookkeeping is per process: two
processes on one directory (two CLI runs at once) may each fill it to the limit until the next
one to load it trims it back. Every ``OSError`` here is a miss or a copy not kept: the object
store is always there behind it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from pathlib import Path

from prometheus_client import Counter

log = logging.getLogger(__name__)

PACK_READS = Counter(
    "dsec_snapshot_pack_reads_total",
    "Pack reads of restores, rollbacks and diffs (not verify, which always reads S3), by "
    "source: cache (the node's copy) or store (S3)",
    ["source"],
)
_FROM_CACHE = PACK_READS.labels("cache")
_FROM_STORE = PACK_READS.labels("store")

_NAME = re.compile(r"packs/([0-9a-f]{64})")
_FILE = re.compile(r"[0-9a-f]{64}(?:\.own)?")
OWN = ".own"
"""The file of a whole pack this node's packer made (``<hash>.own``), as against a copy of what
a read brought from S3 (``<hash>``): only the former is checked as a whole against its name and
its own trailer (:meth:`PackCache.read_own`), since an S3 attacker may have written the
trailer of the latter."""
_TMP_MARK = ".tmp"
_BLOCK = 4096
PENDING_LIMIT = 64 << 20
"""Bytes of copies waiting to be written at most (a snapshot larger than that is partly kept)."""
_WRITER_NICE = 10
_STALE_TMP_S = 600.0
"""A temporary file older than this is a crashed writer's: removed when the cache is loaded."""


def count_read(from_cache: bool) -> None:
    """Count a pack read of a restore, rollback or diff: served by this node's copy, or by the
    object store (the copy missed, or there is no cache)."""
    (_FROM_CACHE if from_cache else _FROM_STORE).inc()


def _charge(size: int) -> int:
    """What a copy of ``size`` bytes counts against the limit: its blocks on disk."""
    return max(1, -(-size // _BLOCK)) * _BLOCK


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
        self._total = 0  # what the copies count against the limit (_charge of each)
        # Copies waiting for the writer thread (file name -> bytes), in the order kept; the one
        # being written stays here (read from memory) until its file is in place.
        self._pending: dict[str, bytes] = {}
        self._pending_bytes = 0
        self._writing: str | None = None  # the name the writer thread is writing now
        self._revoked: set[str] = set()  # ... dropped meanwhile: its file goes once written
        self._changed = threading.Condition(self._lock)
        self._writer: threading.Thread | None = None
        self._closed = False
        self._dir_made = False

    # ------------------------------------------------------------------------------ reading

    def read(self, key: str, start: int, length: int) -> bytes | memoryview | None:
        """``length`` bytes of pack ``key`` from ``start``, or ``None`` (not here, shorter
        than that, unreadable)."""
        name = _name_of(key)
        if name is None or length <= 0 or start < 0:
            return None
        for file in (name + OWN, name):
            data = self._read(file, start, length)
            if data is not None:
                return data
        return None

    def holds(self, key: str) -> bool:
        """Whether some copy of pack ``key`` is here (its own or one read from S3), whole or
        not: a read of it may stay on this disk."""
        name = _name_of(key)
        if name is None:
            return False
        with self._lock:
            sizes = self._loaded()
            return any(f in self._pending or f in sizes for f in (name + OWN, name))

    def own_size(self, key: str) -> int | None:
        """The size of the whole copy of pack ``key`` this node's packer made, if there is one."""
        name = _name_of(key)
        if name is None:
            return None
        with self._lock:
            waiting = self._pending.get(name + OWN)
            return len(waiting) if waiting is not None else self._loaded().get(name + OWN)

    def read_own(self, key: str) -> tuple[bytes, bool] | None:
        """The whole pack ``key`` as this node's packer made it, and whether it came from
        memory (written by this process, never on disk yet); ``None`` when there is no such
        copy. The caller checks a copy from disk against the pack's name."""
        name = _name_of(key)
        if name is None:
            return None
        file = name + OWN
        with self._lock:
            waiting = self._pending.get(file)
            if waiting is not None:
                return waiting, True
            size = self._loaded().get(file)
        if size is None:
            return None
        data = self._read(file, 0, size)
        return None if data is None else (bytes(data), False)

    def _read(self, file: str, start: int, length: int) -> bytes | memoryview | None:
        with self._lock:
            waiting = self._pending.get(file)
            if waiting is not None and start + length <= len(waiting):
                return memoryview(waiting)[start : start + length]
            sizes = self._loaded()
            size = sizes.get(file)
            if size is None or start + length > size:
                return None
            sizes.move_to_end(file)
        try:
            # (no FIFO or device can stall a restore here: non-blocking, a regular file only)
            fd = os.open(
                self.directory / file, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
            )
        except OSError:
            self._forget(file)
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                data = b""
            else:
                data = os.pread(fd, length, start)
                with contextlib.suppress(OSError):  # (a read-only mount: the order is lost)
                    os.utime(fd)  # the order of use survives a restart (loaded by mtime)
        except OSError:
            return None
        finally:
            os.close(fd)
        if len(data) != length:  # cut short or swapped behind our back: not a copy of the pack
            self._discard(file)
            return None
        return data

    # ------------------------------------------------------------------------------ writing

    def keep(self, key: str, data: bytes, *, own: bool = False) -> None:
        """Keep ``data`` (see :meth:`put`), written behind by the writer thread; read from
        memory until then. Not kept when ``pending_limit`` bytes wait already. Never raises:
        a copy that cannot be kept is only a later read from S3."""
        size = len(data)
        file = self._file_for(key, size, own)
        if file is None:
            return
        if own and type(data) is not bytes:  # (trusted from memory unhashed: never mutable)
            data = bytes(data)
        with self._lock:
            if (
                self._closed
                or file in self._pending
                or self._pending_bytes + size > self.pending_limit
                or self._have(file, size)
            ):
                return
            self._pending[file] = data
            self._pending_bytes += size
            if self._writer is None:
                writer = threading.Thread(
                    target=self._write_behind, name="snap-pack-cache", daemon=True
                )
                try:
                    writer.start()
                except RuntimeError:  # no thread to be had: not kept
                    del self._pending[file]
                    self._pending_bytes -= size
                    return
                self._writer = writer
            self._changed.notify_all()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every copy kept so far is written; False when ``timeout_s`` ran out."""
        with self._lock:
            return self._changed.wait_for(
                lambda: not self._pending and self._writing is None, timeout_s
            )

    def close(self, timeout_s: float = 30.0) -> None:
        """Write what waits, then stop the writer thread (nothing is kept after this)."""
        with self._lock:
            self._closed = True
            self._changed.notify_all()
            writer = self._writer
        if writer is not None and writer.is_alive():
            writer.join(timeout_s)

    def _write_behind(self) -> None:
        # Below the threads that compress, hash and write a restore (on Linux a thread has its
        # own nice value); raising it needs no privilege.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _WRITER_NICE)
        try:
            while True:
                with self._lock:
                    self._changed.wait_for(lambda: bool(self._pending) or self._closed)
                    if not self._pending:
                        return
                    file, data = next(iter(self._pending.items()))
                    self._writing = file
                try:
                    self.put(f"packs/{file[:64]}", data, own=file.endswith(OWN))
                except Exception:  # (put turns OSError into a copy not kept; anything else)
                    log.exception("pack copy %s not kept", file)
                finally:
                    self._written(file, data)
        finally:
            with self._lock:
                if self._writer is threading.current_thread():
                    self._writer = None
                self._changed.notify_all()

    def _written(self, file: str, data: bytes) -> None:
        """The writer thread's end of one copy: it waits no more, it is removed if it was
        dropped while written, and only then is the write done (``flush()`` returns after the
        removal)."""
        with self._lock:
            if self._pending.get(file) is data:  # (not a newer copy kept since)
                del self._pending[file]
                self._pending_bytes -= len(data)
            revoked = file in self._revoked
        try:
            if revoked:
                self._discard(file)
        except Exception:  # (the writer goes on; the next retain() removes it)
            log.exception("pack copy %s not removed", file)
        finally:
            with self._lock:
                self._writing = None
                self._revoked.discard(file)
                self._changed.notify_all()

    def put(self, key: str, data: bytes | memoryview, *, own: bool = False) -> None:
        """Keep ``data``, the first ``len(data)`` bytes of pack ``key`` (``own``: all of it, as
        this node's packer made it), unless as good a copy is here or it is too large."""
        size = len(data)
        file = self._file_for(key, size, own)
        if file is None:
            return
        with self._lock:
            if self._have(file, size):
                return
        tmp = self.directory / f"{file[:64]}{_TMP_MARK}{os.getpid()}.{threading.get_ident()}"
        try:
            if not self._dir_made:  # 0700 whoever made it, and whatever umask made it
                self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
                os.chmod(self.directory, 0o700, follow_symlinks=False)
                self._dir_made = True
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600
            )
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
            finally:
                os.close(fd)
            os.replace(tmp, self.directory / file)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            return
        with self._lock:
            sizes = self._loaded()
            old = sizes.pop(file, None)
            self._total += _charge(size) - (0 if old is None else _charge(old))
            sizes[file] = size
            doomed = self._over_limit(sizes)
        self._remove(doomed)

    def _file_for(self, key: str, size: int, own: bool) -> str | None:
        """The file a copy of ``size`` bytes of pack ``key`` goes to; ``None``: not kept (not a
        pack's name, empty, or more than a quarter of the cache)."""
        name = _name_of(key)
        if name is None or size == 0 or size > self.limit // 4:
            return None
        return name + OWN if own else name

    def _have(self, file: str, size: int) -> bool:
        """Whether as good a copy as ``size`` bytes in ``file`` is here (the lock is held): a
        copy read from S3 is no better than the whole pack this node made."""
        sizes = self._loaded()
        if not file.endswith(OWN) and (file + OWN in self._pending or file + OWN in sizes):
            return True
        return sizes.get(file, -1) >= size

    def drop(self, key: str) -> None:
        """Forget pack ``key`` and remove its copy (GC removed it; its copy did not check),
        also one waiting to be written or being written now."""
        name = _name_of(key)
        if name is None:
            return
        for file in (name + OWN, name):
            with self._lock:
                waiting = self._pending.pop(file, None)
                if waiting is not None:
                    self._pending_bytes -= len(waiting)
                if self._writing == file:
                    self._revoked.add(file)
                self._changed.notify_all()
            self._discard(file)

    def _discard(self, file: str) -> None:
        """Forget the file ``file`` and remove it."""
        if self._forget(file):
            self._remove([file])

    def retain(self, live: Collection[str], min_age_s: float) -> int:
        """Remove the copies of packs not in ``live`` (pack keys: what the store's index
        names) whose file is older than ``min_age_s`` (a snapshot being taken stores its packs
        before an index names them); how many went."""
        keep = {name for key in live if (name := _name_of(key)) is not None}
        with self._lock:
            candidates = [file for file in self._loaded() if file[:64] not in keep]
        now = time.time()
        removed = 0
        for file in candidates:
            try:
                age = now - os.stat(self.directory / file, follow_symlinks=False).st_mtime
            except OSError:
                self._forget(file)
                continue
            if age >= min_age_s:
                self.drop(f"packs/{file[:64]}")
                removed += 1
        return removed

    @property
    def size(self) -> int:
        """What the copies count against the limit, as this process knows them."""
        with self._lock:
            self._loaded()
            return self._total

    # ------------------------------------------------------------------------------ internals

    def _forget(self, name: str) -> bool:
        with self._lock:
            size = self._loaded().pop(name, None)
            if size is None:
                return False
            self._total -= _charge(size)
            return True

    def _over_limit(self, sizes: OrderedDict[str, int]) -> list[str]:
        doomed: list[str] = []
        while self._total > self.limit and sizes:
            name, size = sizes.popitem(last=False)
            self._total -= _charge(size)
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
                    elif _FILE.fullmatch(item.name):
                        found.append((info.st_mtime, item.name, info.st_size))
        except OSError:
            pass
        found.sort()
        self._sizes = OrderedDict((name, size) for _, name, size in found)
        self._total = sum(_charge(size) for size in self._sizes.values())
        self._remove(stale + self._over_limit(self._sizes))  # (a lowered limit applies now)
        return self._sizes


def _name_of(key: str) -> str | None:
    match = _NAME.fullmatch(key)
    return match.group(1) if match else None
