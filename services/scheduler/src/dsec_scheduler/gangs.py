"""Compute units and gangs: what the placement engine is asked, what it is told, and the queue.

Pure (no I/O). A sandbox's compiled plan becomes a :class:`~.placement.api.GangDemand` (its
``topology`` when the spec has one, else one unit ``main`` from ``resources``); a node's
inventory becomes a :class:`~.placement.api.NodeSpec`; :class:`EngineSync` keeps an engine's
nodes and allocations equal to the folded state (the log is the truth; the engine is an index
over it); :func:`quota_refusal` and :func:`ordered` are the queue's rules.

The queue (documented in the README's "Placement"): strict priority (higher first), then first
come first served. While the head of the queue cannot fit, smaller units behind it are placed
(backfill), but only for :data:`BACKFILL_S`: once the head has waited that long and could fit
the fleet were it empty, nothing behind it is placed until it is, so a large gang is never
starved by a stream of small ones (it gets the capacity they free as they end).
"""

from __future__ import annotations

import functools
import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dsec_core import gpumodels
from dsec_core.events import GpuInfo, NodeInventory, Resources

from dsec_scheduler.placement.api import (
    MILLI,
    Edge,
    GangDemand,
    GangPlacement,
    GpuSpec,
    NodeSpec,
    PlacementEngine,
    UnitChoice,
    UnitDemand,
)

log = logging.getLogger(__name__)

MAIN = "main"
"""The one unit of a sandbox whose spec declares no topology."""
BACKFILL_S = 300.0
"""How long units behind a head that cannot fit may pass it."""


# --------------------------------------------------------------------------- held units


@dataclass(frozen=True)
class UnitHeld:
    """One unit's allocation on its node (from its ``unit.placed``, or a sandbox placed before
    units existed: one unit ``main`` with its ``resources``)."""

    sandbox_id: str
    unit: str
    tenant: str
    node_id: str
    cpu_milli: int
    memory_bytes: int
    gpus: int = 0
    gpu_memory_bytes: int = 0
    gpu_indices: tuple[int, ...] = ()
    gpu_milli: int = 0
    gpu_model: str | None = None

    @functools.cached_property
    def key(self) -> str:  # (read for every unit on every decision: made once)
        return f"{self.sandbox_id}/{self.unit}"

    @property
    def gpu_milli_total(self) -> int:
        """GPU thousandths held in all (whole GPUs count 1000 each)."""
        if self.gpu_indices:
            return self.gpu_milli * len(self.gpu_indices)
        return self.gpus * MILLI

    def resources(self) -> Resources:
        """As the fleet's legacy per-node accounting counts it (a share takes its GPU)."""
        gpus = len(self.gpu_indices) if self.gpu_indices else self.gpus
        return Resources(
            cpus=self.cpu_milli / 1000,
            memory_bytes=self.memory_bytes,
            gpus=gpus,
            gpu_memory_bytes=self.gpu_memory_bytes,
        )

    def demand(self) -> UnitDemand:
        whole = self.gpu_milli >= MILLI or (not self.gpu_indices and self.gpus)
        return UnitDemand(
            key=self.key,
            cpu_milli=self.cpu_milli,
            memory_bytes=self.memory_bytes,
            gpus=(len(self.gpu_indices) or self.gpus) if whole else 0,
            gpu_milli=0 if whole else self.gpu_milli,
        )

    def choice(self) -> UnitChoice:
        milli = self.gpu_milli if self.gpu_indices else 0
        return UnitChoice(self.key, self.node_id, self.gpu_indices, milli)


def held_from_placed(payload: Mapping[str, Any], tenant: str) -> UnitHeld:
    """A ``unit.placed`` payload as the allocation it makes."""
    indices = tuple(int(i) for i in payload.get("gpu_indices") or ())
    milli = int(payload.get("gpu_milli") or 0)
    return UnitHeld(
        sandbox_id=str(payload["sandbox_id"]),
        unit=str(payload["unit"]),
        tenant=tenant,
        node_id=str(payload["node_id"]),
        cpu_milli=int(payload.get("cpu_millicores") or 0),
        memory_bytes=int(payload.get("memory_bytes") or 0),
        gpus=len(indices) if milli >= MILLI else 0,
        gpu_indices=indices,
        gpu_milli=milli,
        gpu_model=payload.get("gpu_model"),
    )


