"""A handler registered with ``workers``, in memory behind the real trust gate: what it holds
is handled once, its attempts are its starts, and a handler's own cancellation is a failed
attempt, not the end of a worker (``dsec_core.service``, ``dsec_core.fairness``)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from dsec_core.envelope import Envelope
from dsec_core.events import SpecRejected, SpecSubmitted, SpecValidated
from dsec_core.service import Service
from dsec_core.settings import Settings
from dsec_testing.inmemory import MemoryBus, in_memory
from faststream.nats.annotations import NatsMessage

pytestmark = pytest.mark.unit


async def _until(check: Callable[[], object], timeout: float = 10.0) -> None:
    """Let the loop run until ``check()`` holds (each verification is a few awaits), at most
    ``timeout`` seconds; what is asserted next says what it waited for."""
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        await asyncio.sleep(0.001)


def _service(tmp_path: Path, **settings: object) -> Service:
    return Service("policy", Settings(home=tmp_path, **settings))  # type: ignore[arg-type]


def _gated(
    tmp_path: Path, workers: int = 1, **settings: object
) -> tuple[Service, asyncio.Event, list[str]]:
    """A service whose handler records each spec and waits for the gate."""
    service = _service(tmp_path, **settings)
    gate = asyncio.Event()
    runs: list[str] = []

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        runs.append(event.spec_yaml)
        await gate.wait()
        return [SpecRejected(errors=[])]

    service.handles(SpecSubmitted, answers=(SpecValidated, SpecRejected), workers=workers)(
        on_submitted
    )
    return service, gate, runs


async def _publish(bus: MemoryBus, n: int, tenant: str = "acme") -> Envelope:
    pub = await bus.producer("user", tenant=tenant)
    sent = await pub.publish(SpecSubmitted(spec_yaml=f"r{n}"), aggregate_id=f"sbx_r{n}")
    await bus.broker.publish(sent.sealed.wire, sent.sealed.subject, stream="DSEC_EVENTS")
    return sent.sealed.envelope


def _ends(bus: MemoryBus, request: Envelope) -> list[str]:
    return [e.type for e in bus.caused_by(request)]


async def test_a_request_delivered_again_while_held_is_held_once_and_ends_once(
    tmp_path: Path,
) -> None:
    """JetStream delivers a held request again (its heartbeat came late): with its tenant at
    its bound, the copy is neither refused nor held a second time; the request ends once."""
    service, gate, runs = _gated(tmp_path, tenant_queue=2)
    async with in_memory(service) as bus:
        (fair,) = service._fair
        first, second = await _publish(bus, 0), await _publish(bus, 1)  # r0 runs, r1 waits
        while not runs:
            await asyncio.sleep(0)
        delivery = service.delivery
        service.delivery = lambda msg: (2, delivery(msg)[1])  # r1 delivered again
        wire = next(d for _, s, d in bus.log.records if s == second.subject and d)
        await bus.broker.publish(wire, second.subject, stream="DSEC_EVENTS")
        service.delivery = delivery
        assert fair.queue.held == 2  # not 3
        gate.set()
        await service.settled()
        assert _ends(bus, first) == ["spec.rejected"]
        assert _ends(bus, second) == ["spec.rejected"]
        assert runs == ["r0", "r1"]


async def test_deliveries_spent_waiting_are_not_attempts(tmp_path: Path) -> None:
    """A request given back while it waited its turn (its instance stopped, five times) comes
    with JetStream's delivery count past the handler's attempts: it was never started, so it
    runs, and ends in its answer, not in 'no attempt completed'."""
    service = _service(tmp_path)

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        return [SpecRejected(errors=[])]

    service.handles(SpecSubmitted, answers=(SpecValidated, SpecRejected), workers=2)(on_submitted)
    async with in_memory(service) as bus:
        delivery = service.delivery
        service.delivery = lambda msg: (6, delivery(msg)[1])  # max_attempts is 5
        request = await _publish(bus, 0)
        await service.settled()
        assert _ends(bus, request) == ["spec.rejected"]


async def test_a_handler_that_raises_cancelled_fails_its_attempts_and_no_worker_ends(
    tmp_path: Path,
) -> None:
    service = _service(tmp_path)

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        if event.spec_yaml.startswith("boom"):
            raise asyncio.CancelledError  # e.g. a library's cancel scope leaking out
        return [SpecRejected(errors=[])]

    service.handles(SpecSubmitted, answers=(SpecValidated, SpecRejected), workers=2)(on_submitted)
    async with in_memory(service) as bus:
        (fair,) = service._fair
        for n in range(3):
            await bus.send("user", SpecSubmitted(spec_yaml=f"boom {n}"), f"sbx_b{n}", tenant="evil")
        assert all(not task.done() for task in fair.tasks)
        assert not [p for p in service.problems() if "worker" in p]
        victim = await asyncio.wait_for(  # (a dead worker held it for good)
            bus.send("user", SpecSubmitted(spec_yaml="ok"), "sbx_v", tenant="victim"), 10
        )
        assert _ends(bus, victim) == ["spec.rejected"]


async def test_an_event_id_that_is_not_a_uuid_is_refused_so_it_cannot_reach_anothers_keys(
    tmp_path: Path,
) -> None:
    """Users read the whole stream: an attacker who sees request V publishes its own valid
    spec with the id ``V.starts``, the key where V's attempts are counted. Refused as
    malformed; V is validated when its turn comes."""
    service = _service(tmp_path)

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        return [SpecRejected(errors=[])]

    service.handles(SpecSubmitted, answers=(SpecValidated, SpecRejected), workers=2)(on_submitted)
    async with in_memory(service) as bus:
        victim = await bus.send(
            "user", SpecSubmitted(spec_yaml="v"), "sbx_v", tenant="victim", deliver=False
        )
        evil = await bus.producer("user", tenant="evil")
        forged = await evil.publish(
            SpecSubmitted(spec_yaml="e"), aggregate_id="sbx_e", event_id=f"{victim.id}.starts"
        )
        await bus.deliver(forged.sealed.wire, forged.sealed.subject)
        (refusal,) = bus.rejections()
        assert refusal.payload["reason"] == "malformed", refusal.payload
        assert "is not a UUID" in refusal.payload["detail"]
        wire = next(d for _, s, d in bus.log.records if s == victim.subject)
        await bus.deliver(wire, victim.subject)
        assert _ends(bus, victim) == ["spec.rejected"]


async def test_two_instances_starting_one_request_count_two_attempts(tmp_path: Path) -> None:
    """The start counter is compared and set (a lost update would give two starts one
    number, and a request more attempts than its handler allows)."""
    service = _service(tmp_path)

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        return [SpecRejected(errors=[])]

    service.handles(SpecSubmitted, answers=(SpecValidated, SpecRejected), workers=1)(on_submitted)
    async with in_memory(service) as bus:
        assert service.gate is not None and service.gate.handled is not None
        kv = service.gate.handled
        get, update = kv.get, kv.update

        async def slow_get(key: str) -> object:  # a network round trip each
            await asyncio.sleep(0.01)
            return await get(key)

        async def slow_update(key: str, value: bytes, last: int | None = None) -> int:
            await asyncio.sleep(0.01)
            return await update(key, value, last=last)

        kv.get, kv.update = slow_get, slow_update
        request = await bus.send("user", SpecSubmitted(spec_yaml="r"), "sbx_r", deliver=False)
        (fair,) = service._fair
        msg = type("Msg", (), {"raw_message": None})()
        service.delivery = lambda m: (2, 1)
        held = type("Held", (), {"msg": msg, "envelope": request})()
        counts = [await service._attempt(fair.handling, held)]  # type: ignore[arg-type]
        counts += await asyncio.gather(
            service._attempt(fair.handling, held),  # type: ignore[arg-type]
            service._attempt(fair.handling, held),  # type: ignore[arg-type]
        )
        assert sorted(counts) == [1, 2, 3]


async def test_a_service_started_again_after_a_stop_handles_again(tmp_path: Path) -> None:
    service = _service(tmp_path)

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        return [SpecRejected(errors=[])]

    service.handles(SpecSubmitted, answers=(SpecValidated, SpecRejected), workers=2)(on_submitted)
    for n in range(2):
        async with in_memory(service) as bus:
            request = await bus.send("user", SpecSubmitted(spec_yaml="r"), f"sbx_{n}")
            assert _ends(bus, request) == ["spec.rejected"], n


async def test_a_stop_under_backpressure_gives_back_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nacked: list[tuple[bytes, float | None]]
) -> None:
    """The instance holds its most and one more delivery waits for room inside FastStream's
    consume when the service stops: it is given back (NAK) with what waits, and stopping the
    consumers does not wait FastStream's 15 s for it (then to drop it unanswered)."""
    import dsec_core.service as runtime
    from faststream._internal.endpoint.subscriber.utils import MultiLock

    monkeypatch.setattr(runtime, "FAIR_INSTANCE_HELD", 2)
    service, gate, _ = _gated(tmp_path)
    async with in_memory(service) as bus:
        subscribers = list(service.broker.subscribers)
        for sub in subscribers:
            sub.lock = MultiLock()  # what a real broker's start sets (graceful stop)
        deliveries = []
        for n, tenant in enumerate(("a", "b", "b")):
            pub = await bus.producer("user", tenant=tenant)
            sent = await pub.publish(SpecSubmitted(spec_yaml=f"r{n}"), aggregate_id=f"sbx_{n}")
            deliveries.append(
                asyncio.create_task(
                    bus.broker.publish(sent.sealed.wire, sent.sealed.subject, stream="DSEC_EVENTS")
                )
            )
            if n < 2:  # r0 runs, r1 waits
                await deliveries[n]
        (fair,) = service._fair
        await _until(lambda: len(fair.held) == 3)  # r2 verified, waits in the queue for room
        assert fair.queue.held == 2 and not deliveries[2].done()
        started = asyncio.get_running_loop().time()
        await service._close_queues()  # Service.stop()'s order: the queues, then the consumers
        await asyncio.gather(*(sub.stop() for sub in subscribers))
        assert asyncio.get_running_loop().time() - started < 5
        await asyncio.wait_for(deliveries[2], 1.0)
        assert len(nacked) == 2  # r1 (waiting) and r2 (waiting for room), at once
        gate.set()


