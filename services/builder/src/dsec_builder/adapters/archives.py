"""Environment archives in the object store: one per lock hash for the whole cluster.

``envs/<lock_hash>.tar.zst`` in the system bucket (:func:`dsec_core.objectstore.env_archive_key`),
packed by :func:`dsec_core.envarchive.pack`. The object carries its BLAKE3 digest and unpacked
size as user metadata; the builder also keeps a record of each archive it stored under its own
root (``archives/<lock_hash>.json``), and a reuse whose object no longer matches that record is
treated as missing (built and stored again), so an object replaced in the store is never vouched
for by a builder that stored the original. Methods block (the ``minio`` SDK): call them in a
worker thread.
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from dsec_core.envarchive import pack
from dsec_core.objectstore import env_archive_key, stat_object
from minio import Minio

from dsec_builder.adapters.artifacts import sweep_files

_META_DIGEST = "blake3"
_META_UNPACKED = "unpacked-bytes"


@dataclass(frozen=True)
class StoredArchive:
    """An environment archive in the object store (what ``env.built`` names)."""

    object_key: str
    digest: str
    size_bytes: int
    unpacked_bytes: int


class EnvArchives:
    """Environment archives of one bucket, packed in ``work`` (the builder's own root)."""

    def __init__(self, client: Minio, bucket: str, work: Path) -> None:
        self.client = client
        self.bucket = bucket
        self.work = work

    def _record(self, lock_hash: str) -> Path:
        return self.work / f"{lock_hash}.json"

    def existing(self, lock_hash: str) -> StoredArchive | None:
        """The stored archive of ``lock_hash``, or ``None`` when there is none to reuse."""
        key = env_archive_key(lock_hash)
        info = stat_object(self.client, self.bucket, key)
        if info is None:
            return None
        try:
            found = StoredArchive(
                key, info.metadata[_META_DIGEST], info.size, int(info.metadata[_META_UNPACKED])
            )
        except (KeyError, ValueError):
            return None  # not one of ours (no digest recorded): pack and store it again
        record = self._record(lock_hash)
        if record.is_file():
            mine = StoredArchive(**json.loads(record.read_text()))
            if mine != found:
                return None  # replaced since this builder stored it: never vouch for it
        return found

    def sweep(self, older_than_s: float) -> int:
        """Remove archives left half packed or uploaded longer than ``older_than_s`` (a builder
        killed meanwhile); returns how many."""
        return sweep_files(self.work, ".*.tar.zst", older_than_s)

    def store(self, lock_hash: str, env_root: Path) -> StoredArchive:
        """Pack the environment at ``env_root`` and store it under its lock hash."""
        self.work.mkdir(parents=True, exist_ok=True)
        staged = self.work / f".{lock_hash}.{uuid.uuid4().hex[:8]}.tar.zst"
        try:
            packed = pack(env_root, staged)
            key = env_archive_key(lock_hash)
            self.client.fput_object(
                self.bucket,
                key,
                str(staged),
                content_type="application/zstd",
                metadata={_META_DIGEST: packed.digest, _META_UNPACKED: str(packed.unpacked_bytes)},
            )
        finally:
            staged.unlink(missing_ok=True)
        stored = StoredArchive(key, packed.digest, packed.size_bytes, packed.unpacked_bytes)
        tmp = self._record(lock_hash).with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(stored)))
        os.replace(tmp, self._record(lock_hash))
        return stored
