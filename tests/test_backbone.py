"""The JetStream backbone: stream guarantees, deduplication, the service runtime's retry and
idempotency contract — against a real NATS server."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from dsec_core import identity
from dsec_core.bus import EventPublisher, ensure_stream, replay
from dsec_core.envelope import decode
from dsec_core.events import SpecRejected, SpecSubmitted, SpecValidated
from dsec_core.ids import derive_event_id, output_event_id
from dsec_core.service import RetryPolicy, Service, sandbox_failed
from dsec_core.settings import Settings
from dsec_core.signing import Signer
from dsec_core.subjects import STREAM, aggregate_filter, subject_for
from dsec_testing import trust
from dsec_testing.plans import minimal_plan
from nacl.signing import SigningKey
from nats.js import JetStreamContext
from nats.js.errors import APIError
from prometheus_client import REGISTRY

pytestmark = pytest.mark.integration


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_stream(js)
    yield js
    await nc.close()


@pytest.fixture
async def publisher(js: JetStreamContext, make_publisher) -> EventPublisher:
    return await make_publisher(js)


async def _events_of(js: JetStreamContext, sandbox: str) -> list[tuple[int, str, dict]]:
    out = []
    async for seq, data in replay(js, filter_subject=aggregate_filter("sandbox", sandbox)):
        env = decode(data)
        out.append((seq, env.type, env.payload))
    return out


async def _wait_for(js: JetStreamContext, sandbox: str, predicate, timeout: float = 20.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        events = await _events_of(js, sandbox)
        if predicate(events):
            return events
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out; events so far: {[e[1] for e in events]}")
        await asyncio.sleep(0.05)


async def test_stream_refuses_purge_and_message_delete(
    publisher: EventPublisher, js: JetStreamContext
) -> None:
    published = await publisher.publish(SpecSubmitted(spec_yaml="x"), aggregate_id="sbx_p")
    info = await js.stream_info(STREAM)
    assert info.config.deny_delete and info.config.deny_purge
    with pytest.raises(APIError):
        await js.purge_stream(STREAM)
    with pytest.raises(APIError):
        await js.delete_msg(STREAM, published.stream_seq)
    assert (await js.get_msg(STREAM, published.stream_seq)).data


async def test_same_event_id_is_stored_once(
    publisher: EventPublisher, js: JetStreamContext
) -> None:
    sealed = publisher.signer.seal(SpecSubmitted(spec_yaml="x"), aggregate_id="sbx_dup")
    first = await publisher.publish_sealed(sealed)
    again = await publisher.publish_sealed(sealed)
    assert not first.duplicate
    assert again.duplicate and again.stream_seq == first.stream_seq
    assert len(await _events_of(js, "sbx_dup")) == 1


async def _settled(js: JetStreamContext, service: Service) -> None:
    """Wait until the service's consumer has nothing pending or unacknowledged."""
    durable = f"{service.name}-spec-submitted"
    for _ in range(400):
        info = await js.consumer_info(STREAM, durable)
        if info.num_ack_pending == 0 and info.num_pending == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"consumer {durable} never settled: {info}")


def _service(nats_url: str, home: Path, stack_home: Path, name: str | None = None) -> Service:
    """An in-process service acting as the policy service would: its key certified by the test
    stack's root, its own durable consumers (a fresh name unless ``name``)."""
    root = trust.stack_root(stack_home)
    name = name or f"t{uuid.uuid4().hex[:8]}"
    identity.ensure_service_identity(identity.TrustPaths(home), root, "policy", name=name)
    anchor = bytes(root.verify_key).hex()
    return Service(name, Settings(nats_url=nats_url, home=home, trust_root=anchor))


async def test_failing_handler_is_retried_then_ends_in_one_failure_event(
    publisher: EventPublisher, js: JetStreamContext, nats_url: str, tmp_path: Path, dsec_stack
) -> None:
    service = _service(nats_url, tmp_path, dsec_stack.home)
    attempts: list[str] = []

    @service.handles(SpecSubmitted, retry=RetryPolicy(max_attempts=3, base_delay_s=0.05))
    async def always_fails(envelope, payload):  # type: ignore[no-untyped-def]
        if envelope.aggregate_id == sandbox:
            attempts.append(envelope.id)
        raise RuntimeError("resolver exploded")

    sandbox = f"sbx_{uuid.uuid4().hex[:10]}"
    await service.start()
    try:
        await publisher.publish(SpecSubmitted(spec_yaml="x"), aggregate_id=sandbox)
        await _wait_for(js, sandbox, lambda ev: any(t == "sandbox.failed" for _, t, _ in ev))
        await _settled(js, service)
        events = await _events_of(js, sandbox)
    finally:
        await service.stop()
    failures = [p for _, t, p in events if t == "sandbox.failed"]
    assert len(failures) == 1
    assert failures[0]["stage"] == service.name
    assert failures[0]["attempts"] == 3
    assert "RuntimeError: resolver exploded" in failures[0]["reason"]
    assert len(attempts) == 3


