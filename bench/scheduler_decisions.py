"""The scheduler's decisions at fleet scale, without the bus: what a decision costs as the fleet
and the sandboxes placed on it grow.

    uv run python bench/scheduler_decisions.py [--nodes 1000] [--held 0 2000] [--waiting 400]

The real :class:`dsec_scheduler.app.Scheduler` over its folded state (a stand-in service takes
its published events, as ``services/scheduler/tests/test_scheduler_queue.py`` does): ``--nodes``
nodes of 8 GPUs join, ``--held`` sandboxes already hold one GPU each (spread over the nodes),
``--waiting`` sandboxes of one GPU wait; the queue is placed (each decision: the fleet's count,
the engine's sync, the engine's choice, the two decision events applied at once). Reported:
milliseconds a decision, and one loss-detection pass (``SchedulerState.evacuate``, every tick),
for each ``--held``. What placement through the bus costs beside it is
``bench/placement_e2e.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from _common import at_least, at_least_one, emit
from dsec_core.events import GpuInfo, NodeInventory, Payload, Resources
from dsec_core.settings import Settings
from dsec_scheduler.app import Scheduler
from dsec_scheduler.domain import Seen

GIB = 2**30
_ids = itertools.count()


@dataclass
class _Recorder:
    published: list[Payload] = field(default_factory=list)

    async def publish(self, payload: Payload, **_: Any) -> None:
        self.published.append(payload)


@dataclass
class _StandIn:
    settings: Settings
    publisher: _Recorder = field(default_factory=_Recorder)
    name: str = "scheduler"
    gate: None = None
    nc: None = None


def _seen(type_: str, agg: str, payload: dict[str, Any], at: float, tenant: str) -> Seen:
    return Seen(f"ev{next(_ids)}", type_, agg, tenant, payload, at, at)


def _scheduler(nodes: int, held: int, waiting: int) -> tuple[Scheduler, _Recorder]:
    # (no heartbeats while it runs: the nodes say they beat hourly, so they stay fresh however
    # long the slower code takes)
    service = _StandIn(Settings(node_lost_s=3600))
    s = Scheduler(service)  # type: ignore[arg-type]
    now = time.time()
    for i in range(nodes):
        node_id = f"n{i:05d}"
        inv = NodeInventory(
            cpus=64,
            memory_bytes=512 * GIB,
            gpus=[
                GpuInfo(index=g, uuid=f"{node_id}-{g}", model="H100", memory_total_bytes=80 * GIB)
                for g in range(8)
            ],
        )
        payload = {
            "node_id": node_id,
            "inventory": inv.model_dump(mode="json"),
            "heartbeat_s": 3600,
        }
        s.state.apply(_seen("node.joined", node_id, payload, now, "system"))
    one = Resources(cpus=1, memory_bytes=GIB, gpus=1).model_dump(mode="json")
    for i in range(held):
        sid, node_id = f"sbx_h{i}", f"n{i % nodes:05d}"
        s.state.apply(_seen("env.built", sid, {}, now, "acme"))
        s.state.apply(
            _seen("unit.placed", sid, {
                "sandbox_id": sid, "unit": "main", "node_id": node_id,
                "gpu_indices": [(i // nodes) % 8], "gpu_milli": 1000, "cpu_millicores": 1000,
                "memory_bytes": GIB, "attempt": 1}, now, "acme")
        )  # fmt: skip
        s.state.apply(
            _seen("sandbox.scheduled", sid, {"node_id": node_id, "resources": one}, now, "acme")
        )
    for i in range(waiting):
        sid = f"sbx_w{i}"
        s.state.apply(_seen("env.built", sid, {}, now, "acme"))
        pending = {"reason": "x", "resources": one}
        s.state.apply(_seen("sandbox.pending", sid, pending, now - 100 + i * 0.01, "acme"))
    return s, service.publisher


def _measure(nodes: int, held: int, waiting: int) -> dict[str, float]:
    s, recorder = _scheduler(nodes, held, waiting)
    s.state.fleet(time.time())  # (the first count of what is held: once, at start-up)
    started = time.perf_counter()
    asyncio.run(s.place_waiting())
    elapsed = time.perf_counter() - started
    placed = sum(1 for p in recorder.published if p.TYPE == "sandbox.scheduled")
    if placed != waiting:
        raise RuntimeError(f"placed {placed} of {waiting} waiting sandboxes")
    passes = []
    for _ in range(5):
        t = time.perf_counter()
        s.state.evacuate()
        passes.append(time.perf_counter() - t)
    return {
        "decision_ms": round(elapsed / placed * 1000, 3),
        "loss_pass_ms": round(statistics.median(passes) * 1000, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--nodes", type=at_least_one, default=1000, help="nodes of 8 GPUs")
    parser.add_argument(
        "--held",
        type=at_least(0),
        nargs="+",
        default=[0, 2000],
        help="sandboxes placed before, each",
    )
    parser.add_argument("--waiting", type=at_least_one, default=400, help="sandboxes to place")
    args = parser.parse_args()
    gpus, most = args.nodes * 8, args.waiting + max(args.held)
    if most > gpus:
        parser.error(
            f"{args.nodes} nodes have {gpus} GPUs: {args.waiting} waiting and {max(args.held)} "
            "held sandboxes of one GPU each do not fit; give more --nodes or fewer --held / "
            "--waiting"
        )
    results = {str(h): _measure(args.nodes, h, args.waiting) for h in args.held}
    line = "; ".join(
        f"{h} held: {r['decision_ms']} ms a decision, loss pass {r['loss_pass_ms']} ms"
        for h, r in results.items()
    )
    emit(
        "scheduler_decisions",
        {"nodes": args.nodes, "waiting": args.waiting, "by_held": results},
        f"scheduler decisions on {args.nodes} nodes, {args.waiting} placed one after another: "
        + line,
        argv=sys.argv[1:],
    )


if __name__ == "__main__":
    main()
