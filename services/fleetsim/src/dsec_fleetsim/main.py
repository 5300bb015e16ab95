"""``python -m dsec_fleetsim``: run a simulated fleet (``dsec fleet simulate`` spawns it).

Output: one JSON object per line on stdout — ``{"event": "started", ...}``, then a ``status``
line every ``--status-every`` seconds (events/s, CPU µs per event, placements, refusals, RSS),
then ``stopped``. Logs go to stderr. Exit codes: 0 done, 2 bad input (located), 3 the bus is
unreachable.

``--measure`` publishes nothing: it builds the fleet, certifies every node, signs one heartbeat
per node and reports the cost (µs per signed heartbeat, bytes per heartbeat, bytes per
node-hour in the stream, RSS).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import logging
import signal
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dsec_core.identity import SYSTEM_TENANT, TrustPaths, read_anchor
from dsec_core.settings import Settings
from dsec_core.spec.units import parse_cpu, parse_size

from dsec_fleetsim import inventory
from dsec_fleetsim.fleet import Fleet, NotPermitted, Options, rss_mib
from dsec_fleetsim.identities import NodeIdentity, NoRoot, certify, fleet_secret, root_key
from dsec_fleetsim.node import SimNode
from dsec_fleetsim.script import Step, load_script

log = logging.getLogger("dsec_fleetsim")

EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3


def emit(line: dict[str, Any]) -> None:
    """One JSON line on stdout."""
    print(json.dumps(line, separators=(",", ":")), flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dsec_fleetsim", description=__doc__)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--nodes-csv", type=Path, help="openb node list: sn,cpu_milli,...,model")
    src.add_argument("--inventory", type=Path, help="YAML inventory (nodes: [...])")
    src.add_argument("--nodes", type=int, help="N identical nodes <prefix>-0..N-1")
    p.add_argument("--gpus", type=int, default=8, help="GPUs per node (with --nodes)")
    p.add_argument("--gpu-model", default="H100", help="GPU model (with --nodes)")
    p.add_argument("--cpu", default="128", help="CPU cores per node (with --nodes)")
    p.add_argument("--memory", default="1TiB", help="Memory per node (with --nodes)")
    p.add_argument("--prefix", default=None, help="Node id prefix (default sim; CSV: none)")
    p.add_argument("--label", action="append", default=[], help="k=v on every node (repeat)")
    p.add_argument("--limit", type=int, default=None, help="Only the first N nodes")
    p.add_argument("--heartbeat-s", type=float, default=None, help="Default: DSEC_HEARTBEAT_S")
    p.add_argument("--run-for", type=float, default=300.0, help="Seconds a placed unit runs")
    p.add_argument("--script", type=Path, help="Health script (YAML steps)")
    p.add_argument("--for", dest="duration", type=float, default=None, help="Stop after N s")
    p.add_argument("--status-every", type=float, default=2.0, help="Status line period (s)")
    p.add_argument("--root-key", type=Path, default=None, help="Operator root key file")
    p.add_argument("--max-in-flight", type=int, default=2048, help="Unacknowledged publishes")
    p.add_argument("--measure", action="store_true", help="Sign only, publish nothing")
    return p


def _labels(items: Sequence[str]) -> dict[str, str]:
    labels: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise inventory.InventoryError(f"--label {item!r}: expected key=value")
        problem = inventory.label_problem(key, value)
        if problem is not None:
            raise inventory.InventoryError(f"--label {item!r}: {problem}")
        labels[key] = value
    return labels


def plans_of(args: argparse.Namespace) -> list[inventory.NodePlan]:
    """The nodes the arguments describe.

    Raises:
        InventoryError: located.
    """
    labels = _labels(args.label)
    if args.nodes_csv is not None:
        plans = inventory.load_csv(args.nodes_csv, prefix=args.prefix)
    elif args.inventory is not None:
        plans = inventory.load_yaml(args.inventory, prefix=args.prefix or "sim")
    else:
        try:
            cpus = float(parse_cpu(args.cpu))
            memory = int(parse_size(args.memory))
        except ValueError as exc:
            raise inventory.InventoryError(f"--cpu/--memory: {exc}") from None
        plans = inventory.uniform(
            args.nodes,
            gpus=args.gpus,
            gpu_model=args.gpu_model,
            cpus=cpus,
            memory_bytes=memory,
            prefix=args.prefix or "sim",
        )
    if args.limit is not None:
        plans = plans[: max(1, args.limit)]
    if labels:
        plans = [
            inventory.NodePlan(p.node_id, p.cpus, p.memory_bytes, p.gpu_model, p.gpus,
                               {**p.labels, **labels})
            for p in plans
        ]  # fmt: skip
    return plans


def measure(plans: Sequence[inventory.NodePlan], idents: dict[str, NodeIdentity],
            heartbeat_s: float) -> dict[str, Any]:  # fmt: skip
    """Sign one heartbeat per node: the CPU cost and the bytes the stream stores."""
    nodes = [SimNode(p, heartbeat_s, "0.1.0") for p in plans]
    signers = {n.node_id: idents[n.node_id].signer() for n in nodes}
    for node in nodes:  # the first beat fills each node's cache of its GPUs' signed form
        signers[node.node_id].seal(node.heartbeat(0.0), aggregate_id=node.node_id)
    t0 = time.process_time()
    size = 0
    for node in nodes:  # a steady beat
        sealed = signers[node.node_id].seal(
            node.heartbeat(heartbeat_s), aggregate_id=node.node_id, tenant=SYSTEM_TENANT
        )
        size += len(sealed.wire)
    cpu = time.process_time() - t0
    per_event = size / len(nodes)
    per_node_hour = per_event * 3600 / heartbeat_s
    return {
        "event": "measured",
        "nodes": len(nodes),
        "heartbeat_s": heartbeat_s,
        "sign_us_per_heartbeat": round(cpu / len(nodes) * 1e6, 1),
        "bytes_per_heartbeat": round(per_event),
        "events_per_s_at_this_interval": round(len(nodes) / heartbeat_s, 1),
        "stream_mib_per_node_hour": round(per_node_hour / 2**20, 2),
        "stream_gib_per_hour_all_nodes": round(per_node_hour * len(nodes) / 2**30, 2),
        "rss_mib": rss_mib(),
    }


async def run(args: argparse.Namespace) -> int:
    settings = Settings()
    heartbeat_s = args.heartbeat_s or settings.heartbeat_s
    try:
        plans = plans_of(args)
        steps: list[Step] = []
        if args.script is not None:
            steps = load_script(args.script, [p.node_id for p in plans])
        root = root_key(settings.home, args.root_key)
    except (inventory.InventoryError, NoRoot) as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    t0 = time.monotonic()
    secret = fleet_secret(settings.home)
    idents = {p.node_id: certify(root, secret, p.node_id) for p in plans}
    certify_s = time.monotonic() - t0
    if args.measure:
        emit({**measure(plans, idents, heartbeat_s), "certify_s": round(certify_s, 2)})
        return 0
    anchor = read_anchor(TrustPaths(settings.home), settings.trust_root) or bytes(root.verify_key)
    from dsec_core.bus import connect, require_stream
    from dsec_core.trust import Gate, KeyRing

    try:
        nc = await connect(settings, "dsec-fleetsim")
    except Exception as exc:
        print(f"error: NATS at {settings.nats_endpoint()} unreachable: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    fleet: Fleet | None = None
    try:
        js = nc.jetstream()
        await require_stream(js)
        keys = KeyRing(nc, js, anchor)
        await keys.start()
        fleet = Fleet(
            plans,
            idents,
            js,
            Gate(keys, js, None),
            Options(
                heartbeat_s=heartbeat_s,
                version=_version(),
                run_for_s=args.run_for,
                max_in_flight=args.max_in_flight,
                status_every_s=args.status_every,
            ),
            steps,
            report=emit,
        )
        try:
            await fleet.start()
        except NotPermitted as exc:
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return EXIT_UNREACHABLE
        emit(
            {
                "event": "started",
                "nodes": len(plans),
                "gpus": sum(p.gpus for p in plans),
                "heartbeat_s": heartbeat_s,
                "certify_s": round(certify_s, 2),
                "join_s": round(time.monotonic() - t0 - certify_s, 2),
                "node_ids": [p.node_id for p in plans[:3]],
            }
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), args.duration)
    finally:
        if fleet is not None:
            await fleet.stop()
            emit({"event": "stopped", **fleet.status()})
        with contextlib.suppress(Exception):
            await nc.drain()
    return 0


def _version() -> str:
    """What ``node.joined`` says it runs (the package's version, as a node agent says its)."""
    try:
        return importlib.metadata.version("dsec-fleetsim")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0"


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(
        level=Settings().log_level,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return asyncio.run(run(args))
