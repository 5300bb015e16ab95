"""Store-wide locks kept in the object store itself: a GC excludes every create, creates share.

A create decides which chunks it need not upload from the pack index it read; a GC deletes the
packs whose chunks no manifest names. Run at once from two processes (the CLI's ``dsec snapshot
create`` and the snapshot service's GC, or two nodes' services on one bucket), a create could
name a chunk the GC was deleting: a snapshot stored whole but missing a chunk. The grace period
protects only packs written recently, not an old pack whose chunk a new snapshot reuses.

The protocol is restic's (https://restic.readthedocs.io/en/stable/100_references.html#locks):

1. write your lock object, ``locks/<kind>-<id>.json`` (``shared`` for a create, ``exclusive``
   for a GC), naming its holder;
2. list ``locks/``: a fresh lock that conflicts with yours (an exclusive one, or for an
   exclusive lock any other) means delete yours, wait a moment and try again, until a deadline
   (then :class:`~dsec_snapstore.errors.StoreBusy`, naming the holders);
3. while held, the lock is written again every ``refresh_s`` (its last-modified time moves);
4. released: deleted.

Two parties that write at once both see the other and both step back (each waits a little and
tries again), so at no time do a GC and a create both go on. A lock not written again for
``stale_after`` is a crashed holder's and is ignored (a GC removes it). Ages are measured with
the store's own clock: the last-modified time of the lock just written, not this host's clock.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Literal

from dsec_snapstore.adapters.objectstore import ObjectInfo, ObjectMissing, ObjectStore
from dsec_snapstore.errors import StoreBusy

log = logging.getLogger(__name__)

LOCK_PREFIX = "locks/"
STALE_AFTER = timedelta(minutes=5)
REFRESH_S = 60.0
Kind = Literal["shared", "exclusive"]


class StoreLocks:
    """Takes and holds the locks of one store (see the module's text).

    Args:
        objects: The store.
        stale_after: A lock not written again for this long is ignored (its holder crashed).
        refresh_s: How often a held lock is written again (well under ``stale_after``).
    """

    def __init__(
        self,
        objects: ObjectStore,
        *,
        stale_after: timedelta = STALE_AFTER,
        refresh_s: float = REFRESH_S,
    ) -> None:
        self.objects = objects
        self.stale_after = stale_after
        self.refresh_s = refresh_s
        self.holder = f"{socket.gethostname()}:{os.getpid()}"

    @contextmanager
    def shared(self, wait_s: float, what: str = "snapshot create") -> Iterator[str]:
        """Hold a shared lock (any number at once; none while a GC holds its lock)."""
        held = self.acquire("shared", wait_s, what)
        try:
            yield held.key
        finally:
            held.release()

    @contextmanager
    def exclusive(self, wait_s: float, what: str = "snapshot gc") -> Iterator[str]:
        """Hold the exclusive lock (no other lock at once)."""
        held = self.acquire("exclusive", wait_s, what)
        try:
            yield held.key
        finally:
            held.release()

    def acquire(self, kind: Kind, wait_s: float, what: str) -> Held:
        """Take a lock of ``kind``, waiting up to ``wait_s`` for conflicting ones to go; it is
        written again every ``refresh_s`` until :meth:`Held.release`.

        Raises:
            StoreBusy: a conflicting lock was still there after ``wait_s``.
        """
        key = self._acquire(kind, wait_s, what)
        held = Held(self, key, self._body(kind, what))
        held.start()
        return held

    def stale(self) -> list[str]:
        """The locks not written again for ``stale_after`` (by the store's clock)."""
        listed = self.objects.list(LOCK_PREFIX)
        if not listed:
            return []
        now = max(info.last_modified for info in listed.values())
        return [k for k, info in listed.items() if now - info.last_modified > self.stale_after]

    def _body(self, kind: Kind, what: str) -> bytes:
        return json.dumps({"kind": kind, "holder": self.holder, "for": what}).encode()

    def _acquire(self, kind: Kind, wait_s: float, what: str) -> str:
        deadline = time.monotonic() + wait_s
        delay = 0.02
        body = self._body(kind, what)
        while True:
            key = f"{LOCK_PREFIX}{kind}-{uuid.uuid4().hex}.json"
            self.objects.put(key, body)
            try:
                blockers = self._blockers(key, kind)
            except BaseException:
                self.objects.delete_many([key])
                raise
            if not blockers:
                return key
            self.objects.delete_many([key])
            if time.monotonic() + delay > deadline:
                raise StoreBusy(self._busy_text(what, blockers, wait_s))
            time.sleep(delay)  # (both sides stepped back when they wrote at once: back off)
            delay = min(delay * 2, 0.5)

    def _blockers(self, mine: str, kind: Kind) -> dict[str, ObjectInfo]:
        listed = self.objects.list(LOCK_PREFIX)
        own = listed.get(mine)
        if own is None:  # not listed yet: count every lock as fresh
            now = max((i.last_modified for i in listed.values()), default=None)
        else:
            now = own.last_modified
        out: dict[str, ObjectInfo] = {}
        for key, info in listed.items():
            if key == mine or (now is not None and now - info.last_modified > self.stale_after):
                continue
            other = key[len(LOCK_PREFIX) :].partition("-")[0]
            if kind == "exclusive" or other == "exclusive":
                out[key] = info
        return out

    def _busy_text(self, what: str, blockers: dict[str, ObjectInfo], wait_s: float) -> str:
        held = []
        for key, info in sorted(blockers.items())[:3]:
            try:
                doc = json.loads(self.objects.get(key))
                by = f"{doc.get('for', '?')} by {doc.get('holder', '?')}"
            except (ObjectMissing, ValueError, AttributeError):
                by = "released meanwhile"
            held.append(f"{key} ({by}, written {_iso(info.last_modified)})")
        more = f" and {len(blockers) - 3} more" if len(blockers) > 3 else ""
        return (
            f"{what}: the snapshot store is locked by {', '.join(held)}{more}; waited "
            f"{wait_s:g} s. A GC and a create never run at once (the create could reuse a chunk "
            f"the GC deletes). Try again later; a lock left by a crashed process is ignored "
            f"once it is {int(self.stale_after.total_seconds())} s old"
        )


class Held:
    """A lock taken: written again every ``refresh_s`` (a thread of its own) until released."""

    def __init__(self, locks: StoreLocks, key: str, body: bytes) -> None:
        self.key = key
        self._locks = locks
        self._body = body
        self._stop = threading.Event()
        self._guard = threading.Lock()  # a refresh never writes the lock again after release
        self._thread = threading.Thread(target=self._refresh, name="snap-lock", daemon=True)

    def start(self) -> None:
        """Start writing the lock again every ``refresh_s``."""
        self._thread.start()

    def release(self) -> None:
        """Delete the lock (the first call only); a failure is logged, the lock goes stale."""
        with self._guard:
            if self._stop.is_set():
                return
            self._stop.set()
        try:
            self._locks.objects.delete_many([self.key])
        except Exception as exc:  # it goes stale; the work is done
            log.warning(
                "could not remove the store lock %s (stale in %s): %s",
                self.key,
                self._locks.stale_after,
                exc,
            )

    def _refresh(self) -> None:
        while not self._stop.wait(self._locks.refresh_s):
            with self._guard:
                if self._stop.is_set():
                    return
                try:
                    self._locks.objects.put(self.key, self._body)
                except Exception as exc:  # tried again at the next tick
                    log.warning("could not refresh the store lock %s: %s", self.key, exc)


def _iso(when: datetime) -> str:
    return when.isoformat(timespec="seconds")
