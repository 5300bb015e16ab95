"""Where a service's certified key comes from: its ``$DSEC_HOME/keys`` files or Vault/OpenBao.

A service never creates its own key: a key the operator root did not certify would be refused
by every consumer, so a service without one refuses to start and names the command that issues
it (:class:`KeyMissing`). Two sources (``DSEC_KEY_SOURCE``):

* ``file`` — ``$DSEC_HOME/keys/<producer>.key`` (the raw Ed25519 seed, 0600) and
  ``<producer>.cert.json``, written by ``dsec up`` or ``dsec admin issue-service``;
* ``vault`` — one KV v2 secret ``<mount>/<prefix>/<name>`` holding ``seed`` (hex) and
  ``certificate`` (JSON), written by ``dsec admin issue-service --to-vault`` and
  ``dsec audit keys rotate``. Replicas and re-created containers read the same certified key;
  each process still opens its own chain. The token a service uses may read only its own path
  (:func:`vault_policy`). The name is the producer's, except for node agents: each node's
  agent has its own certified key, at ``nodeagent-<node id>`` (:func:`vault_name`).

The seed is never put into a log line, an event or an exception message.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nacl.signing import SigningKey

from dsec_core import identity
from dsec_core.identity import Certificate, CertificateError, TrustPaths

if TYPE_CHECKING:
    import hvac

    from dsec_core.settings import Settings

KEY_SOURCES = ("file", "vault")


class KeySourceError(CertificateError):
    """The key source cannot be read (Vault unreachable, permission denied, malformed data)."""


class KeyMissing(KeySourceError):
    """No key is stored for this producer: the message names the command that issues one."""


@dataclass(frozen=True)
class ServiceKey:
    """A producer's private key with the root-issued certificate that binds it."""

    key: SigningKey
    cert: Certificate

    @property
    def key_id(self) -> str:
        return self.cert.key_id


def vault_name(producer: str, node_id: str | None) -> str:
    """The name of a producer's key in Vault: a node agent's names its node."""
    return f"nodeagent-{node_id}" if producer == "nodeagent" and node_id else producer


def issue_command(producer: str, *, vault: bool, home: Path | None = None) -> str:
    """The operator command that issues ``producer``'s key (or Vault key name's) here."""
    role, node_id = producer, ""
    if producer.startswith("nodeagent-"):
        role, _, node_id = producer.partition("-")
    role = role if role in identity.SERVICE_ROLES else "ROLE"
    node = f" --node {node_id or 'NODE_ID'}" if role == "nodeagent" else ""
    if vault:
        return f"dsec admin issue-service {role}{node} --to-vault --token-file FILE"
    return f"dsec admin issue-service {role}{node} --home {home or 'DSEC_HOME'}"


def _matching(key: SigningKey, cert: Certificate, where: str) -> ServiceKey:
    if cert.public_key != bytes(key.verify_key).hex():
        raise KeySourceError(f"{where}: the certificate certifies another key than the seed")
    return ServiceKey(key, cert)


# --- file ---------------------------------------------------------------------------------------


def read_file_key(paths: TrustPaths, producer: str) -> ServiceKey:
    """The key and certificate under ``paths.home/keys``; never creates either."""
    key_path, cert_path = paths.key(producer), paths.cert(producer)
    missing = [p.name for p in (key_path, cert_path) if not p.exists()]
    if missing:
        raise KeyMissing(
            f"no certified key for {producer!r}: {', '.join(missing)} missing in "
            f"{key_path.parent} (DSEC_KEY_SOURCE=file). The operator issues it with "
            f"`{issue_command(producer, vault=False, home=paths.home)}`, or stores it in Vault "
            f"with `{issue_command(producer, vault=True)}` and runs the service with "
            "DSEC_KEY_SOURCE=vault"
        )
    seed = key_path.read_bytes()
    if len(seed) != 32:
        raise KeySourceError(f"{key_path}: not an Ed25519 seed (expected 32 bytes)")
    return _matching(SigningKey(seed), identity.read_cert(cert_path), str(cert_path))


def write_file_key(paths: TrustPaths, producer: str, key: SigningKey, cert: Certificate) -> None:
    """Store a key and its certificate under ``paths.home/keys`` (0600, each replaced
    atomically; the certificate last, so a reader that finds it matching has both)."""
    identity._write_private(paths.key(producer), bytes(key))
    identity.write_cert(paths.cert(producer), cert)


