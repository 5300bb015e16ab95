"""Compiled plans for tests that publish ``spec.validated`` (its ``plan`` is typed)."""

from __future__ import annotations

from dsec_core.spec import EnforcementPlan, compile_plan, load_spec


def minimal_plan(name: str = "x", body: str = "") -> EnforcementPlan:
    """The plan of ``name: NAME`` on ``python:3.11`` plus ``body`` (more spec YAML), compiled
    with its source lines as the policy service compiles it."""
    text = f'version: "1.2"\nname: {name}\nbase: python:3.11\n{body}'
    loaded = load_spec(text, "dsec.yaml")
    if loaded.spec is None:
        raise ValueError("; ".join(e.format() for e in loaded.errors))
    return compile_plan(loaded.spec, source=loaded.source)
