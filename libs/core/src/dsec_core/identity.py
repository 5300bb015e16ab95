"""Who may sign: the operator root key, certificates that bind a key to a role and a tenant.

No key is trusted on first use. The operator holds a **root key** (an Ed25519 key created by
``dsec up`` under ``$DSEC_HOME/trust/root.key``, or kept elsewhere by the operator; only its
public half, the *trust anchor*, is needed to verify). The root signs a :class:`Certificate`
for every producer key:

* each service key (role ``policy``, ``builder``, ``snapshot``, ``scheduler``, ``nodeagent`` —
  a node agent's certificate also names its node), issued by ``dsec up`` or ``dsec admin issue``;
* each user key (role ``user``, bound to a user name and a tenant), issued by the identity step
  ``dsec login`` (an operator-issued credential);
* the operator's own signing key (role ``operator``: revocations).

Every consumer checks an event's key against its certificate and the anchor before it acts
(:mod:`dsec_core.trust`); ``dsec audit verify`` does the same over the whole log.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from dsec_core import canonical
from dsec_core.sigkeys import key_id_of, load_or_create_key
from dsec_core.trustroot import (  # (re-exported: defined there, apart from the signing stack)
    CertificateError as CertificateError,
)
from dsec_core.trustroot import TrustPaths as TrustPaths
from dsec_core.trustroot import read_anchor as read_anchor

Role = Literal["operator", "policy", "builder", "snapshot", "scheduler", "nodeagent", "user"]
SERVICE_ROLES: tuple[Role, ...] = ("policy", "builder", "snapshot", "scheduler", "nodeagent")
SYSTEM_TENANT = "system"
"""The tenant of events no tenant caused (key registrations, heartbeats, rejections)."""
DEFAULT_TENANT = "default"


def reserved_tenant(name: str) -> str | None:
    """Why ``name`` cannot be a tenant (None: it can). The stack keeps its own secrets under
    tenant-like paths of the tenants' Vault mount (``secret/dsec/keys``: the producers' keys,
    ``secret/dsec-state/<t>``, ``secret/dsec-recording/<t>``), and a tenant's conventional
    scope is ``secret/<tenant>/``: a tenant named ``dsec`` or ``dsec-state`` would read them."""
    if name == SYSTEM_TENANT or name == "dsec" or name.startswith("dsec-"):
        return (
            f"tenant {name!r} is reserved ('system', 'dsec' and names starting 'dsec-' name "
            "the stack's own secrets and events)"
        )
    return None


class Certificate(BaseModel):
    """The operator root's statement: this public key speaks as ``subject`` in ``role``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    subject: str = Field(description="The producer name the key signs as, e.g. 'policy'")
    role: Role
    tenant: str | None = Field(
        default=None, description="Users: the only tenant they act for; services: None (any)"
    )
    node_id: str | None = Field(default=None, description="Node agents: the node they own")
    public_key: str = Field(description="Raw Ed25519 public key, hex")
    key_id: str
    issued_at: datetime
    expires_at: datetime | None = None
    issuer: str = Field(description="Key id of the root key that signed it")
    sig: str = Field(description="The root key's Ed25519 signature of the other fields, hex")

    def signed_bytes(self) -> bytes:
        """The canonical bytes the root signature covers."""
        return canonical.canonical_bytes(self.model_dump(mode="json", exclude={"sig"}))


def issue(
    root: SigningKey,
    public_raw: bytes,
    *,
    subject: str,
    role: Role,
    tenant: str | None = None,
    node_id: str | None = None,
    expires_at: datetime | None = None,
) -> Certificate:
    """Sign a certificate for ``public_raw`` with the operator root key."""
    if role == "user" and not tenant:
        raise ValueError("a user certificate needs a tenant")
    fields: dict[str, Any] = {
        "subject": subject,
        "role": role,
        "tenant": tenant,
        "node_id": node_id,
        "public_key": public_raw.hex(),
        "key_id": key_id_of(public_raw),
        "issued_at": datetime.now(UTC),
        "expires_at": expires_at,
        "issuer": key_id_of(bytes(root.verify_key)),
        "sig": "",
    }
    unsigned = Certificate.model_validate(fields)
    return unsigned.model_copy(update={"sig": root.sign(unsigned.signed_bytes()).signature.hex()})


def check(cert: Certificate, anchor: bytes, *, now: datetime | None = None) -> None:
    """Raise :class:`CertificateError` unless the root ``anchor`` signed a still valid ``cert``."""
    if cert.issuer != key_id_of(anchor):
        raise CertificateError(f"issued by key {cert.issuer}, not by the operator root")
    try:
        VerifyKey(anchor).verify(cert.signed_bytes(), bytes.fromhex(cert.sig))
    except (BadSignatureError, ValueError) as exc:
        raise CertificateError(f"root signature invalid: {exc}") from None
    if key_id_of(bytes.fromhex(cert.public_key)) != cert.key_id:
        raise CertificateError("key id does not match the public key")
    if cert.expires_at is not None and (now or datetime.now(UTC)) >= cert.expires_at:
        raise CertificateError(f"expired at {cert.expires_at.isoformat()}")


