"""GPU health on the simulated fleet against the real scheduler (session stack): a scripted GPU
heats past the operator's threshold, its node publishes `gpu.degraded`, and the scheduler places
a new unit elsewhere; the operator raises the threshold (`dsec cluster config set`), the node
publishes `gpu.recovered`, and the GPU takes work again."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
from dsec_core import events
from dsec_core.natsperms import FLEETSIM
from dsec_core.subjects import filter_for
from dsec_testing import trust
from dsec_testing.stack import StackFixture
from nats.js import JetStreamContext

from tests.test_fleet_sim import Sim, _events, _poll, _until_silent

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SPEC = """\
version: "1.2"
name: gpu-health
base: dsec/python311:latest
entrypoint: [python, -c, "pass"]
resources: {cpu: 1, memory: 1GiB, gpu: {count: 1, memory: 80GiB}}
"""


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_url)
    yield nc.jetstream()
    await nc.close()


async def _placed_on(js: JetStreamContext, sid: str) -> str:
    async def scheduled() -> str | None:
        found = await _events(js, filter_for("sandbox.scheduled", sid))
        return str(found[0].payload["node_id"]) if found else None

    return str(await _poll(scheduled, f"{sid} scheduled", 90))


async def test_a_hot_gpu_takes_nothing_new_until_it_recovers(
    dsec_stack: StackFixture, services: Any, dsec_cli: Any, stack_env: dict[str, str],
    js: JetStreamContext, tmp_path: Path,
) -> None:  # fmt: skip
    prefix = f"gh{uuid.uuid4().hex[:6]}"
    hot, cool = f"{prefix}-0", f"{prefix}-1"
    script = tmp_path / "script.yaml"
    script.write_text(f"steps:\n  - {{at: 0.5, node: {hot}, gpu: 0, temperature: 92}}\n")
    env = {
        **os.environ,
        **dsec_stack.env(),
        "DSEC_NATS_NKEY_SEED": str(dsec_stack.nats_seed(FLEETSIM)),
    }
    await asyncio.to_thread(services.start, "scheduler")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dsec_fleetsim", "--nodes", "2", "--gpus", "1",
        "--gpu-model", "H100", "--prefix", prefix, "--heartbeat-s", "1",
        "--run-for", "600", "--script", str(script), "--status-every", "0.5",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    sim = Sim(proc)
    ended: list[tuple[trust.Pipeline, str]] = []
    try:
        await sim.until(lambda: sim.last("started"), "started", timeout=120)

        # The hot GPU's node says so, signed as that node's agent.
        degraded = await _poll(
            lambda: _events(js, filter_for("gpu.degraded", hot)), f"{hot} degraded", 60
        )
        d = degraded[0]
        assert d.producer == f"nodeagent-{hot}"
        assert (d.payload["signal"], d.payload["value"], d.payload["threshold"]) == (
            "temperature", 92.0, 85.0,
        )  # fmt: skip
        assert d.payload["source"] == "simulated" and d.payload["gpu_index"] == 0

        # A new unit goes to the other node, though the hot one comes first among equals.
        pipe = await trust.pipeline(js, dsec_stack.home)
        first = await pipe.built(SPEC, f"sbx_gh_{uuid.uuid4().hex[:12]}")
        ended.append((pipe, first))
        assert await _placed_on(js, first) == cool

        # The operator raises the threshold: the GPU recovers and takes the next unit (the
        # other node's only GPU is taken).
        out = await asyncio.to_thread(
            dsec_cli, "cluster", "config", "set", "gpu.temperature_c", "100", env=stack_env
        )
        assert out.exit_code == 0, out.output
        shown = await asyncio.to_thread(
            dsec_cli, "cluster", "config", "show", "--json", env=stack_env
        )
        row = next(r for r in shown.last_json() if r["key"] == "gpu.temperature_c")
        assert (row["value"], row["set"]) == ("100", True)
        (*_, setting) = await _events(js, filter_for("cluster.config_set", "config"))
        assert setting.producer == "operator"
        assert setting.payload["config"]["gpu.temperature_c"] == "100"
        assert (setting.payload["key"], setting.payload["value"]) == ("gpu.temperature_c", "100")
        recovered = await _poll(
            lambda: _events(js, filter_for("gpu.recovered", hot)), f"{hot} recovered", 60
        )
        assert recovered[0].producer == f"nodeagent-{hot}"
        second = await pipe.built(SPEC, f"sbx_gh_{uuid.uuid4().hex[:12]}")
        ended.append((pipe, second))
        assert await _placed_on(js, second) == hot
    finally:
        await asyncio.to_thread(
            dsec_cli, "cluster", "config", "set", "gpu.temperature_c", "85", env=stack_env
        )
        await sim.stop()
        for pipe, sid in ended:
            await pipe.builder.publish(
                events.SandboxFailed(stage="test", reason="test over"), aggregate_id=sid
            )
        await _until_silent(dsec_cli, stack_env, prefix)
