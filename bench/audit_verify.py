"""``dsec audit verify`` end to end, the CLI as a user runs it, on a long stream.

    uv run python bench/audit_verify.py [--events 200000] [--repeat 3] [--json]

Fills a fresh nats-server's DSEC_EVENTS stream with ``--events`` signed events of six certified
producers (interleaved, as ``bench/bus.py``'s verifier figures), then runs ``dsec audit verify
--json`` ``--repeat`` times (a new process each time: start-up, connection, the replay through
JetStream and the verifier, as shipped: forked before the reader connects, in a process of its
own) and, each time beside it, the verifier core alone over the same envelopes in memory.
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

import bus as busbench
from _common import at_least_one, emit, nats_server
from dsec_core import audit
from dsec_core.bus import EventPublisher, ensure_stream

PRODUCERS = 6


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


def _cli_run(env: dict[str, str]) -> tuple[float, dict]:
    started = time.perf_counter()
    done = subprocess.run(
        [_dsec(), "audit", "verify", "--json"], env=env, capture_output=True, text=True
    )
    elapsed = time.perf_counter() - started
    report = json.loads(done.stdout.strip().splitlines()[-1])
    if done.returncode != 0 or not report["ok"] or report["injected"]:
        raise SystemExit(f"dsec audit verify failed: {done.stdout[-500:]} {done.stderr[-500:]}")
    return elapsed, report


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
    rows = []
    with nats_server() as url, tempfile.TemporaryDirectory(prefix="dsec-bench-") as home:
        wires = asyncio.run(_fill(url, n))
        numbered = list(enumerate(wires, 1))
        env = {
            **os.environ,
            "DSEC_NATS_URL": url,
            "DSEC_TRUST_ROOT": busbench.ANCHOR.hex(),
            "DSEC_HOME": home,
        }
        for _ in range(repeat):
            started = time.perf_counter()
            core = audit.verify_stream(numbered, busbench.ANCHOR)
            core_rate = len(numbered) / (time.perf_counter() - started)
            if not core.ok:
                raise SystemExit(f"verification failed: {core.finding}")
            elapsed, report = _cli_run(env)
            events = report["last_seq"] - report["first_seq"] + 1
            rows.append((events / elapsed / core_rate, events / elapsed, core_rate))
        startup = min(_startup_s(READER_IMPORTS) for _ in range(3))
        verifier_import = min(_startup_s(VERIFIER_IMPORTS) for _ in range(3)) - startup
    # Each figure's own median (the CLI's rate is the target's; the run with the median ratio
    # may be another one).
    ratio, cli_rate, core_rate = (statistics.median(r[k] for r in rows) for k in range(3))
    emit(
        "audit_verify",
        {
            "events": len(numbered),
            "cli_events_per_s": round(cli_rate),
            "core_events_per_s": round(core_rate),
            "ratio_cli_over_core": round(ratio, 3),
            "runs": [{"cli": round(r[1]), "core": round(r[2])} for r in rows],
            "cli_startup_s": round(startup, 3),
            "verifier_import_s": round(verifier_import, 3),
        },
        f"audit verify: `dsec audit verify` {cli_rate:,.0f} ev/s end to end on {len(numbered):,} "
        f"events (median of {len(rows)}: {', '.join(f'{r[1]:,.0f}' for r in rows)}), the "
        f"verifier core alone {core_rate:,.0f} ev/s (median) in the same runs; the command "
        f"reached {ratio:.0%} of the core in its median run; the command's "
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
