"""The node agent's IPC broker: shared-memory channels between the agents of a task group."""

from dsec_nodeagent.ipc.broker import Broker, Connection, Identify
from dsec_nodeagent.ipc.registry import AgentKey, Registry

__all__ = ["AgentKey", "Broker", "Connection", "Identify", "Registry"]
