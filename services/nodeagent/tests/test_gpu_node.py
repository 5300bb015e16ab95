"""The node agent's GPU side with a fake NVML (pure unit tests): a unit's slice applied to its
sandbox config, its quota watch warning then stopping it, the GPUs' health becoming events."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from dsec_core import events
from dsec_core.events import GpuInfo, Payload
from dsec_core.gpuhealth import GpuReading
from dsec_core.settings import Settings

from dsec_nodeagent.gpuenforce import MpsServers
from dsec_nodeagent.gpunode import GpuNode
from dsec_nodeagent.gpuslice import DeviceInfo, ProcessUsage
from dsec_nodeagent.sandbox.models import SandboxConfig

pytestmark = pytest.mark.unit
GIB = 2**30


@dataclass
class FakeNvml:
    """Two 80 GiB GPUs; processes and health as the test sets them."""

    procs: list[ProcessUsage] = field(default_factory=list)
    temperature: float = 50.0

    def devices(self) -> list[DeviceInfo]:
        return [DeviceInfo(i, f"GPU-{i}", i, 80 * GIB) for i in range(2)]

    def processes(self) -> list[ProcessUsage]:
        return list(self.procs)

    def health(self, xids: dict[str, int]) -> list[GpuReading]:
        return [GpuReading(0, "GPU-0", self.temperature, xids.get("GPU-0")), GpuReading(1, "GPU-1")]

    def close(self) -> None:
        pass


class FakeGate:
    async def find(self, subject: str, **_: Any) -> None:
        return None


@dataclass
class Recorder:
    published: list[tuple[Payload, str]] = field(default_factory=list)
    stopped: list[tuple[str, str]] = field(default_factory=list)

    async def publish(self, payload: Payload, aggregate_id: str) -> None:
        self.published.append((payload, aggregate_id))

    async def stop(self, sid: str, detail: str) -> None:
        self.stopped.append((sid, detail))


def _node(tmp_path: Path, nvml: FakeNvml, rec: Recorder, mps: bool = True) -> GpuNode:
    settings = Settings(home=tmp_path, node_id="gpu-1")
    servers = MpsServers(tmp_path / "mps", binary="/bin/true" if mps else None)
    node = GpuNode(settings, rec.publish, lambda: FakeGate(), backend=nvml, mps=servers)  # type: ignore[arg-type, return-value]
    node.stop_unit = rec.stop
    return node


def _placed(indices: list[int], milli: int) -> events.UnitPlaced:
    return events.UnitPlaced(
        sandbox_id="sbx_1", unit="main", node_id="gpu-1", gpu_indices=indices, gpu_milli=milli,
        policy="dsec",
    )  # fmt: skip


async def test_a_shared_unit_gets_mps_its_gpu_only_and_is_stopped_over_quota(
    tmp_path: Path,
) -> None:
    nvml, rec = FakeNvml(), Recorder()
    node = _node(tmp_path, nvml, rec)
    plan = await node.prepare("sbx_1", _placed([1], 250))
    assert plan is not None and plan.mode == "mps"
    assert node.mps.users == {
        "GPU-1": {node.units["sbx_1"].holder}
    }  # its GPU's MPS daemon, started
    config = node.apply(
        SandboxConfig(sandbox_id="sbx_1", argv=["python"], runtime=Path("/x")), plan
    )
    assert config.env["CUDA_VISIBLE_DEVICES"] == "GPU-1"
    assert config.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert config.env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "0=20480M"
    assert config.gpu_devices == ["nvidiactl", "nvidia-uvm", "nvidia1"]
    assert config.gpu_binds == {"/run/dsec/mps/GPU-1": tmp_path / "mps" / "GPU-1" / "pipe"}

    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    (cgroup / "cgroup.procs").write_text("100\n")
    node.units["sbx_1"].cgroup_dir = cgroup  # (attach's device program needs root: kernel test)
    nvml.procs = [ProcessUsage(1, 100, 19 * GIB), ProcessUsage(1, 555, 40 * GIB)]
    ((sid, warn),) = await node.check_quotas(now=0)
    assert sid == "sbx_1" and warn.action == "warn"  # 19 of 20 GiB: 95 %
    nvml.procs = [ProcessUsage(1, 100, 22 * GIB)]
    await node.check_quotas(now=1)
    await node.check_quotas(now=3)
    assert rec.stopped == []  # within the grace (5 s)
    await node.check_quotas(now=7)
    kinds = [
        (p.action, p.rule_id, a) for p, a in rec.published if isinstance(p, events.PolicyViolation)
    ]
    assert kinds == [("log", "gpu-memory", "sbx_1")] * 2 + [("deny", "gpu-memory", "sbx_1")]
    assert rec.stopped and rec.stopped[0][0] == "sbx_1"
    assert (
        "GPU 1: 22.00 GiB of its 20.00 GiB GPU memory quota: over it for 6.0 s" in rec.stopped[0][1]
    )
    detail = await node.release("sbx_1")
    assert detail == rec.stopped[0][1] and node.mps.users == {}  # its daemon told to quit


async def test_whole_gpus_time_slicing_and_health(tmp_path: Path) -> None:
    nvml, rec = FakeNvml(), Recorder()
    node = _node(tmp_path, nvml, rec, mps=False)
    whole = await node.prepare("sbx_1", _placed([0, 1], 1000))
    assert whole is not None and [g.mode for g in whole.grants] == ["whole", "whole"]
    assert node.units["sbx_1"].watch is None  # no neighbour on its GPUs to protect
    await node.release("sbx_1")
    shared = await node.prepare("sbx_2", _placed([0], 500))
    assert (
        shared is not None and shared.mode == "time" and "CUDA_MPS_PIPE_DIRECTORY" not in shared.env
    )
    assert await node.prepare("sbx_3", _placed([], 0)) is None
    gpus = [GpuInfo(index=0, uuid="GPU-0", model="H100", memory_total_bytes=80 * GIB, xid_errors=0)]
    assert await node.health(gpus, now=0) == []
    nvml.temperature = 91
    (hot,) = await node.health(gpus, now=1)
    assert isinstance(hot, events.GpuDegraded) and (hot.node_id, hot.signal, hot.source) == (
        "gpu-1", "temperature", "nvml",
    )  # fmt: skip
    nvml.temperature = 60
    (back,) = await node.health(gpus, now=2)
    assert isinstance(back, events.GpuRecovered)


async def test_without_nvml_a_declared_gpu_is_only_named(tmp_path: Path) -> None:
    rec = Recorder()
    settings = Settings(home=tmp_path, node_id="gpu-1")
    node = GpuNode(settings, rec.publish, lambda: FakeGate())  # type: ignore[arg-type, return-value]
    node.declared = [GpuInfo(index=0, uuid="GPU-decl-0", model="L4", memory_total_bytes=24 * GIB)]
    plan = await node.prepare("sbx_1", _placed([0], 300))
    assert plan is not None and plan.mode == "time"
    assert plan.env["CUDA_VISIBLE_DEVICES"] == "GPU-decl-0" and plan.devices == ()
    assert node.units["sbx_1"].watch is None  # nothing to read GPU memory from


class FakePynvml:
    """The subset of ``pynvml`` :class:`PynvmlBackend` calls (two GPUs; GPU 1 has MIG on)."""

    NVML_DEVICE_MIG_ENABLE = 1
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18
    NVML_NVLINK_ERROR_DL_REPLAY, NVML_NVLINK_ERROR_DL_RECOVERY = 0, 1
    NVML_NVLINK_ERROR_DL_CRC_FLIT = 2
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_GPU_INSTANCE_PROFILE_COUNT = 3

    def __init__(self) -> None:
        self.tx_kib = 0

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> bytes:
        return f"GPU-{h}".encode()

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(total=80 * GIB, used=GIB)

    def nvmlDeviceGetMinorNumber(self, h: int) -> int:
        return 4 + h

    def nvmlDeviceGetMigMode(self, h: int) -> list[int]:
        if h == 0:
            raise RuntimeError("not supported")
        return [1, 1]

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: int, profile: int) -> Any:
        if profile == 1:
            raise RuntimeError("not supported")
        return SimpleNamespace(
            id=profile * 10, sliceCount=1 + profile * 3, memorySizeMB=10240 * (1 + profile * 3)
        )

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, h: int, profile_id: int) -> int:
        return 2 if profile_id == 0 else 1

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return [SimpleNamespace(pid=100 + h, usedGpuMemory=GIB * (h + 1)),
                SimpleNamespace(pid=200, usedGpuMemory=None)]  # fmt: skip

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 70 + h

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        return 3 * h

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h: int) -> int:
        return 0x40 if h else 0x1

    def nvmlDeviceGetNvLinkVersion(self, h: int, link: int) -> int:
        return 4

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if h == 1 or link >= 2:
            raise RuntimeError("invalid argument")  # no (more) links
        return 1

    def nvmlDeviceGetNvLinkErrorCounter(self, h: int, link: int, kind: int) -> int:
        return 10 * (kind + 1) + link

    def nvmlDeviceGetFieldValues(self, h: int, fields: list[tuple[int, int]]) -> list[Any]:
        value = SimpleNamespace(ullVal=self.tx_kib)
        return [SimpleNamespace(nvmlReturn=0, value=value)]


def test_the_pynvml_backend_maps_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    from dsec_nodeagent import gpuenforce

    fake = FakePynvml()
    backend = gpuenforce.PynvmlBackend(fake)
    a, b = backend.devices()
    assert (a.uuid, a.minor, a.mig_capable, a.mig_profiles) == ("GPU-0", 4, False, ())
    assert (b.minor, b.mig_capable, b.mig_enabled) == (5, True, True)
    assert [(p.profile_id, p.name, p.slices, p.free) for p in b.mig_profiles] == [
        (0, "1g.10gb", 1, 2), (2, "7g.70gb", 7, 1),
    ]  # fmt: skip
    assert backend.processes() == [ProcessUsage(0, 100, GIB), ProcessUsage(1, 101, 2 * GIB)]
    clock = iter([100.0, 101.0])
    monkeypatch.setattr(gpuenforce.time, "monotonic", lambda: next(clock, 101.0))
    first = backend.health({"GPU-0": 2})
    fake.tx_kib = 12_207_031  # 12.5e9 bytes in the second since: half of a 25 GB/s link
    second = backend.health({"GPU-0": 2})
    g0, g1 = first
    assert (g0.temperature_c, g0.xid_total, g0.ecc_uncorrected_total) == (70.0, 2, 0)
    assert g0.throttle == frozenset({"gpu_idle"}) and g1.throttle == frozenset({"hw_thermal"})
    assert [(link.link, link.errors_total, link.utilization_pct) for link in g0.links] == [
        (0, 60, None), (1, 63, None),
    ]  # fmt: skip
    assert g1.links == () and second[0].links[0].utilization_pct == 50.0


async def test_the_node_agent_slices_only_its_own_current_placement(tmp_path: Path) -> None:
    """``NodeAgent._gpu_slice``: the unit's latest ``unit.placed`` here, for the attempt it
    runs as, with GPUs; anything else leaves the sandbox's config as it is."""
    from dsec_core.envelope import Envelope
    from dsec_core.spec import compile_plan, load_spec

    from dsec_nodeagent.agent import NodeAgent, StartRefused

    rec = Recorder()
    agent = object.__new__(NodeAgent)
    agent.node_id = "gpu-1"
    agent._attempts = {"sbx_1": 2}
    agent.gpus = _node(tmp_path, FakeNvml(), rec)
    found: dict[str, events.UnitPlaced | None] = {"placed": None}

    async def maybe_last(event_type: str, sid: str) -> Envelope | None:
        assert event_type == "unit.placed"
        placed = found["placed"]
        return None if placed is None else SimpleNamespace(decoded=lambda: placed)  # type: ignore[return-value]

    agent._maybe_last = maybe_last  # type: ignore[method-assign]
    spec = load_spec('version: "1.2"\nname: g\nbase: b\nentrypoint: [python]\n', "g.yaml").spec
    assert spec is not None
    plan = compile_plan(spec)
    config = SandboxConfig(sandbox_id="sbx_1", argv=["python"], runtime=Path("/x"))
    assert await agent._gpu_slice("sbx_1", plan, config) is config  # no unit.placed
    for other in (
        _placed([1], 250).model_copy(update={"node_id": "gpu-2", "attempt": 2}),
        _placed([1], 250).model_copy(update={"attempt": 1}),  # an older placement
        _placed([], 0).model_copy(update={"attempt": 2}),  # no GPU
    ):
        found["placed"] = other
        assert await agent._gpu_slice("sbx_1", plan, config) is config
    found["placed"] = _placed([1], 250).model_copy(update={"attempt": 2})
    sliced = await agent._gpu_slice("sbx_1", plan, config)
    assert sliced.env["CUDA_VISIBLE_DEVICES"] == "GPU-1" and sliced.gpu_devices[-1] == "nvidia1"
    found["placed"] = _placed([7], 250).model_copy(update={"attempt": 2})
    with pytest.raises(
        StartRefused, match="GPU slice: placed on GPU 7, which this node does not have"
    ):
        await agent._gpu_slice("sbx_2", plan, config)
