"""GPUs through NVML (a fake ``pynvml`` module: pure unit tests of the mapping), declared
inventories and their errors, and the inventory of this very machine (real /proc, cgroups)."""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from dsec_core.settings import Settings

from dsec_nodeagent import gpu
from dsec_nodeagent.gpu import FieldReadError, InventoryError, NvmlProbe, load_declared
from dsec_nodeagent.inventory import (
    Inventory,
    cgroup_limits,
    granted_of,
    parse_cpu_max,
    parse_labels,
    parse_meminfo,
    read_host,
)

# ---------------------------------------------------------------------- a fake pynvml


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


NOT_SUPPORTED, INVALID_ARGUMENT, TIMEOUT, GPU_IS_LOST = 3, 2, 10, 15


@dataclass
class FakeGpu:
    name: str
    uuid: str
    pci: str
    total: int = 80 << 30
    used: int = 1 << 30
    temperature: int | Exception = 41
    utilization: int = 7
    ecc: tuple[int, int] | Exception = (2, 0)
    mig: int | Exception = 0
    links: list[tuple[bool, str]] = field(default_factory=list)  # (active, remote pci)
    xid_capable: bool = True


class FakeNvml:
    """The subset of ``pynvml`` the probe uses, with the same constants and error shape."""

    NVMLError = NVMLError
    NVML_ERROR_NOT_SUPPORTED = NOT_SUPPORTED
    NVML_ERROR_FUNCTION_NOT_FOUND = 13
    NVML_ERROR_INVALID_ARGUMENT = INVALID_ARGUMENT
    NVML_ERROR_TIMEOUT = TIMEOUT
    NVML_TEMPERATURE_GPU = 0
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18
    NVML_TOPOLOGY_INTERNAL, NVML_TOPOLOGY_SINGLE, NVML_TOPOLOGY_MULTIPLE = 0, 10, 20
    NVML_TOPOLOGY_HOSTBRIDGE, NVML_TOPOLOGY_NODE, NVML_TOPOLOGY_SYSTEM = 30, 40, 50
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, gpus: list[FakeGpu], levels: dict[tuple[int, int], int]) -> None:
        self.gpus = gpus
        self.levels = levels
        self.pending: list[tuple[int, int]] = []  # (gpu index, xid)
        self.shut = False

    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        self.shut = True

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> bytes:
        return self.gpus[h].uuid.encode()

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(busId=self.gpus[h].pci)

    def nvmlDeviceGetName(self, h: int) -> str:
        return self.gpus[h].name

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        g = self.gpus[h]
        return SimpleNamespace(total=g.total, used=g.used, free=g.total - g.used)

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return _value(self.gpus[h].temperature)

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=self.gpus[h].utilization, memory=3)

    def nvmlDeviceGetTotalEccErrors(self, h: int, kind: int, counter: int) -> int:
        return _value(self.gpus[h].ecc)[kind]

    def nvmlDeviceGetMigMode(self, h: int) -> list[int]:
        mode = _value(self.gpus[h].mig)
        return [mode, mode]

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        links = self.gpus[h].links
        if not links:
            raise NVMLError(NOT_SUPPORTED)
        if link >= len(links):
            raise NVMLError(INVALID_ARGUMENT)
        return 1 if links[link][0] else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> Any:
        return SimpleNamespace(busId=self.gpus[h].links[link][1])

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return self.levels[(min(a, b), max(a, b))]

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlDeviceRegisterEvents(self, h: int, types: int, es: str) -> None:
        assert types == self.nvmlEventTypeXidCriticalError and es == "event-set"
        if not self.gpus[h].xid_capable:
            raise NVMLError(NOT_SUPPORTED)

    def nvmlEventSetWait_v2(self, es: str, timeout_ms: int) -> Any:
        assert timeout_ms == 0  # polled, never waiting on the driver
        if not self.pending:
            raise NVMLError(TIMEOUT)
        index, xid = self.pending.pop(0)
        return SimpleNamespace(device=index, eventType=8, eventData=xid)

    def nvmlEventSetFree(self, es: str) -> None:
        pass


def _value(v: Any) -> Any:
    if isinstance(v, Exception):
        raise v
    return v


def _eight_way() -> FakeNvml:
    """Two GPUs joined by an active NVLink, a third on the other socket without NVLink."""
    gpus = [
        FakeGpu("NVIDIA H100 80GB HBM3", "GPU-a", "00000000:17:00.0",
                links=[(True, "00000000:65:00.0"), (False, "")]),
        FakeGpu("NVIDIA H100 80GB HBM3", "GPU-b", "0000:65:00.0",
                links=[(True, "00000000:17:00.0")], mig=1),
        FakeGpu("NVIDIA H100 80GB HBM3", "GPU-c", "00000000:CA:00.0",
                ecc=NVMLError(NOT_SUPPORTED), temperature=NVMLError(NOT_SUPPORTED),
                xid_capable=False),
    ]  # fmt: skip
    return FakeNvml(gpus, {(0, 1): 20, (0, 2): 50, (1, 2): 40})


