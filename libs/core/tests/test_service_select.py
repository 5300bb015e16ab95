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
from dsec_core.service import HANDLING_SEQ, RetryPolicy, Service
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


def _confirmed_service(
    tmp_path: Path, answer: bool | None, asked: list[str]
) -> tuple[Service, asyncio.Event]:
    """A bound of one; ``confirm`` answers ``answer`` (``None``: it raises)."""
    service = Service("policy", Settings(home=tmp_path, tenant_queue=1))
    release = asyncio.Event()

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        await release.wait()
        return [SpecRejected(errors=[])]

    async def confirm(envelope: Envelope, event: SpecSubmitted) -> bool:
        asked.append(event.spec_yaml)
        assert HANDLING_SEQ.get() is not None  # at the event's place in the log
        if answer is None:
            raise ConnectionError("NATS away")
        return answer

    service.handles(
        SpecSubmitted,
        answers=(SpecValidated, SpecRejected),
        workers=2,
        select=_mine,
        confirm=confirm,
    )(on_submitted)
    return service, release


async def test_a_full_tenants_event_no_longer_this_instances_is_acked_without_an_end(
    tmp_path: Path,
) -> None:
    """The node agent's case: a late copy of an old placement of a sandbox now running on
    another node, met with its tenant full here, must not end the sandbox there."""
    asked: list[str] = []
    service, release = _confirmed_service(tmp_path, False, asked)
    async with in_memory(service) as bus:
        await _send(bus, "mine 0", 0)
        late = await _send(bus, "mine late", 1)
        assert asked == ["mine late"]
        assert bus.caused_by(late) == []
        release.set()
        await service.settled()
    confirmed: list[str] = []
    service, release = _confirmed_service(tmp_path / "b", True, confirmed)
    async with in_memory(service) as bus:  # still this instance's: ended as before
        await _send(bus, "mine 0", 0)
        full = await _send(bus, "mine 1", 1)
        assert [e.type for e in bus.caused_by(full)] == ["sandbox.failed"]
        release.set()
        await service.settled()


async def test_a_full_tenants_event_whose_placement_is_not_known_comes_back_later(
    tmp_path: Path, nacked: list[tuple[bytes, float | None]]
) -> None:
    asked: list[str] = []
    service, release = _confirmed_service(tmp_path, None, asked)
    async with in_memory(service) as bus:
        await _send(bus, "mine 0", 0)
        unknown = await _send(bus, "mine 1", 1)
        assert bus.caused_by(unknown) == []  # not ended on a guess
        assert [delay for _, delay in nacked] == [0.2]  # given back, asked again then
        release.set()
        await service.settled()


async def test_a_spare_delivery_no_longer_this_instances_ends_nothing(tmp_path: Path) -> None:
    """Every attempt crashed (the spare delivery): the failure is published only when the
    event is still this instance's to end."""
    for answer, ends in ((False, []), (True, ["sandbox.failed"])):
        asked: list[str] = []
        service, release = _confirmed_service(tmp_path / str(answer), answer, asked)
        release.set()
        async with in_memory(service) as bus:
            delivery = service.delivery
            service.delivery = lambda msg, d=delivery: (22, d(msg)[1])  # past its 5 + 16 + 1
            request = await _send(bus, "mine 0", 0)
            await service.settled()
            assert asked == ["mine 0"]
            assert [e.type for e in bus.caused_by(request)] == ends


@pytest.mark.parametrize("workers", [0, 2])
async def test_a_last_attempt_that_raised_ends_only_a_request_still_this_instances(
    tmp_path: Path, workers: int
) -> None:
    """A node's handler failing on a request of a sandbox another node now runs (its lookup
    failed every attempt) leaves it to that node; still this instance's, it is ended as
    before."""
    for answer, ends in ((False, []), (True, ["sandbox.failed"])):
        service = Service("policy", Settings(home=tmp_path / str(answer)))
        asked: list[str] = []

        async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
            raise ConnectionError("the sandbox's history could not be read")

        async def confirm(
            envelope: Envelope, event: SpecSubmitted, a: bool = answer, seen: list[str] = asked
        ) -> bool:
            seen.append(f"{event.spec_yaml} at {HANDLING_SEQ.get()}")  # as its handler saw it
            return a

        service.handles(
            SpecSubmitted,
            answers=(SpecValidated, SpecRejected),
            workers=workers,
            retry=RetryPolicy(max_attempts=1),
            confirm=confirm,
        )(on_submitted)
        async with in_memory(service) as bus:
            request = await _send(bus, "mine 0", 0)
            await service.settled()
            seq = next(n for n, subject, _ in bus.log.records if subject == request.subject)
            assert asked == [f"mine 0 at {seq}"]
            assert [e.type for e in bus.caused_by(request)] == ends


def test_a_select_or_confirm_that_is_not_a_function_is_refused_where_it_is_written(
    tmp_path: Path,
) -> None:
    service = Service("policy", Settings(home=tmp_path))
    for name in ("select", "confirm"):
        with pytest.raises(TypeError, match=f"{name} must be a function of"):
            service.handles(SpecSubmitted, workers=2, **{name: "node-1"})  # type: ignore[call-overload]
