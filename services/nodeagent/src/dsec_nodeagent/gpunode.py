"""The node agent's GPU side: slices for its units, their memory quota watch, and the node's GPU
health signals (docs/gpu.md).

* :meth:`GpuNode.prepare` (before a unit starts): its ``unit.placed`` GPUs and share become a
  :class:`~dsec_nodeagent.gpuslice.SlicePlan` (MIG / MPS / time-slicing by the operator's
  ``gpu.mig`` / ``gpu.mps``), an MPS daemon is started for its GPU or a MIG instance created;
  :meth:`GpuNode.apply` puts the plan's environment, ``/dev/nvidia*`` nodes and MPS pipe
  directory in the sandbox's config.
* :meth:`GpuNode.attach` (its cgroup exists, before its first instruction): the device cgroup
  program that refuses every other NVIDIA device node.
* the quota watch (every ``QUOTA_EVERY_S``): NVML's per-process memory summed over the unit's
  cgroup; ``policy.violation`` (``log``) when it nears or passes its quota, then, still over
  after ``gpu.memory_grace_s``, ``policy.violation`` (``deny``) and a stop that ends in
  ``sandbox.exited{reason: gpu_memory}``.
* :meth:`GpuNode.health` (each heartbeat): NVML's health readings judged against the operator's
  thresholds (``dsec_core.gpuhealth``) into ``gpu.degraded`` / ``gpu.recovered`` /
  ``link.congested``.

Without NVML (no driver, or a declared inventory) a unit still gets ``CUDA_VISIBLE_DEVICES``
for its GPUs' uuids, and no device node, quota watch or MPS daemon (there is no GPU to fence).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec_core import events
from dsec_core.events import GpuInfo, Payload
from dsec_core.gpuhealth import CONFIG_ID, ClusterConfig, HealthTracker, readings_of
from dsec_core.settings import Settings
from dsec_core.subjects import subject_for
from dsec_core.threads import to_the_end
from dsec_core.trust import Gate

from dsec_nodeagent.gpu import InventoryError, declared_gpus, load_declared
from dsec_nodeagent.gpuenforce import (
    MpsServers,
    PynvmlBackend,
    attach_device_guard,
    cgroup_pids,
    mig_caps,
)
from dsec_nodeagent.gpuquota import QuotaWatch, Verdict, usage_of
from dsec_nodeagent.gpuslice import (
    DeviceInfo,
    MigProfile,
    SlicePlan,
    SliceSettings,
    device_rules,
    nvidia_majors,
    plan_slice,
    with_mig_instance,
)
from dsec_nodeagent.sandbox.models import SandboxConfig

log = logging.getLogger(__name__)

QUOTA_EVERY_S = 1.0
"""How often the units' GPU memory is read."""
MPS_TARGET = "/run/dsec/mps"
"""Where a unit sees its GPU's MPS pipe directory (``<dir>/<uuid>``)."""
RULE_ID = "gpu-memory"


@dataclass
class UnitGpu:
    """One running unit's GPU slice."""

    sandbox_id: str
    plan: SlicePlan
    watch: QuotaWatch | None = None
    cgroup_dir: Path | None = None
    mig: list[tuple[Any, Any]] = field(default_factory=list)
    stop_detail: str | None = None


Publish = Callable[[Payload, str], Awaitable[None]]
StopUnit = Callable[[str, str], Awaitable[None]]


