"""The YAML parser is bounded: alias bombs, huge, deep or wide documents end in a located error."""

from __future__ import annotations

import time

import pytest
from dsec_core.spec import load_spec
from dsec_core.spec.source import MAX_ALIAS_EXPANSIONS, MAX_DEPTH, MAX_DOCUMENT_BYTES, MAX_NODES

pytestmark = pytest.mark.unit

HEAD = 'version: "1.2"\nname: bomb\nbase: dsec/python311:latest\n'


def billion_laughs(levels: int = 9) -> str:
    lines = [HEAD.rstrip("\n"), 'a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\n"


def the_error(text: str) -> str:
    result = load_spec(text, "bomb.yaml")
    assert result.spec is None
    assert len(result.errors) == 1, [e.format() for e in result.errors]
    error = result.errors[0]
    assert error.rule_id == "yaml-limit"
    return error.format()


def test_billion_laughs_stops_at_the_alias_limit_quickly_with_a_located_error() -> None:
    started = time.monotonic()
    shown = the_error(billion_laughs())
    assert time.monotonic() - started < 2.0
    assert shown.startswith("bomb.yaml:5:")  # the first line whose aliases go over the limit
    assert f"alias expansions limit of {MAX_ALIAS_EXPANSIONS} alias uses" in shown


def test_a_few_aliases_still_work() -> None:
    text = HEAD + "entrypoint: &cmd [python, agent.py]\nresources: {cpu: 1}\n"
    assert load_spec(text, "ok.yaml").ok


def test_document_size_is_bounded() -> None:
    text = HEAD + "# " + "x" * MAX_DOCUMENT_BYTES + "\n"
    shown = the_error(text)
    assert shown.startswith("bomb.yaml:1:1:")
    assert f"document size limit of {MAX_DOCUMENT_BYTES} bytes" in shown


def test_depth_is_bounded() -> None:
    depth = MAX_DEPTH + 5
    text = HEAD + "x: " + "[" * depth + "]" * depth + "\n"
    shown = the_error(text)
    assert f"depth limit of {MAX_DEPTH} levels" in shown


def test_very_deep_nesting_is_a_limit_error_not_a_crash() -> None:
    text = HEAD + "x: " + "[" * 5000 + "]" * 5000 + "\n"
    assert "depth limit" in the_error(text)


def test_node_count_is_bounded_without_aliases() -> None:
    items = ",".join(["1"] * (MAX_NODES + 1))
    text = HEAD + f"x: [{items}]\n"
    assert f"node count limit of {MAX_NODES} values" in the_error(text)
