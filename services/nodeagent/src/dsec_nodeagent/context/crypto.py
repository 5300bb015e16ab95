"""Client-side encryption of objects for ``ro-encrypted`` mounts (pure; keys come from outside).

Envelope encryption, as KMS-backed S3 clients do it: each object has its own random 256-bit data
key; Vault's Transit engine wraps that key (``transit/datakey/plaintext/<key>``), and only the
wrapped form is stored, in the object's header. Vault never hands out the key-encryption key,
Transit key rotation needs no re-upload, and a node decrypts only what its token may unwrap.

Object layout::

    b"DSECENC1" | u32 header length (big endian) | header JSON | AES-256-GCM(ciphertext + tag)

The header (``{"alg", "kek", "wrapped_key", "nonce"}``) is the GCM associated data, so tampering
with it — or swapping the wrapped key — fails authentication.
"""

from __future__ import annotations

import base64
import json
import os
import struct
from collections.abc import Callable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from dsec_core.text import untrusted_json

MAGIC = b"DSECENC1"
ALG = "AES-256-GCM"


class DecryptionError(ValueError):
    """An object is not in DSec's format, or fails authentication."""


def seal(plaintext: bytes, data_key: bytes, wrapped_key: str, kek: str) -> bytes:
    """Encrypt ``plaintext`` with ``data_key`` (32 bytes); ``wrapped_key`` is stored with it.

    Args:
        kek: names the key-encryption key, e.g. ``transit:dsec-data``.
    """
    if len(data_key) != 32:
        raise ValueError("data key must be 32 bytes (AES-256)")
    nonce = os.urandom(12)
    header = json.dumps(
        {
            "alg": ALG,
            "kek": kek,
            "wrapped_key": wrapped_key,
            "nonce": base64.b64encode(nonce).decode(),
        },
        sort_keys=True,
    ).encode()
    prefix = MAGIC + struct.pack(">I", len(header)) + header
    return prefix + AESGCM(data_key).encrypt(nonce, plaintext, prefix)


def parse_header(blob: bytes) -> tuple[dict[str, str], bytes, bytes]:
    """``(header, associated data, ciphertext)`` of a sealed object.

    Raises:
        DecryptionError: not a sealed object.
    """
    if not blob.startswith(MAGIC) or len(blob) < len(MAGIC) + 4:
        raise DecryptionError("not a DSec-encrypted object (missing DSECENC1 header)")
    (size,) = struct.unpack(">I", blob[len(MAGIC) : len(MAGIC) + 4])
    end = len(MAGIC) + 4 + size
    try:
        header: dict[str, str] = untrusted_json(blob[len(MAGIC) + 4 : end])
    except ValueError as exc:
        raise DecryptionError("corrupt encryption header") from exc
    if header.get("alg") != ALG:
        raise DecryptionError(f"unsupported algorithm {header.get('alg')!r}; expected {ALG}")
    return header, blob[:end], blob[end:]


def open_sealed(blob: bytes, unwrap: Callable[[str, str], bytes]) -> bytes:
    """Decrypt a sealed object; ``unwrap(kek, wrapped_key)`` returns its 32-byte data key.

    Raises:
        DecryptionError: wrong format, or authentication failed (tampered data or wrong key).
    """
    header, aad, ciphertext = parse_header(blob)
    key = unwrap(header["kek"], header["wrapped_key"])
    try:
        return AESGCM(key).decrypt(base64.b64decode(header["nonce"]), ciphertext, aad)
    except InvalidTag as exc:
        raise DecryptionError("authentication failed: the object or its key was altered") from exc
