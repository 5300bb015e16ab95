"""Prometheus metrics of the communication plane's broker (the node agent's ``/metrics``).

Local calls never pass through the broker (the two agents talk through shared memory alone), so
these count what the broker does see: agents, channels, refusals, and calls bridged to or from
other nodes over NATS.
"""

from __future__ import annotations

from typing import Final

from dsec_sdk.ipc import codec
from prometheus_client import Counter, Gauge, Histogram

AGENTS = Gauge("dsec_ipc_agents", "Agents connected to this node's broker", ["role"])
CHANNELS_OPENED = Counter(
    "dsec_ipc_channels_opened_total",
    "Shared-memory channels handed to callers; where=remote when the callee is on another node",
    ["where"],
)
CONNECTS_FAILED = Counter(
    "dsec_ipc_connects_failed_total",
    "Channel requests that got no channel, by error code (not_found, bad_request)",
    ["code"],
)
REFUSED = Counter(
    "dsec_ipc_refused_total",
    "Connections refused at hello: a name the process may not use, a taken name, bad input",
)
REFUSALS = Counter(
    "dsec_ipc_refusals_total",
    "Connections, hellos and channel requests the broker refused or closed, by reason "
    "(a fixed set: see dsec_nodeagent.ipc.limits.REASONS)",
    ["reason"],
)
CONNECTIONS = Gauge("dsec_ipc_connections", "Connections to this node's broker")
PENDING = Gauge(
    "dsec_ipc_pending_connections", "Connections to this node's broker that have not said hello"
)
REMOTE_CALLS = Counter(
    "dsec_ipc_remote_calls_total",
    "Calls bridged over NATS; direction=out (a local caller, remote agent) or in; outcome is "
    "result or the error code",
    ["direction", "outcome"],
)
REMOTE_CALL_SECONDS = Histogram(
    "dsec_ipc_remote_call_seconds",
    "Latency of calls bridged over NATS, as the bridging node agent sees it",
    ["direction"],
    buckets=(0.0002, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1, 5, 30),
)

_CODES: Final = frozenset(
    {
        codec.E_REMOTE,
        codec.E_UNKNOWN_TOOL,
        codec.E_BAD_ARGUMENTS,
        codec.E_BAD_RESULT,
        codec.E_TOO_LARGE,
        codec.E_TIMEOUT,
        codec.E_PEER_GONE,
        codec.E_NOT_FOUND,
    }
)


def outcome(kind: int, body: bytes) -> str:
    """``result``, or the error code of an ERROR body (``other`` when it is not one of ours)."""
    if kind == codec.RESULT:
        return "result"
    try:
        code = codec.unpack(body)[0]
    except (ValueError, TypeError, IndexError, KeyError):
        return "other"
    return code if code in _CODES else "other"


def observe_remote(direction: str, kind: int, body: bytes, seconds: float) -> None:
    """Count one bridged call and its latency."""
    REMOTE_CALLS.labels(direction, outcome(kind, body)).inc()
    REMOTE_CALL_SECONDS.labels(direction).observe(seconds)
