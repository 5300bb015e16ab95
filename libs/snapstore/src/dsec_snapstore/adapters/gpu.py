"""GPU inventory through NVML: models, memory, MIG slices and NVLink peers, or why none.

Read with a deadline (:mod:`dsec_core.nvmlcall`): a hung driver gives a record that says so
("NVML did not answer ... within 30 s") instead of holding the snapshot, its tree's lock and
its worker for good.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any, TypeVar

import pynvml
from dsec_core.nvmlcall import NVML_TIMEOUT_S, NvmlCalls, NvmlHung

from dsec_snapstore.domain import gpu_dot
from dsec_snapstore.manifest import GpuDevice, GpuRecord

T = TypeVar("T")


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _optional(query: Callable[[], T], default: T) -> T:
    """Run an NVML query that some GPUs or drivers do not support."""
    try:
        return query()
    except pynvml.NVMLError:
        return default


def _mig_slices(handle: Any) -> tuple[tuple[str, int], ...]:
    current, _pending = _optional(lambda: pynvml.nvmlDeviceGetMigMode(handle), (0, 0))
    if current != pynvml.NVML_DEVICE_MIG_ENABLE:
        return ()
    slices = []
    for i in range(_optional(lambda: pynvml.nvmlDeviceGetMaxMigDeviceCount(handle), 0)):
        mig = _optional(partial(pynvml.nvmlDeviceGetMigDeviceHandleByIndex, handle, i), None)
        if mig is None:
            continue
        name = _text(pynvml.nvmlDeviceGetName(mig))
        slices.append((name, int(pynvml.nvmlDeviceGetMemoryInfo(mig).total)))
    return tuple(slices)


def _nvlink_peers(handle: Any) -> tuple[str, ...]:
    peers = []
    for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
        state = _optional(partial(pynvml.nvmlDeviceGetNvLinkState, handle, link), None)
        if state is None:
            break  # no more links (or NVLink unsupported)
        if state == pynvml.NVML_FEATURE_ENABLED:
            info = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(handle, link)
            peers.append(_text(info.busId))
    return tuple(sorted(set(peers)))


def _device(index: int) -> GpuDevice:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    major, minor = _optional(lambda: pynvml.nvmlDeviceGetCudaComputeCapability(handle), (0, 0))
    bar1 = _optional(lambda: int(pynvml.nvmlDeviceGetBAR1MemoryInfo(handle).bar1Total), None)
    pci = _optional(lambda: _text(pynvml.nvmlDeviceGetPciInfo(handle).busId), None)
    slices = _mig_slices(handle)
    return GpuDevice(
        index=index,
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        memory_total=int(pynvml.nvmlDeviceGetMemoryInfo(handle).total),
        bar1_total=bar1,
        pci_bus_id=pci,
        compute_capability=f"{major}.{minor}" if major else None,
        mig_enabled=bool(slices),
        mig_slices=slices,
        nvlink_peers=_nvlink_peers(handle),
    )


def _cuda_version() -> str | None:
    raw = _optional(pynvml.nvmlSystemGetCudaDriverVersion_v2, 0)
    return f"{raw // 1000}.{raw % 1000 // 10}" if raw else None


def _deadline() -> float:
    """``DSEC_NVML_TIMEOUT_S`` (the node agent's setting), else 30 s."""
    try:
        value = float(os.environ.get("DSEC_NVML_TIMEOUT_S") or NVML_TIMEOUT_S)
    except ValueError:
        return NVML_TIMEOUT_S
    return value if 0 < value <= 3600 else NVML_TIMEOUT_S


_CALLS = NvmlCalls(_deadline())
"""This process's snapshot-side NVML reads: while one has not returned, the next says so."""


def probe_gpus() -> GpuRecord:
    """Return this node's GPUs and their memory layout as DOT, or say why there are none
    (blocking, at most the NVML deadline: call it from a thread)."""
    try:
        return _CALLS.call_blocking("the snapshot's GPU probe", _probe)
    except NvmlHung as exc:
        return GpuRecord(present=False, reason=str(exc))


def _probe() -> GpuRecord:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return GpuRecord(present=False, reason=f"NVML unavailable: {exc}")
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return GpuRecord(present=False, reason="NVML found no GPU")
        devices = tuple(_device(i) for i in range(count))
        return GpuRecord(
            present=True,
            driver_version=_text(pynvml.nvmlSystemGetDriverVersion()),
            cuda_version=_cuda_version(),
            devices=devices,
            dot=gpu_dot(devices),
        )
    except pynvml.NVMLError as exc:
        return GpuRecord(present=False, reason=f"NVML query failed: {exc}")
    finally:
        _optional(pynvml.nvmlShutdown, None)
