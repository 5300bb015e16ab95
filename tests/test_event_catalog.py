"""Every event type in the AsyncAPI document is produced by some code path and tested.

For each type of ``dsec_core.events.EVENT_TYPES`` the source tree (outside ``events.py`` and the
test support library) must construct its payload model somewhere (an AST scan for a call of the
class), and some test must name it (the class, or the type string). ``dsec events schema`` must
list every type with its schema version.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
from dsec_core.events import EVENT_TYPES
from dsec_core.schema import asyncapi_document
from dsec_core.subjects import filter_for

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
EVENTS_PY = ROOT / "libs/core/src/dsec_core/events.py"

IN_FLIGHT: dict[str, str] = {
    # Types whose producers (and their tests) are being added in parallel branches: ONLY for
    # those; emptied at merge. A type listed here that already has a producer and a test fails
    # below, so it cannot go stale. (unit.placed / unit.migrated return with GPU placement and
    # migration, produced by the code that emits them.)
}


def _python_files(pattern: str) -> Iterator[Path]:
    for path in sorted(ROOT.glob(pattern)):
        if ".venv" not in path.parts and "__pycache__" not in path.parts:
            yield path


def _source_files() -> Iterator[Path]:
    for pattern in ("libs/*/src/**/*.py", "services/*/src/**/*.py"):
        for path in _python_files(pattern):
            if path != EVENTS_PY and "dsec_testing" not in path.parts:
                yield path


def _test_files() -> Iterator[Path]:
    for pattern in ("tests/**/*.py", "libs/*/tests/**/*.py", "services/*/tests/**/*.py"):
        for path in _python_files(pattern):
            if path != Path(__file__).resolve():
                yield path


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


@cache
def _producers() -> dict[str, list[str]]:
    """Event type -> the source files that construct its model (``Model(...)``)."""
    by_class = {model.__name__: event_type for event_type, model in EVENT_TYPES.items()}
    found: dict[str, list[str]] = {}
    for path in _source_files():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and _name(node.func) in by_class:
                event_type = by_class[str(_name(node.func))]
                found.setdefault(event_type, []).append(str(path.relative_to(ROOT)))
    return found


@cache
def _tested() -> dict[str, list[str]]:
    """Event type -> the test files that name it (its class, or its type string)."""
    by_class = {model.__name__: event_type for event_type, model in EVENT_TYPES.items()}
    found: dict[str, list[str]] = {}
    for path in _test_files():
        seen: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = _name(node)
            if name in by_class:
                seen.add(by_class[name])
            elif isinstance(node, ast.Constant) and node.value in EVENT_TYPES:
                seen.add(str(node.value))
        for event_type in seen:
            found.setdefault(event_type, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_event_type_has_a_producer_in_the_source() -> None:
    producers = _producers()
    missing = sorted(t for t in EVENT_TYPES if t not in producers and t not in IN_FLIGHT)
    assert missing == [], (
        f"no code path outside events.py constructs these event types: {missing}; "
        "produce them, or drop them from EVENT_MODELS"
    )


def test_every_event_type_is_named_by_a_test() -> None:
    tested = _tested()
    missing = sorted(t for t in EVENT_TYPES if t not in tested and t not in IN_FLIGHT)
    assert missing == [], f"no test names these event types: {missing}"


def test_the_in_flight_allowlist_holds_only_types_still_missing() -> None:
    unknown = sorted(set(IN_FLIGHT) - set(EVENT_TYPES))
    assert unknown == [], f"IN_FLIGHT names types that do not exist: {unknown}"
    done = sorted(t for t in IN_FLIGHT if t in _producers() and t in _tested())
    assert done == [], f"produced and tested now; remove from IN_FLIGHT: {done}"


def test_the_scan_sees_a_known_producer() -> None:
    """The scan itself works: the policy service constructs spec.validated."""
    assert "services/policy/src/dsec_policy/handlers.py" in _producers()["spec.validated"]


def test_the_asyncapi_document_lists_every_type_with_its_version(dsec_cli_schema) -> None:
    document = dsec_cli_schema
    channels, messages = document["channels"], document["components"]["messages"]
    schemas = document["components"]["schemas"]
    for event_type, model in EVENT_TYPES.items():
        assert channels[event_type]["address"] == filter_for(event_type), event_type
        message = messages[f"{event_type}:Message"]
        assert message["x-dsec-event-type"] == event_type
        assert message["x-dsec-schema-version"] == model.VERSION, event_type
        assert message["x-dsec-terminal"] == model.TERMINAL, event_type
        schema = schemas[message["payload"]["$ref"].rsplit("/", 1)[-1]]
        assert set(schema.get("properties", {})) == set(model.model_fields), event_type


@pytest.fixture
def dsec_cli_schema(tmp_path: Path) -> dict[str, object]:
    """What `dsec events schema --out FILE` writes."""
    from dsec_cli.main import app
    from typer.testing import CliRunner

    out = tmp_path / "asyncapi.json"
    result = CliRunner().invoke(app, ["events", "schema", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert f"({len(EVENT_TYPES)} event types)" in " ".join(result.output.split())
    document: dict[str, object] = json.loads(out.read_text())
    assert document == json.loads(json.dumps(asyncapi_document()))
    return document
