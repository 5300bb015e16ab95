"""Migration on a simulated fleet, with the real scheduler: a GPU degrades and its unit moves
(``gpu.degraded`` → ``unit.migration_started`` → ``unit.migrated``, nothing lost); an operator
moves it again with `dsec unit migrate --to`; a target that cannot take it is refused with the
unit still running; a user's request and a node agent reporting a migration it is no end of are
refused by the trust gates."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import nats
import pytest
from dsec_core import events
from dsec_core.envelope import Envelope
from dsec_core.natsperms import FLEETSIM
from dsec_core.trust import Gate, KeyRing, unpack_fields
from dsec_testing import trust
from dsec_testing.stack import StackFixture

from tests.test_fleet_sim import Sim, _poll, _until_silent
from tests.test_placement_gang import _of

pytestmark = [pytest.mark.integration, pytest.mark.slow]

INVENTORY = """\
nodes:
  - {name: h100, count: 3, gpus: 2, gpu_model: H100, cpu: 64, memory: 512GiB}
  - {name: cpu, count: 1}
"""
SPEC = """\
version: "1.2"
name: migrating
base: dsec/python311:latest
entrypoint: [python, -c, "pass"]
resources: {cpu: 2, memory: 4GiB, gpu: {count: 1, type: h100}}
"""


async def test_a_degraded_gpu_moves_its_unit_and_the_operator_moves_it_again(
    dsec_stack: StackFixture, services: Any, dsec_cli: Any, stack_env: dict[str, str],
    nats_url: str, tmp_path: Path,
) -> None:  # fmt: skip
    prefix = f"mig{uuid.uuid4().hex[:6]}"
    inventory = tmp_path / "fleet.yaml"
    inventory.write_text(INVENTORY)
    env = {
        **os.environ,
        **dsec_stack.env(),
        "DSEC_NATS_NKEY_SEED": str(dsec_stack.nats_seed(FLEETSIM)),
    }
    await asyncio.to_thread(services.start, "scheduler")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dsec_fleetsim", "--inventory", str(inventory),
        "--prefix", prefix, "--heartbeat-s", "0.75", "--run-for", "600", "--status-every", "0.5",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    sim = Sim(proc)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    pipe = await trust.pipeline(js, dsec_stack.home)
    sid = f"sbx_mig_{uuid.uuid4().hex[:12]}"
    stateful = f"sbx_mis_{uuid.uuid4().hex[:12]}"
    gpu_nodes = {f"{prefix}-h100-{i}" for i in range(3)}
    try:
        await sim.until(lambda: sim.last("started"), "started", timeout=120)

        async def ready() -> bool:
            out = await asyncio.to_thread(dsec_cli, "node", "ls", "--json", env=stack_env)
            rows = [r for r in out.last_json() if r["node_id"].startswith(prefix)]
            return len(rows) == 4 and all(r["state"] == "ready" for r in rows)

        await _poll(ready, "the 4 simulated nodes ready")
        await pipe.built(SPEC, sid)
        [placed] = await _poll(lambda: _of(js, "unit.placed", sid), "unit.placed")
        first, gpu = placed.payload["node_id"], placed.payload["gpu_indices"][0]
        assert first in gpu_nodes
        await _poll(lambda: _of(js, "sandbox.ready", sid), "sandbox.ready")

        # 1. The GPU heats past its threshold: its node agent says so; the unit moves.
        node_agent = await trust.publisher(
            js, dsec_stack.home, "nodeagent", subject=f"nodeagent-{first}", node_id=first,
            acts_for="default",
        )  # fmt: skip
        for reading in (91.0, 93.0):  # a storm: one migration of the unit, not two
            await node_agent.publish(
                events.GpuDegraded(
                    node_id=first, gpu_index=gpu, signal="temperature", value=reading,
                    threshold=85.0, detail=f"GPU {gpu} at {reading} °C", source="simulated",
                ),
                aggregate_id=first,
            )  # fmt: skip
        [started] = await _poll(
            lambda: _of(js, "unit.migration_started", sid), "unit.migration_started"
        )
        s = started.payload
        assert (s["reason"], s["from_node"], s["from_gpus"], s["path"]) == (
            "gpu_degraded", first, [gpu], "criu"
        )  # fmt: skip
        assert s["to_node"] in gpu_nodes - {first} and started.producer == "scheduler"
        [moved] = await _poll(lambda: _of(js, "unit.migrated", sid), "unit.migrated")
        m = moved.payload
        second = m["to_node"]
        assert (m["migration_id"], m["from_node"], second) == (
            s["migration_id"], first, s["to_node"]
        )  # fmt: skip
        assert moved.producer == f"nodeagent-{second}"  # the target reports it
        assert m["interruption_ms"] > 0 and m["bytes_moved"] > 0
        # nothing lost: the sandbox still runs, now on the target's heartbeats only

        async def runs_on(node: str) -> bool:
            out = await asyncio.to_thread(dsec_cli, "node", "ls", "--json", env=stack_env)
            rows = {r["node_id"]: r for r in out.last_json() if r["node_id"] in gpu_nodes}
            return sid in rows[node]["sandboxes"] and not any(
                sid in r["sandboxes"] for n, r in rows.items() if n != node
            )

        await _poll(lambda: runs_on(second), f"{sid} listed by {second} only")
        for gone in ("unit.lost", "sandbox.exited", "sandbox.failed", "unit.migration_failed"):
            assert await _of(js, gone, sid) == [], gone
        assert len(await _of(js, "unit.migration_started", sid)) == 1  # the storm moved it once

        # 2. The operator moves it on to the third node.
        third = sorted(gpu_nodes - {first, second})[0]
        out = await asyncio.to_thread(
            dsec_cli, "unit", "migrate", sid, "--to", third, "--wait", "--json", env=stack_env
        )
        assert out.exit_code == 0, out.output
        row = out.last_json()
        assert (row["outcome"], row["from_node"], row["to_node"], row["reason"]) == (
            "migrated", second, third, "operator"
        )  # fmt: skip
        assert row["interruption_ms"] > 0 and row["path"] == "criu"

        # 3. A node without GPUs cannot take it: refused, the unit still runs where it was.
        out = await asyncio.to_thread(
            dsec_cli, "unit", "migrate", sid, "--to", f"{prefix}-cpu", "--json", env=stack_env
        )
        assert out.exit_code == 1, out.output
        row = out.last_json()
        assert (row["outcome"], row["stage"], row["still_running"]) == ("failed", "choose", True)
        assert "no GPU" in row["why"] and third in row["why"], row["why"]
        listed = await asyncio.to_thread(dsec_cli, "unit", "migrations", "--json", env=stack_env)
        mine = [r for r in listed.last_json() if r["sandbox_id"] == sid]
        assert [r["outcome"] for r in mine] == ["migrated", "migrated", "failed"]
        assert [r.get("interruption_ms") is not None for r in mine] == [True, True, False]

        # 4. A user may not ask for a migration: the scheduler's gate refuses it, nothing moves.
        forged = await pipe.user.publish(
            events.UnitMigrationRequested(to_node=first), aggregate_id=sid
        )

        async def rejected() -> list[Envelope]:
            got = await _of(js, "security.event_rejected", "scheduler-unit-migration_requested")
            return [e for e in got if e.payload["event_id"] == forged.envelope.id]

        [refusal] = await _poll(rejected, "the user's request refused")
        assert refusal.payload["reason"] == "unauthorized"
        assert len(await _of(js, "unit.migration_started", sid)) == 2

        # 5. A node agent may report a migration only as an end of one the scheduler started.
        claim = await node_agent.publish(
            events.UnitMigrated(
                migration_id=s["migration_id"], from_node=second, to_node=first,
                reason="operator", path="criu", interruption_ms=1.0,
            ),
            aggregate_id=sid,
        )  # fmt: skip
        gate = Gate(KeyRing(nc, js, bytes(trust.stack_root(dsec_stack.home).verify_key)), js, None)
        fields = unpack_fields(claim.sealed.wire)
        refused = await gate.check(fields, claim.envelope)
        assert refused is not None and refused[0] == "wrong-node", refused
        assert await gate.placement(sid) == third  # where the log says it runs

        # 6. A drain hands a stateful unit over to another node (no restart) and restarts a
        #    stateless one elsewhere, as before.
        await pipe.built(SPEC + "state: {}\n", stateful)
        [placed] = await _poll(lambda: _of(js, "unit.placed", stateful), "unit.placed")
        await _poll(lambda: _of(js, "sandbox.ready", stateful), "sandbox.ready (stateful)")
        drained = placed.payload["node_id"]
        out = await asyncio.to_thread(
            dsec_cli, "node", "drain", drained, "--yes", "--json", env=stack_env
        )
        assert out.exit_code == 0, out.output
        [moved] = await _poll(lambda: _of(js, "unit.migrated", stateful), "drain: unit.migrated")
        [started] = await _of(js, "unit.migration_started", stateful)
        assert (started.payload["reason"], started.payload["path"]) == ("drain", "handover")
        assert moved.payload["from_node"] == drained != moved.payload["to_node"]
        assert await _of(js, "unit.lost", stateful) == []  # moved, not restarted
        if drained == third:  # the stateless one was there too: restarted elsewhere
            [lost] = await _poll(lambda: _of(js, "unit.lost", sid), "drain: unit.lost")
            assert lost.payload["reason"] == "node drained"
            assert len(await _of(js, "unit.migration_started", sid)) == 2  # none by the drain
    finally:
        await sim.stop()
        for dead in (sid, stateful):
            await pipe.builder.publish(
                events.SandboxFailed(stage="test", reason="test over"), aggregate_id=dead
            )
        await nc.close()
        await _until_silent(dsec_cli, stack_env, prefix)
