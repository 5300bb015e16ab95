"""Who serves tools under which name: pure bookkeeping, no I/O.

Names are per tenant and task group: ``agent-b`` of group ``g1`` and ``agent-b`` of ``g2`` are
different agents that can never reach each other, and so are ``g1/agent-b`` of tenant ``acme``
and ``g1/agent-b`` of tenant ``umbrella`` (on this node and across nodes: the tenant is part of
every NATS subject). Within a tenant, a name is owned by one sandbox at a time: the first live
server keeps it until its connection closes (its process exits), unless a later one asks for an
explicit takeover.

A hand-over (docs/state.md) adds a *standby*: the new version's server may register the name
its old version holds while the node agent expects that hand-over; :meth:`Registry.switch`
then points the name at it (the old server becomes the standby, so a failed hand-over can
switch back).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

C = TypeVar("C")

SUBJECT_PREFIX = "dsec_ipc"
DEFAULT_TENANT: Final = "default"
_TOKEN_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}\Z")


def tenant_token(tenant: str) -> str:
    """``tenant`` as one NATS subject token: itself when it is a plain name, else ``%`` + its
    UTF-8 hex (a ``%`` never starts a plain name, so two tenants never share a token)."""
    if _TOKEN_RE.match(tenant):
        return tenant
    return "%" + tenant.encode().hex()


@dataclass(frozen=True)
class AgentKey:
    """One agent's address on the communication plane."""

    group: str
    agent: str
    tenant: str = DEFAULT_TENANT

    def subject(self, tool: str) -> str:
        """The NATS subject a remote call of ``tool`` travels on.

        Outside ``dsec.>``: the event stream captures that whole space, so JetStream would
        answer every request there with a publish acknowledgement (a lookup would always "find"
        the agent) and record each call in the audit log.
        """
        return f"{SUBJECT_PREFIX}.{tenant_token(self.tenant)}.{self.group}.{self.agent}.{tool}"

    def __str__(self) -> str:
        return f"{self.group}/{self.agent}"


@dataclass(frozen=True)
class Claim(Generic[C]):
    """The outcome of :meth:`Registry.claim`: refused with ``reason``, or granted (``displaced``:
    the previous server, replaced by an explicit takeover)."""

    reason: str | None = None
    displaced: C | None = None


@dataclass
class Registry(Generic[C]):
    """Serving agents of this node, each bound to the connection (and sandbox) that registered
    it."""

    _servers: dict[AgentKey, tuple[C, str]] = field(default_factory=dict)
    _standby: dict[AgentKey, tuple[C, str]] = field(default_factory=dict)

    def owner(self, key: AgentKey) -> str | None:
        """The sandbox whose server holds ``key``, if any."""
        held = self._servers.get(key)
        return None if held is None else held[1]

    def standby(self, key: AgentKey, conn: C, owner: str) -> str | None:
        """Register ``conn`` of sandbox ``owner`` as the standby server of ``key`` (a hand-over
        in progress); the reason when refused (a standby is there already)."""
        held = self._standby.get(key)
        if held is not None and held[0] is not conn:
            return (
                f"agent {key.agent!r} of task group {key.group!r} already has a standby server "
                f"(sandbox {held[1]})"
            )
        self._standby[key] = (conn, owner)
        return None

    def standby_of(self, key: AgentKey) -> tuple[C, str] | None:
        """The standby server of ``key`` and its owner (after a switch: the previous server)."""
        return self._standby.get(key)

    def switch(self, key: AgentKey, to_owner: str) -> C | None:
        """Point ``key`` at the standby server of sandbox ``to_owner``; the server that held
        it becomes the standby. Returns that previous server (``None``: no such standby)."""
        standby = self._standby.get(key)
        if standby is None or standby[1] != to_owner:
            return None
        held = self._servers.get(key)
        self._servers[key] = standby
        if held is None:
            del self._standby[key]
            return None
        self._standby[key] = held
        return held[0]

    def claim(self, key: AgentKey, conn: C, owner: str, *, takeover: bool = False) -> Claim[C]:
        """Register ``conn`` of sandbox ``owner`` as the server of ``key``."""
        held = self._servers.get(key)
        if held is not None and held[0] is not conn:
            holder, holder_owner = held
            if not takeover:
                who = "this sandbox" if holder_owner == owner else f"sandbox {holder_owner}"
                return Claim(
                    reason=f"agent {key.agent!r} of task group {key.group!r} is already served by "
                    f"another live process of {who}; the name frees when that process exits "
                    "(or take it over explicitly: DSecClient(takeover=True))"
                )
            self._servers[key] = (conn, owner)
            return Claim(displaced=holder)
        self._servers[key] = (conn, owner)
        return Claim()

    def release(self, conn: C) -> list[AgentKey]:
        """Forget every name ``conn`` held; return them."""
        keys = [key for key, (holder, _) in self._servers.items() if holder is conn]
        for key in keys:
            del self._servers[key]
        for key in [key for key, (holder, _) in self._standby.items() if holder is conn]:
            del self._standby[key]
        return keys

    def lookup(self, key: AgentKey) -> C | None:
        """The connection serving ``key`` on this node, if any."""
        held = self._servers.get(key)
        return None if held is None else held[0]

    def __len__(self) -> int:
        return len(self._servers)
