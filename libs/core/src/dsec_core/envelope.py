"""The envelope every event travels in, and its MessagePack wire format.

The wire bytes are the canonical MessagePack encoding of the envelope's fields (see
:mod:`dsec_core.canonical`); the signature covers the same encoding without ``sig``. A human
view is :meth:`Envelope.to_json_dict`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsec_core import canonical
from dsec_core.events import Payload, decode_payload
from dsec_core.eventtypes import MalformedEnvelope as MalformedEnvelope  # (defined there: light)
from dsec_core.eventtypes import unpack_fields


class Envelope(BaseModel):
    """One signed event."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(description="UUIDv7, or UUIDv5 derived from the causing event")
    type: str = Field(description="Event type, e.g. 'sandbox.ready'")
    subject: str
    aggregate: str
    aggregate_id: str
    time: datetime
    producer: str = Field(description="Logical producer, e.g. 'policy' or 'user-alice'")
    tenant: str = Field(
        description="The tenant the event belongs to: a user's own (from its certificate), "
        "a service's cause's, or 'system'"
    )
    causation_id: str | None = None
    correlation_id: str
    schema_version: str
    payload: dict[str, Any]
    key_id: str = Field(description="Id of the producer key that signed this envelope")
    chain: str = Field(description="Id of the producer instance's hash chain")
    chain_seq: int = Field(ge=0, description="Position in the chain, from 0")
    prev: str | None = Field(description="BLAKE3 of the previous envelope of the chain")
    sig: str = Field(description="Ed25519 signature of the canonical bytes without sig, hex")

    def signed_fields(self) -> dict[str, Any]:
        """Return every field except ``sig`` as a canonical structure."""
        data = self.model_dump(mode="json", exclude={"sig"})
        data["time"] = self.time.isoformat()
        return dict(canonical.canonicalize(data))

    def decoded(self) -> Payload:
        """Return the typed payload (tolerates a newer minor schema version)."""
        return decode_payload(self.type, self.schema_version, self.payload)

    def to_json_dict(self) -> dict[str, Any]:
        """Return a JSON-friendly dict for humans and ``--json`` output."""
        return self.model_dump(mode="json")


def utcnow() -> datetime:
    """Return the current time in UTC."""
    return datetime.now(UTC)


def encode(envelope: Envelope) -> bytes:
    """Return the canonical wire bytes of ``envelope``."""
    data = envelope.signed_fields()
    data["sig"] = envelope.sig
    return canonical.pack(canonical.canonicalize(data))


def decode(data: bytes) -> Envelope:
    """Parse wire bytes into an envelope, or raise :class:`MalformedEnvelope`."""
    raw = unpack_fields(data)
    try:
        return Envelope.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise MalformedEnvelope(f"invalid envelope field {where}: {first['msg']}") from None
