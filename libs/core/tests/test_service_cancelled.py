"""A delivery whose consume is cancelled before it was acked is given back (NAK with a short
delay), so JetStream delivers it again in seconds, not after the consumer's whole ack_wait
(``dsec_core.service._give_back_msg``). FastStream cancels what still runs when a
service stops past its grace, and what it fetched as it stopped. In memory, behind the real
trust gate; ``tests/test_backbone.py`` shows the same against a real NATS server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import dsec_core.service as runtime
import faststream.nats.message as messages
import pytest
from dsec_core.envelope import Envelope
from dsec_core.events import SpecRejected, SpecSubmitted, SpecValidated
from dsec_core.service import Service
from dsec_core.settings import Settings
from dsec_testing.inmemory import MemoryBus, in_memory

pytestmark = pytest.mark.unit


async def _delivering(bus: MemoryBus, tenant: str = "acme") -> tuple[asyncio.Task[None], bytes]:
    """Publish a spec and start delivering it (the consume runs in the returned task)."""
    pub = await bus.producer("user", tenant=tenant)
    sent = await pub.publish(SpecSubmitted(spec_yaml="r"), aggregate_id="sbx_c")
    task = asyncio.create_task(
        bus.broker.publish(sent.sealed.wire, sent.sealed.subject, stream="DSEC_EVENTS")
    )
    return task, sent.sealed.wire


async def _cancelled(task: asyncio.Task[None]) -> None:
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("workers", [0, 2])
async def test_a_delivery_cancelled_while_it_is_verified_is_given_back(
    tmp_path: Path, nacked: list[tuple[bytes, float | None]], workers: int
) -> None:
    service = Service("policy", Settings(home=tmp_path))
    ran: list[str] = []

    async def on_submitted(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        ran.append(envelope.id)
        return [SpecRejected(errors=[])]

    service.handles(SpecSubmitted, answers=(SpecValidated, SpecRejected), workers=workers)(
        on_submitted
    )
    async with in_memory(service) as bus:
        assert service.gate is not None
        admit, entered = service.gate.admit, asyncio.Event()

        async def slow_admit(*args: object, **kwargs: object) -> object:
            entered.set()
            await asyncio.Event().wait()  # the stop comes while it is verified
            return await admit(*args, **kwargs)  # type: ignore[arg-type]

        service.gate.admit = slow_admit  # type: ignore[method-assign]
        task, wire = await _delivering(bus)
        await entered.wait()
        await _cancelled(task)
        assert nacked == [(wire, runtime.FAIR_GIVE_BACK_S)]
        assert ran == []


async def test_a_request_whose_handler_is_cancelled_is_given_back_once(
    tmp_path: Path, nacked: list[tuple[bytes, float | None]]
) -> None:
    """The handler (no ``workers``: FastStream runs it in its consume) is still running when
    its service stops: the request is given back once, and nothing answers it here."""
    service = Service("policy", Settings(home=tmp_path))
    started = asyncio.Event()

    async def hangs(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        started.set()
        await asyncio.Event().wait()
        return [SpecRejected(errors=[])]

    service.handles(SpecSubmitted, answers=(SpecValidated, SpecRejected))(hangs)
    async with in_memory(service) as bus:
        task, wire = await _delivering(bus)
        await started.wait()
        await _cancelled(task)
        assert nacked == [(wire, runtime.FAIR_GIVE_BACK_S)]
        assert [e for e in bus.log.records if e[1].endswith("spec.rejected")] == []


@pytest.mark.parametrize("stopping", [False, True])
async def test_an_acked_request_is_not_given_back_when_its_consume_is_cancelled_after(
    tmp_path: Path,
    nacked: list[tuple[bytes, float | None]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    stopping: bool,
) -> None:
    """The cancel lands after the ack (the handler ended as the service stopped): no NAK, which
    would make JetStream deliver an answered request again. During a stop the warning says it
    was acked, not "given back" (which would send someone looking for a redelivery)."""
    service = Service("policy", Settings(home=tmp_path))
    acked = asyncio.Event()

    async def answers(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        return [SpecRejected(errors=[])]

    service.handles(SpecSubmitted, answers=(SpecValidated, SpecRejected))(answers)
    ack_sync = messages.NatsMessage.ack_sync

    async def then_wait(self: messages.NatsMessage) -> None:
        await ack_sync(self)
        acked.set()
        await asyncio.Event().wait()  # cancelled here, after its ack

    monkeypatch.setattr(messages.NatsMessage, "ack_sync", then_wait)
    async with in_memory(service) as bus:
        task, _ = await _delivering(bus)
        await acked.wait()
        if stopping:
            service._in_stop = True  # (what Service.stop sets first)
            task.cancel()
            await task  # ended by the consume, not raised
            (line,) = [r for r in caplog.records if "stopped while handling" in r.getMessage()]
            assert "acked" in line.getMessage() and "given back," not in line.getMessage()
        else:
            await _cancelled(task)
        assert nacked == []


async def test_a_stop_that_cancels_a_handler_is_one_warning_not_an_error(
    tmp_path: Path,
    nacked: list[tuple[bytes, float | None]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """While the service stops, a cancelled delivery is given back and logged as one warning
    line naming it; the cancellation ends there (FastStream logged it as an ERROR with a
    traceback). Outside a stop it goes on (the tests above)."""
    service = Service("policy", Settings(home=tmp_path))
    started = asyncio.Event()

    async def hangs(envelope: Envelope, event: SpecSubmitted) -> list[SpecRejected]:
        started.set()
        await asyncio.Event().wait()
        return []

    service.handles(SpecSubmitted, answers=(SpecValidated, SpecRejected))(hangs)
    async with in_memory(service) as bus:
        task, wire = await _delivering(bus)
        await started.wait()
        service._in_stop = True  # (what Service.stop sets first)
        task.cancel()
        await task  # ended by the consume, not raised
        assert nacked == [(wire, runtime.FAIR_GIVE_BACK_S)]
        (line,) = [r for r in caplog.records if "stopped while handling" in r.getMessage()]
        assert line.levelname == "WARNING"
        assert "spec.submitted" in line.getMessage()
        assert "delivered again in 2 s" in line.getMessage()
