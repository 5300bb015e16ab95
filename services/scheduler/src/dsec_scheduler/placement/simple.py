"""A small, exact placement engine: the reference implementation of :class:`.api.PlacementEngine`.

It filters every node for every unit (counting each node once, under its first reason), scores
the nodes that fit, and takes the best (ties by node id, so a decision is reproducible). Policies:

``leastloaded``
    The node whose most used resource (CPU, memory, whole free GPUs) is the least used, as the
    scheduler placed sandboxes before GPU placement existed: work spreads over the fleet.
``bestfit``
    The node left fullest after the unit (GPU milli first, then CPU): work packs, whole GPUs
    and nodes stay free for large units.

GPU shares stack on the GPU with the least free milli that still fits (best fit); whole GPUs
are the smallest ones large enough, from one NVLink group when the unit asks for NVLink. Units
joined by an ``nvlink-p2p`` or ``shm`` edge go to one node (with ``nvlink-p2p`` and whole GPUs:
one NVLink group). A gang is placed all or none. It serves as the scheduler's fallback when the
tuned engine is not installed, and as the reference the tests compare against.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dsec_scheduler.placement.api import (
    MILLI,
    Edge,
    GangDemand,
    GangPlacement,
    NodeSpec,
    Unfit,
    UnitChoice,
    UnitDemand,
)

POLICIES = ("leastloaded", "bestfit")
LOCAL_PROTOCOLS = frozenset({"nvlink-p2p", "shm"})
GIB = 2**30


@dataclass
class _Use:
    """What is taken on one node."""

    cpu_milli: int = 0
    memory_bytes: int = 0
    units: int = 0
    gpu_milli: dict[int, int] = field(default_factory=dict)

    def copy(self) -> _Use:
        return _Use(self.cpu_milli, self.memory_bytes, self.units, dict(self.gpu_milli))

    def take(self, demand: UnitDemand, choice: UnitChoice, sign: int = 1) -> None:
        self.cpu_milli += sign * demand.cpu_milli
        self.memory_bytes += sign * demand.memory_bytes
        self.units += sign
        for i in choice.gpu_indices:
            self.gpu_milli[i] = self.gpu_milli.get(i, 0) + sign * choice.gpu_milli


def _models_text(models: frozenset[str]) -> str:
    names = sorted(models)
    return "/".join(names) if len(names) <= 3 else "/".join(names[:3]) + "/…"


class SimpleEngine:
    """Stateful and incremental, as the protocol asks; pure (no I/O)."""

    def __init__(self, policy: str = "leastloaded") -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; valid: {', '.join(POLICIES)}")
        self.policy = policy
        self._nodes: dict[str, NodeSpec] = {}
        self._use: dict[str, _Use] = {}
        self._held: dict[str, tuple[UnitDemand, UnitChoice]] = {}
        self._asked: dict[str, UnitDemand] = {}  # demands of the latest place() per unit key

    # ------------------------------------------------------------------ the fleet

    def upsert_node(self, node: NodeSpec) -> None:
        self._nodes[node.node_id] = node
        self._use.setdefault(node.node_id, _Use())

    def remove_node(self, node_id: str) -> None:
        self._nodes.pop(node_id, None)
        self._use.pop(node_id, None)
        for key in [k for k, (_, c) in self._held.items() if c.node_id == node_id]:
            del self._held[key]

    def nodes(self) -> Sequence[str]:
        return sorted(self._nodes)

    # ------------------------------------------------------------------ capacity

    def commit(self, placement: GangPlacement) -> None:
        for choice in placement.choices:
            demand = self._asked.get(choice.key)
            if demand is not None:
                self.assume(demand, choice)

    def assume(self, demand: UnitDemand, choice: UnitChoice) -> None:
        """Take what ``choice`` says for ``demand`` (a unit placed before: by another replica,
        or before a restart), replacing what the unit held."""
        self.release(choice.key)
        use = self._use.get(choice.node_id)
        if use is None:
            return
        use.take(demand, choice)
        self._held[choice.key] = (demand, choice)

    def release(self, key: str) -> None:
        held = self._held.pop(key, None)
        if held is None:
            return
        use = self._use.get(held[1].node_id)
        if use is not None:
            use.take(held[0], held[1], sign=-1)

    def allocation_ratio(self) -> Mapping[str, float]:
        cap: dict[str, int] = {}
        used: dict[str, int] = {}
        for node_id, node in self._nodes.items():
            use = self._use[node_id]
            for g in node.gpus:
                for model in (g.model, "all"):
                    cap[model] = cap.get(model, 0) + MILLI
                    used[model] = used.get(model, 0) + min(MILLI, use.gpu_milli.get(g.index, 0))
        return {m: used[m] / cap[m] for m in sorted(cap)}

    # ------------------------------------------------------------------ deciding

    def place(self, gang: GangDemand) -> GangPlacement | Unfit:
        for unit in gang.units:
            self._asked[unit.key] = unit
        overlay = {n: u.copy() for n, u in self._use.items()}
        choices: dict[str, UnitChoice] = {}
        for group, nvlink in _groups(gang.units, gang.edges):
            found = self._place_group(group, nvlink, overlay)
            if isinstance(found, tuple):
                return Unfit(gang.gang_id, found[0], len(self._nodes), found[1])
            for choice in found:
                choices[choice.key] = choice
        ordered = tuple(choices[u.key] for u in gang.units)
        return GangPlacement(gang.gang_id, ordered, self.policy, len(self._nodes))

    def _place_group(
        self, group: list[UnitDemand], nvlink: bool, overlay: dict[str, _Use]
    ) -> list[UnitChoice] | tuple[str, dict[str, int]]:
        """Place units that must share one node; on failure the first unit's reasons."""
        best: tuple[tuple[float, str], list[UnitChoice], dict[str, float]] | None = None
        reasons: dict[str, int] = {}
        first_unit = group[0].key
        feasible = 0
        for node_id in sorted(self._nodes):
            node = self._nodes[node_id]
            use = overlay[node_id]
            trial = use.copy()
            picked: list[UnitChoice] = []
            why = ""
            group_id: int | None = None
            for unit in group:
                got = _fit(node, trial, unit, nvlink_group=group_id if nvlink else None)
                if isinstance(got, str):
                    why = got
                    break
                if nvlink and got.gpu_indices and got.gpu_milli == MILLI:
                    group_id = next(g.nvlink_group for g in node.gpus if g.index in got.gpu_indices)
                trial.take(unit, got)
                picked.append(got)
            if why:
                reasons[why] = reasons.get(why, 0) + 1
                continue
            feasible += 1
            score, breakdown = self._score(node, use, trial)
            key = (-score, node_id)
            if best is None or key < best[0]:
                best = (key, picked, breakdown)
        if best is None:
            return first_unit, reasons
        (neg, node_id), picked, breakdown = best
        for unit, choice in zip(group, picked, strict=True):
            overlay[node_id].take(unit, choice)
        return [
            UnitChoice(c.key, node_id, c.gpu_indices, c.gpu_milli, -neg, dict(breakdown), feasible)
            for c in picked
        ]

    def _score(self, node: NodeSpec, before: _Use, after: _Use) -> tuple[float, dict[str, float]]:
        def shares(use: _Use) -> dict[str, float]:
            out = {
                "cpu_free": 1 - use.cpu_milli / node.cpu_milli if node.cpu_milli > 0 else 0.0,
                "memory_free": (
                    1 - use.memory_bytes / node.memory_bytes if node.memory_bytes > 0 else 0.0
                ),
            }
            if node.gpus:
                whole = sum(1 for g in node.gpus if use.gpu_milli.get(g.index, 0) == 0)
                milli = sum(MILLI - use.gpu_milli.get(g.index, 0) for g in node.gpus)
                out["gpu_free"] = whole / len(node.gpus)
                out["gpu_milli_free"] = milli / (MILLI * len(node.gpus))
            return out

        if self.policy == "leastloaded":
            terms = shares(before)
            free = max(0.0, min(v for k, v in terms.items() if k != "gpu_milli_free"))
            return round(free, 6), {**_rounded(terms), "free_fraction": round(free, 6)}
        terms = shares(after)
        packing = 1 - terms.get("gpu_milli_free", terms["cpu_free"])
        cpu_packing = 1 - terms["cpu_free"]
        score = packing + cpu_packing / 100
        return round(score, 6), {
            **_rounded(terms),
            "gpu_packing": round(packing, 6),
            "cpu_packing": round(cpu_packing, 6),
        }


