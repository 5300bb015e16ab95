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
* ``fleetsim`` — the simulated fleet (``dsec fleet simulate``, on the operator's machine): one
  connection publishes the node events of thousands of simulated nodes (``node.joined``,
  ``node.heartbeat``, the lifecycle a node agent reports, its refusals) and their key
  registrations; it reads placements with ephemeral readers and consumes no durable. NATS
  cannot bind it to a node, so
  every event it publishes must still be signed by a ``nodeagent-<node>`` key the operator root
  certified for that node (:mod:`dsec_core.authz`): the credential alone forges nothing.

Replies: each identity has its own inbox prefix, ``_INBOX.<identity>`` (:func:`inbox_prefix`;
every DSec client connects with it, :mod:`dsec_core.natsclient`), and may subscribe to that
prefix only: a tenant's connection never receives the replies to another connection's requests
(JetStream reads, KV reads, remote sessions). Answering roles still publish to any ``_INBOX.>``.

Subjects are derived from event types (:func:`dsec_core.subjects.filter_for`), never typed by
hand. Limitation: subjects carry no tenant token, so reading cannot be restricted per tenant.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from dsec_core.subjects import STATE_STREAM, STATE_SUBJECTS, STREAM, filter_for

OPERATOR = "operator"
USER = "user"
FLEETSIM = "fleetsim"
SERVICES: tuple[str, ...] = ("policy", "builder", "snapshot", "scheduler", "nodeagent")
ROLES: tuple[str, ...] = (OPERATOR, *SERVICES, USER, FLEETSIM)

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
ID_CLAIMS = "id"
"""Keys ``id.<key id>.<event id>`` of that bucket: the one message each user key's event id
admits, claimed by the first consumer to admit it (``dsec_core.trust.Gate._claim``); every
consumer writes."""
_API = "$JS.API"


_NODE = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
INBOX = "_INBOX"
_IDENTITY = re.compile(r"^[A-Za-z0-9_-]{1,128}\Z")


def inbox_prefix(identity: str) -> str:
    """The inbox prefix of ``identity``'s connections (``_INBOX.<identity>``): the only replies
    it may subscribe to."""
    if not _IDENTITY.match(identity):
        raise ValueError(f"NATS identity {identity!r} must match {_IDENTITY.pattern}")
    return f"{INBOX}.{identity}"


RPC_REQUESTS = "dsec_rpc.node.*.*"
"""Remote logs/exec requests to node agents (:mod:`dsec_core.remote`), outside the stream."""
CODE_UPLOADS = "dsec_rpc.upload.code"
"""Code-upload requests to the policy service (:mod:`dsec_core.codeupload`), outside the
stream."""
DEFAULT_NODE = "node-1"
"""The node of the plain ``nodeagent`` identity (a single-node stack); the node agent of any
other node connects as ``nodeagent-<node id>``."""


def durable_name(service: str, event_type: str, node_id: str | None = None) -> str:
    """The durable consumer of ``service`` for ``event_type`` (``policy-spec-submitted``); a
    node-scoped one carries the node (``nodeagent-<node>-sandbox-scheduled``)."""
    if node_id is not None and not _NODE.match(node_id):
        raise ValueError(f"node id {node_id!r} must match {_NODE.pattern} (DSEC_NODE_ID)")
    owner = service if node_id is None else f"{service}-{node_id}"
    return f"{owner}-{event_type.replace('.', '-')}"


@dataclass(frozen=True)
class Role:
    """What one role may publish and consume.

    Attributes:
        publishes: event types it may publish (subjects derived from them).
        consumes: event types it consumes through its own durable consumers.
        node_consumes: event types each node's instance consumes through durables of its node
            only (``nodeagent-<node>-<type>``; another node's are denied).
        extra_publish / extra_subscribe: non-event subjects (IPC, KV reads).
        kv_read: KV buckets it reads.
        allow_responses: it may answer requests it received (reply subjects).
    """

    name: str
    publishes: tuple[str, ...] = ()
    consumes: tuple[str, ...] = ()
    node_consumes: tuple[str, ...] = ()
    extra_publish: tuple[str, ...] = ()
    extra_subscribe: tuple[str, ...] = ()
    kv_read: tuple[str, ...] = ()
    allow_responses: bool = False
    notes: str = field(default="", compare=False)

    @property
    def durables(self) -> tuple[str, ...]:
        return tuple(durable_name(self.name, t) for t in self.consumes)

    def node_durables(self, node_id: str) -> tuple[str, ...]:
        """The durables of this role's instance on ``node_id``."""
        return tuple(durable_name(self.name, t, node_id) for t in self.node_consumes)


TABLE: Mapping[str, Role] = {
    "policy": Role(
        "policy",
        publishes=("spec.validated", "spec.rejected"),
        consumes=("spec.submitted",),
        # code-upload grants: answers go to the requester's inbox (signed, encrypted)
        extra_publish=("_INBOX.>",),
        extra_subscribe=(CODE_UPLOADS,),
        allow_responses=True,
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
        publishes=(
            "sandbox.scheduled",
            "sandbox.pending",
            "unit.placed",
            "unit.lost",
            "node.lost",
            "node.cordoned",
            "sandbox.exited",
            # migrate
            "unit.migration_started",
            "unit.migration_failed",
        ),
        consumes=(
            "env.built",
            "node.cordon_requested",
            "sandbox.stop_requested",
            # migrate
            "unit.migration_requested",
            "gpu.degraded",
        ),
    ),
    "nodeagent": Role(
        "nodeagent",
        publishes=(
            "context.injected",
            "sandbox.ready",
            "sandbox.exited",
            "sandbox.restarted",
            "policy.violation",
            "policy.violation_summary",
            "policy.reported",
            "node.joined",
            "node.heartbeat",
            "snapshot.taken",
            "snapshot.restored",
            "snapshot.failed",
            "state.checkpointed",
            "state.recovered",
            "state.handed_over",
            "recording.saved",
            # tools
            "tool.degraded",
            "tool.recovered",
            # gpu: GPU health of its own node
            "gpu.degraded",
            "gpu.recovered",
            "link.congested",
            # criu
            "unit.migrated",
            "unit.migration_failed",
        ),
        # each node agent sees these through its own node's durables; acts only on its own
        node_consumes=(
            "sandbox.scheduled",
            "sandbox.stop_requested",
            "unit.lost",
            "snapshot.requested",
            "snapshot.restore_requested",
            "unit.migration_started",  # criu
        ),
        # remote logs/exec: answers go to the requester's inbox (encrypted, signed); the state
        # keeper's encrypted deltas (DSEC_STATE: publish, read back by sequence; a warm
        # snapshot's rollup marker replaces older ones, so no purge right)
        extra_publish=(
            "dsec_ipc.>",
            "_INBOX.>",
            STATE_SUBJECTS,
            f"{_API}.STREAM.INFO.{STATE_STREAM}",
            f"{_API}.STREAM.MSG.GET.{STATE_STREAM}",
            f"{_API}.DIRECT.GET.{STATE_STREAM}",
            f"{_API}.DIRECT.GET.{STATE_STREAM}.>",
        ),
        extra_subscribe=("dsec_ipc.>", RPC_REQUESTS),
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
            # `dsec node cordon|uncordon|drain` on the operator's machine (which connects as
            # its local user): the event must still be signed by the operator's key (authz)
            "node.cordon_requested",
            # `dsec experiment run` (docs/experiments.md)
            "experiment.started",
            "experiment.trial_completed",
            "experiment.completed",
            # migrate: `dsec unit migrate` (signed by the operator's key, authz)
            "unit.migration_requested",
            # gpu: `dsec cluster config set` (signed by the operator's key: authz)
            "cluster.config_set",
        ),
        # `dsec sandbox logs|exec` requests and code-upload requests (signed)
        extra_publish=(RPC_REQUESTS, CODE_UPLOADS),
    ),
    # `dsec fleet simulate`: node events of many simulated nodes over one connection; each
    # event is signed by its node's certified node-agent key (authz binds it to the node)
    FLEETSIM: Role(
        FLEETSIM,
        publishes=(
            "node.joined",
            "node.heartbeat",
            "sandbox.ready",
            "sandbox.exited",
            "security.event_rejected",
            "audit.key_registered",
            # migrate: the simulated nodes carry out migrations
            "unit.migrated",
            "unit.migration_failed",
            # gpu: the simulated nodes' GPU health
            "gpu.degraded",
            "gpu.recovered",
            "link.congested",
        ),
        notes="simulated nodes (dsec fleet simulate)",
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


def node_of_identity(identity: str) -> str | None:
    """The node of a node-scoped identity (``nodeagent-<node>``), else ``None``."""
    for name, r in TABLE.items():
        if r.node_consumes and identity.startswith(f"{name}-"):
            return identity.removeprefix(f"{name}-")
    return None


def publish_allow(role: str, node_id: str | None = None) -> list[str]:
    """Subjects ``role`` may publish to (``[">"]`` for the operator); ``node_id``: the node of
    a node-scoped identity (:data:`DEFAULT_NODE` when ``None``)."""
    if role == OPERATOR:
        return [">"]
    r = _role(role)
    durables = [*r.durables, *r.node_durables(node_id or DEFAULT_NODE)]
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
    for durable in durables:
        subjects += _consume_durable(STREAM, durable)
        subjects.append(f"$KV.{HANDLED_BUCKET}.{durable}.>")  # the ids this durable handled
    if durables:
        subjects += _read_stream(f"KV_{HANDLED_BUCKET}")
        subjects.append(f"$KV.{HANDLED_BUCKET}.{ID_CLAIMS}.>")  # user ids' claims
    for bucket in r.kv_read:
        subjects += _read_stream(f"KV_{bucket}")
    subjects += r.extra_publish
    return subjects


def publish_deny(
    role: str, node_id: str | None = None, other_nodes: Iterable[str] = ()
) -> list[str]:
    """Subjects ``role`` may never publish to: stream administration, other roles' durable
    consumers and those of ``other_nodes`` (the ephemeral readers' wildcard would otherwise
    reach them)."""
    if role == OPERATOR:
        return []
    deny = list(OPERATOR_ONLY)
    mine = node_id or DEFAULT_NODE
    nodes = sorted({DEFAULT_NODE, mine, *other_nodes})
    elsewhere = [
        d
        for name, r in TABLE.items()
        for node in nodes
        if name != role or node != mine
        for d in r.node_durables(node)
    ]
    for durable in [*_others_durables(role), *elsewhere]:
        deny += [
            f"{_API}.CONSUMER.MSG.NEXT.{STREAM}.{durable}",
            *_consume_durable(STREAM, durable),
        ]
    return deny


def subscribe_allow(
    role: str, node_id: str | None = None, identity: str | None = None
) -> list[str]:
    """Subjects ``role`` may subscribe to: the replies to its own identity (``_INBOX.<identity>.>``,
    ``identity`` defaults to the role's name) and its extra subjects; a node agent gets its own
    node's remote requests only (:data:`DEFAULT_NODE` when ``None``)."""
    if role == OPERATOR:
        return [">"]
    extra = list(_role(role).extra_subscribe)
    if RPC_REQUESTS in extra:
        extra[extra.index(RPC_REQUESTS)] = f"dsec_rpc.node.{node_id or DEFAULT_NODE}.*"
    # Revocations are followed live by every consumer (core NATS, no consumer to manage).
    return [f"{inbox_prefix(identity or role)}.>", filter_for(KEY_REVOKED), *extra]


def permissions(
    role: str,
    node_id: str | None = None,
    other_nodes: Iterable[str] = (),
    identity: str | None = None,
) -> dict[str, Any]:
    """nats-server ``permissions`` of ``role`` (of the node agent of ``node_id``, which may
    use none of ``other_nodes``' durables) for ``identity`` (its inbox; the role's name when
    ``None``)."""
    publish: dict[str, Any] = {"allow": publish_allow(role, node_id)}
    deny = publish_deny(role, node_id, other_nodes)
    if deny:
        publish["deny"] = deny
    perms: dict[str, Any] = {
        "publish": publish,
        "subscribe": {"allow": subscribe_allow(role, node_id, identity)},
    }
    if role != OPERATOR and _role(role).allow_responses:
        perms["allow_responses"] = True
    return perms


def _role(role: str) -> Role:
    try:
        return TABLE[role]
    except KeyError:
        raise ValueError(f"unknown NATS role {role!r}; valid: {', '.join(ROLES)}") from None


def role_of_identity(identity: str) -> str:
    """The role of an identity name: ``user-<tenant>`` is ``user``, ``nodeagent-<node>`` is
    ``nodeagent``, others are themselves."""
    if identity.startswith(f"{USER}-"):
        return USER
    node = node_of_identity(identity)
    return identity.removesuffix(f"-{node}") if node is not None else identity


@dataclass(frozen=True)
class Identity:
    """One user entry of the server config: an nkey (public) or a user with a bcrypt hash.

    ``name`` is ``operator``, a service, or ``user-<tenant>``.
    """

    name: str
    nkey: str | None = None
    user: str | None = None
    password_hash: str | None = field(default=None, repr=False)

    def entry(self, *, raw: bool = False, nodes: Iterable[str] = ()) -> dict[str, Any]:
        """The user entry; ``nodes``: every node of the config (a node agent may use none of
        the others' durables)."""
        out: dict[str, Any] = {}
        if self.nkey is not None:
            out["nkey"] = self.nkey
        if self.user is not None:
            out["user"] = self.user
            out["password"] = self.password_hash or ""
        out["permissions"] = permissions(
            role_of_identity(self.name), node_of_identity(self.name), nodes, self.name
        )
        return out


def _nodes(names: Iterable[str]) -> list[str]:
    """The nodes of a config's node agent identities (the plain one is :data:`DEFAULT_NODE`)."""
    return sorted({node_of_identity(n) or DEFAULT_NODE for n in names if _node_scoped(n)})


def _node_scoped(name: str) -> bool:
    role = role_of_identity(name)
    return role in TABLE and bool(TABLE[role].node_consumes)


def render_authorization(identities: Sequence[Identity]) -> str:
    """The ``authorization { users = [...] }`` block of nats-server's config (JSON values: the
    NATS config format reads them, and ``$`` inside quoted strings is literal)."""
    nodes = _nodes(i.name for i in identities)
    users = [i.entry(nodes=nodes) for i in identities]
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
    names = [*SERVICES, FLEETSIM, *(f"{USER}-{t}" for t in tenants)]
    for name in names:
        var = "DSEC_NKEY_" + name.upper().replace("-", "_")
        perms = permissions(role_of_identity(name), identity=name)
        users.append({"nkey": f"@{var}@", "permissions": perms})
    body = json.dumps(users, indent=2)
    body = body.replace('"@OPERATOR@"', "$DSEC_NATS_OPERATOR_BCRYPT")
    for name in names:
        var = "DSEC_NKEY_" + name.upper().replace("-", "_")
        body = body.replace(f'"@{var}@"', f"${var}")
    return header + "authorization {\n  users = " + body + "\n}\n"


if __name__ == "__main__":  # pragma: no cover - regenerates the deploy file
    print(render_deploy_config(), end="")
