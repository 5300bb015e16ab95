"""Pure decisions about snapshots: names, diffs, code checks, inspection, GPUs, retention, GC.

No I/O here: callers pass manifests, file contents and clocks in, and get plain values back.
"""

from __future__ import annotations

import difflib
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import PurePosixPath

from dsec_core.codebundle import CodeManifest, FileEntry

from dsec_snapstore.errors import InvalidInput
from dsec_snapstore.manifest import (
    NAME_RE,
    NAME_RULE,
    GpuDevice,
    GpuRecord,
    SnapshotManifest,
    SnapshotSummary,
)

TEXT_DIFF_LIMIT = 1 << 20
"""Files larger than this (either side) are reported as changed without a line diff."""


def validate_name(name: str, what: str = "snapshot name") -> str:
    """Return ``name`` if it is a valid snapshot name.

    Raises:
        InvalidInput: naming the value and the rule.
    """
    if not NAME_RE.fullmatch(name):
        raise InvalidInput(f"{what} {name!r} is not valid: {NAME_RULE}")
    return name


def validate_member_path(path: str) -> PurePosixPath:
    """Return ``path`` as a relative POSIX path that stays inside its root.

    Raises:
        InvalidInput: the path is empty, absolute or contains ``..``.
    """
    rel = PurePosixPath(path)
    if not path or "\0" in path or rel.is_absolute() or ".." in rel.parts or rel.parts in ((),):
        raise InvalidInput(f"manifest path {path!r} is absolute or escapes the root")
    return rel


# --- file-level comparison ------------------------------------------------------------------


@dataclass(frozen=True)
class FileChange:
    """A file present on both sides with different content, mode or kind."""

    path: str
    old: FileEntry
    new: FileEntry
    diff: str | None = None
    note: str | None = None

    @property
    def what(self) -> str:
        """A short description of what differs."""
        parts = []
        if self.old.kind != self.new.kind:
            parts.append(f"{self.old.kind} -> {self.new.kind}")
        if self.old.blake3 != self.new.blake3:
            parts.append(f"content {self.old.size} -> {self.new.size} bytes")
        if self.old.mode != self.new.mode:
            parts.append(f"mode {self.old.mode:o} -> {self.new.mode:o}")
        return ", ".join(parts)


@dataclass(frozen=True)
class CodeDelta:
    """How one code manifest differs from another."""

    added: tuple[FileEntry, ...] = ()
    removed: tuple[FileEntry, ...] = ()
    changed: tuple[FileChange, ...] = ()

    @property
    def empty(self) -> bool:
        """True when both sides hold the same files."""
        return not (self.added or self.removed or self.changed)


def compare_code(old: CodeManifest, new: CodeManifest) -> CodeDelta:
    """Return the files added, removed and changed going from ``old`` to ``new``."""
    before, after = old.by_path(), new.by_path()
    added = tuple(after[p] for p in sorted(after.keys() - before.keys()))
    removed = tuple(before[p] for p in sorted(before.keys() - after.keys()))
    changed = tuple(
        FileChange(p, before[p], after[p])
        for p in sorted(before.keys() & after.keys())
        if _differs(before[p], after[p])
    )
    return CodeDelta(added, removed, changed)


def _differs(a: FileEntry, b: FileEntry) -> bool:
    return (a.kind, a.blake3, a.mode, a.target) != (b.kind, b.blake3, b.mode, b.target)


def text_diff(
    path: str, old: bytes, new: bytes, *, old_label: str, new_label: str
) -> tuple[str | None, str | None]:
    """Return ``(unified diff, note)`` of two versions of a file.

    The diff is ``None`` with a note when either side is binary or too large to show.
    """
    if max(len(old), len(new)) > TEXT_DIFF_LIMIT:
        return None, f"larger than {TEXT_DIFF_LIMIT} bytes: no line diff"
    old_text, new_text = _as_text(old), _as_text(new)
    if old_text is None or new_text is None:
        return None, "binary file: no line diff"
    lines = difflib.unified_diff(
        old_text.splitlines(keepends=True),
        new_text.splitlines(keepends=True),
        fromfile=f"{old_label}/{path}",
        tofile=f"{new_label}/{path}",
    )
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines), None


