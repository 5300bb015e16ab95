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

Three additions to restic's protocol close the gaps a long-lived holder would leave:

- a holder whose lock could not be written again for most of ``stale_after`` (the store
  unreachable from it, not from others) may be taken for crashed: before it acts on what the
  lock protects (a create writing its manifest, a GC deleting) :meth:`Held.check` fails it;
- a lock written must show up in the listing that follows; if it does not, the store's listing
  is not to be trusted and taking the lock fails (no party may go on unseen);
- a GC that has to wait writes ``locks/waiting-<id>.json``: new creates step back for it as for
  a GC's lock, so a stream of creates, each overlapping the next, cannot keep a GC out for
  ever; the creates already running end, the GC runs, then the waiting creates go on.
"""

from __future__ import annotations

import json
import logging
import os
import random
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from typing import Literal

from dsec_core.text import untrusted_json

from dsec_snapstore.adapters.objectstore import ObjectInfo, ObjectMissing, ObjectStore
from dsec_snapstore.errors import StoreBusy, StoreUnavailable

log = logging.getLogger(__name__)

LOCK_PREFIX = "locks/"
STALE_AFTER = timedelta(minutes=5)
REFRESH_S = 60.0
RETRY_S = 5.0  # a refresh that failed is tried again this soon
LOST_AT = 0.8  # a lock unwritten for this share of stale_after is lost (see Held)
Kind = Literal["shared", "exclusive"]
WAITING = "waiting"  # a GC waiting for the creates running to end: no new create starts
WAITING_REFRESH_S = 10.0  # a waiting GC writes its marker again this often
WAITING_STALE = timedelta(seconds=30)  # a marker older than this is a GC's that went away


class LockGivenUp(Exception):
    """The caller gave up waiting for a lock (:meth:`StoreLocks.acquire`'s ``given_up``)."""


def _clock() -> float:
    """Seconds of a clock that also counts while the machine sleeps (a laptop's CLI paused for
    longer than ``stale_after`` must find its lock aged, not young)."""
    return time.clock_gettime(_CLOCK)


_CLOCK = getattr(time, "CLOCK_BOOTTIME", time.CLOCK_MONOTONIC)


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

    def acquire(
        self, kind: Kind, wait_s: float, what: str, *, given_up: threading.Event | None = None
    ) -> Held:
        """Take a lock of ``kind``, waiting up to ``wait_s`` for conflicting ones to go; it is
        written again every ``refresh_s`` until :meth:`Held.release`.

        ``given_up``: set by the caller once it no longer wants the lock (a create that failed
        while its lock was awaited): the wait ends at once with :class:`LockGivenUp`.

        Raises:
            StoreBusy: a conflicting lock was still there after ``wait_s``.
            StoreUnavailable: the store failed (no lock of this call is left behind where the
                store let it be deleted).
            LockGivenUp: ``given_up`` was set while a conflicting lock was waited out.
        """
        key, written = self._acquire(kind, wait_s, what, given_up)
        held = Held(self, key, self._body(kind, what), written)
        try:
            held.start()
        except BaseException:
            held.release()
            raise
        return held

    def stale(self) -> list[str]:
        """The locks not written again for ``stale_after`` (by the store's clock)."""
        listed = self.objects.list(LOCK_PREFIX)
        if not listed:
            return []
        now = max(info.last_modified for info in listed.values())
        return [k for k, info in listed.items() if now - info.last_modified > self.stale_after]

    def _body(self, kind: str, what: str) -> bytes:
        return json.dumps({"kind": kind, "holder": self.holder, "for": what}).encode()

    def _acquire(
        self, kind: Kind, wait_s: float, what: str, given_up: threading.Event | None = None
    ) -> tuple[str, float]:
        deadline = time.monotonic() + wait_s
        delay = 0.02
        body = self._body(kind, what)
        waiting: str | None = None  # a GC's marker while it waits (see the module's text)
        waiting_written = 0.0
        seen: tuple[datetime, float] | None = None  # the store's time at a step back, and ours
        try:
            while True:
                if given_up is not None and given_up.is_set():
                    raise LockGivenUp(f"{what}: no longer waiting for the store's lock")
                blockers: dict[str, ObjectInfo] = {}
                if kind == "shared" and seen is not None:
                    # Stepped back before: look first, and write a lock only when no GC holds
                    # or waits for the store (a create polling with writes would keep showing
                    # a GC a shared lock, and keep it out).
                    store_now = seen[0] + timedelta(seconds=time.monotonic() - seen[1])
                    blockers = self._conflicts(self.objects.list(LOCK_PREFIX), "", kind, store_now)
                if not blockers:
                    key = f"{LOCK_PREFIX}{kind}-{uuid.uuid4().hex}.json"
                    written = self._put(key, body)
                    try:
                        blockers, own_time = self._blockers(key, kind)
                    except BaseException:
                        self._delete(key)
                        raise
                    if not blockers:
                        return key, written
                    seen = (own_time, time.monotonic())
                    if not self._delete(key):
                        raise StoreUnavailable(
                            f"{what}: could not remove its own lock {key} after stepping back "
                            f"for another; it goes stale in {self.stale_after}"
                        )
                if time.monotonic() + delay > deadline:
                    raise StoreBusy(self._busy_text(what, blockers, wait_s))
                if kind == "exclusive" and (
                    waiting is None
                    or _clock() - waiting_written > min(WAITING_REFRESH_S, self.refresh_s)
                ):
                    waiting = waiting or f"{LOCK_PREFIX}{WAITING}-{uuid.uuid4().hex}.json"
                    waiting_written = self._put(waiting, self._body(WAITING, what))
                # (both sides stepped back when they wrote at once: back off, apart)
                pause = delay * random.uniform(0.5, 1.5)
                if given_up is None:
                    time.sleep(pause)
                elif given_up.wait(pause):
                    raise LockGivenUp(f"{what}: no longer waiting for the store's lock")
                delay = min(delay * 2, 0.5)
        finally:
            if waiting is not None:
                self._delete(waiting)

    def _put(self, key: str, body: bytes) -> float:
        """Write a lock; when its write was sent (:func:`_clock`). A failed write may have
        been stored (its answer lost): it is deleted then, as far as the store allows."""
        started = _clock()
        try:
            self.objects.put(key, body)
        except BaseException:
            self._delete(key)
            raise
        return started

    def _delete(self, key: str, tries: int = 3) -> bool:
        """Delete a lock, trying again briefly; whether it is gone (a failure is logged: the
        lock goes stale by itself)."""
        for attempt in range(tries):
            try:
                self.objects.delete_many([key])
                return True
            except Exception as exc:
                if attempt == tries - 1:
                    log.warning(
                        "could not remove the store lock %s (stale in %s): %s",
                        key,
                        self.stale_after,
                        exc,
                    )
                else:
                    time.sleep(0.05 * 4**attempt)
        return False

    def _blockers(self, mine: str, kind: Kind) -> tuple[dict[str, ObjectInfo], datetime]:
        """The fresh locks that conflict with ``mine`` (just written), and its time by the
        store's clock."""
        for attempt in range(4):
            listed = self.objects.list(LOCK_PREFIX)
            own = listed.get(mine)
            if own is not None:
                break
            time.sleep(0.05 * 2**attempt)
        else:  # a party that went on unseen could run beside a conflicting one
            raise StoreUnavailable(
                f"the store lock {mine} was written but is not listed: the object store's "
                "listing is not read-after-write consistent, so its locks cannot be taken"
            )
        return self._conflicts(listed, mine, kind, own.last_modified), own.last_modified

    def _conflicts(
        self, listed: dict[str, ObjectInfo], mine: str, kind: Kind, now: datetime
    ) -> dict[str, ObjectInfo]:
        out: dict[str, ObjectInfo] = {}
        for key, info in listed.items():
            other = key[len(LOCK_PREFIX) :].partition("-")[0]
            stale = WAITING_STALE if other == WAITING else self.stale_after
            if key == mine or now - info.last_modified > stale:
                continue
            if other == WAITING and kind == "exclusive":
                continue  # (another GC's wait: its exclusive lock is what counts)
            if kind == "exclusive" or other in ("exclusive", WAITING):
                out[key] = info
        return out

    def _busy_text(self, what: str, blockers: dict[str, ObjectInfo], wait_s: float) -> str:
        held = []
        for key, info in sorted(blockers.items())[:3]:
            try:
                doc = untrusted_json(self.objects.get(key))
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
    """A lock taken: written again every ``refresh_s`` (a thread of its own) until released.

    Lost for good once it went unwritten for most of ``stale_after``: another process may have
    taken it for a crashed holder's meanwhile, and a later successful write cannot undo what
    that process did (:meth:`check` fails from then on).
    """

    def __init__(self, locks: StoreLocks, key: str, body: bytes, written: float) -> None:
        self.key = key
        self._locks = locks
        self._body = body
        self._written = written  # when its last successful write was sent (_clock)
        self._lost = False
        self._stop = threading.Event()
        self._guard = threading.Lock()  # a refresh never writes the lock again after release
        self._thread = threading.Thread(target=self._refresh, name="snap-lock", daemon=True)

    def start(self) -> None:
        """Start writing the lock again every ``refresh_s``."""
        self._thread.start()

    def check(self, doing: str) -> None:
        """Fail unless the lock has held throughout: not released, and never unwritten for
        most of ``stale_after`` (past it, another process may take it for a crashed holder's).

        Raises:
            StoreUnavailable: naming the lock and how long it went unwritten.
        """
        if self._stop.is_set() or self._lost_since(_clock()):
            stale_s = self._locks.stale_after.total_seconds()
            raise StoreUnavailable(
                f"{doing}: the store lock {self.key} went unwritten for "
                f"{stale_s * LOST_AT:.0f} s or more (the object store failed, or this process "
                f"was paused); past {stale_s:.0f} s another process may take it for a crashed "
                "holder's, so this stopped rather than act on it"
            )

    def _lost_since(self, now: float) -> bool:
        """Whether the lock is lost, ``now`` being a moment its last write was still the one
        before (see the class text); once lost, for good."""
        if now - self._written > self._locks.stale_after.total_seconds() * LOST_AT:
            self._lost = True
        return self._lost

    def release(self) -> None:
        """Delete the lock (the first call only), trying again briefly; a failure is logged,
        the lock goes stale."""
        with self._guard:
            if self._stop.is_set():
                return
            self._stop.set()
        self._locks._delete(self.key)

    def _refresh(self) -> None:
        wait = self._locks.refresh_s
        while not self._stop.wait(wait):
            with self._guard:
                if self._stop.is_set():
                    return
                started = _clock()
                if self._lost_since(started):  # a write now would hide the gap
                    log.warning("the store lock %s went unwritten too long: lost", self.key)
                    return
                try:
                    self._locks.objects.put(self.key, self._body)
                except Exception as exc:  # tried again soon
                    log.warning("could not refresh the store lock %s: %s", self.key, exc)
                    wait = min(RETRY_S, self._locks.refresh_s)
                    continue
                # The store dates a write by its arrival: one that took long may have landed
                # after the lock had aged past its margin there.
                if self._lost_since(_clock()):
                    log.warning("the store lock %s was written too late: lost", self.key)
                    return
                self._written = started
                wait = self._locks.refresh_s


def _iso(when: datetime) -> str:
    return when.isoformat(timespec="seconds")
