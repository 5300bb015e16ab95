"""The simulated fleet against the real scheduler (session stack): 200 simulated 8×H100 nodes
join and `dsec node ls` lists them with their GPUs; a sandbox the scheduler places on one runs
there (its heartbeats list it, it reports `sandbox.ready`); a scripted crash makes the
scheduler declare that node lost; a placement signed by a non-scheduler is refused."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
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
from nats.js import JetStreamContext

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NODES = 200
HEARTBEAT_S = 1.5
LOST_S = 6.0
SPEC = """\
version: "1.2"
name: fleet-sim
base: dsec/python311:latest
entrypoint: [python, -c, "pass"]
resources: {cpu: 4, memory: 16GiB, gpu: {count: 8, memory: 80GiB}}
"""


class Sim:
    """``python -m dsec_fleetsim`` as a process, its JSON lines collected."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.lines: list[dict[str, Any]] = []
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        async for raw in self.proc.stdout:
            with contextlib.suppress(json.JSONDecodeError):
                self.lines.append(json.loads(raw))

    def last(self, kind: str) -> dict[str, Any] | None:
        return next((x for x in reversed(self.lines) if x.get("event") == kind), None)

    async def until(self, done: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
        deadline = time.monotonic() + timeout
        while True:
            value = done()
            if value:
                return value
            if self.proc.returncode is not None:
                err = await self.proc.stderr.read() if self.proc.stderr else b""
                raise AssertionError(f"the simulation exited: {err.decode()[-3000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"not {what} within {timeout} s; last: {self.lines[-2:]}")
            await asyncio.sleep(0.3)

    async def stop(self) -> None:
        if self.proc.returncode is None:
            self.proc.terminate()
            with contextlib.suppress(TimeoutError):  # (its stop is bounded: ~10 s at most)
                await asyncio.wait_for(self.proc.wait(), 60)
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()
        await self._reader


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_url)
    yield nc.jetstream()
    await nc.close()


async def _events(js: JetStreamContext, subject: str) -> list[Envelope]:
    return [decode(data) async for _, data in replay(js, filter_subject=subject)]


async def _submit(js: JetStreamContext, pipe: trust.Pipeline) -> str:
    """What the user, policy and builder publish for a sandbox of 8 GPUs of 80 GiB."""
    return await pipe.built(SPEC, f"sbx_fleet_{uuid.uuid4().hex[:12]}")


async def _poll(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout} s")
        await asyncio.sleep(0.5)


async def _until_silent(dsec_cli: Any, stack_env: dict[str, str], prefix: str) -> None:
    """Once the simulation stopped: none of its nodes is `ready` any more (3 heartbeats
    missed, when the scheduler stops placing there too), so no later test's sandbox is placed
    on a node nobody runs."""

    async def silent() -> bool:
        out = await asyncio.to_thread(dsec_cli, "node", "ls", "--json", env=stack_env)
        rows = [r for r in out.last_json() if r["node_id"].startswith(prefix)]
        return all(r["state"] != "ready" for r in rows)

    await _poll(silent, f"the {prefix} nodes silent", timeout=30)


async def test_a_simulated_fleet_is_a_fleet_to_the_real_scheduler(
    dsec_stack: StackFixture, services: Any, dsec_cli: Any, stack_env: dict[str, str],
    js: JetStreamContext, tmp_path: Path,
) -> None:  # fmt: skip
    prefix = f"sim{uuid.uuid4().hex[:6]}"
    crashed, forged_on = f"{prefix}-7", f"{prefix}-3"
    script = tmp_path / "script.yaml"
    hot, broken = f"{prefix}-11", f"{prefix}-9"
    script.write_text(
        "steps:\n"
        f"  - {{at: 3, node: {crashed}, crash: true}}\n"
        f"  - {{at: 17, node: {crashed}, recover: true}}\n"
        f"  - {{at: 1, node: {hot}, gpu: 0, temperature: 92, over: 2}}\n"
        f"  - {{at: 1, node: {broken}, gpu: 3, xid: 79}}\n"
    )
    env = {
        **os.environ,
        **dsec_stack.env(),
        "DSEC_NATS_NKEY_SEED": str(dsec_stack.nats_seed(FLEETSIM)),
    }
    await asyncio.to_thread(services.start, "scheduler", env={"DSEC_NODE_LOST_S": str(LOST_S)})
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dsec_fleetsim", "--nodes", str(NODES), "--gpus", "8",
        "--gpu-model", "H100", "--prefix", prefix, "--heartbeat-s", str(HEARTBEAT_S),
        "--run-for", "600", "--script", str(script), "--status-every", "0.5",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    sim = Sim(proc)
    ended: list[tuple[trust.Pipeline, str]] = []
    try:
        started = await sim.until(lambda: sim.last("started"), "started", timeout=120)
        assert started["nodes"] == NODES and started["gpus"] == NODES * 8

        # The real scheduler's read model lists every simulated node with its GPUs.
        async def listed() -> dict[str, Any] | None:
            out = await asyncio.to_thread(dsec_cli, "node", "ls", "--json", env=stack_env)
            assert out.exit_code == 0, out.output
            rows = {r["node_id"]: r for r in out.last_json() if r["node_id"].startswith(prefix)}
            return rows if len(rows) == NODES else None

        rows = await _poll(listed, f"{NODES} nodes listed by `dsec node ls`")
        # (the scripted XID 79 at 1 s may already have taken one GPU of `broken`)
        assert {r["gpus"]["H100"] for n, r in rows.items() if n != broken} == {8}
        assert all(r["cpus"] == 128.0 for r in rows.values())

        # A scripted crash: the node falls silent and the scheduler declares it lost.
        lost = await _poll(
            lambda: _events(js, filter_for("node.lost", crashed)), f"{crashed} lost", 60
        )
        assert lost[0].producer == "scheduler"

        # Scripted health, as the read model shows it: a hot GPU, a GPU fallen off the bus.
        async def health() -> dict[str, Any] | None:
            rows = await listed()
            hot_gpu = await asyncio.to_thread(
                dsec_cli, "node", "show", hot, "--json", env=stack_env
            )
            temperature = hot_gpu.last_json()["inventory"]["gpus"][0]["temperature_c"]
            if rows and rows[broken]["problems"] and temperature == 92.0:
                return rows
            return None

        rows = await _poll(health, "the scripted heat and XID 79 reported")
        assert rows[broken]["gpus"] == {"H100": 7}  # the lost GPU is no longer offered
        assert (
            f"GPU 3 (GPU-{broken}-3): no name or memory reported; not offered"
            in (rows[broken]["problems"])
        )

        # A placement by the real scheduler runs on its simulated node.
        pipe = await trust.pipeline(js, dsec_stack.home)
        sid = await _submit(js, pipe)
        ended.append((pipe, sid))

        async def scheduled() -> Envelope | None:
            found = await _events(js, filter_for("sandbox.scheduled", sid))
            return found[0] if found else None

        placed = await _poll(scheduled, f"{sid} scheduled")
        node = placed.payload["node_id"]
        assert node.startswith(prefix) and node != crashed

        async def reported() -> bool:
            beats = await _events(js, filter_for("node.heartbeat", node))
            return any(sid in b.payload["sandboxes"] for b in beats)

        await _poll(reported, f"{sid} in {node}'s heartbeat")
        ready = await _events(js, filter_for("sandbox.ready", sid))
        assert [(e.producer, e.payload["node_id"]) for e in ready] == [(f"nodeagent-{node}", node)]
        beats = await _events(js, filter_for("node.heartbeat", node))
        gpus = beats[-1].payload["inventory"]["gpus"]
        assert [g["utilization_pct"] for g in gpus] == [97.0] * 8  # all 8 taken by the unit

        # A placement signed by a producer that may not place is refused, never run.
        policy = await trust.publisher(js, dsec_stack.home, "policy")
        forged = f"sbx_forged_{uuid.uuid4().hex[:10]}"
        await policy.publish(
            events.SandboxScheduled(node_id=forged_on, resources=events.Resources(gpus=1)),
            aggregate_id=forged,
        )
        status = await sim.until(
            lambda: next((s for s in reversed(sim.lines) if s.get("refused", 0) >= 1), None),
            "the forged placement refused",
        )
        assert any(forged in r and "unauthorized" in r for r in status["last_refusals"])
        mark = time.monotonic()

        async def later_beat() -> list[Envelope] | None:
            beats = await _events(js, filter_for("node.heartbeat", forged_on))
            recent = [b for b in beats if b.time.timestamp() > time.time() - 1]
            return beats if recent and time.monotonic() - mark > HEARTBEAT_S else None

        beats = await _poll(later_beat, f"a later heartbeat of {forged_on}")
        assert all(forged not in b.payload["sandboxes"] for b in beats)
        assert not await _events(js, filter_for("sandbox.ready", forged))
        # ... and answered as a node agent's consumer answers it (once, by the node it names)
        durable = f"nodeagent-{forged_on}-sandbox-scheduled"
        answers = await _events(js, filter_for("security.event_rejected", durable))
        assert [(a.producer, a.payload["reason"], a.payload["producer"]) for a in answers] == [
            (f"nodeagent-{forged_on}", "unauthorized", "policy")
        ]

        # The crashed node recovers: it joins again and is ready.
        async def back() -> bool:
            rows = await listed()
            joined = await _events(js, filter_for("node.joined", crashed))
            return bool(rows and rows[crashed]["state"] == "ready" and len(joined) == 2)

        await _poll(back, f"{crashed} back after its recovery")
    finally:
        await sim.stop()
        for pipe, sid in ended:  # no later test finds it waiting for a node
            await pipe.builder.publish(
                events.SandboxFailed(stage="test", reason="test over"), aggregate_id=sid
            )
        await _until_silent(dsec_cli, stack_env, prefix)
    stopped = sim.last("stopped")
    assert stopped is not None and stopped["publish_errors"] == 0
    # it ran exactly the placements the real scheduler made on its nodes (ours, and any
    # sandbox another test left waiting that fits there), and refused the forged one
    placed_here = [
        e
        for e in await _events(js, filter_for("sandbox.scheduled"))
        if str(e.payload.get("node_id", "")).startswith(f"{prefix}-") and e.producer == "scheduler"
    ]
    assert stopped["placements"] == len(placed_here) >= 1 and stopped["refused"] == 1


async def test_dsec_fleet_simulate_runs_a_fleet_on_the_stack(
    dsec_stack: StackFixture, dsec_cli: Any, stack_env: dict[str, str], js: JetStreamContext
) -> None:
    """The CLI command connects as the stack's fleetsim identity (not the user's credential in
    the environment, which may not publish node events) and reports in JSON lines."""
    prefix = f"cli{uuid.uuid4().hex[:6]}"
    out = await asyncio.to_thread(
        dsec_cli, "fleet", "simulate", "--nodes", "3", "--gpus", "2", "--gpu-model",
        "A100-80GB", "--prefix", prefix, "--heartbeat-s", "0.5", "--for", "3", "--json",
        env=stack_env,
    )  # fmt: skip
    assert out.exit_code == 0, out.output
    lines = [json.loads(x) for x in out.output.splitlines() if x.startswith("{")]
    assert lines[0]["event"] == "started" and lines[0]["nodes"] == 3
    stopped = lines[-1]
    assert stopped["event"] == "stopped" and stopped["publish_errors"] == 0
    assert stopped["heartbeats"] >= 3
    beats = await _events(js, filter_for("node.heartbeat", f"{prefix}-2"))
    assert beats and beats[-1].producer == f"nodeagent-{prefix}-2"
    gpus = beats[-1].payload["inventory"]["gpus"]
    assert [g["model"] for g in gpus] == ["A100-80GB"] * 2
    assert "NVLINK" not in gpus[0]["topology"].values()  # 2 GPUs: not an 8-GPU board
    await _until_silent(dsec_cli, stack_env, prefix)
