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
from dsec_core.settings import Settings

from dsec_nodeagent import gpunode
from dsec_nodeagent.gpu import GpuReading as ProbeReading
from dsec_nodeagent.gpuenforce import MpsServers
from dsec_nodeagent.gpunode import GpuNode
from dsec_nodeagent.gpuslice import DeviceInfo, MigProfile, ProcessUsage, SliceError
from dsec_nodeagent.inventory import Inventory
from dsec_nodeagent.nvmlcall import NvmlCalls, NvmlHung

pytestmark = pytest.mark.unit
GIB = 2**30
DEADLINE_S = 0.2


@pytest.fixture
def wedge() -> Iterator[threading.Event]:
    """Set: a hung NVML call returns (every test lets its threads end)."""
    event = threading.Event()
    yield event
    event.set()


async def _until(check: Any, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


# --------------------------------------------------------------------------- the calls


async def test_a_hung_call_ends_at_its_deadline_and_nvml_counts_as_not_answering_until_it_returns(
    wedge: threading.Event,
) -> None:
    calls = NvmlCalls(DEADLINE_S)
    tried: list[str] = []

    def hangs() -> str:
        tried.append("hangs")
        wedge.wait(30)
        return "late"

    started = time.monotonic()
    with pytest.raises(NvmlHung, match=r"NVML did not answer reading the GPUs within 0\.2 s"):
        await calls.call("reading the GPUs", hangs)
    assert time.monotonic() - started < 2.0
    (thread,) = [t for t in threading.enumerate() if t.name == "nvml: reading the GPUs"]
    assert thread.daemon  # never holds the process at its exit

    # refused at once, naming the stuck call: no thread piles up behind it
    started = time.monotonic()
    with pytest.raises(NvmlHung, match=r"not answering \(reading the GPUs has not returned for"):
        await calls.call("reading the health", tried.append, "health")
    assert time.monotonic() - started < 0.1 and tried == ["hangs"]
    assert calls.stuck() is not None

    wedge.set()
    await _until(lambda: calls.stuck() is None, "the hung call to return")
    assert await calls.call("reading the health", lambda: "fine") == "fine"


async def test_errors_pass_through_and_a_quick_call_answers() -> None:
    calls = NvmlCalls(5.0)

    def fails() -> None:
        raise LookupError("GPU is lost")

    with pytest.raises(LookupError, match="GPU is lost"):
        await calls.call("reading the GPUs", fails)
    assert calls.stuck() is None
    assert await calls.call("adding", lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ValueError, match="more than 0 s"):
        NvmlCalls(0)


async def test_what_a_call_made_after_its_caller_gave_up_is_undone(
    wedge: threading.Event,
) -> None:
    """Past the deadline, and cancelled while it runs: the late result is undone, once."""
    calls = NvmlCalls(DEADLINE_S)
    undone: list[str] = []

    def makes(name: str) -> str:
        wedge.wait(30)
        return name

    with pytest.raises(NvmlHung):
        await calls.call("creating a", makes, "a", undo=undone.append)
    wedge.set()
    await _until(lambda: undone == ["a"], "the late instance to be undone")

    wedge.clear()
    task = asyncio.create_task(calls.call("creating b", makes, "b", undo=undone.append))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    wedge.set()
    await _until(lambda: undone == ["a", "b"], "the cancelled call's instance to be undone")
    assert await calls.call("creating c", makes, "c", undo=undone.append) == "c"
    await asyncio.sleep(0.05)
    assert undone == ["a", "b"]  # a result its caller took is its caller's


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
        "GPU probe: NVML is not answering (the GPU probe's read has not returned for"
    )

    wedge.set()
    await _until(lambda: inventory.calls.stuck() is None, "the probe's read to return")
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
    await _until(lambda: node.nvml.stuck() is None, "the health read to return")
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
    await _until(lambda: nvml.destroyed == [7], "the late MIG instance to be destroyed")
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
    with pytest.raises(SliceError, match="GPU slicing is off on this node: NVML did not answer"):
        await node.prepare("sbx_1", _placed("sbx_1"))
    wedge.set()  # NVML opens after all: the late handle is shut
    await _until(lambda: closed == ["late"], "the late NVML to be shut")
    await node.stop()


async def _idle() -> None:
    await asyncio.Event().wait()