async def test_what_a_stopping_service_ran_or_fetched_and_never_ended_is_handled_in_seconds(
    publisher: EventPublisher,
    js: JetStreamContext,
    nats_url: str,
    tmp_path: Path,
    dsec_stack,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When the service stops, its handler still runs past the stop grace (``busy``), and the
    consumer's pull subscription holds a delivery nobody took from its queue (``waiting``: put
    there by a pull request of the test's own on the same inbox). Both are given back: the
    next instance answers each within seconds, once. Before, each waited out the consumer's
    ack_wait (60 s here) unanswered."""
    import dsec_core.service as runtime

    monkeypatch.setattr(runtime, "STOP_GRACE_S", 0.5)
    name = f"t{uuid.uuid4().hex[:8]}"
    retry = RetryPolicy(max_attempts=3, base_delay_s=0.05, ack_wait_s=60.0)
    busy, waiting = f"sbx_{uuid.uuid4().hex[:10]}", f"sbx_{uuid.uuid4().hex[:10]}"
    first = _service(nats_url, tmp_path, dsec_stack.home, name)
    started = asyncio.Event()

    @first.handles(SpecSubmitted, retry=retry)
    async def hangs(envelope, payload):  # type: ignore[no-untyped-def]
        if envelope.aggregate_id in (busy, waiting):
            started.set()
            await asyncio.Event().wait()
        return []

    await first.start()
    try:
        await publisher.publish(SpecSubmitted(spec_yaml="x"), aggregate_id=busy)
        await asyncio.wait_for(started.wait(), 20)  # FastStream waits for it: no fetch now
        await publisher.publish(SpecSubmitted(spec_yaml="x"), aggregate_id=waiting)
        (sub,) = first.broker.subscribers
        pull = sub.subscription  # type: ignore[attr-defined]
        await js._nc.publish(pull._nms, b'{"batch": 1}', reply=pull._deliver)
        for _ in range(400):  # received by the subscription, not taken by FastStream
            if pull._sub._pending_queue.qsize():
                break
            await asyncio.sleep(0.02)
        assert pull._sub._pending_queue.qsize() == 1
    finally:
        await first.stop()
    second = _service(nats_url, tmp_path, dsec_stack.home, name)

    @second.handles(SpecSubmitted, retry=retry)
    async def answers(envelope, payload):  # type: ignore[no-untyped-def]
        # (spec.validated: the stack's own policy service answers these specs with
        # spec.rejected, whose derived id would be the same as this answer's)
        if envelope.aggregate_id not in (busy, waiting):
            return []
        return [SpecValidated(name="n", spec_digest="d", plan=minimal_plan())]

    await second.start()
    try:  # within 20 s each: a third of the ack_wait they waited out before
        for sandbox in (busy, waiting):
            events = await _wait_for(
                js, sandbox, lambda ev: "spec.validated" in {t for _, t, _ in ev}
            )
            assert [t for _, t, _ in events].count("spec.validated") == 1
    finally:
        await second.stop()


async def test_a_services_consumer_lag_is_exported_per_durable(
    publisher: EventPublisher, js: JetStreamContext, nats_url: str, tmp_path: Path, dsec_stack
) -> None:
    """``dsec_consumer_pending`` / ``dsec_consumer_ack_pending`` follow JetStream's own counts of
    the service's durable: a handler that does not finish holds its message unacknowledged,
    events behind it wait; once it finishes both read 0."""
    service = _service(nats_url, tmp_path, dsec_stack.home)
    release = asyncio.Event()
    sandbox = f"sbx_{uuid.uuid4().hex[:10]}"

    @service.handles(SpecSubmitted, batch=1)
    async def slow(envelope, payload):  # type: ignore[no-untyped-def]
        if envelope.aggregate_id == sandbox:
            await release.wait()
        return []

    durable = f"{service.name}-spec-submitted"
    labels = {"service": service.name, "durable": durable}

    def exported() -> tuple[float | None, float | None]:
        return (
            REGISTRY.get_sample_value("dsec_consumer_pending", labels),
            REGISTRY.get_sample_value("dsec_consumer_ack_pending", labels),
        )

    async def until(predicate, what: str) -> None:  # type: ignore[no-untyped-def]
        deadline = asyncio.get_running_loop().time() + 20
        while True:
            await service.export_consumers(js)
            if predicate(*exported()):
                return
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(f"{what}: exported {exported()}")
            await asyncio.sleep(0.05)

    await service.start()
    try:
        await publisher.publish(SpecSubmitted(spec_yaml="x"), aggregate_id=sandbox)
        for _ in range(3):
            await publisher.publish(SpecSubmitted(spec_yaml="x"), aggregate_id=f"{sandbox}_n")
        await until(lambda pending, acks: acks == 1 and pending == 3, "one held, three behind")
        release.set()
        await until(lambda pending, acks: acks == 0 and pending == 0, "all handled")
    finally:
        release.set()
        await service.stop()


async def test_redelivery_after_a_crash_between_publish_and_ack_publishes_nothing_new(
    publisher: EventPublisher, js: JetStreamContext, nats_url: str, tmp_path: Path, dsec_stack
) -> None:
    service = _service(nats_url, tmp_path, dsec_stack.home)
    calls = 0

    @service.handles(SpecSubmitted, retry=RetryPolicy(max_attempts=5, base_delay_s=0.05))
    async def validate(envelope, payload):  # type: ignore[no-untyped-def]
        nonlocal calls
        if envelope.aggregate_id != sandbox:
            return []
        calls += 1
        assert service.publisher is not None
        output = SpecValidated(name="a", spec_digest="d", plan=minimal_plan())
        if calls == 1:  # the output reached the log, then the process "died" before acking
            await service._publish_outputs(envelope, [output])
            raise ConnectionError("lost before ack")
        return [output]

    sandbox = f"sbx_{uuid.uuid4().hex[:10]}"
    await service.start()
    try:
        await publisher.publish(SpecSubmitted(spec_yaml="x"), aggregate_id=sandbox)
        await _wait_for(js, sandbox, lambda ev: calls >= 2)
        await _settled(js, service)
        events = await _events_of(js, sandbox)
    finally:
        await service.stop()
    assert [t for _, t, _ in events] == ["spec.submitted", "spec.validated"]


async def test_a_spare_delivery_ends_only_a_request_no_attempt_answered(
    publisher: EventPublisher, js: JetStreamContext, nats_url: str, tmp_path: Path, dsec_stack
) -> None:
    """Once retries run out, the spare delivery publishes the failure, unless an attempt's
    answer reached the log before its process died (the ack did not): one request, one
    answer. Neither a forged answer (the service's name, a key nobody certified) nor a copy of
    a genuine one the service gave on another aggregate counts."""
    service = _service(nats_url, tmp_path, dsec_stack.home)
    answers = (SpecValidated, SpecRejected)

    @service.handles(SpecSubmitted, answers=answers)
    async def ignore(envelope, payload):  # type: ignore[no-untyped-def]
        return []

    answered, forged_for, copied_for, elsewhere, labelled = (
        f"sbx_{uuid.uuid4().hex[:10]}" for _ in range(5)
    )
    await service.start()
    try:
        asked = {
            sid: await publisher.publish(SpecSubmitted(spec_yaml="x"), aggregate_id=sid)
            for sid in (answered, forged_for, copied_for, labelled)
        }
        output = SpecValidated(name="a", spec_digest="d", plan=minimal_plan())
        await service._publish_outputs(asked[answered].envelope, [output])  # then it "died"
        wanted = output_event_id(
            asked[forged_for].envelope.id,
            SpecValidated.TYPE,
            0,
            input_type=SpecSubmitted.TYPE,
            key_id=asked[forged_for].envelope.key_id,
        )
        forger = Signer(service.name, SigningKey.generate())
        forged = forger.seal(output, aggregate_id=forged_for, event_id=wanted)
        await js.publish(forged.envelope.subject, forged.wire)
        assert service.publisher is not None  # a genuine answer to it, on another aggregate
        wanted = output_event_id(
            asked[copied_for].envelope.id,
            SpecValidated.TYPE,
            0,
            input_type=SpecSubmitted.TYPE,
            key_id=asked[copied_for].envelope.key_id,
        )
        genuine = await service.publisher.publish(output, aggregate_id=elsewhere, event_id=wanted)
        await js.publish(subject_for(SpecValidated.TYPE, copied_for), genuine.sealed.wire)
        # an answer the handler publishes itself, under an id of its own label
        cause = asked[labelled].envelope
        own = derive_event_id(cause.id, "placement")
        await service.publisher.publish(
            output, aggregate_id=labelled, event_id=own, causation=cause
        )
        failure = sandbox_failed(service.name)
        declared = (*answers, (SpecValidated, "placement"))
        for asking in asked.values():
            await service._end_unfinished(asking.envelope, asking.stream_seq, 5, failure, declared)
        seen = {sid: [t for _, t, _ in await _events_of(js, sid)] for sid in asked}
    finally:
        await service.stop()
    assert seen[answered] == seen[labelled] == ["spec.submitted", "spec.validated"]
    for sid in (forged_for, copied_for):  # (the forgery and the copy are in the log)
        assert seen[sid] == ["spec.submitted", "spec.validated", "sandbox.failed"]


async def test_no_one_can_take_a_derived_ids_place_in_the_duplicate_window(
    publisher: EventPublisher, js: JetStreamContext
) -> None:
    """Derived ids are predictable (a hash of a public request id); JetStream's duplicate
    window is stream-wide. A message published first under the bare id (anyone allowed to
    publish anywhere in the stream may) does not make the genuine envelope a "duplicate": it
    goes in under an id only its key can compute, and publishing it again (a handler's
    redelivery) still stores it once."""
    sandbox = f"sbx_{uuid.uuid4().hex[:10]}"
    request = await publisher.publish(SpecSubmitted(spec_yaml="x"), aggregate_id=sandbox)
    wanted = output_event_id(
        request.envelope.id,
        SpecRejected.TYPE,
        0,
        input_type=request.envelope.type,
        key_id=request.envelope.key_id,
    )
    junk_subject = subject_for(SpecSubmitted.TYPE, f"sbx_{uuid.uuid4().hex[:10]}")
    await js.publish(junk_subject, b"junk", headers={"Nats-Msg-Id": wanted})
    answer = SpecRejected(errors=[])
    first = await publisher.publish(answer, aggregate_id=sandbox, event_id=wanted)
    assert not first.duplicate
    assert (await js.get_msg(STREAM, first.stream_seq)).data == first.sealed.wire
    again = await publisher.publish(answer, aggregate_id=sandbox, event_id=wanted)
    assert again.duplicate and again.stream_seq == first.stream_seq
    stored = [t for _, t, _ in await _events_of(js, sandbox)]
    assert stored == ["spec.submitted", "spec.rejected"]


async def test_events_are_ordered_per_aggregate_and_carry_causation(
    publisher: EventPublisher, js: JetStreamContext, nats_url: str, tmp_path: Path, dsec_stack
) -> None:
    service = _service(nats_url, tmp_path, dsec_stack.home)

    @service.handles(SpecSubmitted)
    async def validate(envelope, payload):  # type: ignore[no-untyped-def]
        # Only its own: a fresh durable reads the whole shared log, and validating another
        # test's spec again (minutes later, past the dedup window) is a replay audit flags.
        if envelope.aggregate_id != sandbox:
            return []
        return [SpecValidated(name="n", spec_digest="d", plan=minimal_plan())]

    sandbox = f"sbx_{uuid.uuid4().hex[:10]}"
    await service.start()
    try:
        sub = await publisher.publish(SpecSubmitted(spec_yaml="x"), aggregate_id=sandbox)
        await _wait_for(js, sandbox, lambda ev: len(ev) == 2)
        raw = [
            decode(d)
            async for _, d in replay(js, filter_subject=aggregate_filter("sandbox", sandbox))
        ]
    finally:
        await service.stop()
    assert raw[1].causation_id == sub.envelope.id
    assert raw[1].correlation_id == sub.envelope.correlation_id
    assert raw[1].producer == service.name


_MAJOR, _MINOR = SpecSubmitted.VERSION.split(".")


class _SpecSubmittedNewer(SpecSubmitted):  # what a newer producer would publish: next minor
    VERSION = f"{_MAJOR}.{int(_MINOR) + 1}"
    priority: str = "high"


async def test_consumer_decodes_a_newer_minor_version_from_the_bus(
    publisher: EventPublisher, js: JetStreamContext, nats_url: str, tmp_path: Path, dsec_stack
) -> None:
    service = _service(nats_url, tmp_path, dsec_stack.home)
    seen: list[SpecSubmitted] = []

    @service.handles(SpecSubmitted)
    async def validate(envelope, payload):  # type: ignore[no-untyped-def]
        if envelope.aggregate_id == sandbox:
            seen.append(payload)
            return [SpecValidated(name="n", spec_digest="d", plan=minimal_plan())]
        return []

    sandbox = f"sbx_{uuid.uuid4().hex[:10]}"
    await service.start()
    try:
        await publisher.publish(_SpecSubmittedNewer(spec_yaml="x"), aggregate_id=sandbox)
        events = await _wait_for(js, sandbox, lambda ev: len(ev) == 2)
    finally:
        await service.stop()
    assert events[0][2]["priority"] == "high"
    assert seen == [SpecSubmitted(spec_yaml="x")]
    assert events[1][1] == "spec.validated"


async def test_an_event_over_max_payload_is_refused_and_the_chain_continues(
    publisher: EventPublisher, js: JetStreamContext
) -> None:
    from dsec_core.bus import EventTooLarge

    before = await publisher.publish(SpecSubmitted(spec_yaml="small"), aggregate_id="sbx_big")
    with pytest.raises(EventTooLarge) as info:
        await publisher.publish(SpecSubmitted(spec_yaml="x" * (2 << 20)), aggregate_id="sbx_big")
    assert info.value.limit == 1 << 20 and info.value.size > 2 << 20
    assert str(info.value).startswith("spec.submitted is ")
    after = await publisher.publish(SpecSubmitted(spec_yaml="next"), aggregate_id="sbx_big")
    # the refused envelope never took a chain position: the next one links to the one before
    assert after.envelope.chain_seq == before.envelope.chain_seq + 1
    assert [e[2]["spec_yaml"] for e in await _events_of(js, "sbx_big")] == ["small", "next"]


async def test_replay_reads_every_message_in_order_across_pull_batches(
    js: JetStreamContext, publisher: EventPublisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fast replay (pipelined pull requests into a callback) yields what the slow path
    (nats-py fetch, :func:`follow`) yields: each message once, in stream order, filtered, from
    a start position, across many pull batches."""
    from dsec_core import bus

    follow = bus.follow
    monkeypatch.setattr(bus, "PULL_BATCH", 7)
    seqs = []
    for i in range(30):
        sandbox = f"sbx_{uuid.uuid4().hex[:12]}"
        published = await publisher.publish(SpecSubmitted(spec_yaml=f"v{i}"), aggregate_id=sandbox)
        seqs.append(published.stream_seq)
    filt = "dsec.sandbox.*.spec.submitted"
    start = seqs[0]

    async def slow() -> list[tuple[int, bytes]]:
        last = (await js.stream_info(STREAM)).state.last_seq
        out: list[tuple[int, bytes]] = []
        async for msgs in bus.follow(js, filter_subject=filt, start_seq=start):
            out += [m for m in msgs if m[0] <= last]
            if not msgs or (out and out[-1][0] >= last):
                return out
        return out

    fast = [item async for item in replay(js, filter_subject=filt, start_seq=start)]
    assert [s for s, _ in fast if s in seqs] == seqs
    assert [s for s, _ in fast] == sorted({s for s, _ in fast})  # in order, each once
    assert fast == (await slow())[: len(fast)]
    middle = [item async for item in replay(js, filter_subject=filt, start_seq=seqs[10])]
    expected = [m for m in fast if m[0] >= seqs[10]]
    assert middle[: len(expected)] == expected
    # The whole stream from there: read by the fast path alone (the slow one never called).
    slow_calls = []
    monkeypatch.setattr(bus, "follow", lambda *a, **k: slow_calls.append(k) or follow(*a, **k))
    everything = [item async for item in replay(js, start_seq=start)]
    assert [s for s, _ in everything] == list(range(start, everything[-1][0] + 1))
    assert everything[-1][0] >= seqs[-1] and not slow_calls


def test_the_stream_sequence_is_read_from_both_ack_subject_layouts() -> None:
    from dsec_core.bus import _ack_stream_seq

    assert _ack_stream_seq("$JS.ACK.DSEC_EVENTS.c1.1.42.7.1700000000000000000.3") == 42
    v2 = "$JS.ACK.hub.ACCHASH.DSEC_EVENTS.c1.1.43.7.1700000000000000000.3.rnd"
    assert _ack_stream_seq(v2) == 43
    with pytest.raises(ValueError, match="not a JetStream ack subject"):
        _ack_stream_seq("_INBOX.abc.def")


async def test_a_pipelined_batch_lands_in_order_once_with_its_acks(
    js: JetStreamContext, publisher: EventPublisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """publish_many's asynchronous publish: each envelope stored once, in batch order, at the
    position its ack names; the same batch again is deduplicated by id (same positions)."""
    sandbox = f"sbx_{uuid.uuid4().hex[:12]}"
    batch = [
        publisher.signer.seal(SpecSubmitted(spec_yaml=f"v{i}"), aggregate_id=f"{sandbox}{i}")
        for i in range(40)
    ]
    slow = []
    monkeypatch.setattr(publisher, "publish_sealed", lambda s: slow.append(s))  # not expected
    published = await publisher.publish_many(batch, window=8)
    assert not slow  # every ack came back on the pipelined path
    seqs = [p.stream_seq for p in published]
    assert seqs == sorted(seqs) and len(set(seqs)) == 40 and not any(p.duplicate for p in published)
    for p in published[::13]:
        assert (await js.get_msg(STREAM, p.stream_seq)).data == p.sealed.wire
    again = await publisher.publish_many(batch)
    assert [p.stream_seq for p in again] == seqs and all(p.duplicate for p in again)


async def test_a_reader_whose_consumer_vanished_reads_on_from_a_new_one(
    js: JetStreamContext, publisher: EventPublisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reader's consumer lives in memory: a NATS restart drops it (the fetch in flight then
    times out), and the server deletes one whose process stalled past its inactive threshold.
    ``follow`` (the projector's and the scheduler's reader) reads on from where it was on a new
    one, missing and repeating nothing, instead of dying on "consumer not found" (the read
    models then stopped moving and the service's shutdown hung)."""
    from dsec_core import bus

    real_fetch = JetStreamContext.PullSubscription.fetch
    restart = {"pending": False}

    async def fetch(self: JetStreamContext.PullSubscription, *args: Any, **kwargs: Any) -> Any:
        if restart["pending"]:  # the fetch that was in flight when NATS went away
            restart["pending"] = False
            raise nats.errors.TimeoutError
        return await real_fetch(self, *args, **kwargs)

    monkeypatch.setattr(JetStreamContext.PullSubscription, "fetch", fetch)
    sandbox = f"sbx_{uuid.uuid4().hex[:12]}"
    filt = aggregate_filter("sandbox", sandbox)
    published = [await publisher.publish(SpecSubmitted(spec_yaml="a"), aggregate_id=sandbox)]
    seen: list[int] = []
    reader = bus.follow(js, filter_subject=filt, start_seq=published[0].stream_seq, idle_s=0.2)
    try:
        async with asyncio.timeout(60):
            while not seen:
                seen += [seq for seq, _ in await anext(reader)]
            mine = [
                info.name
                for info in await js.consumers_info(STREAM)
                if info.config.filter_subject == filt
            ]
            assert len(mine) == 1, mine
            await js.delete_consumer(STREAM, mine[0])
            restart["pending"] = True
            for text in ("b", "c"):
                published.append(
                    await publisher.publish(SpecSubmitted(spec_yaml=text), aggregate_id=sandbox)
                )
            while len(seen) < 3:
                seen += [seq for seq, _ in await anext(reader)]
    finally:
        await reader.aclose()
    assert not restart["pending"]
    assert seen == [p.stream_seq for p in published]


async def test_a_reader_that_lost_messages_on_the_way_reads_them_again(
    js: JetStreamContext, publisher: EventPublisher, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Messages a consumer delivered can be lost with a connection (a reconnect, or the server
    dropping a reader it finds slow): with no acks the consumer counts them delivered. A hole
    in the consumer sequence, or the consumer having delivered more than arrived when the
    reader goes idle, makes ``follow`` read on anew from the last message it got, so nothing
    is skipped and "caught up" is never said over lost messages."""
    from dsec_core import bus

    sandbox = f"sbx_{uuid.uuid4().hex[:12]}"
    filt = aggregate_filter("sandbox", sandbox)
    published = [
        await publisher.publish(SpecSubmitted(spec_yaml=str(i)), aggregate_id=sandbox)
        for i in range(5)
    ]
    lose = {published[1].stream_seq, published[4].stream_seq}  # one inside, the last one
    real_fetch = JetStreamContext.PullSubscription.fetch

    async def fetch(self: JetStreamContext.PullSubscription, *args: Any, **kwargs: Any) -> Any:
        msgs = await real_fetch(self, *args, **kwargs)
        kept = [m for m in msgs if bus.stream_seq(m) not in lose]
        lose.difference_update(bus.stream_seq(m) for m in msgs)  # lost once, then delivered
        return kept

    monkeypatch.setattr(JetStreamContext.PullSubscription, "fetch", fetch)
    seen: list[int] = []
    reader = bus.follow(js, filter_subject=filt, start_seq=published[0].stream_seq, idle_s=0.2)
    try:
        async with asyncio.timeout(60):
            while True:
                batch = await anext(reader)
                if not batch:
                    break  # caught up: only once the lost ones were read again
                seen += [seq for seq, _ in batch]
    finally:
        await reader.aclose()
    assert seen == [p.stream_seq for p in published]


async def test_a_replay_of_large_messages_asks_within_a_byte_budget(
    js: JetStreamContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Large messages (anyone who may publish can add them) must not make the server queue
    more than its per-client limit behind a reader, which drops the connection and loses
    messages: each pull request of a replay asks for a bounded number of bytes, and a request
    its budget ended early is followed by the next, on the fast path, nothing handed over."""
    from dsec_core import bus

    monkeypatch.setattr(bus, "PULL_MAX_BYTES", 1)  # the floor: twice the server's max_payload
    subject = f"dsec.sandbox.sbx_{uuid.uuid4().hex[:12]}.junk"
    sizes = js._nc.max_payload // 3  # 12 of them: 4 max_payloads, over two budgets
    seqs = [(await js.publish(subject, bytes([i]) * sizes)).seq for i in range(12)]
    calls: list[Any] = []
    follow = bus.follow
    monkeypatch.setattr(bus, "follow", lambda *a, **k: calls.append(k) or follow(*a, **k))
    got = [item async for item in bus.replay(js, filter_subject=subject, start_seq=seqs[0])]
    assert [seq for seq, _ in got] == seqs
    assert [data for _, data in got] == [bytes([i]) * sizes for i in range(12)]
    assert calls == []  # over several byte budgets, all on the fast path


async def test_a_live_reader_of_large_messages_asks_for_fewer_at_a_time(
    js: JetStreamContext, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``follow`` (every service's read model and the projector) cannot give nats-py's fetch a
    byte budget, so it sizes its fetches by the largest message it read lately: what it may
    make the server queue behind it stays near the budget instead of 512 large events."""
    from dsec_core import bus

    monkeypatch.setattr(bus, "PULL_MAX_BYTES", 1)  # the floor: twice the server's max_payload
    size = js._nc.max_payload // 3
    subject = f"dsec.sandbox.sbx_{uuid.uuid4().hex[:12]}.junk"
    asked: list[int] = []
    real_fetch = JetStreamContext.PullSubscription.fetch

    async def fetch(self: JetStreamContext.PullSubscription, n: int, **kwargs: Any) -> Any:
        asked.append(n)
        return await real_fetch(self, n, **kwargs)

    monkeypatch.setattr(JetStreamContext.PullSubscription, "fetch", fetch)
    seqs = [(await js.publish(subject, bytes([i]) * size)).seq for i in range(2)]
    got: list[tuple[int, bytes]] = []
    reader = bus.follow(js, filter_subject=subject, start_seq=seqs[0], batch=64, idle_s=0.2)
    try:
        async with asyncio.timeout(60):
            while len(got) < 2:
                got += await anext(reader)
            assert asked[0] == 64  # nothing seen yet: the whole batch
            first = len(asked)
            seqs += [(await js.publish(subject, bytes([i]) * size)).seq for i in range(2, 20)]
            while len(got) < len(seqs):
                got += await anext(reader)
    finally:
        await reader.aclose()
    assert [seq for seq, _ in got] == seqs
    assert [data for _, data in got] == [bytes([i]) * size for i in range(20)]
    assert max(asked[first:]) == (2 * js._nc.max_payload) // size  # 6, not 64
