"""How a unit placed on GPUs is sliced and fenced (pure: decided here, applied by
:mod:`dsec_nodeagent.gpuenforce`).

A unit's ``unit.placed`` names its GPUs (``gpu_indices``) and, for a share, the thousandths it
takes of one GPU (``gpu_milli``). The mode, per GPU (docs/gpu.md says what each isolates):

* ``whole``: the unit has the GPU(s) to itself (``gpu_milli`` 1000 or whole GPUs).
* ``mig``: a share on a GPU whose MIG mode is on, when the operator enabled MIG
  (``gpu.mig on``): the smallest free MIG profile (from NVML) with at least the unit's share of
  the GPU's slices and its memory; its own memory and fault domain.
* ``mps``: else, when the operator left MPS on (``gpu.mps``, default on) and the MPS control
  binary exists: one MPS control daemon per GPU; the unit gets
  ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` from its share (at least 1 %) and
  ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` from its memory quota.
* ``time``: else time-slicing: no memory isolation beyond the quota watch.

Always: ``CUDA_VISIBLE_DEVICES`` names only the granted GPUs (by UUID, or the MIG instance's
UUID), only their ``/dev/nvidia<minor>`` nodes (plus ``nvidiactl``, ``nvidia-uvm``, and for MIG
the instance's ``nvidia-caps`` access nodes) are bound into the sandbox's ``/dev``, and the
sandbox's device cgroup refuses every other NVIDIA device node (:func:`device_rules`). The unit's
GPU memory quota (its share of the GPU's memory, or the spec's ``min_memory`` when larger is not
granted) is watched (:mod:`dsec_nodeagent.gpuquota`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

Mode = Literal["whole", "mig", "mps", "time"]

MIG_SLICES = 7
"""Compute slices of a MIG-capable GPU (A100/H100/H200: 7 GPCs for instances)."""

BASE_DEVICES: tuple[str, ...] = ("nvidiactl", "nvidia-uvm")
"""Device nodes every GPU unit needs besides its GPUs'."""

NVIDIA_MAJOR = 195
"""The fixed character major of ``/dev/nvidia<N>`` and ``/dev/nvidiactl``."""


@dataclass(frozen=True, slots=True)
class MigProfile:
    """One GPU-instance profile of a MIG-capable GPU, as NVML lists it."""

    profile_id: int
    name: str
    """e.g. ``1g.10gb``."""
    slices: int
    memory_bytes: int
    free: int
    """Instances of this profile that can still be created now."""


@dataclass(frozen=True, slots=True)
class DeviceInfo:
    """One GPU of the node, as the slicing needs it."""

    index: int
    uuid: str
    minor: int
    """``/dev/nvidia<minor>``."""
    memory_bytes: int
    mig_capable: bool = False
    mig_enabled: bool = False
    mig_profiles: tuple[MigProfile, ...] = ()


@dataclass(frozen=True, slots=True)
class ProcessUsage:
    """GPU memory one process uses on one GPU (``nvmlDeviceGetComputeRunningProcesses``)."""

    gpu_index: int
    pid: int
    used_bytes: int


class Nvml(Protocol):
    """What the slicing and the quota watch read from NVML (real: ``gpuenforce.PynvmlBackend``;
    pure unit tests pass a fake)."""

    def devices(self) -> list[DeviceInfo]: ...

    def processes(self) -> list[ProcessUsage]: ...


@dataclass(frozen=True)
class SliceSettings:
    """The operator's slicing choices (``dsec cluster config``) and what this node has."""

    mig: bool = False
    mps: bool = True
    mps_available: bool = False
    """``nvidia-cuda-mps-control`` is on the node."""


@dataclass(frozen=True)
class GpuGrant:
    """One GPU of a unit and how it is sliced."""

    index: int
    uuid: str
    minor: int
    mode: Mode
    memory_quota_bytes: int
    mig_profile: MigProfile | None = None
    why: str = ""


