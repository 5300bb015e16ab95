"""The placement engine: a stateful, incremental, numpy-vectorised :class:`PlacementEngine`.

The fleet lives in arrays (nodes × GPUs): free milli per GPU, model ids, memory, NVLink group,
health and temperature, and per node free CPU, memory and unit count. A decision filters every
node at once and scores the feasible ones with the engine's policy; ``random`` and ``bestfit``
break ties at random (from the engine's seed, so a run is reproducible), ``fgd`` and ``dsec`` by
node name as the paper's simulator does.

Policies:

- ``random``: any feasible node, uniformly; a share goes on a random GPU that fits.
- ``bestfit``: kube-scheduler style best fit: ``0.5·cpu_left/128000 + 0.5·gpu_milli_left/8000``
  after placing, as an integer 0-100 (lower left is better), random tie-break; a share takes the
  tightest GPU that fits, whole GPUs the first free ones.
- ``fgd``: fragmentation gradient descent (Weng et al., ATC '23): the node and GPU whose expected
  fragmentation (:mod:`.frag`) grows least, scored ``int(100·sigmoid(−ΔF/1000))`` as the paper's
  simulator does, ties to the node first by name (the simulator's kube-scheduler picks the
  lexicographically smallest name, not a random one).
- ``dsec``: FGD's measure, with each typical unit's memory asked of the node too, the same
  0-100 score, and then, among equal scores, the node most used after the placement (in 1/8
  steps of its GPU capacity), then the name: see :func:`_dsec_rank` and docs/placement.md.

Scores of a unit shape are cached per node and recomputed only for nodes that changed since
(each commit changes one node), which is what keeps a decision well under a millisecond.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import numpy.typing as npt

from . import frag
from .api import (
    MILLI,
    GangDemand,
    GangPlacement,
    NodeSpec,
    Unfit,
    UnitChoice,
    UnitDemand,
)

POLICIES = ("random", "bestfit", "fgd", "dsec")

_MAX_SPEC_CPU = 128_000
_MAX_SPEC_GPU = 8 * MILLI
_GIB = 1 << 30
_FILL_STEPS = 8  # one GPU of an 8-GPU node
_LEARN_EVERY = 256
_LEARN_MOVED = 0.02

IntArr = npt.NDArray[np.int64]
BoolArr = npt.NDArray[np.bool_]
FloatArr = npt.NDArray[np.float64]


@dataclass(slots=True)
class _Held:
    node: int
    slots: tuple[int, ...]
    milli: int
    cpu: int
    mem: int


@dataclass(slots=True)
class _ShapeCache:
    """Per-node best score and GPU slot for one unit shape; row ``i`` is valid while the node's
    version is not newer than ``stamp[i]``."""

    stamp: IntArr
    score: FloatArr
    slot: IntArr
    terms: FloatArr  # (N, 3): the named score terms
    names: tuple[str, ...] = field(default=())


class _Slots:
    """Lazily, per row: the GPUs that could take the unit (allowed and with enough free)."""

    __slots__ = ("free", "mask", "need")

    def __init__(self, mask: BoolArr, free: IntArr, need: int) -> None:
        self.mask, self.free, self.need = mask, free, need

    def __getitem__(self, rows: int | npt.NDArray[np.intp]) -> BoolArr:
        return np.asarray(self.mask[rows] & (self.free[rows] >= self.need))


def _moved(old: frag.Typical, new: frag.Typical) -> bool:
    """Whether two distributions differ by more than ``_LEARN_MOVED`` in total variation."""
    a = dict(zip(old.keys, old.weight.tolist(), strict=True))
    b = dict(zip(new.keys, new.weight.tolist(), strict=True))
    tv = 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in a.keys() | b.keys())
    return bool(tv > _LEARN_MOVED)


def _check(gang_id: str, u: UnitDemand) -> None:
    """A unit's numbers make sense, or a clear error naming the gang, unit and field."""
    where = f"gang {gang_id}, unit {u.key}"
    if not 0 <= u.gpu_milli <= MILLI:
        raise ValueError(f"{where}: gpu_milli {u.gpu_milli} is not 0-1000 (thousandths of a GPU)")
    if u.gpus < 0:
        raise ValueError(f"{where}: gpus {u.gpus} is negative")
    if u.gpus and u.gpu_milli:
        raise ValueError(f"{where}: gpus and gpu_milli are exclusive (whole GPUs or one share)")
    if u.cpu_milli < 0 or u.memory_bytes < 0 or u.min_gpu_memory_bytes < 0:
        raise ValueError(f"{where}: cpu_milli, memory_bytes, min_gpu_memory_bytes must be ≥ 0")


def _any(m: BoolArr) -> BoolArr:
    return np.asarray(m.any(axis=1), dtype=bool)


@dataclass(slots=True)
class _Elig:
    """The GPUs a unit's static constraints (models, GPU memory, health, temperature) allow:
    ``mask`` (N, G), per node whether any, and whether every node allows all its healthy GPUs
    or none (then per-node aggregates answer "does it fit" without touching N × G)."""

    mask: BoolArr
    node_any: BoolArr
    uniform: bool


def _models_text(models: frozenset[str]) -> str:
    """``V100M16/V100M32``; more than three: the first three, then ``/…`` (a bounded reason)."""
    names = sorted(models)
    return "/".join(names) if len(names) <= 3 else "/".join(names[:3]) + "/…"


