"""How long a DSec service takes to stop, beside a minimal FastStream app stopped the same way.

    uv run python bench/service_stop.py [--rounds 5] [--json]

A private embedded stack (NATS, Postgres, SeaweedFS, OpenBao) in a temp dir; each service of
``dsec up`` is started idle and stopped as ``dsec down`` stops it (SIGTERM, then waiting for
the process to be gone), ``--rounds`` times; the time is SIGTERM to gone. The peer is what a
user would write instead: a FastStream app with one JetStream pull subscriber on the same NATS,
stopping on SIGTERM the usual way (``asyncio.run`` returns, Python's own shutdown follows).
"""

from __future__ import annotations

import argparse
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import at_least_one, emit
from dsec_testing.stack import ServiceRunner, StackFixture

SERVICES = ("policy", "builder", "snapshot", "scheduler", "nodeagent")

PEER = """
import asyncio, signal, sys
from faststream.nats import JStream, NatsBroker, PullSub

async def main() -> None:
    broker = NatsBroker(sys.argv[1])
    stream = JStream(name="BENCH_STOP", subjects=["bench.stop.>"], declare=True)

    @broker.subscriber("bench.stop.x", stream=stream, pull_sub=PullSub(batch_size=16))
    async def handle(body: bytes) -> None:
        pass

    await broker.start()
    print("ready", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stopping.set)
    await stopping.wait()
    await broker.stop()

asyncio.run(main())
"""


def _peer_stop(url: str) -> float:
    proc = subprocess.Popen([sys.executable, "-c", PEER, url], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # FastStream's own log lines come first
            if line.strip() == b"ready":
                break
        else:
            raise SystemExit("the FastStream peer did not start")
        time.sleep(0.5)  # idle, as the services are when stopped
        started = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        return time.perf_counter() - started
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main(rounds: int) -> None:
    times: dict[str, list[float]] = {name: [] for name in SERVICES}
    peer: list[float] = []
    with tempfile.TemporaryDirectory(prefix="dsec-bench-stop-") as work:
        stack = StackFixture(Path(work) / "stack")
        runner = ServiceRunner(stack)
        try:
            runner.start(*SERVICES)
            for _ in range(rounds):
                for name in SERVICES:
                    time.sleep(0.5)  # idle
                    started = time.perf_counter()
                    runner.stop(name)  # SIGTERM, then waits until the process is gone
                    times[name].append(time.perf_counter() - started)
                    runner.restart(name)
                peer.append(_peer_stop(stack.nats_url))
        finally:
            runner.close()
            stack.close()
    medians = {name: statistics.median(t) for name, t in times.items()}
    peer_median = statistics.median(peer)
    worst = max(medians.values())
    emit(
        "service_stop",
        {
            "rounds": rounds,
            "stop_s_median": {name: round(v, 3) for name, v in medians.items()},
            "stop_s_all": {name: [round(x, 3) for x in t] for name, t in times.items()},
            "faststream_app_stop_s_median": round(peer_median, 3),
            "faststream_app_stop_s_all": [round(x, 3) for x in peer],
        },
        "service stop (SIGTERM to gone, idle, median of "
        f"{rounds}): "
        + ", ".join(f"{name} {v * 1000:.0f} ms" for name, v in medians.items())
        + f"; a minimal FastStream app {peer_median * 1000:.0f} ms "
        f"(the slowest service {worst / peer_median:.2f}× it)",
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=at_least_one, default=5, help="stops of each service")
    parser.add_argument("--json", action="store_true", help="(the JSON line is printed last)")
    args = parser.parse_args()
    main(args.rounds)