class GpuNode:
    """The GPUs of this node as its units and its health see them."""

    def __init__(
        self,
        settings: Settings,
        publish: Publish,
        gate: Callable[[], Gate],
        *,
        backend: Any = None,
        mps: MpsServers | None = None,
    ) -> None:
        self.settings = settings
        self._publish = publish
        self._gate = gate
        self.backend: Any = backend
        self.mps = mps or MpsServers(settings.home.resolve() / "gpu" / "mps")
        self.config = ClusterConfig()
        self._config_seq = 0  # the stream seq of cluster.config_set read up to
        self.units: dict[str, UnitGpu] = {}
        source = "declared" if settings.node_inventory is not None else "nvml"
        self.tracker = HealthTracker(settings.node_id, source)  # type: ignore[arg-type]
        self.stop_unit: StopUnit | None = None
        """Stops a unit over its quota (the node agent's stop with reason gpu_memory)."""
        self._task: asyncio.Task[None] | None = None
        self._majors: dict[str, int] = {}
        self.declared: list[GpuInfo] = []
        """A declared inventory's GPUs (``DSEC_NODE_INVENTORY``): uuids for CUDA_VISIBLE_DEVICES."""

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Open NVML (unless the node's GPUs are declared), read the operator's config, watch."""
        if self.settings.node_inventory is not None:
            try:
                declared = await asyncio.to_thread(load_declared, self.settings.node_inventory)
                self.declared = declared_gpus(declared, self.settings.node_id)
            except InventoryError as exc:  # the heartbeat's start reports it and stops
                log.warning("declared GPUs not read: %s", exc)
        if self.backend is None and self.settings.node_inventory is None:
            try:
                self.backend = await asyncio.to_thread(PynvmlBackend)
            except Exception as exc:  # no library, no driver: no GPU to slice or watch
                log.info("GPU slicing off: no NVML (%s)", exc)
                self.backend = None
        if self.backend is not None:
            with contextlib.suppress(OSError):
                text = await asyncio.to_thread(Path("/proc/devices").read_text)
                self._majors = nvidia_majors(text)
        await self.refresh_config()
        self._task = asyncio.create_task(self._watch_forever(), name="gpu-quota")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            for sid in list(self.units):
                await self.release(sid)
            await self.mps.close()
        finally:  # (the node agent's other stop hooks run after this one)
            if self.backend is not None:
                await asyncio.to_thread(self.backend.close)

    async def refresh_config(self) -> ClusterConfig:
        """The latest authentic ``cluster.config_set`` (kept when the bus is away)."""
        try:
            found, self._config_seq = await self._gate().newest(
                subject_for(events.ClusterConfigSet.TYPE, CONFIG_ID), after=self._config_seq
            )
        except Exception as exc:
            log.debug("cluster config not read: %s", exc)
            return self.config
        if found is not None:
            payload = found.decoded()
            if isinstance(payload, events.ClusterConfigSet):
                self.config = ClusterConfig.of(payload.config)
        self.tracker.thresholds = self.config.thresholds()
        return self.config

    # ------------------------------------------------------------------ units

    async def devices(self, declared: Sequence[GpuInfo] = ()) -> list[DeviceInfo]:
        if self.backend is not None:
            return list(await asyncio.to_thread(self.backend.devices))
        return [
            DeviceInfo(g.index, g.uuid, g.index, g.memory_total_bytes, False, g.mig_enabled)
            for g in declared
        ]

    async def prepare(
        self, sid: str, placed: events.UnitPlaced, memory_quota_bytes: int | None = None
    ) -> SlicePlan | None:
        """The slice of a unit placed here (None: it has no GPU). Starts its GPU's MPS daemon
        or creates its MIG instance.

        Raises:
            SliceError: placed on a GPU this node does not have.
        """
        if not placed.gpu_indices:
            return None
        real = self.backend is not None
        settings = SliceSettings(
            mig=real and bool(self.config.get("gpu.mig")),
            mps=bool(self.config.get("gpu.mps")),
            mps_available=real and self.mps.available,
        )
        devices = await self.devices(self.declared)
        plan = plan_slice(
            placed.gpu_indices, placed.gpu_milli, devices, settings,
            memory_quota_bytes=memory_quota_bytes, mps_pipe_dir=MPS_TARGET,
        )  # fmt: skip
        if not real:  # a declared GPU: nothing on this machine to bind or fence
            plan = SlicePlan(plan.grants, plan.milli, plan.env, (), ())
        unit = UnitGpu(sid, plan)
        self.units[sid] = unit
        try:
            for grant in plan.grants:
                if grant.mode == "mps":
                    await self.mps.acquire(grant.uuid, sid)
                elif grant.mode == "mig" and grant.mig_profile is not None:
                    # Kept in ``unit.mig`` even when a cancel lands while NVML creates it, so the
                    # release below destroys it (before, it was left on the GPU for good).
                    mig_uuid, gi, ci = await to_the_end(
                        self._create_mig(unit, grant.index, grant.mig_profile)
                    )
                    gid, cid = await asyncio.to_thread(self.backend.mig_ids, gi, ci)
                    caps = await asyncio.to_thread(mig_caps, grant.minor, gid, cid)
                    unit.plan = with_mig_instance(unit.plan, grant.index, mig_uuid, caps)
        except BaseException:
            # this unit's own record: the node agent's stop may have dropped it from ``units``
            # meanwhile (a MIG instance NVML created after that would be kept by nobody)
            if self.units.get(sid) is unit:
                del self.units[sid]
            await to_the_end(self._release_unit(sid, unit))
            raise
        shared = [g for g in plan.grants if g.mode != "whole"]
        if real and shared:  # a whole GPU has no neighbour to protect
            unit.watch = QuotaWatch(
                {g.index: g.memory_quota_bytes for g in shared},
                warn_pct=float(self.config.get("gpu.memory_warn_pct")),
                grace_s=float(self.config.get("gpu.memory_grace_s")),
            )
        log.info(
            "%s: GPUs %s, %s", sid, ",".join(str(g.index) for g in plan.grants),
            "; ".join(g.why for g in plan.grants),
        )  # fmt: skip
        return unit.plan

    async def _create_mig(
        self, unit: UnitGpu, index: int, profile: MigProfile
    ) -> tuple[str, Any, Any]:
        mig_uuid, gi, ci = await asyncio.to_thread(self.backend.create_mig, index, profile)
        unit.mig.append((gi, ci))
        return str(mig_uuid), gi, ci

    def apply(self, config: SandboxConfig, plan: SlicePlan) -> SandboxConfig:
        """``config`` with the slice's environment, device nodes and MPS pipe directory."""
        binds = {f"{MPS_TARGET}/{uuid}": self.mps.pipe_dir(uuid) for uuid in plan.mps_pipes}
        return config.model_copy(
            update={
                "env": {**config.env, **plan.env},
                "gpu_devices": list(plan.devices),
                "gpu_binds": binds,
            }
        )

    async def attach(self, sid: str, cgroup_dir: Path) -> None:
        """Fence the unit's cgroup off every NVIDIA device node but its own."""
        unit = self.units.get(sid)
        if unit is None:
            return
        unit.cgroup_dir = cgroup_dir
        if self.backend is None or not unit.plan.devices:
            return
        caps = [int(d.rsplit("nvidia-cap", 1)[1]) for d in unit.plan.devices if "nvidia-cap" in d]
        guarded, allowed = device_rules(unit.plan, self._majors, caps)
        await asyncio.to_thread(attach_device_guard, cgroup_dir, guarded, allowed)

    async def release(self, sid: str) -> str | None:
        """The unit ended: its MPS daemon told to quit when last, its MIG instance destroyed.
        Returns why it was stopped, when it was over its quota."""
        unit = self.units.pop(sid, None)
        if unit is None:
            return None
        await to_the_end(self._release_unit(sid, unit))  # a cancel leaves no holder behind
        return unit.stop_detail

    async def _release_unit(self, sid: str, unit: UnitGpu) -> None:
        for grant in unit.plan.grants:
            if grant.mode == "mps":
                try:
                    await self.mps.release(grant.uuid, sid)
                except Exception:
                    log.exception("%s: MPS daemon of %s not stopped", sid, grant.uuid)
        while unit.mig:  # each instance destroyed once, even if released twice
            gi, ci = unit.mig.pop(0)
            try:
                await asyncio.to_thread(self.backend.destroy_mig, gi, ci)
            except Exception:
                log.exception("%s: MIG instance not destroyed", sid)

    # ------------------------------------------------------------------ the quota watch

    async def check_quotas(self, now: float | None = None) -> list[tuple[str, Verdict]]:
        """One look at every watched unit's GPU memory; acts on what it finds."""
        watched = [u for u in self.units.values() if u.watch is not None and u.cgroup_dir]
        if not watched or self.backend is None:
            return []
        processes = await asyncio.to_thread(self.backend.processes)
        now = time.monotonic() if now is None else now
        verdicts: list[tuple[str, Verdict]] = []
        for unit in watched:
            assert unit.watch is not None and unit.cgroup_dir is not None
            pids = await asyncio.to_thread(cgroup_pids, unit.cgroup_dir)
            verdict = unit.watch.observe(now, usage_of(processes, pids))
            if verdict is not None:
                verdicts.append((unit.sandbox_id, verdict))
                await self._act(unit, verdict)
        return verdicts

    async def _act(self, unit: UnitGpu, verdict: Verdict) -> None:
        stop = verdict.action == "stop"
        await self._publish(
            events.PolicyViolation(
                layer="kernel",
                rule_id=RULE_ID,
                action="deny" if stop else "log",
                operation="gpu_memory",
                target=f"GPU {verdict.gpu_index}",
                message=verdict.message,
            ),
            unit.sandbox_id,
        )
        if stop:
            unit.stop_detail = verdict.message
            if self.stop_unit is not None:
                await self.stop_unit(unit.sandbox_id, verdict.message)

    async def _watch_forever(self) -> None:
        while True:
            await asyncio.sleep(QUOTA_EVERY_S)
            try:
                await self.check_quotas()
            except Exception:  # a driver surprise must not end the watch
                log.exception("GPU memory check failed")

    # ------------------------------------------------------------------ health

    async def health(self, gpus: Sequence[GpuInfo], now: float | None = None) -> list[Payload]:
        """The health events this node's GPUs call for now (called at each heartbeat with the
        inventory's GPUs: their XIDs counted by the probe)."""
        if self.backend is None and not gpus:
            return []  # no GPU to judge
        await self.refresh_config()
        if self.backend is not None:
            xids = {g.uuid: g.xid_errors for g in gpus if g.xid_errors is not None}
            readings = await asyncio.to_thread(self.backend.health, xids)
        else:
            readings = readings_of(gpus)
        return self.tracker.observe(time.time() if now is None else now, readings)
