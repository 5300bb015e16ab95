"""Applies a unit's GPU slice on a real node: NVML (``nvidia-ml-py``), MPS control daemons, MIG
instances, the device cgroup, the memory quota watch and the health signals.

The decisions are pure (:mod:`dsec_nodeagent.gpuslice`, :mod:`dsec_nodeagent.gpuquota`,
:mod:`dsec_core.gpuhealth`); this module does what they decide. Every NVML call blocks in the
driver: the node agent calls them from a thread.

* :class:`PynvmlBackend`: the :class:`~dsec_nodeagent.gpuslice.Nvml` interface over ``pynvml``
  (devices with their minor numbers and MIG profiles, per-process memory, health readings:
  temperature, XIDs from the probe, volatile uncorrected ECC, clock throttle reasons, per-link
  NVLink error counters and throughput).
* :class:`MpsServers`: one ``nvidia-cuda-mps-control -d`` per GPU (started with the first MPS
  unit of that GPU, told ``quit`` after the last), pipe and log directories under the node's
  home.
* :func:`attach_device_guard`: a ``BPF_PROG_TYPE_CGROUP_DEVICE`` program on the sandbox's
  cgroup that refuses every NVIDIA device node but the unit's own (loaded through libbpf from a
  few instructions: no compiler at run time).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import importlib
import logging
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsec_core.gpuhealth import GpuReading, LinkReading, throttle_names
from dsec_core.threads import to_the_end

from dsec_nodeagent.gpuslice import DeviceInfo, DeviceRule, MigProfile, ProcessUsage

log = logging.getLogger(__name__)

MPS_CONTROL = "nvidia-cuda-mps-control"
NVLINK_LINK_BYTES_S = {1: 20e9, 2: 25e9, 3: 25e9, 4: 25e9, 5: 50e9}
"""Per-direction bandwidth of one NVLink by NVLink version (bytes/s), for utilization."""


# --------------------------------------------------------------------------- NVML


class PynvmlBackend:
    """The real NVML (``pynvml``; ``nvml``: the module, default imported)."""

    def __init__(self, nvml: Any | None = None) -> None:
        self.nvml: Any = nvml if nvml is not None else importlib.import_module("pynvml")
        self.nvml.nvmlInit()
        count = self.nvml.nvmlDeviceGetCount()
        self._handles = [self.nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        self._throughput: dict[tuple[int, int], tuple[float, int]] = {}

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except Exception as exc:
            log.debug("NVML shutdown: %s", exc)

    def _try(self, fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception:  # NVMLError: not supported here (or the GPU is gone)
            return None

    def devices(self) -> list[DeviceInfo]:
        nvml, out = self.nvml, []
        for index, h in enumerate(self._handles):
            uuid = nvml.nvmlDeviceGetUUID(h)
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            mem = nvml.nvmlDeviceGetMemoryInfo(h)
            modes = self._try(nvml.nvmlDeviceGetMigMode, h)
            enabled = modes is not None and modes[0] == nvml.NVML_DEVICE_MIG_ENABLE
            out.append(
                DeviceInfo(
                    index=index,
                    uuid=uuid,
                    minor=int(nvml.nvmlDeviceGetMinorNumber(h)),
                    memory_bytes=int(mem.total),
                    mig_capable=modes is not None,
                    mig_enabled=enabled,
                    mig_profiles=tuple(self._profiles(h)) if enabled else (),
                )
            )
        return out

    def _profiles(self, handle: Any) -> list[MigProfile]:
        nvml, out = self.nvml, []
        count = getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 8)
        for pid in range(count):
            info = self._try(nvml.nvmlDeviceGetGpuInstanceProfileInfo, handle, pid)
            if info is None:
                continue
            free = self._try(nvml.nvmlDeviceGetGpuInstanceRemainingCapacity, handle, info.id)
            name = f"{info.sliceCount}g.{round(info.memorySizeMB / 1024)}gb"
            out.append(
                MigProfile(
                    profile_id=pid,
                    name=name,
                    slices=int(info.sliceCount),
                    memory_bytes=int(info.memorySizeMB) * 2**20,
                    free=int(free or 0),
                )
            )
        return out

    def processes(self) -> list[ProcessUsage]:
        nvml, out = self.nvml, []
        for index, h in enumerate(self._handles):
            for proc in self._try(nvml.nvmlDeviceGetComputeRunningProcesses, h) or []:
                used = getattr(proc, "usedGpuMemory", None)
                if used is None:  # not available (Windows WDDM; some vGPU modes)
                    continue
                out.append(ProcessUsage(index, int(proc.pid), int(used)))
        return out

    def health(self, xids: dict[str, int] | None = None) -> list[GpuReading]:
        """Each GPU's health now (``xids``: uuid -> XIDs counted by the probe's event set)."""
        nvml, out = self.nvml, []
        for index, h in enumerate(self._handles):
            uuid = self._try(nvml.nvmlDeviceGetUUID, h)
            if uuid is None:
                continue  # lost: the tracker notices it is missing
            uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
            temp = self._try(nvml.nvmlDeviceGetTemperature, h, nvml.NVML_TEMPERATURE_GPU)
            ecc = self._try(
                nvml.nvmlDeviceGetTotalEccErrors, h,
                nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC,
            )  # fmt: skip
            reasons = getattr(nvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None)
            mask = self._try(reasons, h) if reasons is not None else None
            out.append(
                GpuReading(
                    index=index,
                    uuid=uuid,
                    temperature_c=None if temp is None else float(temp),
                    xid_total=(xids or {}).get(uuid),
                    ecc_uncorrected_total=None if ecc is None else int(ecc),
                    throttle=throttle_names(int(mask or 0)),
                    links=tuple(self._links(index, h)),
                )
            )
        return out

    def _links(self, index: int, h: Any) -> list[LinkReading]:
        nvml, out = self.nvml, []
        kinds = [
            getattr(nvml, n, None)
            for n in (
                "NVML_NVLINK_ERROR_DL_REPLAY",
                "NVML_NVLINK_ERROR_DL_RECOVERY",
                "NVML_NVLINK_ERROR_DL_CRC_FLIT",
            )
        ]
        version = self._try(nvml.nvmlDeviceGetNvLinkVersion, h, 0)
        link_bytes_s = NVLINK_LINK_BYTES_S.get(int(version or 4), 25e9)
        tx = getattr(nvml, "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX", None)
        for link in range(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
            state = self._try(nvml.nvmlDeviceGetNvLinkState, h, link)
            if state is None:
                break
            if state != nvml.NVML_FEATURE_ENABLED:
                continue
            errors = 0
            for kind in kinds:
                if kind is not None:
                    errors += int(
                        self._try(nvml.nvmlDeviceGetNvLinkErrorCounter, h, link, kind) or 0
                    )
            util = None
            if tx is not None:
                values = self._try(nvml.nvmlDeviceGetFieldValues, h, [(tx, link)])
                if values and getattr(values[0], "nvmlReturn", 0) == 0:
                    kib = int(values[0].value.ullVal)
                    now = time.monotonic()
                    before = self._throughput.get((index, link))
                    self._throughput[(index, link)] = (now, kib)
                    if before is not None and now > before[0] and kib >= before[1]:
                        rate = (kib - before[1]) * 1024 / (now - before[0])
                        util = round(min(100.0, 100.0 * rate / link_bytes_s), 1)
            out.append(LinkReading(link=link, utilization_pct=util, errors_total=errors))
        return out

    # ---------------------------------------------------------------- MIG

    def create_mig(self, index: int, profile: MigProfile) -> tuple[str, Any, Any]:
        """A GPU instance of ``profile`` and one compute instance using all of it: (the MIG
        device's uuid, gpu instance, compute instance)."""
        nvml, h = self.nvml, self._handles[index]
        gi = nvml.nvmlDeviceCreateGpuInstance(h, profile.profile_id)
        try:
            ci_profile = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, nvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE + profile.slices - 1,
                nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED,
            )  # fmt: skip
            ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, ci_profile.id)
        except Exception:
            nvml.nvmlGpuInstanceDestroy(gi)
            raise
        info = nvml.nvmlGpuInstanceGetInfo(gi)
        for mig_index in range(nvml.nvmlDeviceGetMaxMigDeviceCount(h)):
            mig = self._try(nvml.nvmlDeviceGetMigDeviceHandleByIndex, h, mig_index)
            if mig is not None and nvml.nvmlDeviceGetGpuInstanceId(mig) == info.id:
                uuid = nvml.nvmlDeviceGetUUID(mig)
                return (uuid.decode() if isinstance(uuid, bytes) else str(uuid)), gi, ci
        nvml.nvmlComputeInstanceDestroy(ci)
        nvml.nvmlGpuInstanceDestroy(gi)
        raise RuntimeError(f"GPU {index}: the new MIG instance has no device")

    def mig_ids(self, gi: Any, ci: Any) -> tuple[int, int]:
        """The ids of a GPU instance and its compute instance (their capability files)."""
        nvml = self.nvml
        return int(nvml.nvmlGpuInstanceGetInfo(gi).id), int(nvml.nvmlComputeInstanceGetInfo(ci).id)

    def mig_by_ids(self, index: int, gi_id: int, ci_id: int) -> tuple[Any, Any, str] | None:
        """GPU ``index``'s MIG instance ``gi_id`` and its compute instance ``ci_id`` (made
        before this process opened NVML): their handles and the MIG device's uuid (None: no
        such instance now). Other NVML errors are raised."""
        nvml, h = self.nvml, self._handles[index]
        try:
            gi = nvml.nvmlDeviceGetGpuInstanceById(h, gi_id)
            ci = nvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id)
        except nvml.NVMLError_NotFound:
            return None
        for mig_index in range(nvml.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, mig_index)
            except nvml.NVMLError_NotFound:  # an empty slot
                continue
            if nvml.nvmlDeviceGetGpuInstanceId(mig) == gi_id:
                uuid = nvml.nvmlDeviceGetUUID(mig)
                return gi, ci, (uuid.decode() if isinstance(uuid, bytes) else str(uuid))
        raise RuntimeError(f"GPU {index}: MIG instance {gi_id} exists and has no device")

    def destroy_mig(self, gi: Any, ci: Any) -> None:
        self.nvml.nvmlComputeInstanceDestroy(ci)
        self.nvml.nvmlGpuInstanceDestroy(gi)


