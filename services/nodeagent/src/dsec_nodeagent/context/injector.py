"""Prepare a sandbox's runtime context, keep its leases alive, release everything at exit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dsec_core.spec.plan import MountPlan, SecretInjection
from pydantic import SecretStr

from dsec_nodeagent.context.configmap import ConfigMaps
from dsec_nodeagent.context.models import ContextError, InjectionRecord
from dsec_nodeagent.context.s3 import S3Materializer, s3_uri
from dsec_nodeagent.context.vault import Lease, VaultSecrets, vault_uri
from dsec_nodeagent.sandbox.models import Mount

log = logging.getLogger(__name__)

RENEW_FRACTION = 0.5
"""Renew a lease when this fraction of its TTL has passed."""

RELEASE_WAIT_S = 10.0
"""How long a stopping node agent waits for the releases of starts it cancelled mid-step."""


@dataclass
class PreparedContext:
    """A sandbox's injected context.

    Attributes:
        secret_env: env vars for :attr:`SandboxConfig.secret_env` (values; never log them).
        mounts: read-only mounts for :attr:`SandboxConfig.mounts`.
        records: one ``context.injected`` payload per item, in the order injected.
        leases: the Vault leases (accessors are also in :meth:`metadata`).
        directory: per-sandbox directory holding the materialized mounts.
    """

    sandbox_id: str
    secret_env: dict[str, SecretStr] = field(default_factory=dict)
    mounts: list[Mount] = field(default_factory=list)
    records: list[InjectionRecord] = field(default_factory=list)
    leases: list[Lease] = field(default_factory=list)
    directory: Path | None = None

    def metadata(self) -> dict[str, object]:
        """What to keep in the sandbox's state (``SandboxConfig.metadata``) so that a restarted
        node agent can still release it: lease accessors and the context directory."""
        return {
            "vault_accessors": [lease.accessor for lease in self.leases],
            "context_dir": str(self.directory) if self.directory else None,
        }


def tenant_bound(tenant: str, content: str) -> str:
    """What a ``context.injected`` digest is taken of: the content with its tenant, so that the
    digest shows equality within a tenant only. Across tenants equal digests let one tenant
    confirm a guess of another's secret or data online (its own Vault path or mount holding
    the guess, the digests compared in the log)."""
    return f"dsec context digest v2\0{tenant}\0{content}"


class ContextInjector:
    """Fetches secrets, object-store data and config maps for a sandbox.

    Args:
        root: where per-sandbox context directories go (``DSEC_HOME/sandboxes``).
        vault: secrets and Transit keys, or ``None`` when no Vault is configured.
        s3: object-store materializer, or ``None``.
        configmaps: config map reader, or ``None``.
    """

    def __init__(
        self,
        root: Path,
        *,
        vault: VaultSecrets | None = None,
        s3: S3Materializer | None = None,
        configmaps: ConfigMaps | None = None,
    ) -> None:
        self.root = root
        self.vault = vault
        self.s3 = s3
        self.configmaps = configmaps
        self._releasing: dict[str, asyncio.Task[None]] = {}  # sandbox -> _release_after's

    async def prepare(
        self,
        sandbox_id: str,
        secrets: Sequence[SecretInjection],
        mounts: Sequence[MountPlan],
        *,
        tenant: str = "default",
        tenant_vault: Sequence[str] = (),
    ) -> PreparedContext:
        """Inject everything, or nothing: on the first failure, what was done is undone.

        Secrets are read with a token limited to ``tenant``'s Vault prefixes (``tenant_vault``,
        else ``secret/<tenant>/``).

        Raises:
            ContextError: naming the source that failed.
        """
        pending = self._releasing.get(sandbox_id)
        if pending is not None:  # an earlier start's release: it removes this very directory
            log.info("%s: waiting for an earlier start's context to be released", sandbox_id)
            await asyncio.shield(pending)
        ctx = PreparedContext(sandbox_id, directory=self.root / sandbox_id / "context")
        step: asyncio.Future[None] | None = None
        try:
            for secret in secrets:
                step = asyncio.ensure_future(self._secret(ctx, secret, tenant, tenant_vault))
                await asyncio.shield(step)
            for index, mount in enumerate(mounts):
                step = asyncio.ensure_future(self._mount(ctx, index, mount, tenant))
                await asyncio.shield(step)
        except BaseException:
            if step is not None and not step.done():
                # Cancelled mid-step: the step's thread (a Vault read making a child token, a
                # download writing into the context directory) cannot be stopped. The start
                # ends now; what the step made is undone once it has ended (before, the release
                # ran at once: the token was made after it, the directory written again).
                self._release_after(step, ctx)
            else:
                await self.release(ctx)
            raise
        return ctx

    def _release_after(self, step: asyncio.Future[None], ctx: PreparedContext) -> None:
        earlier = self._releasing.get(ctx.sandbox_id)  # (two starts of it cancelled: chained)

        async def release() -> None:
            if earlier is not None:
                with contextlib.suppress(BaseException):
                    await earlier
            with contextlib.suppress(BaseException):
                await step
            try:
                failed = await self.release(ctx)
            except Exception:
                log.exception("%s: context not released after a cancelled start", ctx.sandbox_id)
                return
            if failed:
                log.warning("%s: leases not revoked (they expire): %s", ctx.sandbox_id, failed)

        sid = ctx.sandbox_id
        task = asyncio.create_task(release(), name=f"release-{sid}")
        self._releasing[sid] = task
        task.add_done_callback(lambda t: self._forget_release(sid, t))

    def _forget_release(self, sid: str, task: asyncio.Task[None]) -> None:
        if self._releasing.get(sid) is task:
            del self._releasing[sid]

    async def close(self, timeout_s: float = RELEASE_WAIT_S) -> None:
        """The node agent stops: wait (at most ``timeout_s``) for the releases of starts its
        stop cancelled mid-step, so their tokens are revoked and their files removed before the
        process ends (the tasks would be cancelled at its end, the threads' work left)."""
        pending = list(self._releasing.values())
        if not pending:
            return
        _, late = await asyncio.wait(pending, timeout=timeout_s)
        for task in late:
            log.warning(
                "%s: its cancelled start's step still runs after %.0f s: its lease, if any, "
                "expires at its TTL; its files go with the sandbox's directory (retention)",
                task.get_name().removeprefix("release-"),
                timeout_s,
            )

    async def _secret(
        self,
        ctx: PreparedContext,
        secret: SecretInjection,
        tenant: str = "default",
        tenant_vault: Sequence[str] = (),
    ) -> None:
        uri = vault_uri(secret.vault_mount, secret.vault_path, secret.key)
        if self.vault is None:
            raise ContextError(uri, "no Vault configured on this node (DSEC_VAULT_ADDR)")
        value, lease = await self.vault.read(
            secret.vault_mount,
            secret.vault_path,
            secret.key,
            secret.ttl_s,
            ctx.sandbox_id,
            tenant=tenant,
            prefixes=tenant_vault,
        )
        ctx.leases.append(lease)
        ctx.secret_env[secret.env_var] = SecretStr(value)
        ctx.records.append(
            InjectionRecord(
                kind="secret",
                name=secret.env_var,
                source=uri,
                digest=await self._keyed(value, uri, tenant),
                lease_id=lease.accessor,
                ttl_s=float(lease.ttl_s),
            )
        )

    async def _mount(
        self, ctx: PreparedContext, index: int, mount: MountPlan, tenant: str = "default"
    ) -> None:
        assert ctx.directory is not None
        dest = ctx.directory / f"{index:02d}"
        if mount.scheme == "s3":
            uri = s3_uri(mount.bucket or "", mount.prefix or "")
            if mount.mode == "rw":
                raise ContextError(uri, "mode rw is not supported for s3 mounts; use ro")
            if self.s3 is None:
                raise ContextError(uri, "no object store configured on this node")
            done = await self.s3.materialize(
                mount.bucket or "",
                mount.prefix or "",
                dest,
                encrypted=mount.encrypted,
                cache_ttl_s=mount.cache_ttl_s,
            )
            ctx.records.append(
                InjectionRecord(
                    kind="s3",
                    name=mount.path,
                    source=uri,
                    digest=await self._keyed(done.digest, uri, tenant),
                    bytes=done.bytes,
                )
            )
        else:
            uri = f"configmap://{mount.configmap}/{mount.key}"
            if self.configmaps is None:
                raise ContextError(uri, "no NATS configured on this node for config maps")
            digest, size, _ = await self.configmaps.materialize(
                mount.configmap or "", mount.key or "", dest
            )
            ctx.records.append(
                InjectionRecord(
                    kind="configmap",
                    name=mount.path,
                    source=uri,
                    digest=await self._keyed(digest, uri, tenant),
                    bytes=size,
                )
            )
        ctx.mounts.append(Mount(source=dest, target=mount.path, read_only=True))

    async def _keyed(self, content: str, uri: str, tenant: str) -> str | None:
        """What ``context.injected`` shows of a secret's value or a mount's content BLAKE3:
        Transit's HMAC under this installation's key (which never leaves Vault) of it with its
        tenant (:func:`tenant_bound`), or nothing where no Vault is configured. Every user reads
        the event: a plain BLAKE3 of a config value or of an encrypted object's plaintext let
        anyone test guesses offline (a 4-digit PIN in 10,000 hashes)."""
        if self.vault is None:
            return None
        return await self.vault.digest(tenant_bound(tenant, content), uri)

    async def keepalive(self, ctx: PreparedContext) -> None:
        """Renew every lease at half its TTL until cancelled (run it as a task while the sandbox
        runs). A failed renewal is logged by accessor and retried at the next tick."""
        if self.vault is None or not ctx.leases:
            return
        vault = self.vault
        while True:
            await asyncio.sleep(min(lease.ttl_s for lease in ctx.leases) * RENEW_FRACTION)
            for lease in ctx.leases:
                try:
                    lease.ttl_s = await vault.renew(lease) or lease.ttl_s
                    lease.renewed_at = time.time()
                except ContextError as exc:
                    log.warning("sandbox %s: %s", ctx.sandbox_id, exc)

    async def release(self, ctx: PreparedContext) -> list[str]:
        """Revoke leases and delete materialized data; return accessors that could not be
        revoked (they still expire at their TTL)."""
        failed: list[str] = []
        if self.vault is not None and ctx.leases:
            failed = await self.vault.revoke([lease.accessor for lease in ctx.leases])
        ctx.leases.clear()
        if ctx.directory is not None:
            await asyncio.to_thread(shutil.rmtree, ctx.directory, True)
        return failed

    async def release_metadata(self, metadata: dict[str, object]) -> list[str]:
        """:meth:`release` from what :meth:`PreparedContext.metadata` stored (after a restart)."""
        accessors = metadata.get("vault_accessors") or []
        failed: list[str] = []
        if self.vault is not None and isinstance(accessors, list) and accessors:
            failed = await self.vault.revoke([str(a) for a in accessors])
        directory = metadata.get("context_dir")
        if isinstance(directory, str):
            with contextlib.suppress(OSError):
                await asyncio.to_thread(shutil.rmtree, directory, True)
        return failed
