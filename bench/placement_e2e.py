"""Placement through the bus, end to end: request event in → signed ``unit.placed`` out.

    uv run python bench/placement_e2e.py [--nodes 1000] [--requests 400] [--serial 60]

A throwaway embedded stack (NATS, the real scheduler service as a process) and a simulated
fleet of ``--nodes`` 8×H100 nodes (``python -m dsec_fleetsim``: every node signs its own
heartbeats). Each request is the chain a sandbox's pipeline publishes (``spec.submitted`` →
``spec.validated`` → ``deps.resolved`` → ``env.built``), with one unit of one H100; the clock is
JetStream's: the time the log stored ``env.built`` to the time it stored the scheduler's
``unit.placed`` (no clock of ours in between).

* **serial**: one request at a time (the next ``env.built`` after the previous ``unit.placed``):
  the latency a single user sees, p50/p99.
* **burst**: ``--requests`` ``env.built`` published at once (pipelined acks): decisions/s
  through the bus, from the first ``env.built`` stored to the last ``unit.placed`` stored.

Which part costs what: the scheduler's own decision time (its
``dsec_scheduler_placement_seconds`` histogram: the engine, for all the sandbox's units) is read
from its ``/metrics`` and set beside the end-to-end time; the rest is the trust gate on the
way in (signature, certificate, authorization, the replay bucket's round trip), the fold
catching up with the log, signing and publishing the two decision events with their acks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
from _common import emit, percentile
from dsec_core import events
from dsec_core.envelope import Envelope, decode
from dsec_core.natsperms import FLEETSIM
from dsec_core.subjects import filter_for
from dsec_testing import trust
from dsec_testing.stack import ServiceRunner, StackFixture
from dsec_testing.trust import ENV_BUILT
from nats.aio.msg import Msg
from nats.js import JetStreamContext

SPEC = """\
version: "1.2"
name: bench-unit
base: dsec/python311:latest
entrypoint: [python, -c, "pass"]
resources: {cpu: 2, memory: 8GiB, gpu: {count: 1, type: h100}}
"""


@dataclass(frozen=True)
class Chain:
    """One request, published up to ``deps.resolved`` ahead of the timed part."""

    sid: str
    cause: Envelope
    """Its ``deps.resolved``: the cause of the ``env.built`` the clock starts at."""


async def _prepare(pipe: trust.Pipeline, n: int) -> list[Chain]:
    chains = []
    for _ in range(n):
        sid = f"sbx_bench_{uuid.uuid4().hex[:12]}"
        chains.append(Chain(sid, await pipe.resolved(SPEC, sid, "bench.yaml")))
    return chains


async def _first(js: JetStreamContext, subject: str, timeout: float = 60.0) -> Msg:
    """The first message on ``subject`` (waits for it)."""
    sub = await js.subscribe(subject, ordered_consumer=True)
    try:
        return await sub.next_msg(timeout=timeout)
    finally:
        await sub.unsubscribe()


async def _stored_at(js: JetStreamContext, subject: str, timeout: float = 60.0) -> float:
    """JetStream's timestamp of the first message on ``subject``."""
    return (await _first(js, subject, timeout)).metadata.timestamp.timestamp()