def mig_caps(minor: int, gi_id: int, ci_id: int, proc: Path = Path("/proc")) -> list[str]:
    """The ``nvidia-caps`` nodes a MIG instance's client must open (from the driver's
    ``/proc/driver/nvidia/capabilities``: ``DeviceFileMinor`` of its gi and ci access files)."""
    base = proc / f"driver/nvidia/capabilities/gpu{minor}/mig/gi{gi_id}"
    out = []
    for access in (base / "access", base / f"ci{ci_id}" / "access"):
        try:
            for line in access.read_text().splitlines():
                if line.startswith("DeviceFileMinor:"):
                    out.append(f"nvidia-caps/nvidia-cap{int(line.split(':')[1])}")
        except OSError:
            continue
    return out


# --------------------------------------------------------------------------- MPS


MPS_CONTROL_TIMEOUT_S = 30.0
"""The longest one run of the MPS control program (start or quit of a GPU's daemon) may take."""


@dataclass
class MpsServers:
    """One MPS control daemon per GPU uuid, counted by the units that use it.

    A GPU's acquires and releases take turns (one lock per uuid): two first units at once start
    one daemon, not two, and a release of the last unit beside an acquire of a new one ends with
    the daemon running for the new one (before, the quit could land after the new unit's start
    and leave it on no daemon). Whether a daemon runs is kept apart from who holds it, and each
    start and quit runs to its end even when its caller is cancelled, so the two never disagree:
    a daemon started for an acquire cancelled meanwhile is used by the next acquire, or told
    ``quit`` by the next release that leaves it no holder (:meth:`close` at the node's stop).
    One it does not know of (left by an earlier node agent, a failed quit, a start killed past
    its timeout) is used by the GPU's next unit, never quit by it.
    """

    root: Path
    binary: str | None = field(default_factory=lambda: shutil.which(MPS_CONTROL))
    users: dict[str, set[str]] = field(default_factory=dict)
    running: set[str] = field(default_factory=set)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict, repr=False)

    @property
    def available(self) -> bool:
        return self.binary is not None

    def pipe_dir(self, uuid: str) -> Path:
        return self.root / uuid / "pipe"

    def _env(self, uuid: str) -> dict[str, str]:
        return {
            **os.environ,
            "CUDA_VISIBLE_DEVICES": uuid,
            "CUDA_MPS_PIPE_DIRECTORY": str(self.pipe_dir(uuid)),
            "CUDA_MPS_LOG_DIRECTORY": str(self.root / uuid / "log"),
        }

    def _lock(self, uuid: str) -> asyncio.Lock:
        return self._locks.setdefault(uuid, asyncio.Lock())

    async def _control(self, uuid: str, *args: str, say: bytes | None = None) -> int:
        """Run the control program for ``uuid``'s daemon; its exit status. Bounded: one that
        has not ended after :data:`MPS_CONTROL_TIMEOUT_S` is killed (RuntimeError), so a hung
        driver never holds the GPU's lock, or a node agent's stop, for good."""
        assert self.binary is not None
        proc = await asyncio.create_subprocess_exec(
            self.binary, *args, env=self._env(uuid),
            stdin=asyncio.subprocess.PIPE if say is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
        )  # fmt: skip
        try:
            async with asyncio.timeout(MPS_CONTROL_TIMEOUT_S):
                await proc.communicate(say)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            what = " ".join((MPS_CONTROL, *args)) + (f" ({say.decode().strip()})" if say else "")
            raise RuntimeError(
                f"{what} for {uuid} did not end within {MPS_CONTROL_TIMEOUT_S:g} s; killed"
            ) from None
        assert proc.returncode is not None
        return proc.returncode

    async def _start(self, uuid: str) -> None:
        for d in (self.pipe_dir(uuid), self.root / uuid / "log"):
            d.mkdir(parents=True, exist_ok=True)
            d.chmod(0o755)
        code = await self._control(uuid, "-d")
        if code != 0:
            if not self._serving(uuid):
                raise RuntimeError(f"{MPS_CONTROL} -d for {uuid} exited {code}")
            # A daemon this node agent did not start serves the GPU already: one an earlier
            # node agent left to the sandboxes it re-adopted, one whose quit failed, one a
            # start killed past its timeout had started. It is used, never told to quit here
            # (re-adopted sandboxes may be its clients).
            log.warning("mps: a daemon already serves %s (-d exited %d): using it", uuid, code)
        self.running.add(uuid)

    def _serving(self, uuid: str) -> bool:
        """Whether a control daemon listens on ``uuid``'s pipe directory (its ``control``
        pipe, which it creates, and its pid file naming a live process when there is one)."""
        pipes = self.pipe_dir(uuid)
        if not (pipes / "control").exists():
            return False
        try:
            pid = int((pipes / "nvidia-cuda-mps-control.pid").read_text().strip())
        except (OSError, ValueError):
            return True  # no pid file to check: the pipe says
        return Path(f"/proc/{pid}").exists()

    async def _quit(self, uuid: str) -> None:
        """Tell ``uuid``'s daemon to quit. It is no longer counted as running either way: a
        quit that failed most often means the daemon had died; one still there is used by the
        GPU's next unit (see :meth:`_start`)."""
        self.running.discard(uuid)
        code = await self._control(uuid, say=b"quit\n")
        if code != 0:
            raise RuntimeError(f"{MPS_CONTROL} quit for {uuid} exited {code}")

    async def acquire(self, uuid: str, unit: str) -> Path:
        """The pipe directory of ``uuid``'s daemon (started when none runs for it)."""
        if self.binary is None:
            raise RuntimeError(f"{MPS_CONTROL} is not installed")
        async with self._lock(uuid):
            if uuid not in self.running:
                await to_the_end(self._start(uuid))
            self.users.setdefault(uuid, set()).add(unit)
        return self.pipe_dir(uuid)

    async def adopt(self, uuid: str, unit: str) -> None:
        """``unit``, started by an earlier node agent, uses ``uuid``'s daemon: it is counted
        as this node's (told to quit at its last unit's release) when it still serves."""
        async with self._lock(uuid):
            if uuid not in self.running and self._serving(uuid):
                self.running.add(uuid)
            self.users.setdefault(uuid, set()).add(unit)

    async def release(self, uuid: str, unit: str) -> None:
        """``unit`` no longer uses ``uuid``'s daemon; the last unit's release quits it."""
        async with self._lock(uuid):
            holders = self.users.get(uuid)
            if holders is None or unit not in holders:
                return
            holders.discard(unit)
            if holders:
                return
            del self.users[uuid]
            if self.binary is not None and uuid in self.running:
                await to_the_end(self._quit(uuid))

    async def close(self) -> None:
        """Quit every daemon no unit holds (one an acquire cancelled mid-start left running);
        a quit that fails is logged and the others still go."""
        for uuid in sorted(self.running):
            async with self._lock(uuid):
                if not self.users.get(uuid) and uuid in self.running:
                    try:
                        await to_the_end(self._quit(uuid))
                    except RuntimeError as exc:
                        log.warning("mps: %s", exc)


