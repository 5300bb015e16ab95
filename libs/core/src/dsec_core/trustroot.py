"""Where the trust root and the keys live, and reading the trust anchor, alone.

:mod:`dsec_core.identity` (certificates: pydantic, Ed25519, the signing stack with the event
models) re-exports every name here; a command that only needs the anchor to hand to a forked
verifier (``dsec audit verify``) reads it without loading that stack.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


class CertificateError(ValueError):
    """A certificate that does not hold (wrong issuer, bad signature, expired, malformed)."""


@dataclass(frozen=True)
class TrustPaths:
    """Where the embedded stack keeps the root key, the service keys and the local identity."""

    home: Path

    @property
    def root_key(self) -> Path:
        return self.home / "trust" / "root.key"

    @property
    def anchor(self) -> Path:
        return self.home / "trust" / "root.pub"

    def key(self, name: str) -> Path:
        return self.home / "keys" / f"{name}.key"

    def cert(self, name: str) -> Path:
        return self.home / "keys" / f"{name}.cert.json"

    @property
    def user_key(self) -> Path:
        return self.home / "identity" / "user.key"

    @property
    def user_cert(self) -> Path:
        return self.home / "identity" / "user.cert.json"


def read_anchor(paths: TrustPaths, configured: str | None = None) -> bytes | None:
    """The trust anchor: ``configured`` (hex, ``DSEC_TRUST_ROOT``) or the stack's ``root.pub``."""
    text = configured or (paths.anchor.read_text().strip() if paths.anchor.exists() else "")
    if not text:
        return None
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise CertificateError("the trust root must be a hex Ed25519 public key") from None
    if len(raw) != 32:
        raise CertificateError("the trust root must be 32 bytes (64 hex characters)")
    return raw
