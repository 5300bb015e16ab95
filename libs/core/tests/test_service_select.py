"""A handler registered with ``select`` acts only on the verified events it selects (a node
agent: those placed on its node): the rest are acked unanswered, never held, never counted
against a tenant's bound (so no node ends another node's request), in memory behind the real
trust gate (``dsec_core.service``)."""

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


def _mine(_envelope: Envelope, event: SpecSubmitted) -> bool:
    return event.spec_yaml.startswith("mine")


def _service(tmp_path: Path, workers: int, **settings: object) -> tuple[Service, list[str]]:
    """A service whose handler records each spec it runs, and waits while ``hold`` is unset."""
    service = Service("policy", Settings(home=tmp_path, **settings))  # type: ignore[arg-type]
    runs: list[str] = []

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        runs.append(event.spec_yaml)
        return [SpecRejected(errors=[])]

    service.handles(
        SpecSubmitted, answers=(SpecValidated, SpecRejected), workers=workers, select=_mine
    )(on_submitted)
    return service, runs


async def _send(bus: MemoryBus, text: str, n: int) -> Envelope:
    """Publish a spec and hand it to the service; returns once it was held or ended (without
    waiting, as ``MemoryBus.send`` does, for what is held to end)."""
    pub = await bus.producer("user", tenant="acme")
    sent = await pub.publish(SpecSubmitted(spec_yaml=text), aggregate_id=f"sbx_{n}")
    await bus.broker.publish(sent.sealed.wire, sent.sealed.subject, stream="DSEC_EVENTS")
    return sent.sealed.envelope


@pytest.mark.parametrize("workers", [0, 2])
async def test_only_the_selected_events_reach_the_handler_and_are_answered(
    tmp_path: Path, workers: int
) -> None:
    service, runs = _service(tmp_path, workers)
    async with in_memory(service) as bus:
        others = [await _send(bus, f"other {n}", n) for n in range(3)]
        mine = await _send(bus, "mine 9", 9)
        await service.settled()
        assert runs == ["mine 9"]
        assert [e.type for e in bus.caused_by(mine)] == ["spec.rejected"]
        assert all(bus.caused_by(e) == [] for e in others)  # acked, answered by nobody here
        assert bus.rejections() == []


async def test_events_not_selected_count_against_no_tenants_bound(tmp_path: Path) -> None:
    """A tenant bound of one: a hundred events another node acts on, sent while this
    instance holds the tenant's one request, end nothing here (before, each would have ended
    in a failure event of this node's: 'already holds 1 requests')."""
    service = Service("policy", Settings(home=tmp_path, tenant_queue=1))
    release = asyncio.Event()
    runs: list[str] = []

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        runs.append(event.spec_yaml)
        await release.wait()
        return [SpecRejected(errors=[])]

    service.handles(SpecSubmitted, answers=(SpecValidated, SpecRejected), workers=2, select=_mine)(
        on_submitted
    )
    async with in_memory(service) as bus:
        held = await _send(bus, "mine 0", 0)
        others = [await _send(bus, f"other {n}", n) for n in range(1, 101)]
        (fair,) = service._fair
        assert fair.queue.held == 1 and runs == ["mine 0"]
        assert all(bus.caused_by(e) == [] for e in others)
        full = await _send(bus, "mine 101", 101)  # the bound still holds for its own
        assert [e.type for e in bus.caused_by(full)] == ["sandbox.failed"]
        release.set()
        await service.settled()
        assert [e.type for e in bus.caused_by(held)] == ["spec.rejected"]
        assert runs == ["mine 0"]


async def test_a_select_that_raises_leaves_the_event_to_the_handler(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    service = Service("policy", Settings(home=tmp_path))
    runs: list[str] = []

    def broken(_envelope: Envelope, event: SpecSubmitted) -> bool:
        raise KeyError("node_id")

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        runs.append(event.spec_yaml)
        return [SpecRejected(errors=[])]

    service.handles(SpecSubmitted, answers=(SpecValidated, SpecRejected), workers=2, select=broken)(
        on_submitted
    )
    caplog.set_level("WARNING", logger="dsec_core.service")
    async with in_memory(service) as bus:
        sent = await _send(bus, "any", 0)
        await service.settled()
    assert runs == ["any"]
    assert [e.type for e in bus.caused_by(sent)] == ["spec.rejected"]
    assert any("selecting spec.submitted" in r.getMessage() for r in caplog.records)
