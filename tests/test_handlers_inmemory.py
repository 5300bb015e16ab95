"""Every handler of every service refuses, before acting, an event its producer may not emit:
driven through FastStream's in-memory broker behind the real trust gate
(``dsec_testing.inmemory``). A service that registers a new handler is covered at once."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from dsec_core import authz, events
from dsec_core.identity import Role
from dsec_core.service import Service
from dsec_core.settings import Settings
from dsec_testing.inmemory import in_memory

pytestmark = pytest.mark.unit


def _factories() -> dict[str, Callable[[Settings], Service]]:
    from dsec_builder.app import create_service as builder
    from dsec_policy.app import create_service as policy
    from dsec_scheduler.app import create_service as scheduler
    from dsec_snapshot.app import create_service as snapshot

    return {"policy": policy, "builder": builder, "snapshot": snapshot, "scheduler": scheduler}


def _handled() -> list[tuple[str, str]]:
    """(service, event type) of every registered handler."""
    pairs = []
    for name, make in _factories().items():
        service = make(Settings(home=Path("/nonexistent"), snapshot_interval_s=60))
        prefix = f"{name}-"
        for durable in service.durables:
            suffix = durable.removeprefix(prefix)
            event_type = next(t for t in events.EVENT_TYPES if t.replace(".", "-") == suffix)
            pairs.append((name, event_type))
    return pairs


def _not_allowed(event_type: str) -> Role:
    allowed = authz.PRODUCERS[event_type]
    return next(r for r in ("user", "builder", "policy", "scheduler") if r not in allowed)


@pytest.mark.parametrize(("service_name", "event_type"), _handled())
async def test_an_event_from_a_producer_not_allowed_to_emit_it_never_reaches_the_handler(
    service_name: str, event_type: str, tmp_path: Path
) -> None:
    settings = Settings(home=tmp_path, snapshot_interval_s=60)
    service = _factories()[service_name](settings)
    model = events.EVENT_TYPES[event_type]
    role = _not_allowed(event_type)
    async with in_memory(service, run_hooks=False) as bus:
        # No payload is valid here on purpose: the gate must refuse before anything decodes it.
        sent = await bus.send(role, model.model_construct(), "sbx_forged")
        answers = bus.caused_by(sent)
        (rejected,) = bus.rejections()
    assert answers == []
    assert rejected.payload["reason"] == "unauthorized"
    assert rejected.payload["event_id"] == sent.id
    assert rejected.payload["consumer"] == f"{service_name}-{event_type.replace('.', '-')}"
