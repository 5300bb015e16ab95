"""The optional ``task_group`` of a spec: which agents may call each other's tools."""

from __future__ import annotations

import pytest
from dsec_core.spec import EnforcementPlan, compile_plan, load_spec

pytestmark = pytest.mark.unit

BASE = """\
version: "1.2"
name: planner
base: dsec/python311:latest
"""


def _plan(extra: str = "") -> EnforcementPlan:
    result = load_spec(BASE + extra, "dsec.yaml")
    assert result.spec is not None, [e.format() for e in result.errors]
    return compile_plan(result.spec)


def test_agents_of_one_task_group_share_it_in_the_plan() -> None:
    plan = _plan("task_group: research-team\n")
    assert plan.task_group == "research-team"
    assert plan.effective_task_group == "research-team"


def test_without_a_task_group_an_agent_is_a_group_of_its_own() -> None:
    plan = _plan()
    assert plan.task_group is None
    assert plan.effective_task_group == "planner"


def test_a_plan_recorded_before_task_groups_still_loads() -> None:
    recorded = _plan().model_dump()
    del recorded["task_group"]
    assert EnforcementPlan.model_validate(recorded).effective_task_group == "planner"


def test_an_invalid_task_group_is_named_with_its_line_and_a_suggestion() -> None:
    result = load_spec(BASE + "task_group: Research Team\n", "dsec.yaml")
    assert result.spec is None
    (error,) = result.errors
    text = error.format()
    assert "dsec.yaml:4" in text and "task_group" in text
    assert "'Research Team' is not a valid name" in text
    assert "did you mean 'research-team'?" in text
