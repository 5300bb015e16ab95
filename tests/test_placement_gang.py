"""The brief's task topology placed as a gang by the real scheduler on a simulated fleet that
has its GPU models (A100-80GB, H100, MI300X nodes), and what `dsec schedule explain` tells a
user about it; a unit no node can take waits with the numbers of why."""

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
from dsec_core.bus import replay
from dsec_core.envelope import Envelope, decode
from dsec_core.natsperms import FLEETSIM
from dsec_core.subjects import filter_for
from dsec_testing import trust
from dsec_testing.stack import StackFixture

from tests.test_fleet_sim import Sim, _poll, _until_silent

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[1]
RAG = REPO / "examples" / "rag-training" / "dsec.yaml"
INVENTORY = """\
nodes:
  - {name: a100, count: 3, gpus: 8, gpu_model: A100-80GB, cpu: 96, memory: 1TiB}
  - {name: h100, count: 3, gpus: 8, gpu_model: H100, cpu: 128, memory: 2TiB}
  - {name: mi300x, count: 2, gpus: 8, gpu_model: MI300X, cpu: 192, memory: 2TiB}
"""
V100 = """\
tasks:
  - name: old-model
    compute_unit: {gpu_type: V100M32, gpus: 2}
    script: python run.py
"""


async def _submit(pipe: trust.Pipeline, text: str, filename: str) -> str:
    """What the user, policy and builder publish for ``text`` (the plan compiled from it)."""
    return await pipe.built(text, f"sbx_gang_{uuid.uuid4().hex[:12]}", filename)


async def _of(js: Any, event_type: str, sid: str) -> list[Envelope]:
    return [decode(d) async for _, d in replay(js, filter_subject=filter_for(event_type, sid))]


async def test_the_briefs_task_is_placed_as_a_gang_and_explained(
    dsec_stack: StackFixture, services: Any, dsec_cli: Any, stack_env: dict[str, str],
    nats_url: str, tmp_path: Path,
) -> None:  # fmt: skip
    prefix = f"gang{uuid.uuid4().hex[:6]}"
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
        "--prefix", prefix, "--heartbeat-s", "1.5", "--run-for", "600", "--status-every", "0.5",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    sim = Sim(proc)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    pipe = await trust.pipeline(js, dsec_stack.home)
    sids: list[str] = []
    try:
        await sim.until(lambda: sim.last("started"), "started", timeout=120)

        async def ready() -> bool:
            out = await asyncio.to_thread(dsec_cli, "node", "ls", "--json", env=stack_env)
            rows = [r for r in out.last_json() if r["node_id"].startswith(prefix)]
            return len(rows) == 8 and all(r["state"] == "ready" for r in rows)

        await _poll(ready, "the 8 simulated nodes ready")

        sid = await _submit(pipe, RAG.read_text(), str(RAG.relative_to(REPO)))
        sids.append(sid)

        async def placed() -> list[Envelope] | None:
            got = await _of(js, "unit.placed", sid)
            return got if len(got) == 3 else None

        units = {e.payload["unit"]: e for e in await _poll(placed, "3 unit.placed")}
        assert set(units) == {"embedding-gen", "llm-inference", "vector-search"}
        assert all(e.producer == "scheduler" for e in units.values())
        assert all(e.payload["gang_size"] == 3 for e in units.values())
        # each unit on a node of the model it accepts, with the GPUs its needs came to
        want = {
            "embedding-gen": ("a100", "A100-80GB", 1),
            "llm-inference": ("h100", "H100", 3),  # 2000 TFLOPS / 989 per H100
            "vector-search": ("mi300x", "MI300X", 1),
        }
        for name, (group, model, count) in want.items():
            p = units[name].payload
            assert p["node_id"].startswith(f"{prefix}-{group}-"), (name, p["node_id"])
            assert (p["gpu_model"], len(p["gpu_indices"])) == (model, count), name
            assert p["feasible_nodes"] >= 1 and p["nodes_total"] >= 8
            assert p["breakdown"], name  # the score's named terms
        scheduled = await _poll(lambda: _of(js, "sandbox.scheduled", sid), "sandbox.scheduled")
        assert scheduled[0].payload["node_id"] in {e.payload["node_id"] for e in units.values()}

        shown = await asyncio.to_thread(
            dsec_cli, "schedule", "explain", sid, "--json", env=stack_env
        )
        assert shown.exit_code == 0, shown.output
        doc = shown.last_json()
        assert doc["decision"] == "placed"
        assert {u["unit"]: u["node_id"] for u in doc["units"]} == {
            n: e.payload["node_id"] for n, e in units.items()
        }

        # A unit no node of the fleet can take waits, with the numbers of why.
        waiting = await _submit(pipe, V100, "v100.yaml")
        sids.append(waiting)
        pending = await _poll(lambda: _of(js, "sandbox.pending", waiting), "sandbox.pending")
        p = pending[-1].payload
        assert p["unit"] == "old-model" and p["nodes_total"] >= 8
        assert p["unfit"].get("no GPU of model V100M32", 0) >= 8, p["unfit"]
        table = await asyncio.to_thread(
            dsec_cli, "schedule", "explain", waiting, env={**stack_env, "COLUMNS": "220"}
        )
        assert table.exit_code == 0, table.output
        assert f"0/{p['nodes_total']} nodes:" in table.output
        assert "no GPU of model V100M32" in table.output
    finally:
        await sim.stop()
        for sid in sids:  # no later test finds them waiting or holding capacity
            await pipe.builder.publish(
                events.SandboxFailed(stage="test", reason="test over"), aggregate_id=sid
            )
        await nc.close()
        await _until_silent(dsec_cli, stack_env, prefix)
