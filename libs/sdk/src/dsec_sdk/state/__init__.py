"""The state plane, agent side: :class:`AgentState` and its containers (see docs/state.md,
"Using it from an agent"). ``wire`` is the agent <-> keeper contract; ``codec`` applies records
to values (shared with the node agent's keeper). numpy is needed only for arrays and vectors
(``pip install 'dsec-sdk[state]'``)."""

from dsec_sdk.state.agent import AgentState, CheckpointInfo, RestoreInfo, SwitchInfo
from dsec_sdk.state.containers import ArrayState, Blob, KVMap, LogEntry, MessageLog, VectorIndex
from dsec_sdk.state.store import LocalStore, NodeStore, StateError

__all__ = [
    "AgentState",
    "ArrayState",
    "Blob",
    "CheckpointInfo",
    "KVMap",
    "LocalStore",
    "LogEntry",
    "MessageLog",
    "NodeStore",
    "RestoreInfo",
    "StateError",
    "SwitchInfo",
    "VectorIndex",
]
