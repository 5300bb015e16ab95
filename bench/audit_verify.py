"""``dsec audit verify`` end to end, the CLI as a user runs it, on a long stream.

    uv run python bench/audit_verify.py [--events 200000] [--repeat 3] [--json]

Fills a fresh nats-server's DSEC_EVENTS stream with ``--events`` signed events of six certified
producers (interleaved, as ``bench/bus.py``'s verifier figures), then runs ``dsec audit verify
--json`` ``--repeat`` times (a new process each time: start-up, connection, the replay through
JetStream and the verifier, as shipped: forked before the reader connects, in a process of its
own) and, each time beside it, the verifier core alone over the same envelopes in memory. Each
run is made twice, alternating: as shipped (the verifier's common case in C,
``dsec_core/_auditfast.c``) and with ``DSEC_AUDIT_PURE_PYTHON=1`` (its Python path alone); the
core is also timed as the forked verifier is fed (batches with the reader's chain hashes), in
µs an event.
Events/s = the stream's events / the command's wall time. The start-up is reported too, as it
is a fixed cost in every run: the reader's imports before it forks the verifier, and the
verifier's own (the signature checks and certificates, not the event models), which the forked
child pays before it verifies.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import bus as busbench
from _common import at_least_one, emit, nats_server
from dsec_core import audit, bus
from dsec_core.audit_report import fewer_collections
from dsec_core.bus import EventPublisher, ensure_stream
from dsec_core.canonical import envelope_hash

PRODUCERS = 6


class _Round(NamedTuple):
    """One path's figures in one round (as shipped, or the verifier's Python path alone)."""

    cli: float  # the command's events/s
    core: float  # verify_stream's events/s
    hashed_us: float  # µs an event, fed as the forked verifier is


async def _fill(url: str, n: int) -> list[bytes]:
    """Publish ``n`` events of six producers (after their key registrations); their wires."""
    nc = await busbench._connect(url)
    js = nc.jetstream()
    await ensure_stream(js)
    publishers, wires = [], []
    for i in range(PRODUCERS):
        signer, reg = busbench._certified(f"svc{i}")
        publisher = EventPublisher(js, signer)
        wires.append((await publisher.publish(reg, aggregate_id=signer.key_id)).sealed.wire)
        publishers.append(publisher)
    payload = busbench._payload()
    for base in range(0, n, busbench.BATCH):
        for j, publisher in enumerate(publishers):
            batch = [
                publisher.signer.seal(payload, aggregate_id=f"sbx_{i % 64}")
                for i in range(base, min(n, base + busbench.BATCH))
                if i % PRODUCERS == j
            ]
            if batch:
                wires += [p.sealed.wire for p in await publisher.publish_many(batch)]
    await nc.close()
    return wires


def _dsec() -> str:
    return str(Path(sys.executable).parent / "dsec")


def _cli_run(env: dict[str, str], pure_python: bool = False) -> tuple[float, dict]:
    env = {**env, "DSEC_AUDIT_PURE_PYTHON": "1" if pure_python else "0"}
    started = time.perf_counter()
    done = subprocess.run(
        [_dsec(), "audit", "verify", "--json"], env=env, capture_output=True, text=True
    )
    elapsed = time.perf_counter() - started
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if done.returncode != 0 or not report["ok"] or report["injected"]:
        raise SystemExit(f"dsec audit verify failed: {done.stdout[-500:]} {done.stderr[-500:]}")
    return elapsed, report


def _hashed_core_us(hashed: list[tuple[int, bytes, str]]) -> float:
    """µs an event of the verifier core fed as the forked verifier is fed: batches of the
    reader's size, each envelope with its chain hash (the reader computes them)."""
    started = time.perf_counter()
    with fewer_collections():
        verifier = audit.Verifier(busbench.ANCHOR)
        for at in range(0, len(hashed), bus.PULL_BATCH):
            verifier.feed_many(hashed[at : at + bus.PULL_BATCH])
        report = verifier.finish()
    if not report.ok or report.events != len(hashed):
        raise SystemExit(f"verification failed: {report.finding}")
    return (time.perf_counter() - started) / len(hashed) * 1e6