def _as_text(data: bytes) -> str | None:
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


# --- snapshot-level diff --------------------------------------------------------------------


@dataclass(frozen=True)
class MappingDelta:
    """Keys added, removed and changed between two string mappings."""

    added: dict[str, str] = field(default_factory=dict)
    removed: dict[str, str] = field(default_factory=dict)
    changed: dict[str, tuple[str, str]] = field(default_factory=dict)

    @property
    def empty(self) -> bool:
        """True when nothing differs."""
        return not (self.added or self.removed or self.changed)


def compare_mappings(old: Mapping[str, str], new: Mapping[str, str]) -> MappingDelta:
    """Return how ``new`` differs from ``old``."""
    return MappingDelta(
        added={k: new[k] for k in sorted(new.keys() - old.keys())},
        removed={k: old[k] for k in sorted(old.keys() - new.keys())},
        changed={k: (old[k], new[k]) for k in sorted(old.keys() & new.keys()) if old[k] != new[k]},
    )


@dataclass(frozen=True)
class EnvDelta:
    """Environment variables added, removed or whose value changed (names only)."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    comparable: bool = True

    @property
    def empty(self) -> bool:
        """True when nothing differs (or nothing can be compared)."""
        return not (self.added or self.removed or self.changed)


@dataclass(frozen=True)
class SnapshotDiff:
    """What differs between snapshot ``a`` and snapshot ``b``."""

    a: str
    b: str
    code: CodeDelta
    deps: MappingDelta
    deps_fingerprint: tuple[str | None, str | None]
    env: EnvDelta
    kernel: MappingDelta
    gpu: tuple[tuple[str, ...], tuple[str, ...]] | None

    @property
    def empty(self) -> bool:
        """True when the two snapshots record the same state."""
        return (
            self.code.empty
            and self.deps.empty
            and self.env.empty
            and self.kernel.empty
            and self.gpu is None
        )


def _packages(m: SnapshotManifest) -> dict[str, str]:
    if m.deps is None:
        return {}
    return {p.name: p.version for p in m.deps.packages}


def _env_delta(a: SnapshotManifest, b: SnapshotManifest) -> EnvDelta:
    old = a.env.hashes if a.env else {}
    new = b.env.hashes if b.env else {}
    delta = compare_mappings(old, new)
    comparable = a.env is None or b.env is None or a.env.key_id == b.env.key_id
    return EnvDelta(
        added=tuple(delta.added),
        removed=tuple(delta.removed),
        changed=tuple(delta.changed) if comparable else (),
        comparable=comparable,
    )


def diff_manifests(a: SnapshotManifest, b: SnapshotManifest) -> SnapshotDiff:
    """Compare two snapshots (without file contents: line diffs are added by the caller)."""
    gpu = None if a.gpu.models == b.gpu.models else (a.gpu.models, b.gpu.models)
    return SnapshotDiff(
        a=a.name,
        b=b.name,
        code=compare_code(a.code, b.code),
        deps=compare_mappings(_packages(a), _packages(b)),
        deps_fingerprint=(
            a.deps.fingerprint if a.deps else None,
            b.deps.fingerprint if b.deps else None,
        ),
        env=_env_delta(a, b),
        kernel=compare_mappings(a.kernel, b.kernel),
        gpu=gpu,
    )


# --- inspection -----------------------------------------------------------------------------

_KINDS: dict[str, tuple[str, ...]] = {
    "source": (".py", ".pyi", ".pyx", ".js", ".ts", ".tsx", ".jsx", ".go", ".rs", ".c", ".h",
               ".cc", ".cpp", ".hpp", ".cu", ".java", ".kt", ".scala", ".rb", ".sh", ".sql"),
    "notebook": (".ipynb",),
    "weights": (".pt", ".pth", ".ckpt", ".safetensors", ".bin", ".onnx", ".gguf", ".h5", ".pb"),
    "data": (".csv", ".tsv", ".jsonl", ".parquet", ".arrow", ".feather", ".npy", ".npz",
             ".pkl", ".pickle", ".db", ".sqlite", ".avro"),
    "archive": (".zip", ".tar", ".gz", ".tgz", ".zst", ".xz", ".bz2", ".whl", ".7z"),
    "config": (".yaml", ".yml", ".toml", ".ini", ".cfg", ".json", ".env", ".conf"),
    "docs": (".md", ".rst", ".txt", ".pdf", ".html"),
    "media": (".png", ".jpg", ".jpeg", ".gif", ".svg", ".mp4", ".wav", ".mp3", ".webp"),
}  # fmt: skip
_KIND_OF_SUFFIX = {suffix: kind for kind, suffixes in _KINDS.items() for suffix in suffixes}


def kind_of(entry: FileEntry) -> str:
    """The kind of a file for inspection (source, data, weights, ..., other, symlink)."""
    if entry.kind == "symlink":
        return "symlink"
    return _KIND_OF_SUFFIX.get(PurePosixPath(entry.path).suffix.lower(), "other")


@dataclass(frozen=True)
class Share:
    """Bytes and files of one directory or kind."""

    key: str
    bytes: int
    files: int


@dataclass(frozen=True)
class Inspection:
    """What takes space in a snapshot, and what dominates."""

    name: str
    files: int
    total_bytes: int
    unique_bytes: int
    by_directory: tuple[Share, ...]
    by_kind: tuple[Share, ...]
    largest: tuple[FileEntry, ...]
    dominant: str


def _shares(pairs: Iterable[tuple[str, FileEntry]]) -> tuple[Share, ...]:
    sizes: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for key, entry in pairs:
        sizes[key] += entry.size
        counts[key] += 1
    return tuple(Share(k, sizes[k], counts[k]) for k, _ in sizes.most_common())


def _directory(path: str, depth: int) -> str:
    parts = PurePosixPath(path).parts[:-1]
    return "/".join(parts[:depth]) + "/" if parts else "./"


def inspect_manifest(m: SnapshotManifest, *, depth: int = 2, top: int = 10) -> Inspection:
    """Break a snapshot down by directory (to ``depth``) and kind; name what dominates."""
    files = m.code.files
    total = sum(f.size for f in files)
    unique = sum({f.blake3: f.size for f in files if f.kind == "file"}.values())
    by_dir = _shares((_directory(f.path, depth), f) for f in files)
    by_kind = _shares((kind_of(f), f) for f in files)
    largest = tuple(sorted(files, key=lambda f: (-f.size, f.path))[:top])
    return Inspection(
        name=m.name,
        files=len(files),
        total_bytes=total,
        unique_bytes=unique,
        by_directory=by_dir,
        by_kind=by_kind,
        largest=largest,
        dominant=_dominant(by_dir, by_kind, total),
    )


def _dominant(by_dir: Sequence[Share], by_kind: Sequence[Share], total: int) -> str:
    if total == 0:
        return "empty snapshot"
    d, k = by_dir[0], by_kind[0]
    return (
        f"{d.key} holds {100 * d.bytes / total:.0f}% of the bytes ({d.files} files); "
        f"{k.key} files are {100 * k.bytes / total:.0f}%"
    )


# --- GPUs -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuCheck:
    """Whether a snapshot's GPUs match this node's; a mismatch runs in compatibility mode."""

    compatibility_mode: bool
    message: str


def check_gpu(recorded: GpuRecord, current: GpuRecord) -> GpuCheck:
    """Compare the GPU models a snapshot was taken on with the ones available now."""
    if not recorded.present:
        return GpuCheck(False, "snapshot was taken without a GPU")
    if not current.present:
        return GpuCheck(
            True,
            f"snapshot ran on {', '.join(recorded.models)} but no GPU is available here "
            f"({current.reason}): compatibility mode",
        )
    if recorded.models != current.models:
        return GpuCheck(
            True,
            f"GPU model differs: snapshot {', '.join(recorded.models)}, "
            f"here {', '.join(current.models)}: compatibility mode",
        )
    return GpuCheck(False, f"same GPU model ({', '.join(current.models)})")


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB"


def gpu_dot(devices: Sequence[GpuDevice]) -> str:
    """Render GPUs, their memory (and MIG slices) and NVLink peers as a Graphviz DOT graph."""
    lines = ["digraph gpus {", "  rankdir=LR;", "  node [shape=record];"]
    by_bus = {d.pci_bus_id: f"gpu{d.index}" for d in devices if d.pci_bus_id}
    for d in devices:
        label = f"GPU {d.index}|{d.name}|memory {_gib(d.memory_total)}"
        if d.bar1_total is not None:
            label += f"|BAR1 {_gib(d.bar1_total)}"
        lines.append(f'  gpu{d.index} [label="{{{_dot_escape(label)}}}"];')
        for i, (profile, size) in enumerate(d.mig_slices):
            slice_label = f"MIG {profile}|{_gib(size)}"
            lines.append(f'  gpu{d.index}_mig{i} [label="{{{_dot_escape(slice_label)}}}"];')
            lines.append(f"  gpu{d.index} -> gpu{d.index}_mig{i};")
    edges = set()
    for d in devices:
        for peer in d.nvlink_peers:
            other = by_bus.get(peer)
            if other is not None:
                edges.add(tuple(sorted((f"gpu{d.index}", other))))
    lines += [f'  {a} -> {b} [dir=both, label="NVLink"];' for a, b in sorted(edges)]
    lines.append("}")
    return "\n".join(lines) + "\n"


def _dot_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


# --- retention, periodic snapshots, GC ------------------------------------------------------


@dataclass(frozen=True)
class RetentionPolicy:
    """Which snapshots of a series to keep; every other one is deleted.

    Attributes:
        keep_last: The newest N (at least 1: the newest is the parent of the next snapshot).
        keep_within: Every snapshot younger than this.
        keep_daily: The newest snapshot of each of the last N days that have one.
    """

    keep_last: int = 10
    keep_within: timedelta | None = None
    keep_daily: int = 0

    def __post_init__(self) -> None:
        if self.keep_last < 1:
            raise InvalidInput(f"retention keep_last={self.keep_last}: must be at least 1")
        if self.keep_daily < 0:
            raise InvalidInput(f"retention keep_daily={self.keep_daily}: must be >= 0")


def select_expired(
    snapshots: Sequence[SnapshotSummary], policy: RetentionPolicy, now: datetime
) -> list[str]:
    """Return the names of the snapshots ``policy`` does not keep, per series."""
    expired: list[str] = []
    series: dict[str, list[SnapshotSummary]] = {}
    for s in snapshots:
        series.setdefault(s.series, []).append(s)
    for members in series.values():
        newest_first = sorted(members, key=lambda s: (s.created_at, s.name), reverse=True)
        keep = {s.name for s in newest_first[: policy.keep_last]}
        if policy.keep_within is not None:
            keep |= {s.name for s in newest_first if now - s.created_at <= policy.keep_within}
        days: list[str] = []
        for s in newest_first:
            day = s.created_at.date().isoformat()
            if day not in days and len(days) < policy.keep_daily:
                days.append(day)
                keep.add(s.name)
        expired += [s.name for s in newest_first if s.name not in keep]
    return sorted(expired)


@dataclass(frozen=True)
class PeriodicPolicy:
    """Take a snapshot of a series every ``interval``, then apply ``retention``."""

    interval: timedelta
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    name_prefix: str = "auto"

    def __post_init__(self) -> None:
        if self.interval <= timedelta(0):
            raise InvalidInput(f"periodic interval {self.interval}: must be positive")
        validate_name(self.name_prefix, "periodic name_prefix")


def is_due(last_taken: datetime | None, now: datetime, interval: timedelta) -> bool:
    """True when a periodic snapshot should be taken now."""
    return last_taken is None or now - last_taken >= interval


def periodic_name(prefix: str, now: datetime) -> str:
    """The name of the periodic snapshot taken at ``now`` (sortable, unique per second)."""
    return f"{prefix}-{now.strftime('%Y%m%dT%H%M%SZ')}"


def collectable(
    stored: Mapping[str, datetime], referenced: set[str], now: datetime, grace: timedelta
) -> list[str]:
    """Return the stored object keys no snapshot references and older than ``grace``.

    The grace period protects the objects of a snapshot being created right now, uploaded
    before its manifest is written.
    """
    return sorted(
        k for k, modified in stored.items() if k not in referenced and now - modified > grace
    )
