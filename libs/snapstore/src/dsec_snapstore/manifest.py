"""The snapshot manifest: what a snapshot records, signed as one canonical document.

A snapshot is stored as ``snapshots/<name>.json`` = :class:`SignedManifest` (the manifest plus an
Ed25519 signature over its compact JSON bytes) and content-addressed objects: file chunks
(zstd-compressed; the id is the BLAKE3 of the plain bytes) inside pack objects found through the
pack index (:mod:`dsec_snapstore.packs`; snapshots taken before packs have one object per chunk
under ``chunks/<blake3>``, still read) and the encrypted audit segment under
``snapshot-audit/<blake3 of the ciphertext>``; index rows under ``snapshot-index/<name>.json``.
The snapshot GC owns ``packs/``, ``pack-index/``, ``chunks/`` and ``snapshot-audit/``.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any, Literal

import blake3
from dsec_core.codebundle import CodeManifest, FileEntry
from dsec_core.events import LockedPackage
from pydantic import BaseModel, ConfigDict, Field

SCHEMA_VERSION = 1
CHUNK_PREFIX = "chunks/"
AUDIT_PREFIX = "snapshot-audit/"
INDEX_PREFIX = "snapshot-index/"
MANIFEST_PREFIX = "snapshots/"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z")
NAME_RULE = "1-128 characters: letters, digits, '.', '_', '-', starting with a letter or digit"


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Source(_Frozen):
    """What was snapshotted: a sandbox (by id) and/or a code directory on a node."""

    sandbox_id: str | None = None
    code_dir: str | None = Field(default=None, description="Absolute path on the node")
    node_id: str | None = None

    @property
    def series(self) -> str:
        """The key snapshots of the same thing share (retention applies per series)."""
        return self.sandbox_id or f"{self.node_id or ''}:{self.code_dir or ''}"


class DepsRecord(_Frozen):
    """The dependency fingerprint and lock of the sandbox's environment (from ``env.built``)."""

    fingerprint: str
    lock_hash: str
    packages: tuple[LockedPackage, ...] = ()


class EnvRecord(_Frozen):
    """Environment variables: names and keyed BLAKE3 hashes of the values (never the values).

    The hash key is secret (kept in Vault), so a low-entropy value cannot be recovered by
    brute force from the manifest; it is shared by the installation so two snapshots compare.
    """

    key_id: str = Field(description="Which hash key was used (hashes compare only under one key)")
    hashes: dict[str, str]


class GpuDevice(_Frozen):
    """One GPU as NVML reports it."""

    index: int
    name: str
    uuid: str
    memory_total: int = Field(description="Bytes of device memory")
    bar1_total: int | None = None
    pci_bus_id: str | None = None
    compute_capability: str | None = None
    mig_enabled: bool = False
    mig_slices: tuple[tuple[str, int], ...] = Field(
        default=(), description="MIG GPU instances as (profile name, memory bytes)"
    )
    nvlink_peers: tuple[str, ...] = Field(default=(), description="PCI bus ids of NVLink peers")


class GpuRecord(_Frozen):
    """The GPUs of the node and their memory layout, or why there are none."""

    present: bool
    reason: str | None = Field(default=None, description="Why no GPU was found")
    driver_version: str | None = None
    cuda_version: str | None = None
    devices: tuple[GpuDevice, ...] = ()
    dot: str | None = Field(default=None, description="Memory layout as a Graphviz DOT graph")

    @property
    def models(self) -> tuple[str, ...]:
        """The sorted device model names (what compatibility is judged on)."""
        return tuple(sorted(d.name for d in self.devices))


class AuditRecord(_Frozen):
    """The sandbox's audit segment, AES-256-GCM encrypted; the key lives in Vault."""

    object_key: str = Field(description="snapshot-audit/<BLAKE3 hex of the ciphertext>")
    blake3: str
    size: int = Field(description="Ciphertext bytes (nonce + ciphertext + tag)")
    plaintext_size: int
    key_ref: str = Field(description="Where the key is: vault KV v2 path")


class SnapshotManifest(_Frozen):
    """Everything a snapshot records. Signed as a whole."""

    schema_version: Literal[1] = 1
    id: str
    name: str
    created_at: datetime
    created_by: str
    parent: str | None = None
    source: Source
    labels: dict[str, str] = Field(default_factory=dict)
    code: CodeManifest
    chunk_map: dict[str, tuple[str, ...]] = Field(
        default_factory=dict,
        description="Chunk ids of files stored in more than one chunk; other non-empty files "
        "are one chunk whose id is the file's BLAKE3",
    )
    deps: DepsRecord | None = None
    env: EnvRecord | None = None
    kernel: dict[str, str] = Field(default_factory=dict)
    gpu: GpuRecord
    audit: AuditRecord | None = None

    def signed_bytes(self) -> bytes:
        """The bytes that are signed and hashed: the manifest's compact JSON.

        Fields come in declared order and mappings in insertion order, which a JSON round trip
        keeps, so a verifier re-serializes the parsed manifest and gets the same bytes (an
        altered manifest does not). Several times faster than canonical MessagePack on a
        manifest of thousands of files.
        """
        return self.model_dump_json().encode()

    def digest(self) -> str:
        """BLAKE3 hex of :meth:`signed_bytes` (``manifest_digest`` in ``snapshot.taken``)."""
        return blake3.blake3(self.signed_bytes()).hexdigest()

    def chunks_of(self, entry: FileEntry) -> tuple[str, ...]:
        """The chunk ids holding ``entry``'s content, in order."""
        if entry.kind != "file" or entry.size == 0:
            return ()
        return self.chunk_map.get(entry.path, (entry.blake3,))

    def all_chunks(self) -> set[str]:
        """Every chunk id the snapshot references."""
        out: set[str] = set()
        for entry in self.code.files:
            out.update(self.chunks_of(entry))
        return out


class Signature(_Frozen):
    """An Ed25519 signature over :meth:`SnapshotManifest.signed_bytes`."""

    algorithm: Literal["ed25519"] = "ed25519"
    key_id: str
    public_key: str = Field(description="Raw public key, hex")
    value: str = Field(description="Signature, hex")
    certificate: dict[str, Any] | None = Field(
        default=None,
        description="The signer's certificate from the operator root (a node agent's or the "
        "snapshot service's): what lets a reader on another machine trust the key",
    )


class SignedManifest(_Frozen):
    """What is stored at ``snapshots/<name>.json``."""

    manifest: SnapshotManifest
    signature: Signature


class SnapshotSummary(_Frozen):
    """The index row of one snapshot (``snapshot-index/<name>.json``), what ``ls`` shows."""

    name: str
    id: str
    created_at: datetime
    series: str
    parent: str | None = None
    files: int
    bytes_total: int
    bytes_uploaded: int
    manifest_digest: str
    git_commit: str | None = None
    labels: dict[str, str] = Field(default_factory=dict)


def manifest_key(name: str) -> str:
    """Object key of a snapshot's signed manifest."""
    return f"{MANIFEST_PREFIX}{name}.json"


def summary_key(name: str) -> str:
    """Object key of a snapshot's index row."""
    return f"{INDEX_PREFIX}{name}.json"


def audit_key(digest: str) -> str:
    """Object key of an encrypted audit segment."""
    return f"{AUDIT_PREFIX}{digest}"


def chunk_key(chunk_id: str) -> str:
    """Object key of a chunk."""
    return f"{CHUNK_PREFIX}{chunk_id}"
