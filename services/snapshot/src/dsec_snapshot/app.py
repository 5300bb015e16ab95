"""Wiring of the snapshot service: its handlers on the bus.

``snapshot.requested`` → ``snapshot.taken | snapshot.failed``;
``snapshot.restore_requested`` → ``snapshot.restored | snapshot.failed``; with
``DSEC_SNAPSHOT_INTERVAL_S`` > 0 also ``sandbox.ready`` / ``sandbox.exited`` (which sandboxes to
snapshot periodically).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from dsec_core import events
from dsec_core.envelope import Envelope
from dsec_core.events import Payload, SnapshotFailed
from dsec_core.service import RetryPolicy, Service
from dsec_core.settings import Settings
from dsec_core.trust import Gate
from nats.js import JetStreamContext

from dsec_snapshot.handlers import SnapshotHandlers
from dsec_snapshot.periodic import PeriodicSnapshots

log = logging.getLogger(__name__)

_OPERATION = {"snapshot.requested": "create", "snapshot.restore_requested": "restore"}


def snapshot_failed(envelope: Envelope, reason: str, attempts: int) -> Sequence[Payload]:
    """A snapshot request whose retries are exhausted ends in ``snapshot.failed``: a snapshot
    that could not be taken says nothing about the sandbox, which ``sandbox.failed`` (terminal)
    would mark as failed."""
    request = envelope.payload
    return [
        SnapshotFailed(
            snapshot=str(request.get("name") or request.get("snapshot") or ""),
            operation="create" if _OPERATION.get(envelope.type) == "create" else "restore",
            reason=f"gave up after {attempts} attempts: {reason}",
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

    handlers = SnapshotHandlers(service.settings, js, gate)
    # S3 or Vault hiccups: a few quick retries (a rollback is wanted within seconds).
    retry = RetryPolicy(max_attempts=4, base_delay_s=0.5, max_delay_s=4.0, ack_wait_s=60.0)
    service.handles(events.SnapshotRequested, retry=retry, batch=4, on_exhausted=snapshot_failed)(
        handlers.on_requested
    )
    service.handles(
        events.SnapshotRestoreRequested, retry=retry, batch=4, on_exhausted=snapshot_failed
    )(handlers.on_restore_requested)
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
