"""The checks of an envelope's raw fields that need no connection and no event models.

:mod:`dsec_core.trust` (the gate every consumer passes events through, which re-exports these)
and ``dsec audit verify``'s verifier (:mod:`dsec_core.audit`) both read a message this way: its
fields exactly as signed, its routing consistent with its type, a key registration's certificate
from the operator root. Apart from the gate, so the verifier loads neither NATS nor the event
models (only the two key events, :mod:`dsec_core.eventbase`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from dsec_core import identity
from dsec_core.eventbase import KeyRegistered
from dsec_core.eventtypes import aggregate_of
from dsec_core.identity import Certificate, CertificateError
from dsec_core.ids import canonical_uuid
from dsec_core.sigkeys import verify_raw
from dsec_core.subjects import subject_for


def shape_problem(fields: dict[str, Any]) -> str | None:
    """What is inconsistent in an envelope's routing fields (raw, as signed): its aggregate and
    subject must be the ones its type and aggregate id give, so a message cannot pose as
    another kind or another sandbox's."""
    event_type, aggregate_id = fields.get("type"), fields.get("aggregate_id")
    if not isinstance(event_type, str) or not isinstance(aggregate_id, str):
        return "type and aggregate_id must be strings"
    try:
        aggregate = aggregate_of(event_type)
        subject = subject_for(event_type, aggregate_id)
    except ValueError as exc:
        return str(exc)[:300]
    if fields.get("aggregate") != aggregate:
        return f"aggregate {fields.get('aggregate')!r} is not that of {event_type}"
    if fields.get("subject") != subject:
        return f"subject {fields.get('subject')!r} is not {subject!r}"
    return None


def registration_problem(fields: dict[str, Any], anchor: bytes) -> str | Certificate:
    """Check one ``audit.key_registered`` envelope: its certificate or what is wrong with it."""
    try:
        reg = KeyRegistered.model_validate(fields.get("payload"))
        public = bytes.fromhex(reg.public_key)
    except ValueError as exc:
        return f"malformed key registration: {str(exc)[:200]}"
    if not verify_raw(fields, public):
        return "key registration not signed by the key it registers"
    if not (fields.get("key_id") == fields.get("aggregate_id") == reg.key_id):
        return "a key registration must be filed under the key id it registers"
    if reg.certificate is None:
        return f"key {reg.key_id} of {reg.producer!r} has no certificate from the operator root"
    try:
        cert = identity.parse(reg.certificate)
        identity.check(cert, anchor)
    except CertificateError as exc:
        return f"key {reg.key_id} of {reg.producer!r}: {exc}"
    if cert.public_key != reg.public_key or cert.key_id != reg.key_id:
        return "the certificate is for another key"
    if cert.subject != reg.producer or fields.get("producer") != reg.producer:
        return f"certificate for {cert.subject!r} registered as {reg.producer!r}"
    return cert


USER_ID_SKEW_MS = 60_000
"""A user's event id is a UUIDv7 dated within this of the event's signing time (ms)."""


def user_id_problem(event_id: str, signed: datetime) -> str | None:
    """Why a user's event id is not one it may use, or None. A user's event id must be a fresh
    UUIDv7, dated within :data:`USER_ID_SKEW_MS` of the event's signing time (what every DSec
    client makes): replay protection is per consumer, and answers take ids derived from their
    request's, so a user choosing ids could take a service's predictable one first (another
    tenant's periodic snapshot, refused as a replay) or use one of its own again on another
    kind of request once JetStream's duplicate window had passed (two answers under one id:
    `dsec audit verify` reported tampering). Within the window a second use is not stored."""
    value = event_id
    if not canonical_uuid(value):
        return None  # refused as malformed where an id keys anything (replay checks)
    if value[14] != "7" or value[19] not in "89ab":
        return f"event id {value[:80]!r} is not a UUIDv7, as a user's event ids are"
    try:
        dated_ms = int(value[:8] + value[9:13], 16)
    except ValueError:
        return f"event id {value[:80]!r} is not a UUIDv7, as a user's event ids are"
    signed_ms = signed.timestamp() * 1000
    if abs(dated_ms - signed_ms) > USER_ID_SKEW_MS:
        return (
            f"event id {value} is dated {abs(dated_ms - signed_ms) / 1000:.0f} s from the event's "
            f"signing time (at most {USER_ID_SKEW_MS // 1000} s: a user's event id is new for "
            "each event)"
        )
    return None


def signed_time(fields: dict[str, Any]) -> datetime | str:
    """An envelope's signing time, or what is wrong with it: an ISO 8601 string with its zone
    (what every producer writes). The gate and the verifier read it alike: a time one took and
    the other could not read made the verifier stop (any user could send one)."""
    value = fields.get("time")
    if not isinstance(value, str) or len(value) > 64:
        return "time must be an ISO 8601 string"
    try:
        signed = datetime.fromisoformat(value)
    except ValueError:
        return f"time {value!r} is not ISO 8601"
    if signed.tzinfo is None:
        return "time has no zone"
    return signed
