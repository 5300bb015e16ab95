"""DSec core: event models, envelope, signing, bus wiring, settings, metrics helpers."""

from dsec_core.envelope import Envelope, decode, encode
from dsec_core.events import EVENT_TYPES, TERMINAL_TYPES, Payload, decode_payload
from dsec_core.ids import derive_event_id, new_event_id, new_sandbox_id
from dsec_core.settings import Settings
from dsec_core.signing import Signer, load_or_create_key

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
