"""The S3 object store as every DSec process reaches it (the ``minio`` SDK).

Works unchanged against SeaweedFS (the embedded stack), MinIO and AWS S3. The SDK is
synchronous: async callers go through :func:`get_bytes` / :func:`put_bytes`, which run it in a
worker thread so the event loop never blocks on the network.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, TypeVar, cast

import blake3
from minio import Minio
from minio.error import S3Error

from dsec_core.settings import Settings

T = TypeVar("T")


class ObjectStoreNotConfigured(RuntimeError):
    """No S3 endpoint in the settings nor in the stack state."""


class ObjectMissing(LookupError):
    """The named object does not exist."""


def client(settings: Settings) -> Minio:
    """A client for the configured store (endpoint from settings or ``stack.json``)."""
    endpoint = settings.endpoint("s3_endpoint")
    if not endpoint:
        raise ObjectStoreNotConfigured("no object store: run `dsec up` or set DSEC_S3_ENDPOINT")
    return Minio(
        str(endpoint),
        access_key=settings.endpoint("s3_access_key"),
        secret_key=settings.endpoint("s3_secret_key"),
        secure=settings.s3_secure,
    )


_SHARED: dict[tuple[str, str | None, bytes, bool], Minio] = {}
_SHARED_LOCK = threading.Lock()
_SHARED_MAX = 8  # endpoints (or key pairs) one process reaches: a stack moved by `dsec up` adds one


def shared_client(settings: Settings) -> Minio:
    """One client per store and key pair for the whole process, so repeated reads reuse its
    connection pool (a :func:`client` per call opened new connections each time). The minio
    client is thread-safe; the key is held only as its BLAKE3, never as text in the cache."""
    endpoint = settings.endpoint("s3_endpoint")
    if not endpoint:
        raise ObjectStoreNotConfigured("no object store: run `dsec up` or set DSEC_S3_ENDPOINT")
    secret = settings.endpoint("s3_secret_key") or ""
    key = (
        str(endpoint), settings.endpoint("s3_access_key"),
        blake3.blake3(secret.encode()).digest(), bool(settings.s3_secure),
    )  # fmt: skip
    with _SHARED_LOCK:
        store = _SHARED.get(key)
        if store is None:
            if len(_SHARED) >= _SHARED_MAX:
                _SHARED.pop(next(iter(_SHARED)))  # the oldest: its pool closes when unreferenced
            store = _SHARED[key] = client(settings)
        return store


def ensure_bucket(store: Minio, bucket: str) -> None:
    """Create ``bucket`` when missing (tolerates a concurrent creator)."""
    if store.bucket_exists(bucket):
        return
    try:
        store.make_bucket(bucket)
    except S3Error as exc:
        if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
            raise


def _open(store: Minio, bucket: str, key: str) -> Any:
    """The object's response (close and release it), or :class:`ObjectMissing`."""
    try:
        return store.get_object(bucket, key)
    except S3Error as exc:
        if exc.code in ("NoSuchKey", "NoSuchBucket"):
            raise ObjectMissing(f"s3://{bucket}/{key} does not exist") from None
        raise


def _get(store: Minio, bucket: str, key: str) -> bytes:
    response = _open(store, bucket, key)
    try:
        return bytes(response.read())
    finally:
        response.close()
        response.release_conn()


async def get_bytes(store: Minio, bucket: str, key: str) -> bytes:
    """Read a whole object without blocking the event loop."""
    return await asyncio.to_thread(_get, store, bucket, key)


async def put_bytes(store: Minio, bucket: str, key: str, data: bytes) -> None:
    """Write a whole object without blocking the event loop."""
    await asyncio.to_thread(store.put_object, bucket, key, io.BytesIO(data), len(data))


ENV_ARCHIVES = "envs/"
_LOCK_HASH = re.compile(r"^[A-Za-z0-9]{8,128}\Z")


def env_archive_key(lock_hash: str) -> str:
    """The system bucket's key of a lock's environment archive: ``envs/<lock_hash>.tar.zst``.

    Raises:
        ValueError: ``lock_hash`` is not 8-128 letters and digits.
    """
    if not _LOCK_HASH.match(lock_hash):
        raise ValueError(f"lock hash {lock_hash!r} must match {_LOCK_HASH.pattern}")
    return f"{ENV_ARCHIVES}{lock_hash}.tar.zst"


@dataclass(frozen=True)
class ObjectInfo:
    """What a stat of an object says: its size and its user metadata (lower-case keys)."""

    size: int
    metadata: dict[str, str]


def stat_object(store: Minio, bucket: str, key: str) -> ObjectInfo | None:
    """Size and user metadata of an object; ``None`` when it does not exist (blocking)."""
    try:
        found = store.stat_object(bucket, key)
    except S3Error as exc:
        if exc.code in ("NoSuchKey", "NoSuchObject", "NoSuchBucket", "ResourceNotFound"):
            return None
        raise
    prefix = "x-amz-meta-"
    meta = {
        k.lower().removeprefix(prefix): str(v)
        for k, v in (found.metadata or {}).items()
        if k.lower().startswith(prefix)
    }
    return ObjectInfo(int(found.size or 0), meta)