# --- vault --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VaultKeys:
    """The KV v2 location of producer keys: ``<mount>/<prefix>/<producer>``."""

    addr: str
    token: str | None
    mount: str = "secret"
    prefix: str = "dsec/keys"

    def path(self, producer: str) -> str:
        return f"{self.prefix.strip('/')}/{producer}"

    def where(self, producer: str) -> str:
        return f"Vault {self.addr} {self.mount}/{self.path(producer)}"

    def client(self) -> hvac.Client:
        import hvac

        return hvac.Client(url=self.addr, token=self.token, timeout=10)

    def _call(self, producer: str, fn: Callable[[hvac.Client], Any]) -> Any:
        """Run one Vault call; every failure becomes a :class:`KeySourceError` that names the
        path and the kind of error (never a response body: it may hold a seed)."""
        import hvac.exceptions
        import requests

        try:
            return fn(self.client())
        except hvac.exceptions.InvalidPath:
            raise KeyMissing(
                f"no certified key for {producer!r} at {self.where(producer)} "
                f"(DSEC_KEY_SOURCE=vault). The operator stores it with "
                f"`{issue_command(producer, vault=True)}`"
            ) from None
        except hvac.exceptions.Forbidden:
            raise KeySourceError(
                f"{self.where(producer)}: permission denied (the token may read only the key "
                "path of the producer it was issued for; check DSEC_VAULT_TOKEN)"
            ) from None
        except (hvac.exceptions.VaultError, requests.RequestException) as exc:
            raise KeySourceError(f"{self.where(producer)}: {type(exc).__name__}") from None

    def read(self, producer: str) -> ServiceKey:
        """The producer's key and certificate (one KV read)."""
        response = self._call(
            producer,
            lambda c: c.secrets.kv.v2.read_secret_version(
                path=self.path(producer), mount_point=self.mount, raise_on_deleted_version=True
            ),
        )
        where = self.where(producer)
        try:
            data = response["data"]["data"]
            key = SigningKey(bytes.fromhex(data["seed"]))
            cert = identity.parse(data["certificate"])
        except CertificateError as exc:
            raise KeySourceError(f"{where}: {exc}") from None
        except (KeyError, TypeError, ValueError) as exc:
            # The message of a failed hex/seed parse could quote the seed: name only the kind.
            raise KeySourceError(
                f"{where}: not a DSec key (fields seed, certificate; {type(exc).__name__})"
            ) from None
        return _matching(key, cert, where)

    def write(self, producer: str, key: SigningKey, cert: Certificate) -> int:
        """Store (a new version of) the producer's key; returns the KV version."""
        secret = {"seed": bytes(key).hex(), "certificate": cert.model_dump(mode="json")}
        response = self._call(
            producer,
            lambda c: c.secrets.kv.v2.create_or_update_secret(
                path=self.path(producer), secret=secret, mount_point=self.mount
            ),
        )
        return int(response["data"]["version"])

    def policy_name(self, producer: str) -> str:
        return f"dsec-key-{producer}"

    def grant(self, producer: str, *, ttl: str | None = None) -> str:
        """Create the producer's read-only policy and an orphan token holding only it (plus
        Vault's ``default``: look itself up, renew itself); returns the token."""
        name = self.policy_name(producer)
        rules = vault_policy(self.mount, self.path(producer))

        def create(c: hvac.Client) -> str:
            c.sys.create_or_update_policy(name=name, policy=rules)
            created = c.auth.token.create_orphan(
                policies=[name], ttl=ttl, display_name=f"dsec-{producer}", renewable=True
            )
            return str(created["auth"]["client_token"])

        token: str = self._call(producer, create)
        return token


def vault_policy(mount: str, path: str) -> str:
    """A Vault policy that reads one KV v2 secret and nothing else."""
    return f'path "{mount}/data/{path}" {{\n  capabilities = ["read"]\n}}\n'


def vault_keys(settings: Settings) -> VaultKeys:
    """The Vault key location from the settings (``DSEC_VAULT_ADDR``/``DSEC_VAULT_TOKEN``,
    ``DSEC_VAULT_KEY_MOUNT``, ``DSEC_VAULT_KEY_PREFIX``)."""
    addr = settings.endpoint("vault_addr")
    if not addr:
        raise KeySourceError("DSEC_KEY_SOURCE=vault needs DSEC_VAULT_ADDR (and DSEC_VAULT_TOKEN)")
    return VaultKeys(
        str(addr),
        settings.endpoint("vault_token") or os.environ.get("VAULT_TOKEN"),
        settings.vault_key_mount,
        settings.vault_key_prefix,
    )


def load_service_key(settings: Settings, producer: str) -> ServiceKey:
    """The certified key ``producer`` signs with, from the configured source.

    Raises:
        KeyMissing: none is stored (the message names the command that issues it).
        KeySourceError: the source cannot be read or holds a mismatched key.
    """
    if settings.key_source == "vault":
        return vault_keys(settings).read(vault_name(producer, settings.node_id))
    return read_file_key(TrustPaths(settings.home), producer)


def store_service_key(settings: Settings, producer: str, key: SigningKey, cert: Certificate) -> str:
    """Store a key where a service configured like ``settings`` reads it; returns where."""
    if settings.key_source == "vault":
        keys, name = vault_keys(settings), vault_name(producer, cert.node_id)
        version = keys.write(name, key, cert)
        return f"{keys.where(name)} (version {version})"
    paths = TrustPaths(settings.home)
    write_file_key(paths, producer, key, cert)
    return str(paths.key(producer).parent)
