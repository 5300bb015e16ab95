"""Producer keys and the check of a signature, apart from the signing stack.

:mod:`dsec_core.signing` (which re-exports these) seals envelopes with the event models;
checking one needs only the raw fields, the key and libsodium: ``dsec audit verify``'s verifier
and the certificates (:mod:`dsec_core.identity`) load this, not the event models.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import blake3
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from dsec_core import canonical


def key_id_of(public_raw: bytes) -> str:
    """Return the short id of a public key: first 16 hex chars of BLAKE3 of its raw bytes."""
    return blake3.blake3(public_raw).hexdigest()[:16]


def load_or_create_key(path: Path) -> SigningKey:
    """Load the raw private key at ``path``, creating it (mode 0600) when absent."""
    if path.exists():
        return SigningKey(path.read_bytes())
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    key = SigningKey.generate()
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.write(fd, bytes(key))
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)  # atomic, and never overwrites a key another process created first
    except FileExistsError:
        return SigningKey(path.read_bytes())
    finally:
        tmp.unlink()
    return key


def signed_bytes(fields: dict[str, Any]) -> bytes:
    """The bytes a signature covers: canonical MessagePack of every field except ``sig``."""
    return canonical.pack({k: v for k, v in fields.items() if k != "sig"})


def verify_raw(fields: dict[str, Any], public_raw: bytes) -> bool:
    """Return True when ``fields['sig']`` is valid for the other fields under ``public_raw``."""
    try:
        VerifyKey(public_raw).verify(signed_bytes(fields), bytes.fromhex(fields["sig"]))
    except (BadSignatureError, ValueError, TypeError):
        return False
    return True
