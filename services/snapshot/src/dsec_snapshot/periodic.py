"""Periodic snapshots of every running sandbox (``DSEC_SNAPSHOT_INTERVAL_S``), on any node.

The service learns which sandboxes run from the log: at start, every ``sandbox.ready`` without a
``sandbox.exited``; then from the ``sandbox.ready`` / ``sandbox.exited`` events it consumes.
On each tick, for a sandbox whose last periodic snapshot is older than the interval it
publishes ``snapshot.requested`` (``requested_by: periodic``, name ``auto-<id>-<time>``): the
node agent that owns the sandbox takes it and publishes ``snapshot.taken``. Retention of each
sandbox's periodic series (``DSEC_SNAPSHOT_KEEP``) and, now and then, the GC of unreferenced
chunks are this service's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta

from dsec_core import events
from dsec_core.bus import replay
from dsec_core.envelope import Envelope, decode
from dsec_core.ids import derive_event_id
from dsec_core.subjects import filter_for
from dsec_snapstore import domain, sandboxes
from dsec_snapstore.domain import RetentionPolicy
from dsec_snapstore.errors import StoreBusy
from dsec_snapstore.manifest import SnapshotSummary
from dsec_snapstore.requests import PERIODIC_REQUESTER, SnapshotRequests

log = logging.getLogger(__name__)

Publish = Callable[[events.Payload, str, str | None], Awaitable[None]]

GC_EVERY_S = 600.0
"""Chunks become unreferenced only when retention deletes snapshots: GC at most this often."""
GC_BUSY_RETRY_S = 300.0
"""A GC owed but kept out by snapshots being taken (``StoreBusy``) is tried again this soon
(not sooner: while it waits, up to DSEC_SNAPSHOT_GC_WAIT_S, new snapshots wait for it)."""


class PeriodicSnapshots:
    """Asks for a snapshot of every running sandbox every ``interval_s``; keeps ``keep``."""

    def __init__(
        self, requests: SnapshotRequests, publish: Publish, interval_s: float, keep: int
    ) -> None:
        self.requests = requests
        self._publish = publish
        self.interval = timedelta(seconds=interval_s)
        self.retention = RetentionPolicy(keep_last=keep)
        self.running: set[str] = set()
        self._last_asked: dict[str, float] = {}
        self._gc_after = time.monotonic() + GC_EVERY_S  # no GC before this (monotonic)
        self._gc_owed = False  # retention deleted snapshots since the last GC that ran
        self._since = datetime.now(UTC)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Find the sandboxes running now, then tick in the background."""
        self._since = datetime.now(UTC)
        js = self.requests.js()
        ready: set[str] = set()
        async for _, data in replay(js, filter_subject=filter_for("sandbox.ready")):
            ready.add(decode(data).aggregate_id)
        async for _, data in replay(js, filter_subject=filter_for("sandbox.exited")):
            ready.discard(decode(data).aggregate_id)
        self.running |= ready
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Stop ticking."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def on_ready(
        self, envelope: Envelope, event: events.SandboxReady
    ) -> Sequence[events.Payload]:
        """Track a sandbox that started (on any node)."""
        # Older events were accounted for by the scan at start (a new durable consumer
        # delivers the whole history, ready events of long-gone sandboxes included).
        if envelope.time >= self._since:
            self.running.add(envelope.aggregate_id)
        return []

    async def on_exited(
        self, envelope: Envelope, event: events.SandboxExited
    ) -> Sequence[events.Payload]:
        """Forget a sandbox that ended."""
        self.running.discard(envelope.aggregate_id)
        self._last_asked.pop(envelope.aggregate_id, None)
        return []

    async def _loop(self) -> None:
        tick = min(max(self.interval.total_seconds() / 4, 0.5), 60.0)
        while True:
            await asyncio.sleep(tick)
            try:
                await self.tick()
            except Exception:  # one bad tick must not end periodic snapshots
                log.exception("periodic snapshots: tick failed")

    async def tick(self) -> list[str]:
        """Ask for each due sandbox's snapshot and apply retention; return the names asked."""
        store = self.requests.store
        rows = await asyncio.to_thread(store.list_snapshots)
        asked = []
        expired_any = False
        now = datetime.now(UTC)
        for sid in sorted(self.running):
            series = periodic_series(rows, sid)
            expired = domain.select_expired(series, self.retention, now)
            for name in expired:
                with contextlib.suppress(Exception):
                    await asyncio.to_thread(store.delete, name)
                    expired_any = True
            wanted = await self._ask_if_due(sid, series, now)
            if wanted is not None:
                asked.append(wanted)
        self._gc_owed |= expired_any
        if self._gc_owed and time.monotonic() >= self._gc_after:
            await self._collect()
        return asked

    async def _collect(self) -> None:
        """The GC retention made due; owed until it has run (a busy store puts it off)."""
        self._gc_after = time.monotonic() + GC_EVERY_S
        try:
            report = await asyncio.to_thread(self.requests.store.gc)
        except StoreBusy as exc:  # snapshots being taken: soon again, not in GC_EVERY_S
            self._gc_after = time.monotonic() + GC_BUSY_RETRY_S
            log.warning("snapshot gc put off %.0f s: %s", GC_BUSY_RETRY_S, exc)
            return
        self._gc_owed = False
        log.info("snapshot gc: %d objects deleted", len(report.deleted))

    async def _ask_if_due(
        self, sid: str, series: list[SnapshotSummary], now: datetime
    ) -> str | None:
        last_asked = self._last_asked.get(sid)
        if last_asked is not None and time.monotonic() - last_asked < self.interval.total_seconds():
            return None
        last = max((s.created_at for s in series), default=None)
        if not domain.is_due(last, now, self.interval):
            return None
        name = domain.periodic_name(sandboxes.periodic_prefix(sid), now)
        request = events.SnapshotRequested(name=name, requested_by=PERIODIC_REQUESTER)
        await self._publish(request, sid, derive_event_id(sid, f"snapshot.requested#{name}"))
        self._last_asked[sid] = time.monotonic()
        log.info("periodic snapshot %s of %s requested", name, sid)
        return name


def periodic_series(rows: list[SnapshotSummary], sandbox_id: str) -> list[SnapshotSummary]:
    """A sandbox's periodic snapshots, from the store's index rows."""
    prefix = sandboxes.periodic_prefix(sandbox_id)
    return [r for r in rows if r.labels.get("periodic") == prefix]