# ---------------------------------------------------------------------- NVML mapping


@pytest.mark.unit
def test_nvml_fields_map_to_the_inventory() -> None:
    nvml = _eight_way()
    probe = NvmlProbe(nvml)
    nvml.pending = [(0, 79), (0, 48), (2, 13)]
    reading = probe.read()
    assert reading.probe == "nvml" and reading.problems == []
    a, b, c = reading.gpus
    assert (a.model, a.uuid, a.pci_bus_id) == ("NVIDIA H100 80GB HBM3", "GPU-a", "00000000:17:00.0")
    assert b.pci_bus_id == "00000000:65:00.0"  # one spelling of PCI ids, whatever NVML gave
    assert (a.memory_total_bytes, a.memory_used_bytes) == (80 << 30, 1 << 30)
    assert (a.temperature_c, a.utilization_pct) == (41.0, 7.0)
    assert (a.ecc_corrected, a.ecc_uncorrected) == (2, 0)
    assert (c.ecc_corrected, c.ecc_uncorrected, c.temperature_c) == (None, None, None)
    assert (a.xid_errors, b.xid_errors, c.xid_errors) == (2, 0, None)  # c: no XID events
    assert (a.mig_enabled, b.mig_enabled) == (False, True)
    assert [(link.link, link.active, link.remote_pci) for link in a.nvlinks] == [
        (0, True, "00000000:65:00.0"),
        (1, False, None),
    ]
    assert c.nvlinks == []  # NVLink not supported
    # An active NVLink joins a and b (NVML says MULTIPLE for their PCIe path); the rest is PCIe.
    assert a.topology == {"GPU-b": "NVLINK", "GPU-c": "SYSTEM"}
    assert b.topology == {"GPU-a": "NVLINK", "GPU-c": "NODE"}
    assert c.topology == {"GPU-a": "SYSTEM", "GPU-b": "NODE"}
    nvml.pending = [(1, 31)]
    assert [g.xid_errors for g in probe.read().gpus] == [2, 1, None]  # counted since start
    probe.close()
    assert nvml.shut


@pytest.mark.unit
def test_a_field_that_fails_is_a_problem_or_in_strict_mode_an_error() -> None:
    nvml = _eight_way()
    nvml.gpus[1].temperature = NVMLError(GPU_IS_LOST)
    reading = NvmlProbe(nvml).read()
    assert reading.gpus[1].temperature_c is None
    assert reading.problems == ["GPU 1: temperature: NVML error 15"]
    with pytest.raises(FieldReadError, match="GPU 1: temperature: NVMLError: NVML error 15"):
        NvmlProbe(_lost_temperature(), strict=True).read()


def _lost_temperature() -> FakeNvml:
    nvml = _eight_way()
    nvml.gpus[1].temperature = NVMLError(GPU_IS_LOST)
    return nvml


@pytest.mark.unit
def test_without_nvml_the_node_has_no_gpus_and_says_why() -> None:
    class NoLibrary(FakeNvml):
        def nvmlInit(self) -> None:
            raise NVMLError(12)

    reading = NvmlProbe(NoLibrary([], {})).read()
    assert (reading.gpus, reading.probe) == ([], "no NVML: NVML error 12")


@pytest.mark.unit
def test_this_machine_without_a_driver_reports_no_nvml() -> None:
    """The real pynvml on this GPU-less machine: no library, so no GPUs, and why."""
    reading = NvmlProbe().read()
    if reading.probe == "nvml":
        pytest.skip("this machine has NVML (the GPU check covers it: scripts/gpu-check.sh)")
    assert reading.gpus == [] and reading.probe.startswith("no NVML: ")


