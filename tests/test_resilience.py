"""Resilience: a NATS restart under load loses no acknowledged event; a service killed while it
holds unacknowledged events ends every aggregate with exactly one outcome after restart, and the
audit trail still verifies."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import nats
import pytest
from dsec_core.bus import ensure_stream, replay
from dsec_core.envelope import Envelope, MalformedEnvelope, decode
from dsec_core.events import SpecSubmitted
from dsec_core.subjects import STREAM

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _decoded(data: bytes) -> Envelope | None:
    """The envelope, or None for the garbage other tests inject into the shared stream."""
    try:
        return decode(data)
    except MalformedEnvelope:
        return None


async def test_nats_restart_under_load_loses_no_acknowledged_event(
    nats_url, nats_restart, make_publisher
):
    nc = await nats.connect(nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    js = nc.jetstream()
    await ensure_stream(js)
    publisher = await make_publisher(js, "loadgen")
    run = uuid.uuid4().hex[:8]
    acked: list[str] = []

    async def load() -> None:
        for i in range(600):
            published = await publisher.publish(
                SpecSubmitted(spec_yaml=f"n: {i}"), aggregate_id=f"sbx_{run}_{i % 20}"
            )
            acked.append(published.envelope.id)

    task = asyncio.create_task(load())
    while len(acked) < 150 and not task.done():  # restart in the middle of the load
        await asyncio.sleep(0.01)
    if task.done():
        task.result()  # the load failed before the restart: show why
    await nats_restart.arestart(kill=True)
    await asyncio.wait_for(task, 120)
    assert len(acked) == 600

    stored = Counter()
    async for _, data in replay(js, filter_subject="dsec.sandbox.*.spec.submitted"):
        env = _decoded(data)
        if env is not None and env.aggregate_id.startswith(f"sbx_{run}_"):
            stored[env.id] += 1
    await nc.close()
    assert set(acked) <= set(stored), f"{len(set(acked) - set(stored))} acknowledged events lost"
    assert max(stored.values()) == 1, "an event was stored twice"


GOOD = "version: '1.2'\nname: ok-{i}\nbase: python:3.11\n"
BAD = "version: '1.2'\nname: Bad_{i}\nbase: python:3.11\nmemroy: 1GiB\n"


async def test_killed_service_ends_every_aggregate_with_exactly_one_outcome(
    nats_url, services, stack_env, dsec_cli, make_publisher
):
    services.start("policy")
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    publisher = await make_publisher(js, "load")
    run = uuid.uuid4().hex[:8]
    sandboxes = [f"sbx_{run}_{i}" for i in range(400)]
    await publisher.publish_many(
        [
            publisher.signer.seal(
                SpecSubmitted(spec_yaml=(GOOD if i % 2 else BAD).format(i=i)), aggregate_id=sid
            )
            for i, sid in enumerate(sandboxes)
        ]
    )

    async def outcomes() -> Counter:
        """Terminal events per aggregate: validated, rejected, or failed (one tenant holds at
        most DSEC_TENANT_QUEUE at the service; past it a spec ends at once in sandbox.failed)."""
        seen: Counter = Counter()
        for subjects in ("dsec.sandbox.*.spec.*", "dsec.sandbox.*.failed"):
            async for _, data in replay(js, filter_subject=subjects):
                env = _decoded(data)
                if env is None or env.type == "spec.submitted":
                    continue
                if env.aggregate_id.startswith(f"sbx_{run}_"):
                    seen[env.aggregate_id] += 1
        return seen

    # Kill it while it holds delivered-but-unacknowledged events, in the middle of the work.
    held = 0
    for _ in range(2000):
        info = await js.consumer_info(STREAM, "policy-spec-submitted")
        if info.num_ack_pending > 0 and info.delivered.consumer_seq > 20:
            services.kill("policy")
            held = info.num_ack_pending
            break
        await asyncio.sleep(0.002)
    killed_at = sum((await outcomes()).values())
    services.start("policy")
    for _ in range(600):
        seen = await outcomes()
        if len(seen) == len(sandboxes):
            break
        await asyncio.sleep(0.05)
    await nc.close()
    assert held > 0, "the service was never caught holding unacknowledged events"
    assert killed_at < len(sandboxes), "the kill came too late to test anything"
    assert set(seen) == set(sandboxes), f"{len(sandboxes) - len(seen)} aggregates got no outcome"
    assert max(seen.values()) == 1, "an aggregate got two outcomes"
    verified = dsec_cli("audit", "verify", "--json", env=stack_env)
    assert verified.exit_code == 0, verified.output