def download_file(store: Minio, bucket: str, key: str, dest: Path, max_bytes: int) -> int:
    """Copy an object into ``dest`` (blocking), refusing more than ``max_bytes``.

    Raises:
        ObjectMissing: the object does not exist.
        ValueError: the object is larger than ``max_bytes``.
    """
    response = _open(store, bucket, key)
    size = 0
    try:
        with dest.open("wb") as fh:
            for chunk in response.stream(1 << 20):
                size += len(chunk)
                if size > max_bytes:
                    raise ValueError(f"s3://{bucket}/{key} is larger than {max_bytes} bytes")
                fh.write(chunk)
    finally:
        response.close()
        response.release_conn()
    return size


class BundleAltered(ValueError):
    """A code bundle's bytes do not match the digest its event recorded."""


class BundleTooLarge(BundleAltered):
    """A stored code bundle larger than its spec lets a bundle be
    (:func:`dsec_core.codebundle.archive_bound`): never read past that bound."""


class _CheckedReader(io.RawIOBase):
    """An object's bytes as they arrive, hashed and counted: never more than ``max_bytes``."""

    def __init__(self, response: Any, key: str, max_bytes: int) -> None:
        self._response = response
        self._key = key
        self._max_bytes = max_bytes
        self.hasher = blake3.blake3()
        self.size = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._response.read(min(len(buffer), 1 << 20))
        self.size += len(data)
        if self.size > self._max_bytes:  # replaced since the stat
            raise BundleTooLarge(f"code bundle {self._key} is larger than {self._max_bytes} bytes")
        self.hasher.update(data)
        buffer[: len(data)] = data
        return len(data)

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def scan_bundle(
    settings: Settings, object_key: str, digest: str, consume: Callable[[BinaryIO], T],
    *, max_bytes: int,
) -> T:  # fmt: skip
    """``consume(stream)`` over a code bundle's bytes as they come from the store (blocking:
    nothing is written to disk and memory holds a chunk), then the rest of the object read and
    the whole checked against its BLAKE3 ``digest``: ``consume``'s result is returned only if
    the bytes were the bundle's. At most ``max_bytes`` are read, the store's size checked
    first, so a huge object costs one request, not its bytes.

    Raises: as :func:`get_bundle`, and whatever ``consume`` raises (for bytes that may not be
    the bundle's: a caller refuses either way).
    """
    store = shared_client(settings)
    bucket = settings.s3_bucket
    info = stat_object(store, bucket, object_key)
    if info is None:
        raise ObjectMissing(f"s3://{bucket}/{object_key} does not exist")
    if info.size > max_bytes:
        raise BundleTooLarge(
            f"code bundle {object_key} is larger than {max_bytes} bytes, the most a bundle of "
            "its spec's include_code.max_size may take"
        )
    response = _open(store, bucket, object_key)
    try:
        reader = _CheckedReader(response, object_key, max_bytes)
        result = consume(cast(BinaryIO, io.BufferedReader(reader, 1 << 20)))
        reader.drain()
    finally:
        response.close()
        response.release_conn()
    if reader.hasher.hexdigest() != digest:
        raise BundleAltered(
            f"code bundle {object_key} does not match its digest {digest[:16]}… "
            "(altered in the object store?)"
        )
    return result


async def get_bundle(settings: Settings, object_key: str, digest: str, *, max_bytes: int) -> bytes:
    """Read a content-addressed code bundle of at most ``max_bytes`` and check it against its
    BLAKE3 ``digest`` (in memory: :func:`fetch_bundle` streams it to a file instead).

    Raises:
        ObjectMissing: the bundle is not in the store.
        BundleTooLarge: it is larger than ``max_bytes`` (nothing past the bound is read).
        BundleAltered: its bytes are not the ones that were submitted.
    """
    data = await asyncio.to_thread(
        scan_bundle, settings, object_key, digest, lambda stream: stream.read(),
        max_bytes=max_bytes,
    )  # fmt: skip
    return bytes(data)


async def fetch_bundle(
    settings: Settings, object_key: str, digest: str, dest: Path, *, max_bytes: int
) -> None:
    """Stream a code bundle of at most ``max_bytes`` into the file ``dest``, checked against its
    BLAKE3 ``digest`` as it comes (memory stays a chunk). It is written under a name of this
    attempt's own and renamed to ``dest`` only when whole and wanted: a failed or cancelled
    fetch leaves nothing, and never touches another attempt's ``dest``.

    Raises: as :func:`get_bundle`.
    """

    part = dest.with_name(f"{dest.name}.{uuid.uuid4().hex[:12]}.part")  # this attempt's own
    gone = threading.Event()

    def fetch() -> None:
        try:
            with part.open("wb") as fh:
                scan_bundle(
                    settings, object_key, digest, lambda stream: shutil.copyfileobj(stream, fh),
                    max_bytes=max_bytes,
                )  # fmt: skip
            if not gone.is_set():  # a caller that gave up must not replace a retry's file
                os.replace(part, dest)
        finally:
            part.unlink(missing_ok=True)

    running = asyncio.ensure_future(asyncio.to_thread(fetch))
    try:
        await asyncio.shield(running)
    except asyncio.CancelledError:
        gone.set()  # the thread runs on: it removes its own part and leaves dest alone

        def retrieved(done: asyncio.Future[None]) -> None:
            if not done.cancelled():
                done.exception()  # the caller that wanted it has gone

        running.add_done_callback(retrieved)
        raise
