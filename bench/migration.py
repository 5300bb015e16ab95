"""Migration: a CPU sandbox with 256 MiB of touched memory moved between two node agents by CRIU.

    sudo .venv/bin/python bench/migration.py [--quick] [--json] [--runs N] [--mib 256]

Two node agents in this process (the real service each: node-1 and node-2, homes of their own,
certified by one operator root, egress programs under their own pin directories, a throwaway
NATS). Each run starts a sandbox on node-1 that fills ``--mib`` MiB of memory and then keeps
printing a counter, publishes ``unit.migration_started{path: criu}`` as the scheduler would, and
waits for node-2's ``unit.migrated``: its ``interruption_ms`` is the **freeze** (from the final
dump freezing the sandbox to the restored tree continuing on node-2: dump, transfer of the
images, restore, the source's release), with ``bytes_moved``, ``precopy_rounds`` and the stages.
Every run checks that the counter went on with nothing lost or repeated.

Anchors (published figures, not measured here): Xen live migration ~60 ms downtime (Clark et
al., NSDI 2005); the CUDA restore phase ~1.3 s (NVIDIA Dynamo). On a kernel without
``CONFIG_MEM_SOFT_DIRTY`` (this VM's) CRIU cannot track the pages written after a pre-dump, so
there are no pre-copy rounds: the whole memory is dumped and moved inside the freeze.

Path ``handover`` across nodes (docs/migration.md, a warm standby on the target) is measured
as ``handover.cross_node`` in the full JSON (``--cross-node-runs``, on the
embedded stack: JetStream ``DSEC_STATE``, S3, OpenBao). Reported as ``handover`` in the
last line, as before: the hand-over's switch on one node's broker with
real SDK agent processes — the old version serving ``record``, another agent calling it in a
loop, the new version registered as the standby, the old one paused (its call in progress
finished) and frozen, the name switched, the caller told ``moved`` — as the caller's gap from
its last answer by the old version to its first by the new one (the state plane's final delta,
timed in bench/state.py, is not in it). Beside it, ``handover.large_agent``: the same with an
old version that touched ``--large-agent-mib`` MiB (1024), with the callers moved at the final
notice (as shipped) and, its peer, moved only when the old process is gone (as before
2026-12-06): the second waits for a large process to die; and both again with the caller on
another node (a second broker, the calls bridged over a throwaway NATS), whose calls the
serving node's bridge moves at the notice as it does a local caller's.

``--json``: the last line is exactly
``{"criu": {"freeze_ms_p50": X, "freeze_ms_p99": X, "bytes": N}, "handover":
{"interruption_ms_p50": X, "interruption_ms_p99": X}}``. Needs root and CRIU
(``scripts/setup-criu.sh``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "services/nodeagent/tests"))
import _nodeagent_harness
from _common import at_least, emit, nats_server, percentile, until
from _ipc_testkit import BrokerThread
from _nodeagent_harness import NodeAgentHarness
from dsec_core import events
from dsec_core.layout import NodeLayout

QUIET = "{cidr: 10.77.0.0/16, ports: [80]}"
PROGRAM = """
import time
memory = bytearray({mib} << 20)
for i in range(0, len(memory), 4096):
    memory[i] = 1
print("filled", flush=True)
n = 0
while True:
    n += 1
    memory[(n * 4096) % len(memory)] = n & 255
    print("count", n, flush=True)
    time.sleep(0.01)
