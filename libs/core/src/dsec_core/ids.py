"""Identifiers: time-ordered event ids and deterministic ids derived from an input event.

Output ids derived from the input id make handlers idempotent: a redelivered input produces the
same output id, and JetStream's duplicate window (``Nats-Msg-Id``) drops the second publish.
"""

from __future__ import annotations

import uuid

import uuid6

# Namespace for derived ids; fixed forever (changing it would break idempotency across versions).
_DERIVE_NS = uuid.UUID("6f1e0c2a-8a55-4c5e-9a57-3c1b0d9f2e11")


def new_event_id() -> str:
    """Return a new UUIDv7 (time-ordered) as a string."""
    return str(uuid6.uuid7())


def derive_event_id(input_id: str, label: str) -> str:
    """Return the id of the output ``label`` of the event ``input_id`` (UUIDv5, stable)."""
    return str(uuid.uuid5(_DERIVE_NS, f"{input_id}/{label}"))


def new_sandbox_id() -> str:
    """Return a new sandbox id (``sbx_`` + 26 chars of a UUIDv7, sortable by creation)."""
    return "sbx_" + uuid6.uuid7().hex[:26]