async def test_one_tenants_slow_requests_leave_a_worker_to_the_others(tmp_path: Path) -> None:
    """A tenant's requests that never end (its builds hang) occupy at most workers - 1: the
    neighbour's request, sent after them, runs at once on the worker left."""
    service = _service(tmp_path)
    hang = asyncio.Event()
    running: list[str] = []

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        running.append(event.spec_yaml)
        if event.spec_yaml.startswith("slow"):
            await hang.wait()
        return [SpecRejected(errors=[])]

    service.handles(SpecSubmitted, answers=(SpecValidated, SpecRejected), workers=4)(on_submitted)
    async with in_memory(service) as bus:
        pub = await bus.producer("user", tenant="evil")
        for n in range(6):
            sent = await pub.publish(SpecSubmitted(spec_yaml=f"slow {n}"), aggregate_id=f"sbx_{n}")
            await bus.broker.publish(sent.sealed.wire, sent.sealed.subject, stream="DSEC_EVENTS")
        while len(running) < 3:
            await asyncio.sleep(0)
        victim = await _publish(bus, 9, tenant="victim")
        ended = asyncio.create_task(_until_ended(bus, victim))
        await asyncio.wait_for(ended, 10)
        assert running[:3] == ["slow 0", "slow 1", "slow 2"] and "r9" in running
        assert "slow 3" not in running  # the tenant's fourth waits for one of its three
        hang.set()
        await service.settled()
        assert sorted(running) == sorted([f"slow {n}" for n in range(6)] + ["r9"])