def held_from_resources(sandbox_id: str, tenant: str, node_id: str, r: Resources) -> UnitHeld:
    """A sandbox placed as one unit without ``unit.placed`` (before units existed)."""
    return UnitHeld(
        sandbox_id,
        MAIN,
        tenant,
        node_id,
        round(r.cpus * 1000),
        r.memory_bytes,
        gpus=r.gpus,
        gpu_memory_bytes=r.gpu_memory_bytes,
    )


# --------------------------------------------------------------------------- the demand


def _int(value: Any, default: int = 0) -> int:
    return int(value) if isinstance(value, int | float) and not isinstance(value, bool) else default


def gang_demand(
    sandbox_id: str, tenant: str, plan: Mapping[str, Any], resources: Resources
) -> GangDemand:
    """What a sandbox asks: its plan's ``topology`` (read defensively: a plan compiled before
    topologies existed has none), else one unit ``main`` from ``resources``.

    Raises:
        ValueError: the topology is not readable (the caller fails the sandbox, located).
    """
    topology = plan.get("topology") if isinstance(plan, Mapping) else None
    if not topology:
        gpu = (plan.get("resources") or {}).get("gpu") if isinstance(plan, Mapping) else None
        models: frozenset[str] = frozenset()
        if isinstance(gpu, Mapping) and gpu.get("type"):
            try:
                models = frozenset(gpumodels.resolve(str(gpu["type"])))
            except KeyError:
                models = frozenset({str(gpu["type"])})
        unit = UnitDemand(
            key=f"{sandbox_id}/{MAIN}",
            cpu_milli=round(resources.cpus * 1000),
            memory_bytes=resources.memory_bytes,
            gpus=resources.gpus,
            models=models if resources.gpus else frozenset(),
            min_gpu_memory_bytes=resources.gpu_memory_bytes,
        )
        return GangDemand(sandbox_id, (unit,), team=tenant)
    if not isinstance(topology, Mapping) or not isinstance(topology.get("units"), list | tuple):
        raise ValueError("topology.units: expected a list of units")
    units: list[UnitDemand] = []
    groups: dict[str, list[str]] = {}
    for i, u in enumerate(topology["units"]):
        if not isinstance(u, Mapping) or not isinstance(u.get("name"), str):
            raise ValueError(f"topology.units[{i}]: expected a unit with a name")
        key = f"{sandbox_id}/{u['name']}"
        gpus, milli = _int(u.get("gpus")), _int(u.get("gpu_milli"))
        if gpus < 0 or not 0 <= milli <= MILLI or (gpus and milli):
            raise ValueError(
                f"topology.units[{i}] ({u['name']}): gpus={gpus}, gpu_milli={milli}: "
                "either whole GPUs or a share of 1-1000 thousandths of one"
            )
        if milli == MILLI:
            gpus, milli = 1, 0
        temp = u.get("max_temperature_c")
        group = u.get("nvlink_group")
        if isinstance(group, str) and group:
            groups.setdefault(group, []).append(key)
        units.append(
            UnitDemand(
                key=key,
                cpu_milli=_int(u.get("cpu_millicores"), 1000),
                memory_bytes=_int(u.get("memory_bytes"), 512 * 2**20),
                gpus=gpus,
                gpu_milli=milli,
                models=frozenset(str(m) for m in u.get("gpu_models") or ()),
                min_gpu_memory_bytes=_int(u.get("min_gpu_memory_bytes")),
                max_temperature_c=float(temp) if isinstance(temp, int | float) else None,
                nvlink=bool(group) and gpus > 1,
            )
        )
    if not units:
        raise ValueError("topology.units: a topology needs at least one unit")
    names = {u.key for u in units}
    by_key = {u.key: u for u in units}
    edges = []
    for e in topology.get("edges") or ():
        if not isinstance(e, Mapping):
            continue
        a, b = f"{sandbox_id}/{e.get('src')}", f"{sandbox_id}/{e.get('dst')}"
        if a not in names or b not in names:
            raise ValueError(f"topology.edges: {e.get('src')} -> {e.get('dst')}: unknown unit")
        protocol = str(e.get("protocol"))
        if protocol == "nvlink-p2p" and _no_common_model(by_key[a], by_key[b]):
            # NVLink joins GPUs of one model: two units that accept no model in common never
            # share an NVLink domain, so the edge is placed as a network link (the spec check
            # warns: `nvlink-degraded`) instead of making the gang unplaceable.
            protocol = DEGRADED_NVLINK
        edges.append(Edge(a, b, protocol))
    for members in groups.values():  # one NVLink group name: the units talk over NVLink
        edges += [Edge(members[0], m, "nvlink-p2p") for m in members[1:]]
    return GangDemand(
        sandbox_id, tuple(units), tuple(edges), _int(topology.get("priority")), team=tenant
    )


