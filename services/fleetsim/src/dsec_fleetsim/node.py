"""One simulated node: its GPUs, health, the units it runs, and the events it would publish.

What a node reports is what the real node agent's probe reports for the same hardware
(``dsec_nodeagent.gpu``), so the scheduler cannot tell the two apart:

* GPUs as NVML shows them (``gpu_probe = "nvml"``): uuid ``GPU-<node>-<i>``, a PCI bus id, the
  datasheet memory, temperature, utilization, volatile ECC counts (0), the XID errors counted
  since start, its NVLinks and how each pair of GPUs is joined (``topology``). A whole 8-GPU node
  of a model with a GPU-to-GPU link is one NVLink group (NVSwitch: every pair ``NVLINK``, each
  GPU's links active and ending at a switch); other nodes' GPUs are joined over PCIe (``NODE``
  within a socket's half, ``SYSTEM`` across).
* health: a GPU's temperature follows the script (a ramp to a target); an XID error adds to its
  count; XID 79 (fallen off the bus) makes it unreadable as NVML would (no longer offered, and
  two problems named, so the node is unhealthy); a crashed node publishes nothing; a recovered
  one starts over like a restarted node agent (``node.joined``, sequence 1, counters reset).
* units: a placement's GPUs, CPUs and memory are granted while it runs; the heartbeat lists it
  among the node's sandboxes (what the scheduler counts once a placement's assumption ends).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

from dsec_core import gpumodels
from dsec_core.canonical import Canonical, canonicalize
from dsec_core.events import (
    MAX_PROBLEMS,
    GpuInfo,
    GpuLink,
    NodeHeartbeat,
    NodeInventory,
    NodeJoined,
    Payload,
)
from dsec_core.gpuhealth import GpuReading, HealthTracker, LinkReading, Thresholds
from pydantic import PrivateAttr

from dsec_fleetsim.inventory import NodePlan

IDLE_C = 34.0
"""Temperature of an idle simulated GPU (°C)."""
BUSY_C = 62.0
"""Temperature of a GPU a unit runs on."""
BUSY_UTILIZATION = 97.0
FALLEN_OFF_BUS = frozenset({79})
"""XID codes after which NVML cannot read the GPU any more (79: GPU has fallen off the bus)."""
NVLINKS_PER_GPU = {"P100": 4, "V100M16": 6, "V100M32": 6, "A100-40GB": 12, "A100-80GB": 12}
"""NVLinks per GPU by model (H100/H200: 18; AMD Infinity Fabric: 7)."""
NVLINK_GROUP_GPUS = 8
"""A node of this many GPUs of a linked model is one NVLink group (an HGX/OAM board)."""
DISK_FREE = 2 * 2**40


def _pci(index: int) -> str:
    return f"00000000:{0x18 + 0x10 * index:02x}:00.0"


def _switch_pci(link: int) -> str:
    return f"00000000:{0xC0 + link % 6:02x}:00.0"


@cache
def _links(count: int) -> tuple[GpuLink, ...]:
    """A GPU's NVLinks to the NVSwitches (shared by every GPU of that link count: frozen)."""
    return tuple(GpuLink(link=n, active=True, remote_pci=_switch_pci(n)) for n in range(count))


@cache
def _links_json(links: tuple[GpuLink, ...]) -> list[Any]:
    """The canonical JSON form of a GPU's links (shared, never modified)."""
    return [Canonical(canonicalize(link.model_dump(mode="json"))) for link in links]


def gpu_json(gpu: GpuInfo) -> Canonical:
    """A GPU's canonical JSON form (what the signer would make of it), its NVLinks shared."""
    data = canonicalize(gpu.model_dump(mode="json", exclude={"nvlinks"}))
    data["nvlinks"] = _links_json(tuple(gpu.nvlinks))
    return Canonical({k: data[k] for k in sorted(data)})


class PreparedHeartbeat(NodeHeartbeat):
    """A :class:`NodeHeartbeat` whose JSON form reuses its GPUs' canonical forms, cached per
    node (most GPUs do not change between beats): signing it walks a few dozen values instead
    of the ~800 of an 8-GPU NVLink node. The bytes signed are exactly those of the plain event
    (``tests/test_node.py`` compares them)."""

    _gpus_json: list[Canonical] = PrivateAttr(default_factory=list)

    def model_dump(self, *, mode: str = "python", **kwargs: Any) -> dict[str, Any]:
        if mode != "json" or kwargs:
            return super().model_dump(mode=mode, **kwargs)
        data = super().model_dump(mode="json", exclude={"inventory": {"gpus"}})
        data["inventory"]["gpus"] = self._gpus_json
        return data


@dataclass(slots=True)
class Ramp:
    """A temperature moving linearly from ``start_c`` to ``target_c`` over ``[t0, t0+over]``."""

    t0: float
    start_c: float
    target_c: float
    over_s: float

    def at(self, now: float) -> float:
        if self.over_s <= 0 or now >= self.t0 + self.over_s:
            return self.target_c
        frac = max(0.0, (now - self.t0) / self.over_s)
        return round(self.start_c + (self.target_c - self.start_c) * frac, 1)


