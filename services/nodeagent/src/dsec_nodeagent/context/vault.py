"""Secrets from OpenBao/Vault as short-lived leases, and Transit data keys (hvac adapter).

Each secret is read with a *child token* created for it with the spec's TTL: the child token is
the lease. The child token carries only the tenant's Vault ACL policy (``dsec-tenant-<tenant>``,
read on the tenant's prefixes; written idempotently with the node agent's own token), never the
node agent's: even a plan that slipped past validation cannot read another tenant's secret.
The lease is renewed while the sandbox runs and revoked (by accessor) when it exits;
anything a dynamic engine issues to it is revoked with it. Events carry the accessor, never the
token. hvac is synchronous, so every call runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dsec_core.identity import reserved_tenant
from dsec_core.lazyimports import DeferredModule

if TYPE_CHECKING:
    import hvac
    import hvac.exceptions
    import requests.exceptions
else:  # hvac and requests load when a secret or key is first needed (idle RSS)
    hvac = DeferredModule("hvac")
    requests = DeferredModule("requests")

from dsec_nodeagent.context.models import ContextError

log = logging.getLogger(__name__)

_PREFIX = re.compile(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_./-]*")


def tenant_prefixes(tenant: str, prefixes: Sequence[str] = ()) -> tuple[str, ...]:
    """The tenant's Vault prefixes (``MOUNT/PATH-PREFIX/``): given, else ``secret/<tenant>/``
    (none for a reserved tenant name: ``secret/dsec-state/`` holds every tenant's state key).

    Prefixes that could not be expressed safely in an ACL path (``..``, ``*``, quotes) are
    dropped: the tenant then reads less, never more.
    """
    conventional = () if reserved_tenant(tenant) is not None else (f"secret/{tenant}/",)
    chosen = tuple(prefixes) or conventional
    return tuple(
        p
        for p in chosen
        if _PREFIX.fullmatch(p) and ".." not in p.split("/") and "." not in p.split("/")
    )


def tenant_policy_name(tenant: str) -> str:
    """The Vault ACL policy of a tenant."""
    return f"dsec-tenant-{tenant}"


def tenant_policy_hcl(prefixes: Sequence[str]) -> str:
    """Read-only access to KV v2 data under each prefix (``secret/acme/`` ->
    ``secret/data/acme/*``)."""
    rules = []
    for prefix in prefixes:
        mount, _, rest = prefix.partition("/")
        rules.append(f'path "{mount}/data/{rest}*" {{\n  capabilities = ["read"]\n}}\n')
    return "".join(rules) or "# no secrets\n"


def in_prefixes(mount: str, path: str, prefixes: Sequence[str]) -> bool:
    """Whether ``mount/path`` lies under one of ``prefixes`` (used for the error message)."""
    return any(f"{mount}/{path}".startswith(p) for p in prefixes)


DIGEST_KEY = "dsec-digest"
"""The Transit key (``transit/keys/dsec-digest``) that keys every secret digest of this
installation; created by the first node agent that needs it."""


@dataclass
class Lease:
    """A child token holding one secret's lease.

    Attributes:
        accessor: the token's accessor (safe to log, enough to revoke).
        ttl_s: the granted TTL.
        token: the child token itself (kept in memory only, never logged).
        renewed_at: wall-clock time of the last successful grant or renewal (0: unknown);
            the lease expires ``ttl_s`` after it unless renewed again.
    """

    accessor: str
    ttl_s: int
    token: str = field(repr=False)
    renewed_at: float = 0.0


def vault_uri(mount: str, path: str, key: str) -> str:
    """The reference as users write it."""
    return f"vault://{mount}/{path}#{key}"


class VaultSecrets:
    """Reads KV v2 secrets through per-secret child tokens; wraps Transit data keys.

    Args:
        addr: Vault/OpenBao address.
        token: the node agent's token (needs ``auth/token/create`` and the secrets' read policy).
        transit_mount: the Transit engine's mount (``ro-encrypted`` data keys).
    """

    def __init__(
        self,
        addr: str,
        token: str,
        *,
        transit_mount: str = "transit",
        digest_key: str = DIGEST_KEY,
    ) -> None:
        self.addr = addr
        self._token = token
        self.transit_mount = transit_mount
        self._policies: dict[str, str] = {}  # tenant -> the HCL written (once per content)
        self._policy_lock = threading.Lock()
        self.digest_key = digest_key
        self._digest_ready = False

    def _client(self, token: str | None = None) -> hvac.Client:
        return hvac.Client(url=self.addr, token=token or self._token, timeout=10)

    async def read(
        self,
        mount: str,
        path: str,
        key: str,
        ttl_s: int,
        sandbox_id: str,
        *,
        tenant: str = "default",
        prefixes: Sequence[str] = (),
    ) -> tuple[str, Lease]:
        """Create a child token with ``ttl_s`` carrying only ``tenant``'s policy and read ``key``
        of ``mount/path`` with it.

        Raises:
            ContextError: the secret, the field or Vault itself is unavailable, or the secret is
                outside the tenant's prefixes (names the source, never a value).
        """
        allowed = tenant_prefixes(tenant, prefixes)
        return await asyncio.to_thread(
            self._read, mount, path, key, ttl_s, sandbox_id, tenant, allowed
        )

    def _read(
        self,
        mount: str,
        path: str,
        key: str,
        ttl_s: int,
        sandbox_id: str,
        tenant: str,
        allowed: tuple[str, ...],
    ) -> tuple[str, Lease]:
        uri = vault_uri(mount, path, key)
        policy = self._ensure_tenant_policy(uri, tenant, allowed)
        lease = self._create_lease(uri, ttl_s, sandbox_id, policy)
        try:
            value = self._read_field(uri, lease, mount, path, key, tenant, allowed)
        except BaseException:
            self._revoke(lease.accessor)
            raise
        return value, lease

    def _ensure_tenant_policy(self, uri: str, tenant: str, allowed: tuple[str, ...]) -> str:
        name = tenant_policy_name(tenant)
        hcl = tenant_policy_hcl(allowed)
        with self._policy_lock:
            if self._policies.get(tenant) == hcl:
                return name
            try:
                self._client().sys.create_or_update_policy(name=name, policy=hcl)
            except (hvac.exceptions.VaultError, requests.exceptions.RequestException) as exc:
                raise ContextError(
                    uri, f"cannot write the tenant's Vault policy: {_why(exc)}", transient=True
                ) from exc
            self._policies[tenant] = hcl
        log.info("vault policy %s covers %s", name, ", ".join(allowed) or "nothing")
        return name

    def _create_lease(self, uri: str, ttl_s: int, sandbox_id: str, policy: str) -> Lease:
        try:
            auth = self._client().auth.token.create(
                policies=[policy],
                ttl=f"{ttl_s}s",
                explicit_max_ttl=f"{max(ttl_s, 1) * 24}s",
                renewable=True,
                display_name=f"dsec-{sandbox_id}"[:60],
                meta={"sandbox": sandbox_id},
            )["auth"]
        except (hvac.exceptions.VaultError, requests.exceptions.RequestException) as exc:
            raise ContextError(
                uri, f"cannot create a lease token in Vault: {_why(exc)}", transient=True
            ) from exc
        return Lease(auth["accessor"], int(auth["lease_duration"]), auth["client_token"])

    def _read_field(
        self,
        uri: str,
        lease: Lease,
        mount: str,
        path: str,
        key: str,
        tenant: str,
        allowed: tuple[str, ...],
    ) -> str:
        try:
            response = self._client(lease.token).secrets.kv.v2.read_secret_version(
                path=path, mount_point=mount, raise_on_deleted_version=True
            )
        except hvac.exceptions.InvalidPath as exc:
            raise ContextError(
                uri, f"secret not found (KV v2 mount {mount!r}, path {path!r})"
            ) from exc
        except hvac.exceptions.Forbidden as exc:
            if not in_prefixes(mount, path, allowed):
                shown = ", ".join(f"vault://{p}" for p in allowed) or "none"
                raise ContextError(
                    uri,
                    f"permission denied: outside the secrets of tenant {tenant!r} "
                    f"(allowed: {shown})",
                ) from exc
            raise ContextError(
                uri, "permission denied: the tenant's Vault policy does not allow reading it"
            ) from exc
        except (hvac.exceptions.VaultError, requests.exceptions.RequestException) as exc:
            raise ContextError(uri, f"Vault read failed: {_why(exc)}", transient=True) from exc
        data = response["data"]["data"] or {}
        if key not in data:
            fields = ", ".join(sorted(data)) or "none"
            raise ContextError(uri, f"the secret has no field {key!r} (fields: {fields})")
        return str(data[key])

    async def renew(self, lease: Lease) -> int:
        """Extend a lease by its TTL; return the new TTL.

        Raises:
            ContextError: the lease is gone (expired or revoked).
        """

        def renew() -> int:
            try:
                auth = self._client(lease.token).auth.token.renew_self(increment=f"{lease.ttl_s}s")[
                    "auth"
                ]
            except (hvac.exceptions.VaultError, requests.exceptions.RequestException) as exc:
                raise ContextError(
                    f"lease {lease.accessor}", f"renewal failed: {_why(exc)}"
                ) from exc
            return int(auth["lease_duration"])

        return await asyncio.to_thread(renew)

    async def revoke(self, accessors: list[str]) -> list[str]:
        """Revoke leases by accessor; return those that could not be revoked (already gone is
        fine)."""
        return await asyncio.to_thread(lambda: [a for a in accessors if not self._revoke(a)])

    def _revoke(self, accessor: str) -> bool:
        try:
            self._client().auth.token.revoke_accessor(accessor)
        except hvac.exceptions.InvalidRequest:
            return True  # unknown accessor: expired or revoked already
        except (hvac.exceptions.VaultError, requests.exceptions.RequestException):
            return False
        return True

    # -- keyed digests of secret values ----------------------------------------------------------

    async def digest(self, value: str, source: str) -> str:
        """A keyed digest of a secret value: Transit's HMAC-SHA256 under this installation's key.

        The key never leaves Vault, so the digest in ``context.injected`` shows whether two
        values are equal (the same secret in two sandboxes, a rotated secret) but nobody who
        reads the log can test guesses offline. ``hmac-sha256:v<key version>:<hex>``.

        Raises:
            ContextError: Vault cannot compute it (names ``source``; transient).
        """
        return await asyncio.to_thread(self._digest, value.encode(), source)

    def _digest(self, value: bytes, source: str) -> str:
        encoded = base64.b64encode(value).decode()
        try:
            try:
                response = self._hmac(encoded)
            except (hvac.exceptions.InvalidPath, hvac.exceptions.InvalidRequest):
                if self._digest_ready:
                    raise
                self._ensure_digest_key()  # first use on this installation: create the key
                response = self._hmac(encoded)
        except (hvac.exceptions.VaultError, requests.exceptions.RequestException) as exc:
            raise ContextError(
                source,
                f"Vault Transit could not compute the secret's digest: {_why(exc)}",
                transient=True,
            ) from exc
        self._digest_ready = True
        return transit_hmac_digest(str(response["data"]["hmac"]))

    def _hmac(self, encoded: str) -> dict[str, Any]:
        response: dict[str, Any] = self._client().secrets.transit.generate_hmac(
            name=self.digest_key,
            hash_input=encoded,
            algorithm="sha2-256",
            mount_point=self.transit_mount,
        )
        return response

    def _ensure_digest_key(self) -> None:
        """Create the Transit engine and the digest key once (both idempotent)."""
        client = self._client()
        if f"{self.transit_mount}/" not in client.sys.list_mounted_secrets_engines()["data"]:
            with contextlib.suppress(hvac.exceptions.InvalidRequest):  # enabled concurrently
                client.sys.enable_secrets_engine("transit", path=self.transit_mount)
        # Creating an existing key changes nothing: every node agent may call it.
        client.secrets.transit.create_key(name=self.digest_key, mount_point=self.transit_mount)

    # -- Transit data keys (ro-encrypted) ---------------------------------------------------------

    def new_data_key(self, key_name: str) -> tuple[bytes, str]:
        """``(plaintext key, wrapped key)`` for encrypting one object (uploads, tests)."""
        data = self._client().secrets.transit.generate_data_key(
            name=key_name, key_type="plaintext", bits=256, mount_point=self.transit_mount
        )["data"]
        return base64.b64decode(data["plaintext"]), str(data["ciphertext"])

    def unwrap(self, kek: str, wrapped_key: str) -> bytes:
        """Decrypt a wrapped data key named by ``kek`` (``transit:<key name>``).

        Raises:
            ContextError: unknown KEK scheme, or Vault refused.
        """
        scheme, _, name = kek.partition(":")
        if scheme != "transit" or not name:
            raise ContextError(kek, "unsupported key-encryption key; expected transit:<name>")
        try:
            data = self._client().secrets.transit.decrypt_data(
                name=name, ciphertext=wrapped_key, mount_point=self.transit_mount
            )["data"]
        except (hvac.exceptions.VaultError, requests.exceptions.RequestException) as exc:
            raise ContextError(
                kek, f"Vault Transit could not unwrap the data key: {_why(exc)}"
            ) from exc
        return base64.b64decode(data["plaintext"])


def transit_hmac_digest(hmac_value: str) -> str:
    """``vault:v1:<base64>`` (Transit's answer) as ``hmac-sha256:v1:<hex>``."""
    parts = hmac_value.split(":", 2)
    if len(parts) != 3 or parts[0] != "vault" or not parts[1].startswith("v"):
        raise ValueError(f"not a Transit HMAC: {hmac_value[:12]}...")
    _, version, b64 = parts
    return f"hmac-sha256:{version}:{base64.b64decode(b64).hex()}"


def _why(exc: BaseException) -> str:
    # hvac errors can echo request URLs, never tokens; keep the first line only.
    text = str(exc).strip().splitlines()
    return text[0][:200] if text else type(exc).__name__
