"""GPU fragmentation against a distribution of typical units (the FGD paper's measure).

A node's free GPU capacity is *fragmented* for a typical unit when that unit could not use it:
the node lacks the model, the CPU, or GPUs with enough free milli. Weighting by how often each
typical unit arrives gives the node's expected fragmentation::

    F(node) = Σ_k f_k · frag_k(node)
    frag_k  = free milli on GPUs the unit could not use on this node (all of it when the unit
              cannot fit at all; only GPUs with less free than its share when it can)

Written as ``F = total_free − U`` with ``U = Σ_k f_k · fits_k · usable_k`` (the expected *usable*
free capacity), the change a placement causes only needs the per-GPU terms of the GPUs it touches,
which is what makes the measure cheap to evaluate for every (node, GPU) candidate at once.

All functions are vectorised over rows (nodes) × GPUs × typical units with numpy.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from .api import MILLI

Key = tuple[int, int, int, frozenset[str], int]
"""A unit's shape for the distribution: (cpu_milli, whole gpus, share milli, models, memory)."""

IntArr = npt.NDArray[np.int64]
BoolArr = npt.NDArray[np.bool_]
FloatArr = npt.NDArray[np.float64]


def shape_key(
    cpu_milli: int, gpus: int, gpu_milli: int, models: frozenset[str], memory_bytes: int = 0
) -> Key:
    """The shape the distribution counts (a 1000-milli share is one whole GPU)."""
    if gpu_milli >= MILLI and gpus == 0:
        gpus, gpu_milli = 1, 0
    return (max(cpu_milli, 0), gpus, gpu_milli, models, max(memory_bytes, 0))


@dataclass(frozen=True, slots=True)
class Typical:
    """The typical units as arrays: per unit k its cpu, per-GPU milli (1000 for whole GPUs, 0 for
    none), GPU count, weight, and which models it accepts (by model id)."""

    cpu: IntArr  # (K,)
    milli: IntArr  # (K,)
    count: IntArr  # (K,)
    weight: FloatArr  # (K,)
    mem: FloatArr  # (K,): the shape's mean memory (units of one shape differ in memory)
    access: BoolArr  # (K, M+1): model id → acceptable; the last column is "no GPU"
    keys: tuple[tuple[int, int, int, frozenset[str]], ...]

    @property
    def size(self) -> int:
        return len(self.keys)


def typical_from_counts(
    counts: Iterable[tuple[Key, float]],
    model_ids: dict[str, int],
    n_models: int,
    popularity: float = 0.95,
) -> Typical:
    """The most frequent shapes that together make ``popularity`` of all units (the paper's
    95 %), renormalised to sum to 1. ``n_models`` sizes the access table (ids ≥ it: none)."""
    merged: dict[tuple[int, int, int, frozenset[str]], list[float]] = {}
    for full, w in counts:
        acc = merged.setdefault((full[0], full[1], full[2], full[3]), [0.0, 0.0])
        acc[0] += w
        acc[1] += w * full[4]
    items = sorted(merged.items(), key=lambda kv: (-kv[1][0], repr(kv[0])))
    total = float(sum(w for _, (w, _m) in items))
    chosen: list[tuple[tuple[int, int, int, frozenset[str]], float, float]] = []
    cum = 0.0
    for shape, (w, msum) in items:
        if total <= 0 or cum >= popularity * total:
            break
        chosen.append((shape, w, msum / w if w else 0.0))
        cum += w
    cpu = np.array([k[0] for k, _, _ in chosen], dtype=np.int64)
    milli = np.array([MILLI if k[1] > 0 else k[2] for k, _, _ in chosen], dtype=np.int64)
    count = np.array([k[1] if k[1] > 0 else (1 if k[2] > 0 else 0) for k, _, _ in chosen], np.int64)
    weight = np.array([w for _, w, _ in chosen], dtype=np.float64)
    mem = np.array([m for _, _, m in chosen], dtype=np.float64)
    if weight.size:
        weight = weight / weight.sum()
    access = np.zeros((len(chosen), n_models + 1), dtype=bool)
    for i, (shape, _, _) in enumerate(chosen):
        models = shape[3]
        if not models:
            access[i, :n_models] = True
        else:
            for m in models:
                mid = model_ids.get(m)
                if mid is not None and mid < n_models:
                    access[i, mid] = True
    return Typical(cpu, milli, count, weight, mem, access, tuple(k for k, _, _ in chosen))