class Engine:
    """See the module docstring. ``typical``: the distribution of unit shapes the fragmentation
    measure expects (shape key → weight, :func:`frag.shape_key`); without it the engine learns the
    distribution online from the units it is asked to place. ``memory_aware``: a typical unit
    fits a node only with its memory free too (default: on for ``dsec``, off for ``fgd``)."""

    # the fleet, one row per node (rows of removed nodes are reused), G columns of GPU slots
    _cpu_cap: IntArr
    _cpu_free: IntArr
    _mem_cap: IntArr
    _mem_free: IntArr
    _units: IntArr
    _max_units: IntArr
    _alive: BoolArr
    _sched: BoolArr
    _ver: IntArr  # the clock at the node's last change
    _gmax: IntArr  # most free milli on one healthy GPU (-1: none)
    _gwhole: IntArr  # healthy GPUs with all 1000 milli free
    _gfree: IntArr
    _gcap: IntArr
    _gmodel: IntArr  # model id, -1: no GPU in the slot
    _gmem: IntArr
    _gok: BoolArr  # present and healthy
    _gpresent: BoolArr
    _gtemp: FloatArr
    _gnvl: IntArr
    _gindex: IntArr  # the GPU's index as the node reports it

    def __init__(
        self,
        policy: str = "dsec",
        *,
        seed: int = 0,
        typical: Mapping[frag.Key, float] | None = None,
        popularity: float = 0.95,
        memory_aware: bool | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r} is not one of {', '.join(POLICIES)}")
        self.policy = policy
        self._memory_aware = policy == "dsec" if memory_aware is None else memory_aware
        self._rng = random.Random(seed)
        self._popularity = popularity
        self._fixed_typical = dict(typical) if typical is not None else None
        self._seen: dict[frag.Key, float] = {}
        self._seen_total = 0
        self._seen_gangs: set[str] = set()
        self._next_learn = 16
        self._typ: frag.Typical | None = None
        self._typ_stale = False
        self._typ_models = -1
        self._cap = 0
        self._g = 0
        self._n = 0  # rows in use (alive or tombstoned)
        self._ids: list[str] = []
        self._index: dict[str, int] = {}
        self._free_rows: list[int] = []
        self._reason: list[str] = []
        self._model_ids: dict[str, int] = {}
        self._model_names: list[str] = []
        self._held: dict[str, _Held] = {}
        self._clock = 0
        self._rank: IntArr | None = None
        self._alloc(16, 1)
        self._elig: dict[tuple[frozenset[str], int, float | None], _Elig] = {}
        self._static: dict[tuple[object, ...], tuple[IntArr, list[str]]] = {}
        self._shape: dict[tuple[object, ...], _ShapeCache] = {}

    # ---- fleet arrays -------------------------------------------------------------------------

    def _alloc(self, cap: int, g: int) -> None:
        old = self.__dict__.get("_cpu_cap")

        def grow(
            a: npt.NDArray[np.generic] | None, shape: tuple[int, ...], fill: object, dt: object
        ) -> npt.NDArray[np.generic]:
            out = np.full(shape, fill, dtype=dt)  # type: ignore[call-overload]
            if a is not None:
                if a.ndim == 1:
                    out[: a.shape[0]] = a
                else:
                    out[: a.shape[0], : a.shape[1]] = a
            return np.asarray(out)

        d = self.__dict__
        specs: tuple[tuple[str, object, object], ...] = (
            ("_cpu_cap", 0, np.int64),
            ("_cpu_free", 0, np.int64),
            ("_mem_cap", 0, np.int64),
            ("_mem_free", 0, np.int64),
            ("_units", 0, np.int64),
            ("_max_units", 0, np.int64),
            ("_alive", False, bool),
            ("_sched", False, bool),
            ("_ver", 0, np.int64),
            ("_gmax", -1, np.int64),
            ("_gwhole", 0, np.int64),
        )
        for name, fill, dt in specs:
            d[name] = grow(d.get(name) if old is not None else None, (cap,), fill, dt)
        gspecs: tuple[tuple[str, object, object], ...] = (
            ("_gfree", 0, np.int64),
            ("_gcap", 0, np.int64),
            ("_gmodel", -1, np.int64),
            ("_gmem", 0, np.int64),
            ("_gok", False, bool),  # present and healthy
            ("_gpresent", False, bool),
            ("_gtemp", np.nan, np.float64),
            ("_gnvl", 0, np.int64),
            ("_gindex", 0, np.int64),
        )
        for name, fill, dt in gspecs:
            d[name] = grow(d.get(name) if old is not None else None, (cap, g), fill, dt)
        self._cap, self._g = cap, g
        self._elig = {}
        self._shape = {}
        self._static = {}

    def _touch(self, row: int) -> None:
        self._clock += 1
        self._ver[row] = self._clock
        ok = self._gok[row]
        free = self._gfree[row]
        self._gmax[row] = int(free[ok].max()) if ok.any() else -1
        self._gwhole[row] = int((ok & (free >= MILLI)).sum())

    def upsert_node(self, node: NodeSpec) -> None:
        row = self._index.get(node.node_id)
        fresh = row is None
        if row is None:
            row = self._free_rows.pop() if self._free_rows else self._n
            if row == self._n:
                self._n += 1
        g = max(self._g, len(node.gpus))
        if self._n > self._cap or g > self._g:
            self._alloc(max(self._cap * 2, self._n, 16), g)
        if fresh:
            self._rank = None
            self._index[node.node_id] = row
            if row == len(self._ids):
                self._ids.append(node.node_id)
                self._reason.append("")
            else:
                self._ids[row] = node.node_id
        held_cpu = held_mem = units = 0
        gused = np.zeros(self._g, dtype=np.int64)
        if not fresh:
            for h in self._held.values():
                if h.node == row:
                    held_cpu += h.cpu
                    held_mem += h.mem
                    units += 1
                    for s in h.slots:
                        gused[s] += h.milli
        self._cpu_cap[row] = node.cpu_milli
        self._cpu_free[row] = node.cpu_milli - held_cpu
        self._mem_cap[row] = node.memory_bytes
        self._mem_free[row] = node.memory_bytes - held_mem
        self._units[row] = units
        self._max_units[row] = node.max_units
        self._alive[row] = True
        self._sched[row] = node.schedulable
        self._reason[row] = node.unschedulable_reason or "cordoned"
        for a, v in (
            (self._gcap, 0),
            (self._gfree, 0),
            (self._gmodel, -1),
            (self._gmem, 0),
            (self._gok, False),
            (self._gpresent, False),
            (self._gtemp, np.nan),
            (self._gnvl, 0),
            (self._gindex, 0),
        ):
            a[row] = v
        for s, gpu in enumerate(node.gpus):
            mid = self._model_ids.get(gpu.model)
            if mid is None:
                mid = self._model_ids[gpu.model] = len(self._model_names)
                self._model_names.append(gpu.model)
            self._gcap[row, s] = MILLI
            self._gfree[row, s] = max(0, MILLI - int(gused[s]))
            self._gmodel[row, s] = mid
            self._gmem[row, s] = gpu.memory_bytes
            self._gpresent[row, s] = True
            self._gok[row, s] = gpu.healthy
            self._gtemp[row, s] = np.nan if gpu.temperature_c is None else gpu.temperature_c
            self._gnvl[row, s] = gpu.nvlink_group
            self._gindex[row, s] = gpu.index
        self._touch(row)
        self._static = {}
        if fresh:
            self._elig = {}
        else:
            for key, e in self._elig.items():
                e.mask[row] = self._elig_rows(key, np.array([row]))[0]
                e.node_any[row] = e.mask[row].any()
                if e.node_any[row] and not (e.mask[row] == self._gok[row]).all():
                    e.uniform = False

    def remove_node(self, node_id: str) -> None:
        row = self._index.pop(node_id, None)
        if row is None:
            return
        self._rank = None
        self._alive[row] = False
        self._sched[row] = False
        self._gpresent[row] = False
        self._gok[row] = False
        self._gfree[row] = 0
        self._gcap[row] = 0
        self._touch(row)
        self._static = {}
        for key in [k for k, h in self._held.items() if h.node == row]:
            del self._held[key]
        self._free_rows.append(row)

    def _name_rank(self) -> IntArr:
        if self._rank is None or self._rank.size != self._cap:
            rank = np.full(self._cap, self._cap, dtype=np.int64)
            for pos, (_name, row) in enumerate(sorted(self._index.items())):
                rank[row] = pos
            self._rank = rank
        return self._rank

    def nodes(self) -> Sequence[str]:
        return sorted(self._index)

    # ---- eligibility (static per unit constraints) --------------------------------------------

    def _elig_rows(
        self, key: tuple[frozenset[str], int, float | None], rows: npt.NDArray[np.intp]
    ) -> BoolArr:
        models, min_mem, max_temp = key
        ok = self._gok[rows] & self._gpresent[rows]
        if models:
            ids = [self._model_ids[m] for m in models if m in self._model_ids]
            ok = ok & np.isin(self._gmodel[rows], ids)
        if min_mem:
            ok = ok & (self._gmem[rows] >= min_mem)
        if max_temp is not None:
            t = self._gtemp[rows]
            ok = ok & (np.isnan(t) | (t < max_temp))
        return np.asarray(ok)

    def _eligible(self, u: UnitDemand) -> _Elig:
        key = (u.models, u.min_gpu_memory_bytes, u.max_temperature_c)
        e = self._elig.get(key)
        if e is None:
            mask = self._elig_rows(key, np.arange(self._cap))
            node_any = _any(mask)
            uniform = bool(((mask == self._gok) | ~node_any[:, None]).all())
            e = self._elig[key] = _Elig(mask, node_any, uniform)
        return e

    # ---- the typical distribution -------------------------------------------------------------

    def _learn(self, gang: GangDemand) -> None:
        """Count the shapes of a gang's units the first time it is asked for (a pending gang is
        asked again). The distribution is re-estimated at 16, 32, 64 … units, then every 256, and
        adopted (which drops the score caches) when it moved by more than 2 % (total variation)."""
        if self._fixed_typical is not None or self.policy not in ("fgd", "dsec"):
            return
        if gang.gang_id in self._seen_gangs:
            return
        if len(self._seen_gangs) > 100_000:
            self._seen_gangs.clear()
        self._seen_gangs.add(gang.gang_id)
        for u in gang.units:
            k = frag.shape_key(u.cpu_milli, u.gpus, u.gpu_milli, u.models, u.memory_bytes)
            self._seen[k] = self._seen.get(k, 0.0) + 1.0
            self._seen_total += 1
        if self._seen_total >= self._next_learn:
            self._next_learn = min(self._next_learn * 2, self._seen_total + _LEARN_EVERY)
            self._typ_stale = True

    def _typical(self) -> frag.Typical:
        nm = len(self._model_names)
        if self._typ is None or self._typ_models != nm or self._typ_stale:
            counts = self._fixed_typical if self._fixed_typical is not None else self._seen
            typ = frag.typical_from_counts(counts.items(), self._model_ids, nm, self._popularity)
            moved = self._typ is None or self._typ_models != nm or _moved(self._typ, typ)
            self._typ_stale = False
            if moved:
                self._typ = typ
                self._typ_models = nm
                self._shape = {}
        assert self._typ is not None
        return self._typ

    # ---- one unit -----------------------------------------------------------------------------

    def _gpu_fit(self, u: UnitDemand, e: _Elig) -> BoolArr:
        """Per node: the GPU part of the unit fits."""
        if u.gpus > 0:
            if u.nvlink and u.gpus > 1:
                slot_ok = e.mask & (self._gfree >= MILLI)
                fit = np.zeros(self._cap, dtype=bool)
                for grp in np.unique(self._gnvl[slot_ok]):
                    fit |= (slot_ok & (self._gnvl == grp)).sum(axis=1) >= u.gpus
                return fit
            if e.uniform:
                return e.node_any & (self._gwhole >= u.gpus)
            return np.asarray((e.mask & (self._gfree >= MILLI)).sum(axis=1) >= u.gpus)
        if u.gpu_milli > 0:
            if e.uniform:
                return e.node_any & (self._gmax >= u.gpu_milli)
            return _any(e.mask & (self._gfree >= u.gpu_milli))
        return np.ones(self._cap, dtype=bool)

    def _feasible(self, u: UnitDemand, e: _Elig) -> tuple[BoolArr, BoolArr]:
        """(feasible nodes, the GPU part fits)."""
        gfit = self._gpu_fit(u, e)
        ok = (
            self._sched
            & (self._cpu_free >= u.cpu_milli)
            & (self._mem_free >= u.memory_bytes)
            & (self._units < self._max_units)
            & gfit
        )
        return ok, gfit

    def _static_codes(self, u: UnitDemand) -> tuple[IntArr, list[str]]:
        """Per node, the first GPU constraint it fails (0: none) and the reasons' texts; these
        change only when nodes do, so they are kept until the next upsert or removal."""
        key = (u.models, u.min_gpu_memory_bytes, u.max_temperature_c)
        got = self._static.get(key)
        if got is not None:
            return got
        codes = np.zeros(self._cap, dtype=np.int64)
        texts: list[str] = []

        def mark(ok_any: BoolArr, text: str) -> None:
            texts.append(text)
            codes[(codes == 0) & ~ok_any] = len(texts)

        m = self._gpresent
        mark(_any(m), "no GPU")
        if u.models:
            m = m & np.isin(self._gmodel, [self._model_ids.get(x, -2) for x in u.models])
            mark(_any(m), f"no GPU of model {_models_text(u.models)}")
        if u.min_gpu_memory_bytes:
            m = m & (self._gmem >= u.min_gpu_memory_bytes)
            gib = u.min_gpu_memory_bytes / _GIB
            mark(_any(m), f"no GPU with {gib:g} GiB memory")
        m = m & self._gok
        mark(_any(m), "GPU unhealthy")
        if u.max_temperature_c is not None:
            t = self._gtemp
            m = m & (np.isnan(t) | (t < u.max_temperature_c))
            mark(_any(m), "GPU too hot")
        got = self._static[key] = (codes, texts)
        return got

    def _reasons(self, u: UnitDemand, gfit: BoolArr, only: int | None) -> dict[str, int]:
        """Each node under its first failing reason: not the peer's node, unschedulable, unit
        limit, GPU model / memory / health / temperature, GPU capacity, CPU, memory."""
        out: dict[str, int] = {}
        left = self._alive.copy()

        def count(bad: BoolArr, text: str) -> None:
            nonlocal left
            hit = left & bad
            c = int(hit.sum())
            if c:
                out[text] = out.get(text, 0) + c
                left &= ~bad

        if only is not None:
            other = np.ones(self._cap, dtype=bool)
            other[only] = False
            count(other, "not the node of its nvlink/shm peer")
        for row in np.flatnonzero(left & ~self._sched):
            r = self._reason[int(row)]
            out[r] = out.get(r, 0) + 1
        left &= self._sched
        count(self._units >= self._max_units, "at its unit limit")
        if u.gpus > 0 or u.gpu_milli > 0:
            codes, texts = self._static_codes(u)
            per = np.bincount(codes[left], minlength=len(texts) + 1)
            for i, text in enumerate(texts, start=1):
                if per[i]:
                    out[text] = out.get(text, 0) + int(per[i])
            left &= codes == 0
            if u.gpus > 0:
                nv = u.nvlink and u.gpus > 1
                count(
                    ~gfit,
                    "no NVLink group with enough free GPUs" if nv else "insufficient whole GPUs",
                )
            else:
                count(~gfit, "insufficient GPU share")
        count(self._cpu_free < u.cpu_milli, "insufficient CPU")
        count(self._mem_free < u.memory_bytes, "insufficient memory")
        return out

    def _shape_key(self, u: UnitDemand) -> tuple[object, ...]:
        return (
            u.cpu_milli,
            u.gpus,
            u.gpu_milli,
            u.models,
            u.min_gpu_memory_bytes,
            u.max_temperature_c,
            u.nvlink,
        )

    def _frag_scores(
        self, u: UnitDemand, rows: npt.NDArray[np.intp], slot_ok: _Slots
    ) -> tuple[FloatArr, IntArr, FloatArr, tuple[str, ...]]:
        """Scores (higher is better), chosen slot and named terms for ``rows``. Rows in the same
        state (same free milli, models, health, CPU …) score alike: each state is scored once."""
        if rows.size > 32:
            state = np.concatenate(
                [
                    self._gfree[rows],
                    self._gmodel[rows],
                    self._gok[rows],
                    slot_ok[rows],
                    self._cpu_free[rows, None],
                    self._gcap[rows].sum(axis=1, keepdims=True),
                ],
                axis=1,
            ).astype(np.int64)
            h = state @ self._hash_vec(state.shape[1])
            _, first, inverse = np.unique(h, return_index=True, return_inverse=True)
            if first.size < rows.size * 0.7:
                score, slot, terms, names = self._frag_rows(u, rows[first], slot_ok)
                return score[inverse], slot[inverse], terms[inverse], names
        return self._frag_rows(u, rows, slot_ok)

    def _hash_vec(self, n: int) -> IntArr:
        v = self.__dict__.get("_hv")
        if v is None or v.size != n:
            v = self.__dict__["_hv"] = np.random.default_rng(12345).integers(
                1, 1 << 62, size=n, dtype=np.int64
            )
        return v

    def _frag_rows(
        self, u: UnitDemand, rows: npt.NDArray[np.intp], slot_ok: _Slots
    ) -> tuple[FloatArr, IntArr, FloatArr, tuple[str, ...]]:
        typ = self._typical()
        free = self._gfree[rows]
        gmodel = self._gmodel[rows]
        gok = self._gok[rows] & self._gpresent[rows]
        cpu = self._cpu_free[rows]
        cap = np.maximum(self._gcap[rows].sum(axis=1), 1).astype(np.float64)
        free_total = np.where(gok, free, 0).sum(axis=1)
        dsec = self.policy == "dsec"
        # DSec's measure also asks a typical unit's memory of the node (FGD's looks at CPU only)
        memf = self._mem_free[rows] if self._memory_aware else None
        names = ("fragmentation_delta", "fgd_score", "node_used_after")
        ar = np.arange(len(rows))
        if u.gpus == 0 and 0 < u.gpu_milli < MILLI:
            dfrag2, _ = frag.share_candidates(
                typ, free, gmodel, gok, cpu, u.cpu_milli, u.gpu_milli, memf, u.memory_bytes
            )
            base2 = frag.sigmoid_score(dfrag2).astype(np.float64)
            base2 = np.where(slot_ok[rows], base2, -np.inf)
            slot = np.argmax(base2, axis=1)  # the first GPU among the best, as FGD does
            base = base2[ar, slot]
            dfrag = dfrag2[ar, slot]
            used = 1.0 - (free_total - u.gpu_milli) / cap
        else:
            after = free.copy()
            slot = np.full(len(rows), -1, dtype=np.int64)
            if u.gpus > 0 or u.gpu_milli >= MILLI:
                k = max(u.gpus, 1)
                first = np.argsort(~slot_ok[rows], axis=1, kind="stable")[:, :k]
                after[ar[:, None], first] = 0
                slot = first[:, 0].astype(np.int64)
            dfrag, _ = frag.state_change(
                typ, free, after, gmodel, gok, cpu, u.cpu_milli, memf, u.memory_bytes
            )
            base = frag.sigmoid_score(dfrag).astype(np.float64)
            used = 1.0 - np.where(gok, after, 0).sum(axis=1) / cap
        score = _dsec_rank(base, used) if dsec else base
        terms = np.stack([dfrag, base, used], axis=1)
        return np.asarray(score, dtype=np.float64), slot.astype(np.int64), terms, names

    def _gfree_total(self, rows: npt.NDArray[np.intp]) -> IntArr:
        return np.asarray(np.where(self._gpresent[rows], self._gfree[rows], 0).sum(axis=1))

    def _scores(
        self, u: UnitDemand, feas: BoolArr, slot_ok: _Slots
    ) -> tuple[FloatArr, IntArr, FloatArr, tuple[str, ...]]:
        """Scores for all rows (only feasible rows are meaningful)."""
        n = self._cap
        if self.policy == "random":
            return np.zeros(n), np.full(n, -1, np.int64), np.zeros((n, 0)), ()
        if self.policy == "bestfit":
            req = u.gpus * MILLI if u.gpus else u.gpu_milli
            cpu_left = (self._cpu_free - u.cpu_milli) / _MAX_SPEC_CPU
            gpu_left = (self._gfree_total(np.arange(n)) - req) / _MAX_SPEC_GPU
            raw = 0.5 * cpu_left + 0.5 * gpu_left
            score = np.trunc((1.0 - raw) * 100.0)
            return (
                score,
                np.full(n, -1, np.int64),
                np.stack([cpu_left, gpu_left], 1),
                (
                    "cpu_left",
                    "gpu_left",
                ),
            )
        self._typical()  # a re-estimated distribution drops the caches first
        key = self._shape_key(u)
        c = self._shape.get(key)
        if c is None:
            c = self._shape[key] = _ShapeCache(
                np.full(n, -1, dtype=np.int64),
                np.zeros(n),
                np.full(n, -1, dtype=np.int64),
                np.zeros((n, 3)),
            )
        # only feasible rows that changed since they were last scored
        stale = np.flatnonzero(feas & (self._ver > c.stamp))
        if stale.size:
            score, slot, terms, names = self._frag_scores(u, stale, slot_ok)
            c.score[stale] = score
            c.slot[stale] = slot
            c.terms[stale] = terms
            c.stamp[stale] = self._clock
            c.names = names
        return c.score, c.slot, c.terms, c.names

    def _choose(
        self, u: UnitDemand, only: int | None, group: int | None
    ) -> tuple[UnitChoice, int, tuple[int, ...]] | dict[str, int]:
        e = self._eligible(u)
        if group is not None and only is not None:
            mask = e.mask.copy()
            mask[only] &= self._gnvl[only] == group
            e = _Elig(mask, _any(mask), False)
        feas, gfit = self._feasible(u, e)
        if only is not None:
            keep = feas[only]
            feas = np.zeros_like(feas)
            feas[only] = keep
        idx = np.flatnonzero(feas)
        if idx.size == 0:
            return self._reasons(u, gfit, only)
        if self.policy == "dsec" and u.gpus == 0 and u.gpu_milli == 0:
            gpuless = idx[~self._gpresent[idx].any(axis=1)]
            if gpuless.size:
                return self._spread(u, gpuless, int(idx.size))
        need = MILLI if u.gpus > 0 else u.gpu_milli
        slot_ok = _Slots(e.mask, self._gfree, need)
        if group is not None:
            # restricted GPUs: score directly, the shape cache assumes unrestricted slots
            score, slot, terms, names = self._direct(u, idx, slot_ok)
            sub = score
        else:
            score, slot, terms, names = self._scores(u, feas, slot_ok)
            sub = score[idx]
            slot = slot[idx]
            terms = terms[idx] if terms.shape[1] else terms
        best = np.flatnonzero(sub == sub.max())
        if best.size == 1:
            pick = int(best[0])
        elif self.policy in ("fgd", "dsec"):
            # the paper's simulator breaks ties by the lexicographically smallest node name
            pick = int(best[np.argmin(self._name_rank()[idx[best]])])
        else:
            pick = int(best[self._rng.randrange(best.size)])
        row = int(idx[pick])
        slots = self._slots_for(u, row, int(slot[pick]) if slot.size else -1, slot_ok)
        gi = tuple(int(self._gindex[row, s]) for s in slots)
        bd = {nm: float(terms[pick, j]) for j, nm in enumerate(names)} if names else {}
        milli = MILLI if u.gpus > 0 else u.gpu_milli
        choice = UnitChoice(
            key=u.key,
            node_id=self._ids[row],
            gpu_indices=gi,
            gpu_milli=milli if slots else 0,
            score=float(sub[pick]),
            breakdown=bd,
            feasible_nodes=int(idx.size),
            cpu_milli=u.cpu_milli,
            memory_bytes=u.memory_bytes,
        )
        return choice, row, slots

    def _spread(
        self, u: UnitDemand, rows: npt.NDArray[np.intp], feasible: int
    ) -> tuple[UnitChoice, int, tuple[int, ...]]:
        """A unit without GPUs, with nodes without GPUs that fit it: the least loaded of those
        (the most free of its scarcer resource after placing; ties by node name). GPU nodes
        keep their CPUs and memory for GPU units (a GPU whose node's CPUs are gone is
        stranded), and agent sandboxes spread, as Kubernetes' LeastAllocated does, so one node's
        trouble reaches as few of them as possible."""
        cpu = (self._cpu_free[rows] - u.cpu_milli) / np.maximum(self._cpu_cap[rows], 1)
        mem = (self._mem_free[rows] - u.memory_bytes) / np.maximum(self._mem_cap[rows], 1)
        free_after = np.minimum(cpu, mem)
        best = np.flatnonzero(free_after == free_after.max())
        pick = (
            int(best[np.argmin(self._name_rank()[rows[best]])]) if best.size > 1 else int(best[0])
        )
        row = int(rows[pick])
        choice = UnitChoice(
            key=u.key,
            node_id=self._ids[row],
            score=float(free_after[pick]),
            breakdown={"free_after": float(free_after[pick]), "gpu_nodes_spared": 1.0},
            feasible_nodes=feasible,
            cpu_milli=u.cpu_milli,
            memory_bytes=u.memory_bytes,
        )
        return choice, row, ()

    def _direct(
        self, u: UnitDemand, idx: npt.NDArray[np.intp], slot_ok: _Slots
    ) -> tuple[FloatArr, IntArr, FloatArr, tuple[str, ...]]:
        if self.policy in ("fgd", "dsec"):
            return self._frag_scores(u, idx, slot_ok)
        score, slot, terms, names = self._scores(u, np.ones(self._cap, bool), slot_ok)
        return score[idx], slot[idx], terms[idx] if terms.shape[1] else terms, names

    def _slots_for(self, u: UnitDemand, row: int, hint: int, slot_ok: _Slots) -> tuple[int, ...]:
        ok = slot_ok[row]
        if u.gpus > 0 or u.gpu_milli >= MILLI:
            k = max(u.gpus, 1)
            cand = np.flatnonzero(ok)
            if u.nvlink and k > 1:
                for grp in np.unique(self._gnvl[row, cand]):
                    inside = cand[self._gnvl[row, cand] == grp]
                    if inside.size >= k:
                        return tuple(int(s) for s in inside[:k])
            return tuple(int(s) for s in cand[:k])
        if u.gpu_milli > 0:
            if hint >= 0 and ok[hint]:
                return (hint,)
            cand = np.flatnonzero(ok)
            if self.policy == "random":
                return (int(cand[self._rng.randrange(cand.size)]),)
            free = self._gfree[row, cand]
            return (int(cand[np.argmin(free)]),)  # tightest fit, first among equals
        return ()

    # ---- gangs --------------------------------------------------------------------------------

    def _apply(
        self, row: int, slots: tuple[int, ...], milli: int, cpu: int, mem: int, sign: int
    ) -> None:
        self._cpu_free[row] -= sign * cpu
        self._mem_free[row] -= sign * mem
        self._units[row] += sign
        for s in slots:
            self._gfree[row, s] -= sign * milli
        self._touch(row)

    def place(self, gang: GangDemand) -> GangPlacement | Unfit:
        if not gang.units:
            raise ValueError(f"gang {gang.gang_id}: no units")
        for u in gang.units:
            _check(gang.gang_id, u)
        self._learn(gang)
        units = gang.units
        if len(units) == 1:
            got = self._choose(units[0], None, None)
            if isinstance(got, dict):
                return Unfit(gang.gang_id, units[0].key, len(self._index), got)
            return GangPlacement(gang.gang_id, (got[0],), self.policy, len(self._index))
        return self._place_gang(gang)

    def _place_gang(self, gang: GangDemand) -> GangPlacement | Unfit:
        by_key = {u.key: u for u in gang.units}
        for e in gang.edges:
            for k in (e.a, e.b):
                if k not in by_key:
                    raise ValueError(f"gang {gang.gang_id}: edge names unknown unit {k!r}")
        # colocation groups (union-find over nvlink-p2p / shm edges)
        parent = {k: k for k in by_key}

        def find(k: str) -> str:
            while parent[k] != k:
                parent[k] = parent[parent[k]]
                k = parent[k]
            return k

        nvpeer: dict[str, set[str]] = {k: set() for k in by_key}
        for e in gang.edges:
            if e.protocol in ("nvlink-p2p", "shm"):
                parent[find(e.a)] = find(e.b)
            if e.protocol == "nvlink-p2p":
                nvpeer[e.a].add(e.b)
                nvpeer[e.b].add(e.a)
        size: dict[str, int] = {}
        cpu_sum: dict[str, int] = {}
        mem_sum: dict[str, int] = {}
        for k, u in by_key.items():
            r = find(k)
            size[r] = size.get(r, 0) + 1
            cpu_sum[r] = cpu_sum.get(r, 0) + u.cpu_milli
            mem_sum[r] = mem_sum.get(r, 0) + u.memory_bytes
        # whole-GPU units joined by nvlink-p2p need their GPUs in one NVLink group: the first of
        # them looks for a group with room for all
        nvparent = {k: k for k in by_key}

        def nvfind(k: str) -> str:
            while nvparent[k] != k:
                k = nvparent[k]
            return k

        for e in gang.edges:
            if e.protocol == "nvlink-p2p" and by_key[e.a].gpus > 0 and by_key[e.b].gpus > 0:
                nvparent[nvfind(e.a)] = nvfind(e.b)
        nv_total: dict[str, int] = {}
        nv_size: dict[str, int] = {}
        for k, u in by_key.items():
            if u.gpus > 0:
                r = nvfind(k)
                nv_total[r] = nv_total.get(r, 0) + u.gpus
                nv_size[r] = nv_size.get(r, 0) + 1
        nv_started: set[str] = set()

        def constrained(u: UnitDemand) -> tuple[int, int, int, int, int]:
            return (
                -size[find(u.key)],
                -len(u.models) if u.models else 0,
                -(u.gpus * MILLI or u.gpu_milli),
                -u.cpu_milli,
                -u.memory_bytes,
            )

        order = sorted(gang.units, key=lambda u: (find(u.key), constrained(u)))
        groups: dict[str, list[UnitDemand]] = {}
        for u in order:
            groups.setdefault(find(u.key), []).append(u)
        ordered = [u for g in sorted(groups.values(), key=lambda g: constrained(g[0])) for u in g]
        placed: list[tuple[UnitChoice, int, tuple[int, ...], UnitDemand]] = []
        where: dict[str, tuple[int, tuple[int, ...]]] = {}
        home: dict[str, int] = {}
        try:
            for u in ordered:
                root = find(u.key)
                only = home.get(root)
                group = None
                if only is not None and u.gpus > 0:
                    for peer in nvpeer[u.key]:
                        pu = by_key[peer]
                        if peer in where and pu.gpus > 0 and where[peer][1]:
                            group = int(self._gnvl[where[peer][0], where[peer][1][0]])
                            break
                probe = u
                nvr = nvfind(u.key)
                if u.gpus > 0 and nv_size.get(nvr, 0) > 1 and nvr not in nv_started:
                    probe = replace(probe, gpus=nv_total[nvr], nvlink=True)
                if only is None and size[root] > 1:
                    probe = replace(probe, cpu_milli=cpu_sum[root], memory_bytes=mem_sum[root])
                got = self._choose(probe, only, group)
                if isinstance(got, dict):
                    return Unfit(gang.gang_id, u.key, len(self._index), got)
                choice, row, slots = got
                if probe is not u:
                    slots = slots[: u.gpus] if u.gpus > 0 else slots
                    choice = replace(
                        choice,
                        key=u.key,
                        gpu_indices=tuple(int(self._gindex[row, s]) for s in slots),
                        cpu_milli=u.cpu_milli,
                        memory_bytes=u.memory_bytes,
                    )
                if u.gpus > 0:
                    nv_started.add(nvr)
                milli = MILLI if u.gpus > 0 else u.gpu_milli
                self._apply(row, slots, milli, u.cpu_milli, u.memory_bytes, +1)
                placed.append((choice, row, slots, u))
                where[u.key] = (row, slots)
                home.setdefault(root, row)
        finally:
            for _choice, row, slots, u in reversed(placed):
                milli = MILLI if u.gpus > 0 else u.gpu_milli
                self._apply(row, slots, milli, u.cpu_milli, u.memory_bytes, -1)
        pos = {u.key: i for i, u in enumerate(gang.units)}
        choices = tuple(sorted((p[0] for p in placed), key=lambda c: pos[c.key]))
        return GangPlacement(gang.gang_id, choices, self.policy, len(self._index))

    # ---- commit / release ---------------------------------------------------------------------

    def commit(self, placement: GangPlacement) -> None:
        todo: list[tuple[UnitChoice, int, tuple[int, ...]]] = []
        for c in placement.choices:
            if c.key in self._held:
                raise ValueError(f"unit {c.key!r} already holds capacity (release it first)")
            row = self._index.get(c.node_id)
            if row is None:
                raise ValueError(f"unit {c.key!r}: node {c.node_id!r} is not in the fleet")
            found: list[int] = []
            for gi in c.gpu_indices:
                hit = np.flatnonzero(self._gpresent[row] & (self._gindex[row] == gi))
                if hit.size == 0:
                    raise ValueError(f"unit {c.key!r}: node {c.node_id!r} has no GPU {gi}")
                found.append(int(hit[0]))
            todo.append((c, row, tuple(found)))
        for c, row, slots in todo:
            self._apply(row, slots, c.gpu_milli, c.cpu_milli, c.memory_bytes, +1)
            self._held[c.key] = _Held(row, slots, c.gpu_milli, c.cpu_milli, c.memory_bytes)

    def assume(self, demand: UnitDemand, choice: UnitChoice) -> None:
        """Take what ``choice`` says for ``demand`` (a unit placed before this engine existed:
        by another replica, or before a restart), replacing what the unit held; its CPUs and
        memory come from ``demand`` when the choice does not carry them. A node not in the
        fleet (gone since) holds nothing."""
        self.release(choice.key)
        if choice.node_id not in self._index:
            return
        if not choice.cpu_milli and not choice.memory_bytes:
            choice = replace(choice, cpu_milli=demand.cpu_milli, memory_bytes=demand.memory_bytes)
        self.commit(GangPlacement(choice.key, (choice,), self.policy, len(self._index)))

    def release(self, key: str) -> None:
        h = self._held.pop(key, None)
        if h is None:
            return
        self._apply(h.node, h.slots, h.milli, h.cpu, h.mem, -1)

    def allocation_ratio(self) -> Mapping[str, float]:
        n = self._n
        live = self._gpresent[:n] & self._alive[:n, None]
        cap = live.sum()
        out: dict[str, float] = {}
        used = np.where(live, MILLI - self._gfree[:n], 0)
        for mid, name in enumerate(self._model_names):
            m = live & (self._gmodel[:n] == mid)
            c = int(m.sum())
            if c:
                out[name] = float(used[m].sum()) / (c * MILLI)
        out["all"] = float(used.sum()) / (int(cap) * MILLI) if cap else 0.0
        return out


def _dsec_rank(fgd_score: FloatArr, used_after: FloatArr) -> FloatArr:
    """DSec's order (higher is better): the fragmentation score first (FGD's 0-100 scale),
    then among equal scores the node that is the most used after the placement, in steps of 1/8
    of its GPU capacity (one GPU of an 8-GPU node): work concentrates on nodes already in use and
    emptier nodes stay whole for the large units still to come. Nodes equal on both go by name
    (a fixed order, so nodes of a similar fill fill up one after another, not all a little)."""
    return np.asarray(fgd_score * 1e3 + np.floor(used_after * _FILL_STEPS + 1e-9), np.float64)


def make_engine(policy: str = "dsec") -> Engine:
    """The engine for ``policy`` (one of :data:`POLICIES`), learning the demand online.

    Raises:
        ValueError: an unknown policy.
    """
    return Engine(policy)
