"""Encryption of audit segments (AES-256-GCM) and keyed hashes of environment values.

The AES key of a segment is random per snapshot and kept in Vault, never in S3; the snapshot id
is the associated data, so a segment moved to another snapshot fails to decrypt. Environment
values are hashed with keyed BLAKE3 under a secret installation key, so a hash in a manifest
cannot be brute-forced back into a short secret by anyone without Vault access.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import blake3
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

KEY_BYTES = 32
_NONCE_BYTES = 12


class DecryptionFailed(Exception):
    """The ciphertext, its key or its snapshot binding is wrong."""


def new_key() -> bytes:
    """A fresh 256-bit key."""
    return os.urandom(KEY_BYTES)


def encrypt_segment(plaintext: bytes, key: bytes, snapshot_id: str) -> bytes:
    """Return ``nonce || ciphertext || tag`` bound to ``snapshot_id``."""
    nonce = os.urandom(_NONCE_BYTES)
    return nonce + AESGCM(key).encrypt(nonce, plaintext, snapshot_id.encode())


def decrypt_segment(blob: bytes, key: bytes, snapshot_id: str) -> bytes:
    """Invert :func:`encrypt_segment`.

    Raises:
        DecryptionFailed: the blob was altered, or the key or snapshot id is not the one used.
    """
    nonce, body = blob[:_NONCE_BYTES], blob[_NONCE_BYTES:]
    try:
        return AESGCM(key).decrypt(nonce, body, snapshot_id.encode())
    except (InvalidTag, ValueError) as exc:
        raise DecryptionFailed("authentication failed") from exc


def key_id(key: bytes) -> str:
    """A public id of a secret key (hash of a derived value, never of the key itself)."""
    return blake3.blake3(b"dsec key id", key=key).hexdigest()[:16]


def hash_env(values: Mapping[str, str], key: bytes) -> dict[str, str]:
    """Return each variable's keyed BLAKE3 hash (name bound in, so equal values differ)."""
    return {
        name: blake3.blake3(name.encode() + b"\0" + value.encode(), key=key).hexdigest()
        for name, value in sorted(values.items())
    }
