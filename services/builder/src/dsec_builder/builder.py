"""Incremental, content-addressed environment builds from a lock.

An environment is keyed by its lock hash. An identical lock reuses the stored environment at
once; otherwise each artifact is taken from the first tier that has it with the right sha256:
the node-local cache, then the cluster cache in S3, then the package index (whose downloads
fill the cluster cache). Bytes with a wrong hash are reported and never installed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from dsec_core.layout import NodeLayout
from dsec_core.settings import Settings
from dsec_core.threads import to_thread_to_the_end
from minio import Minio

from dsec_builder.adapters.artifacts import (
    ClusterCacheError,
    Digest,
    IndexFetcher,
    IndexUnavailableError,
    LocalCache,
    S3WheelCache,
    sha256_file,
)
from dsec_builder.adapters.store import SITE_PACKAGES, EnvironmentStore, remove_tree
from dsec_builder.adapters.uv import Uv
from dsec_builder.domain import fingerprint, lock_hash, redact_text
from dsec_builder.errors import InstallError, MissingArtifactsError
from dsec_builder.models import (
    BuildTimings,
    BuiltEnv,
    IntegrityFailure,
    Lock,
    LockedPackage,
    MissingArtifact,
    Tier,
    TierBytes,
)

log = logging.getLogger(__name__)


def default_interpreter() -> Path:
    """The interpreter environments are built for: this one, seen through any venv symlink."""
    return Path(os.path.realpath(sys.executable))


@dataclass
class _FetchLog:
    """What one build took from where, and what it caught."""

    bytes_from: dict[Tier, int] = field(default_factory=lambda: {"local": 0, "s3": 0, "index": 0})
    failures: list[IntegrityFailure] = field(default_factory=list)
    missing: list[MissingArtifact] = field(default_factory=list)

    def caught(self, package: LockedPackage, tier: Tier, actual: str, action: str) -> None:
        log.warning("sha256 mismatch for %s from %s tier: %s", package.filename, tier, action)
        self.failures.append(
            IntegrityFailure(
                package=f"{package.name}=={package.version}",
                filename=package.filename,
                tier=tier,
                expected_sha256=package.sha256,
                actual_sha256=actual,
                action=action,
            )
        )


class EnvironmentBuilder:
    """Builds and reuses environments under the builder's own root (``NodeLayout.builder``).

    Args:
        home: ``$DSEC_HOME``; environments go to ``builder/envs/``, artifacts to
            ``builder/cache/wheels`` (the node agent stages what it runs from the object store).
        uv: The installer engine (its cache holds unpacked wheels for fast re-installs).
        cluster_cache: The S3 artifact cache shared by all nodes, or ``None``.
        index: Downloads from the package index.
        python: The sandbox interpreter the environments are for.
        max_parallel: Artifacts fetched at once.
    """

    def __init__(
        self,
        home: Path,
        *,
        uv: Uv | None = None,
        cluster_cache: S3WheelCache | None = None,
        index: IndexFetcher | None = None,
        python: Path | None = None,
        max_parallel: int = 8,
    ) -> None:
        root = NodeLayout(home).builder
        self.store = EnvironmentStore(root / "envs")
        self.cache = LocalCache(root / "cache" / "wheels")
        self.uv = uv or Uv(cache_dir=root / "cache" / "uv")
        self.cluster_cache = cluster_cache
        self.index = index or IndexFetcher()
        self.python = python or default_interpreter()
        self._parallel = asyncio.Semaphore(max_parallel)

    @classmethod
    def from_settings(
        cls, settings: Settings, *, s3: Minio | None = None, python: Path | None = None
    ) -> EnvironmentBuilder:
        """A builder for this node; the cluster cache is ``s3`` or the one in ``settings``."""
        endpoint = settings.endpoint("s3_endpoint")
        if s3 is None and endpoint:
            s3 = Minio(
                str(endpoint),
                access_key=settings.endpoint("s3_access_key"),
                secret_key=settings.endpoint("s3_secret_key"),
                secure=settings.s3_secure,
            )
        cache = S3WheelCache(s3, settings.s3_bucket) if s3 is not None else None
        home = settings.home.resolve()
        return cls(home, cluster_cache=cache, python=python)

    async def close(self) -> None:
        """Release network connections."""
        await self.index.close()

    async def build(self, lock: Lock) -> BuiltEnv:
        """Return the environment for ``lock``, building only what is missing.

        Raises:
            MissingArtifactsError: some artifacts are in no tier (e.g. offline node, cold cache).
            InstallError: the installer rejected the verified artifacts.
        """
        started = time.monotonic()
        key, print_ = lock_hash(lock), fingerprint(lock.packages)
        if self.store.exists(key):
            return self._reused(key, print_, lock, started)
        async with self.store.build_lock(key):
            if self.store.exists(key):  # a concurrent build of the same lock finished first
                return self._reused(key, print_, lock, started)
            fetched, report = await self._fetch_all(key, lock)
            fetch_done = time.monotonic()
            await self._install(key, print_, lock, fetched)
        finished = time.monotonic()
        return BuiltEnv(
            lock_hash=key,
            fingerprint=print_,
            path=self.store.site_packages(key),
            reused=False,
            timings=BuildTimings(
                fetch_s=fetch_done - started,
                install_s=finished - fetch_done,
                total_s=finished - started,
            ),
            bytes_from=TierBytes(**report.bytes_from),
            integrity_failures=tuple(report.failures),
            packages=len(lock.packages),
        )

    def _reused(self, key: str, print_: str, lock: Lock, started: float) -> BuiltEnv:
        self.store.touch(key)
        return BuiltEnv(
            lock_hash=key,
            fingerprint=print_,
            path=self.store.site_packages(key),
            reused=True,
            timings=BuildTimings(total_s=time.monotonic() - started),
            bytes_from=TierBytes(),
            packages=len(lock.packages),
        )

    # ------------------------------------------------------------------ fetching

    async def _fetch_all(self, key: str, lock: Lock) -> tuple[list[Path], _FetchLog]:
        report = _FetchLog()
        paths = await asyncio.gather(*(self._obtain(p, report) for p in lock.packages))
        if report.missing:
            raise MissingArtifactsError(key, report.missing, report.failures)
        return [p for p in paths if p is not None], report

    async def _obtain(self, package: LockedPackage, report: _FetchLog) -> Path | None:
        async with self._parallel:
            local = await self._from_local(package, report)
            if local is not None:
                return local
            reasons: list[str] = []
            staged = self.cache.staging_file()
            try:
                path = await self._from_cluster(package, staged, report, reasons)
                if path is None:
                    path = await self._from_index(package, staged, report, reasons)
                return path
            finally:
                staged.unlink(missing_ok=True)

    async def _from_local(self, package: LockedPackage, report: _FetchLog) -> Path | None:
        path = self.cache.path(package)
        if not path.is_file():
            return None
        digest = await asyncio.to_thread(sha256_file, path)
        if digest.sha256 != package.sha256:
            report.caught(package, "local", digest.sha256, "evicted from the node cache; refetched")
            self.cache.evict(package)
            return None
        report.bytes_from["local"] += digest.size
        return path

    async def _from_cluster(
        self, package: LockedPackage, staged: Path, report: _FetchLog, reasons: list[str]
    ) -> Path | None:
        if self.cluster_cache is None:
            return None
        try:
            # (a cancelled build removes the staged file only once the download stopped writing)
            digest = await to_thread_to_the_end(self.cluster_cache.download, package.sha256, staged)
        except ClusterCacheError as exc:
            reasons.append(str(exc))
            return None
        if digest is None:
            reasons.append("not in the cluster cache")
            return None
        if digest.sha256 != package.sha256:
            report.caught(
                package,
                "s3",
                digest.sha256,
                "not installed; refetched from the package index and the cluster cache repaired",
            )
            reasons.append("cluster cache object has the wrong sha256")
            return None
        report.bytes_from["s3"] += digest.size
        return self.cache.admit(staged, package)

    async def _from_index(
        self, package: LockedPackage, staged: Path, report: _FetchLog, reasons: list[str]
    ) -> Path | None:
        try:
            digest = await self.index.download(package.url, staged)
        except IndexUnavailableError as exc:
            reasons.append(str(exc))
            self._missing(package, report, reasons)
            return None
        if digest.sha256 != package.sha256:
            report.caught(package, "index", digest.sha256, "not installed; the build fails")
            reasons.append("the package index served bytes with the wrong sha256")
            self._missing(package, report, reasons)
            return None
        report.bytes_from["index"] += digest.size
        path = self.cache.admit(staged, package)
        await self._fill_cluster(package, path, digest)
        return path

    async def _fill_cluster(self, package: LockedPackage, path: Path, digest: Digest) -> None:
        if self.cluster_cache is None:
            return
        try:
            await asyncio.to_thread(self.cluster_cache.upload, path, digest.sha256)
        except ClusterCacheError as exc:
            # The build does not need the cluster cache; other nodes just miss it later.
            log.warning("could not fill the cluster cache with %s: %s", package.filename, exc)

    @staticmethod
    def _missing(package: LockedPackage, report: _FetchLog, reasons: list[str]) -> None:
        report.missing.append(
            MissingArtifact(
                package=f"{package.name}=={package.version}",
                filename=package.filename,
                sha256=package.sha256,
                reason="; ".join(reasons),
            )
        )

    # ------------------------------------------------------------------ installing

    async def _install(self, key: str, print_: str, lock: Lock, artifacts: list[Path]) -> None:
        # Staging, committing (a read-only walk of every file) and cleaning up are filesystem
        # work: off the event loop, so other handlers and the in-progress heartbeats keep going.
        staging = await to_thread_to_the_end(self.store.new_staging, key)
        try:
            site = staging / SITE_PACKAGES
            site.mkdir()
            if artifacts:  # an empty spec is a valid, empty environment
                await self._run_installer(key, lock, artifacts, site)
            (site / ".lock").unlink(missing_ok=True)  # uv's lock of the target dir, not ours
            manifest = self._manifest(key, print_, lock)
            # A cancelled attempt (its timeout, a stop) lets the commit end before its staging
            # tree is removed: never a tree removed while it is walked and renamed into place.
            await to_thread_to_the_end(self.store.commit, staging, key, manifest)
        except BaseException:
            await asyncio.shield(asyncio.to_thread(remove_tree, staging))
            raise

    async def _run_installer(self, key: str, lock: Lock, artifacts: list[Path], site: Path) -> None:
        run = await self.uv.install(
            artifacts, site, self.python, allow_index=any(p.kind == "sdist" for p in lock.packages)
        )
        if run.returncode != 0:
            detail = redact_text(run.stderr.strip())
            raise InstallError(f"installing environment {key[:16]} failed: {detail}")

    def _manifest(self, key: str, print_: str, lock: Lock) -> dict[str, object]:
        return {
            "lock_hash": key,
            "fingerprint": print_,
            "target": lock.target.model_dump(),
            "python": str(self.python),
            "built_at": time.time(),
            "packages": [
                {"name": p.name, "version": p.version, "sha256": p.sha256, "filename": p.filename}
                for p in lock.packages
            ],
        }
