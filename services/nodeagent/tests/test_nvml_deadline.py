"""A hung NVML costs the node agent its GPUs, never its heartbeat, its launches or its stop
(pure unit tests: NVML is a fake whose calls block until the test lets them return, as the
real one's do when a GPU falls off the bus).

Before: every NVML call ran on ``asyncio.to_thread`` with no deadline. The heartbeat's GPU read
blocked, so no heartbeat went out and the scheduler declared the node lost after three beats
(and placed its running sandboxes again elsewhere); the health check, the quota watch, a launch
creating a MIG instance and a release destroying one waited for good, each holding a thread of
the default pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from dsec_core import events
from dsec_core.events import GpuInfo, Payload
from dsec_core.gpuhealth import ClusterConfig, GpuReading
from dsec_core.nvmlcall import NvmlCalls, NvmlHung
from dsec_core.settings import Settings
from dsec_testing.inmemory import until

from dsec_nodeagent import gpunode
from dsec_nodeagent.gpu import GpuReading as ProbeReading
from dsec_nodeagent.gpuenforce import MpsServers
from dsec_nodeagent.gpunode import GpuNode
from dsec_nodeagent.gpuslice import DeviceInfo, MigProfile, ProcessUsage, SliceError
from dsec_nodeagent.inventory import Inventory

pytestmark = pytest.mark.unit
GIB = 2**30
DEADLINE_S = 0.2


@pytest.fixture
def wedge() -> Iterator[threading.Event]:
    """While clear, the fake NVML's hung calls block; each test ends by setting it."""
    with contextlib.ExitStack() as end:
        event = threading.Event()
        end.callback(event.set)
        yield event


# --------------------------------------------------------------------------- the heartbeat


@dataclass
class HungProbe:
    """The heartbeat's GPU probe: its read blocks while ``wedge`` is clear."""

    wedge: threading.Event
    reads: int = 0

    def read(self) -> ProbeReading:
        self.reads += 1
        self.wedge.wait(30)
        gpu = GpuInfo(index=0, uuid="GPU-0", model="H100", memory_total_bytes=80 * GIB)
        return ProbeReading([gpu], "nvml")

    def close(self) -> None:
        pass


async def test_a_hung_gpu_probe_costs_the_heartbeat_its_gpus_not_its_time(
    tmp_path: Path, wedge: threading.Event
) -> None:
    """The read waits one beat at most, then the node says why it has no GPUs (the scheduler
    stops placing on it; it does not declare it lost); the next beats say so at once."""
    settings = Settings(home=tmp_path, heartbeat_s=DEADLINE_S, nvml_timeout_s=30)
    probe = HungProbe(wedge)
    inventory = Inventory(settings, list, probe)  # type: ignore[arg-type]
    await inventory.start()
    started = time.monotonic()
    found, problems = await inventory.read()
    assert time.monotonic() - started < 2.0
    assert found.gpus == [] and found.gpu_probe == "nvml" and found.cpus > 0
    assert problems == ["GPU probe: NVML did not answer the GPU probe's read within 0.2 s"]

    started = time.monotonic()
    found, problems = await inventory.read()
    assert time.monotonic() - started < 0.5 and probe.reads == 1
    assert found.gpus == [] and problems[0].startswith(
        "GPU probe: the GPU probe's read not tried again: NVML has not answered the previous one"
    )

    wedge.set()
    await until(lambda: not inventory.calls.in_flight(), "the probe's read to return")
    found, problems = await inventory.read()
    assert [g.uuid for g in found.gpus] == ["GPU-0"] and problems == []
    await inventory.close()


# --------------------------------------------------------------------------- the GPU side