def _decision_seconds(url: str) -> tuple[float, float]:
    """``(sum, count)`` of the scheduler's placement histogram."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=5).read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith("dsec_scheduler_placement_seconds_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith("dsec_scheduler_placement_seconds_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


async def _run(stack: StackFixture, url: str, args: argparse.Namespace) -> dict[str, Any]:
    nc = await nats.connect(stack.nats_url)
    js = nc.jetstream()
    pipe = await trust.pipeline(js, stack.home)

    # warm-up: probes until a placement counts every simulated node (the scheduler has read
    # each one's node.joined / first heartbeat)
    probes: list[Chain] = []
    deadline = time.monotonic() + 180
    while True:
        probe = (await _prepare(pipe, 1))[0]
        probes.append(probe)
        await pipe.builder.publish(ENV_BUILT, aggregate_id=probe.sid, causation=probe.cause)
        placed = await _first(js, filter_for("unit.placed", probe.sid))
        if _nodes_total(placed) >= args.nodes:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the scheduler did not see {args.nodes} nodes within 180 s")
        await asyncio.sleep(1.0)

    serial: list[float] = []
    before = _decision_seconds(url)
    for chain in await _prepare(pipe, args.serial):
        await pipe.builder.publish(ENV_BUILT, aggregate_id=chain.sid, causation=chain.cause)
        placed = await _stored_at(js, filter_for("unit.placed", chain.sid))
        built_at = await _stored_at(js, filter_for("env.built", chain.sid))
        serial.append((placed - built_at) * 1000)
    after = _decision_seconds(url)
    decide_ms = (after[0] - before[0]) / max(1.0, after[1] - before[1]) * 1000

    chains = await _prepare(pipe, args.requests)
    sealed = [
        pipe.builder.signer.seal(ENV_BUILT, aggregate_id=c.sid, causation=c.cause) for c in chains
    ]
    before = _decision_seconds(url)
    await pipe.builder.publish_many(sealed)
    first_in = await _stored_at(js, filter_for("env.built", chains[0].sid))
    last_out = 0.0
    for c in chains:
        last_out = max(last_out, await _stored_at(js, filter_for("unit.placed", c.sid), 120))
    after = _decision_seconds(url)
    burst_decide_ms = (after[0] - before[0]) / max(1.0, after[1] - before[1]) * 1000
    burst_s = last_out - first_in
    for c in [*chains, *probes]:  # end them: nothing of the bench stays queued or placed
        await pipe.builder.publish(events.SandboxFailed(stage="bench", reason="bench over"),
                                   aggregate_id=c.sid)  # fmt: skip
    await nc.close()
    return {
        "nodes": args.nodes,
        "gpus": args.nodes * 8,
        "serial_requests": len(serial),
        "serial_p50_ms": round(percentile(serial, 0.5), 2),
        "serial_p99_ms": round(percentile(serial, 0.99), 2),
        "serial_decision_ms": round(decide_ms, 3),
        "burst_requests": args.requests,
        "burst_s": round(burst_s, 3),
        "burst_decisions_per_s": round(args.requests / burst_s, 1),
        "burst_decision_ms": round(burst_decide_ms, 3),
    }


def _nodes_total(msg: Msg) -> int:
    return int(decode(msg.data).payload.get("nodes_total") or 0)


async def _fleet(stack: StackFixture, nodes: int) -> asyncio.subprocess.Process:
    env = {
        **os.environ,
        **stack.env(),
        "DSEC_NATS_NKEY_SEED": str(stack.nats_seed(FLEETSIM)),
        "DSEC_LOG_LEVEL": "ERROR",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dsec_fleetsim", "--nodes", str(nodes), "--gpus", "8",
        "--gpu-model", "H100", "--prefix", "bench", "--run-for", "3600",
        "--status-every", "1", env=env, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.stdout is not None
    async for raw in proc.stdout:  # joined: every node registered its key and said node.joined
        if raw.startswith(b"{") and json.loads(raw).get("event") == "started":
            break
    asyncio.get_running_loop().create_task(_drain(proc))
    return proc


async def _drain(proc: asyncio.subprocess.Process) -> None:
    assert proc.stdout is not None
    async for _ in proc.stdout:
        pass


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--serial", type=int, default=60)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="dsec-bench-place-") as tmp:
        stack = StackFixture(Path(tmp) / "stack")
        services = ServiceRunner(stack)
        fleet = None
        try:
            services.start("scheduler")
            fleet = await _fleet(stack, args.nodes)
            results = await _run(stack, services.url("scheduler"), args)
        finally:
            if fleet is not None and fleet.returncode is None:
                fleet.terminate()
                await fleet.wait()
            services.close()
            stack.close()
    ratio = (
        f"placement through the bus on {args.nodes} simulated nodes ({args.nodes * 8} GPUs): "
        f"one request at a time p50 {results['serial_p50_ms']} ms, p99 "
        f"{results['serial_p99_ms']} ms (the scheduler's decision "
        f"{results['serial_decision_ms']} ms of it); {args.requests} at once "
        f"{results['burst_decisions_per_s']} decisions/s"
    )
    emit("placement_e2e", results, ratio, argv=sys.argv[1:])


if __name__ == "__main__":
    asyncio.run(main())
