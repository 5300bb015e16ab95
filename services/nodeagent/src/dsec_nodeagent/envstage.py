"""Staging environments on this node: from the object store into ``NodeLayout.env(lock)``.

``env.built`` names an archive (``object_key``), its BLAKE3 ``digest``, its size and the bytes it
unpacks to. Staging downloads it into ``envs/.incoming/``, checks size and digest, and unpacks it
(:func:`dsec_core.envarchive.unpack`: no absolute paths, no ``..``, no links out, no more bytes
than announced) into a temporary directory under ``envs/``, renamed to ``envs/<lock hash>`` only
when complete. One staging per lock at a time; a staged environment is reused by every later
sandbox of the same lock. A corrupted archive raises :class:`EnvStageError` and leaves nothing
behind (the sandbox fails with that reason); an unreachable store raises
:class:`EnvStageUnavailable` (retried).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from dsec_core import events
from dsec_core.envarchive import (
    MAX_UNPACKED_BYTES,
    EnvArchiveError,
    digest_file,
    remove_tree,
    unpack,
)
from dsec_core.layout import LayoutError, NodeLayout
from dsec_core.objectstore import ObjectMissing, download_file, env_archive_key
from minio import Minio
from minio.error import S3Error
from urllib3.exceptions import HTTPError as Urllib3Error

log = logging.getLogger(__name__)

MAX_ARCHIVE_BYTES = 16 * 2**30
"""The largest environment archive a node downloads."""


class EnvStageError(Exception):
    """The environment cannot be staged from what ``env.built`` names (no retry helps)."""


class EnvStageUnavailable(Exception):
    """The object store could not be reached (the runtime retries)."""


@dataclass(frozen=True)
class Staged:
    """A staged environment: what the sandbox gets, and what staging cost."""

    site_packages: Path
    reused: bool
    ms: float


class EnvStager:
    """Stages environment archives into this node's layout (``envs/``, owned by the node
    agent)."""

    def __init__(self, layout: NodeLayout, store: Minio | None, bucket: str) -> None:
        self.layout = layout
        self.store = store
        self.bucket = bucket
        self._locks: dict[str, asyncio.Lock] = {}

    def _check(self, built: events.EnvBuilt) -> tuple[str, str, int]:
        """The key, digest and size ``env.built`` names, each checked."""
        try:
            expected = env_archive_key(built.lock_hash)
            self.layout.env(built.lock_hash)
        except (ValueError, LayoutError) as exc:
            raise EnvStageError(f"env.built: {exc}") from None
        if built.object_key != expected:
            raise EnvStageError(f"env.built: object_key {built.object_key!r} is not {expected!r}")
        if built.size_bytes > MAX_ARCHIVE_BYTES or built.unpacked_bytes > MAX_UNPACKED_BYTES:
            raise EnvStageError(
                f"environment {built.lock_hash}: {built.size_bytes} bytes packed, "
                f"{built.unpacked_bytes} unpacked; this node takes at most {MAX_ARCHIVE_BYTES} "
                f"and {MAX_UNPACKED_BYTES}"
            )
        return expected, built.digest, built.size_bytes

    async def stage(self, built: events.EnvBuilt) -> Staged:
        """The staged ``site-packages`` of ``built``'s lock (fetched, verified, unpacked once).

        Raises:
            EnvStageError: the archive is missing, altered, unsafe or larger than announced.
            EnvStageUnavailable: the object store could not be reached.
        """
        started = time.monotonic()
        key, digest, size = self._check(built)
        lock_hash = built.lock_hash
        dest = self.layout.env(lock_hash)
        lock = self._locks.setdefault(lock_hash, asyncio.Lock())
        await lock.acquire()  # one staging per lock on this node; the next sandbox reuses it
        # The work holds the lock until it ends, even when this caller is cancelled (its
        # download and unpack threads cannot be stopped): the next staging of the lock must
        # not sweep a directory an unpack still writes and then renames into place.
        work = asyncio.ensure_future(self._stage_locked(lock, key, digest, size, built, dest))
        work.add_done_callback(lambda t: t.cancelled() or t.exception())  # (collected)
        reused = await asyncio.shield(work)
        ms = (time.monotonic() - started) * 1000
        log.info("environment %s %s in %.1f ms", lock_hash, "reused" if reused else "staged", ms)
        return Staged(self.layout.env_site_packages(lock_hash), reused, ms)

    async def _stage_locked(
        self,
        lock: asyncio.Lock,
        key: str,
        digest: str,
        size: int,
        built: events.EnvBuilt,
        dest: Path,
    ) -> bool:
        """Whether ``dest`` was staged already; else fetch and unpack it. Releases ``lock``."""
        try:
            if dest.is_dir():
                return True
            await self._fetch_and_unpack(key, digest, size, built.unpacked_bytes, dest)
            return False
        finally:
            lock.release()

    async def _fetch_and_unpack(
        self, key: str, digest: str, size: int, unpacked: int, dest: Path
    ) -> None:
        if self.store is None:
            raise EnvStageError("no object store configured: environments come from S3")
        incoming = self.layout.envs / ".incoming"
        incoming.mkdir(parents=True, exist_ok=True)
        for stale in self.layout.envs.glob(f".{dest.name}.unpack-*"):
            remove_tree(stale)  # a crashed staging of this lock; we hold its lock
        for stale in incoming.glob(f"{dest.name}.*.tar.zst"):
            stale.unlink(missing_ok=True)
        archive = incoming / f"{dest.name}.{uuid.uuid4().hex[:8]}.tar.zst"
        try:
            await self._download(key, archive, size)
            actual, actual_size = await asyncio.to_thread(digest_file, archive)
            if actual != digest or actual_size != size:
                raise EnvStageError(
                    f"environment archive {key} does not match its env.built "
                    f"(BLAKE3 {actual[:16]}…, {actual_size} bytes; expected {digest[:16]}…, "
                    f"{size} bytes): altered or corrupted in the object store"
                )
            try:
                await asyncio.to_thread(unpack, archive, dest, max_bytes=unpacked)
            except EnvArchiveError as exc:
                raise EnvStageError(f"environment archive {key}: {exc}") from None
        finally:
            with contextlib.suppress(OSError):
                archive.unlink()

    async def _download(self, key: str, archive: Path, size: int) -> None:
        assert self.store is not None
        try:
            await asyncio.to_thread(download_file, self.store, self.bucket, key, archive, size)
        except ObjectMissing:
            missing = f"environment archive s3://{self.bucket}/{key} is missing"
            raise EnvStageError(missing) from None
        except ValueError as exc:  # more bytes than env.built announced
            raise EnvStageError(f"environment archive {key}: {exc}") from None
        except (S3Error, Urllib3Error, OSError) as exc:
            raise EnvStageUnavailable(
                f"object store unreachable for {key}: {type(exc).__name__}"
            ) from None