def _startup_s(code: str) -> float:
    """Wall time of a fresh interpreter running ``code`` (imports) alone."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True)
    return time.perf_counter() - started


# What the reader imports before it forks the verifier and reads, and what the forked verifier
# imports before it verifies (the signature checks and the certificates; beside the reader, on the
# other core).
READER_IMPORTS = "import dsec_cli.main, dsec_cli.commands.audit, dsec_core.audit_worker"
VERIFIER_IMPORTS = f"{READER_IMPORTS}; import dsec_core.audit"


def main(n: int, repeat: int) -> None:
    shipped: list[_Round] = []
    python: list[_Round] = []
    with nats_server() as url, tempfile.TemporaryDirectory(prefix="dsec-bench-") as home:
        wires = asyncio.run(_fill(url, n))
        numbered = list(enumerate(wires, 1))
        env = {
            **os.environ,
            "DSEC_NATS_URL": url,
            "DSEC_TRUST_ROOT": busbench.ANCHOR.hex(),
            "DSEC_HOME": home,
        }
        # The forked verifier's input: each envelope with the chain hash the reader computed.
        hashed = [(seq, data, envelope_hash(data)) for seq, data in numbered]
        c_run = audit._fast_run
        for _ in range(repeat):
            for pure_python, rounds in ((False, shipped), (True, python)):
                audit._fast_run = None if pure_python else c_run
                started = time.perf_counter()
                core = audit.verify_stream(numbered, busbench.ANCHOR)
                core_rate = len(numbered) / (time.perf_counter() - started)
                if not core.ok:
                    raise SystemExit(f"verification failed: {core.finding}")
                elapsed, report = _cli_run(env, pure_python)
                events = report["last_seq"] - report["first_seq"] + 1
                rounds.append(_Round(events / elapsed, core_rate, _hashed_core_us(hashed)))
        audit._fast_run = c_run
        startup = min(_startup_s(READER_IMPORTS) for _ in range(3))
        verifier_import = min(_startup_s(VERIFIER_IMPORTS) for _ in range(3)) - startup
    # Each figure's own median (the CLI's rate is the target's; the run with the median ratio
    # may be another one).
    ratio = statistics.median(r.cli / r.core for r in shipped)
    cli_rate, core_rate, hashed_us = (statistics.median(f) for f in zip(*shipped, strict=True))
    py_cli_rate, py_core_rate, py_hashed_us = (
        statistics.median(f) for f in zip(*python, strict=True)
    )
    emit(
        "audit_verify",
        {
            "events": len(numbered),
            "cli_events_per_s": round(cli_rate),
            "core_events_per_s": round(core_rate),
            "ratio_cli_over_core": round(ratio, 3),
            "runs": [
                {
                    "cli": round(c.cli),
                    "core": round(c.core),
                    "core_hashed_us": round(c.hashed_us, 2),
                    "cli_pure_python": round(p.cli),
                    "core_pure_python": round(p.core),
                    "core_hashed_pure_python_us": round(p.hashed_us, 2),
                }
                for c, p in zip(shipped, python, strict=True)
            ],
            "cli_pure_python_events_per_s": round(py_cli_rate),
            "core_pure_python_events_per_s": round(py_core_rate),
            "core_hashed_us_per_event": round(hashed_us, 2),
            "core_hashed_pure_python_us_per_event": round(py_hashed_us, 2),
            "cli_startup_s": round(startup, 3),
            "verifier_import_s": round(verifier_import, 3),
        },
        f"audit verify: `dsec audit verify` {cli_rate:,.0f} ev/s end to end on {len(numbered):,} "
        f"events (median of {len(shipped)}: {', '.join(f'{r.cli:,.0f}' for r in shipped)}), the "
        f"verifier core alone {core_rate:,.0f} ev/s (median) in the same runs; the command "
        f"reached {ratio:.0%} of the core in its median run; with its Python path alone "
        f"(DSEC_AUDIT_PURE_PYTHON=1, alternating) the command {py_cli_rate:,.0f} ev/s (median: "
        f"{', '.join(f'{r.cli:,.0f}' for r in python)}), the core {py_core_rate:,.0f} ev/s; the "
        f"core given the reader's chain hashes (as the forked verifier is) {hashed_us:.2f} "
        f"against {py_hashed_us:.2f} us an event; the command's "
        f"start-up {startup:.2f} s of it, then the forked verifier's imports "
        f"{verifier_import:.2f} s",
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--events", type=at_least_one, default=200_000, help="events in the stream to verify"
    )
    parser.add_argument("--repeat", type=at_least_one, default=3, help="runs (the median)")
    parser.add_argument("--json", action="store_true", help="(the JSON line is printed last)")
    args = parser.parse_args()
    main(args.events, args.repeat)
