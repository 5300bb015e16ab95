"""What this node offers sandboxes and what of it is granted: the inventory of its heartbeats.

* **CPUs and memory sandboxes may use**: the cgroup v2 limits (``cpu.max``, ``memory.max``) of
  the node agent's parent cgroup and its ancestors, when set (a node agent in a container or a
  systemd slice with limits); else the CPUs of its affinity mask and ``MemTotal``. A declared
  inventory (``DSEC_NODE_INVENTORY``) may state both instead.
* **Granted**: the sum of the limits of the running sandboxes' cgroups (their plans' limits, as
  the kernel holds them, so re-adopted sandboxes count too).
* **Host now**: ``MemAvailable``, the 1-minute load, the free disk of ``DSEC_HOME``.
* ``max_sandboxes`` (``DSEC_MAX_SANDBOXES``), ``labels`` (``DSEC_NODE_LABELS``: ``k=v,k=v``)
  and the GPUs (:mod:`dsec_nodeagent.gpu`), read with a deadline of one heartbeat
  (:mod:`dsec_core.nvmlcall`): a hung driver makes the heartbeat report no GPUs and the
  problem, never makes it late (three late beats and the scheduler declares the node lost).

Every file read happens in a thread (:func:`asyncio.to_thread`), never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dsec_core.events import NodeInventory
from dsec_core.nvmlcall import NvmlCalls, NvmlHung
from dsec_core.settings import Settings

from dsec_nodeagent.gpu import (
    DeclaredInventory,
    GpuReading,
    InventoryError,
    NvmlProbe,
    declared_gpus,
    load_declared,
)

log = logging.getLogger(__name__)

_LABEL_KEY = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_./-]{0,61}[A-Za-z0-9])?")
_LABEL_VALUE = re.compile(r"([A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?")
_V1_UNLIMITED = 1 << 62  # memory.limit_in_bytes of an unlimited v1 cgroup is near 2**63


@dataclass(frozen=True)
class HostFacts:
    """The host as the node agent sees it now."""

    cpus: float
    memory_bytes: int
    memory_available_bytes: int
    load1: float
    disk_free_bytes: int


# ---------------------------------------------------------------------- pure parsing


def parse_cpu_max(text: str) -> float | None:
    """``cpu.max`` (``"200000 100000"`` -> 2.0 cores); ``None`` for ``max`` (no limit)."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    period = int(parts[1]) if len(parts) > 1 else 100_000
    return int(parts[0]) / period


def parse_memory_max(text: str) -> int | None:
    """``memory.max`` in bytes; ``None`` for ``max`` (no limit)."""
    value = text.strip()
    return None if value in ("", "max") else int(value)


