"""Each event type's aggregate, without the event models (what reading the stream needs).

:mod:`dsec_core.events` defines every event's payload model, its ``TYPE`` and ``AGGREGATE``;
loading them (with the spec models they carry) takes a fifth of a second. A reader that only
routes or checks envelopes (``dsec audit verify``'s verifier, :func:`dsec_core.subjects.
subject_for`) needs only which aggregate each type belongs to: that is this table.
``libs/core/tests/test_envelope_signing.py`` holds it equal to the models' own.
"""

from __future__ import annotations

from typing import Any

from dsec_core import canonical

AGGREGATES: dict[str, str] = {
    "audit.key_registered": "producer",
    "audit.key_revoked": "producer",
    "cluster.config_set": "cluster",
    "context.injected": "sandbox",
    "deps.conflict": "sandbox",
    "deps.resolved": "sandbox",
    "env.built": "sandbox",
    "experiment.completed": "experiment",
    "experiment.started": "experiment",
    "experiment.trial_completed": "experiment",
    "gpu.degraded": "node",
    "gpu.recovered": "node",
    "link.congested": "node",
    "node.cordon_requested": "node",
    "node.cordoned": "node",
    "node.heartbeat": "node",
    "node.joined": "node",
    "node.lost": "node",
    "policy.reported": "sandbox",
    "policy.violation": "sandbox",
    "policy.violation_summary": "sandbox",
    "recording.saved": "sandbox",
    "sandbox.exited": "sandbox",
    "sandbox.failed": "sandbox",
    "sandbox.pending": "sandbox",
    "sandbox.ready": "sandbox",
    "sandbox.restarted": "sandbox",
    "sandbox.scheduled": "sandbox",
    "sandbox.stop_requested": "sandbox",
    "security.event_rejected": "security",
    "snapshot.delete_requested": "snapshot",
    "snapshot.deleted": "snapshot",
    "snapshot.failed": "sandbox",
    "snapshot.requested": "sandbox",
    "snapshot.restore_requested": "sandbox",
    "snapshot.restored": "sandbox",
    "snapshot.taken": "sandbox",
    "spec.rejected": "sandbox",
    "spec.submitted": "sandbox",
    "spec.validated": "sandbox",
    "state.checkpointed": "sandbox",
    "state.handed_over": "sandbox",
    "state.recovered": "sandbox",
    "tool.degraded": "sandbox",
    "tool.recovered": "sandbox",
    "unit.lost": "sandbox",
    "unit.migrated": "sandbox",
    "unit.migration_failed": "sandbox",
    "unit.migration_requested": "sandbox",
    "unit.migration_started": "sandbox",
    "unit.placed": "sandbox",
}
"""Event type -> its aggregate, for every event type of this version of DSec."""


class UnknownEventType(ValueError):
    """The event type is not part of this version of DSec."""


class MalformedEnvelope(ValueError):
    """Bytes on the bus that are not a DSec envelope."""


def aggregate_of(event_type: str) -> str:
    """The aggregate of ``event_type`` or :class:`UnknownEventType` naming the known ones."""
    try:
        return AGGREGATES[event_type]
    except KeyError:
        known = ", ".join(sorted(AGGREGATES))
        raise UnknownEventType(f"unknown event type {event_type!r}; known: {known}") from None


def unpack_fields(data: bytes) -> dict[str, Any]:
    """The envelope's raw fields, exactly as signed (no model round trip)."""
    try:
        raw = canonical.unpack(data)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise MalformedEnvelope(f"not MessagePack: {exc}") from None
    if not isinstance(raw, dict):
        raise MalformedEnvelope("envelope must be a map")
    return raw
