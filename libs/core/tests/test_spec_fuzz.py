"""Property: any mutation of a valid spec yields a valid spec or located errors, never a crash."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from dsec_core.spec import compile_plan, load_spec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.unit

EXAMPLE = (Path(__file__).parent / "spec_fixtures" / "agent-train-sandbox.yaml").read_bytes()
EXAMPLE_DATA: dict[str, Any] = yaml.safe_load(EXAMPLE)
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check(text: bytes | str) -> None:
    result = load_spec(text, "fuzz.yaml")
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    lines = raw.count(b"\n") + 1
    if result.spec is not None:
        assert not result.errors
        compile_plan(result.spec)
        return
    assert result.errors, "rejected without an error"
    for error in result.errors:
        assert error.file == "fuzz.yaml"
        assert error.line >= 1 and error.line <= lines + 1, error.format()
        assert error.column >= 1
        assert error.message
        error.format()


@st.composite
def byte_mutations(draw: st.DrawFn) -> bytes:
    data = bytearray(EXAMPLE)
    for _ in range(draw(st.integers(1, 4))):
        pos = draw(st.integers(0, len(data) - 1))
        action = draw(st.sampled_from(["flip", "delete", "insert"]))
        if action == "flip":
            data[pos] = draw(st.integers(0, 255))
        elif action == "delete":
            del data[pos : pos + draw(st.integers(1, 8))]
        else:
            data[pos:pos] = draw(
                st.sampled_from(
                    [
                        b":",
                        b"-",
                        b" ",
                        b"\t",
                        b"[",
                        b"{",
                        b"'",
                        b'"',
                        b"&a",
                        b"*a",
                        b"!!",
                        b"\n",
                        b"#",
                        b"\x00",
                    ]
                )
            )
    return bytes(data)


@st.composite
def line_mutations(draw: st.DrawFn) -> str:
    lines = EXAMPLE.decode().splitlines()
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(lines) - 1))
        action = draw(st.sampled_from(["drop", "dup", "swap", "indent", "dedent"]))
        if action == "drop":
            del lines[i]
        elif action == "dup":
            lines.insert(i, lines[i])
        elif action == "swap":
            j = draw(st.integers(0, len(lines) - 1))
            lines[i], lines[j] = lines[j], lines[i]
        elif action == "indent":
            lines[i] = "  " + lines[i]
        else:
            lines[i] = lines[i][2:]
        if not lines:
            break
    return "\n".join(lines)


REPLACEMENTS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True),
    st.text(max_size=12),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)


def paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for key, value in node.items():
            out += paths(value, (*prefix, key))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            out += paths(value, (*prefix, index))
    return out


ALL_PATHS = [p for p in paths(EXAMPLE_DATA) if p]


@st.composite
def type_swaps(draw: st.DrawFn) -> str:
    data = yaml.safe_load(EXAMPLE)
    path = draw(st.sampled_from(ALL_PATHS))
    parent = data
    for step in path[:-1]:
        parent = parent[step]
    parent[path[-1]] = draw(REPLACEMENTS)
    return str(yaml.safe_dump(data, sort_keys=False, allow_unicode=True))


@FUZZ
@given(byte_mutations())
def test_byte_mutations_never_crash(text: bytes) -> None:
    check(text)


@FUZZ
@given(line_mutations())
def test_line_mutations_never_crash(text: str) -> None:
    check(text)


@FUZZ
@given(type_swaps())
def test_type_swaps_never_crash(text: str) -> None:
    check(text)


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text_never_crashes(text: str) -> None:
    check(text)