@dataclass
class HungNvml:
    """One MIG-enabled GPU whose calls block while ``wedge`` is clear (``hang`` names which)."""

    wedge: threading.Event
    hang: set[str] = field(default_factory=set)
    created: list[int] = field(default_factory=list)
    destroyed: list[int] = field(default_factory=list)

    def _maybe_hang(self, name: str) -> None:
        if name in self.hang:
            self.wedge.wait(30)

    def devices(self) -> list[DeviceInfo]:
        self._maybe_hang("devices")
        profile = MigProfile(profile_id=19, name="1g.10gb", slices=1, memory_bytes=10 * GIB, free=7)
        return [DeviceInfo(0, "GPU-0", 0, 80 * GIB, True, True, (profile,))]

    def processes(self) -> list[ProcessUsage]:
        self._maybe_hang("processes")
        return []

    def health(self, xids: dict[str, int]) -> list[GpuReading]:
        self._maybe_hang("health")
        return [GpuReading(0, "GPU-0", 50.0)]

    def create_mig(self, index: int, profile: MigProfile) -> tuple[str, Any, Any]:
        self._maybe_hang("create_mig")
        gi = 7 + len(self.created)
        self.created.append(gi)
        return f"MIG-{gi}", gi, 0

    def mig_ids(self, gi: Any, ci: Any) -> tuple[int, int]:
        return gi, ci

    def destroy_mig(self, gi: Any, ci: Any) -> None:
        self._maybe_hang("destroy_mig")
        self.destroyed.append(gi)

    def close(self) -> None:
        self._maybe_hang("close")


@dataclass
class Published:
    events: list[Payload] = field(default_factory=list)

    async def publish(self, payload: Payload, aggregate_id: str) -> None:
        self.events.append(payload)


class NoConfig:
    async def newest(self, subject: str, **_: Any) -> tuple[None, int]:
        return None, 0


def _node(tmp_path: Path, nvml: Any, published: Published | None = None) -> GpuNode:
    settings = Settings(home=tmp_path, node_id="gpu-1", heartbeat_s=DEADLINE_S)
    node = GpuNode(
        settings, (published or Published()).publish, lambda: NoConfig(),  # type: ignore[arg-type, return-value]
        backend=nvml, mps=MpsServers(tmp_path / "mps", binary=None), nvml=NvmlCalls(DEADLINE_S),
    )  # fmt: skip
    node.config = ClusterConfig.of({"gpu.mig": "on"})
    return node


def _placed(sid: str) -> events.UnitPlaced:
    return events.UnitPlaced(
        sandbox_id=sid, unit="main", node_id="gpu-1", gpu_indices=[0], gpu_milli=100,
        policy="dsec",
    )  # fmt: skip


async def test_a_hung_health_read_reports_every_gpu_lost_on_time(
    tmp_path: Path, wedge: threading.Event
) -> None:
    nvml, published = HungNvml(wedge), Published()
    node = _node(tmp_path, nvml, published)
    gpus = [GpuInfo(index=0, uuid="GPU-0", model="H100", memory_total_bytes=80 * GIB)]
    assert await node.health(gpus, now=0) == []
    nvml.hang.add("health")
    started = time.monotonic()
    (lost,) = await node.health(gpus, now=1)
    assert time.monotonic() - started < 2.0
    assert isinstance(lost, events.GpuDegraded) and (lost.signal, lost.severity) == (
        "lost", "critical",
    )  # fmt: skip
    assert await node.health(gpus, now=2) == []  # said once, refused at once meanwhile
    nvml.hang.clear()
    wedge.set()
    await until(lambda: node.nvml.stuck() is None, "the health read to return")
    assert await node.health(gpus, now=3) == []  # answering again: quiet for a while first
    (back,) = await node.health(gpus, now=2 + node.tracker.thresholds.recover_after_s)
    assert isinstance(back, events.GpuRecovered) and back.gpu_uuid == "GPU-0"


async def test_a_launch_whose_mig_instance_nvml_never_makes_fails_and_a_late_one_is_destroyed(
    tmp_path: Path, wedge: threading.Event
) -> None:
    nvml = HungNvml(wedge, hang={"create_mig"})
    node = _node(tmp_path, nvml)
    started = time.monotonic()
    with pytest.raises(NvmlHung, match=r"creating a 1g\.10gb MIG instance on GPU 0 within 0\.2 s"):
        await node.prepare("sbx_1", _placed("sbx_1"))
    assert time.monotonic() - started < 2.0
    assert node.units == {} and list(node.records.glob("*.json")) == []
    with pytest.raises(NvmlHung, match="not answering"):  # the next launch fails at once
        await node.prepare("sbx_2", _placed("sbx_2"))
    wedge.set()  # NVML makes the instance after all: nobody wants it
    await until(lambda: nvml.destroyed == [7], "the late MIG instance to be destroyed")
    assert nvml.created == [7] and node.units == {}