DEGRADED_NVLINK = "network (nvlink-p2p degraded)"
"""The protocol an nvlink-p2p edge between units with no GPU model in common is placed as:
anywhere, like RoCE."""


def _no_common_model(a: UnitDemand, b: UnitDemand) -> bool:
    return bool(a.models) and bool(b.models) and not (a.models & b.models)


def unit_name(key: str) -> str:
    """``sbx_…/trainer`` → ``trainer``."""
    return key.rsplit("/", 1)[-1]


def demand_gpus(gang: GangDemand) -> float:
    """GPUs a gang asks for in all (shares as fractions)."""
    return sum(u.gpus + u.gpu_milli / MILLI for u in gang.units)


# --------------------------------------------------------------------------- the fleet


_GROUPS: dict[tuple[object, ...], dict[int, int]] = {}
_GROUPS_MAX = 4096


def nvlink_groups(gpus: Sequence[GpuInfo]) -> dict[int, int]:
    """GPU index → NVLink group (the lowest index of the GPUs it reaches over NVLink, directly
    or through others); a GPU without NVLink is a group of its own. Remembered per link layout
    (every heartbeat of a node repeats it; a node of 8 GPUs × 18 links costs ~80 µs to join)."""
    key = tuple(
        (
            g.index,
            g.uuid,
            g.pci_bus_id,
            tuple(sorted(g.topology.items())),
            tuple((link.remote_pci, link.active) for link in g.nvlinks),
        )
        for g in gpus
    )
    groups = _GROUPS.get(key)
    if groups is None:
        if len(_GROUPS) >= _GROUPS_MAX:
            _GROUPS.clear()
        groups = _GROUPS[key] = _join_nvlink_groups(gpus)
    return groups


def _join_nvlink_groups(gpus: Sequence[GpuInfo]) -> dict[int, int]:
    parent = {g.index: g.index for g in gpus}
    by_uuid = {g.uuid: g.index for g in gpus}
    by_pci = {g.pci_bus_id.lower(): g.index for g in gpus if g.pci_bus_id}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    def join(a: int, b: int) -> None:
        ra, rb = root(a), root(b)
        parent[max(ra, rb)] = min(ra, rb)

    for g in gpus:
        for peer, ancestor in g.topology.items():
            if peer in by_uuid and ancestor.upper().startswith("NV"):
                join(g.index, by_uuid[peer])
        for link in g.nvlinks:
            remote = (link.remote_pci or "").lower()
            if link.active and remote in by_pci:
                join(g.index, by_pci[remote])
    return {i: root(i) for i in parent}


def gpu_healthy(g: GpuInfo) -> bool:
    """No uncorrected ECC error and no XID error reported."""
    return not (g.ecc_uncorrected or 0) and not (g.xid_errors or 0)


def unschedulable_class(why: Sequence[str]) -> str:
    """A node's reasons not to take work, as one bounded class (a reason count's key)."""
    first = why[0] if why else ""
    for prefix in ("lost", "draining", "cordoned", "unhealthy", "no heartbeat"):
        if first.startswith(prefix):
            return prefix
    return "unschedulable"


