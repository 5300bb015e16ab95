"""Three nodes on one machine (`dsec up --nodes 3`, the `dsec_cluster` fixture): each node agent
runs with its own node id, home, certificate and NATS identity, and heartbeats as its node."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
import pytest
from dsec_core import identity
from dsec_core.bus import follow
from dsec_core.events import NodeHeartbeat
from dsec_core.subjects import filter_for
from dsec_core.trust import Gate, KeyRing
from dsec_testing import trust
from dsec_testing.stack import ClusterFixture

pytestmark = [pytest.mark.integration, pytest.mark.kernel]

NODES = ("node-1", "node-2", "node-3")


def _gate(nc: nats.NATS, home: Path) -> Gate:
    root = trust.stack_root(home)
    return Gate(KeyRing(nc, nc.jetstream(), bytes(root.verify_key)), nc.jetstream(), None)


async def test_three_node_agents_heartbeat_each_as_its_own_node(dsec_cluster: ClusterFixture):
    started = await asyncio.to_thread(dsec_cluster.start_node_agents, {"DSEC_HEARTBEAT_S": "0.5"})
    assert started == ["nodeagent", "nodeagent@node-2", "nodeagent@node-3"]
    for node in NODES[1:]:  # a home of its own, certified for its node by the operator root
        cert = identity.read_cert(
            identity.TrustPaths(dsec_cluster.node_home(node)).cert("nodeagent")
        )
        assert cert.role == "nodeagent" and cert.node_id == node
    nc = await nats.connect(servers=dsec_cluster.operator_urls)
    try:
        gate = _gate(nc, dsec_cluster.home)
        seen: dict[str, NodeHeartbeat] = {}
        deadline = time.monotonic() + 30
        subject = filter_for("node.heartbeat")
        async for batch in follow(nc.jetstream(), filter_subject=subject):
            for _, data in batch:
                env = await gate.authentic(data)  # signed, certified, authorized for that node
                if env is not None:
                    seen[env.aggregate_id] = NodeHeartbeat.model_validate(env.payload)
            if set(NODES) <= set(seen) or time.monotonic() > deadline:
                break
        assert set(NODES) <= set(seen), f"heartbeats only from {sorted(seen)}"
    finally:
        await nc.close()
