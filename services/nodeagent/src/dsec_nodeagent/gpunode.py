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

Every NVML call has a deadline (:mod:`dsec_core.nvmlcall`): while the driver hangs, a
launch that needs it fails with the reason, the health check reads every GPU as lost, the quota
watch skips its look, and a release keeps its record for the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec_core import events
from dsec_core.envelope import Envelope
from dsec_core.events import GpuInfo, Payload
from dsec_core.gpuhealth import CONFIG_ID, ClusterConfig, HealthTracker, readings_of
from dsec_core.nvmlcall import NvmlCalls, NvmlHung
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
    GpuGrant,
    MigProfile,
    SliceError,
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
class MigInstance:
    """A MIG instance made for a unit: NVML's handles, and the ids that find them again."""

    index: int
    """The GPU's index."""
    gi: Any
    ci: Any
    gi_id: int
    ci_id: int
    uuid: str
    """Its device's uuid (``MIG-…``): what tells it from a later instance given its ids."""


@dataclass
class UnitGpu:
    """One running unit's GPU slice."""

    sandbox_id: str
    plan: SlicePlan
    watch: QuotaWatch | None = None
    cgroup_dir: Path | None = None
    mig: list[MigInstance] = field(default_factory=list)
    stop_detail: str | None = None
    holder: str = field(default_factory=lambda: secrets.token_hex(8))
    """Who holds its MPS daemons: this unit, not any unit of its sandbox (a release of an
    earlier copy never takes a later copy's hold); also its record's name."""
    released: bool = False

    def record(self) -> dict[str, Any]:
        """What a later node agent needs to take the slice over, or to undo it (JSON)."""
        return {
            "sandbox_id": self.sandbox_id,
            "plan": dataclasses.asdict(self.plan),
            "cgroup_dir": str(self.cgroup_dir) if self.cgroup_dir is not None else None,
            "mig": [[m.index, m.gi_id, m.ci_id, m.uuid] for m in self.mig],
            "holder": self.holder,
        }


