"""The planner: calls the researcher's ``lookup`` tool through the DSec SDK and times the calls.

Both agents run in sandboxes of their own; the call travels through shared memory the node
agent's broker set up for this pair, never through the network. At the end the planner asks
the researcher to shut down, so both sandboxes end.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from dsec_sdk import AgentNotFound, DSecClient, PeerGone
from dsec_sdk.ipc.ring import accelerated

PEER = "researcher"
QUERIES = ("memfd", "eventfd", "msgpack", "landlock", "io_uring")
WARM_UP = 50
CALLS = 500
PEER_START_S = 30.0


def first_answer(client: DSecClient) -> Any:
    """The first lookup, retried while the researcher is still starting up."""
    deadline = time.monotonic() + PEER_START_S
    while True:
        try:
            return client.call_tool(PEER, "lookup", query=QUERIES[0])
        except AgentNotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def timed_calls(client: DSecClient, count: int) -> list[int]:
    """Latency in nanoseconds of ``count`` lookups, one after the other."""
    latencies = []
    for i in range(count):
        query = QUERIES[i % len(QUERIES)]
        start = time.perf_counter_ns()
        client.call_tool(PEER, "lookup", query=query)
        latencies.append(time.perf_counter_ns() - start)
    return latencies


def main() -> int:
    """Ask, time, report, and shut the researcher down."""
    client = DSecClient()
    print(f"planner: {client.agent!r} in task group {client.group!r} calls {PEER!r}", flush=True)
    first_answer(client)
    for query in QUERIES:
        answer = client.call_tool(PEER, "lookup", query=query)
        print(f"lookup({query!r}) -> {answer['summary']}", flush=True)
    timed_calls(client, WARM_UP)
    latencies = timed_calls(client, CALLS)
    p50 = statistics.median(latencies) / 1000
    p99 = statistics.quantiles(latencies, n=100)[98] / 1000
    rings = "C ring hot path" if accelerated() else "pure-Python rings"
    summary = f"{CALLS} calls to {PEER}.lookup: p50 {p50:.1f} µs, p99 {p99:.1f} µs ({rings})"
    print(f"planner: {summary}", flush=True)
    try:
        outcome = client.call_tool(PEER, "shutdown", timeout=5.0)
        print(f"planner: {PEER} shut down after serving {outcome['served']} lookups", flush=True)
    except PeerGone:
        print(f"planner: {PEER} ended before it answered the shutdown", flush=True)
    client.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
