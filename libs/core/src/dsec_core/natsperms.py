"""Who may do what on NATS: the one table of roles and their publish/subscribe allow lists.

The embedded stack (``dsec up``) renders it into nats-server's ``authorization`` block, and
``deploy/nats/nats-server.conf`` is generated from it (:func:`render_deploy_config`), so the
two cannot drift.

Roles:

* ``operator`` — everything; the only role that may create, update, delete or purge a stream,
  delete a message or a consumer (``dsec up`` / the stack create and check ``DSEC_EVENTS``).
* one role per service (``policy``, ``builder``, ``snapshot``, ``scheduler``, ``nodeagent``) —
  publishes only the event types it produces, consumes only its own durable consumers, reads
  the stream.
* ``user`` — a tenant's CLI: publishes only the requests a person makes (submit, stop,
  snapshot, restore, its key registration) and reads the stream.

Subjects are derived from event types (:func:`dsec_core.subjects.filter_for`), never typed by
hand. Limitation: subjects carry no tenant token, so reading cannot be restricted per tenant.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsec_core.subjects import STREAM, filter_for

OPERATOR = "operator"
USER = "user"
SERVICES: tuple[str, ...] = ("policy", "builder", "snapshot", "scheduler", "nodeagent")
ROLES: tuple[str, ...] = (OPERATOR, *SERVICES, USER)

EVERY_SERVICE_PUBLISHES: tuple[str, ...] = (
    "sandbox.failed",
    "security.event_rejected",
    "audit.key_registered",
)
"""Event types any service may publish (terminal failures, refusals, its own key)."""

KEY_REGISTERED = "audit.key_registered"
KEY_REVOKED = "audit.key_revoked"
CONFIGMAP_BUCKET = "dsec-configmaps"
HANDLED_BUCKET = "dsec-handled"
"""Event ids each consumer handled (replay protection, :mod:`dsec_core.trust`)."""
_API = "$JS.API"


def durable_name(service: str, event_type: str) -> str:
    """The durable consumer of ``service`` for ``event_type`` (``policy-spec-submitted``)."""
    return f"{service}-{event_type.replace('.', '-')}"


def node_durable_name(node_id: str, event_type: str) -> str:
    """A node agent's durable consumer of ``event_type`` on node ``node_id``
    (``nodeagent-node-1-snapshot-requested``): each node sees every node-bound request."""
    return f"nodeagent-{node_id}-{event_type.replace('.', '-')}"


NODE_IDS: tuple[str, ...] = ("node-1",)
"""Nodes whose per-node durables the rendered permissions name (the embedded stack's node;
per-node NATS identities replace this list in the multi-node work)."""


@dataclass(frozen=True)
class Role:
    """What one role may publish and consume.

    Attributes:
        publishes: event types it may publish (subjects derived from them).
        consumes: event types it consumes through its own durable consumers.
        extra_publish / extra_subscribe: non-event subjects (IPC, KV reads).
        kv_read: KV buckets it reads.
        allow_responses: it may answer requests it received (reply subjects).
    """

    name: str
    publishes: tuple[str, ...] = ()
    consumes: tuple[str, ...] = ()
    extra_publish: tuple[str, ...] = ()
    extra_subscribe: tuple[str, ...] = ()
    kv_read: tuple[str, ...] = ()
    allow_responses: bool = False
    node_consumes: tuple[str, ...] = ()
    """Event types consumed through one durable per node (:func:`node_durable_name`)."""
    notes: str = field(default="", compare=False)

    @property
    def durables(self) -> tuple[str, ...]:
        shared = tuple(durable_name(self.name, t) for t in self.consumes)
        per_node = tuple(node_durable_name(n, t) for n in NODE_IDS for t in self.node_consumes)
        return shared + per_node


TABLE: Mapping[str, Role] = {
    "policy": Role(
        "policy",
        publishes=("spec.validated", "spec.rejected"),
        consumes=("spec.submitted",),
    ),
    "builder": Role(
        "builder",
        publishes=("deps.resolved", "deps.conflict", "env.built"),
        consumes=("spec.validated", "deps.resolved"),
    ),
    "snapshot": Role(
        "snapshot",
        publishes=(
            "snapshot.taken",
            "snapshot.restored",
            "snapshot.failed",
            "snapshot.deleted",
            "snapshot.requested",
        ),
        consumes=(
            "snapshot.requested",
            "snapshot.restore_requested",
            "snapshot.delete_requested",
            "sandbox.ready",
            "sandbox.exited",
        ),
    ),
    "scheduler": Role(
        "scheduler",
        publishes=("sandbox.scheduled", "unit.placed", "unit.migrated", "node.heartbeat"),
        consumes=(),
    ),
    "nodeagent": Role(
        "nodeagent",
        publishes=(
            "context.injected",
            "sandbox.ready",
            "sandbox.exited",
            "policy.violation",
            "policy.violation_summary",
            "policy.reported",
            "node.heartbeat",
            "snapshot.taken",
            "snapshot.restored",
            "snapshot.failed",
        ),
        consumes=("env.built", "sandbox.stop_requested"),
        node_consumes=("snapshot.requested", "snapshot.restore_requested"),
        extra_publish=("dsec_ipc.>",),
        extra_subscribe=("dsec_ipc.>",),
        kv_read=(CONFIGMAP_BUCKET,),
        allow_responses=True,
    ),
    USER: Role(
        USER,
        publishes=(
            "spec.submitted",
            "sandbox.stop_requested",
            "snapshot.requested",
            "snapshot.restore_requested",
            "snapshot.delete_requested",
            "audit.key_registered",
        ),
    ),
}
"""Every non-operator role. Edit here; the embedded config and the deploy file follow."""

OPERATOR_ONLY: tuple[str, ...] = (
    f"{_API}.STREAM.CREATE.>",
    f"{_API}.STREAM.UPDATE.>",
    f"{_API}.STREAM.DELETE.>",
    f"{_API}.STREAM.PURGE.>",
    f"{_API}.STREAM.MSG.DELETE.>",
    f"{_API}.STREAM.RESTORE.>",
    f"{_API}.CONSUMER.DELETE.>",
    f"$KV.{CONFIGMAP_BUCKET}.>",
)
"""Subjects only the operator may publish to (explicitly denied to every other role)."""


def _read_stream(stream: str) -> list[str]:
    """Read-only JetStream API of one stream: info, message get, direct get."""
    return [
        f"{_API}.STREAM.INFO.{stream}",
        f"{_API}.STREAM.MSG.GET.{stream}",
        f"{_API}.DIRECT.GET.{stream}",
        f"{_API}.DIRECT.GET.{stream}.>",
    ]


def _consume_durable(stream: str, durable: str) -> list[str]:
    return [
        f"{_API}.CONSUMER.CREATE.{stream}.{durable}",
        f"{_API}.CONSUMER.CREATE.{stream}.{durable}.>",
        f"{_API}.CONSUMER.DURABLE.CREATE.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",
    ]


def _others_durables(role: str) -> list[str]:
    return [d for name, r in TABLE.items() if name != role for d in r.durables]


def publish_allow(role: str) -> list[str]:
    """Subjects ``role`` may publish to (``[">"]`` for the operator)."""
    if role == OPERATOR:
        return [">"]
    r = _role(role)
    types = list(r.publishes)
    if role in SERVICES:
        types += [t for t in EVERY_SERVICE_PUBLISHES if t not in types]
    # Key registrations are filed under the key id (``dsec.producer.<key id>.…``): one subject
    # token cannot tie them to a role, so every consumer checks the key's root certificate.
    subjects = [filter_for(t) for t in types]
    subjects += [
        f"{_API}.INFO",
        *_read_stream(STREAM),
        # Ephemeral readers (replay, follow, tail): nats-py names them itself. Other roles'
        # durable names are denied below, so a reader cannot take over a service's consumer.
        f"{_API}.CONSUMER.CREATE.{STREAM}",
        f"{_API}.CONSUMER.CREATE.{STREAM}.*",
        f"{_API}.CONSUMER.CREATE.{STREAM}.*.>",
        f"{_API}.CONSUMER.INFO.{STREAM}.*",
        f"{_API}.CONSUMER.MSG.NEXT.{STREAM}.*",
    ]
    for durable in r.durables:
        subjects += _consume_durable(STREAM, durable)
        subjects.append(f"$KV.{HANDLED_BUCKET}.{durable}.>")  # the ids this durable handled
    if r.durables:
        subjects += _read_stream(f"KV_{HANDLED_BUCKET}")
    for bucket in r.kv_read:
        subjects += _read_stream(f"KV_{bucket}")
    subjects += r.extra_publish
    return subjects


def publish_deny(role: str) -> list[str]:
    """Subjects ``role`` may never publish to: stream administration and other roles'
    durable consumers (the ephemeral readers' wildcard would otherwise reach them)."""
    if role == OPERATOR:
        return []
    deny = list(OPERATOR_ONLY)
    for durable in _others_durables(role):
        deny += [
            f"{_API}.CONSUMER.MSG.NEXT.{STREAM}.{durable}",
            *_consume_durable(STREAM, durable),
        ]
    return deny


def subscribe_allow(role: str) -> list[str]:
    """Subjects ``role`` may subscribe to: replies (``_INBOX.>``) and its extra subjects."""
    if role == OPERATOR:
        return [">"]
    # Revocations are followed live by every consumer (core NATS, no consumer to manage).
    return ["_INBOX.>", filter_for(KEY_REVOKED), *_role(role).extra_subscribe]


def permissions(role: str) -> dict[str, Any]:
    """nats-server ``permissions`` of ``role``."""
    publish: dict[str, Any] = {"allow": publish_allow(role)}
    deny = publish_deny(role)
    if deny:
        publish["deny"] = deny
    perms: dict[str, Any] = {"publish": publish, "subscribe": {"allow": subscribe_allow(role)}}
    if role != OPERATOR and _role(role).allow_responses:
        perms["allow_responses"] = True
    return perms


def _role(role: str) -> Role:
    try:
        return TABLE[role]
    except KeyError:
        raise ValueError(f"unknown NATS role {role!r}; valid: {', '.join(ROLES)}") from None


def role_of_identity(identity: str) -> str:
    """The role of an identity name: ``user-<tenant>`` is ``user``, others are themselves."""
    return USER if identity.startswith(f"{USER}-") else identity


@dataclass(frozen=True)
class Identity:
    """One user entry of the server config: an nkey (public) or a user with a bcrypt hash.

    ``name`` is ``operator``, a service, or ``user-<tenant>``.
    """

    name: str
    nkey: str | None = None
    user: str | None = None
    password_hash: str | None = field(default=None, repr=False)

    def entry(self, *, raw: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.nkey is not None:
            out["nkey"] = self.nkey
        if self.user is not None:
            out["user"] = self.user
            out["password"] = self.password_hash or ""
        out["permissions"] = permissions(role_of_identity(self.name))
        return out


def render_authorization(identities: Sequence[Identity]) -> str:
    """The ``authorization { users = [...] }`` block of nats-server's config (JSON values: the
    NATS config format reads them, and ``$`` inside quoted strings is literal)."""
    users = [i.entry() for i in identities]
    return "authorization {\n  users = " + json.dumps(users, indent=2) + "\n}\n"


def render_deploy_config(tenants: Iterable[str] = ("default",)) -> str:
    """``deploy/nats/nats-server.conf``: the same permissions, credentials from environment
    variables (``$DSEC_NKEY_<ROLE>`` public nkeys, ``$DSEC_NATS_OPERATOR_BCRYPT``)."""
    header = (
        "# Generated by `uv run python -m dsec_core.natsperms`; do not edit.\n"
        "# Credentials come from the environment: DSEC_NATS_OPERATOR_BCRYPT (bcrypt hash of the\n"
        "# operator password) and DSEC_NKEY_<ROLE> (public nkeys, U...; seeds stay with the\n"
        "# clients). `dsec nats credentials DIR` writes both.\n"
        "# Ports and JetStream come from the command line: nats-server -c THIS -js -sd DIR.\n"
    )
    users = [{"user": OPERATOR, "password": "@OPERATOR@", "permissions": permissions(OPERATOR)}]
    names = [*SERVICES, *(f"{USER}-{t}" for t in tenants)]
    for name in names:
        var = "DSEC_NKEY_" + name.upper().replace("-", "_")
        users.append({"nkey": f"@{var}@", "permissions": permissions(role_of_identity(name))})
    body = json.dumps(users, indent=2)
    body = body.replace('"@OPERATOR@"', "$DSEC_NATS_OPERATOR_BCRYPT")
    for name in names:
        var = "DSEC_NKEY_" + name.upper().replace("-", "_")
        body = body.replace(f'"@{var}@"', f"${var}")
    return header + "authorization {\n  users = " + body + "\n}\n"


if __name__ == "__main__":  # pragma: no cover - regenerates the deploy file
    print(render_deploy_config(), end="")
