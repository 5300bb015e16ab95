"""DSec core: event models, envelope, signing, bus wiring, settings, metrics helpers.

The names below are imported on first use (PEP 562): importing any ``dsec_core`` module (the
CLI's ``dsec_core.text``) must not load the event models, pydantic and nats with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsec_core.lazyimports import (
    defer_aiohttp_for_nats,
    defer_minio_admin_crypto,
    submodule_attributes,
)

defer_minio_admin_crypto()
defer_aiohttp_for_nats()

if TYPE_CHECKING:
    from dsec_core.envelope import Envelope, decode, encode
    from dsec_core.events import EVENT_TYPES, TERMINAL_TYPES, Payload, decode_payload
    from dsec_core.ids import derive_event_id, new_event_id, new_sandbox_id
    from dsec_core.settings import Settings
    from dsec_core.signing import Signer, load_or_create_key

_WHERE = {
    "Envelope": "envelope",
    "decode": "envelope",
    "encode": "envelope",
    "EVENT_TYPES": "events",
    "TERMINAL_TYPES": "events",
    "Payload": "events",
    "decode_payload": "events",
    "derive_event_id": "ids",
    "new_event_id": "ids",
    "new_sandbox_id": "ids",
    "Settings": "settings",
    "Signer": "signing",
    "load_or_create_key": "signing",
}


__getattr__ = submodule_attributes(__name__, _WHERE)


__all__ = [
    "EVENT_TYPES",
    "TERMINAL_TYPES",
    "Envelope",
    "Payload",
    "Settings",
    "Signer",
    "decode",
    "decode_payload",
    "derive_event_id",
    "encode",
    "load_or_create_key",
    "new_event_id",
    "new_sandbox_id",
]
