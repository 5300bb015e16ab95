"""Every event type in the AsyncAPI document is produced by some code path and tested.

For each type of ``dsec_core.events.EVENT_TYPES`` the source tree (outside ``events.py`` and the
test support library) must construct its payload model somewhere (an AST scan for a call of the
class), and some test must name it (the class, or the type string). ``dsec events schema`` must
list every type with its schema version.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
from dsec_core import canonical
from dsec_core.authz import PRODUCERS
from dsec_core.envelope import Envelope
from dsec_core.events import EVENT_TYPES, SandboxStopRequested
from dsec_core.schema import asyncapi_document
from dsec_core.signing import Signer
from dsec_core.subjects import filter_for, subject_for
from nacl.signing import SigningKey

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
        address = channels[event_type]["address"]
        (param,) = channels[event_type]["parameters"]
        assert address.replace(f"{{{param}}}", "sbx_1") == subject_for(event_type, "sbx_1")
        assert address.replace(f"{{{param}}}", "*") == filter_for(event_type), event_type
        message = messages[event_type]
        assert message["x-dsec-event-type"] == event_type
        assert message["x-dsec-schema-version"] == model.VERSION, event_type
        assert message["x-dsec-terminal"] == model.TERMINAL, event_type
        assert message["x-dsec-producers"] == sorted(PRODUCERS[event_type]), event_type
        envelope, specific = message["payload"]["allOf"]
        assert envelope == {"$ref": "#/components/schemas/Envelope"}, event_type
        assert specific["properties"]["type"] == {"const": event_type}
        payload_ref = specific["properties"]["payload"]["$ref"]
        schema = schemas[payload_ref.rsplit("/", 1)[-1]]
        assert set(schema.get("properties", {})) == set(model.model_fields), event_type
        assert message["headers"] == {"$ref": "#/components/schemas/NatsHeaders"}


def test_every_event_type_has_authorized_producers_and_nothing_else_does() -> None:
    """The authorization table and the catalog name the same types: a type nobody may
    publish (or a permission for a type that does not exist) is a dead entry."""
    assert set(PRODUCERS) == set(EVENT_TYPES)
    assert all(PRODUCERS[t] for t in EVENT_TYPES)


def test_the_envelope_schema_is_the_envelope_on_the_wire() -> None:
    """The document's Envelope schema names exactly the fields a sealed envelope carries on
    the wire, all required; the Nats-Msg-Id header is required."""
    schemas = asyncapi_document()["components"]["schemas"]
    envelope = schemas["Envelope"]
    signer = Signer("user-alice", SigningKey(bytes(32)), tenant="default")
    sealed = signer.seal(SandboxStopRequested(), aggregate_id="sbx_1")
    wire = canonical.unpack(sealed.wire)
    assert set(envelope["properties"]) == set(wire) == set(Envelope.model_fields)
    assert envelope["required"] == sorted(wire) and envelope["additionalProperties"] is False
    assert schemas["NatsHeaders"]["required"] == ["Nats-Msg-Id"]
    for name, value in wire.items():
        pattern = envelope["properties"][name].get("pattern")
        if pattern is not None and value is not None:
            assert re.fullmatch(pattern, str(value)), (name, value)


_ROOT_FIELDS = {
    "asyncapi",
    "id",
    "info",
    "servers",
    "defaultContentType",
    "channels",
    "operations",
    "components",
}
_COMPONENT_FIELDS = {
    "schemas",
    "servers",
    "channels",
    "operations",
    "messages",
    "securitySchemes",
    "serverVariables",
    "parameters",
    "correlationIds",
    "replies",
    "replyAddresses",
    "externalDocs",
    "tags",
    "operationTraits",
    "messageTraits",
    "serverBindings",
    "channelBindings",
    "operationBindings",
    "messageBindings",
}
_CHANNEL_FIELDS = {
    "address",
    "messages",
    "title",
    "summary",
    "description",
    "servers",
    "parameters",
    "tags",
    "externalDocs",
    "bindings",
}
_MESSAGE_FIELDS = {
    "headers",
    "payload",
    "correlationId",
    "contentType",
    "name",
    "title",
    "summary",
    "description",
    "tags",
    "externalDocs",
    "bindings",
    "examples",
    "traits",
}
_OPERATION_FIELDS = {
    "action",
    "channel",
    "title",
    "summary",
    "description",
    "security",
    "tags",
    "externalDocs",
    "bindings",
    "traits",
    "messages",
    "reply",
}


def _fields_ok(obj: dict[str, object], allowed: set[str], where: str) -> None:
    unknown = {k for k in obj if k not in allowed and not k.startswith("x-")}
    assert not unknown, f"{where}: fields AsyncAPI 3.0 does not define: {sorted(unknown)}"


def _resolve(document: dict[str, object], ref: str) -> object:
    assert ref.startswith("#/"), ref
    node: object = document
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        assert isinstance(node, dict) and part in node, f"dangling $ref {ref}"
        node = node[part]
    return node


def _refs(node: object) -> Iterator[str]:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _refs(value)


def test_the_asyncapi_document_has_the_structure_of_asyncapi_3() -> None:
    """What the AsyncAPI 3.0.0 specification requires, checked offline: the root and each
    object use only fields it defines (or x- extensions); every $ref resolves; a channel's
    address names exactly its parameters; an operation sends or receives on a channel, with
    messages of that channel; component keys match ^[a-zA-Z0-9.\\-_]+$."""
    document = asyncapi_document()
    assert document["asyncapi"] == "3.0.0"
    _fields_ok(document, _ROOT_FIELDS, "root")
    assert {"title", "version"} <= set(document["info"])
    for name, server in document["servers"].items():
        assert {"host", "protocol"} <= set(server), name
    components = document["components"]
    _fields_ok(components, _COMPONENT_FIELDS, "components")
    key = re.compile(r"^[a-zA-Z0-9.\-_]+$")
    for section in components.values():
        assert all(key.match(k) for k in section), sorted(k for k in section if not key.match(k))
    for ref in _refs(document):
        _resolve(document, ref)
    for name, channel in document["channels"].items():
        _fields_ok(channel, _CHANNEL_FIELDS, f"channel {name}")
        params = set(re.findall(r"{([^}]+)}", channel["address"]))
        assert params == set(channel.get("parameters", {})), name
        assert channel["messages"], name
    for name, operation in document["operations"].items():
        _fields_ok(operation, _OPERATION_FIELDS, f"operation {name}")
        assert operation["action"] in ("send", "receive"), name
        channel_ref = operation["channel"]["$ref"]
        assert channel_ref.startswith("#/channels/"), name
        for message in operation["messages"]:
            assert message["$ref"].startswith(f"{channel_ref}/messages/"), name
    for name, message in components["messages"].items():
        _fields_ok(message, _MESSAGE_FIELDS, f"message {name}")
        assert message["contentType"] == "application/msgpack"
        assert message["correlationId"]["$ref"].startswith("#/components/correlationIds/")
    for correlation in components["correlationIds"].values():
        assert correlation["location"].startswith("$message.")


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
