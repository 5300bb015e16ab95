"""The AsyncAPI 3.0 document of the bus: every message modelled whole (headers, envelope,
payload), built from the event models, the subject convention and the authorization table.

``docs/events.md`` is the prose contract (canonical MessagePack, signing, chaining, keys); this
document is its machine-readable half: one channel per event type with its subject parameter,
one message per type whose schema is the envelope with that type's payload in it, the
``Nats-Msg-Id`` header, and who may publish it (``x-dsec-producers``).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from dsec_core.authz import PRODUCERS
from dsec_core.events import EVENT_MODELS, KeyRegistered, Payload
from dsec_core.identity import Certificate
from dsec_core.subjects import ROOT, STREAM, event_suffix

ENVELOPE_DOC = (
    "Every message on `dsec.>` is one event: a MessagePack map (the envelope) of 17 fields "
    "(id, type, subject, aggregate, aggregate_id, time, producer, tenant, causation_id, "
    "correlation_id, schema_version, payload, key_id, chain, chain_seq, prev, sig) in "
    "canonical encoding (keys sorted, smallest integer forms, 64-bit floats). `sig` is the "
    "producer key's Ed25519 signature of the canonical encoding of the other 16 fields; `prev` "
    "is the BLAKE3 hash of the wire bytes of the previous envelope of the same producer "
    f"instance's chain. Every message is stored in the JetStream stream `{STREAM}` and "
    "published with the header `Nats-Msg-Id` = its envelope id (deduplication). A key counts "
    "only once an `audit.key_registered` event carries a certificate from the operator root "
    "for it; `x-dsec-producers` on each message lists the certificate roles that may publish "
    "it. Each message's schema below is the whole envelope, its `payload` that type's schema. "
    "The full contract, with a worked example in bytes: docs/events.md in the DSec repository."
)

CONTENT_TYPE = "application/msgpack"

# The subject parameter of each aggregate: the token between ``dsec.<aggregate>.`` and the event.
_PARAMETERS: dict[str, tuple[str, str]] = {
    "sandbox": ("sandbox_id", "The sandbox the event is about (its spec.submitted's aggregate)"),
    "node": ("node_id", "The node the event is about"),
    "producer": ("key_id", "The key id registered or revoked (16 hex characters)"),
    "security": ("consumer", "The durable consumer that refused a message"),
    "snapshot": ("request_id", "The delete request's own id (the CLI: del-<32 hex>)"),
    "experiment": ("experiment_id", "The experiment (`dsec experiment run`: exp_<hex>)"),
    "cluster": ("setting", "Always `config`: the operator's cluster settings"),
}

_HEX = "^[0-9a-f]+$"


def _envelope_schema() -> dict[str, Any]:
    """The JSON Schema of the 17 envelope fields (as decoded from MessagePack)."""
    text: dict[str, Any] = {"type": "string"}
    properties: dict[str, Any] = {
        "aggregate": {**text, "description": "The aggregate kind: sandbox, node, producer..."},
        "aggregate_id": {
            **text,
            "pattern": "^[A-Za-z0-9_-]+$",
            "description": "The aggregate's id; one NATS subject token",
        },
        "causation_id": {
            "type": ["string", "null"],
            "description": "Id of the event this one answers; null for a first cause",
        },
        "chain": {**text, "description": "Id of the producer instance's hash chain (UUIDv7)"},
        "chain_seq": {
            "type": "integer",
            "minimum": 0,
            "description": "Position in the chain, from 0 (the key registration)",
        },
        "correlation_id": {
            **text,
            "description": "Id of the first event of the conversation (its own id when first)",
        },
        "id": {**text, "description": "Event id: UUIDv7, or a UUIDv5 derived from its cause"},
        "key_id": {
            **text,
            "pattern": "^[0-9a-f]{16}$",
            "description": "First 16 hex characters of BLAKE3 of the signing key's public key",
        },
        "payload": {"type": "object", "description": "The event type's payload"},
        "prev": {
            "type": ["string", "null"],
            "pattern": "^[0-9a-f]{64}$",
            "description": "BLAKE3 (hex) of the previous envelope's wire bytes in this chain; "
            "null at chain_seq 0",
        },
        "producer": {**text, "description": "Producer name, the certificate's subject"},
        "schema_version": {
            **text,
            "pattern": r"^[0-9]+\.[0-9]+$",
            "description": "MAJOR.MINOR of the payload schema",
        },
        "sig": {
            **text,
            "pattern": "^[0-9a-f]{128}$",
            "description": "Ed25519 signature (hex) of the canonical MessagePack of the other "
            "16 fields",
        },
        "subject": {**text, "description": "The NATS subject the event is published on"},
        "tenant": {**text, "description": "The tenant the event belongs to ('system': none)"},
        "time": {
            **text,
            "format": "date-time",
            "description": "Producer's clock, UTC, Python isoformat: "
            "YYYY-MM-DDTHH:MM:SS[.ffffff]+00:00 (signed as this exact string)",
        },
        "type": {**text, "description": "Event type, e.g. sandbox.ready"},
    }
    return {
        "title": "Envelope",
        "description": "The signed envelope every event travels in (docs/events.md).",
        "type": "object",
        "properties": properties,
        "required": sorted(properties),
        "additionalProperties": False,
    }


def _headers_schema() -> dict[str, Any]:
    return {
        "title": "NatsHeaders",
        "type": "object",
        "properties": {
            "Nats-Msg-Id": {
                "type": "string",
                "description": "The envelope's id: JetStream drops a second publish of the same "
                "id within the stream's duplicate window (idempotent retries). Where another "
                "message took the id first, the id, a dot and 16 hex digits only the "
                "producer's key can compute (docs/events.md, section 8)",
            }
        },
        "required": ["Nats-Msg-Id"],
    }


def channel_address(model: type[Payload]) -> str:
    """The channel address of an event type, its aggregate id as a ``{parameter}``."""
    param = _PARAMETERS[model.AGGREGATE][0]
    return f"{ROOT}.{model.AGGREGATE}.{{{param}}}.{event_suffix(model.AGGREGATE, model.TYPE)}"


def _subject_pattern(model: type[Payload]) -> str:
    suffix = event_suffix(model.AGGREGATE, model.TYPE).replace(".", r"\.")
    return rf"^{ROOT}\.{model.AGGREGATE}\.[A-Za-z0-9_-]+\.{suffix}$"


def asyncapi_document(server_url: str = "nats://127.0.0.1:4222") -> dict[str, Any]:
    """Return the AsyncAPI 3.0 document describing every DSec event channel."""
    ref = "#/components/schemas/{model}"
    models: list[type[BaseModel]] = [*EVENT_MODELS, Certificate]
    keys, defs = models_json_schema([(m, "serialization") for m in models], ref_template=ref)
    schemas: dict[str, Any] = dict(defs.get("$defs", {}))
    payload_ref = {m: keys[(m, "serialization")]["$ref"] for m in EVENT_MODELS}
    cert_ref = keys[(Certificate, "serialization")]["$ref"]
    registered = schemas[payload_ref[KeyRegistered].rsplit("/", 1)[-1]]
    registered["properties"]["certificate"] = {
        "anyOf": [{"$ref": cert_ref}, {"type": "null"}],
        "default": None,
        "description": registered["properties"]["certificate"].get("description", ""),
    }
    schemas["Envelope"] = _envelope_schema()
    schemas["NatsHeaders"] = _headers_schema()

    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for model in EVENT_MODELS:
        event_type = name = model.TYPE
        doc = " ".join((model.__doc__ or "").split())
        producers = sorted(PRODUCERS.get(event_type, ()))
        major = model.VERSION.split(".", 1)[0]
        param, param_doc = _PARAMETERS[model.AGGREGATE]
        messages[name] = {
            "name": event_type,
            "title": event_type,
            "summary": doc.split(". ")[0].rstrip("."),
            "description": f"{doc} (schema_version {model.VERSION}, "
            f"{'terminal' if model.TERMINAL else 'non-terminal'}; "
            f"may be published by: {', '.join(producers) or 'nobody'})",
            "contentType": CONTENT_TYPE,
            "headers": {"$ref": "#/components/schemas/NatsHeaders"},
            "correlationId": {"$ref": "#/components/correlationIds/correlation"},
            "payload": {
                "allOf": [
                    {"$ref": "#/components/schemas/Envelope"},
                    {
                        "type": "object",
                        "properties": {
                            "type": {"const": event_type},
                            "aggregate": {"const": model.AGGREGATE},
                            "subject": {"type": "string", "pattern": _subject_pattern(model)},
                            "schema_version": {
                                "type": "string",
                                "pattern": rf"^{major}\.[0-9]+$",
                            },
                            "payload": {"$ref": payload_ref[model]},
                        },
                    },
                ]
            },
            "x-dsec-event-type": event_type,
            "x-dsec-aggregate": model.AGGREGATE,
            "x-dsec-schema-version": model.VERSION,
            "x-dsec-terminal": model.TERMINAL,
            "x-dsec-producers": producers,
        }
        channels[event_type] = {
            "address": channel_address(model),
            "title": event_type,
            "description": doc,
            "parameters": {param: {"description": param_doc}},
            "messages": {event_type: {"$ref": f"#/components/messages/{name}"}},
            "servers": [{"$ref": "#/servers/development"}],
        }
        operations[f"publish:{event_type}"] = {
            "action": "send",
            "title": f"publish {event_type}",
            "summary": f"Published by a key certified for: {', '.join(producers)}",
            "channel": {"$ref": f"#/channels/{event_type}"},
            "messages": [{"$ref": f"#/channels/{event_type}/messages/{event_type}"}],
        }
    host = server_url.split("://", 1)[-1]
    return {
        "asyncapi": "3.0.0",
        "info": {"title": "DSec event bus", "version": "1.0", "description": ENVELOPE_DOC},
        "defaultContentType": CONTENT_TYPE,
        "servers": {
            "development": {
                "host": host,
                "protocol": "nats",
                "description": f"NATS with JetStream; every subject under {ROOT}.> is stored "
                f"in the stream {STREAM}",
            }
        },
        "channels": channels,
        "operations": operations,
        "components": {
            "schemas": schemas,
            "messages": messages,
            "correlationIds": {
                "correlation": {
                    "description": "The envelope's correlation_id: the first event's id",
                    "location": "$message.payload#/correlation_id",
                }
            },
        },
        "x-dsec-stream": STREAM,
    }
