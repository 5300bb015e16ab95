"""The placement engine's contract: what a unit asks for, what a node offers, what a decision
says (with its score breakdown) and why a unit waits (node counts per reason, like
kube-scheduler's "0/1213 nodes are available: 800 …", with numbers).

GPU shares are integers in thousandths of one GPU (``milli``): a unit takes either ``gpus``
whole GPUs (each 1000 milli free) or ``gpu_milli`` (1-999, or 1000 for one whole GPU) of one
GPU; several shared units stack on a GPU while their milli sum stays ≤ 1000.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

MILLI = 1000

Protocol_ = Literal["nvlink-p2p", "rdma-over-converged-ethernet", "shm"]


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU of a node as inventoried."""

    index: int
    model: str
    """Canonical model name (:mod:`dsec_core.gpumodels`)."""
    memory_bytes: int
    nvlink_group: int = 0
    """GPUs of a node with the same group id reach each other over NVLink (P2P)."""
    healthy: bool = True
    temperature_c: float | None = None


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """A node as the engine knows it: capacity, and whether it may take work now."""

    node_id: str
    cpu_milli: int
    memory_bytes: int
    gpus: tuple[GpuSpec, ...] = ()
    schedulable: bool = True
    unschedulable_reason: str = ""
    """Why not (``cordoned``, ``lost``, ``unhealthy: …``): counted as the node's reason."""
    max_units: int = 1 << 30


@dataclass(frozen=True, slots=True)
class UnitDemand:
    """One compute unit's needs."""

    key: str
    """Unique id of the unit (``<sandbox_id>/<unit name>``)."""
    cpu_milli: int
    memory_bytes: int
    gpus: int = 0
    """Whole GPUs (0: none, or a share)."""
    gpu_milli: int = 0
    """A share of one GPU in thousandths (0: none, or whole GPUs)."""
    models: frozenset[str] = frozenset()
    """Acceptable canonical GPU models (empty: any)."""
    min_gpu_memory_bytes: int = 0
    max_temperature_c: float | None = None
    nvlink: bool = False
    """Whole GPUs of this unit must share one NVLink group."""


@dataclass(frozen=True, slots=True)
class Edge:
    """Two units of a gang that talk; ``nvlink-p2p`` and ``shm`` ask for one node (and for
    nvlink-p2p one NVLink group when both use whole GPUs); RoCE is satisfied anywhere."""

    a: str
    b: str
    protocol: str


@dataclass(frozen=True, slots=True)
class GangDemand:
    """All units of one task: placed together or not at all."""

    gang_id: str
    units: tuple[UnitDemand, ...]
    edges: tuple[Edge, ...] = ()
    priority: int = 0
    team: str = ""


@dataclass(frozen=True, slots=True)
class UnitChoice:
    """Where one unit goes."""

    key: str
    node_id: str
    gpu_indices: tuple[int, ...] = ()
    gpu_milli: int = 0
    """Milli taken on each GPU in ``gpu_indices`` (1000 for whole GPUs)."""
    score: float = 0.0
    breakdown: Mapping[str, float] = field(default_factory=dict)
    """Named terms of the score (e.g. ``fragmentation_delta``, ``packing``, ``affinity``)."""
    feasible_nodes: int = 0
    """How many nodes could have taken the unit."""
    cpu_milli: int = 0
    """CPU the unit takes on the node (so a commit needs nothing but the placement)."""
    memory_bytes: int = 0


@dataclass(frozen=True, slots=True)
class GangPlacement:
    """A decision for a whole gang (not yet committed)."""

    gang_id: str
    choices: tuple[UnitChoice, ...]
    policy: str
    nodes_total: int


@dataclass(frozen=True, slots=True)
class Unfit:
    """Why a gang cannot be placed now."""

    gang_id: str
    unit: str
    """The first unit that found no place (its key)."""
    nodes_total: int
    reasons: Mapping[str, int]
    """Reason → how many nodes it excluded (each node counted once, under its first reason)."""

    def summary(self) -> str:
        """``0/1213 nodes: 800 no GPU of model V100M32, 413 insufficient GPU share``."""
        parts = ", ".join(
            f"{n} {r}" for r, n in sorted(self.reasons.items(), key=lambda kv: (-kv[1], kv[0]))
        )
        return f"0/{self.nodes_total} nodes: {parts}" if parts else f"0/{self.nodes_total} nodes"


class PlacementEngine(Protocol):
    """Stateful and incremental: nodes are upserted as heartbeats arrive, decisions committed as
    they are published, units released when they end."""

    policy: str

    def upsert_node(self, node: NodeSpec) -> None: ...

    def remove_node(self, node_id: str) -> None: ...

    def place(self, gang: GangDemand) -> GangPlacement | Unfit:
        """Choose places for every unit of ``gang`` (all or none); changes nothing."""
        ...

    def commit(self, placement: GangPlacement) -> None:
        """Take the capacity a placement chose."""
        ...

    def assume(self, demand: UnitDemand, choice: UnitChoice) -> None:
        """Take what ``choice`` says for ``demand``, replacing what the unit held (a unit placed
        by another replica or before a restart, read back from the log)."""
        ...

    def release(self, key: str) -> None:
        """Give back what unit ``key`` holds (no-op when it holds nothing)."""
        ...

    def allocation_ratio(self) -> Mapping[str, float]:
        """Allocated GPU milli / capacity, per model and ``"all"``."""
        ...

    def nodes(self) -> Sequence[str]: ...