def node_spec(
    node_id: str,
    inv: NodeInventory,
    why_not: Sequence[str],
    degraded: frozenset[int] = frozenset(),
) -> NodeSpec:
    """A node's inventory as the engine sees it; ``why_not``: why it may take nothing now;
    ``degraded``: GPUs reported degraded (``gpu.degraded``), offered to nothing new."""
    groups = nvlink_groups(inv.gpus)
    return NodeSpec(
        node_id=node_id,
        cpu_milli=round(inv.cpus * 1000),
        memory_bytes=inv.memory_bytes,
        gpus=tuple(
            GpuSpec(
                index=g.index,
                model=gpumodels.canonical(g.model),
                memory_bytes=g.memory_total_bytes,
                nvlink_group=groups[g.index],
                healthy=gpu_healthy(g) and g.index not in degraded,
                temperature_c=g.temperature_c,
            )
            for g in inv.gpus
        ),
        schedulable=not why_not,
        unschedulable_reason=unschedulable_class(why_not) if why_not else "",
        max_units=inv.max_sandboxes,
    )


@dataclass
class EngineSync:
    """An engine kept equal to the folded state: its nodes, and the units that hold capacity
    (the engine's own commits, and units placed by another replica or before a restart)."""

    engine: PlacementEngine
    _nodes: dict[str, NodeSpec] = field(default_factory=dict)
    _held: dict[str, UnitChoice] = field(default_factory=dict)
    _pinned: set[str] = field(default_factory=set)
    """Units committed whose events are being published (the state holds them once the
    sandbox's ``sandbox.scheduled`` is applied): never released by a sync meanwhile."""
    _from: dict[str, tuple[UnitHeld, UnitChoice]] = field(default_factory=dict)
    """Key → the unit a sync last took its choice from, and that choice (while it is the one
    held: the same unit again needs no new choice and no compare)."""

    def sync(self, specs: Iterable[NodeSpec], held: Iterable[UnitHeld]) -> None:
        """``specs``: one for each node (no node twice)."""
        specs = list(specs)
        for spec in specs:
            known = self._nodes.get(spec.node_id)
            if known is not spec:  # the same object: unchanged, no deep compare
                if known != spec:
                    self.engine.upsert_node(spec)
                # an equal spec rebuilt from a new heartbeat is kept too, so the next sync finds
                # the same object (else every node ever rebuilt was compared on every decision)
                self._nodes[spec.node_id] = spec
        # (every node of ``specs`` is known now: others are gone when there are more)
        gone_ones = (
            set(self._nodes) - {s.node_id for s in specs} if len(self._nodes) > len(specs) else ()
        )
        for gone in gone_ones:
            self.engine.remove_node(gone)
            del self._nodes[gone]
            for key in [k for k, c in self._held.items() if c.node_id == gone]:
                del self._held[key]
                self._from.pop(key, None)
        wanted = {h.key: h for h in held if h.node_id in self._nodes}
        for key in set(self._held) - set(wanted) - self._pinned:
            self.engine.release(key)
            del self._held[key]
            self._from.pop(key, None)
        for key, h in sorted(wanted.items(), key=lambda kv: not kv[1].gpu_indices):
            mine = self._held.get(key)
            last = self._from.get(key)
            if last is not None and last[0] is h and last[1] is mine:
                continue  # what this very unit gave before, still held
            if not h.gpu_indices and h.gpus:
                # Placed before units had GPU indices: it holds GPUs, which ones is unknown.
                # Keep the ones it was given; else the smallest free ones large enough.
                if mine is not None and mine.node_id == h.node_id:
                    continue
                choice = self._whole_gpus(h)
            else:
                choice = h.choice()
            if mine is not None and _same(mine, choice):
                self._from[key] = (h, mine)
                continue
            self.engine.release(key)
            choice = self._assume(h, choice)
            self._held[key] = choice
            self._from[key] = (h, choice)

    def _assume(self, h: UnitHeld, choice: UnitChoice) -> UnitChoice:
        """Take ``choice`` for a unit placed before; one naming GPUs its node no longer reports
        (a GPU fallen off the bus, the node's inventory smaller since) holds the GPUs left and
        its CPUs and memory, instead of failing every sync of an engine made after the
        change (a restarted scheduler's)."""
        try:
            self.engine.assume(h.demand(), choice)
            return choice
        except ValueError:
            spec = self._nodes.get(h.node_id)
            present = {g.index for g in spec.gpus} if spec is not None else set()
            kept = tuple(i for i in choice.gpu_indices if i in present)
            if kept == tuple(choice.gpu_indices):
                raise
            log.warning(
                "scheduler: unit %s holds GPUs %s of node %s, which reports only %s",
                h.key, list(choice.gpu_indices), h.node_id, sorted(present),
            )  # fmt: skip
            choice = replace(choice, gpu_indices=kept, gpu_milli=choice.gpu_milli if kept else 0)
            self.engine.assume(h.demand(), choice)
            return choice

    def _whole_gpus(self, h: UnitHeld) -> UnitChoice:
        """Whole GPUs for a unit that names none: the smallest free ones large enough (as the
        scheduler counted them before units), then any free ones."""
        spec = self._nodes[h.node_id]
        used: dict[int, int] = {}
        for c in self._held.values():
            if c.node_id == h.node_id:
                for i in c.gpu_indices:
                    used[i] = used.get(i, 0) + (c.gpu_milli or MILLI)
        free = sorted(
            (g for g in spec.gpus if not used.get(g.index)), key=lambda g: (g.memory_bytes, g.index)
        )
        big = [g for g in free if g.memory_bytes >= h.gpu_memory_bytes]
        chosen = (big + [g for g in free if g not in big])[: h.gpus]
        return UnitChoice(h.key, h.node_id, tuple(sorted(g.index for g in chosen)), MILLI)

    def commit(self, placement: GangPlacement) -> None:
        """Take a placement's capacity, pinned until :meth:`unpin` (its events published, or
        not: the next sync then releases what the state does not hold)."""
        self.engine.commit(placement)
        for c in placement.choices:
            self._held[c.key] = c
            self._pinned.add(c.key)

    def unpin(self, keys: Iterable[str]) -> None:
        self._pinned.difference_update(keys)

    def node(self, node_id: str) -> NodeSpec | None:
        return self._nodes.get(node_id)

    def set_node(self, spec: NodeSpec) -> None:
        """Tell the engine ``spec`` for one decision (``avoid``); the next sync restores."""
        self.engine.upsert_node(spec)
        self._nodes[spec.node_id] = spec