@dataclass(frozen=True)
class SlicePlan:
    """Everything the node agent applies for one unit."""

    grants: tuple[GpuGrant, ...]
    milli: int
    env: Mapping[str, str] = field(default_factory=dict)
    devices: tuple[str, ...] = ()
    """Names under ``/dev`` bound into the sandbox."""
    mps_pipes: tuple[str, ...] = ()
    """GPU uuids whose MPS pipe directory the sandbox must reach."""

    @property
    def mode(self) -> Mode:
        return self.grants[0].mode if self.grants else "whole"

    @property
    def memory_quota_bytes(self) -> int:
        return sum(g.memory_quota_bytes for g in self.grants)


class SliceError(ValueError):
    """The placement cannot be honoured on this node (a GPU index it does not have)."""


def mig_profile_for(
    profiles: Sequence[MigProfile], milli: int, memory_bytes: int
) -> MigProfile | None:
    """The smallest free profile with at least ``milli``/1000 of the slices and
    ``memory_bytes`` of memory (None: none fits, or none is free)."""
    want = math.ceil(milli * MIG_SLICES / 1000)
    fitting = [
        p for p in profiles if p.free > 0 and p.slices >= want and p.memory_bytes >= memory_bytes
    ]
    return min(fitting, key=lambda p: (p.slices, p.memory_bytes, p.profile_id), default=None)


def choose_mode(
    gpu: DeviceInfo, milli: int, quota_bytes: int, settings: SliceSettings
) -> tuple[Mode, MigProfile | None, str]:
    """The mode for a unit taking ``milli`` of ``gpu`` and why."""
    if milli >= 1000:
        return "whole", None, "the unit has the whole GPU"
    if settings.mig and gpu.mig_capable:
        if not gpu.mig_enabled:
            why_not = "MIG mode is off on the GPU (nvidia-smi -mig 1 and a GPU reset turn it on)"
        else:
            profile = mig_profile_for(gpu.mig_profiles, milli, quota_bytes)
            if profile is not None:
                return "mig", profile, f"MIG instance {profile.name}"
            why_not = f"no free MIG profile with {milli}/1000 of the GPU and its memory"
    elif settings.mig:
        why_not = "the GPU cannot do MIG"
    else:
        why_not = "MIG is off (dsec cluster config set gpu.mig on)"
    if settings.mps and settings.mps_available:
        return "mps", None, f"MPS ({why_not})"
    if not settings.mps:
        return "time", None, f"time-slicing ({why_not}; MPS is off)"
    return "time", None, f"time-slicing ({why_not}; no nvidia-cuda-mps-control on the node)"


def thread_percentage(milli: int) -> int:
    """``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` of a share: its percent, rounded up, at least 1."""
    return max(1, min(100, math.ceil(milli / 10)))


