"""Property: validate() on any mutated spec, with code, returns diagnostics — never a traceback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from dsec_rules.domain import validate

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[3] / "examples/websearch-agent"
SPEC: dict[str, Any] = yaml.safe_load((EXAMPLE / "dsec.yaml").read_text())
CODE = {"agent.py": (EXAMPLE / "agent.py").read_bytes()}

VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 70000),
    st.sampled_from(
        [
            "*",
            "*.com",
            "/",
            "0.0.0.0/0",
            "10.0.0.0/8",
            "48h",
            "1EiB",
            "api.websearch.test",
            "vault://x/y#z",
            "s3://b/p/",
            "rw",
            "redirect",
            "1.0",
            "1.1",
        ]
    ),
    st.text(max_size=10),
    st.lists(st.sampled_from(["/", "/tmp", 443, "x"]), max_size=3),
)


def leaf_paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in leaf_paths(v, (*prefix, k))] + [prefix]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in leaf_paths(v, (*prefix, i))] + [prefix]
    return [prefix]


PATHS = [p for p in leaf_paths(SPEC) if p]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(PATHS), VALUES), min_size=1, max_size=3))
def test_mutated_specs_yield_a_plan_or_located_errors(edits: list[tuple[Any, Any]]) -> None:
    data = yaml.safe_load((EXAMPLE / "dsec.yaml").read_text())
    for path, value in edits:
        parent = data
        try:
            for step in path[:-1]:
                parent = parent[step]
            parent[path[-1]] = value
        except (KeyError, IndexError, TypeError):
            continue
    outcome = validate(yaml.safe_dump(data), "fuzz.yaml", CODE)
    assert (outcome.plan is None) == bool(outcome.errors)
    for error in (*outcome.errors, *outcome.warnings):
        assert error.line >= 1 and error.column >= 1 and error.message