def usable_terms(
    typ: Typical, free: IntArr, gmodel: IntArr, gok: BoolArr, acc: BoolArr | None = None
) -> tuple[IntArr, IntArr, BoolArr]:
    """Per typical unit and row: how many GPUs it could use, and their summed free milli.

    ``free`` (R, G) free milli (absent GPUs: any value, masked by ``gok``), ``gmodel`` (R, G) model
    ids, ``gok`` (R, G) present and healthy. Returns ``cnt`` (K, R), ``use`` (K, R) and the mask
    ``ge`` (K, R, G) of usable GPUs."""
    if acc is None:
        acc = access_of(typ, gmodel, gok)
    ge = acc & (free[None] >= typ.milli[:, None, None])
    cnt = ge.sum(axis=2)
    use = (ge * free[None]).sum(axis=2)
    return cnt, use, ge


def access_of(typ: Typical, gmodel: IntArr, gok: BoolArr) -> BoolArr:
    """(K, R, G): GPU may serve typical unit k (model accepted, present, healthy; GPU units)."""
    return typ.access[:, gmodel] & gok[None] & (typ.milli[:, None, None] > 0)


def expected_usable(
    typ: Typical, cnt: IntArr, use: IntArr, cpu_free: IntArr, mem_free: IntArr | None = None
) -> FloatArr:
    """``U`` per row: Σ_k f_k · [unit k fits] · usable_k (CPU-only units use no GPU). With
    ``mem_free`` a unit also needs its shape's memory (FGD itself looks at CPU only)."""
    fits = (cnt >= typ.count[:, None]) & (cpu_free[None] >= typ.cpu[:, None])
    if mem_free is not None:
        fits &= mem_free[None] >= typ.mem[:, None]
    return np.asarray((typ.weight[:, None] * (fits * use)).sum(axis=0), dtype=np.float64)


def share_candidates(
    typ: Typical,
    free: IntArr,
    gmodel: IntArr,
    gok: BoolArr,
    cpu_free: IntArr,
    cpu: int,
    milli: int,
    mem_free: IntArr | None = None,
    mem: int = 0,
) -> tuple[FloatArr, FloatArr]:
    """Fragmentation change of putting a ``milli`` share on each GPU of each row.

    Returns ``dfrag`` (R, G): F(after) − F(before) (lower is better; meaningless where the share
    does not fit), and ``u_after`` (R, G) the expected usable capacity left."""
    acc = access_of(typ, gmodel, gok)
    cnt, use, ge = usable_terms(typ, free, gmodel, gok, acc)
    after = free - milli  # (R, G)
    ge2 = acc & (after[None] >= typ.milli[:, None, None])
    cnt2 = cnt[:, :, None] - ge + ge2  # (K, R, G)
    use2 = use[:, :, None] - ge * free[None] + ge2 * after[None]
    cpu2 = cpu_free - cpu
    fits2 = (cnt2 >= typ.count[:, None, None]) & (cpu2[None, :, None] >= typ.cpu[:, None, None])
    if mem_free is not None:
        fits2 &= (mem_free - mem)[None, :, None] >= typ.mem[:, None, None]
    u2 = (typ.weight[:, None, None] * (fits2 * use2)).sum(axis=0)
    u1 = expected_usable(typ, cnt, use, cpu_free, mem_free)
    # F = total − U, and the total drops by the share: ΔF = −milli − (U' − U)
    return -float(milli) - (u2 - u1[:, None]), u2


def state_change(
    typ: Typical,
    free: IntArr,
    free_after: IntArr,
    gmodel: IntArr,
    gok: BoolArr,
    cpu_free: IntArr,
    cpu: int,
    mem_free: IntArr | None = None,
    mem: int = 0,
) -> tuple[FloatArr, FloatArr]:
    """Fragmentation change for one candidate state per row (whole GPUs, or no GPU):
    ``free_after`` is each row's free milli after the placement."""
    acc = access_of(typ, gmodel, gok)
    cnt, use, _ = usable_terms(typ, free, gmodel, gok, acc)
    u1 = expected_usable(typ, cnt, use, cpu_free, mem_free)
    cnt2, use2, _ = usable_terms(typ, free_after, gmodel, gok, acc)
    u2 = expected_usable(
        typ, cnt2, use2, cpu_free - cpu, None if mem_free is None else mem_free - mem
    )
    taken = np.where(gok, free - free_after, 0).sum(axis=1)
    return -taken - (u2 - u1), u2


def sigmoid_score(dfrag: FloatArr) -> IntArr:
    """FGD's node score: ``int(100 · sigmoid(−ΔF / 1000))`` (kube-scheduler's 0-100 integers)."""
    x = np.clip(-dfrag / 1000.0, -50, 50)
    return np.asarray(np.trunc(100.0 / (1.0 + np.exp(-x))), dtype=np.int64)
