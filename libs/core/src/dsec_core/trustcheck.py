"""The checks of an envelope's raw fields that need no connection and no event models.

:mod:`dsec_core.trust` (the gate every consumer passes events through, which re-exports these)
and ``dsec audit verify``'s verifier (:mod:`dsec_core.audit`) both read a message this way: its
fields exactly as signed, its routing consistent with its type, a key registration's certificate
from the operator root. Apart from the gate, so the verifier loads neither NATS nor the event
models (only the two key events, :mod:`dsec_core.eventbase`).
"""

from __future__ import annotations

from typing import Any

from dsec_core import identity
from dsec_core.eventbase import KeyRegistered
from dsec_core.eventtypes import aggregate_of
from dsec_core.identity import Certificate, CertificateError
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
