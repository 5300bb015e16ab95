#!/usr/bin/env python3
"""Prove the node agent's GPU slicing on a real GPU, once, in about a minute (docs/gpu.md).

    python3 scripts/gpu_check.py [--json] [--quota-mib 2048]

Self-contained: the standard library, ``pynvml`` (``nvidia-ml-py``: imported, or loaded from this
repository's ``.venv``) and the driver's ``libcuda.so.1`` (through ctypes; no CUDA toolkit, no
torch). The slicing and quota decisions are the node agent's own pure modules
(``dsec_nodeagent.gpuslice``, ``dsec_nodeagent.gpuquota``, standard library only).

1. **Inventory**: every GPU as NVML reports it (model, uuid, minor, memory, temperature, MIG
   mode and profiles, throttle reasons, uncorrected ECC, NVLinks up and their error counters,
   compute processes).
2. **Slice**: the node agent's decision for a unit taking 250/1000 of GPU 0 with a
   ``--quota-mib`` memory quota (MIG when on and a profile fits, else MPS, else time-slicing),
   and the environment it gets.
3. **MPS-limited unit** (when ``nvidia-cuda-mps-control`` exists): an MPS control daemon for
   GPU 0, a client with that environment allocating 256 MiB blocks until CUDA refuses: it gets
   about its ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` and sees one GPU.
4. **Quota stop**: a unit (time-sliced) that allocates past its quota and holds it; the quota
   watch reads NVML's per-process memory, warns, and after the grace stops it (SIGKILL), the
   ``sandbox.exited{reason: gpu_memory}`` it would publish is printed, and NVML shows its memory
   freed.

Exit 0: every step ran (a step that cannot run here, e.g. no MPS binary, says why); also exit 0,
with "no GPU here", where there is no NVML or no GPU. Exit 1: a step failed (what failed is
printed).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import importlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "services" / "nodeagent" / "src"))

from dsec_nodeagent.gpuquota import QuotaWatch, usage_of  # noqa: E402
from dsec_nodeagent.gpuslice import (  # noqa: E402
    DeviceInfo,
    MigProfile,
    ProcessUsage,
    SliceSettings,
    plan_slice,
)

MIB = 2**20
BLOCK = 256 * MIB


def load_pynvml() -> Any:
    try:
        return importlib.import_module("pynvml")
    except ImportError:
        pass
    for path in glob.glob(str(REPO / ".venv" / "lib" / "python3*" / "site-packages" / "pynvml.py")):
        spec = importlib.util.spec_from_file_location("pynvml", path)
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules["pynvml"] = module  # it looks itself up while it loads
            spec.loader.exec_module(module)
            return module
    return None


def text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def attempt(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:
        return None


# --------------------------------------------------------------------------- the child units


def child_alloc(limit_bytes: int, hold_s: float) -> int:
    """Allocate (and touch) 256 MiB blocks through the driver API until ``limit_bytes`` or a
    refusal; print what happened as one JSON line; hold the memory ``hold_s`` seconds."""
    cuda = ctypes.CDLL("libcuda.so.1")
    count, dev, ctx = ctypes.c_int(), ctypes.c_int(), ctypes.c_void_p()
    out: dict[str, Any] = {"pid": os.getpid()}
    rc = cuda.cuInit(0)
    if rc != 0:
        print(json.dumps({**out, "error": f"cuInit {rc}"}), flush=True)
        return 1
    cuda.cuDeviceGetCount(ctypes.byref(count))
    out["visible_gpus"] = count.value
    cuda.cuDeviceGet(ctypes.byref(dev), 0)
    rc = cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev)
    if rc != 0:
        print(json.dumps({**out, "error": f"cuCtxCreate {rc}"}), flush=True)
        return 1
    allocated, refused = 0, None
    ptrs = []
    while allocated < limit_bytes:
        ptr = ctypes.c_uint64()
        rc = cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(BLOCK))
        if rc != 0:
            refused = rc  # 2: CUDA_ERROR_OUT_OF_MEMORY
            break
        cuda.cuMemsetD8_v2(ptr, ctypes.c_ubyte(1), ctypes.c_size_t(BLOCK))
        ptrs.append(ptr)
        allocated += BLOCK
    cuda.cuCtxSynchronize()
    out.update(allocated_mib=allocated // MIB, refused_with=refused)
    print(json.dumps(out), flush=True)
    time.sleep(hold_s)
    return 0


def spawn(env: dict[str, str], limit: int, hold_s: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, "--child", str(limit), str(hold_s)],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        text=True,
    )


# --------------------------------------------------------------------------- the steps


def inventory(nvml: Any) -> list[dict[str, Any]]:
    gpus = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        mig = attempt(nvml.nvmlDeviceGetMigMode, h)
        reasons = attempt(nvml.nvmlDeviceGetCurrentClocksThrottleReasons, h)
        links, link_errors = 0, 0
        for link in range(nvml.NVML_NVLINK_MAX_LINKS):
            state = attempt(nvml.nvmlDeviceGetNvLinkState, h, link)
            if state is None:
                break
            if state == nvml.NVML_FEATURE_ENABLED:
                links += 1
                for kind in (nvml.NVML_NVLINK_ERROR_DL_REPLAY, nvml.NVML_NVLINK_ERROR_DL_CRC_FLIT):
                    link_errors += attempt(nvml.nvmlDeviceGetNvLinkErrorCounter, h, link, kind) or 0
        profiles = []
        if mig is not None and mig[0] == nvml.NVML_DEVICE_MIG_ENABLE:
            for pid in range(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
                info = attempt(nvml.nvmlDeviceGetGpuInstanceProfileInfo, h, pid)
                if info is not None:
                    free = attempt(nvml.nvmlDeviceGetGpuInstanceRemainingCapacity, h, info.id)
                    profiles.append(
                        {"id": pid, "slices": info.sliceCount, "memory_mib": info.memorySizeMB,
                         "free": free}
                    )  # fmt: skip
        procs = attempt(nvml.nvmlDeviceGetComputeRunningProcesses, h) or []
        gpus.append(
            {
                "index": i,
                "model": text(nvml.nvmlDeviceGetName(h)),
                "uuid": text(nvml.nvmlDeviceGetUUID(h)),
                "minor": attempt(nvml.nvmlDeviceGetMinorNumber, h),
                "memory_total_mib": mem.total // MIB,
                "memory_used_mib": mem.used // MIB,
                "temperature_c": attempt(nvml.nvmlDeviceGetTemperature, h, 0),
                "mig": None if mig is None else ("on" if mig[0] else "off"),
                "mig_profiles": profiles,
                "throttle_mask": None if reasons is None else hex(reasons),
                "ecc_uncorrected": attempt(
                    nvml.nvmlDeviceGetTotalEccErrors,
                    h,
                    nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    nvml.NVML_VOLATILE_ECC,
                ),
                "nvlinks_up": links,
                "nvlink_errors": link_errors,
                "processes": [
                    {"pid": p.pid, "used_mib": (p.usedGpuMemory or 0) // MIB} for p in procs
                ],
            }
        )
    return gpus


def processes(nvml: Any, index: int) -> list[ProcessUsage]:
    h = nvml.nvmlDeviceGetHandleByIndex(index)
    return [
        ProcessUsage(index, int(p.pid), int(p.usedGpuMemory or 0))
        for p in attempt(nvml.nvmlDeviceGetComputeRunningProcesses, h) or []
    ]


def mps_unit(gpu: dict[str, Any], env: dict[str, str], quota: int) -> dict[str, Any]:
    binary = shutil.which("nvidia-cuda-mps-control")
    if binary is None:
        return {"skipped": "nvidia-cuda-mps-control is not installed here"}
    root = Path(tempfile.mkdtemp(prefix="dsec-mps-"))
    pipe, logs = root / "pipe", root / "log"
    pipe.mkdir()
    logs.mkdir()
    daemon_env = {
        **os.environ, "CUDA_VISIBLE_DEVICES": gpu["uuid"], "CUDA_MPS_PIPE_DIRECTORY": str(pipe),
        "CUDA_MPS_LOG_DIRECTORY": str(logs),
    }  # fmt: skip
    subprocess.run([binary, "-d"], env=daemon_env, check=True, timeout=30)
    try:
        unit_env = {**env, "CUDA_MPS_PIPE_DIRECTORY": str(pipe)}
        child = spawn(unit_env, 4 * quota, 0.5)
        line, _ = child.communicate(timeout=120)
        result = json.loads(line.strip().splitlines()[-1]) if line.strip() else {}
        result["limit_mib"] = quota // MIB
        result["ok"] = (
            result.get("visible_gpus") == 1
            and result.get("refused_with") is not None
            and result.get("allocated_mib", 0) <= quota // MIB + BLOCK // MIB
        )
        return result
    finally:
        subprocess.run([binary], input=b"quit\n", env=daemon_env, timeout=30, check=False)
        shutil.rmtree(root, ignore_errors=True)


def quota_stop(nvml: Any, gpu: dict[str, Any], quota: int) -> dict[str, Any]:
    index = gpu["index"]
    before = {p.pid for p in processes(nvml, index)}
    env = {"CUDA_VISIBLE_DEVICES": gpu["uuid"], "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    child = spawn(env, quota + 4 * BLOCK, 120)  # past its quota, then holds it
    watch = QuotaWatch({index: quota}, warn_pct=90, grace_s=2.0)
    seen: list[dict[str, Any]] = []
    started, note = time.monotonic(), ""
    try:
        while time.monotonic() - started < 90:
            time.sleep(0.5)
            if child.poll() is not None:
                return {"ok": False, "error": f"the unit exited by itself ({child.returncode})"}
            procs = processes(nvml, index)
            usage = usage_of(procs, {child.pid})
            if not usage:  # a pid namespace: NVML reports the host's pids; match by elimination
                new = [p for p in procs if p.pid not in before]
                usage = usage_of(new, {p.pid for p in new})
                note = "NVML pids are the host's (pid namespace): the unit's process matched as new"
            verdict = watch.observe(time.monotonic(), usage)
            if verdict is None:
                continue
            seen.append({"action": verdict.action, "message": verdict.message})
            if verdict.action == "stop":
                child.send_signal(signal.SIGKILL)
                child.wait(timeout=30)
                freed = False
                for _ in range(40):
                    time.sleep(0.25)
                    if not [p for p in processes(nvml, index) if p.pid not in before]:
                        freed = True
                        break
                exited = {
                    "type": "sandbox.exited",
                    "payload": {"reason": "gpu_memory", "exit_code": -signal.SIGKILL,
                                "detail": verdict.message},
                }  # fmt: skip
                return {"ok": freed, "verdicts": seen, "event": exited, "memory_freed": freed,
                        "note": note}  # fmt: skip
        return {"ok": False, "verdicts": seen, "error": "no stop within 90 s", "note": note}
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        return child_alloc(int(sys.argv[2]), float(sys.argv[3]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="one JSON document at the end")
    parser.add_argument("--quota-mib", type=int, default=2048, help="the unit's GPU memory quota")
    args = parser.parse_args()
    nvml = load_pynvml()
    if nvml is None:
        print("gpu_check: no GPU here: the nvidia-ml-py package (pynvml) is not installed")
        return 0
    try:
        nvml.nvmlInit()
    except Exception as exc:
        print(f"gpu_check: no GPU here: NVML did not start ({exc})")
        return 0
    report: dict[str, Any] = {}
    failed = []
    try:
        gpus = inventory(nvml)
        report["inventory"] = gpus
        if not gpus:
            print("gpu_check: no GPU here: NVML found no device")
            return 0
        for g in gpus:
            print(f"GPU {g['index']}: {g['model']} {g['uuid']} minor {g['minor']}, "
                  f"{g['memory_used_mib']}/{g['memory_total_mib']} MiB, {g['temperature_c']} C, "
                  f"MIG {g['mig']} ({len(g['mig_profiles'])} profiles), throttle "
                  f"{g['throttle_mask']}, ECC uncorrected {g['ecc_uncorrected']}, NVLinks up "
                  f"{g['nvlinks_up']} (errors {g['nvlink_errors']}), processes "
                  f"{len(g['processes'])}", flush=True)  # fmt: skip
        g0 = gpus[0]
        quota = args.quota_mib * MIB
        device = DeviceInfo(
            0, g0["uuid"], int(g0["minor"] or 0), g0["memory_total_mib"] * MIB,
            mig_capable=g0["mig"] is not None, mig_enabled=g0["mig"] == "on",
            mig_profiles=tuple(
                MigProfile(p["id"], f"{p['slices']}g", p["slices"], p["memory_mib"] * MIB,
                           int(p["free"] or 0))
                for p in g0["mig_profiles"]
            ),
        )  # fmt: skip
        settings = SliceSettings(
            mig=False, mps=True, mps_available=shutil.which("nvidia-cuda-mps-control") is not None
        )
        plan = plan_slice([0], 250, [device], settings, memory_quota_bytes=quota)
        report["slice"] = {"mode": plan.mode, "why": plan.grants[0].why, "env": dict(plan.env),
                           "devices": list(plan.devices)}  # fmt: skip
        print(f"slice: {plan.mode} ({plan.grants[0].why}); env {dict(plan.env)}; /dev "
              f"{list(plan.devices)}", flush=True)  # fmt: skip
        env = {k: v for k, v in plan.env.items() if k != "CUDA_MPS_PIPE_DIRECTORY"}
        mps = mps_unit(g0, env, quota)
        report["mps_unit"] = mps
        print(f"MPS-limited unit: {mps}", flush=True)
        if mps.get("ok") is False:
            failed.append("mps_unit")
        stop = quota_stop(nvml, g0, quota)
        report["quota_stop"] = stop
        print(f"quota stop: {stop}", flush=True)
        if not stop.get("ok"):
            failed.append("quota_stop")
    except Exception as exc:
        failed.append(f"{type(exc).__name__}: {exc}")
    finally:
        nvml.nvmlShutdown()
    report["failed"] = failed
    if args.json:
        print(json.dumps(report))
    print("gpu_check: " + ("OK" if not failed else f"FAILED: {', '.join(failed)}"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
