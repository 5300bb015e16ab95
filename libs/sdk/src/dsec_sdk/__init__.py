"""DSec SDK: what agent code imports.

The communication plane: :class:`DSecClient` calls other agents' tools over shared memory (and
across nodes over NATS, transparently) and serves this agent's own tools.
"""

from dsec_sdk.client import DSecClient
from dsec_sdk.errors import (
    AgentNotFound,
    BadArguments,
    BrokerUnavailable,
    CallTimeout,
    IpcError,
    PayloadTooLarge,
    PeerGone,
    ProtocolError,
    RemoteError,
    ToolNotFound,
)

__all__ = [
    "AgentNotFound",
    "BadArguments",
    "BrokerUnavailable",
    "CallTimeout",
    "DSecClient",
    "IpcError",
    "PayloadTooLarge",
    "PeerGone",
    "ProtocolError",
    "RemoteError",
    "ToolNotFound",
]
