"""Noisy neighbour: a victim's ``sandbox.ready`` while another sandbox floods refusals.

    sudo .venv/bin/python bench/noisy_neighbour.py [--n 15] [--flood-s 20]

One node agent (this process: the real service, its egress programs under their own pin
directory, a throwaway NATS) starts victim sandboxes one after another and times each from
publishing its ``env.built`` to its ``sandbox.ready`` arriving from the log — what a user of
``dsec submit`` waits for. Three phases in the same run: idle; beside a sandbox looping on a
denied ``connect`` (eBPF refusals); beside a sandbox looping on lookups of names no rule allows
(DNS-proxy refusals). Also reported: the node agent's share of that time (``overhead``: the
latency minus the sandbox's own start, ``start_latency_ms.total``), the flooders' refusals and
the events they cost, and this process's RSS. The comparison is idle vs flood in the same run.
Needs root (namespaces, cgroups, BPF).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services/nodeagent/tests"))
from _common import emit, nats_server, percentile
from _nodeagent_harness import CONNECT_FLOOD, DNS_FLOOD, NodeAgentHarness, rss_mb


def _stats(values: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(percentile(values, 0.5), 1),
        "p99_ms": round(percentile(values, 0.99), 1),
        "n": len(values),
    }


async def _victims(h: NodeAgentHarness, n: int, tag: str) -> tuple[list[float], list[float]]:
    ready, overhead = [], []
    for i in range(n):
        sid = await h.submit(f"{tag}-{i}", "print('hi')")
        await h.wait_for(sid, "sandbox.ready")
        ready.append(h.ready_ms(sid))
        overhead.append(h.overhead_ms(sid))
        await h.wait_for(sid, "sandbox.exited")
    return ready, overhead


async def _phase(
    h: NodeAgentHarness, n: int, tag: str, flood: str | None, flood_s: float
) -> dict[str, Any]:
    attacker = None
    if flood is not None:
        attacker = await h.submit(f"{tag}-flooder", flood.format(seconds=flood_s))
        await h.wait_for(attacker, "sandbox.ready")
        await asyncio.sleep(1.0)  # let the flood build up
    rss_before = rss_mb()
    ready, overhead = await _victims(h, n, tag)
    result: dict[str, Any] = {
        "ready": _stats(ready),
        "overhead": _stats(overhead),
        "rss_mb": {"before": round(rss_before, 1), "after": round(rss_mb(), 1)},
    }
    if attacker is not None:
        running = h.agent.manager.get(attacker) is not None
        exited = await h.wait_for(attacker, "sandbox.exited", timeout_s=flood_s + 60)
        await h.outlet.drain()
        out = h.agent.manager.log_paths(attacker)[0].read_text().splitlines()
        rec = h.recorded[attacker]
        summaries = rec.of("policy.violation_summary")
        result["flood"] = {
            "still_running_after_victims": running,
            "exit_reason": exited.payload["reason"],
            "refused": json.loads(out[-1])["refused"] if out else None,
            "violation_events": len(rec.of("policy.violation")),
            "summary_events": len(summaries),
            "summarized_refusals": sum(s.payload["count"] for s in summaries),
        }
    return result


async def run(n: int, flood_s: float) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="dnb-", dir="/tmp"))  # short: AF_UNIX socket paths
    try:
        with nats_server() as url:
            async with NodeAgentHarness(
                tmp / "home", url, policy_summary_interval_s=2.0, policy_flood_limit=0
            ) as h:
                warm = await h.submit("warm-up", "print('hi')")
                await h.wait_for(warm, "sandbox.exited")
                return {
                    "idle": await _phase(h, n, "idle", None, flood_s),
                    "connect_flood": await _phase(h, n, "conn", CONNECT_FLOOD, flood_s),
                    "dns_flood": await _phase(h, n, "dns", DNS_FLOOD, flood_s),
                }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=15, help="victims per phase")
    parser.add_argument("--flood-s", type=float, default=20.0, help="how long each flood lasts")
    args = parser.parse_args()
    results = asyncio.run(run(args.n, args.flood_s))
    idle = results["idle"]["ready"]["p50_ms"]
    conn = results["connect_flood"]["ready"]["p50_ms"]
    dns = results["dns_flood"]["ready"]["p50_ms"]
    line = (
        f"noisy_neighbour: victim sandbox.ready p50 idle {idle:.0f} ms, under a connect flood "
        f"{conn:.0f} ms ({conn / idle:.2f}x), under a DNS-refusal flood {dns:.0f} ms "
        f"({dns / idle:.2f}x); target within 2x"
    )
    emit("noisy_neighbour", results, line, victims_per_phase=args.n, flood_s=args.flood_s)


if __name__ == "__main__":
    main()
