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