# ---------------------------------------------------------------------- declared inventories


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.unit
def test_a_declared_inventory_replaces_the_probe(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "node.yaml",
        "cpus: 96\nmemory: 1Ti\ngpus:\n"
        "  - {model: NVIDIA H100 80GB HBM3, memory: 80GiB, count: 2, link: NVLINK}\n"
        "  - {model: NVIDIA L4, memory: 24GiB, uuid: GPU-l4}\n",
    )
    declared = load_declared(path)
    gpus = gpu.declared_gpus(declared, "n7")
    assert [(g.index, g.uuid, g.model, g.memory_total_bytes) for g in gpus] == [
        (0, "GPU-n7-0", "NVIDIA H100 80GB HBM3", 80 << 30),
        (1, "GPU-n7-1", "NVIDIA H100 80GB HBM3", 80 << 30),
        (2, "GPU-l4", "NVIDIA L4", 24 << 30),
    ]
    assert gpus[0].topology == {"GPU-n7-1": "NVLINK", "GPU-l4": "SYSTEM"}
    assert (declared.cpus, declared.memory) == (96.0, 1 << 40)
    as_json = _write(tmp_path, "node.json", json.dumps({"gpus": [{"model": "A", "memory": 1}]}))
    assert load_declared(as_json).gpus[0].model == "A"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("gpus:\n  - {model: H100}\n", "gpus[0].memory: Field required"),
        ("gpus:\n  - {model: H100, memory: 80 apples}\n", "gpus[0].memory: "),
        ("gpus:\n  - {model: H100, memory: 1Gi, count: 0}\n", "gpus[0].count: "),
        ("gpus:\n  - {model: H100, memory: 1Gi, link: WIRE}\n", "gpus[0].link: Input should be"),
        ("gpus:\n  - {model: H100, memory: 1Gi, vram: 3}\n", "gpus[0].vram: Extra inputs"),
        ("gpus:\n  - {model: H, memory: 1Gi, count: 2, uuid: G}\n", "uuid names one GPU"),
        ("cpus: many\n", "cpus: "),
        ("gpu: []\n", "gpu: Extra inputs are not permitted"),
        ("- a\n- b\n", "expected a mapping with gpus"),
        ("gpus: [\n", "not valid YAML"),
    ],
)
def test_a_wrong_declared_inventory_names_the_field(
    tmp_path: Path, text: str, message: str
) -> None:
    path = _write(tmp_path, "node.yaml", text)
    with pytest.raises(InventoryError) as caught:
        load_declared(path)
    assert str(caught.value).startswith(f"DSEC_NODE_INVENTORY {path}: ")
    assert message in str(caught.value)


@pytest.mark.unit
def test_a_missing_declared_inventory_says_so(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="cannot read: No such file or directory"):
        load_declared(tmp_path / "absent.yaml")


# ---------------------------------------------------------------------- labels and cgroups


@pytest.mark.unit
def test_labels_parse_and_bad_ones_are_named() -> None:
    assert parse_labels(" zone=a , gpu=h100,empty=") == {"zone": "a", "gpu": "h100", "empty": ""}
    assert parse_labels("") == {}
    with pytest.raises(InventoryError, match="'zone' is not key=value"):
        parse_labels("zone")
    with pytest.raises(InventoryError, match="value of 'zone'"):
        parse_labels("zone=a b")
    with pytest.raises(InventoryError, match="given twice"):
        parse_labels("a=1,a=2")


@pytest.mark.unit
def test_cgroup_limits_are_the_tightest_of_the_parent_chain(tmp_path: Path) -> None:
    mount = tmp_path / "cg"
    agent = mount / "system.slice" / "dsec.slice" / "nodeagent.service"
    agent.mkdir(parents=True)
    (agent / "memory.max").write_text("1024\n")  # the agent's own cgroup: not the sandboxes'
    (agent.parent / "cpu.max").write_text("max 100000\n")
    (agent.parent / "memory.max").write_text(f"{8 << 30}\n")
    (agent.parent.parent / "cpu.max").write_text("400000 100000\n")
    (agent.parent.parent / "memory.max").write_text(f"{16 << 30}\n")
    own = "/system.slice/dsec.slice/nodeagent.service"
    assert cgroup_limits(mount, own) == (4.0, 8 << 30)
    assert cgroup_limits(mount, "/") == (None, None)
    assert parse_cpu_max("150000 100000") == 1.5 and parse_cpu_max("max 100000") is None
    assert parse_meminfo("MemTotal:  1000 kB\nMemAvailable: 500 kB\n") == {
        "MemTotal": 1_024_000,
        "MemAvailable": 512_000,
    }