def _same(a: UnitChoice, b: UnitChoice) -> bool:
    return (a.node_id, tuple(a.gpu_indices), a.gpu_milli if a.gpu_indices else 0) == (
        b.node_id,
        tuple(b.gpu_indices),
        b.gpu_milli if b.gpu_indices else 0,
    )


# --------------------------------------------------------------------------- quotas


@dataclass(frozen=True)
class Quota:
    """What one team may hold at once (None: no bound)."""

    gpus: float | None = None
    gpu_milli: int | None = None
    cpus: float | None = None
    units: int | None = None
    """Compute units held at once: units of a millicore take a node's unit slot
    (``max_sandboxes``) as a large one does, and pass any CPU or GPU bound by the thousand."""


_QUOTA_KEYS = {"gpus", "gpu_milli", "cpus", "units"}
_WHOLE_KEYS = {"gpu_milli", "units"}


def parse_quotas(data: Any, source: str = "quotas") -> dict[str, Quota]:
    """``{tenant: {gpus: N, gpu_milli: N, cpus: N, units: N}}``, validated.

    Raises:
        ValueError: located (``source: tenant.key: …``) with what is valid.
    """
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ValueError(
            f"{source}: expected a mapping {{tenant: {{gpus, gpu_milli, cpus, units}}}}"
        )
    out: dict[str, Quota] = {}
    for tenant, limits in data.items():
        where = f"{source}: {tenant}"
        if not isinstance(limits, Mapping):
            raise ValueError(f"{where}: expected a mapping with gpus, gpu_milli, cpus and/or units")
        values: dict[str, Any] = {}
        for key, value in limits.items():
            if key not in _QUOTA_KEYS:
                raise ValueError(f"{where}.{key}: unknown; valid: {', '.join(sorted(_QUOTA_KEYS))}")
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            if not ok or not math.isfinite(value) or value < 0:
                raise ValueError(f"{where}.{key}: {value!r} is not a number ≥ 0")
            if key in _WHOLE_KEYS and value != int(value):
                raise ValueError(f"{where}.{key}: {value!r} is not a whole number")
            values[key] = int(value) if key in _WHOLE_KEYS else float(value)
        out[str(tenant)] = Quota(**values)
    return out


