"""The spec's ``tools:`` section: compiled into the plan, and every mistake reported at once at
its line."""

from __future__ import annotations

import pytest
from dsec_core.spec import compile_plan, load_spec

pytestmark = pytest.mark.unit

HEAD = """\
version: "1.2"
name: searcher
base: dsec/python311:latest
entrypoint: [python, agent.py]
runtime_context:
  env_vars:
    - name: WEB_SEARCH_KEY
      source: vault://secret/default/agent-tools/websearch#key
"""


def test_a_tools_section_compiles_into_the_plan_in_seconds() -> None:
    text = (
        HEAD
        + """\
tools:
  web_search:
    timeout: 1s
    retries: {attempts: 4, max_time: 8s, backoff: 200ms, max_backoff: 2s, on: [timeout]}
    breaker: {failures: 3, reset_after: 3s}
    fallback: [local_search]
    degraded_after: 2
    secret: WEB_SEARCH_KEY
    hosts: [API.websearch.test]
"""
    )
    result = load_spec(text, "dsec.yaml")
    assert result.ok, [e.format() for e in result.errors]
    assert result.spec is not None
    tool = compile_plan(result.spec, source=result.source).tools["web_search"]
    assert tool.timeout_s == 1.0
    assert tool.retries == {
        "attempts": 4,
        "max_time_s": 8.0,
        "backoff_s": 0.2,
        "max_backoff_s": 2.0,
        "on": ["timeout"],
    }
    assert tool.breaker == {"failures": 3, "reset_after_s": 3.0}
    assert (tool.fallback, tool.degraded_after, tool.secret) == (
        ("local_search",),
        2,
        "WEB_SEARCH_KEY",
    )
    assert tool.hosts == ("api.websearch.test",)
    assert tool.spec_line == 11  # where its mapping starts


def test_every_mistake_of_the_tools_section_is_reported_at_its_line() -> None:
    text = (
        HEAD
        + """\
tools:
  web_search:
    retries: {attempts: 0, backoff: 3s, max_backoff: 1s, on: [bad_arguments]}
    fallback: [local_search, web_search]
    secret: NOPE
  local_search:
    fallback: [web_search]
  9bad: {}
"""
    )
    result = load_spec(text, "dsec.yaml")
    assert not result.ok
    found = {(e.path, e.line) for e in result.errors}
    messages = " | ".join(e.format() for e in result.errors)
    assert ("tools.web_search.retries.attempts", 11) in found, messages
    assert ("tools.web_search.retries.on[0]", 11) in found, messages
    assert ("tools.web_search.fallback[1]", 12) in found, messages
    assert ("tools.web_search.secret", 13) in found, messages
    assert ("tools.local_search.fallback[0]", 15) in found, messages
    assert "falls back to itself" in messages
    assert "round in a circle: local_search → web_search → local_search" in messages
    assert "'NOPE' is not a secret of runtime_context.env_vars" in messages
    assert "'9bad' is not a tool name" in messages


def test_backoff_above_its_ceiling_and_too_many_tools_are_refused() -> None:
    text = HEAD + "tools:\n  web_search:\n    retries: {backoff: 3s, max_backoff: 1s}\n"
    result = load_spec(text, "dsec.yaml")
    assert [e.path for e in result.errors] == ["tools.web_search.retries.backoff"]
    many = HEAD + "tools:\n" + "".join(f"  t{i}: {{}}\n" for i in range(65))
    result = load_spec(many, "dsec.yaml")
    assert any("65 tools; a spec declares at most 64" in e.format() for e in result.errors)
