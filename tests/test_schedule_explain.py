"""`dsec schedule explain`: what a user sees of a placement decision, read from the log (events
published here by test publishers the stack's root certified as the pipeline and the scheduler;
a forged ``unit.placed`` signed by a user is never shown)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import nats
import pytest
from dsec_core import events
from dsec_core.bus import ensure_stream
from dsec_core.events import Resources
from dsec_testing import trust
from dsec_testing.stack import StackFixture
from nats.js import JetStreamContext

pytestmark = pytest.mark.integration

GIB = 2**30
SPEC = """\
version: "1.2"
name: s
base: dsec/python311:latest
entrypoint: [python, -c, "pass"]
resources: {cpu: 8, memory: 64GiB, gpu: {count: 4}}
"""


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_stream(js)
    yield js
    await nc.close()


async def _end(pipe: trust.Pipeline, *sids: str) -> None:
    """End the test's sandboxes: a later test's scheduler never finds one waiting for a node
    (this test's pending sandbox, placed on that test's fleet, was counted there)."""
    for sid in sids:
        await pipe.builder.publish(
            events.SandboxFailed(stage="test", reason="test over"), aggregate_id=sid
        )


async def _built(pipe: trust.Pipeline, sid: str) -> None:
    """A sandbox up to ``env.built``, as the user, policy and builder publish it."""
    await pipe.built(SPEC, sid)


async def test_explain_shows_each_units_place_score_and_why_a_unit_waits(
    js: JetStreamContext, dsec_stack: StackFixture, dsec_cli, stack_env
) -> None:
    pipe = await trust.pipeline(js, dsec_stack.home)
    tag = uuid.uuid4().hex[:8]
    placed, waiting = f"sbx_placed_{tag}", f"sbx_waiting_{tag}"
    resources = Resources(cpus=8, memory_bytes=64 * GIB, gpus=4)
    await _built(pipe, placed)
    for unit, node, gpus, milli in (
        ("trainer", "gpu-7", [0, 1, 2, 3], 1000),
        ("eval", "gpu-2", [5], 250),
    ):
        await pipe.scheduler.publish(
            events.UnitPlaced(
                sandbox_id=placed,
                unit=unit,
                node_id=node,
                gpu_indices=gpus,
                gpu_milli=milli,
                gpu_model="H100",
                cpu_millicores=4000,
                memory_bytes=32 * GIB,
                gang_size=2,
                policy="dsec",
                score=0.82,
                breakdown={"fragmentation_delta": -0.125, "packing": 0.7},
                feasible_nodes=37,
                nodes_total=1213,
                attempt=1,
            ),
            aggregate_id=placed,
        )  # fmt: skip
    forged = await trust.publisher(js, dsec_stack.home, "user", subject=f"user-forger-{tag}")
    await forged.publish(
        events.UnitPlaced(
            sandbox_id=placed, unit="trainer", node_id="evil-node", policy="dsec", attempt=1
        ),
        aggregate_id=placed,
    )
    await pipe.scheduler.publish(
        events.SandboxScheduled(node_id="gpu-7", reason="dsec", resources=resources),
        aggregate_id=placed,
    )
    await _built(pipe, waiting)
    unfit = {"no GPU of model V100M32": 800, "insufficient GPU share": 413}
    await pipe.scheduler.publish(
        events.SandboxPending(
            reason="0/1213 nodes: 800 no GPU of model V100M32, 413 insufficient GPU share",
            resources=resources,
            unit="main",
            unfit=unfit,
            nodes_total=1213,
        ),
        aggregate_id=waiting,
    )

    shown = dsec_cli("schedule", "explain", placed, "--json", env=stack_env)
    assert shown.exit_code == 0, shown.output
    doc = shown.last_json()
    assert (doc["decision"], doc["node_id"], doc["state"]) == ("placed", "gpu-7", "scheduled")
    units = {u["unit"]: u for u in doc["units"]}
    assert set(units) == {"trainer", "eval"}  # the forged unit.placed is not the scheduler's
    assert units["trainer"]["node_id"] == "gpu-7" and units["eval"]["gpu_milli"] == 250
    assert units["trainer"]["breakdown"] == {"fragmentation_delta": -0.125, "packing": 0.7}
    assert (units["eval"]["feasible_nodes"], units["eval"]["nodes_total"]) == (37, 1213)

    table = dsec_cli("schedule", "explain", placed, env={**stack_env, "COLUMNS": "220"})
    assert table.exit_code == 0, table.output
    assert "placed on gpu-7" in table.output and "evil-node" not in table.output
    for text in ("trainer", "0,1,2,3 (H100)", "0.25 GPU each", "37/1213", "packing=0.7"):
        assert text in table.output, text

    pending = dsec_cli("schedule", "explain", waiting, "--json", env=stack_env)
    assert pending.exit_code == 0, pending.output
    doc = pending.last_json()
    assert (doc["decision"], doc["unit"], doc["unfit"], doc["nodes_total"]) == (
        "pending",
        "main",
        unfit,
        1213,
    )
    table = dsec_cli("schedule", "explain", waiting, env={**stack_env, "COLUMNS": "220"})
    assert table.exit_code == 0, table.output
    assert (
        "unit main: 0/1213 nodes: 800 no GPU of model V100M32, 413 insufficient GPU share"
        in table.output
    )

    unknown = dsec_cli("schedule", "explain", f"sbx_nothing_{tag}", env=stack_env)
    assert unknown.exit_code == 2 and "no sandbox" in unknown.output
    bad = dsec_cli("schedule", "explain", "sbx.*", env=stack_env)
    assert bad.exit_code == 2 and "not a sandbox id" in bad.output
    await _end(pipe, placed, waiting)


async def test_explain_never_shows_another_sandboxs_genuine_events_copied_onto_this_one(
    js: JetStreamContext, dsec_stack: StackFixture, dsec_cli, stack_env
) -> None:
    """Attack: the genuine, signed bytes of sandbox B's ``unit.placed`` (the scheduler's) and
    ``sandbox.exited`` (its node agent's) re-published on sandbox A's subjects. Each is
    authentic, but about B: A's explanation shows A's placement and state only."""
    from dsec_core.bus import STREAM
    from dsec_core.subjects import subject_for

    pipe = await trust.pipeline(js, dsec_stack.home)
    tag = uuid.uuid4().hex[:8]
    a, b = f"sbx_victim_{tag}", f"sbx_other_{tag}"
    resources = Resources(cpus=8, memory_bytes=64 * GIB, gpus=4)
    for sid, node in ((a, "gpu-1"), (b, "n1")):
        await _built(pipe, sid)
        await pipe.scheduler.publish(
            events.UnitPlaced(
                sandbox_id=sid, unit="main", node_id=node, gpu_indices=[0], gpu_milli=1000,
                cpu_millicores=8000, memory_bytes=64 * GIB, gang_size=1, policy="dsec",
                score=0.5, feasible_nodes=1, nodes_total=2, attempt=1,
            ),
            aggregate_id=sid,
        )  # fmt: skip
        await pipe.scheduler.publish(
            events.SandboxScheduled(node_id=node, reason="dsec", resources=resources),
            aggregate_id=sid,
        )
    await pipe.nodeagent.publish(
        events.SandboxExited(exit_code=0, reason="ok", duration_s=1.0), aggregate_id=b
    )
    for event_type in ("unit.placed", "sandbox.exited"):
        msg = await js.get_last_msg(STREAM, subject_for(event_type, b))
        await js.publish(
            subject_for(event_type, a), msg.data, headers={"Nats-Msg-Id": uuid.uuid4().hex}
        )

    shown = dsec_cli("schedule", "explain", a, "--json", env=stack_env)
    assert shown.exit_code == 0, shown.output
    doc = shown.last_json()
    assert (doc["decision"], doc["node_id"], doc["state"]) == ("placed", "gpu-1", "scheduled")
    assert [(u["unit"], u["node_id"]) for u in doc["units"]] == [("main", "gpu-1")]
    await _end(pipe, a)
