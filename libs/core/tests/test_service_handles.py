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