async def _until_ended(bus: MemoryBus, request: Envelope) -> None:
    while not _ends(bus, request):
        await asyncio.sleep(0.005)


async def test_an_attempt_past_its_timeout_is_cancelled_and_the_request_ends_saying_so(
    tmp_path: Path,
) -> None:
    """A handler that hangs is cancelled at ``attempt_timeout_s``: its worker is free again and
    the request ends in ``sandbox.failed`` naming the limit (here its only attempt); a handler
    raising its own TimeoutError is not reported as the runtime's."""
    from dsec_core import metrics
    from dsec_core.service import RetryPolicy

    service = _service(tmp_path)
    cancelled: list[str] = []

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        if event.spec_yaml == "own":
            raise TimeoutError("the index did not answer in 3 s")
        try:
            await asyncio.Event().wait()  # never set
        except asyncio.CancelledError:
            cancelled.append(event.spec_yaml)
            raise
        return []

    service.handles(
        SpecSubmitted,
        answers=(SpecValidated, SpecRejected),
        workers=1,
        retry=RetryPolicy(max_attempts=1, attempt_timeout_s=0.2),
    )(on_submitted)
    timeouts = metrics.HANDLER_TIMEOUTS.labels("policy", "spec.submitted")
    before = timeouts._value.get()
    async with in_memory(service) as bus:
        hung = await asyncio.wait_for(
            bus.send("user", SpecSubmitted(spec_yaml="hang"), "sbx_h", tenant="a"), 10
        )
        (failed,) = bus.caused_by(hung)
        assert failed.type == "sandbox.failed" and cancelled == ["hang"]
        reason = failed.payload["reason"]
        assert reason.startswith("AttemptTimedOut: policy did not finish spec.submitted"), reason
        assert "within 0.2 s (attempt 1 of 1); it was cancelled" in reason
        own = await bus.send("user", SpecSubmitted(spec_yaml="own"), "sbx_o", tenant="a")
        (failed,) = bus.caused_by(own)
        assert failed.payload["reason"] == "TimeoutError: the index did not answer in 3 s"
    assert timeouts._value.get() == before + 1


