"""``snapshot.delete_requested`` → the named snapshots deleted (and, with ``gc``, the chunks no
snapshot refers to any more) → ``snapshot.deleted`` (terminal).

A user deletes only its own tenant's snapshots: a snapshot of another tenant is reported as
missing, exactly like one that does not exist, so a delete request can neither remove nor
reveal another tenant's snapshots. A snapshot records its tenant in its ``tenant`` label (older
ones: the tenant of the sandbox it was taken of; neither: ``default``). A manifest that fails
verification is left for the operator (its tenant cannot be trusted).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Sequence
from datetime import timedelta
from typing import Literal

from dsec_core import events
from dsec_core.envelope import Envelope
from dsec_core.identity import DEFAULT_TENANT
from dsec_snapstore import requests
from dsec_snapstore.errors import (
    InvalidInput,
    SnapshotError,
    SnapshotNotFound,
    StoreBusy,
    StoreUnavailable,
    VerificationFailed,
)

log = logging.getLogger(__name__)


_REMEMBERED = 1024
"""Delete requests whose deletions this process remembers (see ``SnapshotDeletes._done``)."""


class SnapshotDeletes:
    """Deletes and GC on behalf of users (the store of the snapshot service's requests)."""

    def __init__(self, requests_: requests.SnapshotRequests) -> None:
        self.requests = requests_
        # request id -> name -> deleted (True) or found missing (False): an attempt that failed
        # halfway (S3 down after the first of three names) is delivered again, and must report
        # what it deleted before as deleted, not as missing (the user would read "no snapshot
        # named" for its own); one that gives up reports what it found missing as missing
        # (keyed by the request's signing key and id: two users' requests under one id, one
        # copied off the bus, are two requests)
        self._done: OrderedDict[tuple[str, str], dict[str, bool]] = OrderedDict()

    def outcome(self, request: Envelope) -> dict[str, bool]:
        """What this process did for the request: name -> deleted (True) or found missing
        (False); for its answer when it gives up."""
        return dict(self._done.get((request.key_id, request.id), {}))

    async def on_delete_requested(
        self, envelope: Envelope, event: events.SnapshotDeleteRequested
    ) -> Sequence[events.Payload]:
        """Delete what the user may delete; say what was missing; GC when asked."""
        deleted: list[str] = []
        missing: list[str] = []
        key = (envelope.key_id, envelope.id)
        done = self._done.pop(key, {})
        self._done[key] = done  # (the newest last: the oldest go first)
        while len(self._done) > _REMEMBERED:
            self._done.popitem(last=False)
        for name in dict.fromkeys(event.names):
            if done.get(name) or await self._delete_one(name, envelope.tenant):
                deleted.append(name)
                done[name] = True
            else:
                missing.append(name)
                done[name] = False
        chunks, freed = 0, 0
        ran_with: float | None = None
        skipped: Literal["busy", "unreadable"] | None = None
        if event.gc:
            store = self.requests.store
            # A shorter grace would let one tenant's GC delete the packs another tenant's
            # snapshot has uploaded but not yet named (its create then stores a snapshot that
            # names chunks stored nowhere): anyone may ask for more, no one for less.
            grace_s = max(event.gc_grace_s, self.requests.settings.snapshot_gc_min_grace_s)
            if grace_s != event.gc_grace_s:
                log.warning(
                    "snapshot gc asked by %s with a grace of %.0f s: %.0f s applied (the least)",
                    envelope.tenant,
                    event.gc_grace_s,
                    grace_s,
                )
            try:
                grace = timedelta(seconds=grace_s)
                report = await asyncio.to_thread(store.gc, grace=grace)
            except StoreBusy as exc:  # creates held the store past DSEC_SNAPSHOT_GC_WAIT_S
                log.warning("snapshot gc put off: %s", exc)
                skipped = "busy"
            except StoreUnavailable:
                raise  # (tried again; the deletes done are remembered, see _done)
            except SnapshotError as exc:  # an unreadable manifest: nothing was collected
                log.warning("snapshot gc refused: %s", exc)
                skipped = "unreadable"
            else:
                chunks, freed = report.chunks_removed, report.bytes_freed
                ran_with = grace_s  # (the answer says so: a raised grace is no silent change)
        return [
            events.SnapshotDeleted(
                names=deleted,
                missing=missing,
                chunks_removed=chunks,
                bytes_freed=freed,
                gc_grace_s=ran_with,
                gc_skipped=skipped,
            )
        ]

    async def _delete_one(self, name: str, tenant: str) -> bool:
        """Delete ``name`` if it exists and belongs to ``tenant``; whether it was deleted."""
        store = self.requests.store
        try:
            manifest = await asyncio.to_thread(store.load, name)
        except (SnapshotNotFound, InvalidInput):
            return False
        except VerificationFailed:
            manifest = None
        if manifest is None:
            return False  # an unreadable manifest: its tenant is unknown, the operator removes it
        owner = await self.requests.tenant_of_manifest(
            dict(manifest.labels), manifest.source.sandbox_id
        )
        if (owner or DEFAULT_TENANT) != tenant:
            log.warning("delete of snapshot %s by tenant %s refused: not its tenant", name, tenant)
            return False
        try:
            await asyncio.to_thread(store.delete, name)
        except SnapshotNotFound:
            return False
        return True
