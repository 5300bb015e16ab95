"""Wiring of the snapshot service: its handlers on the bus.

``snapshot.requested`` of a sandbox that runs nowhere → ``snapshot.taken | snapshot.failed``
(a running sandbox's is its node agent's); ``snapshot.restore_requested`` of a sandbox that runs
nowhere → ``snapshot.failed`` with the reason; ``snapshot.delete_requested`` →
``snapshot.deleted``; with ``DSEC_SNAPSHOT_INTERVAL_S`` > 0 also ``sandbox.ready`` /
``sandbox.exited`` (which sandboxes to ask periodic snapshots of).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence

from dsec_core import events
from dsec_core.envelope import Envelope
from dsec_core.events import Payload, SnapshotDeleted
from dsec_core.service import RetryPolicy, Service
from dsec_core.settings import Settings
from dsec_core.trust import Gate
from dsec_snapstore.requests import snapshot_failed
from nats.js import JetStreamContext

from dsec_snapshot.deletes import SnapshotDeletes
from dsec_snapshot.handlers import service_requests
from dsec_snapshot.periodic import PeriodicSnapshots

log = logging.getLogger(__name__)

DELETE_TIMEOUT_S = 900.0
"""How long one attempt of a delete (or GC) may run before it is cancelled and retried."""


def not_deleted(
    envelope: Envelope, reason: str, attempts: int, done: Mapping[str, bool] | None = None
) -> Sequence[Payload]:
    """A delete whose retries are exhausted still ends in ``snapshot.deleted`` (terminal): the
    names this process knows it deleted (``done[name]`` true) as deleted, those it found
    missing (false) as missing, every other one ``failed`` (it may exist still: not "missing",
    which would tell the user there was no such one)."""
    log.warning("snapshot delete %s gave up after %d attempts: %s", envelope.id, attempts, reason)
    names = list(dict.fromkeys(str(n) for n in envelope.payload.get("names") or []))
    done = done or {}
    return [
        SnapshotDeleted(
            names=[n for n in names if done.get(n) is True],
            missing=[n for n in names if done.get(n) is False],
            failed=[n for n in names if n not in done],
            gc_skipped="gave_up" if envelope.payload.get("gc") else None,
        )
    ]


def create_service(settings: Settings | None = None) -> Service:
    """Build the snapshot service with its handlers registered."""
    service = Service("snapshot", settings)

    def js() -> JetStreamContext:
        assert service.nc is not None
        return service.nc.jetstream()

    async def publish(payload: Payload, aggregate_id: str, event_id: str | None) -> None:
        # Not a handler's output: the event still belongs to the sandbox's tenant.
        assert service.publisher is not None and service.gate is not None
        tenant = None
        if payload.AGGREGATE == "sandbox":
            tenant = await service.gate.tenant_of(aggregate_id)
        await service.publisher.publish(
            payload, aggregate_id=aggregate_id, event_id=event_id, tenant=tenant
        )

    def gate() -> Gate:
        assert service.gate is not None
        return service.gate

    handlers = service_requests(service.settings, js, gate)
    # S3 or Vault hiccups: a few quick retries (a rollback is wanted within seconds).
    retry = RetryPolicy(max_attempts=4, base_delay_s=0.5, max_delay_s=4.0, ack_wait_s=60.0)
    for request, handler, answer in (
        (events.SnapshotRequested, handlers.on_requested, events.SnapshotTaken),
        (events.SnapshotRestoreRequested, handlers.on_restore_requested, events.SnapshotRestored),
    ):
        service.handles(
            request.TYPE,
            retry=retry,
            batch=4,
            on_exhausted=snapshot_failed,
            answers=(answer, events.SnapshotFailed),
        )(handler)
    deletes = SnapshotDeletes(handlers)
    # Two at once, one per tenant: a tenant's long delete (up to MAX_DELETE_NAMES manifests,
    # or a GC) holds another tenant's by none (before: one at a time in stream order, so one
    # request of 20,000 names held every tenant's `dsec snapshot rm` 31 s), and no attempt
    # runs past its timeout.
    service.handles(
        events.SnapshotDeleteRequested,
        retry=dataclasses.replace(retry, attempt_timeout_s=DELETE_TIMEOUT_S),
        batch=8,
        workers=2,
        tenant_workers=1,
        on_exhausted=lambda envelope, reason, attempts: not_deleted(
            envelope, reason, attempts, deletes.outcome(envelope)
        ),
        answers=(events.SnapshotDeleted,),
    )(deletes.on_delete_requested)
    service.on_start.append(handlers.start)
    if service.settings.snapshot_interval_s > 0:
        periodic = PeriodicSnapshots(
            handlers, publish, service.settings.snapshot_interval_s, service.settings.snapshot_keep
        )
        service.handles(events.SandboxReady)(periodic.on_ready)
        service.handles(events.SandboxExited)(periodic.on_exited)
        service.on_start.append(periodic.start)
        service.on_stop.append(periodic.stop)
    service.on_stop.append(handlers.close)
    return service
