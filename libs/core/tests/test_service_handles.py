"""Handlers are registered by event class; the durable and filter follow from the class."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from dsec_core import events
from dsec_core.envelope import Envelope
from dsec_core.service import Service
from dsec_core.settings import Settings

pytestmark = pytest.mark.unit


async def _on_submitted(
    envelope: Envelope, event: events.SpecSubmitted
) -> Sequence[events.Payload]:
    return []


def test_a_handler_is_registered_by_its_event_class(tmp_path) -> None:
    service = Service("policy", Settings(home=tmp_path))
    assert service.handles(events.SpecSubmitted)(_on_submitted) is _on_submitted
    assert service.durables == ["policy-spec-submitted"]
    (sub,) = service.broker.subscribers
    assert str(sub.subject.broker_address) == "dsec.sandbox.*.spec.submitted"


def test_the_type_name_still_registers_for_one_release(tmp_path) -> None:
    service = Service("policy", Settings(home=tmp_path))
    service.handles("spec.submitted")(_on_submitted)
    assert service.durables == ["policy-spec-submitted"]


def test_an_unregistered_class_or_name_is_refused_at_wiring(tmp_path) -> None:
    class Lookalike(events.Payload):
        TYPE = "spec.submitted"
        AGGREGATE = "sandbox"

    service = Service("policy", Settings(home=tmp_path))
    with pytest.raises(ValueError, match=r"Lookalike is not the registered model"):
        service.handles(Lookalike)
    with pytest.raises(ValueError, match=r"unknown event type 'spec\.submited'"):
        service.handles("spec.submited")
    assert service.durables == []


async def test_an_idle_fetch_that_times_out_leaves_the_consumer_running(tmp_path) -> None:
    """nats-py 2.16 ends some idle fetches with the builtin ``TimeoutError`` where FastStream
    0.7 expects nats-py's own: the consumer loop must take it as "nothing yet" and fetch
    again, not die (FastStream's supervisor then logged an ERROR with a traceback at each
    service start and restarted it)."""
    service = Service("policy", Settings(home=tmp_path))
    service.handles(events.SpecSubmitted)(_on_submitted)
    (sub,) = service.broker.subscribers
    fetched: list[int] = []

    class Subscription:
        async def fetch(self, batch: int, timeout: float) -> list[object]:
            fetched.append(batch)
            if len(fetched) == 1:
                raise TimeoutError  # the builtin, as nats-py's _fetch_n raises it
            sub.running = False  # type: ignore[attr-defined,misc]  # (the loop ends after this)
            return []

    sub.subscription = Subscription()  # type: ignore[attr-defined]
    sub.running = True  # type: ignore[attr-defined,misc]
    await sub._consume_pull(cb=_on_submitted)  # type: ignore[attr-defined]
    assert len(fetched) == 2  # fetched again after the timeout
