"""The policy service's tenants' turns and bounds, in memory behind the real trust gate: the
ends a request may have when its tenant is full (``dsec_core.fairness``)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from dsec_core.events import SpecSubmitted
from dsec_core.settings import Settings
from dsec_testing.inmemory import in_memory

from dsec_policy.app import create_service

pytestmark = pytest.mark.unit

SPEC = 'version: "1.2"\nname: agent\nbase: python:3.11\n'


async def test_a_redelivered_answered_request_is_not_refused_when_its_tenant_is_full(
    tmp_path: Path,
) -> None:
    """A spec validated whose ack was lost comes again while its tenant holds its share: it
    ended already, so it is acked as it is (refusing it would end it a second time)."""
    service = create_service(Settings(home=tmp_path, tenant_queue=1))
    async with in_memory(service) as bus:
        sent = await bus.send("user", SpecSubmitted(spec_yaml=SPEC), "sbx_once", tenant="acme")
        assert [e.type for e in bus.caused_by(sent)] == ["spec.validated"]

        (fair,) = service._fair
        for task in fair.tasks:  # the workers paused, so that what is held stays held
            task.cancel()
        await asyncio.gather(*fair.tasks, return_exceptions=True)
        await fair.queue.put("acme", None)  # type: ignore[arg-type]  # the tenant's one request
        first = service.delivery
        service.delivery = lambda msg: (2, first(msg)[1])  # JetStream delivering it again
        wire = next(d for _, s, d in bus.log.records if s == sent.subject)
        await bus.broker.publish(wire, sent.subject, stream="DSEC_EVENTS")
        await fair.queue.done(await fair.queue.take())
        assert [e.type for e in bus.caused_by(sent)] == ["spec.validated"]


@pytest.mark.parametrize(
    ("value", "says"),
    [("1000", "less than or equal to 512"), ("0", "greater than or equal to 1"), ("x", "integer")],
)
def test_a_bad_tenant_queue_setting_stops_the_service_with_one_line(
    tmp_path: Path, value: str, says: str
) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "DSEC_HOME": str(tmp_path), "DSEC_TENANT_QUEUE": value}
    done = subprocess.run(
        [sys.executable, "-m", "dsec_policy"], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()  # one line, no traceback
    assert line.startswith("error: DSEC_TENANT_QUEUE: ") and says in line, line
