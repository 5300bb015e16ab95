"""``s3://bucket/prefix/`` mounts: objects materialized into a per-sandbox directory.

With ``cache_ttl`` the objects go through a node-local cache (``DSEC_HOME/cache/s3``): within
the TTL the cache is used without asking S3; after it, the listing is re-read and only objects
whose ETag changed are fetched again. Each sandbox gets hard links into the cache, so a later
refresh (which writes new files and renames them into place) never changes what a running
sandbox sees. Without ``cache_ttl`` objects are fetched straight into the sandbox's directory.

For ``ro-encrypted`` the cache holds *decrypted* objects (root-only, mode 0700): the sandbox
reads plaintext anyway, and decrypting on every start would cost a Vault round trip per object.
The cache TTL bounds how long plaintext outlives a revoked data key on a node.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import blake3
import minio
import minio.error
import urllib3.exceptions

from dsec_nodeagent.context import crypto
from dsec_nodeagent.context.models import ContextError

FETCH_PARALLEL = 8
"""Objects of one mount fetched at once (within the S3 client's pool of 10 connections)."""

Unwrap = Callable[[str, str], bytes]


@dataclass(frozen=True)
class Materialized:
    """A materialized mount: its directory, content digest, size and whether the cache served it.

    The digest is BLAKE3 over the sorted ``(relative path, file BLAKE3)`` pairs.
    """

    directory: Path
    digest: str
    bytes: int
    files: int
    cache_hit: bool


def s3_uri(bucket: str, prefix: str) -> str:
    """The reference as users write it."""
    return f"s3://{bucket}/{prefix}"


class S3Materializer:
    """Fetches prefixes with the MinIO SDK.

    Args:
        client: a configured :class:`minio.Minio`.
        cache_dir: node-local cache root.
        unwrap: ``(kek, wrapped_key) -> data key`` for ``ro-encrypted`` objects.
    """

    def __init__(self, client: minio.Minio, cache_dir: Path, unwrap: Unwrap | None = None) -> None:
        self.client = client
        self.cache_dir = cache_dir
        self.unwrap = unwrap
        # one refresh of a cache entry at a time: launches run at once (each in a thread),
        # and two sandboxes may mount the same prefix
        self._entries: dict[Path, threading.Lock] = {}
        self._entries_lock = threading.Lock()

    async def materialize(
        self,
        bucket: str,
        prefix: str,
        dest: Path,
        *,
        encrypted: bool,
        cache_ttl_s: float | None,
    ) -> Materialized:
        """Fill ``dest`` (created, must not exist) with the objects under ``prefix``.

        Raises:
            ContextError: bucket or prefix missing/empty, access denied, or decryption failed.
        """
        return await asyncio.to_thread(
            self._materialize, bucket, prefix, dest, encrypted, cache_ttl_s
        )

    def _materialize(
        self, bucket: str, prefix: str, dest: Path, encrypted: bool, cache_ttl_s: float | None
    ) -> Materialized:
        uri = s3_uri(bucket, prefix)
        if encrypted and self.unwrap is None:
            raise ContextError(uri, "ro-encrypted needs Vault (for data keys); none configured")
        if cache_ttl_s is None:
            listing = self._list(uri, bucket, prefix)
            dest.mkdir(parents=True, mode=0o755)
            self._fetch_all(uri, bucket, prefix, list(listing), dest, encrypted)
            return _summarize(dest, cache_hit=False)
        entry = (
            self.cache_dir
            / blake3.blake3(f"{bucket}\0{prefix}\0{encrypted}".encode()).hexdigest()[:32]
        )
        with self._entries_lock:
            lock = self._entries.setdefault(entry, threading.Lock())
        with lock:
            hit = self._refresh(uri, bucket, prefix, entry, encrypted, cache_ttl_s)
            _link_tree(entry / "files", dest)
        return _summarize(dest, cache_hit=hit)

    def _list(self, uri: str, bucket: str, prefix: str) -> dict[str, str]:
        try:
            objects = {
                obj.object_name[len(prefix) :]: str(obj.etag)
                for obj in self.client.list_objects(bucket, prefix=prefix, recursive=True)
                if obj.object_name and not obj.is_dir
            }
        except minio.error.S3Error as exc:
            raise ContextError(uri, _s3_reason(exc)) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise ContextError(uri, f"object store unreachable: {exc}", transient=True) from exc
        for name in objects:
            if not _safe_relative(name):
                raise ContextError(uri, f"object name {name!r} escapes the mount; rename it")
        if not objects:
            raise ContextError(uri, "no objects under this prefix (missing or empty)")
        return objects

    def _fetch_all(
        self, uri: str, bucket: str, prefix: str, names: list[str], dest: Path, encrypted: bool
    ) -> None:
        """Fetch ``names`` (relative to ``prefix``) into ``dest``, up to ``FETCH_PARALLEL`` at a
        time (one object store round trip no longer waits for the previous one); the first
        failure is raised once the others have stopped."""
        if len(names) <= 1:
            for name in names:
                self._fetch(uri, bucket, prefix + name, dest / name, encrypted)
            return
        with ThreadPoolExecutor(min(FETCH_PARALLEL, len(names)), "s3-mount") as pool:
            futures = [
                pool.submit(self._fetch, uri, bucket, prefix + name, dest / name, encrypted)
                for name in names
            ]
            wait(futures, return_when=FIRST_EXCEPTION)
            for future in futures:
                future.cancel()
        for future in futures:
            error = None if future.cancelled() else future.exception()
            if error is not None:
                raise error

    def _fetch(self, uri: str, bucket: str, key: str, target: Path, encrypted: bool) -> None:
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
        tmp = target.with_name(f".{target.name}.part")
        try:
            response = self.client.get_object(bucket, key)
            try:
                if encrypted:  # sealed as one message: opened whole
                    data = response.read()
                else:  # streamed to the file, never whole in memory
                    with open(tmp, "wb") as out:
                        for chunk in response.stream(1 << 20):
                            out.write(chunk)
            finally:
                response.close()
                response.release_conn()
        except minio.error.S3Error as exc:
            tmp.unlink(missing_ok=True)
            raise ContextError(f"s3://{bucket}/{key}", _s3_reason(exc)) from exc
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if encrypted:
            assert self.unwrap is not None
            try:
                data = crypto.open_sealed(data, self.unwrap)
            except crypto.DecryptionError as exc:
                raise ContextError(f"s3://{bucket}/{key}", f"cannot decrypt: {exc}") from exc
            tmp.write_bytes(data)
        os.chmod(tmp, 0o644)
        tmp.replace(target)

    def _refresh(
        self, uri: str, bucket: str, prefix: str, entry: Path, encrypted: bool, ttl_s: float
    ) -> bool:
        """Bring the cache entry up to date; True when it was fresh enough to skip S3."""
        manifest_path = entry / "manifest.json"
        manifest: dict[str, Any] = {}
        if manifest_path.exists():
            manifest = json.loads(manifest_path.read_text())
            if time.time() - manifest["fetched_at"] < ttl_s:
                return True
        listing = self._list(uri, bucket, prefix)
        entry.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(entry, 0o700)
        files = entry / "files"
        cached: dict[str, str] = manifest.get("etags", {})
        stale = [
            name
            for name, etag in listing.items()
            if cached.get(name) != etag or not (files / name).exists()
        ]
        self._fetch_all(uri, bucket, prefix, stale, files, encrypted)
        for name in set(cached) - set(listing):
            (files / name).unlink(missing_ok=True)
        tmp = entry / ".manifest.tmp"
        tmp.write_text(json.dumps({"fetched_at": time.time(), "etags": listing}))
        tmp.replace(manifest_path)
        return False


def _s3_reason(exc: minio.error.S3Error) -> str:
    reasons = {
        "NoSuchBucket": "bucket does not exist",
        "NoSuchKey": "object does not exist",
        "AccessDenied": "access denied for the node agent's S3 credentials",
        "InvalidAccessKeyId": "the node agent's S3 access key is not known to the object store",
        "SignatureDoesNotMatch": "the node agent's S3 secret key is wrong",
    }
    return reasons.get(exc.code or "", f"object store error {exc.code}")


def _safe_relative(name: str) -> bool:
    path = PurePosixPath(name)
    return bool(name) and not path.is_absolute() and ".." not in path.parts


def _link_tree(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, mode=0o755)
    for root, dirs, files in os.walk(src):
        rel = Path(root).relative_to(src)
        for d in dirs:
            (dest / rel / d).mkdir(mode=0o755, exist_ok=True)
        for f in files:
            try:
                os.link(Path(root) / f, dest / rel / f)
            except OSError:  # another filesystem: copy instead
                shutil.copy2(Path(root) / f, dest / rel / f)


def _summarize(directory: Path, *, cache_hit: bool) -> Materialized:
    entries = []
    size = 0
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        data = path.read_bytes()
        size += len(data)
        entries.append(f"{path.relative_to(directory)}\0{blake3.blake3(data).hexdigest()}")
    digest = blake3.blake3("\n".join(entries).encode()).hexdigest()
    return Materialized(directory, digest, size, len(entries), cache_hit)