async def test_a_release_nvml_does_not_answer_keeps_its_record_and_the_stop_ends(
    tmp_path: Path, wedge: threading.Event
) -> None:
    nvml = HungNvml(wedge)
    node = _node(tmp_path, nvml)
    await node.prepare("sbx_1", _placed("sbx_1"))
    assert len(list(node.records.glob("*.json"))) == 1
    nvml.hang.update({"destroy_mig", "close"})
    started = time.monotonic()
    await node.release("sbx_1")
    await node.stop()  # its NVML shutdown is not tried while NVML hangs
    assert time.monotonic() - started < 2.0
    assert nvml.destroyed == [] and len(list(node.records.glob("*.json"))) == 1


async def test_a_hung_quota_read_is_skipped_not_waited_for(
    tmp_path: Path, wedge: threading.Event
) -> None:
    nvml = HungNvml(wedge, hang={"processes"})
    node = _node(tmp_path, nvml)
    await node.prepare("sbx_1", _placed("sbx_1"))
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    (cgroup / "cgroup.procs").write_text("100\n")
    node.units["sbx_1"].cgroup_dir = cgroup
    started = time.monotonic()
    with pytest.raises(NvmlHung):
        await node.check_quotas()
    assert time.monotonic() - started < 2.0


async def test_nvml_that_hangs_at_the_start_turns_slicing_off_and_says_why(
    tmp_path: Path, wedge: threading.Event, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed: list[str] = []

    class HungBackend:
        def __init__(self) -> None:
            wedge.wait(30)

        def close(self) -> None:
            closed.append("late")

    monkeypatch.setattr(gpunode, "PynvmlBackend", HungBackend)
    node = _node(tmp_path, None)
    node._watch_forever = _idle  # type: ignore[method-assign]
    started = time.monotonic()
    await node.start()
    assert time.monotonic() - started < 2.0
    assert node.backend is None
    with pytest.raises(SliceError, match="GPU slicing is off on this node: NVML is not answer"):
        await node.prepare("sbx_1", _placed("sbx_1"))
    wedge.set()  # NVML opens after all: the late handle is shut
    await until(lambda: closed == ["late"] and not node.nvml.in_flight(), "the late NVML shut")
    # the driver answers again: the next launch opens NVML and gets its slice (before, slicing
    # stayed off until a restart while the heartbeat offered the GPUs again)
    monkeypatch.setattr(gpunode, "PynvmlBackend", lambda: HungNvml(wedge))
    plan = await node.prepare("sbx_1", _placed("sbx_1"))
    assert plan is not None and plan.mode == "mig" and node.off_reason is None
    await node.release("sbx_1")
    await node.stop()


async def test_a_slow_heartbeat_read_costs_only_the_heartbeat_its_gpus(tmp_path: Path) -> None:
    """The heartbeat's read waits one beat; one slower than that (a first open) must not make
    a launch, whose NVML deadline is 30 s, fail."""

    class SlowProbe:
        def read(self) -> ProbeReading:
            time.sleep(0.5)
            return ProbeReading([], "nvml")

        def close(self) -> None:
            pass

    settings = Settings(home=tmp_path, node_id="gpu-1", heartbeat_s=DEADLINE_S, nvml_timeout_s=30)
    node = _node(tmp_path, HungNvml(threading.Event()))
    node.nvml = NvmlCalls(settings.nvml_timeout_s)
    inventory = Inventory(settings, list, SlowProbe(), calls=node.nvml)  # type: ignore[arg-type]
    _, problems = await inventory.read()
    assert problems == ["GPU probe: NVML did not answer the GPU probe's read within 0.2 s"]
    plan = await node.prepare("sbx_1", _placed("sbx_1"))
    assert plan is not None and plan.mode == "mig"
    await until(lambda: node.nvml.stuck() is None and not node.nvml.in_flight(), "the slow read")


async def _idle() -> None:
    await asyncio.Event().wait()