"""
# the harness's spec gives a sandbox 256 MiB; this one holds 256 MiB of data besides Python
_nodeagent_harness.SPEC = _nodeagent_harness.SPEC.replace("memory: 256MiB", "memory: 1GiB")
ANCHORS = {"xen_live_migration_downtime_ms": 60.0, "cuda_restore_dynamo_ms": 1300.0}


def counts(path: Path) -> list[int]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [int(line.split()[1]) for line in lines if line.startswith("count ")]


@contextlib.asynccontextmanager
async def two_nodes(base: Path, nats_url: str, **extra: Any) -> AsyncIterator[tuple[Any, Any]]:
    first, second = base / "n1", base / "n2"
    common = {"migration_checkpointable": True, **extra}
    async with NodeAgentHarness(first, nats_url, node_id="node-1", **common) as h1:
        (second / "trust").mkdir(parents=True)
        for name in ("root.key", "root.pub"):
            shutil.copy2(first / "trust" / name, second / "trust" / name)
        settings = {"node_id": "node-2", "sandbox_uid_base": 260000, **common}
        try:
            async with NodeAgentHarness(second, nats_url, **settings) as h2:
                yield h1, h2
        finally:  # node-2's parent cgroups go, as at `dsec down`
            from dsec_nodeagent.sandbox import cgroups

            cgroups.remove_node_group(cgroups.detect(), "node-2")


async def one_run(h1: Any, h2: Any, base: Path, mib: int, say: Any) -> dict[str, Any]:
    code = PROGRAM.format(mib=mib)
    sid = await h1.submit("migrate", code, QUIET)
    await h1.wait_for(sid, "sandbox.ready", 120)
    source_log = NodeLayout.of(base / "n1").sandbox(sid).logs / "stdout.log"
    target_log = NodeLayout.of(base / "n2").sandbox(sid).logs / "stdout.log"
    await until(lambda: len(counts(source_log)) >= 50, "counting on node-1", 120)
    mid = f"bench-{uuid.uuid4().hex[:8]}"
    await h1.upstream.scheduler.publish(
        events.UnitMigrationStarted(
            migration_id=mid, from_node="node-1", to_node="node-2", reason="operator", path="criu"
        ),
        aggregate_id=sid,
    )
    rec = h1.recorded[sid]
    await until(lambda: rec.of("unit.migrated") or rec.of("unit.migration_failed"), "migrated", 300)
    if rec.of("unit.migration_failed"):
        raise SystemExit(f"migration failed: {rec.of('unit.migration_failed')[0].payload}")
    migrated = events.UnitMigrated.model_validate(rec.of("unit.migrated")[0].payload)
    at = len(counts(target_log))
    await until(lambda: len(counts(target_log)) >= at + 20, "counting on node-2", 60)
    seen = counts(target_log)
    intact = seen == list(range(1, len(seen) + 1))
    await h2.upstream.user.publish(
        events.SandboxStopRequested(requested_by="bench"), aggregate_id=sid
    )
    await h2.wait_for(sid, "sandbox.exited", 60)
    result = {
        "freeze_ms": migrated.interruption_ms,
        "bytes": migrated.bytes_moved,
        "precopy_rounds": migrated.precopy_rounds,
        "stages_ms": migrated.stages_ms,
        "counter_intact": intact,
    }
    say(f"  run: {json.dumps(result)}")
    if not intact:
        raise SystemExit("migration bench: the counter lost or repeated a count")
    return result


# ------------------------------------------------------------------ the hand-over's switch

AGENTS = Path(__file__).resolve().parents[1] / "services/nodeagent/tests/_handover_agents.py"
CALLER = """
import json, os, sys, time
from pathlib import Path
from dsec_sdk import DSecClient
client = DSecClient("agent-a", "g1", socket_path=sys.argv[1], timeout=60)
stop, out, seen, seq = Path(sys.argv[3]), sys.argv[2], [], 0
while not stop.exists():
    answer = client.call_tool("agent-b", "record", seq=seq)
    seen.append((answer["who"], time.monotonic()))
    seq += 1
