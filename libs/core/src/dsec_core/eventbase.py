"""The base of every event payload model, and the two the audit verifier reads.

Defined here, apart from :mod:`dsec_core.events` (which re-exports them and registers them with
every other model): ``dsec audit verify``'s verifier checks key registrations and revocations
without loading the other models and the spec models they carry (a fifth of a second).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field


class Payload(BaseModel):
    """Base of every event payload."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    TYPE: ClassVar[str]
    AGGREGATE: ClassVar[str]
    VERSION: ClassVar[str] = "1.0"
    TERMINAL: ClassVar[bool] = False


# --- keys (the audit trail's trust) ----------------------------------------------------------


class KeyRegistered(Payload):
    """A producer's Ed25519 public key, registered in the log itself."""

    TYPE = "audit.key_registered"
    AGGREGATE = "producer"
    VERSION = "1.1"

    producer: str
    key_id: str
    public_key: str = Field(description="Raw Ed25519 public key, hex")
    endorsement: str | None = Field(
        default=None, description="For a key rotation: the new key signed by the previous key"
    )
    certificate: dict[str, Any] | None = Field(
        default=None,
        description="The operator root's certificate binding this key to a role (and a tenant "
        "or node); a key without one is never trusted",
    )


class KeyRevoked(Payload):
    """The operator withdrew a key: events it signs from now on are refused."""

    TYPE = "audit.key_revoked"
    AGGREGATE = "producer"

    key_id: str
    producer: str = Field(description="The producer the key was certified for")
    reason: str = ""
