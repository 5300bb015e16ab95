"""Periodic snapshots of the sandboxes running on this node (``DSEC_SNAPSHOT_INTERVAL_S``).

The service learns which sandboxes run from the log: at start, every ``sandbox.ready`` without a
``sandbox.exited``; then from the ``sandbox.ready`` / ``sandbox.exited`` events it consumes.
On each tick, a sandbox whose last periodic snapshot is older than the interval is snapshotted
with :meth:`SnapshotStore.run_periodic` (which also applies the retention of its series), and
``snapshot.taken`` is published. Unreferenced chunks are garbage-collected now and then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import replace
from datetime import UTC, datetime, timedelta

from dsec_core import events
from dsec_core.bus import replay
from dsec_core.envelope import Envelope, decode
from dsec_core.ids import derive_event_id
from dsec_core.subjects import filter_for

from dsec_snapshot.domain import PeriodicPolicy, RetentionPolicy
from dsec_snapshot.errors import SnapshotError
from dsec_snapshot.handlers import SnapshotHandlers, taken_event
from dsec_snapshot.sandboxes import SandboxFacts

log = logging.getLogger(__name__)

Publish = Callable[[events.Payload, str, str | None], Awaitable[None]]

GC_EVERY_S = 600.0
"""Chunks become unreferenced only when retention deletes snapshots: GC at most this often."""


class PeriodicSnapshots:
    """Snapshots every running sandbox of this node every ``interval_s``."""

    def __init__(
        self, handlers: SnapshotHandlers, publish: Publish, interval_s: float, keep: int
    ) -> None:
        self.handlers = handlers
        self._publish = publish
        self.interval = timedelta(seconds=interval_s)
        self.retention = RetentionPolicy(keep_last=keep)
        self.running: set[str] = set()
        self._last_taken: dict[str, float] = {}
        self._last_gc = time.monotonic()
        self._since = datetime.now(UTC)
        self._task: asyncio.Task[None] | None = None

    def policy(self, sandbox_id: str) -> PeriodicPolicy:
        """The periodic policy of one sandbox (its own name prefix, so names never collide)."""
        return PeriodicPolicy(self.interval, self.retention, name_prefix=f"auto-{sandbox_id}")

    async def start(self) -> None:
        """Find the sandboxes running now, then tick in the background."""
        self._since = datetime.now(UTC)
        js = self.handlers.js()
        node = self.handlers.settings.node_id
        ready: set[str] = set()
        async for _, data in replay(js, filter_subject=filter_for("sandbox.ready")):
            env = decode(data)
            if env.payload.get("node_id") == node:
                ready.add(env.aggregate_id)
        async for _, data in replay(js, filter_subject=filter_for("sandbox.exited")):
            ready.discard(decode(data).aggregate_id)
        self.running |= ready
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Stop ticking (a snapshot in progress in a thread completes)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def on_ready(
        self, envelope: Envelope, event: events.SandboxReady
    ) -> Sequence[events.Payload]:
        """Track a sandbox that started on this node."""
        # Older events were accounted for by the scan at start (a new durable consumer
        # delivers the whole history, ready events of long-gone sandboxes included).
        if event.node_id == self.handlers.settings.node_id and envelope.time >= self._since:
            self.running.add(envelope.aggregate_id)
        return []

    async def on_exited(
        self, envelope: Envelope, event: events.SandboxExited
    ) -> Sequence[events.Payload]:
        """Forget a sandbox that ended."""
        self.running.discard(envelope.aggregate_id)
        self._last_taken.pop(envelope.aggregate_id, None)
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
        """Snapshot each due sandbox; return the names of the snapshots taken."""
        taken = []
        for sid in sorted(self.running):
            last = self._last_taken.get(sid)
            if last is not None and time.monotonic() - last < self.interval.total_seconds():
                continue
            try:
                name = await self.snapshot(sid)
            except SnapshotError as exc:
                log.warning("periodic snapshot of %s failed: %s", sid, exc)
                continue
            except Exception:  # S3, Vault, NATS: one sandbox must not stop the others
                log.exception("periodic snapshot of %s failed", sid)
                continue
            if name is not None:
                taken.append(name)
        if taken and time.monotonic() - self._last_gc >= GC_EVERY_S:
            self._last_gc = time.monotonic()
            report = await asyncio.to_thread(self.handlers.store.gc)
            log.info("snapshot gc: %d objects deleted", len(report.deleted))
        return taken

    async def snapshot(self, sandbox_id: str) -> str | None:
        """Take the periodic snapshot of one sandbox if due; publish ``snapshot.taken``."""
        handlers = self.handlers
        records = await handlers.history(sandbox_id)
        facts = SandboxFacts.from_events(sandbox_id, (decode(d) for _, d in records))
        code_dir = facts.local_code_dir(handlers.settings.node_id, handlers.sandboxes_root)
        if not facts.running or facts.validated is None or code_dir is None:
            self.running.discard(sandbox_id)  # ended, or nothing of it on this node
            return None
        inputs = replace(
            handlers.inputs(facts, records, labels={"code": "running"}), code_dir=code_dir
        )
        result = await asyncio.to_thread(handlers.run_periodic, self.policy(sandbox_id), inputs)
        if result is None:  # the store holds a recent enough one (e.g. before a restart)
            return None
        self._last_taken[sandbox_id] = time.monotonic()
        name = result.manifest.name
        log.info(
            "periodic snapshot %s of %s: %d files, %d bytes uploaded in %.2f s",
            name,
            sandbox_id,
            result.files,
            result.bytes_uploaded,
            result.duration_s,
        )
        await self._publish(
            taken_event(result), sandbox_id, derive_event_id(sandbox_id, f"snapshot.taken#{name}")
        )
        return name