async def test_a_tenants_burst_past_its_bound_is_a_few_log_lines_and_one_end_each(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    import dsec_core.service as runtime

    service, gate, _ = _gated(tmp_path, workers=2, tenant_queue=1)
    async with in_memory(service) as bus:
        held = await _publish(bus, 0)
        caplog.set_level("WARNING", logger="dsec_core.service")
        refused = [await _publish(bus, n) for n in range(1, 6)]
        assert all(_ends(bus, r) == ["sandbox.failed"] for r in refused)
        lines = [r.getMessage() for r in caplog.records if "already holds" in r.getMessage()]
        assert len(lines) == 1 and "tenant 'acme'" in lines[0], lines
        monkeypatch.setattr(runtime, "FULL_LOG_EVERY_S", 0.0)
        await _publish(bus, 6)
        lines = [r.getMessage() for r in caplog.records if "already holds" in r.getMessage()]
        assert len(lines) == 2 and lines[1].endswith("(4 more since the last)"), lines
        gate.set()
        await service.settled()
        assert _ends(bus, held) == ["spec.rejected"]


async def test_a_handler_that_swallows_its_cancellation_does_not_keep_its_worker(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """asyncio cancels once: a handler that catches it and goes on would hold its worker and
    its request for ever. The runtime waits its grace, leaves it running (logged), ends the
    request, and the worker takes the next one."""
    import dsec_core.service as runtime
    from dsec_core.service import RetryPolicy

    monkeypatch.setattr(runtime, "CANCEL_GRACE_S", 0.1)
    service = _service(tmp_path)
    release = asyncio.Event()

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        if event.spec_yaml == "stubborn":
            while not release.is_set():
                with contextlib.suppress(asyncio.CancelledError):
                    await release.wait()
        return [SpecRejected(errors=[])]

    service.handles(
        SpecSubmitted,
        answers=(SpecValidated, SpecRejected),
        workers=1,
        retry=RetryPolicy(max_attempts=1, attempt_timeout_s=0.1),
    )(on_submitted)
    async with in_memory(service) as bus:
        stubborn = await asyncio.wait_for(
            bus.send("user", SpecSubmitted(spec_yaml="stubborn"), "sbx_s", tenant="a"), 10
        )
        (failed,) = bus.caused_by(stubborn)
        assert failed.payload["reason"].startswith("AttemptTimedOut: "), failed.payload
        assert any("ignored its cancellation" in r.getMessage() for r in caplog.records)
        after = await asyncio.wait_for(  # the one worker is free
            bus.send("user", SpecSubmitted(spec_yaml="ok"), "sbx_ok", tenant="a"), 10
        )
        assert _ends(bus, after) == ["spec.rejected"]
        release.set()


def test_bad_fair_settings_are_refused_where_they_are_written(tmp_path: Path) -> None:
    from dsec_core.service import RetryPolicy

    with pytest.raises(ValueError, match="attempt_timeout_s must be > 0 s, not 0"):
        RetryPolicy(attempt_timeout_s=0)
    service = _service(tmp_path)
    with pytest.raises(ValueError, match=r"tenant_workers must be 1..workers \(0\), not 2"):
        service.handles(SpecSubmitted, tenant_workers=2)
    with pytest.raises(ValueError, match=r"tenant_workers must be 1..workers \(4\), not 5"):
        service.handles(SpecSubmitted, workers=4, tenant_workers=5)


async def _batch(bus: MemoryBus, specs: list[tuple[str, str]]) -> list[object]:
    """Deliver (name, tenant) specs at once, as FastStream hands over a fetched batch."""
    sent = []
    for name, tenant in specs:
        pub = await bus.producer("user", tenant=tenant)
        sent.append(await pub.publish(SpecSubmitted(spec_yaml=name), aggregate_id=f"sbx_{name}"))
    return await asyncio.gather(
        *(bus.broker.publish(s.sealed.wire, s.sealed.subject, stream="DSEC_EVENTS") for s in sent),
        return_exceptions=True,
    )


@pytest.mark.parametrize("second_fails", [False, True])
async def test_a_batch_verified_at_once_is_held_in_the_order_it_was_fetched(
    tmp_path: Path, second_fails: bool
) -> None:
    """FastStream hands a fetched batch over at once and the verifications end in any order
    (the first here ends last; the second may fail, NATS gone during its replay check): a
    tenant's requests are still held, and run, in the order they came."""
    service, gate, runs = _gated(tmp_path)
    async with in_memory(service) as bus:
        await _publish(bus, 0, tenant="z")  # takes the one worker
        admit = service._admit
        fetched: list[str] = []  # the order the deliveries reached the runtime

        async def uneven(h: object, msg: object, *, spare: bool = True) -> object:
            admitted = await admit(h, msg, spare=spare)  # type: ignore[arg-type]
            assert admitted is not None
            fetched.append(admitted[0].decoded().spec_yaml)
            if len(fetched) == 1:
                await asyncio.sleep(0.05)
            if len(fetched) == 2 and second_fails:
                raise RuntimeError("NATS went away during the replay check")
            return admitted

        service._admit = uneven  # type: ignore[method-assign]
        await _batch(bus, [("r1", "a"), ("r2", "a"), ("r3", "a")])
        gate.set()
        await service.settled()
        assert sorted(fetched) == ["r1", "r2", "r3"]
        assert runs == ["r0", *(fetched[::2] if second_fails else fetched)]


async def test_a_tenant_waiting_for_room_holds_no_other_tenant_and_all_are_kept_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The instance is full; a batch [a, b, a] arrives. a's first waits for room and its
    second waits behind it (both kept alive: no heartbeat, and JetStream would deliver them
    again after ack_wait); b, a tenant holding nothing, is held at once."""
    import dsec_core.service as runtime

    monkeypatch.setattr(runtime, "FAIR_INSTANCE_HELD", 4)
    service, gate, runs = _gated(tmp_path)
    async with in_memory(service) as bus:
        (fair,) = service._fair
        for n, tenant in enumerate("aacc"):
            await _publish(bus, n, tenant=tenant)
        assert fair.queue.held == 4
        batch = asyncio.create_task(_batch(bus, [("r4", "a"), ("r5", "b"), ("r6", "a")]))
        await _until(lambda: fair.queue.held_by("b") and len(fair.held) == 7)  # all verified
        assert fair.queue.held_by("b") == 1 and fair.queue.held == 5
        assert len(fair.held) == 7 and not any(h.heartbeat.done() for h in fair.held.values())
        gate.set()
        await batch
        await service.settled()
        assert runs.index("r4") < runs.index("r6") and len(runs) == 7


async def test_a_stopped_service_waits_for_its_abandoned_handlers_then_leaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler still running after its cancellation (thread work that cannot be stopped)
    is waited for after the stop: one that ends in time ends cleanly (its thread's cleanup
    runs), one that does not makes the process leave without it, with the stop's status."""
    import dsec_core.service as runtime

    left: list[object] = []
    monkeypatch.setattr(runtime.quickexit, "leave", lambda code, force=False: left.append(code))
    service = _service(tmp_path)
    soon = asyncio.ensure_future(asyncio.sleep(0.1))
    service._abandoned.add(soon)
    soon.add_done_callback(service._abandoned.discard)
    await service._leave_abandoned(0)
    assert soon.done() and left == []
    monkeypatch.setattr(runtime, "ABANDONED_WAIT_S", 0.1)
    never = asyncio.ensure_future(asyncio.Event().wait())
    service._abandoned.add(never)
    await service._leave_abandoned(1)
    assert left == [1]
    never.cancel()


async def test_a_slow_lookup_of_a_redelivery_holds_no_other_tenant(tmp_path: Path) -> None:
    """A redelivered request's end is looked up in the log (a round trip or more): a later
    delivery of another tenant in the same batch is placed meanwhile."""
    service, gate, runs = _gated(tmp_path)
    async with in_memory(service) as bus:
        (fair,) = service._fair
        await _publish(bus, 0, tenant="z")  # takes the one worker
        while runs != ["r0"]:
            await asyncio.sleep(0)
        lookups: list[tuple[str, str]] = []

        async def slow_ended(h: object, msg: object, envelope: Envelope, attempt: int) -> bool:
            lookups.append(("started", envelope.tenant))
            await asyncio.sleep(0.3)
            lookups.append(("ended", envelope.tenant))
            return False

        service._ended = slow_ended  # type: ignore[method-assign,assignment]
        delivery = service.delivery
        first = {"seq": 0}

        def again(msg: NatsMessage) -> tuple[int, int]:
            _, seq = delivery(msg)
            first["seq"] = first["seq"] or seq  # the first verified: delivered again
            return (2 if seq == first["seq"] else 1), seq

        service.delivery = again  # type: ignore[method-assign]
        batch = asyncio.create_task(_batch(bus, [("r1", "a"), ("r2", "b")]))
        await _until(lambda: lookups and fair.queue.held_by("b" if lookups[0][1] == "a" else "a"))
        other = "b" if lookups[0][1] == "a" else "a"
        assert fair.queue.held_by(other) == 1 and [k for k, _ in lookups] == ["started"]
        gate.set()
        await batch
        await service.settled()
        assert sorted(runs) == ["r0", "r1", "r2"]


async def test_a_stop_waits_for_a_handler_unwinding_at_most_its_cancel_grace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handler without an attempt timeout (the node agent's launches) whose unwinding takes
    long (its cleanup awaits a download): the stop cancels it, waits CANCEL_GRACE_S, then goes
    on and leaves it running, kept for the stopped service's last wait."""
    import dsec_core.service as runtime

    monkeypatch.setattr(runtime, "CANCEL_GRACE_S", 0.2)
    service = _service(tmp_path)
    unwound = asyncio.Event()
    running = asyncio.Event()

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        running.set()
        try:
            await asyncio.Event().wait()
        finally:
            await asyncio.sleep(2.0)  # a slow unwind
            unwound.set()
        return []

    service.handles(SpecSubmitted, answers=(SpecValidated, SpecRejected), workers=2)(on_submitted)
    async with in_memory(service) as bus:
        await _publish(bus, 0)
        await asyncio.wait_for(running.wait(), 5)
        started = asyncio.get_running_loop().time()
        await service.stop_workers(grace_s=0.1)
        took = asyncio.get_running_loop().time() - started
        assert took < 1.5, took  # not the 2 s unwind
        assert not unwound.is_set() and len(service._abandoned) == 1
        await asyncio.wait_for(unwound.wait(), 5)  # it goes on, and ends
        await asyncio.sleep(0)
        assert not service._abandoned
        service.start_workers()


async def test_a_start_its_services_stop_cut_short_is_no_attempt(tmp_path: Path) -> None:
    """Stopped while it ran (a node agent restarted during a cold launch): its start is
    taken back, so restarts during one long start do not end the request as if it had failed
    that often. A start that fails on its own stays counted."""
    service, gate, runs = _gated(tmp_path)
    async with in_memory(service) as bus:
        assert service.gate is not None and service.gate.handled is not None
        kv = service.gate.handled
        request = await _publish(bus, 0)
        while not runs:
            await asyncio.sleep(0)
        (fair,) = service._fair
        key = f"{fair.handling.durable}.{request.key_id}.{request.id}.starts"
        assert (await kv.get(key)).value == b"1"
        await service.stop_workers(grace_s=0.05)
        assert (await kv.get(key)).value == b"0"
        service.start_workers()
        gate.set()
