"""Recordings in the object store: encrypted, content-addressed, per tenant.

Layout (bucket ``DSEC_S3_BUCKET``)::

    recordings/<tenant>/objects/<blake3 of the plaintext>      a request or a response
    recordings/<tenant>/manifests/<recording id>               the list of calls

Every object is sealed (XChaCha20-Poly1305, :mod:`dsec_nodeagent.state.sealing`) under the
tenant's recording key (OpenBao ``secret/dsec-recording/<tenant>``), with associated data naming
the tenant and the object's hash, so an object copied under another tenant's prefix, or to
another name, does not open. The manifest is canonical JSON; its BLAKE3 is the recording's
``root_hash`` and ``rec_`` + its first 32 hex digits the recording id: the same calls give the
same id, and a loaded recording is checked against its id and every object against its hash.
A tenant only ever reads under its own prefix with its own key: another tenant's recording id
is "not found".
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol

import blake3
from dsec_core.objectstore import ObjectMissing, get_bytes, put_bytes, stat_object
from dsec_sdk.recording import CallKey, Entry

from dsec_nodeagent.ipc.registry import tenant_token
from dsec_nodeagent.state.sealing import SealError, open_sealed, seal

PREFIX: Final = "recordings"
KEY_PATH: Final = "dsec-recording"
MANIFEST_VERSION: Final = 1
MAX_CALLS: Final = 100_000


class RecordingNotFound(LookupError):
    """No recording of that id for this tenant."""


class RecordingCorrupt(ValueError):
    """A recording whose manifest or objects do not match their hashes or do not open."""


class Keys(Protocol):
    async def get(self, tenant: str) -> bytes: ...


@dataclass(frozen=True)
class Saved:
    recording_id: str
    root_hash: str
    calls: int
    tool_calls: int
    http_calls: int
    failed_calls: int
    bytes: int
    new_objects: int


def _digest(data: bytes) -> str:
    return blake3.blake3(data).hexdigest()


def recording_id_of(root_hash: str) -> str:
    return f"rec_{root_hash[:32]}"


class RecordingStore:
    """Saves and loads recordings (``store``: a Minio client; its calls run in a thread)."""

    def __init__(
        self,
        store: Any,
        bucket: str,
        keys: Keys,
        exists: Callable[[str], Awaitable[bool]] | None = None,
    ) -> None:
        self.store = store
        self.bucket = bucket
        self.keys = keys
        self._exists = exists

    def _prefix(self, tenant: str) -> str:
        return f"{PREFIX}/{tenant_token(tenant)}"

    async def _has(self, key: str) -> bool:
        if self._exists is not None:
            return await self._exists(key)
        return await asyncio.to_thread(stat_object, self.store, self.bucket, key) is not None

    async def save(self, tenant: str, entries: Sequence[Entry]) -> Saved:
        """Store ``entries`` (objects not stored yet, then the manifest); return what
        ``recording.saved`` says."""
        if len(entries) > MAX_CALLS:
            raise ValueError(f"{len(entries)} calls: a recording holds at most {MAX_CALLS}")
        key = await self.keys.get(tenant)
        prefix = self._prefix(tenant)
        blobs: dict[str, bytes] = {}
        calls: list[dict[str, Any]] = []
        total = 0
        for entry in entries:
            request, response = entry.key.body, entry.response
            req_hash, resp_hash = _digest(request), _digest(response)
            blobs[req_hash], blobs[resp_hash] = request, response
            total += len(request) + len(response)
            calls.append(
                {
                    "digest": entry.key.digest(),
                    "kind": entry.key.kind,
                    "target": entry.key.target,
                    "name": entry.key.name,
                    "headers": [list(h) for h in entry.key.headers],
                    "request": req_hash,
                    "response": resp_hash,
                    "failed": entry.failed,
                    "seq": entry.seq,
                }
            )
        new = 0
        for digest, data in blobs.items():
            name = f"{prefix}/objects/{digest}"
            if await self._has(name):
                continue  # content-addressed: stored by an earlier recording
            await put_bytes(self.store, self.bucket, name, seal(key, data, _aad(tenant, digest)))
            new += 1
        manifest = json.dumps(
            {"version": MANIFEST_VERSION, "calls": calls}, sort_keys=True, separators=(",", ":")
        ).encode()
        root = _digest(manifest)
        rid = recording_id_of(root)
        name = f"{prefix}/manifests/{rid}"
        if not await self._has(name):
            await put_bytes(self.store, self.bucket, name, seal(key, manifest, _aad(tenant, rid)))
            new += 1
        return Saved(
            recording_id=rid,
            root_hash=root,
            calls=len(calls),
            tool_calls=sum(1 for c in calls if c["kind"] == "tool"),
            http_calls=sum(1 for c in calls if c["kind"] == "http"),
            failed_calls=sum(1 for c in calls if c["failed"]),
            bytes=total,
            new_objects=new,
        )

    async def load(self, tenant: str, recording_id: str) -> tuple[str, list[Entry]]:
        """The root hash and the calls of ``recording_id`` of ``tenant``.

        Raises:
            RecordingNotFound: no such recording for this tenant (another tenant's included).
            RecordingCorrupt: it does not match its id, or an object does not open.
        """
        key = await self.keys.get(tenant)
        prefix = self._prefix(tenant)
        try:
            sealed = await get_bytes(self.store, self.bucket, f"{prefix}/manifests/{recording_id}")
        except ObjectMissing:
            raise RecordingNotFound(
                f"no recording {recording_id} for tenant {tenant!r} (recordings are per tenant; "
                "see `dsec audit replay --type recording.saved`)"
            ) from None
        try:
            manifest = open_sealed(key, sealed, _aad(tenant, recording_id), recording_id)
        except SealError as exc:
            raise RecordingCorrupt(str(exc)) from None
        root = _digest(manifest)
        if recording_id_of(root) != recording_id:
            raise RecordingCorrupt(f"{recording_id}: its manifest hashes to {root}")
        data = json.loads(manifest)
        cache: dict[str, bytes] = {}

        async def blob(digest: str) -> bytes:
            if digest not in cache:
                try:
                    raw = await get_bytes(self.store, self.bucket, f"{prefix}/objects/{digest}")
                    plain = open_sealed(key, raw, _aad(tenant, digest), digest)
                except (ObjectMissing, SealError) as exc:
                    raise RecordingCorrupt(f"{recording_id}: object {digest}: {exc}") from None
                if _digest(plain) != digest:
                    raise RecordingCorrupt(f"{recording_id}: object {digest} does not match")
                cache[digest] = plain
            return cache[digest]

        entries = []
        for call in data["calls"]:
            entry = Entry(
                CallKey(
                    kind=call["kind"],
                    target=call["target"],
                    name=call["name"],
                    body=await blob(call["request"]),
                    headers=tuple((str(a), str(b)) for a, b in call["headers"]),
                ),
                await blob(call["response"]),
                bool(call["failed"]),
                int(call["seq"]),
            )
            if entry.key.digest() != call["digest"]:
                raise RecordingCorrupt(f"{recording_id}: a call's key does not match its digest")
            entries.append(entry)
        return root, entries


def _aad(tenant: str, name: str) -> bytes:
    return f"dsec-recording\0{tenant}\0{name}".encode()