@pytest.mark.unit
def test_granted_reads_v2_and_v1_limit_files(tmp_path: Path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "cpu.max").write_text("50000 100000\n")
    (v2 / "memory.max").write_text("268435456\n")
    v1cpu, v1mem = tmp_path / "cpu", tmp_path / "mem"
    v1cpu.mkdir(), v1mem.mkdir()
    (v1cpu / "cpu.cfs_quota_us").write_text("200000\n")
    (v1cpu / "cpu.cfs_period_us").write_text("100000\n")
    (v1mem / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # unlimited
    assert granted_of({"cpu": v2, "memory": v2}) == (0.5, 256 << 20)
    assert granted_of({"cpu": v1cpu, "memory": v1mem}) == (2.0, 0)
    assert granted_of({"cpu": tmp_path / "gone", "memory": tmp_path / "gone"}) == (0.0, 0)


# ---------------------------------------------------------------------- this machine


@pytest.mark.unit
def test_the_host_facts_of_this_machine(tmp_path: Path) -> None:
    facts = read_host(tmp_path / "not-yet" / "home")
    meminfo = parse_meminfo(Path("/proc/meminfo").read_text())
    assert facts.cpus <= len(os.sched_getaffinity(0)) and facts.cpus > 0
    assert 0 < facts.memory_bytes <= meminfo["MemTotal"]
    assert 0 < facts.memory_available_bytes <= meminfo["MemTotal"]
    assert facts.load1 >= 0
    assert abs(facts.disk_free_bytes - shutil.disk_usage(tmp_path).free) < 1 << 30


@pytest.mark.unit
async def test_the_inventory_of_this_machine_with_labels_and_a_declared_gpu(
    tmp_path: Path,
) -> None:
    declared = _write(tmp_path, "gpus.yaml", "gpus: [{model: NVIDIA A100, memory: 40Gi}]\n")
    settings = Settings(
        home=tmp_path, node_id="n9", node_labels="zone=b", node_inventory=declared,
        max_sandboxes=7, cpu_allocation_ratio=2.5,
    )  # fmt: skip
    sandbox = tmp_path / "sbx"
    sandbox.mkdir()
    (sandbox / "cpu.max").write_text("150000 100000\n")
    (sandbox / "memory.max").write_text(f"{1 << 30}\n")
    inventory = Inventory(settings, lambda: [{"cpu": sandbox, "memory": sandbox}] * 2)
    await inventory.start()
    found, problems = await inventory.read()
    assert problems == []
    assert (found.cpus_allocated, found.memory_allocated_bytes) == (3.0, 2 << 30)
    # not declared: the host's cores times the allocation ratio (CPU is compressible)
    assert found.cpus == round(read_host(tmp_path).cpus * 2.5, 3)
    assert found.max_sandboxes == 7 and found.labels == {"zone": "b"}
    assert found.gpu_probe == "declared"
    assert [(g.uuid, g.model) for g in found.gpus] == [("GPU-n9-0", "NVIDIA A100")]


@pytest.mark.unit
async def test_a_wrong_label_or_inventory_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="DSEC_NODE_LABELS"):
        await Inventory(Settings(home=tmp_path, node_labels="x"), list).start()
    bad = _write(tmp_path, "bad.yaml", "gpus: [{model: X}]\n")
    with pytest.raises(InventoryError, match=r"gpus\[0\].memory"):
        await Inventory(Settings(home=tmp_path, node_inventory=bad), list).start()


# ---------------------------------------------------------------------- the GPU check's entry point


@pytest.mark.unit
def test_the_gpu_check_prints_the_gpus_and_fails_on_a_field_that_crashes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert gpu.main([], nvml=_eight_way()) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["gpu_probe"] == "nvml" and [g["uuid"] for g in report["gpus"]] == [
        "GPU-a",
        "GPU-b",
        "GPU-c",
    ]
    assert gpu.main([], nvml=_lost_temperature()) == 1
    failed = json.loads(capsys.readouterr().out)
    assert failed["error"] == "GPU 1: temperature: NVMLError: NVML error 15"


@pytest.mark.unit
async def test_a_probe_that_crashes_costs_the_gpus_not_the_heartbeat(tmp_path: Path) -> None:
    class Broken(FakeNvml):
        def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
            return SimpleNamespace(free=1)  # a changed binding: .total fails outside a field

    inventory = Inventory(
        Settings(home=tmp_path), list, NvmlProbe(Broken([FakeGpu("X", "G", "0:1:0.0")], {}))
    )
    await inventory.start()
    found, problems = await inventory.read()
    assert found.gpus == [] and found.cpus > 0
    assert problems == [
        "GPU probe failed: AttributeError: 'types.SimpleNamespace' object has no attribute 'total'"
    ]


@pytest.mark.unit
def test_a_gpu_that_cannot_say_what_it_is_is_not_offered_and_said_so() -> None:
    nvml = _eight_way()
    nvml.nvmlDeviceGetName = lambda h: _value(NVMLError(GPU_IS_LOST) if h == 2 else "H100")  # type: ignore[method-assign]
    reading = NvmlProbe(nvml).read()
    assert [g.uuid for g in reading.gpus] == ["GPU-a", "GPU-b"]
    assert reading.problems == [
        "GPU 2: name: NVML error 15",
        "GPU 2 (GPU-c): no name or memory reported; not offered",
    ]