def load_quotas(path: str | None) -> dict[str, Quota]:
    """The quotas file named by ``DSEC_SCHEDULER_QUOTAS`` (YAML or JSON); none: no quotas.

    Raises:
        ValueError: unreadable or invalid, located.
    """
    if not path:
        return {}
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ValueError(f"DSEC_SCHEDULER_QUOTAS={path}: cannot read: {exc.strerror}") from exc
    try:
        if p.suffix == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except ValueError as exc:  # json and yaml errors both say where
        raise ValueError(f"DSEC_SCHEDULER_QUOTAS={path}: not valid JSON/YAML: {exc}") from exc
    except Exception as exc:
        raise ValueError(f"DSEC_SCHEDULER_QUOTAS={path}: not valid YAML: {exc}") from exc
    return parse_quotas(data, path)


def usage(held: Iterable[UnitHeld]) -> dict[str, tuple[int, float]]:
    """Team → (GPU milli, CPUs) it holds now."""
    out: dict[str, tuple[int, float]] = {}
    for h in held:
        milli, cpus = out.get(h.tenant, (0, 0.0))
        out[h.tenant] = (milli + h.gpu_milli_total, cpus + h.cpu_milli / 1000)
    return out


def unit_counts(held: Iterable[UnitHeld]) -> dict[str, int]:
    """Team → compute units it holds now."""
    out: dict[str, int] = {}
    for h in held:
        out[h.tenant] = out.get(h.tenant, 0) + 1
    return out


def quota_refusal(
    gang: GangDemand,
    quotas: Mapping[str, Quota],
    used: Mapping[str, tuple[int, float]],
    units_held: Mapping[str, int] | None = None,
) -> str | None:
    """Why the team may not take ``gang`` now (``quota: team X uses 7.5/8 GPUs, asks 1``);
    ``units_held``: team → units it holds (:func:`unit_counts`), for a ``units`` quota."""
    quota = quotas.get(gang.team)
    if quota is None:
        return None
    if quota.units is not None:
        held = (units_held or {}).get(gang.team, 0)
        if held + len(gang.units) > quota.units:
            return (
                f"quota: team {gang.team} holds {held}/{quota.units} units, asks {len(gang.units)}"
            )
    milli, cpus = used.get(gang.team, (0, 0.0))
    ask_milli = sum(u.gpus * MILLI + u.gpu_milli for u in gang.units)
    ask_cpus = sum(u.cpu_milli for u in gang.units) / 1000
    team = gang.team
    if quota.gpus is not None and ask_milli and (milli + ask_milli) / MILLI > quota.gpus + 1e-9:
        return (
            f"quota: team {team} uses {milli / MILLI:g}/{quota.gpus:g} GPUs, "
            f"asks {ask_milli / MILLI:g}"
        )
    if quota.gpu_milli is not None and ask_milli and milli + ask_milli > quota.gpu_milli:
        return f"quota: team {team} uses {milli}/{quota.gpu_milli} GPU milli, asks {ask_milli}"
    if quota.cpus is not None and cpus + ask_cpus > quota.cpus + 1e-9:
        return f"quota: team {team} uses {cpus:g}/{quota.cpus:g} CPUs, asks {ask_cpus:g}"
    return None


# --------------------------------------------------------------------------- the queue


@dataclass(frozen=True)
class Waiting:
    """One queue entry as the queue's rules see it."""

    sandbox_id: str
    priority: int
    queued_at: float


def ordered(entries: Iterable[Waiting]) -> list[Waiting]:
    """Higher priority first, then first come first served (ties by id)."""
    return sorted(entries, key=lambda w: (-w.priority, w.queued_at, w.sandbox_id))


def blocks(head: Waiting, now: float, could_ever_fit: bool) -> bool:
    """Whether a head that cannot fit now stops everything behind it (no more backfill): it
    waited :data:`BACKFILL_S` and would fit the fleet were it empty (one that never can
    blocks nothing)."""
    return could_ever_fit and now - head.queued_at >= BACKFILL_S
