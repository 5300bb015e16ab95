"""DSec SDK: what agent code imports.

The communication plane: :class:`DSecClient` calls other agents' tools over shared memory (and
across nodes over NATS, transparently) and serves this agent's own tools.
The state plane: :class:`AgentState` keeps the agent's state in containers that record their own
deltas, checkpointed to the node agent (or a local directory) and restored after a crash.
"""

from typing import TYPE_CHECKING, Any

from dsec_sdk.client import DSecClient
from dsec_sdk.errors import (
    AgentBusy,
    AgentNotFound,
    BadArguments,
    BrokerRefused,
    BrokerUnavailable,
    CallTimeout,
    IpcError,
    PayloadTooLarge,
    PeerGone,
    ProtocolError,
    ReentrantCall,
    RemoteError,
    ToolNotFound,
)

if TYPE_CHECKING:
    from dsec_sdk.state import AgentState, StateError


def __getattr__(name: str) -> Any:
    """The state plane is imported on first use (an agent that keeps no state never pays for
    it)."""
    if name in ("AgentState", "StateError"):
        from dsec_sdk import state

        return getattr(state, name)
    raise AttributeError(f"module 'dsec_sdk' has no attribute {name!r}")


__all__ = [
    "AgentBusy",
    "AgentNotFound",
    "AgentState",
    "BadArguments",
    "BrokerRefused",
    "BrokerUnavailable",
    "CallTimeout",
    "DSecClient",
    "IpcError",
    "PayloadTooLarge",
    "PeerGone",
    "ProtocolError",
    "ReentrantCall",
    "RemoteError",
    "StateError",
    "ToolNotFound",
]