# --------------------------------------------------------------------------- device cgroup

BPF_PROG_TYPE_CGROUP_DEVICE = 15
BPF_CGROUP_DEVICE = 6
BPF_F_ALLOW_MULTI = 2
BPF_DEVCG_DEV_CHAR = 2


class _Insn(ctypes.Structure):
    _fields_ = (
        ("code", ctypes.c_uint8),
        ("regs", ctypes.c_uint8),
        ("off", ctypes.c_int16),
        ("imm", ctypes.c_int32),
    )


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> tuple[int, ...]:
    return (code, (src << 4) | dst, off, imm)


_LDXW, _AND_K, _JNE_K, _JEQ_K, _JA, _MOV_K, _EXIT = 0x61, 0x57, 0x55, 0x15, 0x05, 0xB7, 0x95


def device_program(guarded: frozenset[int], allowed: Sequence[DeviceRule]) -> list[tuple[int, ...]]:
    """The instructions of a device cgroup program: a character device of a ``guarded`` major
    is refused unless ``allowed``; everything else is allowed (left to the other layers)."""
    body: list[tuple[str, tuple[int, ...], str | None]] = []  # (label, insn, jump target)

    def emit(insn: tuple[int, ...], target: str | None = None, label: str = "") -> None:
        body.append((label, insn, target))

    emit(_insn(_LDXW, 2, 1, 0))  # r2 = ctx->access_type
    emit(_insn(_AND_K, 2, imm=0xFFFF))  # r2 &= 0xffff: the device type
    emit(_insn(_LDXW, 3, 1, 4))  # r3 = ctx->major
    emit(_insn(_LDXW, 4, 1, 8))  # r4 = ctx->minor
    emit(_insn(_JNE_K, 2, imm=BPF_DEVCG_DEV_CHAR), "allow")
    for n, rule in enumerate(allowed):
        emit(_insn(_JNE_K, 3, imm=rule.major), f"next{n}")
        if rule.minor is not None:
            emit(_insn(_JNE_K, 4, imm=rule.minor), f"next{n}")
        emit(_insn(_JA), "allow")
        body.append((f"next{n}", (), None))  # a label only
    for major in sorted(guarded):
        emit(_insn(_JEQ_K, 3, imm=major), "deny")
    emit(_insn(_MOV_K, 0, imm=1), label="allow")
    emit(_insn(_EXIT))
    emit(_insn(_MOV_K, 0, imm=0), label="deny")
    emit(_insn(_EXIT))
    # Resolve labels (a label-only entry names the next instruction).
    positions: dict[str, int] = {}
    pc = 0
    for label, insn, _ in body:
        if label:
            positions[label] = pc
        if insn:
            pc += 1
    out: list[tuple[int, ...]] = []
    for _, insn, target in body:
        if not insn:
            continue
        if target is not None:
            code, regs, _, imm = insn
            insn = (code, regs, positions[target] - len(out) - 1, imm)
        out.append(insn)
    return out


