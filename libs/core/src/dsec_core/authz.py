"""Who may say what: the one authorization table every consumer and ``audit verify`` use.

A valid signature proves *who* said something; this table decides whether that producer may say
*this*. A certificate's role names the producer kind; users are further bound to their tenant and
node agents to their node. Anything not in the table is refused (default deny).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dsec_core.identity import SERVICE_ROLES, SYSTEM_TENANT, Certificate, Role

_ANY_SERVICE: frozenset[Role] = frozenset(SERVICE_ROLES)

PRODUCERS: Mapping[str, frozenset[Role]] = {
    # users, for their own tenant
    "spec.submitted": frozenset({"user"}),
    "sandbox.stop_requested": frozenset({"user"}),
    # the snapshot service asks for periodic snapshots; the owning node agent takes them
    "snapshot.requested": frozenset({"user", "snapshot"}),
    "snapshot.restore_requested": frozenset({"user"}),
    "snapshot.delete_requested": frozenset({"user"}),
    # the operator runs the fleet
    "node.cordon_requested": frozenset({"operator"}),
    "unit.migration_requested": frozenset({"operator"}),
    # gpu: cluster settings (GPU health thresholds, slicing modes), operator only
    "cluster.config_set": frozenset({"operator"}),
    # the pipeline
    "spec.validated": frozenset({"policy"}),
    "spec.rejected": frozenset({"policy"}),
    "deps.resolved": frozenset({"builder"}),
    "deps.conflict": frozenset({"builder"}),
    "env.built": frozenset({"builder"}),
    "sandbox.scheduled": frozenset({"scheduler"}),
    "sandbox.pending": frozenset({"scheduler"}),
    "unit.placed": frozenset({"scheduler"}),
    "unit.lost": frozenset({"scheduler"}),
    "node.lost": frozenset({"scheduler"}),
    "node.cordoned": frozenset({"scheduler"}),
    # migration: the scheduler chooses the target and reserves it; the node agents move the
    # unit (the target reports it migrated; either end, or the scheduler, reports a failure)
    "unit.migration_started": frozenset({"scheduler"}),
    "unit.migrated": frozenset({"nodeagent"}),
    "unit.migration_failed": frozenset({"scheduler", "nodeagent"}),
    # GPU health, from the node agent that owns the GPU (NVML, or the simulated fleet's nodes)
    "gpu.degraded": frozenset({"nodeagent"}),
    "gpu.recovered": frozenset({"nodeagent"}),
    "link.congested": frozenset({"nodeagent"}),
    # tools: the node agent running the sandbox, from its SDK's call reports
    "tool.degraded": frozenset({"nodeagent"}),
    "tool.recovered": frozenset({"nodeagent"}),
    # the node agent that runs the sandbox
    "context.injected": frozenset({"nodeagent"}),
    "sandbox.ready": frozenset({"nodeagent"}),
    # (the scheduler ends a sandbox stopped while it waited in the queue)
    "sandbox.exited": frozenset({"nodeagent", "scheduler"}),
    # a stateful sandbox started again in place by its node agent (spec state.restart)
    "sandbox.restarted": frozenset({"nodeagent"}),
    "policy.violation": frozenset({"nodeagent"}),
    "policy.violation_summary": frozenset({"nodeagent"}),
    "policy.reported": frozenset({"nodeagent"}),
    "state.handed_over": frozenset({"nodeagent"}),
    "node.joined": frozenset({"nodeagent"}),
    "node.heartbeat": frozenset({"nodeagent"}),
    # snapshots
    # the node agent owning a running sandbox snapshots it and rolls it back (and restores a
    # snapshot into a new sandbox it starts); the snapshot service: sandboxes running nowhere
    # (which it never rolls back: only the node that runs a sandbox writes its code)
    "snapshot.taken": frozenset({"snapshot", "nodeagent"}),
    "snapshot.restored": frozenset({"nodeagent"}),
    "snapshot.failed": frozenset({"snapshot", "nodeagent"}),
    "state.checkpointed": frozenset({"nodeagent"}),
    "state.recovered": frozenset({"nodeagent"}),
    "snapshot.deleted": frozenset({"snapshot"}),
    # experiments: the node agent that ran the sandbox stores its recording; a user runs an
    # experiment (docs/experiments.md)
    "recording.saved": frozenset({"nodeagent"}),
    "experiment.started": frozenset({"user"}),
    "experiment.trial_completed": frozenset({"user"}),
    "experiment.completed": frozenset({"user"}),
    # any service ends a request it cannot complete, and reports what it refused
    "sandbox.failed": _ANY_SERVICE,
    "security.event_rejected": _ANY_SERVICE,
    # the key log: a key registers itself (its certificate says which role); the operator revokes
    "audit.key_registered": frozenset({*SERVICE_ROLES, "user", "operator"}),
    "audit.key_revoked": frozenset({"operator"}),
}


def refusal(fields: Mapping[str, Any], cert: Certificate) -> str | None:
    """Why the producer holding ``cert`` may not emit this envelope; ``None`` when it may.

    ``fields`` is the envelope as a mapping (``type``, ``producer``, ``tenant``, ``payload``).
    The audit verifier remembers verdicts by the type, key, producer, tenant and payload
    ``node_id`` (:meth:`dsec_core.audit.Verifier._fast`, leaving the migration and key types
    to its full path): a rule reading another payload field must be added there too.
    """
    event_type = fields.get("type")
    allowed = PRODUCERS.get(str(event_type))
    if allowed is None:
        return f"no producer may emit {event_type!r}"
    if cert.subject != fields.get("producer"):
        return f"key certified for {cert.subject!r}, used as {fields.get('producer')!r}"
    if cert.role not in allowed:
        return f"role {cert.role!r} may not emit {event_type}; only {', '.join(sorted(allowed))}"
    tenant = fields.get("tenant")
    if cert.role == "user" and tenant != cert.tenant and event_type != "audit.key_registered":
        return f"user of tenant {cert.tenant!r} may not act for tenant {tenant!r}"
    payload = fields.get("payload")
    node = payload.get("node_id") if isinstance(payload, dict) else None
    if cert.role == "nodeagent" and node is not None and node != cert.node_id:
        return f"node agent of {cert.node_id!r} may not speak for node {node!r}"
    to_node = payload.get("to_node") if isinstance(payload, dict) else None
    if cert.role == "nodeagent" and event_type == "unit.migrated" and to_node != cert.node_id:
        return f"node agent of {cert.node_id!r} may only report units migrated to its node"
    if cert.role == "nodeagent" and event_type == "unit.migration_failed":
        ends = (
            (payload.get("from_node"), payload.get("to_node")) if isinstance(payload, dict) else ()
        )
        if cert.node_id not in ends:
            return f"node agent of {cert.node_id!r} is no end of this migration"
    registered = payload.get("key_id") if isinstance(payload, dict) else None
    if event_type == "audit.key_registered" and registered != cert.key_id:
        return "a key registration must register the key that signs it"
    return None


def tenant_of_new_event(cause_tenant: str | None, cert: Certificate) -> str:
    """The tenant a producer stamps on an event: a user's own; a service's cause's; or system."""
    if cert.role == "user":
        return cert.tenant or SYSTEM_TENANT
    return cause_tenant or SYSTEM_TENANT