@dataclass(slots=True)
class Unit:
    """A placement running on the node."""

    sandbox_id: str
    cpus: float
    memory_bytes: int
    gpu_indices: tuple[int, ...]
    started: float
    until: float
    tenant: str | None = None
    key: str = ""
    """``sandbox`` or ``sandbox/unit`` (a ``unit.placed``); empty: the sandbox id."""
    reports: bool = True
    """Whether its node publishes its ``sandbox.ready``/``exited`` (``sandbox.scheduled``)."""


@dataclass(slots=True)
class GpuState:
    """What changes about one GPU."""

    ramp: Ramp | None = None
    xids: int = 0
    lost: bool = False
    ecc: int = 0
    throttle: frozenset[str] = frozenset()
    nvlink_utilization: float | None = None
    nvlink_errors: int = 0

    @property
    def scripted(self) -> bool:
        """Whether a script touched its health (else the health check has nothing to judge)."""
        return self != _RESTING


_RESTING = GpuState()


def static_gpus(plan: NodePlan) -> list[GpuInfo]:
    """The node's GPUs as NVML describes them at rest (no unit, idle temperature)."""
    if not plan.gpus or plan.gpu_model is None:
        return []
    model = gpumodels.BY_NAME.get(plan.gpu_model)
    linked = model is not None and model.nvlink and plan.gpus == NVLINK_GROUP_GPUS
    links = 0
    if linked:
        assert model is not None
        links = NVLINKS_PER_GPU.get(model.name, 7 if model.vendor == "amd" else 18)
    uuids = [f"GPU-{plan.node_id}-{i}" for i in range(plan.gpus)]
    half = max(1, plan.gpus // 2)
    gpus = []
    for i in range(plan.gpus):
        topology = {
            uuids[j]: "NVLINK" if linked else ("NODE" if i // half == j // half else "SYSTEM")
            for j in range(plan.gpus)
            if j != i
        }
        gpus.append(
            GpuInfo(
                index=i,
                uuid=uuids[i],
                model=plan.gpu_model,
                pci_bus_id=_pci(i),
                memory_total_bytes=plan.gpu_memory_bytes,
                memory_used_bytes=0,
                temperature_c=IDLE_C,
                utilization_pct=0.0,
                ecc_corrected=0,
                ecc_uncorrected=0,
                xid_errors=0,
                nvlinks=list(_links(links)),
                topology=topology,
            )
        )
    return gpus


@dataclass(slots=True)
class SimNode:
    """One simulated node's state (the fleet publishes for it)."""

    plan: NodePlan
    heartbeat_s: float
    version: str
    gpus: list[GpuInfo] = field(default_factory=list)
    health: list[GpuState] = field(default_factory=list)
    units: dict[str, Unit] = field(default_factory=dict)
    alive: bool = True
    joined: bool = False
    seq: int = 0
    run_for_s: float | None = None
    """This node's run time for new units (a script's ``run_for``; ``None``: the fleet's)."""
    tracker: HealthTracker | None = None
    """Judges its GPUs' health once a script touched them (``gpu.degraded``/``recovered``)."""
    _json: dict[tuple[int, float | None, float | None, int | None, int | None], Canonical] = field(
        default_factory=dict
    )

    def __post_init__(self) -> None:
        self.gpus = static_gpus(self.plan)
        self.health = [GpuState() for _ in self.gpus]

    @property
    def node_id(self) -> str:
        return self.plan.node_id

    # ------------------------------------------------------------------ health

    def restart(self) -> None:
        """A fresh node agent process: counters since start are zero, nothing runs."""
        self.health = [GpuState() for _ in self.gpus]
        self.tracker = None
        self.units.clear()
        self.seq = 0
        self.joined = False
        self.alive = True

    def heat(self, gpu: int, target_c: float, over_s: float, now: float) -> None:
        state = self.health[gpu]
        start = state.ramp.at(now) if state.ramp is not None else self._base_temperature(gpu)
        state.ramp = Ramp(now, start, target_c, over_s)

    def xid(self, gpu: int, code: int, count: int = 1) -> None:
        state = self.health[gpu]
        state.xids += count
        if code in FALLEN_OFF_BUS:
            state.lost = True

    def heal(self, gpu: int) -> None:
        """A GPU reset: counters, throttle and link load cleared, back to its base temperature
        (as after ``nvidia-smi -r``, which also resets the volatile counters NVML reports)."""
        self.health[gpu] = GpuState()

    def health_readings(self, now: float) -> list[GpuReading]:
        """What NVML's health fields would read now (a lost GPU is not listed)."""
        busy = self._busy()
        out = []
        for g, h in zip(self.gpus, self.health, strict=True):
            if h.lost:
                continue
            temperature = (
                h.ramp.at(now) if h.ramp is not None else (BUSY_C if g.index in busy else IDLE_C)
            )
            links = tuple(
                LinkReading(
                    link=link.link,
                    utilization_pct=h.nvlink_utilization,
                    errors_total=h.nvlink_errors,
                )
                for link in g.nvlinks
                if link.active
            )
            out.append(
                GpuReading(
                    index=g.index,
                    uuid=g.uuid,
                    temperature_c=temperature,
                    xid_total=h.xids,
                    ecc_uncorrected_total=h.ecc,
                    throttle=h.throttle,
                    links=links,
                )
            )
        return out

    def health_events(self, now: float, thresholds: Thresholds) -> list[Payload]:
        """``gpu.degraded`` / ``gpu.recovered`` / ``link.congested`` this node's GPUs call for
        now (nothing, and no cost, while no script touched them)."""
        if self.tracker is None:
            if not any(h.scripted for h in self.health):
                return []
            self.tracker = HealthTracker(self.node_id, "simulated", thresholds)
            for g in self.gpus:  # a GPU already fallen off the bus is noticed as lost
                self.tracker.track(g.index, g.uuid)
        self.tracker.thresholds = thresholds
        return self.tracker.observe(now, self.health_readings(now))

    # ------------------------------------------------------------------ units

    def free_gpus(self) -> list[int]:
        used = {i for u in self.units.values() for i in u.gpu_indices}
        return [
            g.index for g, h in zip(self.gpus, self.health, strict=True)
            if g.index not in used and not h.lost
        ]  # fmt: skip

    def _busy(self) -> set[int]:
        return {i for u in self.units.values() for i in u.gpu_indices}

    def _base_temperature(self, gpu: int) -> float:
        return BUSY_C if gpu in self._busy() else IDLE_C

    # ------------------------------------------------------------------ events

    def inventory(self, now: float) -> tuple[NodeInventory, list[str]]:
        """The inventory a heartbeat carries now, and the GPU problems NVML would report."""
        busy = self._busy()
        gpus: list[GpuInfo] = []
        problems: list[str] = []
        for g, h in zip(self.gpus, self.health, strict=True):
            if h.lost:
                problems.append(f"GPU {g.index}: name: GPU is lost")
                problems.append(
                    f"GPU {g.index} ({g.uuid}): no name or memory reported; not offered"
                )
                continue
            in_use = g.index in busy
            temperature = h.ramp.at(now) if h.ramp is not None else (BUSY_C if in_use else IDLE_C)
            if (in_use, temperature, h.xids, h.ecc) == (False, IDLE_C, 0, 0):
                gpus.append(g)
                continue
            gpus.append(
                g.model_copy(
                    update={
                        "temperature_c": temperature,
                        "utilization_pct": BUSY_UTILIZATION if in_use else 0.0,
                        "memory_used_bytes": int(g.memory_total_bytes * 0.9) if in_use else 0,
                        "xid_errors": h.xids,
                        "ecc_uncorrected": h.ecc,
                    }
                )
            )
        cpus = round(sum(u.cpus for u in self.units.values()), 3)
        memory = sum(u.memory_bytes for u in self.units.values())
        plan = self.plan
        inventory = NodeInventory(
            cpus=plan.cpus,
            memory_bytes=plan.memory_bytes,
            cpus_allocated=cpus,
            memory_allocated_bytes=memory,
            memory_available_bytes=max(0, plan.memory_bytes - memory),
            load1=round(min(cpus, plan.cpus), 2),
            disk_free_bytes=DISK_FREE,
            max_sandboxes=64,
            gpus=gpus,
            gpu_probe="nvml" if self.gpus else "no NVML: NVML Shared Library Not Found",
            labels=dict(plan.labels),
        )
        return inventory, problems

    def joined_event(self, now: float) -> NodeJoined:
        inventory, _ = self.inventory(now)
        return NodeJoined(
            node_id=self.node_id,
            hostname=self.node_id,
            version=self.version,
            inventory=inventory,
            heartbeat_s=self.heartbeat_s,
        )

    def heartbeat(self, now: float) -> PreparedHeartbeat:
        inventory, problems = self.inventory(now)
        self.seq += 1
        beat = PreparedHeartbeat(
            node_id=self.node_id,
            seq=self.seq,
            inventory=inventory,
            sandboxes=sorted({u.sandbox_id for u in self.units.values()}),
            problems=[p[:500] for p in problems[:MAX_PROBLEMS]],
            heartbeat_s=self.heartbeat_s,
        )
        beat._gpus_json = [self._gpu_json(g) for g in inventory.gpus]
        return beat

    def _gpu_json(self, gpu: GpuInfo) -> Canonical:
        key = (
            gpu.index,
            gpu.temperature_c,
            gpu.utilization_pct,
            gpu.xid_errors,
            gpu.ecc_uncorrected,
        )
        found = self._json.get(key)
        if found is None:
            if len(self._json) > 4 * max(1, len(self.gpus)):
                self._json.clear()  # a ramp makes new states each beat: keep it bounded
            found = self._json[key] = gpu_json(gpu)
        return found
