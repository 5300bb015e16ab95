"""Runtime-context records (``context.injected`` payloads) and errors — never a value."""

from __future__ import annotations

from typing import Literal

import blake3
from pydantic import BaseModel, ConfigDict

# Secret values are hashed in BLAKE3's key-derivation mode under a context string of their own,
# so their digests never collide with file digests and cannot be looked up in a table of plain
# BLAKE3 hashes. (A low-entropy secret stays guessable from any hash: snapshots and events carry
# it only to show *that* a value changed.)
SECRET_HASH_CONTEXT = "dsec 2026-01 runtime-context secret value"


def secret_digest(value: str) -> str:
    """Digest of a secret value for events and snapshots."""
    return blake3.blake3(value.encode(), derive_key_context=SECRET_HASH_CONTEXT).hexdigest()


class InjectionRecord(BaseModel):
    """One injected piece of context; fields match ``dsec_core.events.ContextInjected``.

    Attributes:
        kind: ``secret``, ``s3`` or ``configmap``.
        name: env var name or mount path.
        source: the reference as the spec wrote it (``vault://...``, ``s3://...``).
        digest: BLAKE3 of the content (a secret: keyed, see :func:`secret_digest`).
        lease_id: Vault token accessor of the lease (for secrets) — not the token itself.
        ttl_s: the lease's TTL.
        bytes: size of the materialized data (mounts).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["secret", "s3", "configmap"]
    name: str
    source: str
    digest: str | None = None
    lease_id: str | None = None
    ttl_s: float | None = None
    bytes: int | None = None


class ContextError(RuntimeError):
    """A piece of context could not be injected; names the source (never a value).

    Attributes:
        source: the reference that failed (``vault://secret/x#key``, ``s3://b/p/``).
        reason: what went wrong.
        transient: the store was unreachable or failed (worth retrying), as opposed to a
            missing secret or object, which no retry fixes.
    """

    def __init__(self, source: str, reason: str, *, transient: bool = False) -> None:
        super().__init__(f"{source}: {reason}")
        self.source = source
        self.reason = reason
        self.transient = transient
