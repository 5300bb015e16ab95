"""S3 object store (SeaweedFS, MinIO, AWS) through the ``minio`` client; thread-safe."""

from __future__ import annotations

import io
import threading
from collections.abc import Collection, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

import urllib3
from minio import Minio
from minio.credentials.credentials import Credentials
from minio.deleteobjects import DeleteObject
from minio.error import MinioException, S3Error
from minio.helpers import DictType

from dsec_snapstore.errors import StoreUnavailable

_HEAD_LIMIT = 256
"""Above this many keys, one paginated LIST is cheaper than a HEAD per key."""


class ObjectMissing(KeyError):
    """The object does not exist."""


class ObjectExists(KeyError):
    """The object exists already (a write asked to create it only)."""


@dataclass(frozen=True)
class ObjectInfo:
    """Size and modification time of a stored object."""

    size: int
    last_modified: datetime


class ObjectStore(Protocol):
    """What the snapshot library needs from an object store."""

    @property
    def identity(self) -> str:
        """A stable name of the store (endpoint and bucket) for local caches."""
        ...

    def put(
        self, key: str, data: bytes, *, checked_on_read: bool = False, if_absent: bool = False
    ) -> None:
        """Store ``data`` at ``key``.

        ``checked_on_read``: every reader checks these bytes itself (content-addressed or
        signed), so the store need not protect them in transit on its own. ``if_absent``:
        only create it, atomically (raises :class:`ObjectExists` when it exists).
        """
        ...

    def get(self, key: str) -> bytes:
        """Return the object at ``key`` (raises ObjectMissing)."""
        ...

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """``length`` bytes of the object at ``key`` from ``offset`` (raises ObjectMissing)."""
        ...

    def exists(self, key: str) -> bool:
        """True when ``key`` exists."""
        ...

    def present(self, keys: Collection[str], prefix: str, pool: Executor) -> set[str]:
        """Return the subset of ``keys`` (all under ``prefix``) that exist, in one batch."""
        ...

    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        """Every object under ``prefix``."""
        ...

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` (missing ones are ignored)."""
        ...


_put_options = threading.local()
"""The options of the PUT this thread is making (see :class:`_Minio`): ``unsigned``,
``if_absent``."""
_MAX_SINGLE_PUT = 5 << 30
"""S3's largest single PUT: an ``if_absent`` write is one request up to it (a multipart
upload's parts would each carry the condition)."""


class _Minio(Minio):
    """A client that leaves the payload of a PUT unsigned while :data:`_put_options` says so
    (and adds ``If-None-Match: *`` to a create-only one).

    SigV4 over plain HTTP signs a SHA-256 of the body: the client hashes every byte it sends
    and the server hashes them again to compare (over TLS the client sends ``UNSIGNED-PAYLOAD``
    already). For packs and index documents that second hash protects nothing: their key is
    their BLAKE3 and each reader checks it (every chunk, every document), so they are sent as
    over TLS. The request itself (method, key, headers, time) stays signed.
    """

    def _build_headers(
        self,
        host: str,
        headers: DictType | None = None,
        body: bytes | None = None,
        creds: Credentials | None = None,
    ) -> tuple[DictType, datetime]:
        if not body or creds is None or not getattr(_put_options, "unsigned", False):
            out, date = super()._build_headers(host, headers, body, creds)
        else:
            out, date = super()._build_headers(host, headers, None, creds)
            out["Content-Length"] = str(len(body))
            out["x-amz-content-sha256"] = "UNSIGNED-PAYLOAD"
        if body is not None and getattr(_put_options, "if_absent", False):
            out["If-None-Match"] = "*"  # (signed with the rest) create only: 412 if it exists
        return out, date


class S3ObjectStore:
    """An :class:`ObjectStore` on one S3 bucket (created on first use), under ``prefix``."""

    def __init__(
        self,
        endpoint: str,
        access_key: str | None,
        secret_key: str | None,
        bucket: str,
        *,
        secure: bool = False,
        prefix: str = "",
        pool_size: int = 32,
    ) -> None:
        http = urllib3.PoolManager(
            maxsize=pool_size,
            timeout=urllib3.Timeout(connect=3.0, read=60.0),
            retries=urllib3.Retry(total=3, backoff_factor=0.1, status_forcelist=(500, 502, 503)),
        )
        self._client = _Minio(
            endpoint, access_key=access_key, secret_key=secret_key, secure=secure, http_client=http
        )
        self._endpoint = endpoint
        self.bucket = bucket
        self.prefix = prefix
        self._bucket_checked = False

    @property
    def identity(self) -> str:
        """``endpoint/bucket/prefix``."""
        return f"{self._endpoint}/{self.bucket}/{self.prefix}"

    def _unavailable(self, exc: Exception) -> StoreUnavailable:
        return StoreUnavailable(
            f"S3 at {self._endpoint} (bucket {self.bucket}) failed: {type(exc).__name__}: {exc}"
        )

    def ensure_bucket(self) -> None:
        """Create the bucket when it does not exist."""
        if self._bucket_checked:
            return
        try:
            if not self._client.bucket_exists(self.bucket):
                self._client.make_bucket(self.bucket)
        except S3Error as exc:
            if exc.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                raise self._unavailable(exc) from exc
        except (MinioException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._unavailable(exc) from exc
        self._bucket_checked = True

    def put(
        self, key: str, data: bytes, *, checked_on_read: bool = False, if_absent: bool = False
    ) -> None:
        """Store ``data`` at ``key``; ``checked_on_read``: sent with ``UNSIGNED-PAYLOAD`` (see
        :class:`_Minio`); ``if_absent``: with ``If-None-Match: *`` (S3's conditional write;
        SeaweedFS, MinIO and AWS honour it), in one request.

        Raises:
            ObjectExists: ``if_absent`` and the key exists.
            StoreUnavailable: S3 failed.
        """
        self.ensure_bucket()
        _put_options.unsigned = checked_on_read
        _put_options.if_absent = if_absent
        try:
            self._client.put_object(
                self.bucket,
                self.prefix + key,
                io.BytesIO(data),
                len(data),
                part_size=_MAX_SINGLE_PUT if if_absent else 0,
            )
        except S3Error as exc:
            if if_absent and exc.code == "PreconditionFailed":
                raise ObjectExists(key) from None
            raise self._unavailable(exc) from exc
        except (MinioException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._unavailable(exc) from exc
        finally:
            _put_options.unsigned = _put_options.if_absent = False

    def get(self, key: str) -> bytes:
        """Return the object at ``key``."""
        return self.get_range(key, 0, 0)

    def get_range(self, key: str, offset: int, length: int) -> bytes:
        """Return ``length`` bytes from ``offset`` (``length=0``: to the end), one ranged GET."""
        self.ensure_bucket()
        try:
            response = self._client.get_object(
                self.bucket, self.prefix + key, offset=offset, length=length
            )
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject"):
                raise ObjectMissing(key) from None
            raise self._unavailable(exc) from exc
        except (MinioException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._unavailable(exc) from exc
        try:
            return response.read()
        finally:
            response.close()
            response.release_conn()

    def exists(self, key: str) -> bool:
        """True when ``key`` exists."""
        self.ensure_bucket()
        try:
            self._client.stat_object(self.bucket, self.prefix + key)
        except S3Error as exc:
            if exc.code in ("NoSuchKey", "NoSuchObject", "ResourceNotFound"):
                return False
            raise self._unavailable(exc) from exc
        except (MinioException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._unavailable(exc) from exc
        return True

    def present(self, keys: Collection[str], prefix: str, pool: Executor) -> set[str]:
        """Return which of ``keys`` exist: concurrent HEADs for few, one LIST for many."""
        if not keys:
            return set()
        if len(keys) > _HEAD_LIMIT:
            listed = self.list(prefix)
            return {k for k in keys if k in listed}
        ordered = list(keys)
        return {k for k, hit in zip(ordered, pool.map(self.exists, ordered), strict=True) if hit}

    def list(self, prefix: str) -> dict[str, ObjectInfo]:
        """Every object under ``prefix``."""
        self.ensure_bucket()
        full = self.prefix + prefix
        skip = len(self.prefix)
        try:
            return {
                obj.object_name[skip:]: ObjectInfo(obj.size or 0, obj.last_modified)
                for obj in self._client.list_objects(self.bucket, prefix=full, recursive=True)
                if obj.object_name is not None and obj.last_modified is not None
            }
        except (MinioException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._unavailable(exc) from exc

    def delete_many(self, keys: Iterable[str]) -> None:
        """Delete ``keys`` in batches of 1000 (one request each)."""
        self.ensure_bucket()
        batch = [DeleteObject(self.prefix + k) for k in keys]
        try:
            for i in range(0, len(batch), 1000):
                errors = list(self._client.remove_objects(self.bucket, batch[i : i + 1000]))
                real = [e for e in errors if e.code not in ("NoSuchKey", "NoSuchObject")]
                if real:
                    raise StoreUnavailable(
                        f"S3 delete of {real[0].name} failed: {real[0].code} {real[0].message}"
                    )
        except (MinioException, urllib3.exceptions.HTTPError, OSError) as exc:
            raise self._unavailable(exc) from exc