def plan_slice(
    gpu_indices: Sequence[int],
    milli: int,
    devices: Sequence[DeviceInfo],
    settings: SliceSettings,
    *,
    memory_quota_bytes: int | None = None,
    mps_pipe_dir: str = "/run/dsec/mps",
) -> SlicePlan:
    """The slicing of a unit placed on ``gpu_indices`` taking ``milli`` of each (0 or 1000:
    whole GPUs). ``memory_quota_bytes``: its GPU memory per GPU (default: its share of the
    GPU's memory). ``mps_pipe_dir``: where each GPU's MPS pipe directory is shown in the
    sandbox (``<dir>/<uuid>``).

    Raises:
        SliceError: an index this node has no GPU for.
    """
    by_index = {d.index: d for d in devices}
    milli = 1000 if milli <= 0 else min(milli, 1000)
    grants: list[GpuGrant] = []
    for index in gpu_indices:
        gpu = by_index.get(index)
        if gpu is None:
            have = ", ".join(str(i) for i in sorted(by_index)) or "none"
            raise SliceError(f"placed on GPU {index}, which this node does not have (GPUs: {have})")
        asked = max(0, memory_quota_bytes or 0)
        # A MIG profile must hold the memory the unit asked for (none asked: its slices decide;
        # profiles are quantized, a 1/4 share of 141 GiB fits 2g.35gb).
        mode, profile, why = choose_mode(gpu, milli, asked, settings)
        quota = min(asked or gpu.memory_bytes * milli // 1000, gpu.memory_bytes)
        if profile is not None:
            quota = min(profile.memory_bytes, gpu.memory_bytes)
        grants.append(GpuGrant(index, gpu.uuid, gpu.minor, mode, quota, profile, why))
    env: dict[str, str] = {}
    devs: list[str] = []
    pipes: list[str] = []
    if grants:
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
        env["CUDA_VISIBLE_DEVICES"] = ",".join(g.uuid for g in grants)
        devs = [*BASE_DEVICES, *(f"nvidia{g.minor}" for g in grants)]
        mps = [g for g in grants if g.mode == "mps"]
        if mps:
            # One client talks to one MPS server: a shared unit has one GPU.
            g = mps[0]
            pipes.append(g.uuid)
            env["CUDA_MPS_PIPE_DIRECTORY"] = f"{mps_pipe_dir}/{g.uuid}"
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(thread_percentage(milli))
            mib = max(1, g.memory_quota_bytes // 2**20)
            # The client sees its one GPU as device 0.
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={mib}M"
    return SlicePlan(tuple(grants), milli, env, tuple(devs), tuple(pipes))


def with_mig_instance(plan: SlicePlan, index: int, mig_uuid: str, caps: Sequence[str]) -> SlicePlan:
    """``plan`` once the MIG instance on GPU ``index`` exists: the client sees the instance
    (``CUDA_VISIBLE_DEVICES=MIG-…``) and may open its capability nodes (``nvidia-caps/…``)."""
    uuids = [mig_uuid if g.index == index else g.uuid for g in plan.grants]
    env = {**plan.env, "CUDA_VISIBLE_DEVICES": ",".join(uuids)}
    devices = (*plan.devices, *(c for c in caps if c not in plan.devices))
    return SlicePlan(plan.grants, plan.milli, env, devices, plan.mps_pipes)


def nvidia_majors(proc_devices: str) -> dict[str, int]:
    """Character device majors of the NVIDIA driver, from ``/proc/devices``
    (``nvidia-frontend``/``nvidia``: 195, ``nvidia-uvm``, ``nvidia-caps``, ``nvidia-nvlink``...)."""
    majors: dict[str, int] = {}
    block = False
    for line in proc_devices.splitlines():
        if line.startswith("Block devices"):
            block = True
        parts = line.split()
        if block or len(parts) != 2 or not parts[0].isdigit():
            continue
        if parts[1].startswith("nvidia"):
            majors[parts[1]] = int(parts[0])
    return majors


@dataclass(frozen=True, slots=True)
class DeviceRule:
    """Allow one character device (``minor`` None: every minor of ``major``)."""

    major: int
    minor: int | None


def device_rules(
    plan: SlicePlan, majors: Mapping[str, int], caps_minors: Sequence[int] = ()
) -> tuple[frozenset[int], tuple[DeviceRule, ...]]:
    """The device cgroup of a unit: the NVIDIA majors it guards (every other device is left to
    the sandbox's other layers) and the devices of those majors it allows: its GPUs'
    ``nvidia<minor>``, ``nvidiactl`` (195:255), every ``nvidia-uvm`` minor, and the given
    ``nvidia-caps`` minors (a MIG instance's access capabilities)."""
    guarded = frozenset({NVIDIA_MAJOR, *majors.values()})
    allowed: list[DeviceRule] = [DeviceRule(NVIDIA_MAJOR, 255)]
    allowed += [DeviceRule(NVIDIA_MAJOR, g.minor) for g in plan.grants]
    uvm = majors.get("nvidia-uvm")
    if uvm is not None:
        allowed.append(DeviceRule(uvm, None))
    caps = majors.get("nvidia-caps")
    if caps is not None:
        allowed += [DeviceRule(caps, m) for m in caps_minors]
    return guarded, tuple(allowed)
