"""Keys in Vault/OpenBao (KV v2): audit-segment keys per snapshot and the env hash key.

KV v2 (not Transit) because every OpenBao/Vault has it enabled at ``secret/`` out of the box,
and deleting a snapshot's key path crypto-shreds its audit segment.
"""

from __future__ import annotations

import base64
from typing import TYPE_CHECKING, Protocol

from dsec_core.lazyimports import DeferredModule

if TYPE_CHECKING:
    import hvac
    import hvac.exceptions
    import requests
else:  # hvac and requests load when a secret or key is first needed (idle RSS)
    hvac = DeferredModule("hvac")
    requests = DeferredModule("requests")

from dsec_snapstore.crypto import new_key
from dsec_snapstore.errors import StoreUnavailable

_ENV_KEY_PATH = "dsec/snapshot-env-key"


class KeyMissing(KeyError):
    """No key is stored at that path."""


class KeyStore(Protocol):
    """Where snapshot keys live."""

    def env_hash_key(self) -> bytes:
        """The installation's secret key for hashing env values (created on first use)."""
        ...

    def put_segment_key(self, snapshot_id: str, key: bytes) -> str:
        """Store the audit-segment key of a snapshot; return its reference."""
        ...

    def get_segment_key(self, snapshot_id: str) -> bytes:
        """Return the audit-segment key of a snapshot (raises KeyMissing)."""
        ...

    def delete_segment_key(self, snapshot_id: str) -> None:
        """Destroy the audit-segment key of a snapshot (every version)."""
        ...


class VaultKeyStore:
    """A :class:`KeyStore` in a KV v2 engine (``secret/`` by default)."""

    def __init__(self, addr: str, token: str | None, *, mount: str = "secret") -> None:
        self._addr = addr
        self._mount = mount
        self._client = hvac.Client(url=addr, token=token, timeout=10)

    def _fail(self, exc: Exception) -> StoreUnavailable:
        return StoreUnavailable(f"Vault at {self._addr} failed: {type(exc).__name__}: {exc}")

    def _read(self, path: str) -> bytes:
        try:
            result = self._client.secrets.kv.v2.read_secret_version(
                path=path, mount_point=self._mount, raise_on_deleted_version=True
            )
        except hvac.exceptions.InvalidPath:
            raise KeyMissing(f"{self._mount}/{path}") from None
        except (hvac.exceptions.VaultError, requests.RequestException) as exc:
            raise self._fail(exc) from exc
        return base64.b64decode(result["data"]["data"]["key"])

    def _create(self, path: str, key: bytes) -> bool:
        """Write ``key`` at ``path`` only if nothing is there; False when something was."""
        secret = {"key": base64.b64encode(key).decode()}
        try:
            self._client.secrets.kv.v2.create_or_update_secret(
                path=path, secret=secret, cas=0, mount_point=self._mount
            )
        except hvac.exceptions.InvalidRequest as exc:
            if "check-and-set" in str(exc):
                return False
            raise self._fail(exc) from exc
        except (hvac.exceptions.VaultError, requests.RequestException) as exc:
            raise self._fail(exc) from exc
        return True

    def env_hash_key(self) -> bytes:
        """Read the env hash key, creating it atomically (check-and-set) on first use."""
        try:
            return self._read(_ENV_KEY_PATH)
        except KeyMissing:
            key = new_key()
            if self._create(_ENV_KEY_PATH, key):
                return key
            return self._read(_ENV_KEY_PATH)  # another process created it first

    def _segment_path(self, snapshot_id: str) -> str:
        return f"dsec/snapshots/{snapshot_id}"

    def put_segment_key(self, snapshot_id: str, key: bytes) -> str:
        """Store a snapshot's segment key; refuses to overwrite an existing one."""
        path = self._segment_path(snapshot_id)
        if not self._create(path, key):
            raise StoreUnavailable(f"Vault {self._mount}/{path} exists already")
        return f"vault:{self._mount}/{path}"

    def get_segment_key(self, snapshot_id: str) -> bytes:
        """Return a snapshot's segment key."""
        return self._read(self._segment_path(snapshot_id))

    def delete_segment_key(self, snapshot_id: str) -> None:
        """Destroy a snapshot's segment key."""
        try:
            self._client.secrets.kv.v2.delete_metadata_and_all_versions(
                path=self._segment_path(snapshot_id), mount_point=self._mount
            )
        except hvac.exceptions.InvalidPath:
            return
        except (hvac.exceptions.VaultError, requests.RequestException) as exc:
            raise self._fail(exc) from exc
