"""What the snapshot library takes and returns (plain values, no I/O)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from dsec_snapstore import domain
from dsec_snapstore.manifest import DepsRecord, GpuRecord, SnapshotManifest


@dataclass(frozen=True)
class SnapshotInputs:
    """What to snapshot. The sandbox launcher fills these from a running sandbox.

    Attributes:
        code_dir: The sandbox's code directory.
        exclude_patterns: The spec's code-bundle ``exclude_patterns``.
        sandbox_id: The sandbox, when the snapshot is of one.
        deps: Fingerprint and lock from the sandbox's ``env.built`` / ``deps.resolved``.
        env: The sandbox's environment; only names and keyed hashes are stored.
        audit_segment: The sandbox's audit log segment; stored encrypted.
        kernel: Kernel parameters (default: read from this node's ``/proc/sys/kernel``).
        gpu: GPU inventory (default: probed with NVML on this node).
        labels: Free-form labels (``periodic`` marks periodic snapshots).
        node_id: The node the sandbox runs on.
    """

    code_dir: Path
    exclude_patterns: Sequence[str] = ()
    sandbox_id: str | None = None
    deps: DepsRecord | None = None
    env: Mapping[str, str] | None = None
    audit_segment: bytes | None = None
    kernel: Mapping[str, str] | None = None
    gpu: GpuRecord | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    node_id: str | None = None


@dataclass(frozen=True)
class CreateResult:
    """A stored snapshot and what storing it cost (fields of ``snapshot.taken``).

    ``bytes_uploaded``/``chunks_uploaded`` are what the store took (it dedups across every
    snapshot of the bucket, every tenant's); ``bytes_new`` is what this snapshot holds that its
    parent did not (this tree and its own parent alone decide it): what ``snapshot.taken`` and
    the index row publish, since a count of the store's dedup told any tenant whether another
    tenant had stored the same content.
    """

    manifest: SnapshotManifest
    manifest_digest: str
    files: int
    bytes_total: int
    bytes_uploaded: int
    chunks_total: int
    chunks_uploaded: int
    files_rehashed: int
    duration_s: float
    bytes_new: int = 0


@dataclass(frozen=True)
class VerifyReport:
    """The outcome of ``verify``: ``problems`` names every bad object (empty when all is well)."""

    name: str
    manifest_digest: str | None
    objects_checked: int
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        """True when the signature and every object are intact."""
        return not self.problems


@dataclass(frozen=True)
class RestoreResult:
    """What a restore wrote (fields of ``snapshot.restored``)."""

    manifest: SnapshotManifest
    manifest_digest: str
    dest: Path
    files_written: int
    files_removed: int
    bytes_written: int
    duration_s: float


@dataclass(frozen=True)
class CodeCheck:
    """A directory compared with a snapshot's code manifest."""

    name: str
    directory: Path
    delta: domain.CodeDelta

    @property
    def ok(self) -> bool:
        """True when the directory holds exactly the snapshot's files."""
        return self.delta.empty

    def describe(self) -> list[str]:
        """One line per mismatch, followed by the line diff of each changed file."""
        lines = [f"missing: {f.path}" for f in self.delta.removed]
        lines += [f"not in snapshot: {f.path}" for f in self.delta.added]
        for change in self.delta.changed:
            lines.append(f"changed: {change.path} ({change.what})")
            if change.diff:
                lines += change.diff.rstrip("\n").splitlines()
            elif change.note:
                lines.append(f"  ({change.note})")
        return lines


@dataclass(frozen=True)
class GcReport:
    """What garbage collection found and removed."""

    objects_stored: int
    objects_referenced: int
    deleted: tuple[str, ...]
    bytes_freed: int
    dry_run: bool
    chunks_removed: int = 0
    """Chunks no snapshot references that are gone (with their pack, or repacked without)."""
    packs_repacked: int = 0