def _rounded(terms: Mapping[str, float]) -> dict[str, float]:
    return {k: round(max(v, 0.0), 6) for k, v in terms.items()}


def _groups(
    units: Sequence[UnitDemand], edges: Sequence[Edge]
) -> list[tuple[list[UnitDemand], bool]]:
    """Units that must share a node (joined by nvlink-p2p/shm edges), biggest groups first;
    with whether the group's whole GPUs must share one NVLink group."""
    parent = {u.key: u.key for u in units}

    def root(k: str) -> str:
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    nvlinked: set[str] = set()
    for e in edges:
        if e.protocol in LOCAL_PROTOCOLS and e.a in parent and e.b in parent:
            parent[root(e.a)] = root(e.b)
            if e.protocol == "nvlink-p2p":
                nvlinked.add(e.a)
    groups: dict[str, list[UnitDemand]] = {}
    for u in units:
        groups.setdefault(root(u.key), []).append(u)
    out = [
        (g, any(u.key in nvlinked for u in g) or any(u.nvlink for u in g)) for g in groups.values()
    ]
    return sorted(out, key=lambda gn: -sum(u.gpus * MILLI + u.gpu_milli for u in gn[0]))


def _fit(node: NodeSpec, use: _Use, unit: UnitDemand, nvlink_group: int | None) -> UnitChoice | str:
    """Where ``unit`` goes on ``node`` given ``use``, or the first reason it cannot."""
    if not node.schedulable:
        return node.unschedulable_reason.split(":", 1)[0] or "unschedulable"
    if use.units + 1 > node.max_units:
        return "too many units"
    if use.cpu_milli + unit.cpu_milli > node.cpu_milli:
        return "insufficient CPU"
    if use.memory_bytes + unit.memory_bytes > node.memory_bytes:
        return "insufficient memory"
    if not unit.gpus and not unit.gpu_milli:
        return UnitChoice(unit.key, node.node_id)
    if not node.gpus:
        return "no GPU"
    gpus = [g for g in node.gpus if not unit.models or g.model in unit.models]
    if not gpus:
        return f"no GPU of model {_models_text(unit.models)}"
    if unit.min_gpu_memory_bytes:
        gpus = [g for g in gpus if g.memory_bytes >= unit.min_gpu_memory_bytes]
        if not gpus:
            return f"no GPU with {unit.min_gpu_memory_bytes / GIB:.0f}+ GiB"
    gpus = [
        g
        for g in gpus
        if g.healthy
        and (
            unit.max_temperature_c is None
            or g.temperature_c is None
            or g.temperature_c <= unit.max_temperature_c
        )
    ]
    if not gpus:
        return "GPUs unhealthy or too hot"
    if unit.gpus:
        free = [g for g in gpus if use.gpu_milli.get(g.index, 0) == 0]
        if nvlink_group is not None:
            free = [g for g in free if g.nvlink_group == nvlink_group]
        if len(free) < unit.gpus:
            return "insufficient free GPUs"
        if unit.nvlink or nvlink_group is not None:
            by_group: dict[int, list[int]] = {}
            for g in sorted(free, key=lambda g: (g.memory_bytes, g.index)):
                by_group.setdefault(g.nvlink_group, []).append(g.index)
            fitting = [ix for ix in by_group.values() if len(ix) >= unit.gpus]
            if not fitting:
                return "no NVLink group with enough free GPUs"
            chosen = min(fitting, key=len)[: unit.gpus]  # the tightest group that fits
        else:
            chosen = [g.index for g in sorted(free, key=lambda g: (g.memory_bytes, g.index))][
                : unit.gpus
            ]
        return UnitChoice(unit.key, node.node_id, tuple(sorted(chosen)), MILLI)
    shared = [g for g in gpus if use.gpu_milli.get(g.index, 0) + unit.gpu_milli <= MILLI]
    if not shared:
        return "insufficient GPU share"
    g = min(shared, key=lambda g: (MILLI - use.gpu_milli.get(g.index, 0), g.index))
    return UnitChoice(unit.key, node.node_id, (g.index,), unit.gpu_milli)