def parse(data: Any) -> Certificate:
    """A certificate from its JSON form, or :class:`CertificateError`."""
    try:
        return Certificate.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise CertificateError(f"malformed certificate ({where}: {first['msg']})") from None


# --- files --------------------------------------------------------------------------------------


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def write_cert(path: Path, cert: Certificate) -> None:
    """Store a certificate (public data, but kept beside its private key)."""
    _write_private(path, cert.model_dump_json(indent=2).encode())


def read_cert(path: Path) -> Certificate:
    """Load a certificate file, or :class:`CertificateError` naming the file."""
    try:
        return parse(json.loads(path.read_text()))
    except FileNotFoundError:
        raise CertificateError(f"no certificate at {path}") from None
    except (json.JSONDecodeError, CertificateError) as exc:
        raise CertificateError(f"{path}: {exc}") from None


def ensure_root(paths: TrustPaths) -> SigningKey:
    """The operator root key, created on first use (0600); its public half beside it."""
    root = load_or_create_key(paths.root_key)
    public = bytes(root.verify_key).hex()
    if not paths.anchor.exists() or paths.anchor.read_text().strip() != public:
        paths.anchor.write_text(public + "\n")
    return root


def ensure_service_identity(
    paths: TrustPaths,
    root: SigningKey,
    role: Role,
    *,
    node_id: str | None = None,
    name: str | None = None,
) -> Certificate:
    """Key + certificate of a service, issued by the root when missing or no longer matching.

    ``name`` (default: the role) is the producer it signs as and names its files.
    """
    name = name or role
    key = load_or_create_key(paths.key(name))
    public = bytes(key.verify_key)
    try:
        cert = read_cert(paths.cert(name))
        check(cert, bytes(root.verify_key))
        same = (cert.public_key, cert.role, cert.node_id, cert.subject)
        if same == (public.hex(), role, node_id, name):
            return cert
    except CertificateError:
        pass
    cert = issue(root, public, subject=name, role=role, node_id=node_id)
    write_cert(paths.cert(name), cert)
    return cert


def issue_user(
    root: SigningKey, user: str, tenant: str, key: SigningKey | None = None
) -> tuple[SigningKey, Certificate]:
    """A new user key (unless given) and its certificate for ``tenant``."""
    key = key or SigningKey.generate()
    cert = issue(root, bytes(key.verify_key), subject=f"user-{user}", role="user", tenant=tenant)
    return key, cert


def credential_json(key: SigningKey, cert: Certificate, anchor: bytes | None = None) -> str:
    """An operator-issued credential file: the user's private key, its certificate and the
    operator root's public key (what the user's CLI verifies events against)."""
    data: dict[str, Any] = {"key": bytes(key).hex(), "certificate": cert.model_dump(mode="json")}
    if anchor is not None:
        data["trust_root"] = anchor.hex()
    return json.dumps(data)


def credential_anchor(text: str) -> bytes | None:
    """The trust root a credential file carries, if any."""
    try:
        value = json.loads(text).get("trust_root")
        return bytes.fromhex(value) if isinstance(value, str) and len(value) == 64 else None
    except (json.JSONDecodeError, AttributeError, ValueError):
        return None


def save_identity(paths: TrustPaths, key: SigningKey, cert: Certificate) -> None:
    """Install a user identity as this machine's CLI identity."""
    _write_private(paths.user_key, bytes(key))
    write_cert(paths.user_cert, cert)


def load_user(paths: TrustPaths) -> tuple[SigningKey, Certificate]:
    """The installed user identity (``dsec login``)."""
    key = SigningKey(paths.user_key.read_bytes())
    cert = read_cert(paths.user_cert)
    if cert.public_key != bytes(key.verify_key).hex():
        raise CertificateError(f"{paths.user_cert} certifies another key than {paths.user_key}")
    return key, cert


def load_credential(text: str) -> tuple[SigningKey, Certificate]:
    """Parse a credential file written by :func:`credential_json`."""
    try:
        data = json.loads(text)
        key = SigningKey(bytes.fromhex(data["key"]))
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CertificateError(f"not a DSec credential ({type(exc).__name__})") from None
    cert = parse(data.get("certificate"))
    if cert.public_key != bytes(key.verify_key).hex():
        raise CertificateError("the credential's certificate is for another key")
    return key, cert
