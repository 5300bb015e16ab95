"""A neighbour's spec behind one tenant's burst at the shared policy service.

    uv run python bench/tenant_burst.py [--burst 3000] [--per-tenant 16] [--rounds 2] [--json]

A private embedded stack (NATS, Postgres, SeaweedFS, OpenBao) in a temp dir and the real policy
service (``DSEC_TENANT_QUEUE`` = ``--per-tenant``). Each round, tenant ``flood`` publishes
``--burst`` valid specs as fast as one publisher can (signed, acknowledged by JetStream), then
tenant ``neighbour`` publishes one; the figure is the time from the neighbour's publish to its
terminal event, beside the same spec's time with nothing ahead of it (the peer: an idle
service). JetStream delivers a consumer's events in stream order, so the neighbour's spec is
reached only once the service has taken every event of the burst from the bus: verified,
held, or ended at once past the tenant's bound. The report also gives that admission rate and
how much of the burst was validated rather than ended at once (the rate counts from the burst's
first publish to the neighbour's end).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import nats
from _common import at_least_one, emit
from dsec_core.events import SpecSubmitted
from dsec_core.ids import new_sandbox_id
from dsec_core.settings import TENANT_QUEUE_MAX
from dsec_core.subjects import STREAM, subject_for
from dsec_testing import trust
from dsec_testing.stack import ServiceRunner, StackFixture
from nats.js import JetStreamContext

SPEC = """\
version: "1.2"
name: burst-{n}
base: dsec/python311:latest
entrypoint: [python, -c, "print('hi')"]
"""
ENDS = ("spec.validated", "spec.rejected", "sandbox.failed")


async def _end(js: JetStreamContext, sid: str) -> str | None:
    """The type of ``sid``'s terminal event, once one is in the log."""
    for event_type in ENDS:
        try:
            await js.get_msg(STREAM, subject=subject_for(event_type, sid), next=True, seq=1)
        except Exception:  # nothing on that subject yet
            continue
        return event_type
    return None


async def _until_ended(js: JetStreamContext, sid: str, timeout_s: float = 600.0) -> str:
    deadline = time.monotonic() + timeout_s
    while (end := await _end(js, sid)) is None:
        if time.monotonic() > deadline:
            raise SystemExit(f"{sid} did not end within {timeout_s:g} s")
        await asyncio.sleep(0.01)
    return end


async def _round(js: JetStreamContext, home: Path, burst: int) -> dict[str, float]:
    flood = await trust.publisher(js, home, "user", tenant="flood")
    neighbour = await trust.publisher(js, home, "user", tenant="neighbour")
    alone = []
    for n in range(3):  # the neighbour's spec with nothing ahead of it
        sid = new_sandbox_id()
        started = time.perf_counter()
        await neighbour.publish(SpecSubmitted(spec_yaml=SPEC.format(n=f"a{n}")), aggregate_id=sid)
        await _until_ended(js, sid)
        alone.append(time.perf_counter() - started)
    sids = [new_sandbox_id() for _ in range(burst)]
    started = time.perf_counter()
    for n, sid in enumerate(sids):
        await flood.publish(SpecSubmitted(spec_yaml=SPEC.format(n=n)), aggregate_id=sid)
    published = time.perf_counter()
    victim = new_sandbox_id()
    await neighbour.publish(SpecSubmitted(spec_yaml=SPEC.format(n="v")), aggregate_id=victim)
    await _until_ended(js, victim)
    behind = time.perf_counter() - published
    await _until_ended(js, sids[-1])
    sample = sids[:: max(1, burst // 300)]
    ends = [await _end(js, sid) for sid in sample]
    return {
        "alone_s": statistics.median(alone),
        "behind_burst_s": behind,
        "burst_publish_s": published - started,
        "admitted_per_s": (burst + 1) / (published - started + behind),
        "validated_share": ends.count("spec.validated") / len(ends),
    }


def main(burst: int, per_tenant: int, rounds: int) -> None:
    results = []
    with tempfile.TemporaryDirectory(prefix="dsec-bench-burst-") as work:
        stack = StackFixture(Path(work) / "stack")
        runner = ServiceRunner(stack)
        try:
            runner.start("policy", env={"DSEC_TENANT_QUEUE": str(per_tenant)})

            async def run() -> None:
                nc = await nats.connect(stack.nats_url)
                try:
                    for _ in range(rounds):
                        results.append(await _round(nc.jetstream(), stack.home, burst))
                finally:
                    await nc.close()

            asyncio.run(run())
        finally:
            runner.close()
            stack.close()
    behind = [r["behind_burst_s"] for r in results]
    alone = statistics.median(r["alone_s"] for r in results)
    emit(
        "tenant_burst",
        {
            "burst": burst,
            "per_tenant": per_tenant,
            "rounds": [{k: round(v, 4) for k, v in r.items()} for r in results],
            "behind_burst_s_median": round(statistics.median(behind), 3),
            "alone_s_median": round(alone, 4),
        },
        f"a neighbour's spec behind a {burst:,}-spec burst of another tenant (bound "
        f"{per_tenant}): ended {statistics.median(behind):.2f} s after its publish (rounds: "
        + " / ".join(f"{b:.2f}" for b in behind)
        + f"), {alone * 1000:.0f} ms with nothing ahead; the burst taken from the bus at "
        + " / ".join(f"{r['admitted_per_s']:.0f}" for r in results)
        + " events/s, "
        + " / ".join(f"{r['validated_share']:.0%}" for r in results)
        + " of it validated meanwhile",
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--burst", type=at_least_one, default=3000, help="specs in the burst")
    parser.add_argument(
        "--per-tenant", type=at_least_one, default=16, help="DSEC_TENANT_QUEUE of the service"
    )
    parser.add_argument("--rounds", type=at_least_one, default=2, help="bursts, one by one")
    parser.add_argument("--json", action="store_true", help="(the JSON line is printed last)")
    args = parser.parse_args()
    if args.per_tenant > TENANT_QUEUE_MAX:  # the service would refuse to start
        parser.error(f"argument --per-tenant: at most {TENANT_QUEUE_MAX} (DSEC_TENANT_QUEUE)")
    main(args.burst, args.per_tenant, args.rounds)
