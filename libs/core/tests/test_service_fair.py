"""A handler registered with ``workers``, in memory behind the real trust gate: what it holds
is handled once, its attempts are its starts, and a handler's own cancellation is a failed
attempt, not the end of a worker (``dsec_core.service``, ``dsec_core.fairness``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from dsec_core.envelope import Envelope
from dsec_core.events import SpecRejected, SpecSubmitted, SpecValidated
from dsec_core.service import Service
from dsec_core.settings import Settings
from dsec_testing.inmemory import MemoryBus, in_memory

pytestmark = pytest.mark.unit


def _service(tmp_path: Path, **settings: object) -> Service:
    return Service("policy", Settings(home=tmp_path, **settings))  # type: ignore[arg-type]


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
    service = _service(tmp_path, tenant_queue=2)
    gate = asyncio.Event()
    runs: list[str] = []

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        runs.append(event.spec_yaml)
        await gate.wait()
        return [SpecRejected(errors=[])]

    service.handles(SpecSubmitted, answers=(SpecValidated, SpecRejected), workers=1)(on_submitted)
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
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The instance holds its most and one more delivery waits for room inside FastStream's
    consume when the service stops: it is given back (NAK) with what waits, and stopping the
    consumers does not wait FastStream's 15 s for it (then to drop it unanswered)."""
    import dsec_core.service as runtime
    import faststream.nats.message as messages
    from faststream._internal.endpoint.subscriber.utils import MultiLock

    monkeypatch.setattr(runtime, "FAIR_INSTANCE_HELD", 2)
    nacked: list[bytes] = []
    nack = messages.NatsMessage.nack

    async def counted(self: object, delay: float | None = None) -> None:
        nacked.append(self.raw_message.data)  # type: ignore[attr-defined]
        await nack(self, delay=delay)  # type: ignore[arg-type]

    monkeypatch.setattr(messages.NatsMessage, "nack", counted)
    service = _service(tmp_path)
    gate = asyncio.Event()

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        await gate.wait()
        return [SpecRejected(errors=[])]

    service.handles(SpecSubmitted, answers=(SpecValidated, SpecRejected), workers=1)(on_submitted)
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
            for _ in range(20):
                await asyncio.sleep(0)
        (fair,) = service._fair
        assert fair.queue.held == 2 and not deliveries[2].done()  # r0 runs, r1 waits, r2 blocked
        started = asyncio.get_running_loop().time()
        await service._close_queues()  # Service.stop()'s order: the queues, then the consumers
        await asyncio.gather(*(sub.stop() for sub in subscribers))
        assert asyncio.get_running_loop().time() - started < 5
        await asyncio.wait_for(deliveries[2], 1.0)
        assert len(nacked) == 2  # r1 (waiting) and r2 (waiting for room), at once
        gate.set()