Path(out).write_text(json.dumps(seen))
client.close()
"""


def _sandbox_of(pid: int, _uid: int) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"DSEC_TEST_SANDBOX="):
            return entry.split(b"=", 1)[1].decode()
    return None


def _spawn(
    sandbox: str, argv: list[str], handover_from: str = "", **env: str
) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "DSEC_TEST_SANDBOX": sandbox,
        "DSEC_STATE_HANDOVER_FROM": handover_from,
        **env,
    }
    return subprocess.Popen([sys.executable, *argv], env=env)


def _poll(predicate: Any, what: str, timeout: float = 60.0, every: float = 0.0005) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise SystemExit(f"hand-over bench: not {what} within {timeout} s")
        time.sleep(every)
    return value


def one_handover(
    work: Path, *, release: bool = True, ballast_mib: int = 0, nats_url: str = ""
) -> float:
    """One hand-over of a real SDK agent's tool name on one node's broker while another agent
    calls it in a loop: the new version registers as the standby, the old one finishes its call
    in progress and takes no more, is frozen (SIGSTOP, as the keeper's cgroup freeze), the broker
    switches the name, tells the caller which of its channels moved (``release``, as the node
    agent does once the hand-over is final; ``release=False``: as before 2026-12-06, the caller
    learns it when the old process is gone), and the old one is killed. ``ballast_mib``: memory
    the old version touches first (a large agent, slower to die). ``nats_url``: the caller is on
    another node (a second broker, bridged over that NATS), its calls crossing through both
    brokers. Returns the caller's gap: from its last answer by the old version to its first by
    the new one."""
    from dsec_nodeagent.ipc.registry import AgentKey

    key = AgentKey("g1", "agent-b")
    bridged = {"nats_url": nats_url} if nats_url else {}
    broker = BrokerThread(work / "ipc.sock", sandbox_of=_sandbox_of, node_id="n2", **bridged)
    sock = str(broker.socket_path)
    caller_node = BrokerThread(work / "n1.sock", node_id="n1", **bridged) if nats_url else None
    caller_sock = str(caller_node.socket_path) if caller_node is not None else sock
    old_log, new_log, out, stop = (work / n for n in ("old.log", "new.log", "out.json", "stop"))
    old_argv = [str(AGENTS), "server", sock, "old", str(old_log)]
    procs = [_spawn("old", old_argv, DSEC_TEST_BALLAST_MIB=str(ballast_mib))]
    try:
        _poll(lambda: broker.broker.local_server(key), "the old version serving", every=0.01)
        procs.append(_spawn("caller", ["-c", CALLER, caller_sock, str(out), str(stop)]))
        _poll(lambda: old_log.exists() and old_log.stat().st_size > 2000, "calls", every=0.01)
        broker.broker.expect_handover("new", "old")
        procs.append(
            _spawn("new", [str(AGENTS), "server", sock, "new", str(new_log)], handover_from="old")
        )
        _poll(lambda: Path(f"{new_log}.ready").exists(), "the new version ready", every=0.01)
        old = procs[0]
        old.send_signal(signal.SIGUSR1)  # the keeper's `handover`: finish the call, take no more
        _poll(lambda: Path(f"{old_log}.paused").exists(), "the old version paused")
        old.send_signal(signal.SIGSTOP)  # the freeze

        async def switch() -> int:
            told = broker.broker.switch(key, "new")
            return broker.broker.release(key, "old") if release else told

        broker.run(switch())
        broker.broker.forget_handover("new")
        old.kill()
        _poll(lambda: new_log.exists() and new_log.stat().st_size > 2000, "calls to new")
        stop.touch()
        procs[1].wait(60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
        broker.stop()
        if caller_node is not None:
            caller_node.stop()
    seen = json.loads(out.read_text())
    last_old = max(t for who, t in seen if who == "old")
    first_new = min(t for who, t in seen if who == "new")
    return (first_new - last_old) * 1000


def _gaps(runs: int, say: Any, what: str, **how: Any) -> list[float]:
    gaps = []
    for _ in range(runs):
        work = Path(tempfile.mkdtemp(prefix="dsec-mho-"))  # short: a socket path's 107 bytes
        try:
            gaps.append(one_handover(work, **how))
        finally:
            shutil.rmtree(work, ignore_errors=True)
        say(f"  hand-over{what}: caller's gap {gaps[-1]:.2f} ms")
    return gaps


def _with_and_without_notice(runs: int, say: Any, what: str, **how: Any) -> dict[str, float]:
    """The caller's gaps moved at the final notice, then (the peer) when the old process is
    gone; ``what`` opens the progress lines' parenthesis."""
    ours = _gaps(runs, say, what + ")", **how)
    before = _gaps(runs, say, what + ", no notice)", release=False, **how)
    return {
        "gap_ms_p50": round(percentile(ours, 0.5), 2),
        "gap_ms_max": round(max(ours), 2),
        "without_notice_gap_ms_p50": round(percentile(before, 0.5), 2),
        "without_notice_gap_ms_max": round(max(before), 2),
    }


def handover(runs: int, say: Any, large_runs: int, large_mib: int) -> dict[str, Any]:
    gaps = _gaps(runs, say, "")
    result: dict[str, Any] = {
        "runs": runs,
        "interruption_ms_p50": round(percentile(gaps, 0.5), 2),
        "interruption_ms_p99": round(percentile(gaps, 0.99), 2),
        "gaps_ms": [round(g, 2) for g in gaps],
        "scope": "one node's broker with real SDK agents (pause, freeze, switch, `moved` to the "
        "callers once final, kill); the state plane's final delta is not in it; across nodes: "
        "`cross_node`",
    }
    if large_runs > 0:
        # A large old version, the caller moved at the final notice (as shipped) against moved
        # when the old process is gone (as before 2026-12-06): the second waits for its death.
        what = f" ({large_mib} MiB"
        big = _with_and_without_notice(large_runs, say, what, ballast_mib=large_mib)
        # The same with the caller on another node: the serving node's bridge holds the
        # channel to the old version, and moves it at the notice too (since 2026-12-06 05:00).
        with nats_server() as url:
            far = _with_and_without_notice(
                large_runs, say, what + ", caller on another node", ballast_mib=large_mib,
                nats_url=url,
            )  # fmt: skip
        result["large_agent"] = {
            "mib": large_mib,
            "runs": large_runs,
            **big,
            "caller_on_another_node": far,
        }
    return result


# ------------------------------------------------------------------ path handover across nodes


async def cross_node(runs: int, say: Any) -> dict[str, Any]:
    """Path ``handover`` between node-1 and node-2 on the embedded stack (JetStream
    ``DSEC_STATE``, S3, OpenBao): a stateful SDK agent counting in its state (a checkpoint
    before each count), moved with a warm standby (docs/migration.md "Path ``handover``");
    ``interruption_ms`` from the agent being asked for its final checkpoint (it takes no call
    from then on) to its copy on node-2 owning the state and serving the name. Every run checks
    that the count went on from the last durable one."""
    from dsec_testing.stack import StackFixture
    from test_migration_handover import COUNTER, lines
    from test_migration_handover import counts as ticks

    base = Path(tempfile.mkdtemp(prefix="mho-", dir="/tmp"))
    stack = StackFixture(base / "stack")
    done: list[dict[str, Any]] = []
    try:
        extra = {**stack.s3.settings(), **stack.vault.settings()}
        async with two_nodes(base, stack.nats_url, **extra) as (h1, h2):
            for _ in range(runs):
                sid = await h1.submit(f"hand-{uuid.uuid4().hex[:6]}", COUNTER, QUIET,
                                      extra="state: {}\n")  # fmt: skip
                await h1.wait_for(sid, "sandbox.ready", 120)
                source = NodeLayout.of(base / "n1").sandbox(sid).logs / "stdout.log"
                target = NodeLayout.of(base / "n2").sandbox(sid).logs / "stdout.log"
                await until(lambda: len(ticks(source)) >= 20, "counting on node-1", 120)  # noqa: B023
                await h1.upstream.scheduler.publish(
                    events.UnitMigrationStarted(
                        migration_id=f"bench-{uuid.uuid4().hex[:8]}", from_node="node-1",
                        to_node="node-2", reason="operator", path="handover",
                    ),
                    aggregate_id=sid,
                )  # fmt: skip
                rec = h1.recorded[sid]
                await until(lambda: rec.of("unit.migrated") or rec.of("unit.migration_failed"),  # noqa: B023
                            "migrated", 300)  # fmt: skip
                if rec.of("unit.migration_failed"):
                    raise SystemExit(
                        f"handover failed: {rec.of('unit.migration_failed')[0].payload}"
                    )
                migrated = events.UnitMigrated.model_validate(rec.of("unit.migrated")[0].payload)
                await until(lambda: len(ticks(target)) >= 5, "counting on node-2", 60)  # noqa: B023
                acked = ticks(source)
                restored = next(w for w in lines(target) if w and w[0] == "restored")
                n, went_on = int(restored[1]), ticks(target)
                intact = (
                    restored[2] == "True"
                    and acked[-1] <= n <= acked[-1] + 1
                    and went_on == list(range(n + 1, n + 1 + len(went_on)))
                )
                await h2.upstream.user.publish(
                    events.SandboxStopRequested(requested_by="bench"), aggregate_id=sid
                )
                await h2.wait_for(sid, "sandbox.exited", 60)
                result = {
                    "interruption_ms": migrated.interruption_ms,
                    "bytes": migrated.bytes_moved,
                    "stages_ms": migrated.stages_ms,
                    "state_intact": intact,
                }
                say(f"  cross-node hand-over: {json.dumps(result)}")
                if not intact:
                    raise SystemExit("migration bench: the agent's count lost or repeated one")
                done.append(result)
    finally:
        stack.close()
        shutil.rmtree(base, ignore_errors=True)
    gaps = [r["interruption_ms"] for r in done]
    return {
        "runs": runs,
        "variant": "warm standby",
        "interruption_ms_p50": round(percentile(gaps, 0.5), 1),
        "interruption_ms_p99": round(percentile(gaps, 0.99), 1),
        "stages_p50_ms": {
            k: round(percentile([r["stages_ms"].get(k, 0.0) for r in done], 0.5), 1)
            for k in done[0]["stages_ms"]
        },
        "runs_detail": done,
    }


async def run(runs: int, mib: int, say: Any) -> dict[str, Any]:
    base = Path(tempfile.mkdtemp(prefix="mig-", dir="/tmp"))
    try:
        with nats_server() as url:
            async with two_nodes(base, url) as (h1, h2):
                done = [await one_run(h1, h2, base, mib, say) for _ in range(runs)]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    freezes = [r["freeze_ms"] for r in done]
    stages = {k: round(percentile([r["stages_ms"].get(k, 0.0) for r in done], 0.5), 1)
              for k in done[0]["stages_ms"]}  # fmt: skip
    return {
        "criu": {
            "runs": runs,
            "memory_mib": mib,
            "freeze_ms_p50": round(percentile(freezes, 0.5), 1),
            "freeze_ms_p99": round(percentile(freezes, 0.99), 1),
            "bytes": int(percentile([r["bytes"] for r in done], 0.5)),
            "precopy_rounds": max(r["precopy_rounds"] for r in done),
            "stages_p50_ms": stages,
            "runs_detail": done,
        },
        "anchors": ANCHORS,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 runs instead of 5")
    parser.add_argument("--json", action="store_true", help="print only the ratio and JSON lines")
    parser.add_argument("--runs", type=int, default=None)
    parser.add_argument("--mib", type=int, default=256, help="memory the sandbox touches")
    parser.add_argument(
        "--cross-node-runs", type=int, default=None,
        help="path handover between the two node agents on the embedded stack (default 2 with "
        "--quick, else 5; 0: skip)",
    )  # fmt: skip
    parser.add_argument(
        "--large-agent-runs", type=at_least(0), default=None,
        help="hand-overs of a large old version, with and without the final notice (default 2 "
        "with --quick, else 5; 0: skip)",
    )  # fmt: skip
    parser.add_argument(
        "--large-agent-mib",
        type=at_least(1),
        default=1024,
        help="memory the large old version touches",
    )
    args = parser.parse_args()
    runs = args.runs or (2 if args.quick else 5)

    def say(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    results = asyncio.run(run(runs, args.mib, say))
    large_runs = (
        args.large_agent_runs if args.large_agent_runs is not None else (2 if args.quick else 5)
    )
    results["handover"] = h = handover(
        5 if args.quick else 20, say, large_runs, args.large_agent_mib
    )
    cross_runs = (
        args.cross_node_runs if args.cross_node_runs is not None else (2 if args.quick else 5)
    )
    if cross_runs > 0:
        h["cross_node"] = asyncio.run(cross_node(cross_runs, say))
    x = h.get("cross_node")
    across = (
        f"across nodes (warm standby): p50 {x['interruption_ms_p50']:.1f} ms, p99 "
        f"{x['interruption_ms_p99']:.1f} ms"
        if x
        else "across nodes: not run"
    )
    big = h.get("large_agent")
    far = big["caller_on_another_node"] if big else {}
    large = (
        f"; a {big['mib']} MiB old version: gap p50 {big['gap_ms_p50']:.1f} ms (worst "
        f"{big['gap_ms_max']:.1f}), {big['without_notice_gap_ms_p50']:.1f} ms (worst "
        f"{big['without_notice_gap_ms_max']:.1f}) when callers waited for its death; a caller "
        f"on another node {far['gap_ms_p50']:.1f} ms against {far['without_notice_gap_ms_p50']:.1f}"
        " ms"
        if big
        else ""
    )
    c = results["criu"]
    line = (
        f"migration: criu freeze p50 {c['freeze_ms_p50']:.0f} ms, p99 {c['freeze_ms_p99']:.0f} ms "
        f"for {args.mib} MiB touched ({c['bytes'] / 2**20:.0f} MiB moved, "
        f"{c['precopy_rounds']} pre-copy rounds; stages p50 {c['stages_p50_ms']}); anchors: Xen "
        f"live migration ~60 ms downtime, CUDA restore ~1.3 s; hand-over (one node's broker, "
        f"real SDK agents, a caller calling throughout): gap p50 {h['interruption_ms_p50']:.2f} "
        f"ms, p99 {h['interruption_ms_p99']:.2f} ms (target < 12 ms); {across}{large}"
    )
    summary = {
        "criu": {"freeze_ms_p50": c["freeze_ms_p50"], "freeze_ms_p99": c["freeze_ms_p99"],
                 "bytes": c["bytes"]},
        "handover": {"interruption_ms_p50": h["interruption_ms_p50"],
                     "interruption_ms_p99": h["interruption_ms_p99"]},
    }  # fmt: skip
    emit("migration", results, line, summary=summary, runs=runs)


if __name__ == "__main__":
    main()
