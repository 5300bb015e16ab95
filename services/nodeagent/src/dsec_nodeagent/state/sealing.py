"""Encryption of state at rest and in JetStream, and the tenants' state keys in OpenBao.

Every chunk, warm snapshot and cold object is sealed with XChaCha20-Poly1305 (libsodium via
PyNaCl) under its tenant's state key: a random 24-byte nonce, then the ciphertext; the
associated data names where the bytes belong (subject, seq and chunk; the snapshot's or the
object's key), so a chunk moved to another place, seq or position fails to open.

The tenant's state key is 32 random bytes in OpenBao KV v2 (``secret/dsec-state/<tenant>``,
field ``key``), created on first use with check-and-set (the first node agent's wins), cached in
memory, never logged. The node agent's OpenBao policy needs ``create``, ``read`` and ``update``
on ``secret/data/dsec-state/*`` (the embedded stack's node agent uses the dev root token).
"""

from __future__ import annotations

import asyncio
import base64
import os
import threading
from typing import TYPE_CHECKING, Final

from dsec_core.lazyimports import DeferredModule

if TYPE_CHECKING:
    import hvac
    import hvac.exceptions
    import requests
else:  # hvac and requests load when a secret or key is first needed (idle RSS)
    hvac = DeferredModule("hvac")
    requests = DeferredModule("requests")
from nacl.bindings import (
    crypto_aead_xchacha20poly1305_ietf_decrypt,
    crypto_aead_xchacha20poly1305_ietf_encrypt,
)
from nacl.exceptions import CryptoError

NONCE: Final = 24
TAG: Final = 16
KEY_PATH: Final = "dsec-state"


class SealError(ValueError):
    """Sealed bytes that do not open: altered, truncated, or sealed for another place or key."""


class KeyUnavailable(RuntimeError):
    """The tenant's state key cannot be read or created (OpenBao unreachable or refusing)."""


def seal(key: bytes, plaintext: bytes, aad: bytes) -> bytes:
    """``nonce || XChaCha20-Poly1305(plaintext, aad)``."""
    nonce = os.urandom(NONCE)
    return nonce + crypto_aead_xchacha20poly1305_ietf_encrypt(plaintext, aad, nonce, key)


def open_sealed(key: bytes, sealed: bytes, aad: bytes, what: str) -> bytes:
    """The plaintext of :func:`seal`'s output.

    Raises:
        SealError: naming ``what`` when the bytes do not authenticate.
    """
    if len(sealed) < NONCE + TAG:
        raise SealError(f"{what}: {len(sealed)} bytes, too short to be sealed")
    try:
        return crypto_aead_xchacha20poly1305_ietf_decrypt(sealed[NONCE:], aad, sealed[:NONCE], key)
    except CryptoError:
        raise SealError(
            f"{what}: does not authenticate (altered, or sealed for another place or key)"
        ) from None


class TenantKeys:
    """Tenants' state keys from OpenBao KV v2 (hvac is synchronous: run in a worker thread)."""

    def __init__(
        self, addr: str, token: str, *, mount: str = "secret", path: str = KEY_PATH
    ) -> None:
        self._addr = addr
        self._token = token
        self._mount = mount
        self._path = path  # another purpose, another key (recordings: dsec-recording)
        self._cache: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:  # never the token nor a key
        return f"TenantKeys({self._addr!r}, mount={self._mount!r})"

    async def get(self, tenant: str) -> bytes:
        """The tenant's key (created on first use)."""
        key = self._cache.get(tenant)
        if key is not None:
            return key
        return await asyncio.to_thread(self._get, tenant)

    def _get(self, tenant: str) -> bytes:
        with self._lock:
            if tenant in self._cache:
                return self._cache[tenant]
            client = hvac.Client(url=self._addr, token=self._token, timeout=10)
            path = f"{self._path}/{tenant}"
            try:
                key = self._read(client, path)
                if key is None:
                    fresh = os.urandom(32)
                    secret = {"key": base64.b64encode(fresh).decode()}
                    try:
                        client.secrets.kv.v2.create_or_update_secret(
                            path=path, secret=secret, cas=0, mount_point=self._mount
                        )
                        key = fresh
                    except hvac.exceptions.InvalidRequest as exc:
                        if "check-and-set" not in str(exc):
                            raise
                        key = self._read(client, path)  # another node agent created it first
                if key is None or len(key) != 32:
                    raise KeyUnavailable(f"{self._mount}/{path}: no 32-byte key")
            except (hvac.exceptions.VaultError, requests.RequestException) as exc:
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
                raise KeyUnavailable(
                    f"the state key of tenant {tenant!r} is unavailable in OpenBao "
                    f"({self._mount}/{path}): {first}"
                ) from None
            self._cache[tenant] = key
            return key

    def _read(self, client: hvac.Client, path: str) -> bytes | None:
        try:
            found = client.secrets.kv.v2.read_secret_version(
                path=path, mount_point=self._mount, raise_on_deleted_version=True
            )
        except hvac.exceptions.InvalidPath:
            return None
        return base64.b64decode(found["data"]["data"]["key"])
