"""Where artifacts come from: the node-local cache, the cluster cache in S3 and the index.

Every tier writes into a staging file while hashing it; only bytes whose sha256 matches the
lock are admitted to the node-local cache, so a tampered object can never be installed.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from minio import Minio
from minio.error import S3Error
from urllib3.exceptions import HTTPError as Urllib3Error

from dsec_builder.domain import redact_text, redact_url
from dsec_builder.models import LockedPackage

_CHUNK = 1 << 20


@dataclass(frozen=True)
class Digest:
    """sha256 and size of bytes written to a file."""

    sha256: str
    size: int


def sha256_file(path: Path) -> Digest:
    """Hash a file (hashlib releases the GIL, so callers run this in a worker thread)."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return Digest(digest.hexdigest(), size)


class LocalCache:
    """The node-local wheel cache: ``<root>/<sha256>/<filename>``, written only once verified.

    The filename is kept because installers read a wheel's tags from it.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._incoming = root / ".incoming"

    def path(self, package: LockedPackage) -> Path:
        """Where ``package``'s verified artifact lives (or would live)."""
        return self.root / package.sha256 / package.filename

    def staging_file(self) -> Path:
        """A fresh file path on the cache's filesystem, for a download in progress."""
        self._incoming.mkdir(parents=True, exist_ok=True)
        return self._incoming / uuid.uuid4().hex

    def sweep(self, older_than_s: float) -> int:
        """Remove downloads left in progress longer than ``older_than_s`` (a builder killed
        mid-download); returns how many. Younger ones may be another builder's, at work."""
        return sweep_files(self._incoming, "*", older_than_s)

    def admit(self, staged: Path, package: LockedPackage) -> Path:
        """Move a verified staging file into place (atomic; concurrent admits are harmless)."""
        final = self.path(package)
        final.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(staged, 0o444)
        os.replace(staged, final)
        return final

    def evict(self, package: LockedPackage) -> None:
        """Remove a cached artifact (after it failed verification)."""
        self.path(package).unlink(missing_ok=True)


class ClusterCacheError(Exception):
    """The S3 cluster cache could not be reached or refused the request."""


class S3WheelCache:
    """The cluster-wide artifact cache: objects ``wheels/sha256/<hex>`` in one S3 bucket.

    Methods are blocking (the ``minio`` SDK); the builder calls them in worker threads.
    """

    def __init__(self, client: Minio, bucket: str, prefix: str = "wheels/sha256/") -> None:
        self.client = client
        self.bucket = bucket
        self.prefix = prefix

    def key(self, sha256: str) -> str:
        """The object key of an artifact."""
        return f"{self.prefix}{sha256}"

    def download(self, sha256: str, dest: Path) -> Digest | None:
        """Copy the object for ``sha256`` into ``dest``; ``None`` when it is not cached.

        The returned digest is of the bytes received: the caller compares it with the lock.
        """
        try:
            response = self.client.get_object(self.bucket, self.key(sha256))
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject"):
                return None
            raise ClusterCacheError(f"s3://{self.bucket}/{self.key(sha256)}: {exc.code}") from None
        except (Urllib3Error, OSError) as exc:
            raise ClusterCacheError(f"cluster cache unreachable: {type(exc).__name__}") from None
        digest = hashlib.sha256()
        size = 0
        try:
            with dest.open("wb") as handle:
                for chunk in response.stream(_CHUNK):
                    digest.update(chunk)
                    handle.write(chunk)
                    size += len(chunk)
        except (Urllib3Error, OSError) as exc:
            raise ClusterCacheError(f"cluster cache read failed: {type(exc).__name__}") from None
        finally:
            response.close()
            response.release_conn()
        return Digest(digest.hexdigest(), size)

    def upload(self, path: Path, sha256: str) -> None:
        """Store a verified artifact under its content address."""
        try:
            self.client.fput_object(self.bucket, self.key(sha256), str(path))
        except (S3Error, Urllib3Error, OSError) as exc:
            raise ClusterCacheError(f"cluster cache write failed: {type(exc).__name__}") from None


class IndexUnavailableError(Exception):
    """The package index could not serve an artifact."""


class IndexFetcher:
    """Downloads artifacts from the package index over HTTP(S)."""

    def __init__(self, connect_timeout_s: float = 10.0, total_timeout_s: float = 600.0) -> None:
        self._timeout = aiohttp.ClientTimeout(total=total_timeout_s, sock_connect=connect_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    async def download(self, url: str, dest: Path) -> Digest:
        """Stream ``url`` into ``dest`` while hashing it.

        Raises:
            IndexUnavailableError: connection failed or the index answered with an error.
        """
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self._timeout)
        digest = hashlib.sha256()
        size = 0
        try:
            async with self._session.get(url) as response:
                if response.status != 200:
                    raise IndexUnavailableError(
                        f"{redact_url(url)} answered HTTP {response.status}"
                    )
                with dest.open("wb") as handle:
                    async for chunk in response.content.iter_chunked(_CHUNK):
                        digest.update(chunk)
                        handle.write(chunk)
                        size += len(chunk)
        except (aiohttp.ClientError, TimeoutError) as exc:
            reason = redact_text(str(exc) or type(exc).__name__)
            raise IndexUnavailableError(f"{redact_url(url)} unreachable: {reason}") from None
        return Digest(digest.hexdigest(), size)

    async def close(self) -> None:
        """Close the HTTP connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None


def sweep_files(directory: Path, pattern: str, older_than_s: float) -> int:
    """Remove the files matching ``pattern`` in ``directory`` not modified for
    ``older_than_s``; returns how many (a file gone meanwhile is not counted)."""
    if not directory.is_dir():
        return 0
    limit = time.time() - older_than_s
    removed = 0
    for path in directory.glob(pattern):
        try:
            if path.is_file() and path.stat().st_mtime < limit:
                path.unlink()
                removed += 1
        except FileNotFoundError:
            continue
    return removed
