"""The simulated fleet's cost: N nodes heartbeating on a throwaway JetStream server.

    uv run python bench/fleet_sim.py [--nodes 1000 5000] [--seconds 30] [--heartbeat-s 5]

For each fleet size, ``python -m dsec_fleetsim`` runs ``--seconds`` after joining (8×H100 nodes,
every event signed by its node's certified key and acknowledged by JetStream) and reports: the
time to certify and join, the steady event rate, CPU µs per published event, peak RSS, and what
the stream stored per heartbeat (bytes) and per node-hour.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import nats
from _common import emit, nats_server
from dsec_core import identity
from dsec_core.bus import ensure_stream
from dsec_core.subjects import STREAM


async def _stream(url: str) -> tuple[int, int]:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        await ensure_stream(js)
        state = (await js.stream_info(STREAM)).state
        return int(state.messages), int(state.bytes)
    finally:
        await nc.close()


def run_one(nodes: int, seconds: float, heartbeat_s: float) -> dict[str, Any]:
    with nats_server() as url, tempfile.TemporaryDirectory(prefix="dsec-fleet-") as home:
        identity.ensure_root(identity.TrustPaths(Path(home)))
        asyncio.run(_stream(url))
        env = {**os.environ, "DSEC_HOME": home, "DSEC_NATS_URL": url, "DSEC_LOG_LEVEL": "ERROR"}
        argv = [sys.executable, "-m", "dsec_fleetsim", "--nodes", str(nodes), "--gpus", "8"]
        argv += ["--heartbeat-s", str(heartbeat_s), "--for", str(seconds)]
        argv += ["--status-every", str(max(2.0, heartbeat_s))]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
        lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
        started = next(x for x in lines if x["event"] == "started")
        status = [x for x in lines if x["event"] == "status"]
        steady = status[len(status) // 2 :] or status
        stopped = next(x for x in lines if x["event"] == "stopped")
        before_msgs = 2 * nodes  # key registrations and node.joined
        messages, size = asyncio.run(_stream(url))
        beats = max(1, messages - before_msgs)
        per_beat = size / messages
        return {
            "nodes": nodes,
            "heartbeat_s": heartbeat_s,
            "certify_s": started["certify_s"],
            "join_s": started["join_s"],
            "events_per_s": round(sum(x["events_per_s"] for x in steady) / len(steady), 1),
            "expected_events_per_s": round(nodes / heartbeat_s, 1),
            "cpu_us_per_event": round(sum(x["cpu_us_per_event"] for x in steady) / len(steady)),
            "rss_mib": stopped["rss_mib"],
            "publish_errors": stopped["publish_errors"],
            "heartbeats_stored": beats,
            "stored_bytes_per_event": round(per_beat),
            "stream_mib_per_node_hour": round(per_beat * 3600 / heartbeat_s / 2**20, 2),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--heartbeat-s", type=float, default=5.0)
    args = parser.parse_args()
    results = {str(n): run_one(n, args.seconds, args.heartbeat_s) for n in args.nodes}
    line = "; ".join(
        f"{r['nodes']} nodes: {r['events_per_s']:.0f} events/s, {r['cpu_us_per_event']} µs CPU "
        f"each, RSS {r['rss_mib']:.0f} MiB, {r['stream_mib_per_node_hour']} MiB/node-hour"
        for r in results.values()
    )
    emit("fleet_sim", results, line)


if __name__ == "__main__":
    main()
