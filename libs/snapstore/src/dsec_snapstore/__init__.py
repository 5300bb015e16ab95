"""DSec snapshots: signed, content-addressed records of a sandbox, and the way back to them.

The snapshot data path (manifest, chunking, encryption, the S3 store) as a library: the node
agent takes snapshots of its running sandboxes and rolls them back with it, the snapshot
service snapshots sandboxes that run nowhere, applies retention and deletes, and the
``dsec snapshot`` CLI reads (ls, inspect, diff, verify) through it. See
:mod:`dsec_snapstore.store` and, for what the event log says about a sandbox,
:mod:`dsec_snapstore.sandboxes`.
"""

from dsec_snapstore.domain import (
    CodeDelta,
    FileChange,
    GpuCheck,
    Inspection,
    PeriodicPolicy,
    RetentionPolicy,
    SnapshotDiff,
)
from dsec_snapstore.errors import (
    InvalidInput,
    SnapshotError,
    SnapshotExists,
    SnapshotNotFound,
    StoreBusy,
    StoreUnavailable,
    VerificationFailed,
)
from dsec_snapstore.manifest import (
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
from dsec_snapstore.results import (
    CodeCheck,
    CreateResult,
    GcReport,
    RestoreResult,
    SnapshotInputs,
    VerifyReport,
)
from dsec_snapstore.store import SnapshotStore

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
    "StoreBusy",
    "StoreUnavailable",
    "VerificationFailed",
    "VerifyReport",
]
