"""The placement engine: a stateful, incremental, numpy-vectorised :class:`PlacementEngine`.

The fleet lives in arrays (nodes × GPUs): free milli per GPU, model ids, memory, NVLink group,
health and temperature, and per node free CPU, memory and unit count. A decision filters every
node at once, scores the feasible ones with the engine's policy and breaks ties at random (from
the engine's seed, so a run is reproducible).

Policies:

- ``random``: any feasible node, uniformly; a share goes on a random GPU that fits.
- ``bestfit``: kube-scheduler style best fit: ``0.5·cpu_left/128000 + 0.5·gpu_milli_left/8000``
  after placing, as an integer 0-100 (lower left is better), random tie-break; a share takes the
  tightest GPU that fits, whole GPUs the first free ones.
- ``fgd``: fragmentation gradient descent (Weng et al., ATC '23): the node and GPU whose expected
  fragmentation (:mod:`.frag`) grows least, scored ``int(100·sigmoid(−ΔF/1000))`` as the paper's
  simulator does, random tie-break among equal integers.
- ``dsec``: FGD's measure without the integer rounding, then packing: among placements whose
  fragmentation change is equal, the one that leaves the most *expected usable* capacity per node
  behind it … see :func:`_dsec_rank` and docs/placement.md.

Scores of a unit shape are cached per node and recomputed only for nodes that changed since
(each commit changes one node), which is what keeps a decision well under a millisecond.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

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
    """Per-node best score and GPU slot for one unit shape, valid as of ``stamp``."""

    stamp: int
    score: FloatArr
    slot: IntArr
    terms: FloatArr  # (N, T): the named score terms
    names: tuple[str, ...] = field(default=())


def _models_text(models: frozenset[str]) -> str:
    return "|".join(sorted(models))


class Engine:
    """See the module docstring. ``typical``: the distribution of unit shapes the fragmentation
    measure expects (shape key → weight, :func:`frag.shape_key`); without it the engine learns the
    distribution online from the units it is asked to place."""

    def __init__(
        self,
        policy: str = "dsec",
        *,
        seed: int = 0,
        typical: Mapping[frag.Key, float] | None = None,
        popularity: float = 0.95,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy: {policy!r} is not one of {', '.join(POLICIES)}")
        self.policy = policy
        self._rng = random.Random(seed)
        self._popularity = popularity
        self._fixed_typical = dict(typical) if typical is not None else None
        self._seen: dict[frag.Key, float] = {}
        self._seen_total = 0
        self._seen_gangs: set[str] = set()
        self._next_learn = 16
        self._typ: frag.Typical | None = None
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
        self._elig: dict[tuple[frozenset[str], int, float | None], BoolArr] = {}
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
            return out

        d = self.__dict__
        for name, fill, dt in (
            ("_cpu_cap", 0, np.int64),
            ("_cpu_free", 0, np.int64),
            ("_mem_cap", 0, np.int64),
            ("_mem_free", 0, np.int64),
            ("_units", 0, np.int64),
            ("_max_units", 0, np.int64),
            ("_alive", False, bool),
            ("_sched", False, bool),
            ("_ver", 0, np.int64),
        ):
            d[name] = grow(d.get(name) if old is not None else None, (cap,), fill, dt)
        for name, fill, dt in (
            ("_gfree", 0, np.int64),
            ("_gcap", 0, np.int64),
            ("_gmodel", -1, np.int64),
            ("_gmem", 0, np.int64),
            ("_gok", False, bool),  # present and healthy
            ("_gpresent", False, bool),
            ("_gtemp", np.nan, np.float64),
            ("_gnvl", 0, np.int64),
            ("_gindex", 0, np.int64),
        ):
            d[name] = grow(d.get(name) if old is not None else None, (cap, g), fill, dt)
        self._cap, self._g = cap, g
        self._elig = {}
        self._shape = {}

    def _touch(self, row: int) -> None:
        self._clock += 1
        self._ver[row] = self._clock

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
        if fresh:
            self._elig = {}
        else:
            for key, mask in self._elig.items():
                mask[row] = self._elig_rows(key, np.array([row]))[0]

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

    def _eligible(self, u: UnitDemand) -> BoolArr:
        key = (u.models, u.min_gpu_memory_bytes, u.max_temperature_c)
        mask = self._elig.get(key)
        if mask is None:
            mask = self._elig[key] = self._elig_rows(key, np.arange(self._cap))
        return mask

    # ---- the typical distribution -------------------------------------------------------------

    def _learn(self, gang: GangDemand) -> None:
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
            self._next_learn = max(self._next_learn * 2, 16)
            self._typ = None

    def _typical(self) -> frag.Typical:
        nm = len(self._model_names)
        if self._typ is None or self._typ_models != nm:
            counts = self._fixed_typical if self._fixed_typical is not None else self._seen
            self._typ = frag.typical_from_counts(
                counts.items(), self._model_ids, nm, self._popularity
            )
            self._typ_models = nm
            self._shape = {}
        return self._typ

    # ---- one unit -----------------------------------------------------------------------------

    def _gpu_fit(self, u: UnitDemand, elig: BoolArr) -> tuple[BoolArr, BoolArr]:
        """(per node: the GPU part fits, per GPU: the slot could take the unit)."""
        n = self._cap
        if u.gpus > 0:
            slot_ok = elig & (self._gfree[:n] >= MILLI)
            if u.nvlink and u.gpus > 1:
                fit = np.zeros(n, dtype=bool)
                for grp in np.unique(self._gnvl[slot_ok]):
                    fit |= (slot_ok & (self._gnvl[:n] == grp)).sum(axis=1) >= u.gpus
                return fit, slot_ok
            return slot_ok.sum(axis=1) >= u.gpus, slot_ok
        if u.gpu_milli > 0:
            slot_ok = elig & (self._gfree[:n] >= u.gpu_milli)
            return slot_ok.any(axis=1), slot_ok
        return np.ones(n, dtype=bool), elig

    def _feasible(self, u: UnitDemand, elig: BoolArr) -> tuple[BoolArr, BoolArr]:
        gfit, slot_ok = self._gpu_fit(u, elig)
        ok = (
            self._sched
            & (self._cpu_free >= u.cpu_milli)
            & (self._mem_free >= u.memory_bytes)
            & (self._units < self._max_units)
            & gfit
        )
        return ok, slot_ok

    def _reasons(self, u: UnitDemand, elig: BoolArr, only: int | None) -> dict[str, int]:
        """Each node under its first failing reason (static checks first, then capacity)."""
        out: dict[str, int] = {}
        left = self._alive.copy()

        def count(bad: BoolArr, text: str) -> None:
            nonlocal left
            c = int((left & bad).sum())
            if c:
                out[text] = out.get(text, 0) + c
            left = left & ~bad

        if only is not None:
            other = np.ones(self._cap, dtype=bool)
            other[only] = False
            count(other, f"not the node of its {'nvlink/shm'} peer")
        for row in np.nonzero(left & ~self._sched)[0]:
            r = self._reason[int(row)]
            out[r] = out.get(r, 0) + 1
        left &= self._sched
        count(self._units >= self._max_units, "at its unit limit")
        if u.gpus > 0 or u.gpu_milli > 0:
            present = self._gpresent
            count(~present.any(axis=1), "no GPU")
            m = present
            if u.models:
                m = m & np.isin(self._gmodel, [self._model_ids.get(x, -2) for x in u.models])
                count(~m.any(axis=1), f"no GPU of model {_models_text(u.models)}")
            if u.min_gpu_memory_bytes:
                m = m & (self._gmem >= u.min_gpu_memory_bytes)
                gib = u.min_gpu_memory_bytes / _GIB
                count(~m.any(axis=1), f"no GPU with {gib:g} GiB memory")
            m = m & self._gok
            count(~m.any(axis=1), "GPU unhealthy")
            if u.max_temperature_c is not None:
                t = self._gtemp
                m = m & (np.isnan(t) | (t < u.max_temperature_c))
                count(~m.any(axis=1), "GPU too hot")
            gfit, _ = self._gpu_fit(u, elig)
            if u.gpus > 0:
                txt = "no NVLink group with enough free GPUs" if u.nvlink and u.gpus > 1 else None
                count(~gfit, txt or "insufficient whole GPUs")
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

    def _first_slots(self, slot_ok: BoolArr, rows: IntArr, k: int) -> IntArr:
        """The first ``k`` usable slots of each row (rows have ≥ k)."""
        order = np.argsort(~slot_ok[rows], axis=1, kind="stable")
        return order[:, :k]

    def _frag_scores(
        self, u: UnitDemand, rows: npt.NDArray[np.intp], slot_ok: BoolArr
    ) -> tuple[FloatArr, IntArr, FloatArr, tuple[str, ...]]:
        """Scores (higher is better), chosen slot and named terms for ``rows``."""
        typ = self._typical()
        free = self._gfree[rows]
        gmodel = self._gmodel[rows]
        gok = self._gok[rows] & self._gpresent[rows]
        cpu = self._cpu_free[rows]
        dsec = self.policy == "dsec"
        memf = self._mem_free[rows] if dsec and __import__("os").environ.get("DSEC_MEM") else None
        names = ("fragmentation_delta", "usable_after", "packing")
        if u.gpus == 0 and 0 < u.gpu_milli < MILLI:
            dfrag, u_after = frag.share_candidates(
                typ, free, gmodel, gok, cpu, u.cpu_milli, u.gpu_milli, memf, u.memory_bytes
            )
            ok = slot_ok[rows]
            if dsec:
                import os as _os

                tight = float(_os.environ.get("DSEC_TIGHT", "0"))
                rank = tight * (1000 - (free - u.gpu_milli)) * 1e-3 + _dsec_rank(
                    dfrag,
                    u_after,
                    self._gcap[rows].sum(axis=1)[:, None] + 0 * free,
                    self._gfree_total(rows)[:, None] - u.gpu_milli * (1 - int(_os.environ.get("DSEC_BEFORE", "0"))),
                    ((self._cpu_cap[rows] - cpu + u.cpu_milli) / np.maximum(self._cpu_cap[rows], 1))[:, None],
                    ((free >= MILLI) & gok).sum(axis=1)[:, None],
                )
            else:
                rank = frag.sigmoid_score(dfrag).astype(np.float64)
            rank = np.where(ok, rank, -np.inf)
            slot = np.argmax(rank, axis=1)
            ar = np.arange(len(rows))
            score = rank[ar, slot]
            terms = np.stack(
                [dfrag[ar, slot], u_after[ar, slot], (free - u.gpu_milli)[ar, slot]], axis=1
            )
            return score, slot.astype(np.int64), terms, names
        after = free.copy()
        slot = np.full(len(rows), -1, dtype=np.int64)
        if u.gpus > 0 or u.gpu_milli >= MILLI:
            k = max(u.gpus, 1)
            first = self._first_slots(slot_ok, np.asarray(rows), k)
            ar = np.arange(len(rows))[:, None]
            after[ar, first] = 0
            slot = first[:, 0].astype(np.int64)
        dfrag, u_after = frag.state_change(
            typ, free, after, gmodel, gok, cpu, u.cpu_milli, memf, u.memory_bytes
        )
        left = np.where(gok, after, 0).sum(axis=1)
        if dsec:
            score = _dsec_rank(
                dfrag,
                u_after,
                self._gcap[rows].sum(axis=1),
                left + (self._gfree_total(rows) - left) * int(__import__("os").environ.get("DSEC_BEFORE", "0")),
                (self._cpu_cap[rows] - cpu + u.cpu_milli) / np.maximum(self._cpu_cap[rows], 1),
                ((free >= MILLI) & gok).sum(axis=1),
            )
        else:
            score = frag.sigmoid_score(dfrag).astype(np.float64)
        terms = np.stack([dfrag, u_after, left.astype(np.float64)], axis=1)
        return np.asarray(score, dtype=np.float64), slot, terms, names

    def _gfree_total(self, rows: npt.NDArray[np.intp]) -> IntArr:
        return np.where(self._gpresent[rows], self._gfree[rows], 0).sum(axis=1)

    def _scores(
        self, u: UnitDemand, feas: BoolArr, slot_ok: BoolArr
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
        key = self._shape_key(u)
        c = self._shape.get(key)
        if c is None:
            rows = np.arange(n)
            score, slot, terms, names = self._frag_scores(u, rows, slot_ok)
            c = self._shape[key] = _ShapeCache(self._clock, score, slot, terms, names)
        else:
            stale = np.nonzero(self._ver > c.stamp)[0]
            if stale.size:
                score, slot, terms, _ = self._frag_scores(u, stale, slot_ok)
                c.score[stale] = score
                c.slot[stale] = slot
                c.terms[stale] = terms
            c.stamp = self._clock
        return c.score, c.slot, c.terms, c.names

    def _choose(
        self, u: UnitDemand, only: int | None, group: int | None
    ) -> tuple[UnitChoice, int, tuple[int, ...]] | dict[str, int]:
        elig = self._eligible(u)
        if group is not None and only is not None:
            elig = elig.copy()
            elig[only] &= self._gnvl[only] == group
        feas, slot_ok = self._feasible(u, elig)
        if only is not None:
            keep = feas[only]
            feas = np.zeros_like(feas)
            feas[only] = keep
        idx = np.flatnonzero(feas)
        if idx.size == 0:
            return self._reasons(u, elig, only)
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

    def _direct(
        self, u: UnitDemand, idx: npt.NDArray[np.intp], slot_ok: BoolArr
    ) -> tuple[FloatArr, IntArr, FloatArr, tuple[str, ...]]:
        if self.policy in ("fgd", "dsec"):
            return self._frag_scores(u, idx, slot_ok)
        score, slot, terms, names = self._scores(u, np.ones(self._cap, bool), slot_ok)
        return score[idx], slot[idx], terms[idx] if terms.shape[1] else terms, names

    def _slots_for(self, u: UnitDemand, row: int, hint: int, slot_ok: BoolArr) -> tuple[int, ...]:
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
        for k in by_key:
            size[find(k)] = size.get(find(k), 0) + 1

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
                got = self._choose(u, only, group)
                if isinstance(got, dict):
                    return Unfit(gang.gang_id, u.key, len(self._index), got)
                choice, row, slots = got
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
            slots: list[int] = []
            for gi in c.gpu_indices:
                hit = np.flatnonzero(self._gpresent[row] & (self._gindex[row] == gi))
                if hit.size == 0:
                    raise ValueError(f"unit {c.key!r}: node {c.node_id!r} has no GPU {gi}")
                slots.append(int(hit[0]))
            todo.append((c, row, tuple(slots)))
        for c, row, slots in todo:
            self._apply(row, slots, c.gpu_milli, c.cpu_milli, c.memory_bytes, +1)
            self._held[c.key] = _Held(row, slots, c.gpu_milli, c.cpu_milli, c.memory_bytes)

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


def _dsec_rank(
    dfrag: FloatArr, u_after: FloatArr, gpu_left: IntArr | FloatArr, node_left: IntArr | FloatArr, cpu_frac: FloatArr, whole: IntArr
) -> FloatArr:
    """DSec's order (higher is better): FGD's score first (fragmentation growth, on the paper's
    0-100 scale), then among equal scores the placement that leaves the least free GPU capacity
    on the node (packing: keep whole nodes free for the large units still to come)."""
    import os

    mode = os.environ.get("DSEC_MODE", "c")
    base = frag.sigmoid_score(dfrag).astype(np.float64)
    left = np.asarray(node_left, dtype=np.float64)
    if mode == "c":
        return base * 1e6 - left
    if mode == "d":
        return base * 1e6
    if mode == "e":
        return -np.round(dfrag, 3) * 1e4 - left * 1e-3
    cap = np.asarray(gpu_left, dtype=np.float64)
    if mode == "h":
        return base * 1e6 + (cap - left)
    if mode == "q":
        qq = float(os.environ.get("DSEC_Q", "1"))
        x = np.clip(-dfrag / 1000.0, -50, 50)
        b2 = np.trunc(100.0 * qq / (1.0 + np.exp(-x)))
        return b2 * 1e6 + 1000 * (cap - left) / np.maximum(cap, 1)
    if mode == "i3":
        return base * 1e6 + 1000 * (cap - left) / np.maximum(cap, 1) - np.clip(dfrag, -1e4, 1e4) * 1e-2
    if mode == "i4":
        return base * 1e6 + 500 * (cap - left) / np.maximum(cap, 1) + 500 * cpu_frac
    if mode == "i5":
        return base * 1e6 + 1000 * np.maximum((cap - left) / np.maximum(cap, 1), cpu_frac)
    if mode == "t":
        tau = float(os.environ.get("DSEC_TAU", "50"))
        return -np.floor(dfrag / tau) * 1e6 + 1000 * (cap - left) / np.maximum(cap, 1)
    if mode == "k4":
        return base * 1e6 - cap + 100 * (cap - left) / np.maximum(cap, 1)
    if mode == "k5":
        return base * 1e6 + cap + 100 * (cap - left) / np.maximum(cap, 1)
    if mode == "b1":
        return base * 1e6 - 1000 * whole + 100 * (cap - left) / np.maximum(cap, 1)
    if mode == "b2":
        return base * 1e6 + 1000 * (cap - left) / np.maximum(cap, 1) - whole
    if mode == "sd":
        dd = float(os.environ.get("DSEC_D", "1000"))
        b3 = np.trunc(100.0 / (1.0 + np.exp(-np.clip(-dfrag / dd, -50, 50))))
        return b3 * 1e6 + 1000 * (cap - left) / np.maximum(cap, 1)
    if mode == "i":
        return base * 1e6 + 1000 * (cap - left) / np.maximum(cap, 1)
    if mode == "e2":
        return -np.round(dfrag, 3)
    if mode == "g":
        return base * 1e6 - np.asarray(u_after)
    if mode == "f":
        return base * 1e6 + np.asarray(u_after) * 1e-3
    return base