def attach_device_guard(
    cgroup_dir: Path, guarded: frozenset[int], allowed: Sequence[DeviceRule]
) -> None:
    """Attach the device program to ``cgroup_dir`` (it goes with the cgroup; blocking).

    Raises:
        OSError: the kernel refused the program or the attach.
    """
    lib = ctypes.CDLL(ctypes.util.find_library("bpf") or "libbpf.so.1", use_errno=True)
    lib.bpf_prog_load.restype = ctypes.c_int
    lib.bpf_prog_load.argtypes = [
        ctypes.c_int, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p, ctypes.c_size_t,
        ctypes.c_void_p,
    ]  # fmt: skip
    lib.bpf_prog_attach.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_uint]
    insns = device_program(guarded, allowed)
    array = (_Insn * len(insns))(*[_Insn(*i) for i in insns])
    fd = lib.bpf_prog_load(
        BPF_PROG_TYPE_CGROUP_DEVICE, b"dsec_gpu_dev", b"GPL", ctypes.addressof(array),
        len(insns), None,
    )  # fmt: skip
    if fd < 0:
        raise OSError(-fd, f"device cgroup program refused: {os.strerror(-fd)}")
    try:
        cg = os.open(cgroup_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            rc = lib.bpf_prog_attach(fd, cg, BPF_CGROUP_DEVICE, BPF_F_ALLOW_MULTI)
            if rc < 0:
                raise OSError(-rc, f"device cgroup program not attached: {os.strerror(-rc)}")
        finally:
            os.close(cg)
    finally:
        os.close(fd)


def cgroup_pids(cgroup_dir: Path) -> set[int]:
    """Every pid in ``cgroup_dir`` and its sub-cgroups (blocking)."""
    pids: set[int] = set()
    for procs in [cgroup_dir / "cgroup.procs", *cgroup_dir.rglob("*/cgroup.procs")]:
        try:
            pids.update(int(x) for x in procs.read_text().split())
        except (OSError, ValueError):
            continue
    return pids
