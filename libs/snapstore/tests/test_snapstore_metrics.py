"""Snapshot work is timed by operation and outcome: a ``snapshot.failed`` answer counts as
failed, any other answer as ok (``dsec_snapshot_seconds``)."""

from __future__ import annotations

import time

import pytest
from prometheus_client import REGISTRY

from dsec_snapstore import metrics, sandboxes
from dsec_snapstore.requests import failed

pytestmark = pytest.mark.unit


def _count(operation: str, outcome: str) -> float:
    labels = {"operation": operation, "outcome": outcome}
    return REGISTRY.get_sample_value("dsec_snapshot_seconds_count", labels) or 0.0


def test_answers_are_timed_by_operation_and_outcome() -> None:
    keys = [(op, out) for op in ("create", "restore") for out in ("ok", "failed")]
    before = {key: _count(*key) for key in keys}
    refused = [failed("v1", "restore", "sandbox runs nowhere")]
    taken = [sandboxes.snapshot_taken("v1", "0" * 64, 1, 10, 0)]
    started = time.perf_counter()
    assert metrics.answered("restore", started, refused) is refused
    assert metrics.answered("create", started, taken) is taken
    assert metrics.answered("create", started, []) == []
    after = {key: _count(*key) - n for key, n in before.items()}
    assert after == {
        ("create", "ok"): 2,
        ("create", "failed"): 0,
        ("restore", "ok"): 0,
        ("restore", "failed"): 1,
    }
