"""Which node `dsec sandbox logs|exec` asks, on a real stream where an attacker re-published an
old placement."""

from __future__ import annotations

import uuid
from typing import Any

import nats
import pytest
from dsec_client.remote import owning_node as _owning_node
from dsec_core.bus import ensure_stream
from dsec_core.events import SandboxReady, SandboxScheduled, SpecSubmitted
from dsec_core.ids import new_sandbox_id
from dsec_core.trust import Gate, KeyRing
from dsec_testing import trust

pytestmark = pytest.mark.integration


async def test_a_replayed_old_placement_does_not_send_the_request_to_the_node_it_left(
    nats_url: str, dsec_stack: Any
) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        await ensure_stream(js)
        home = dsec_stack.home
        user = await trust.publisher(js, home, "user")
        scheduler = await trust.publisher(js, home, "scheduler", acts_for="default")
        n1 = await trust.publisher(js, home, "nodeagent", node_id="n1", acts_for="default")
        sid = new_sandbox_id()
        await user.publish(SpecSubmitted(spec_yaml="x"), aggregate_id=sid)
        first = await scheduler.publish(SandboxScheduled(node_id="n1"), aggregate_id=sid)
        await n1.publish(SandboxReady(node_id="n1", pid=1, cgroup="/c"), aggregate_id=sid)
        await scheduler.publish(
            SandboxScheduled(node_id="n2", attempt=2, previous_node="n1"), aggregate_id=sid
        )
        headers = {"Nats-Msg-Id": uuid.uuid4().hex}
        await js.publish(first.sealed.subject, first.sealed.wire, headers=headers)
        anchor = bytes(trust.stack_root(home).verify_key)
        gate = Gate(KeyRing(nc, js, anchor), js, None)
        assert await _owning_node(gate, sid) == "n2"
    finally:
        await nc.close()