def _plan_of(data: dict[str, Any]) -> SlicePlan:
    """A :class:`SlicePlan` from its :meth:`UnitGpu.record` form."""
    grants = []
    for g in data["grants"]:
        profile = g.get("mig_profile")
        grants.append(GpuGrant(**{**g, "mig_profile": MigProfile(**profile) if profile else None}))
    return SlicePlan(
        tuple(grants),
        int(data["milli"]),
        dict(data.get("env") or {}),
        tuple(data.get("devices") or ()),
        tuple(data.get("mps_pipes") or ()),
    )


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
        nvml: NvmlCalls | None = None,
    ) -> None:
        self.settings = settings
        self._publish = publish
        self._gate = gate
        self.backend: Any = backend
        self.nvml = nvml or NvmlCalls(settings.nvml_timeout_s)
        """NVML's calls, each with a deadline (shared with the heartbeat's GPU probe)."""
        self.off_reason: str | None = None
        """Why GPU slicing is off on a node with no declared inventory (NVML did not open)."""
        self._quota_hung = False
        self._reopen_later = False
        self.mps = mps or MpsServers(settings.home.resolve() / "gpu" / "mps")
        self.records = settings.home.resolve() / "gpu" / "units"
        """One file per unit with a slice (``<sandbox id>.<holder>.json``): a unit outlives a
        node agent that stops without stopping it, and the next one takes its slice over at its
        start."""
        self._records_lock = asyncio.Lock()
        self.config = ClusterConfig()
        self._config_seq = 0  # the stream seq of cluster.config_set read up to
        self._config_event: Envelope | None = None  # the cluster.config_set in force
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
            await self._open_backend()
        elif self.backend is not None:
            await self._read_majors()
        await self.refresh_config()
        await self.readopt()
        self._task = asyncio.create_task(self._watch_forever(), name="gpu-quota")

    async def _open_backend(self, timeout_s: float | None = None) -> None:
        """Open NVML for slicing. A driver that does not answer in time leaves slicing off
        until a later try (:meth:`_reopen`) finds it answering."""
        try:
            backend = await self.nvml.call(
                "NVML's start", PynvmlBackend, timeout_s=timeout_s, undo=lambda late: late.close()
            )
        except NvmlHung as exc:  # a wedged driver: tried again at each heartbeat and launch
            log.warning("GPU slicing off for now: %s", exc)
            self.off_reason, self._reopen_later = str(exc), True
            return
        except Exception as exc:  # no library, no driver: no GPU to slice or watch
            log.info("GPU slicing off: no NVML (%s)", exc)
            self.off_reason, self._reopen_later = f"no NVML ({exc})", False
            return
        self.backend, self.off_reason, self._reopen_later = backend, None, False
        await self._read_majors()

    async def _reopen(self, timeout_s: float | None = None) -> None:
        """NVML again, when it did not answer at the start (before, slicing stayed off until
        the node agent restarted, while the heartbeat offered the GPUs again)."""
        if self.backend is None and self._reopen_later:
            await self._open_backend(timeout_s)
            if self.backend is not None:
                log.info("GPU slicing on: NVML answers again")

    async def _read_majors(self) -> None:
        with contextlib.suppress(OSError):
            text = await asyncio.to_thread(Path("/proc/devices").read_text)
            self._majors = nvidia_majors(text)

    async def stop(self) -> None:
        """Stop watching. A unit that still runs (the node agent stops, its sandboxes stay:
        a plain restart) keeps its slice, MPS daemon and MIG instance, and its record for the
        next node agent; every other unit's slice is undone, and every daemon no unit holds
        is told to quit."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        try:
            for sid, unit in list(self.units.items()):
                if await asyncio.to_thread(_runs, unit.cgroup_dir):
                    log.info("%s keeps its GPU slice: it outlives this node agent", sid)
                    continue
                await self.release(sid)
            await self.mps.close()
        finally:  # (the node agent's other stop hooks run after this one)
            if self.backend is not None:
                try:
                    await self.nvml.call("NVML's shutdown", self.backend.close, alone=True)
                except NvmlHung as exc:  # a shutdown would hang too
                    log.warning("NVML not shut down: %s", exc)

    async def readopt(self) -> list[str]:
        """Take over the slices of units that outlived the previous node agent (their
        records); undo those of units that ended meanwhile (their MPS daemon told to quit when
        no unit holds it any more, their MIG instances destroyed). The units taken over."""
        try:
            names = await asyncio.to_thread(sorted, self.records.glob("*.json"))
        except OSError:
            return []
        live: list[UnitGpu] = []
        ended: list[UnitGpu] = []
        for path in names:
            try:
                data = json.loads(await asyncio.to_thread(path.read_text))
                sid = str(data["sandbox_id"])
                if path != self._record_path(sid, str(data["holder"])):
                    raise ValueError(f"it names {sid!r}")
            except Exception as exc:  # unreadable: nothing to take over or undo; dropped
                log.warning("GPU slice record %s not read (%s); dropped", path.name, exc)
                with contextlib.suppress(OSError):
                    await asyncio.to_thread(path.unlink, True)
                continue
            try:
                unit = await self._unit_of(data)
            except Exception as exc:  # NVML away, a MIG instance not found: kept for later
                log.warning(
                    "%s: its GPU slice record was not taken over (%s: %s); kept for the next "
                    "start", sid, type(exc).__name__, exc,
                )  # fmt: skip
                continue
            runs = await asyncio.to_thread(_runs, unit.cgroup_dir)
            (live if runs else ended).append(unit)
        for unit in (*live, *ended):  # all held first: no quit below hits a live unit's daemon
            for grant in unit.plan.grants:
                if grant.mode == "mps":
                    await self.mps.adopt(grant.uuid, unit.holder)
        for unit in live:
            self.units[unit.sandbox_id] = unit
            unit.watch = self._watch_for(unit.plan)
            log.info("%s: its GPU slice taken over (%s)", unit.sandbox_id, unit.plan.mode)
        for unit in ended:
            log.info("%s ended while no node agent ran: its GPU slice is undone", unit.sandbox_id)
            await to_the_end(self.release_unit(unit))
        return [unit.sandbox_id for unit in live]

    async def keep_only(self, adopted: Sequence[str]) -> None:
        """Once the node agent re-adopted the sandboxes that outlived its predecessor: a slice
        taken over for one it did not adopt (it cleaned it up as ended or half-started) is
        undone."""
        for sid in [s for s in self.units if s not in adopted]:
            log.info("%s was not re-adopted: its GPU slice is undone", sid)
            await self.release(sid)

    async def _unit_of(self, data: dict[str, Any]) -> UnitGpu:
        """The unit a record describes, its MIG instances found again. An instance whose ids
        now belong to another device (it was destroyed and its ids given to a new one) is
        not this unit's: left out, never destroyed from here."""
        sid = str(data["sandbox_id"])
        cgroup = data.get("cgroup_dir")
        unit = UnitGpu(
            sid,
            _plan_of(data["plan"]),
            cgroup_dir=Path(cgroup) if cgroup else None,
            holder=str(data["holder"]),
        )
        for index, gi_id, ci_id, uuid in data["mig"]:
            if self.backend is None:
                raise RuntimeError("a MIG instance is recorded and NVML is not open")
            found = await self.nvml.call(
                f"finding MIG instance {gi_id} of GPU {index}",
                self.backend.mig_by_ids, index, gi_id, ci_id,
            )  # fmt: skip
            if found is None or found[2] != uuid:
                log.warning("%s: its MIG instance %s is gone; nothing to undo", sid, uuid)
                continue
            unit.mig.append(MigInstance(int(index), found[0], found[1], gi_id, ci_id, uuid))
        return unit

    def _record_path(self, sid: str, holder: str) -> Path:
        """``<sandbox id>.<holder>.json``: one file per unit, so a unit's record is never
        another copy's of the same sandbox."""
        for part in (sid, holder):
            if not part or "/" in part or part.startswith("."):
                raise ValueError(f"not a sandbox id or holder: {part!r}")
        return self.records / f"{sid}.{holder}.json"

    async def _save(self, unit: UnitGpu) -> None:
        """The unit's record, replaced whole (a crash leaves the old one or the new one);
        records are written and removed one at a time, and a unit released writes none."""
        path = self._record_path(unit.sandbox_id, unit.holder)
        data = json.dumps(unit.record()).encode()

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, path)

        async with self._records_lock:
            if not unit.released:
                await asyncio.to_thread(write)

    async def _drop_record(self, unit: UnitGpu) -> None:
        """Remove the record of a unit released whole."""
        async with self._records_lock:
            with contextlib.suppress(OSError, ValueError):
                await asyncio.to_thread(
                    self._record_path(unit.sandbox_id, unit.holder).unlink, True
                )

    async def refresh_config(self) -> ClusterConfig:
        """The latest authentic ``cluster.config_set`` (kept when the bus is away)."""
        try:
            found, self._config_seq = await self._gate().newest(
                subject_for(events.ClusterConfigSet.TYPE, CONFIG_ID),
                after=self._config_seq,
                than=self._config_event,
            )
        except Exception as exc:
            log.debug("cluster config not read: %s", exc)
            return self.config
        if found is not None:
            payload = found.decoded()
            if isinstance(payload, events.ClusterConfigSet):
                self.config = ClusterConfig.of(payload.config)
                self._config_event = found
        self.tracker.thresholds = self.config.thresholds()
        return self.config

    # ------------------------------------------------------------------ units

    async def devices(self, declared: Sequence[GpuInfo] = ()) -> list[DeviceInfo]:
        if self.backend is not None:
            return list(await self.nvml.call("reading the GPUs", self.backend.devices))
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
        await self._reopen()
        real = self.backend is not None
        if not real and not self.declared and self.off_reason is not None:
            raise SliceError(f"GPU slicing is off on this node: {self.off_reason}")
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
        if sid in self.units:  # (its earlier copy's release under way: keyed by the id)
            raise SliceError(f"{sid} still holds a GPU slice on this node")
        unit = UnitGpu(sid, plan)
        self.units[sid] = unit
        try:
            for grant in plan.grants:
                if grant.mode == "mps":
                    await self.mps.acquire(grant.uuid, unit.holder)
                elif grant.mode == "mig" and grant.mig_profile is not None:
                    # Kept in ``unit.mig`` (and its record) even when a cancel lands while NVML
                    # creates it, so the release below destroys it (before, it was left on the
                    # GPU for good).
                    mig_uuid, made = await to_the_end(
                        self._create_mig(unit, grant.index, grant.mig_profile)
                    )
                    caps = await asyncio.to_thread(mig_caps, grant.minor, made.gi_id, made.ci_id)
                    unit.plan = with_mig_instance(unit.plan, grant.index, mig_uuid, caps)
            if real:
                await self._save(unit)
        except BaseException:
            # this unit's own record: the node agent's stop may have dropped it from ``units``
            # meanwhile (a MIG instance NVML created after that would be kept by nobody)
            if self.units.get(sid) is unit:
                del self.units[sid]
            await to_the_end(self.release_unit(unit))
            raise
        if real:
            unit.watch = self._watch_for(plan)
        log.info(
            "%s: GPUs %s, %s", sid, ",".join(str(g.index) for g in plan.grants),
            "; ".join(g.why for g in plan.grants),
        )  # fmt: skip
        return unit.plan

    def _watch_for(self, plan: SlicePlan) -> QuotaWatch | None:
        """The memory quota watch of a unit's shared GPUs (a whole GPU has no neighbour to
        protect: none)."""
        shared = [g for g in plan.grants if g.mode != "whole"]
        if not shared:
            return None
        return QuotaWatch(
            {g.index: g.memory_quota_bytes for g in shared},
            warn_pct=float(self.config.get("gpu.memory_warn_pct")),
            grace_s=float(self.config.get("gpu.memory_grace_s")),
        )

    async def _create_mig(
        self, unit: UnitGpu, index: int, profile: MigProfile
    ) -> tuple[str, MigInstance]:
        def create() -> tuple[str, MigInstance]:
            mig_uuid, gi, ci = self.backend.create_mig(index, profile)
            try:
                gi_id, ci_id = self.backend.mig_ids(gi, ci)
            except BaseException:
                self.backend.destroy_mig(gi, ci)
                raise
            return str(mig_uuid), MigInstance(index, gi, ci, gi_id, ci_id, str(mig_uuid))

        backend = self.backend
        mig_uuid, made = await self.nvml.call(
            f"creating a {profile.name} MIG instance on GPU {index}",
            create,
            undo=lambda late: backend.destroy_mig(late[1].gi, late[1].ci),
        )
        unit.mig.append(made)
        await self._save(unit)  # before anything else can fail: a crash leaves it known
        return mig_uuid, made

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
        if self.backend is None:
            return
        await self._save(unit)  # a unit that runs: taken over by the next node agent
        if not unit.plan.devices:
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
        await to_the_end(self.release_unit(unit))  # a cancel leaves no holder behind
        return unit.stop_detail

    async def release_unit(self, unit: UnitGpu) -> None:
        """Undo ``unit``'s slice: its hold on its MPS daemons (the last one's quits it), its
        MIG instances, then its record."""
        sid = unit.sandbox_id
        unit.released = True
        for grant in unit.plan.grants:
            if grant.mode == "mps":
                try:
                    await self.mps.release(grant.uuid, unit.holder)
                except Exception:
                    log.exception("%s: MPS daemon of %s not stopped", sid, grant.uuid)
        kept = False
        while unit.mig:  # each instance destroyed once, even if released twice
            made = unit.mig.pop(0)
            try:
                await self.nvml.call(
                    f"destroying MIG instance {made.gi_id} of GPU {made.index}",
                    self.backend.destroy_mig, made.gi, made.ci,
                )  # fmt: skip
            except NvmlHung as exc:
                kept = True  # its record stays: the next node agent's start tries again
                log.warning("%s: MIG instance %s not destroyed: %s", sid, made.uuid, exc)
            except Exception:
                kept = True
                log.exception("%s: MIG instance not destroyed", sid)
        if not kept:
            await self._drop_record(unit)

    # ------------------------------------------------------------------ the quota watch

    async def check_quotas(self, now: float | None = None) -> list[tuple[str, Verdict]]:
        """One look at every watched unit's GPU memory; acts on what it finds."""
        watched = [u for u in self.units.values() if u.watch is not None and u.cgroup_dir]
        if not watched or self.backend is None:
            return []
        processes = await self.nvml.call("reading the GPUs' processes", self.backend.processes)
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
                self._quota_hung = False
            except NvmlHung as exc:  # said once a hang, not every second
                if not self._quota_hung:
                    log.warning("GPU memory quotas not checked while NVML hangs: %s", exc)
                self._quota_hung = True
            except Exception:  # a driver surprise must not end the watch
                log.exception("GPU memory check failed")

    # ------------------------------------------------------------------ health

    async def health(self, gpus: Sequence[GpuInfo], now: float | None = None) -> list[Payload]:
        """The health events this node's GPUs call for now (called at each heartbeat with the
        inventory's GPUs: their XIDs counted by the probe)."""
        beat = min(self.nvml.timeout_s, self.settings.heartbeat_s)
        await self._reopen(beat)  # (a heartbeat waits one beat at most)
        if self.backend is None and not gpus:
            return []  # no GPU to judge
        await self.refresh_config()
        if self.backend is not None:
            xids = {g.uuid: g.xid_errors for g in gpus if g.xid_errors is not None}
            try:
                readings = await self.nvml.call(
                    "reading the GPUs' health", self.backend.health, xids,
                    timeout_s=beat,
                )  # fmt: skip
            except NvmlHung as exc:  # every GPU it knows reads as lost: gpu.degraded{lost}
                log.warning("GPU health: %s", exc)
                readings = []
        else:
            readings = readings_of(gpus)
        return self.tracker.observe(time.time() if now is None else now, readings)


def _runs(cgroup_dir: Path | None) -> bool:
    """Whether a unit's cgroup still has a process (blocking)."""
    return cgroup_dir is not None and bool(cgroup_pids(cgroup_dir))
