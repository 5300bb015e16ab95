"""Which GPUs are degraded now, folded from ``gpu.degraded`` / ``gpu.recovered`` (pure).

The scheduler places nothing new on a degraded GPU: :func:`dsec_scheduler.gangs.node_spec`
marks it unhealthy for the engine. Migration control (``dsec_scheduler.migration``) asks
:meth:`DegradedGpus.is_degraded` / :meth:`DegradedGpus.signals` which units to move.

A GPU is degraded from its first ``gpu.degraded`` (any signal) until a ``gpu.recovered`` of the
same node and GPU signed later; a node that joins again (a restarted node agent, which judges
its GPUs afresh and reports what is still wrong) starts with none degraded.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

DEGRADED_TYPES = frozenset({"gpu.degraded", "gpu.recovered"})


@dataclass(frozen=True, slots=True)
class Degradation:
    """One signal of a degraded GPU (the ``gpu.degraded`` payload's figures)."""

    signal: str
    value: float
    threshold: float
    severity: str
    detail: str
    since: float
    event_id: str


_NONE: frozenset[int] = frozenset()


@dataclass
class DegradedGpus:
    """node -> GPU index -> signal -> :class:`Degradation`."""

    nodes: dict[str, dict[int, dict[str, Degradation]]] = field(default_factory=dict)
    _signed: dict[tuple[str, int], float] = field(default_factory=dict)
    _joined: dict[str, float] = field(default_factory=dict)
    """node -> when its agent last joined: what it (or its predecessor) signed before counts
    no more."""

    def is_degraded(self, node_id: str, gpu_index: int) -> bool:
        """Whether ``gpu_index`` of ``node_id`` is degraded now."""
        return bool(self.nodes.get(node_id, {}).get(gpu_index))

    def of_node(self, node_id: str) -> frozenset[int]:
        """The degraded GPU indices of a node (asked for every node on every decision: most
        have none)."""
        gpus = self.nodes.get(node_id)
        if not gpus:
            return _NONE
        return frozenset(i for i, s in gpus.items() if s)

    def signals(self, node_id: str, gpu_index: int) -> Mapping[str, Degradation]:
        """Why a GPU is degraded (empty: it is not)."""
        return dict(self.nodes.get(node_id, {}).get(gpu_index, {}))

    def forget_node(self, node_id: str, joined_at: float = float("-inf")) -> bool:
        """A node that joined again (at ``joined_at``, its ``node.joined``'s signed time): its
        GPUs are judged afresh, and an event signed before it is a replay (before, an old
        ``gpu.degraded`` published again after the join kept the GPU out of placement until
        the next join). True when any GPU was degraded."""
        gone = self.nodes.pop(node_id, None)
        for key in [k for k in self._signed if k[0] == node_id]:
            del self._signed[key]
        self._joined[node_id] = max(joined_at, self._joined.get(node_id, float("-inf")))
        return bool(gone)

    def apply(
        self, event_type: str, payload: Mapping[str, Any], signed_at: float, event_id: str = ""
    ) -> bool:
        """Fold one authentic event; True when a GPU changed state (the engine must resync;
        for a recovery, the queue may move). An event signed before the latest one folded for
        that GPU (a replay) changes nothing."""
        node = str(payload.get("node_id") or "")
        index = payload.get("gpu_index")
        if not node or not isinstance(index, int):
            return False
        key = (node, index)
        if signed_at < self._signed.get(key, float("-inf")):
            return False
        if signed_at < self._joined.get(node, float("-inf")):
            return False  # signed before the node's agent last joined
        self._signed[key] = signed_at
        gpus = self.nodes.setdefault(node, {})
        if event_type == "gpu.recovered":
            was = bool(gpus.pop(index, None))
            if not gpus:
                self.nodes.pop(node, None)
            return was
        if event_type != "gpu.degraded":
            return False
        signals = gpus.setdefault(index, {})
        signal = str(payload.get("signal") or "unknown")
        fresh = not signals
        signals[signal] = Degradation(
            signal=signal,
            value=float(payload.get("value") or 0.0),
            threshold=float(payload.get("threshold") or 0.0),
            severity=str(payload.get("severity") or "critical"),
            detail=str(payload.get("detail") or ""),
            since=signed_at,
            event_id=event_id,
        )
        return fresh
