"""One tenant's backlog at a shared service: the real policy service on the real bus.

A tenant that submits a burst of specs must not hold another tenant's spec behind the whole
burst (the services used to take a handler's events one at a time in stream order), and what a
tenant may have held at a service is bounded: the excess ends at once, each request with exactly
one terminal event that says why.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from dsec_core import canonical
from dsec_core.events import SpecSubmitted
from dsec_core.ids import new_sandbox_id
from dsec_core.subjects import STREAM, subject_for
from dsec_testing import trust
from nats.js import JetStreamContext

pytestmark = [pytest.mark.e2e]

SPEC = """\
version: "1.2"
name: fair-{n}
base: dsec/python311:latest
entrypoint: [python, -c, "print('hi')"]
"""
ENDS = ("spec.validated", "spec.rejected", "sandbox.failed")
FLOOD = 100
PER_TENANT = 80
WORKERS = 8  # the policy service's validations at once


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_url)
    yield nc.jetstream()
    await nc.close()


async def _ends(js: JetStreamContext, sid: str) -> list[tuple[int, str, dict[str, Any]]]:
    """The terminal events of ``sid`` so far: (stream seq, type, payload)."""
    found = []
    for event_type in ENDS:
        try:
            msg = await js.get_msg(STREAM, subject=subject_for(event_type, sid), next=True, seq=1)
        except Exception:  # nothing on that subject yet
            continue
        fields = canonical.unpack(msg.data)
        found.append((msg.seq, event_type, fields["payload"]))
    return found


async def _all_ended(
    js: JetStreamContext, sids: list[str], timeout_s: float = 90.0
) -> dict[str, list[tuple[int, str, dict[str, Any]]]]:
    deadline = time.monotonic() + timeout_s
    while True:
        ends = {sid: await _ends(js, sid) for sid in sids}
        if all(ends.values()) or time.monotonic() > deadline:
            return ends
        await asyncio.sleep(0.2)


async def test_a_tenants_burst_neither_holds_another_tenants_spec_nor_grows_unbounded(
    services, js, dsec_stack
) -> None:
    services.start("policy", env={"DSEC_TENANT_QUEUE": str(PER_TENANT)})
    home = dsec_stack.home
    flood = await trust.publisher(js, home, "user", tenant="flood")
    neighbour = await trust.publisher(js, home, "user", tenant="neighbour")

    burst = [new_sandbox_id() for _ in range(FLOOD)]
    for n, sid in enumerate(burst):
        await flood.publish(SpecSubmitted(spec_yaml=SPEC.format(n=n)), aggregate_id=sid)
    victim = new_sandbox_id()
    submitted = await neighbour.publish(
        SpecSubmitted(spec_yaml=SPEC.format(n="v")), aggregate_id=victim
    )

    ends = await _all_ended(js, [*burst, victim])
    # Every request ends, each in exactly one terminal event.
    assert all(len(e) == 1 for e in ends.values()), {s: e for s, e in ends.items() if len(e) != 1}
    (victim_end,) = ends[victim]
    assert victim_end[1] == "spec.validated", victim_end

    validated = [sid for sid in burst if ends[sid][0][1] == "spec.validated"]
    refused = [ends[sid][0] for sid in burst if ends[sid][0][1] == "sandbox.failed"]
    assert len(validated) + len(refused) == FLOOD
    # The service held at most PER_TENANT of the burst at once; the rest ended at once, saying
    # why and what to do, not dropped and not queued without bound.
    assert len(validated) >= PER_TENANT and refused, (len(validated), len(refused))
    for _, _, payload in refused:
        assert payload["stage"] == "policy", payload
        assert f"already holds {PER_TENANT} requests of tenant 'flood'" in payload["reason"]
        assert f"DSEC_TENANT_QUEUE = {PER_TENANT} requests" in payload["reason"], payload
        assert "submit it again" in payload["reason"], payload

    # The neighbour's spec, published after the whole burst, was validated after at most the
    # flood's validations running when it came, the one next in turn and those the other
    # workers finished while it ran: not after the flood's backlog (taken in stream order, it
    # came after every one of the flood's specs still waiting, here 60-90 of them).
    ahead = sum(1 for sid in validated if submitted.stream_seq < ends[sid][0][0] < victim_end[0])
    assert ahead <= 2 * WORKERS + 4, (ahead, len(validated))


async def test_a_stopped_service_gives_back_what_it_holds_at_once(services, js, dsec_stack) -> None:
    """SIGTERM while the policy service holds a tenant's backlog: what waits goes back to
    JetStream at once (not after the 30 s ack deadline: a restarted service takes it at once),
    and every request ends, each exactly once."""
    services.start("policy", env={"DSEC_TENANT_QUEUE": "200"})
    tenant = await trust.publisher(js, dsec_stack.home, "user", tenant="backlog")
    sids = [new_sandbox_id() for _ in range(60)]
    for n, sid in enumerate(sids):
        await tenant.publish(SpecSubmitted(spec_yaml=SPEC.format(n=n)), aggregate_id=sid)
    deadline = time.monotonic() + 30
    while not any([await _ends(js, sid) for sid in sids[:8]]):  # it is working
        assert time.monotonic() < deadline, "the policy service never answered"
        await asyncio.sleep(0.05)
    services.stop("policy")
    stopped = time.monotonic()
    unanswered = [sid for sid in sids if not await _ends(js, sid)]
    assert unanswered, "the stop came after the whole backlog"

    services.start("policy", env={"DSEC_TENANT_QUEUE": "200"})
    ends = await _all_ended(js, sids, timeout_s=60.0)
    assert all(len(e) == 1 for e in ends.values()), {s: e for s, e in ends.items() if len(e) != 1}
    assert {e[0][1] for e in ends.values()} == {"spec.validated"}
    # A request left to its 30 s ack deadline would end 30 s after the stop at the earliest.
    took = time.monotonic() - stopped
    assert took < 20, f"the backlog ended {took:.1f} s after the stop: not given back"
