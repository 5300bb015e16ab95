"""The node's environment store: ``<root>/<lock hash>/`` directories, immutable once built.

Layout under ``root`` (``$DSEC_HOME/envs``)::

    <lock hash>/site-packages/   the environment (put on PYTHONPATH)
    <lock hash>/env.json         what it holds (lock hash, fingerprint, packages)
    .staging/<hash>.<random>/    builds in progress; renamed into place when complete
    .locks/<hash>.lock           flock: one build per lock hash across processes
    .used/<hash>                 mtime = last build or reuse, for ``gc --keep``

A build is staged next to the store and renamed in one step, so a crash leaves only a
staging directory (never a half environment under its hash), removed by the next build of
that hash or by ``gc``.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import shutil
import stat
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

from dsec_builder.models import EnvironmentInfo

ENV_MANIFEST = "env.json"
_LOCK_POLL_S = 0.02
SITE_PACKAGES = "site-packages"


class EnvironmentStore:
    """Content-addressed environments on one node."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._staging = root / ".staging"
        self._locks = root / ".locks"
        self._used = root / ".used"

    def env_dir(self, lock_hash: str) -> Path:
        """The directory of the environment for ``lock_hash``."""
        return self.root / lock_hash

    def site_packages(self, lock_hash: str) -> Path:
        """The path a sandbox puts on ``PYTHONPATH``."""
        return self.env_dir(lock_hash) / SITE_PACKAGES

    def exists(self, lock_hash: str) -> bool:
        """True when a complete environment for ``lock_hash`` is in place."""
        return (self.env_dir(lock_hash) / ENV_MANIFEST).is_file()

    def touch(self, lock_hash: str) -> None:
        """Record a use of the environment (for ``gc --keep``)."""
        self._used.mkdir(parents=True, exist_ok=True)
        stamp = self._used / lock_hash
        stamp.touch()
        now = time.time_ns()  # explicit: utime(NULL) uses the coarse clock, ties reorder gc
        os.utime(stamp, ns=(now, now))

    @contextlib.asynccontextmanager
    async def build_lock(self, lock_hash: str) -> AsyncIterator[None]:
        """Hold the build lock of ``lock_hash`` (waits while another process builds it)."""
        self._locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._locks / f"{lock_hash}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            # Polled rather than a blocking flock in a thread: a cancelled waiter must not
            # leave a thread behind that later takes the lock on a closed descriptor.
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    await asyncio.sleep(_LOCK_POLL_S)
            yield
        finally:
            os.close(fd)  # closing the descriptor releases the lock

    @contextlib.contextmanager
    def _try_lock(self, lock_hash: str) -> Iterator[bool]:
        self._locks.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._locks / f"{lock_hash}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)

    def new_staging(self, lock_hash: str) -> Path:
        """A fresh staging directory for a build of ``lock_hash`` (call under its lock)."""
        for stale in self._staging.glob(f"{lock_hash}.*"):
            remove_tree(stale)  # a crashed build's leftovers; we hold the lock, nobody uses it
        path = self._staging / f"{lock_hash}.{uuid.uuid4().hex[:8]}"
        path.mkdir(parents=True)
        return path

    def commit(self, staging: Path, lock_hash: str, manifest: dict[str, Any]) -> Path:
        """Seal a staged build (read-only) and move it into place atomically."""
        (staging / ENV_MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        make_read_only(staging)
        final = self.env_dir(lock_hash)
        os.rename(staging, final)
        self.touch(lock_hash)
        return final

    def manifest(self, lock_hash: str) -> dict[str, Any]:
        """The ``env.json`` of a stored environment."""
        data: dict[str, Any] = json.loads((self.env_dir(lock_hash) / ENV_MANIFEST).read_text())
        return data

    def environments(self) -> list[EnvironmentInfo]:
        """Every complete environment, most recently used first."""
        infos: list[EnvironmentInfo] = []
        if not self.root.is_dir():
            return infos
        for entry in self.root.iterdir():
            if entry.name.startswith(".") or not self.exists(entry.name):
                continue
            manifest = self.manifest(entry.name)
            created = (entry / ENV_MANIFEST).stat().st_mtime
            stamp = self._used / entry.name
            infos.append(
                EnvironmentInfo(
                    lock_hash=entry.name,
                    fingerprint=str(manifest.get("fingerprint", "")),
                    path=entry / SITE_PACKAGES,
                    packages=len(manifest.get("packages", [])),
                    size_bytes=tree_size(entry),
                    created_at=created,
                    last_used_at=stamp.stat().st_mtime if stamp.exists() else created,
                )
            )
        return sorted(infos, key=lambda info: info.last_used_at, reverse=True)

    def gc(self, keep: int, dry_run: bool = False) -> list[EnvironmentInfo]:
        """Remove all but the ``keep`` most recently used environments, and crashed builds.

        Environments whose lock is held (being built or removed elsewhere) are skipped.

        Returns:
            The environments removed (or that would be, with ``dry_run``).
        """
        if keep < 0:
            raise ValueError(f"--keep must be 0 or more, got {keep}")
        victims = self.environments()[keep:]
        removed: list[EnvironmentInfo] = []
        for info in victims:
            with self._try_lock(info.lock_hash) as locked:
                if not locked:
                    continue
                if not dry_run:
                    remove_tree(self.env_dir(info.lock_hash))
                    (self._used / info.lock_hash).unlink(missing_ok=True)
                removed.append(info)
        if not dry_run:
            self._remove_crashed_builds()
        return removed

    def _remove_crashed_builds(self) -> None:
        if not self._staging.is_dir():
            return
        for staging in self._staging.iterdir():
            with self._try_lock(staging.name.split(".", 1)[0]) as locked:
                if locked:
                    remove_tree(staging)


def make_read_only(root: Path) -> None:
    """Drop every write bit under ``root`` (files keep their execute bits)."""
    for directory, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            path = os.path.join(directory, name)
            mode = os.lstat(path).st_mode
            if stat.S_ISREG(mode) and mode & 0o222:
                os.chmod(path, stat.S_IMODE(mode) & ~0o222)
        os.chmod(directory, 0o555)


def remove_tree(root: Path) -> None:
    """Delete a (possibly read-only) tree."""
    if not root.exists():
        return
    for directory, _dirs, _files in os.walk(root):
        os.chmod(directory, 0o755)
    shutil.rmtree(root)


def tree_size(root: Path) -> int:
    """Apparent size in bytes of the regular files under ``root``."""
    total = 0
    for directory, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(directory, name)).st_size
    return total
