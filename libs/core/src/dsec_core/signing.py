"""Producer keys and signing: Ed25519 signatures chained per producer instance.

Each producer (service or CLI) has a long-lived Ed25519 key under ``$DSEC_HOME/keys`` (the raw
32-byte seed, mode 0600). Each running instance starts a fresh hash chain (a UUIDv7 ``chain``
id); every envelope it signs carries its position ``chain_seq`` and ``prev`` = BLAKE3 of the
previous envelope's wire bytes. Chains per instance need no persisted state, so a crash can never
fork a chain. Ed25519 comes from libsodium (PyNaCl): its verify is twice as fast as OpenSSL's
here, and verification is the audit trail's hot path.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import blake3
from nacl.bindings import crypto_sign, crypto_sign_seed_keypair
from nacl.signing import SigningKey

from dsec_core import canonical
from dsec_core.canonical import envelope_hash as envelope_hash  # (defined there: light)
from dsec_core.envelope import Envelope, utcnow
from dsec_core.events import Payload
from dsec_core.ids import new_event_id
from dsec_core.sigkeys import key_id_of as key_id_of  # (defined there, apart from the models)
from dsec_core.sigkeys import load_or_create_key as load_or_create_key
from dsec_core.sigkeys import signed_bytes as signed_bytes
from dsec_core.sigkeys import verify_raw as verify_raw
from dsec_core.subjects import subject_for


@dataclass(frozen=True, slots=True)
class Sealed:
    """A signed envelope ready to publish: its wire bytes plus what routing needs.

    The pydantic :class:`Envelope` and the decoded ``fields`` are built only on demand:
    publishing needs neither.
    """

    id: str
    type: str
    subject: str
    wire: bytes
    time: datetime
    chain: str
    chain_seq: int
    prev: str | None

    @property
    def fields(self) -> dict[str, Any]:
        """Every field as signed (``sig`` included), decoded from the wire bytes."""
        fields: dict[str, Any] = canonical.unpack(self.wire)
        return fields

    @property
    def envelope(self) -> Envelope:
        """The envelope as a model."""
        return Envelope.model_construct(**{**self.fields, "time": self.time})


_CLAIM_CONTEXT = "dsec 2026-12-02 Nats-Msg-Id of an envelope whose id was taken"


class Signer:
    """Builds, signs and chains envelopes for one producer instance (thread-safe)."""

    def __init__(self, producer: str, key: SigningKey, *, tenant: str = "system") -> None:
        self.producer = producer
        self.tenant = tenant
        self._key = key
        # libsodium's 64-byte secret key (seed + public key), for crypto_sign without PyNaCl's
        # per-call wrapper objects.
        self._secret = crypto_sign_seed_keypair(bytes(key))[1]
        self.public_raw = bytes(key.verify_key)
        self.key_id = key_id_of(self.public_raw)
        self._claim_key = blake3.blake3(bytes(key), derive_key_context=_CLAIM_CONTEXT).digest()
        self.chain = new_event_id()
        self._seq = 0
        self._prev: str | None = None
        self._lock = threading.Lock()

    def claimed_id(self, event_id: str) -> str:
        """The ``Nats-Msg-Id`` of an envelope whose own id another message took first in the
        stream's duplicate window (see ``EventPublisher.publish``): the id with a BLAKE3 of it
        keyed by a secret of this signing key, which no one else can compute (so no one can
        take it first too), the same for every retry (so a retry is still deduplicated)."""
        keyed = blake3.blake3(event_id.encode(), key=self._claim_key).hexdigest()[:16]
        return f"{event_id}.{keyed}"

    def seal(
        self,
        payload: Payload,
        *,
        aggregate_id: str,
        event_id: str | None = None,
        causation: Envelope | None = None,
        correlation_id: str | None = None,
        tenant: str | None = None,
    ) -> Sealed:
        """Return the signed envelope for ``payload`` with its canonical wire bytes.

        ``tenant`` defaults to the cause's tenant, else the signer's own (a user's tenant, or
        ``system`` for a service acting on its own account).
        """
        eid = event_id or new_event_id()
        now = utcnow()
        # The 16 signed fields; msgspec sorts them and writes the canonical bytes in C. The
        # payload is a JSON-mode dump (string keys, JSON scalars): its canonical bytes are
        # embedded as they are (canonical.pack_json, byte-identical to canonical_bytes).
        fields: dict[str, Any] = {
            "id": eid,
            "type": payload.TYPE,
            "subject": subject_for(payload.TYPE, aggregate_id),
            "aggregate": payload.AGGREGATE,
            "aggregate_id": aggregate_id,
            "time": now.isoformat(),
            "producer": self.producer,
            "tenant": tenant or (causation.tenant if causation else self.tenant),
            "causation_id": causation.id if causation else None,
            "correlation_id": correlation_id or (causation.correlation_id if causation else eid),
            "schema_version": payload.VERSION,
            "payload": canonical.Raw(canonical.pack_json(payload.model_dump(mode="json"))),
            "key_id": self.key_id,
            "chain": self.chain,
        }
        with self._lock:
            seq, prev = self._seq, self._prev
            fields["chain_seq"] = seq
            fields["prev"] = prev
            signed = canonical.pack_json(fields)
            fields["sig"] = crypto_sign(signed, self._secret)[:64].hex()
            wire = canonical.pack_json(fields)
            self._seq = seq + 1
            self._prev = envelope_hash(wire)
        return Sealed(eid, payload.TYPE, fields["subject"], wire, now, self.chain, seq, prev)

    def rewind(self, sealed: Sealed) -> None:
        """Take back the last sealed envelope: it never entered the log (JetStream kept an
        earlier envelope with the same id), so its chain position must be reused.

        Raises:
            RuntimeError: ``sealed`` is not the last envelope this signer sealed.
        """
        with self._lock:
            if sealed.chain_seq != self._seq - 1 or sealed.chain != self.chain:
                raise RuntimeError("can only rewind the last sealed envelope of this chain")
            self._seq -= 1
            self._prev = sealed.prev

    def endorse(self, new_public_raw: bytes) -> str:
        """Sign another public key (key rotation: the old key endorses the new one)."""
        return str(self._key.sign(new_public_raw).signature.hex())


def verify_signature(envelope: Envelope, public_raw: bytes) -> bool:
    """Return True when ``envelope.sig`` is valid for ``public_raw``."""
    fields = envelope.signed_fields()
    fields["sig"] = envelope.sig
    return verify_raw(fields, public_raw)
