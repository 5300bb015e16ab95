"""The state keeper's interface (CONTRACT — the implementation replaces the bodies; the
signatures below are what the node agent, the broker and the hand-over use; see docs/state.md).

One :class:`StateKeeper` per node agent. It serves each agent's state socket (handed to the
sandbox by the IPC broker), journals hot deltas in node-local shared memory (tmpfs), publishes
them durably (JetStream stream ``DSEC_STATE``, encrypted, chunked), merges warm state on the
node's disk (and copies it to the object store for recovery on another node), keeps cold state
in the object store content-addressed (BLAKE3), and publishes ``state.checkpointed`` and
``state.recovered``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from dsec_core.spec.plan import StatePlan


@dataclass(frozen=True)
class StateKey:
    """Whose state: an agent of a task group of a tenant (the same for every version and every
    restart of that agent, on any node)."""

    tenant: str
    group: str
    agent: str

    @property
    def subject_tokens(self) -> str:
        """``<tenant>.<group>.<agent>`` (each a NATS-safe name)."""
        return f"{self.tenant}.{self.group}.{self.agent}"


@dataclass(frozen=True)
class SandboxState:
    """What the node agent tells the keeper about a sandbox it starts."""

    sandbox_id: str
    tenant: str
    group: str
    agent: str
    plan: StatePlan | None
    handover_from: str | None = None  # a hand-over: the running sandbox it takes over from
    cgroup_dir: str | None = None  # for the freezer (hand-over)


class StateSession:
    """One agent connection (an open state socket)."""

    key: StateKey
    sandbox_id: str
    ready: asyncio.Event
    """Hand-over, on the NEW version's session: set when the agent sends ``ready`` (added for
    the hand-over)."""

    async def send(self, frame: dict[str, Any]) -> None:
        """Send one frame to the agent."""
        raise NotImplementedError

    async def request_final(self, to_sandbox: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """Hand-over, on the OLD version's session: send ``{"op": "handover", "to": ...}``,
        wait for its ``final`` checkpoint, make it durable like any other, ack it, and return
        its records."""
        raise NotImplementedError

    def on_checkpoint(
        self, callback: Callable[[int, list[dict[str, Any]]], Awaitable[None]]
    ) -> None:
        """Call ``callback(seq, records)`` after each checkpoint of this session is durable
        (the hand-over forwards them to the new version)."""
        raise NotImplementedError


HandOver = Callable[["StateKeeper", StateSession, StateSession], Awaitable[None]]
"""Runs a hand-over from the old session to the new one (``dsec_nodeagent.state.handover``)."""


class StateKeeper:
    """Serves the agents of this node (CONTRACT: implemented by the keeper module)."""

    handover: HandOver | None = None
    """Set by the node agent: how a ``hello`` with ``handover: true`` is served; None: such a
    hello is refused (``error`` code ``no-handover``)."""

    def register_sandbox(self, info: SandboxState) -> None:
        """Called by the node agent before it launches a sandbox whose plan has ``state``
        (and for a hand-over's new sandbox)."""
        raise NotImplementedError

    def forget_sandbox(self, sandbox_id: str) -> None:
        """Called when the sandbox ended for good (not between restarts)."""
        raise NotImplementedError

    def session_of(self, key: StateKey) -> StateSession | None:
        """The live session that owns ``key``'s state (at most one), if any."""
        raise NotImplementedError

    def sandbox_of(self, sandbox_id: str) -> SandboxState | None:
        """What was registered for a sandbox."""
        raise NotImplementedError

    async def records_of(self, session: StateSession) -> tuple[list[dict[str, Any]], int]:
        """Hand-over: ``session``'s state as a fetch sends it (warm records, then every
        checkpoint after; cold refs resolved; an array too large for one frame in slices) and
        its last durable seq (added for the hand-over)."""
        raise NotImplementedError

    def switch_owner(self, old: StateSession, new: StateSession) -> None:
        """Hand-over: ``new`` owns ``old``'s state from now on (its checkpoints continue
        ``old``'s seq; ``old`` may not checkpoint any more) (added for the hand-over)."""
        raise NotImplementedError

    async def serve(self, sock: socket.socket, sandbox_id: str) -> None:
        """Serve one agent connection (the broker hands over its end of the socketpair,
        with the sandbox the connecting process belongs to) until it closes."""
        raise NotImplementedError

    async def start(self) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        raise NotImplementedError
