"""The node agent's communication plane: the IPC broker, with identities pinned to sandboxes.

The broker (:mod:`dsec_nodeagent.ipc`) listens on ``$DSEC_HOME/run/ipc.sock``; each sandbox
sees that socket through a directory of its own (see :class:`SandboxManager`). A connecting
process may act only as the agent of the sandbox it runs in: its cgroup names the sandbox, its
uid must be that sandbox's, and the name, task group and tenant come from the sandbox's spec
and plan. A process outside every sandbox is refused. Every connection counts against the
sandbox its process runs in (its cgroup), within the operator's ``DSEC_IPC_*`` bounds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dsec_core.natsclient import auth_options
from dsec_core.settings import Settings

from dsec_nodeagent.ipc import AgentKey, Broker
from dsec_nodeagent.ipc.limits import BrokerLimits
from dsec_nodeagent.sandbox import cgroups
from dsec_nodeagent.sandbox.manager import SandboxManager
from dsec_nodeagent.state.keeper import StateKeeper

log = logging.getLogger(__name__)

SOCKET = Path("run") / "ipc.sock"


def socket_path(settings: Settings) -> Path:
    """Where this node's broker listens (``$DSEC_HOME/run/ipc.sock``)."""
    return settings.home.resolve() / SOCKET


def broker_limits(settings: Settings) -> BrokerLimits:
    """The operator's bounds on what one sandbox may take from the broker."""
    return BrokerLimits(
        fd_budget=settings.ipc_fd_budget,
        connections_per_sandbox=settings.ipc_connections_per_sandbox,
        pending_per_sandbox=settings.ipc_pending_per_sandbox,
        pending_total=settings.ipc_pending_total,
        hello_timeout_s=settings.ipc_hello_timeout_s,
        channels_per_agent=settings.ipc_channels_per_agent,
        connects_per_sandbox=settings.ipc_connects_per_sandbox,
    )


def sandbox_of(pid: int, uid: int) -> str | None:
    """The sandbox whose bounds a connection of process ``pid`` counts against (its cgroup,
    which its tasks cannot leave); ``None`` outside every sandbox."""
    return cgroups.sandbox_of_process(pid)


class CommunicationPlane:
    """Owns this node's IPC broker.

    Args:
        settings: ``home`` (the socket's place), ``node_id``, and the NATS server through which
            agents on other nodes are reached.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.socket_path = socket_path(settings)
        self.broker: Broker | None = None
        self._manager: SandboxManager | None = None
        self.state_keeper: StateKeeper | None = None
        """Serves the broker's ``state`` op (set by the node agent's wiring)."""
        self.tool_reports: Callable[[str, str, dict[str, Any]], None] | None = None
        """Receives the broker's ``tools`` reports (the node agent's tool watch)."""

    def attach(self, manager: SandboxManager) -> None:
        """Identify connecting processes through ``manager``'s sandboxes."""
        self._manager = manager

    def identify(self, pid: int, uid: int, gid: int) -> AgentKey | None:
        """The only identity process ``pid`` may claim: its sandbox's agent, else none."""
        identity = self._manager.identify(pid, uid) if self._manager is not None else None
        if identity is None:
            return None
        return AgentKey(identity.task_group, identity.name, identity.tenant)

    async def start(self) -> None:
        """Listen (before sandboxes are re-adopted, so they can be shown the new socket)."""
        broker = Broker(
            self.socket_path,
            node_id=self.settings.node_id,
            nats_url=self.settings.nats_endpoint(),
            nats_options=auth_options(self.settings),
            identify=self.identify,
            limits=broker_limits(self.settings),
            sandbox_of=sandbox_of,
            state_keeper=self.state_keeper,
        )
        broker.tool_reports = self.tool_reports
        await broker.start()
        self.broker = broker

    async def stop(self) -> None:
        """Close every agent connection and remove the socket; sandboxes keep running."""
        if self.broker is not None:
            await self.broker.stop()
            self.broker = None
