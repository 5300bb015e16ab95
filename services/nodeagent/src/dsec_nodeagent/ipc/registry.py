"""Who serves tools under which name: pure bookkeeping, no I/O.

Names are per task group: ``agent-b`` of group ``g1`` and ``agent-b`` of ``g2`` are different agents
that can never reach each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

C = TypeVar("C")

SUBJECT_PREFIX = "dsec_ipc"


@dataclass(frozen=True)
class AgentKey:
    """One agent's address on the communication plane."""

    group: str
    agent: str

    def subject(self, tool: str) -> str:
        """The NATS subject a remote call of ``tool`` travels on.

        Outside ``dsec.>``: the event stream captures that whole space, so JetStream would
        answer every request there with a publish acknowledgement (a lookup would always "find"
        the agent) and record each call in the audit log.
        """
        return f"{SUBJECT_PREFIX}.{self.group}.{self.agent}.{tool}"

    def __str__(self) -> str:
        return f"{self.group}/{self.agent}"


@dataclass
class Registry(Generic[C]):
    """Serving agents of this node, each bound to the connection that registered it."""

    _servers: dict[AgentKey, C] = field(default_factory=dict)

    def claim(self, key: AgentKey, conn: C) -> str | None:
        """Register ``conn`` as the server of ``key``; the reason it may not, or ``None``."""
        holder = self._servers.get(key)
        if holder is not None and holder is not conn:
            return f"agent {key.agent!r} already serves tools in task group {key.group!r}"
        self._servers[key] = conn
        return None

    def release(self, conn: C) -> list[AgentKey]:
        """Forget every name ``conn`` held; return them."""
        keys = [key for key, holder in self._servers.items() if holder is conn]
        for key in keys:
            del self._servers[key]
        return keys

    def lookup(self, key: AgentKey) -> C | None:
        """The connection serving ``key`` on this node, if any."""
        return self._servers.get(key)

    def __len__(self) -> int:
        return len(self._servers)