def parse_meminfo(text: str) -> dict[str, int]:
    """``/proc/meminfo`` as bytes per key."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            out[key.strip()] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    return out


def own_cgroup(proc_cgroup: str) -> str | None:
    """The cgroup v2 path of a process from its ``/proc/<pid>/cgroup`` (``0::/path``)."""
    for line in proc_cgroup.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return None


def cgroup2_mount(mounts: str) -> Path | None:
    """Where cgroup2 is mounted, from ``/proc/self/mounts``."""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) > 2 and fields[2] == "cgroup2":
            return Path(fields[1])
    return None


def parse_labels(text: str) -> dict[str, str]:
    """``DSEC_NODE_LABELS`` (``zone=a,gpu=h100``) as a mapping.

    Raises:
        InventoryError: an item is not ``key=value`` or uses other characters than letters,
            digits and ``_.-`` (keys also ``/``), at most 63 each.
    """
    labels: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, value = item.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise InventoryError(
                f"DSEC_NODE_LABELS: {item!r} is not key=value (e.g. zone=a,gpu=h100)"
            )
        if not _LABEL_KEY.fullmatch(key):
            raise InventoryError(
                f"DSEC_NODE_LABELS: key {key!r}: 1-63 letters, digits and _.-/ "
                "(starting and ending with a letter or digit)"
            )
        if not _LABEL_VALUE.fullmatch(value):
            raise InventoryError(
                f"DSEC_NODE_LABELS: value of {key!r} ({value!r}): at most 63 letters, digits "
                "and _.- (starting and ending with a letter or digit)"
            )
        if key in labels:
            raise InventoryError(f"DSEC_NODE_LABELS: key {key!r} given twice")
        labels[key] = value
    return labels


# ---------------------------------------------------------------------- reading (blocking)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cgroup_limits(mount: Path, own: str) -> tuple[float | None, int | None]:
    """The tightest ``cpu.max`` and ``memory.max`` of the parent of cgroup ``own`` and of each
    ancestor up to the mount (``None``: no limit set)."""
    cpus: float | None = None
    memory: int | None = None
    current = (mount / own.lstrip("/")).parent if own not in ("", "/") else mount
    while True:
        cpu_text = _read(current / "cpu.max")
        mem_text = _read(current / "memory.max")
        level_cpus = parse_cpu_max(cpu_text) if cpu_text else None
        level_mem = parse_memory_max(mem_text) if mem_text else None
        if level_cpus is not None:
            cpus = level_cpus if cpus is None else min(cpus, level_cpus)
        if level_mem is not None:
            memory = level_mem if memory is None else min(memory, level_mem)
        if current == mount or mount not in current.parents:
            return cpus, memory
        current = current.parent


def read_host(home: Path) -> HostFacts:
    """The host now (blocking: reads ``/proc`` and ``/sys``)."""
    cpus = float(len(os.sched_getaffinity(0)))
    meminfo = parse_meminfo(_read(Path("/proc/meminfo")) or "")
    memory = meminfo.get("MemTotal", 0)
    mount = cgroup2_mount(_read(Path("/proc/self/mounts")) or "")
    own = own_cgroup(_read(Path("/proc/self/cgroup")) or "")
    if mount is not None and own is not None:
        cg_cpus, cg_memory = cgroup_limits(mount, own)
        cpus = min(cpus, cg_cpus) if cg_cpus is not None else cpus
        memory = min(memory, cg_memory) if cg_memory is not None else memory
    return HostFacts(
        cpus=cpus,
        memory_bytes=memory,
        memory_available_bytes=meminfo.get("MemAvailable", 0),
        load1=os.getloadavg()[0],
        disk_free_bytes=_disk_free(home),
    )


def _disk_free(home: Path) -> int:
    path = home.resolve()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def granted_of(dirs: Mapping[str, Path]) -> tuple[float, int]:
    """CPU cores and memory bytes one sandbox's cgroup grants (0 for an unlimited resource;
    v2 ``cpu.max``/``memory.max``, or v1 CFS quota / ``memory.limit_in_bytes``)."""
    cpus, memory = 0.0, 0
    cpu_dir, mem_dir = dirs.get("cpu"), dirs.get("memory")
    if cpu_dir is not None:
        text = _read(cpu_dir / "cpu.max")
        if text is not None:
            cpus = parse_cpu_max(text) or 0.0
        else:
            quota = int((_read(cpu_dir / "cpu.cfs_quota_us") or "-1").strip())
            period = int((_read(cpu_dir / "cpu.cfs_period_us") or "100000").strip())
            cpus = quota / period if quota > 0 and period > 0 else 0.0
    if mem_dir is not None:
        text = _read(mem_dir / "memory.max")
        if text is not None:
            memory = parse_memory_max(text) or 0
        else:
            limit = int((_read(mem_dir / "memory.limit_in_bytes") or "0").strip())
            memory = limit if 0 < limit < _V1_UNLIMITED else 0
    return cpus, memory


def granted(groups: Sequence[Mapping[str, Path]]) -> tuple[float, int]:
    """The sum of :func:`granted_of` over running sandboxes (blocking)."""
    total_cpus, total_memory = 0.0, 0
    for dirs in groups:
        cpus, memory = granted_of(dirs)
        total_cpus += cpus
        total_memory += memory
    return round(total_cpus, 3), total_memory


# ---------------------------------------------------------------------- the inventory


RunningGroups = Callable[[], Sequence[Mapping[str, Path]]]
"""The cgroup directories (controller -> directory) of each running sandbox."""


class Inventory:
    """The node's inventory, read for each heartbeat.

    ``running``: the running sandboxes' cgroup directories. ``probe``: the NVML probe (default:
    the real one; a declared inventory replaces it). ``calls``: the process's NVML calls
    (their deadline and whether NVML answers; shared with the GPU side).
    """

    def __init__(
        self,
        settings: Settings,
        running: RunningGroups,
        probe: NvmlProbe | None = None,
        calls: NvmlCalls | None = None,
    ) -> None:
        self.settings = settings
        self.running = running
        self.probe = probe or NvmlProbe()
        self.calls = calls or NvmlCalls(settings.nvml_timeout_s)
        self.labels: dict[str, str] = {}
        self.declared: DeclaredInventory | None = None

    async def start(self) -> None:
        """Check the labels and the declared inventory (raise :class:`InventoryError` with the
        field named: the node agent does not start on a wrong one)."""
        self.labels = parse_labels(self.settings.node_labels)
        if self.settings.node_inventory is not None:
            self.declared = await asyncio.to_thread(load_declared, self.settings.node_inventory)

    async def close(self) -> None:
        """Shut NVML down (not while NVML hangs: the shutdown would hang too)."""
        try:
            await self.calls.call("the GPU probe's shutdown", self.probe.close, alone=True)
        except NvmlHung as exc:
            log.warning("NVML not shut down: %s", exc)

    async def _gpus(self) -> GpuReading:
        if self.declared is not None:
            return GpuReading(declared_gpus(self.declared, self.settings.node_id), "declared")
        # at most one beat: the heartbeat goes out on time with the problem instead
        limit = min(self.calls.timeout_s, self.settings.heartbeat_s)
        try:
            return await self.calls.call("the GPU probe's read", self.probe.read, timeout_s=limit)
        except NvmlHung as exc:  # the node is unhealthy for placement, not lost
            log.warning("GPU probe: %s", exc)
            return GpuReading([], "nvml", [f"GPU probe: {exc}"])
        except Exception as exc:  # a driver surprise must not cost the node its heartbeat
            log.exception("GPU probe failed")
            return GpuReading([], "nvml", [f"GPU probe failed: {type(exc).__name__}: {exc}"])

    async def read(self) -> tuple[NodeInventory, list[str]]:
        """The inventory now and what could not be read (GPU fields, as problems)."""

        def collect() -> tuple[HostFacts, tuple[float, int]]:
            return read_host(self.settings.home), granted(self.running())

        (host, (cpus_granted, memory_granted)), gpus = await asyncio.gather(
            asyncio.to_thread(collect), self._gpus()
        )
        declared = self.declared
        inventory = NodeInventory(
            # CPU is compressible (each sandbox is capped by its own cpu.max): the node offers
            # its cores times the allocation ratio; a declared inventory says it exactly.
            cpus=(
                declared.cpus
                if declared is not None and declared.cpus
                else round(host.cpus * self.settings.cpu_allocation_ratio, 3)
            ),
            memory_bytes=(
                declared.memory if declared is not None and declared.memory else host.memory_bytes
            ),
            cpus_allocated=cpus_granted,
            memory_allocated_bytes=memory_granted,
            memory_available_bytes=host.memory_available_bytes,
            load1=round(host.load1, 2),
            disk_free_bytes=host.disk_free_bytes,
            max_sandboxes=self.settings.max_sandboxes,
            gpus=gpus.gpus,
            gpu_probe=gpus.probe,
            labels=self.labels,
        )
        return inventory, gpus.problems
