"""A validation runs in a child process with a time and memory budget."""

from __future__ import annotations

import time

import pytest
from dsec_rules.domain import ValidationOutcome, validate

from dsec_policy.budget import Budget, BudgetExceeded, run_budgeted

pytestmark = pytest.mark.unit

SPEC = 'version: "1.2"\nname: t\nbase: dsec/python311:latest\n'


def test_a_validation_comes_back_from_the_child() -> None:
    outcome = run_budgeted(validate, SPEC, "s.yaml", tenant="acme")
    assert isinstance(outcome, ValidationOutcome)
    assert outcome.ok and outcome.plan is not None and outcome.plan.tenant == "acme"


def test_a_runaway_in_time_is_cut_off() -> None:
    started = time.monotonic()
    with pytest.raises(BudgetExceeded, match=r"longer than 0.5 s"):
        run_budgeted(time.sleep, 30, budget=Budget(timeout_s=0.5))
    assert time.monotonic() - started < 5


def test_a_runaway_in_memory_is_cut_off_without_growing_the_caller() -> None:
    with pytest.raises(BudgetExceeded, match=r"more than 64 MiB of memory"):
        run_budgeted(bytearray, 512 * 1024 * 1024, budget=Budget(memory_bytes=64 * 1024 * 1024))


def test_a_crash_is_reported_by_type_only() -> None:
    with pytest.raises(BudgetExceeded, match=r"validation failed: ValueError$"):
        run_budgeted(int, "secret-looking-input")
