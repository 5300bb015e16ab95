"""Runtime-context records (``context.injected`` payloads) and errors — never a value."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class InjectionRecord(BaseModel):
    """One injected piece of context; fields match ``dsec_core.events.ContextInjected``.

    Attributes:
        kind: ``secret``, ``s3`` or ``configmap``.
        name: env var name or mount path.
        source: the reference as the spec wrote it (``vault://...``, ``s3://...``).
        digest: keyed, so that no reader tests guesses offline: a secret's value, and a
            mount's content BLAKE3, under Transit's HMAC (see
            :meth:`.vault.VaultSecrets.digest`); ``None`` for a mount where no Vault is
            configured.
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
