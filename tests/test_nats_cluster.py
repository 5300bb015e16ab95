"""The NATS cluster of `dsec up --nodes 3`: the event stream on three servers survives one of them
being killed mid-flow — no event lost, none stored twice, each handled once by a durable
consumer — and is R3-healthy again once the server is back."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter

import nats
import pytest
from dsec_core.bus import require_stream
from dsec_core.envelope import decode
from dsec_core.events import SpecSubmitted
from dsec_core.subjects import STREAM
from dsec_testing import trust
from dsec_testing.stack import ClusterFixture
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

pytestmark = [pytest.mark.integration]

EVENTS = 300


async def _healthy_r3(js: nats.js.JetStreamContext, name: str, deadline: float) -> None:
    """Wait until ``name`` has a leader and two current followers (every member back)."""
    last = None
    while time.monotonic() < deadline:
        info = await js.stream_info(name)
        cluster = info.cluster
        last = cluster
        if (
            info.config.num_replicas == 3
            and cluster is not None
            and cluster.leader
            and len(cluster.replicas or []) == 2
            and all(r.current and not r.offline for r in cluster.replicas or [])
        ):
            return
        await asyncio.sleep(0.2)
    raise AssertionError(f"{name} not R3-healthy before the deadline: {last}")


async def test_stream_is_r3_and_services_accept_it(dsec_cluster: ClusterFixture):
    nc = await nats.connect(servers=dsec_cluster.operator_urls)
    try:
        js = nc.jetstream()
        config = await require_stream(js)  # what every service checks at start
        assert config.num_replicas == 3
        await _healthy_r3(js, STREAM, time.monotonic() + 20)
        await _healthy_r3(js, "KV_dsec-handled", time.monotonic() + 20)
    finally:
        await nc.close()


async def test_killing_the_stream_leader_mid_flow_loses_nothing(dsec_cluster: ClusterFixture):
    urls = dsec_cluster.operator_urls
    pub_nc = await nats.connect(servers=urls, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    sub_nc = await nats.connect(servers=urls, max_reconnect_attempts=-1, reconnect_time_wait=0.1)
    js = pub_nc.jetstream(timeout=2.0)
    sub_js = sub_nc.jetstream(timeout=2.0)
    run = uuid.uuid4().hex[:8]
    subject = f"dsec.sandbox.sbx_{run}.spec.submitted"
    durable = f"cluster-kill-{run}"
    await sub_js.add_consumer(
        STREAM,
        ConsumerConfig(
            durable_name=durable,
            filter_subject=subject,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=2.0,
        ),
    )
    publisher = await trust.publisher(js, dsec_cluster.home, "user", subject=f"load-{run}")
    acked: list[str] = []
    first_deliveries: Counter[str] = Counter()
    handled: Counter[str] = Counter()  # dedup by event id, as the runtime's replay bucket does

    async def produce() -> None:
        for i in range(EVENTS):
            published = await publisher.publish(
                SpecSubmitted(spec_yaml=f"n: {i}"), aggregate_id=f"sbx_{run}"
            )
            acked.append(published.envelope.id)
            await asyncio.sleep(0.005)

    async def consume() -> None:
        sub = await sub_js.pull_subscribe(subject, durable=durable, stream=STREAM)
        while len(handled) < EVENTS:
            try:
                msgs = await sub.fetch(50, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError, nats.errors.ConnectionClosedError):
                continue  # nothing yet, or the server it talked to just died
            except nats.js.errors.APIError:
                await asyncio.sleep(0.1)  # no leader for a moment: ask again
                continue
            for msg in msgs:
                env = decode(msg.data)
                if msg.metadata.num_delivered == 1:
                    first_deliveries[env.id] += 1
                if env.id not in handled:
                    handled[env.id] += 1
                await msg.ack_sync()

    info = await js.stream_info(STREAM)
    assert info.cluster is not None and info.cluster.leader
    victim = dsec_cluster.member_of(info.cluster.leader)
    producer, consumer = asyncio.create_task(produce()), asyncio.create_task(consume())
    try:
        while len(acked) < EVENTS // 3 and not producer.done():
            await asyncio.sleep(0.01)
        await asyncio.to_thread(dsec_cluster.kill_nats, victim)  # SIGKILL the stream leader
        killed_at = len(acked)
        await asyncio.sleep(1.0)  # the flow goes on against the two others
        await asyncio.to_thread(dsec_cluster.start_nats, victim)
        await asyncio.wait_for(producer, 60)
        done, _ = await asyncio.wait([consumer], timeout=30)
        if not done:
            ci = await js.consumer_info(STREAM, durable)
            raise AssertionError(f"consumed {len(handled)} of {len(acked)}; consumer: {ci}")
    finally:
        for task in (producer, consumer):
            task.cancel()
    assert killed_at < EVENTS and len(acked) == EVENTS

    stored: Counter[str] = Counter()
    verify = await sub_js.pull_subscribe(subject, stream=STREAM)  # ephemeral: a full re-read
    while sum(stored.values()) < EVENTS:
        try:
            msgs = await verify.fetch(100, timeout=2.0)
        except (TimeoutError, nats.errors.TimeoutError):
            break
        for msg in msgs:
            stored[decode(msg.data).id] += 1
            await msg.ack()
    assert set(stored) == set(acked) and max(stored.values()) == 1  # each stored exactly once
    assert set(handled) == set(acked) and max(handled.values()) == 1
    assert max(first_deliveries.values()) == 1  # never two first deliveries of one event
    await _healthy_r3(js, STREAM, time.monotonic() + 30)
    consumer_info = await sub_js.consumer_info(STREAM, durable)
    assert consumer_info.num_ack_pending == 0 and consumer_info.num_pending == 0
    await pub_nc.close()
    await sub_nc.close()
