"""Producer keys and signing: Ed25519 signatures chained per producer instance.

Each producer (service or CLI) has a long-lived Ed25519 key under ``$DSEC_HOME/keys``. Each
running instance starts a fresh hash chain (a UUIDv7 ``chain`` id); every envelope it signs
carries its position ``chain_seq`` and ``prev`` = BLAKE3 of the previous envelope's wire bytes.
Chains per instance need no persisted state, so a crash can never fork a chain.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import blake3
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

from dsec_core import canonical
from dsec_core.envelope import Envelope, encode, utcnow
from dsec_core.events import Payload
from dsec_core.ids import new_event_id
from dsec_core.subjects import subject_for


def key_id_of(public: Ed25519PublicKey) -> str:
    """Return the short id of a public key: first 16 hex chars of BLAKE3 of its raw bytes."""
    return blake3.blake3(public_bytes(public)).hexdigest()[:16]


def public_bytes(public: Ed25519PublicKey) -> bytes:
    """Return the raw 32-byte encoding of ``public``."""
    return public.public_bytes(Encoding.Raw, PublicFormat.Raw)


def load_or_create_key(path: Path) -> Ed25519PrivateKey:
    """Load the raw private key at ``path``, creating it (mode 0600) when absent."""
    if path.exists():
        return Ed25519PrivateKey.from_private_bytes(path.read_bytes())
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = Ed25519PrivateKey.generate()
    raw = key.private_bytes_raw()
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, raw)
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic and never overwrites a key another process created first
    except FileExistsError:
        return Ed25519PrivateKey.from_private_bytes(path.read_bytes())
    finally:
        tmp.unlink()
    return key


def envelope_hash(wire: bytes) -> str:
    """Return the chain hash of an envelope's wire bytes."""
    return blake3.blake3(wire).hexdigest()


class Signer:
    """Builds, signs and chains envelopes for one producer instance (thread-safe)."""

    def __init__(self, producer: str, key: Ed25519PrivateKey) -> None:
        self.producer = producer
        self._key = key
        self.public_key = key.public_key()
        self.key_id = key_id_of(self.public_key)
        self.chain = new_event_id()
        self._seq = 0
        self._prev: str | None = None
        self._lock = threading.Lock()

    def seal(
        self,
        payload: Payload,
        *,
        aggregate_id: str,
        event_id: str | None = None,
        causation: Envelope | None = None,
        correlation_id: str | None = None,
    ) -> tuple[Envelope, bytes]:
        """Return the signed envelope for ``payload`` and its wire bytes."""
        eid = event_id or new_event_id()
        corr = correlation_id or (causation.correlation_id if causation else eid)
        fields: dict[str, Any] = {
            "id": eid,
            "type": payload.TYPE,
            "subject": subject_for(payload.TYPE, aggregate_id),
            "aggregate": payload.AGGREGATE,
            "aggregate_id": aggregate_id,
            "time": utcnow(),
            "producer": self.producer,
            "causation_id": causation.id if causation else None,
            "correlation_id": corr,
            "schema_version": payload.VERSION,
            "payload": payload.model_dump(mode="json"),
            "key_id": self.key_id,
            "chain": self.chain,
        }
        with self._lock:
            fields["chain_seq"] = self._seq
            fields["prev"] = self._prev
            signed = canonical.canonicalize(fields)
            sig = self._key.sign(canonical.pack(signed)).hex()
            envelope = Envelope.model_construct(**fields, sig=sig)
            wire = encode(envelope)
            self._seq += 1
            self._prev = envelope_hash(wire)
        return envelope, wire

    def endorse(self, new_public: Ed25519PublicKey) -> str:
        """Sign another public key (key rotation: the old key endorses the new one)."""
        return self._key.sign(public_bytes(new_public)).hex()


def verify_signature(envelope: Envelope, public_raw: bytes) -> bool:
    """Return True when ``envelope.sig`` is valid for ``public_raw``."""
    try:
        Ed25519PublicKey.from_public_bytes(public_raw).verify(
            bytes.fromhex(envelope.sig), canonical.pack(envelope.signed_fields())
        )
    except Exception:  # InvalidSignature, or a malformed hex/key: all mean "not valid"
        return False
    return True
