"""The GPU models DSec knows: canonical names, aliases and datasheet figures.

One catalogue for the spec (``compute_unit.gpu_type``: unknown models are located errors), the
scheduler (a node's GPUs and a unit's acceptable models compare canonical names) and the
simulated fleet. Figures are the vendors' public datasheet peaks (dense FP16 tensor throughput,
no sparsity; memory bandwidth of the listed memory), used to turn a unit's ``fp16_throughput`` or
``memory_bandwidth`` need into a GPU count and to refuse impossible combinations. ``G2`` and
``G3`` are the anonymised models of Alibaba's openb production trace (figures unknown: 0).

Sources: NVIDIA P100/T4/V100/A10/A100/L4/L40S/H100/H200 datasheets; AMD Instinct MI250X/MI300X
datasheets.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

GB = 10**9
GIB = 2**30


@dataclass(frozen=True)
class GpuModel:
    """One GPU model."""

    name: str
    """Canonical name (as the scheduler, heartbeats and ``unit.placed`` spell it)."""
    vendor: str
    memory_bytes: int
    fp16_tflops: float
    """Dense FP16 tensor throughput, TFLOPS (0: unknown)."""
    memory_bandwidth_gbps: float
    """Memory bandwidth, GB/s (0: unknown)."""
    nvlink: bool
    """Whether the model has a GPU-to-GPU link (NVLink, or AMD Infinity Fabric)."""
    aliases: tuple[str, ...] = ()
    family: str = ""
    """What a bare family name in a spec (``a100``) accepts: every model of the family."""


CATALOG: tuple[GpuModel, ...] = (
    GpuModel("P100", "nvidia", 16 * GIB, 18.7, 732, True, ("tesla-p100",), "p100"),
    GpuModel("T4", "nvidia", 16 * GIB, 65, 320, False, ("tesla-t4",), "t4"),
    GpuModel("V100M16", "nvidia", 16 * GIB, 125, 900, True, ("v100-16gb",), "v100"),
    GpuModel("V100M32", "nvidia", 32 * GIB, 125, 900, True, ("v100-32gb",), "v100"),
    GpuModel("A10", "nvidia", 24 * GIB, 125, 600, False, ("a10g",), "a10"),
    GpuModel("L4", "nvidia", 24 * GIB, 121, 300, False, (), "l4"),
    GpuModel("L40S", "nvidia", 48 * GIB, 362, 864, False, (), "l40s"),
    GpuModel("A100-40GB", "nvidia", 40 * GIB, 312, 1555, True, ("a100-sxm4-40gb",), "a100"),
    GpuModel("A100-80GB", "nvidia", 80 * GIB, 312, 2039, True, ("a100-sxm4-80gb",), "a100"),
    GpuModel("H100", "nvidia", 80 * GIB, 989, 3350, True, ("h100-sxm", "h100-80gb"), "h100"),
    GpuModel("H200", "nvidia", 141 * GB, 989, 4800, True, ("h200-sxm",), "h200"),
    GpuModel("MI250X", "amd", 128 * GIB, 383, 3277, True, (), "mi250x"),
    GpuModel("MI300X", "amd", 192 * GIB, 1307, 5300, True, (), "mi300x"),
    GpuModel("G2", "unknown", 0, 0, 0, False, (), "g2"),
    GpuModel("G3", "unknown", 0, 0, 0, False, (), "g3"),
)

BY_NAME: dict[str, GpuModel] = {m.name: m for m in CATALOG}


def _key(text: str) -> str:
    return re.sub(r"[\s_]+", "-", text.strip().lower())


_LOOKUP: dict[str, tuple[str, ...]] = {}
for _m in CATALOG:
    for _k in (_m.name, *_m.aliases):
        _LOOKUP[_key(_k)] = (_m.name,)
for _fam in {m.family for m in CATALOG}:
    _members = tuple(m.name for m in CATALOG if m.family == _fam)
    _LOOKUP.setdefault(_key(_fam), _members)


def resolve(text: str) -> tuple[str, ...]:
    """The canonical models a spelling accepts (a family name: all of them), case-insensitive.

    Raises:
        KeyError: the model is unknown.
    """
    try:
        return _LOOKUP[_key(text)]
    except KeyError:
        raise KeyError(text) from None


def known_names() -> list[str]:
    """Every accepted spelling, for error hints: families first, then canonical names."""
    return sorted({m.family for m in CATALOG}) + [m.name for m in CATALOG]


def canonical(nvml_name: str) -> str:
    """The canonical model of a name NVML reports (``NVIDIA H100 80GB HBM3`` → ``H100``), or the
    reported name itself when none matches (a node's GPUs are never hidden for lack of a row)."""
    text = nvml_name.upper().replace("NVIDIA", "").replace("TESLA", "").strip()
    if "A100" in text:
        return "A100-80GB" if "80" in text else "A100-40GB"
    if "V100" in text:
        return "V100M32" if "32" in text else "V100M16"
    for m in sorted(CATALOG, key=lambda m: -len(m.name)):
        if m.name in text.replace(" ", ""):
            return m.name
    return nvml_name.strip()
