"""DSec snapshots: signed, content-addressed records of a sandbox, and the way back to them.

The library (:class:`SnapshotStore`) is what the snapshot service's handlers and the
``dsec snapshot`` CLI call; see :mod:`dsec_snapshot.store`.
"""

from dsec_snapshot.domain import (
    CodeDelta,
    FileChange,
    GpuCheck,
    Inspection,
    PeriodicPolicy,
    RetentionPolicy,
    SnapshotDiff,
)
from dsec_snapshot.errors import (
    InvalidInput,
    SnapshotError,
    SnapshotExists,
    SnapshotNotFound,
    StoreUnavailable,
    VerificationFailed,
)
from dsec_snapshot.manifest import (
    AuditRecord,
    DepsRecord,
    EnvRecord,
    GpuDevice,
    GpuRecord,
    SignedManifest,
    SnapshotManifest,
    SnapshotSummary,
    Source,
)
from dsec_snapshot.results import (
    CodeCheck,
    CreateResult,
    GcReport,
    RestoreResult,
    SnapshotInputs,
    VerifyReport,
)
from dsec_snapshot.store import SnapshotStore

__all__ = [
    "AuditRecord",
    "CodeCheck",
    "CodeDelta",
    "CreateResult",
    "DepsRecord",
    "EnvRecord",
    "FileChange",
    "GcReport",
    "GpuCheck",
    "GpuDevice",
    "GpuRecord",
    "Inspection",
    "InvalidInput",
    "PeriodicPolicy",
    "RestoreResult",
    "RetentionPolicy",
    "SignedManifest",
    "SnapshotDiff",
    "SnapshotError",
    "SnapshotExists",
    "SnapshotInputs",
    "SnapshotManifest",
    "SnapshotNotFound",
    "SnapshotStore",
    "SnapshotSummary",
    "Source",
    "StoreUnavailable",
    "VerificationFailed",
    "VerifyReport",
]
