"""Resilience: a NATS restart under load loses no acknowledged event; a service killed while it
holds unacknowledged events ends every aggregate with exactly one outcome after restart, and the
audit trail still verifies."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter

import nats
import pytest
from dsec_core.bus import EventPublisher, ensure_stream, replay
from dsec_core.envelope import decode
from dsec_core.events import SpecSubmitted
from dsec_core.signing import Signer
from nacl.signing import SigningKey

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_nats_restart_under_load_loses_no_acknowledged_event(nats_url, nats_restart):
    nc = await nats.connect(nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    js = nc.jetstream()
    await ensure_stream(js)
    publisher = EventPublisher(js, Signer("loadgen", SigningKey.generate()))
    run = uuid.uuid4().hex[:8]
    acked: list[str] = []

    async def load() -> None:
        for i in range(600):
            published = await publisher.publish(
                SpecSubmitted(spec_yaml=f"n: {i}"), aggregate_id=f"sbx_{run}_{i % 20}"
            )
            acked.append(published.envelope.id)

    task = asyncio.create_task(load())
    while len(acked) < 150:  # restart in the middle of the load
        await asyncio.sleep(0.01)
    await nats_restart.arestart(kill=True)
    await asyncio.wait_for(task, 120)
    assert len(acked) == 600

    stored = Counter()
    async for _, data in replay(js, filter_subject="dsec.sandbox.*.spec.submitted"):
        env = decode(data)
        if env.aggregate_id.startswith(f"sbx_{run}_"):
            stored[env.id] += 1
    await nc.close()
    assert set(acked) <= set(stored), f"{len(set(acked) - set(stored))} acknowledged events lost"
    assert max(stored.values()) == 1, "an event was stored twice"
