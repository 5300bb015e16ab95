"""Archiving the event log to S3: throughput, size on the stream vs in the archive, read-back.

A private embedded stack (NATS + SeaweedFS) in a temporary home; the log is what dominates a
fleet's: node heartbeats of 8-GPU nodes (the fleet simulator's), signed by each node's
certified key. Measures `archive` (read, pack, upload, read back, check), a full check of the
archive, and the audit verifier over the archive.

    uv run python bench/archive.py [--events 20000] [--nodes 10]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import nats
from _common import emit
from dsec_core import eventarchive
from dsec_core.audit import Verifier
from dsec_core.bus import ensure_stream
from dsec_core.subjects import STREAM
from dsec_fleetsim.inventory import uniform
from dsec_fleetsim.node import SimNode
from dsec_testing import trust
from dsec_testing.stack import StackFixture

BUCKET = "bench-archive"


async def fill(js: Any, home: Path, events: int, nodes: int) -> None:
    sims = [SimNode(plan, 5.0, "bench") for plan in uniform(nodes, gpus=8, gpu_model="H100")]
    pubs = [await trust.publisher(js, home, "nodeagent", node_id=sim.plan.node_id) for sim in sims]
    now = time.time()
    left = events - nodes
    while left > 0:
        batch = []
        for sim, pub in zip(sims, pubs, strict=True):
            if left <= 0:
                break
            beat = sim.heartbeat(now)
            batch.append((pub, pub.signer.seal(beat, aggregate_id=sim.plan.node_id)))
            left -= 1
        await asyncio.gather(*(pub.publish_sealed(sealed) for pub, sealed in batch))


async def main(events: int, nodes: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dsec-bench-archive-") as tmp:
        fixture = StackFixture(Path(tmp) / "home")
        try:
            nc = await nats.connect(fixture.nats_url)
            js = nc.jetstream()
            await ensure_stream(js)
            await fill(js, fixture.home, events, nodes)
            state = (await js.stream_info(STREAM)).state
            store = fixture.s3.client()

            anchor = bytes(trust.stack_root(fixture.home).verify_key)
            started = time.perf_counter()
            result = await eventarchive.archive(
                js, store, BUCKET, signer=trust.archive_signer(fixture.home)
            )
            archive_s = time.perf_counter() - started

            started = time.perf_counter()
            check = await eventarchive.check_archive(store, BUCKET, anchor)
            check_s = time.perf_counter() - started

            manifest = await eventarchive.read_manifest(store, BUCKET, anchor)
            assert manifest is not None
            verifier = Verifier(anchor)
            started = time.perf_counter()
            async for record in eventarchive.archived_records(store, BUCKET, manifest):
                verifier.feed(record.seq, record.data)
            report = verifier.finish()
            verify_s = time.perf_counter() - started
            await nc.close()
        finally:
            fixture.close()
    assert report.ok and report.events == state.messages, report
    out = {
        "events": state.messages,
        "nodes": nodes,
        "stream_bytes": state.bytes,
        "stream_bytes_per_event": round(state.bytes / state.messages),
        "archive_bytes": check.bytes,
        "archive_ratio": round(state.bytes / check.bytes, 2),
        "segments": len(result.segments),
        "archive_s": round(archive_s, 2),
        "archive_events_per_s": round(state.messages / archive_s),
        "check_s": round(check_s, 2),
        "check_events_per_s": round(check.events / check_s),
        "verify_from_archive_s": round(verify_s, 2),
        "verify_from_archive_events_per_s": round(report.events / verify_s),
    }
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--nodes", type=int, default=10)
    args = parser.parse_args()
    measured = asyncio.run(main(args.events, args.nodes))
    emit(
        "archive",
        measured,
        f"archive: {measured['archive_events_per_s']} events/s archived and read back, "
        f"{measured['stream_bytes_per_event']} B/event on the stream, "
        f"archive {measured['archive_ratio']}x smaller",
    )
