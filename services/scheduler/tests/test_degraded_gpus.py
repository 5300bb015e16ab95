"""Degraded GPUs: folded from gpu.degraded / gpu.recovered, offered to nothing new (pure)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from dsec_core.events import GpuInfo, NodeInventory

from dsec_scheduler.domain import GIB, SchedulerState, Seen
from dsec_scheduler.gangs import node_spec

pytestmark = pytest.mark.unit

NOW = 1_000_000.0
_ids = itertools.count()


def seen(event_type: str, aggregate_id: str, at: float = NOW, **payload: Any) -> Seen:
    return Seen(f"e{next(_ids)}", event_type, aggregate_id, "default", payload, at, at)


def joined(node_id: str, at: float = NOW) -> Seen:
    gpus = [
        GpuInfo(index=i, uuid=f"GPU-{i}", model="H100", memory_total_bytes=80 * GIB)
        for i in range(2)
    ]
    inv = NodeInventory(cpus=8, memory_bytes=32 * GIB, gpus=gpus).model_dump(mode="json")
    return seen("node.joined", node_id, at, node_id=node_id, inventory=inv, heartbeat_s=5)


def degraded(node_id: str, gpu: int, at: float, signal: str = "temperature") -> Seen:
    return seen(
        "gpu.degraded", node_id, at, node_id=node_id, gpu_index=gpu, signal=signal, value=92,
        threshold=85, detail="GPU hot",
    )  # fmt: skip


def recovered(node_id: str, gpu: int, at: float) -> Seen:
    return seen("gpu.recovered", node_id, at, node_id=node_id, gpu_index=gpu, degraded_s=1)


def test_a_degraded_gpu_takes_nothing_until_it_recovers() -> None:
    state = SchedulerState(lost_after_s=15)
    state.apply(joined("n1"))
    assert state.apply(degraded("n1", 1, NOW + 1)) is False  # nothing new may fit
    d = state.degraded
    assert d.is_degraded("n1", 1) and not d.is_degraded("n1", 0)
    assert d.signals("n1", 1)["temperature"].value == 92
    state.apply(degraded("n1", 1, NOW + 2, "xid"))
    assert sorted(d.signals("n1", 1)) == ["temperature", "xid"]
    inv = state.nodes["n1"].inventory
    spec = node_spec("n1", inv, (), d.of_node("n1"))
    assert [g.healthy for g in spec.gpus] == [True, False]
    assert state.apply(recovered("n1", 1, NOW + 3)) is True  # the queue may move
    assert not d.is_degraded("n1", 1) and d.of_node("n1") == frozenset()


def test_replays_foreign_subjects_and_restarts() -> None:
    state = SchedulerState(lost_after_s=15)
    state.apply(joined("n1"))
    state.apply(recovered("n1", 0, NOW + 5))
    state.apply(degraded("n1", 0, NOW + 4))  # signed before the recovery: a replay
    assert not state.degraded.is_degraded("n1", 0)
    state.apply(seen("gpu.degraded", "n2", NOW + 6, node_id="n1", gpu_index=0, signal="xid",
                     value=1, threshold=1))  # fmt: skip
    assert not state.degraded.is_degraded("n1", 0)  # filed under another node's subject
    state.apply(degraded("n1", 0, NOW + 7))
    assert state.degraded.is_degraded("n1", 0)
    state.apply(joined("n1", NOW + 8))  # a restarted node agent judges afresh
    assert not state.degraded.is_degraded("n1", 0)
    # its predecessor's genuine gpu.degraded, published again after the join: a replay (before,
    # the GPU was out of placement until the next join: the new agent never says recovered)
    state.apply(degraded("n1", 0, NOW + 7))
    assert not state.degraded.is_degraded("n1", 0)
    state.apply(degraded("n1", 1, NOW + 9))  # the new agent's own
    assert state.degraded.is_degraded("n1", 1)
