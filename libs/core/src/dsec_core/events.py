"""Payload models of every DSec event, with their type, aggregate and schema version.

Every event on the bus is an :class:`~dsec_core.envelope.Envelope` whose ``payload`` is one of
the models below. Each model is frozen and forbids unknown fields; ``EVENT_TYPES`` maps the event
type to its model. A consumer that meets a newer *minor* version of a payload still decodes it
(unknown fields are dropped, see :func:`decode_payload`); a newer *major* version is refused.

Versioning rule: adding an optional field is a minor bump; removing or retyping one is a major.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

from dsec_core.eventbase import KeyRegistered as KeyRegistered
from dsec_core.eventbase import KeyRevoked as KeyRevoked
from dsec_core.eventbase import Payload as Payload
from dsec_core.eventtypes import UnknownEventType as UnknownEventType
from dsec_core.eventtypes import aggregate_of
from dsec_core.spec.plan import EnforcementPlan

# --- shared value objects -------------------------------------------------------------------


class BundleRef(BaseModel):
    """A content-addressed code bundle stored in the object store."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    digest: str = Field(description="BLAKE3 hex of the archive bytes")
    object_key: str = Field(description="Key in the DSec bucket")
    size: int = Field(description="Archive size in bytes")
    files: int = Field(description="Number of files in the bundle")
    expanded_size: int | None = Field(
        default=None, description="Bytes the files add up to once extracted (as declared)"
    )


class LockedPackage(BaseModel):
    """One resolved artifact of an environment lock."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str
    version: str
    sha256: str
    source: str


class Alternative(BaseModel):
    """A concrete change that makes a conflicting dependency set resolve."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    requirement: str = Field(description="The requirement to change, as written in the spec")
    suggestion: str = Field(description="The requirement that resolves, e.g. 'vllm<=0.5.4'")
    verified: bool = Field(description="True when a re-resolution with it succeeded")


# --- sandbox lifecycle ----------------------------------------------------------------------


class SpecSubmitted(Payload):
    """A user submitted a sandbox spec (and optionally a code bundle)."""

    TYPE = "spec.submitted"
    AGGREGATE = "sandbox"
    VERSION = "1.2"

    spec_yaml: str = Field(description="The spec text exactly as submitted")
    filename: str = Field(default="dsec.yaml", description="Name used in located errors")
    code: BundleRef | None = None
    submitted_by: str = Field(default="", description="user@host of the submitter")
    start_from_snapshot: str | None = Field(
        default=None,
        description="Snapshot whose code the node agent restores into the sandbox's code dir "
        "before it starts (`dsec sandbox run --snapshot`); it publishes snapshot.restored",
    )
    handover_from: str | None = Field(
        default=None,
        description="1.2: a running sandbox of the same tenant whose state and tool name this "
        "new version takes over in a live hand-over (`dsec sandbox upgrade`); the scheduler "
        "places it on that sandbox's node, the node agent streams the state and switches "
        "(state.handed_over); refused (spec.rejected) for another tenant's sandbox",
    )


class SpecValidated(Payload):
    """The spec is valid; carries the compiled enforcement plan."""

    TYPE = "spec.validated"
    AGGREGATE = "sandbox"
    VERSION = "1.4"  # 1.4: plan.resources.disk_read_bps, disk_write_bps, disk_iops

    name: str
    spec_digest: str = Field(description="BLAKE3 of the spec text")
    plan: EnforcementPlan = Field(
        description="The compiled plan (dsec_core.spec), typed; each rule with its spec line "
        "(1.1: spec_line, spec_file; 1.2: topology, the compute units to place, their edges, "
        "migration limits and priority; a 1.1 plan reads as one unit, main; 1.3: migration's "
        "on, paths, max_interruption_ms and thresholds). On the wire the same map as before"
    )
    code: BundleRef | None = None
    warnings: list[dict[str, Any]] = Field(default_factory=list)


class SpecRejected(Payload):
    """The spec has errors; each is located at FILE:LINE:COL."""

    TYPE = "spec.rejected"
    AGGREGATE = "sandbox"
    TERMINAL = True

    errors: list[dict[str, Any]]
    warnings: list[dict[str, Any]] = Field(default_factory=list)


class DepsResolved(Payload):
    """The dependencies resolved to a lock."""

    TYPE = "deps.resolved"
    AGGREGATE = "sandbox"

    lock: list[LockedPackage]
    lock_hash: str
    python: str
    platform: str
    resolve_ms: float


class DepsConflict(Payload):
    """The dependencies cannot be installed together; alternatives that resolve."""

    TYPE = "deps.conflict"
    AGGREGATE = "sandbox"
    TERMINAL = True

    explanation: str
    conflicting: list[str] = Field(default_factory=list)
    alternatives: list[Alternative] = Field(default_factory=list)
    known_bad: bool = Field(default=False, description="Blocked by the known-bad combinations")


class EnvBuilt(Payload):
    """The environment of a lock exists as a content-addressed archive in the object store.

    Built once for the whole cluster by the builder; each node stages (fetches, verifies and
    unpacks) it into its own layout when a sandbox is scheduled there, so no two services and no
    two nodes share a directory.
    """

    TYPE = "env.built"
    AGGREGATE = "sandbox"
    VERSION = "2.0"

    lock_hash: str
    fingerprint: str = Field(description="Stable hash of sorted name/version/sha256")
    object_key: str = Field(
        description="S3 key of the environment archive (tar + zstd): envs/<lock_hash>.tar.zst"
    )
    digest: str = Field(description="BLAKE3 of the archive bytes, hex")
    size_bytes: int = Field(ge=0, description="Archive size in bytes")
    unpacked_bytes: int = Field(default=0, ge=0, description="Bytes of the files it unpacks to")
    reused: bool = Field(description="The archive already existed: nothing was built")
    timings_ms: dict[str, float] = Field(default_factory=dict)
    bytes_by_tier: dict[str, int] = Field(default_factory=dict)
    integrity_failures: list[str] = Field(default_factory=list)


class Resources(BaseModel):
    """What a sandbox needs from a node (from the compiled plan's ``resources``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpus: float = Field(default=1.0, description="CPU cores (cgroup cpu.max quota)")
    memory_bytes: int = Field(default=512 * 1024 * 1024)
    gpus: int = Field(default=0, description="Whole GPUs")
    gpu_memory_bytes: int = Field(default=0, description="GPU memory per GPU, 0 = any")


ReasonKey = Annotated[str, StringConstraints(max_length=200)]
ScoreTerm = Annotated[str, StringConstraints(max_length=64)]
Finite = Annotated[float, Field(allow_inf_nan=False)]


class SandboxPending(Payload):
    """No node can take the sandbox now; it waits in the scheduler's queue (not a failure)."""

    TYPE = "sandbox.pending"
    AGGREGATE = "sandbox"
    VERSION = "1.1"

    reason: str = Field(description="Why no node fits, per node in one line")
    resources: Resources = Field(default_factory=Resources)
    attempt: int = Field(default=1, description="Placement attempt (2+ after a node was lost)")
    unit: str | None = Field(
        default=None, max_length=128, description="The first compute unit that found no place"
    )
    unfit: dict[ReasonKey, Annotated[int, Field(ge=0)]] = Field(
        default_factory=dict,
        max_length=32,
        description="Why nodes could not take that unit: reason -> how many nodes (each node "
        "counted once); empty for a wait that is not about capacity (a quota, the queue)",
    )
    nodes_total: int | None = Field(default=None, ge=0, description="Nodes the scheduler knew")


class SandboxScheduled(Payload):
    """A node was chosen for the sandbox; from now on only that node acts on it."""

    TYPE = "sandbox.scheduled"
    AGGREGATE = "sandbox"
    VERSION = "1.1"

    node_id: str
    reason: str = ""
    attempt: int = Field(default=1, description="Placement attempt (2+ after a node was lost)")
    previous_node: str | None = Field(default=None, description="The node it was lost on")
    resources: Resources = Field(default_factory=Resources)
    env_built_id: str | None = Field(
        default=None, description="Id of the env.built event whose environment the node stages"
    )


class UnitPlaced(Payload):
    """The scheduler chose a node (and GPUs) for one compute unit of a sandbox; every unit of a
    gang is placed before (or with) the sandbox's ``sandbox.scheduled``, all or none."""

    TYPE = "unit.placed"
    AGGREGATE = "sandbox"

    sandbox_id: str
    unit: str = Field(max_length=128, description="The compute unit's name (``main``: no topology)")
    node_id: str
    gpu_indices: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=256)
    gpu_milli: int = Field(
        default=0, ge=0, le=1000, description="Thousandths taken on each GPU (1000: whole GPUs)"
    )
    gpu_model: str | None = Field(default=None, max_length=64, description="Canonical model")
    cpu_millicores: int = Field(default=0, ge=0)
    memory_bytes: int = Field(default=0, ge=0)
    gang_size: int = Field(default=1, ge=1, description="Units of the sandbox placed together")
    policy: str = Field(max_length=64, description="The placement policy that chose")
    score: Finite = 0.0
    breakdown: dict[ScoreTerm, Finite] = Field(
        default_factory=dict, max_length=16, description="Named terms of the score"
    )
    feasible_nodes: int = Field(default=0, ge=0, description="Nodes that could take the unit")
    nodes_total: int = Field(default=0, ge=0, description="Nodes the scheduler knew")
    attempt: int = Field(default=1, description="Placement attempt (2+ after a node was lost)")


class UnitLost(Payload):
    """The node running this sandbox was lost; the scheduler reschedules or fails it."""

    TYPE = "unit.lost"
    AGGREGATE = "sandbox"

    node_id: str
    reason: str
    action: Literal["reschedule", "fail"]
    attempt: int = Field(description="The placement attempt that was lost")


class ContextInjected(Payload):
    """One piece of runtime context was injected: never a value, only names, hashes, leases."""

    TYPE = "context.injected"
    AGGREGATE = "sandbox"

    kind: Literal["secret", "s3", "configmap"]
    name: str
    source: str
    digest: str | None = None
    lease_id: str | None = None
    ttl_s: float | None = None
    bytes: int | None = None


class SandboxReady(Payload):
    """The sandbox process runs with every isolation layer applied."""

    TYPE = "sandbox.ready"
    AGGREGATE = "sandbox"
    VERSION = "1.2"

    node_id: str
    pid: int
    cgroup: str
    start_latency_ms: dict[str, float] = Field(default_factory=dict)
    code_dir: str | None = Field(
        default=None,
        description="Host path (on node_id) of the sandbox's code copy, shown read-only at the "
        "spec's workdir; None when it runs without a code bundle",
    )
    warnings: list[str] = Field(
        default_factory=list,
        description="(1.2) What the node found while it started the sandbox that its user should "
        "know, each a sentence naming the path or setting: a mount outside read_allowed (the "
        "sandbox cannot read it), a read_allowed path that exists nowhere, an env variable the "
        "sandbox's Python owns, kernel or Landlock refusals the node cannot report (the layers "
        "still refuse), an IPC broker the sandbox cannot reach; at most 32, each at most 500 "
        "characters; empty when there is nothing to say",
    )


ExitReason = Literal[
    "ok",
    "error",
    "oom",
    "pids",
    "timeout",
    "stopped",
    "policy",
    "disk",
    "policy_flood",
    "handed_over",
    "gpu_memory",
    "migrated",
]
"""Why a sandbox ended (1.2 of sandbox.exited adds ``handed_over``: a new version took over its
state and tool name in a live hand-over, see state.handed_over; 1.3 adds ``gpu_memory``: a unit
stopped for using more GPU memory than its slice, and ``migrated``: the unit moved to another node
and runs on there, see unit.migrated).
"""


class SandboxExited(Payload):
    """The sandbox ended; everything it held was released."""

    TYPE = "sandbox.exited"
    AGGREGATE = "sandbox"
    TERMINAL = True
    VERSION = "1.3"

    exit_code: int
    reason: ExitReason
    duration_s: float
    detail: str | None = Field(
        default=None, description="Why, in one line a user can act on (e.g. the full disk quota)"
    )
    log_dropped_bytes: dict[str, int] = Field(
        default_factory=dict,
        description="Bytes cut from the middle of stdout/stderr beyond resources.log_bytes",
    )


class SandboxRestarted(Payload):
    """A stateful sandbox (spec ``state.restart: on-failure``) died — a signal or a non-zero
    exit, not stopped, timed out or handed over — and its node agent started it again in
    place: same sandbox id, same isolation, a new process (no second ``sandbox.ready``: it
    stays running). Published once the new process runs; after ``state.max_restarts`` the exit
    is final (``sandbox.exited``). See docs/state.md."""

    TYPE = "sandbox.restarted"
    AGGREGATE = "sandbox"

    restarts: int = Field(description="Restarts so far, this one included (1 the first time)")
    exit_code: int | None = Field(description="Exit code of the process that died; None: signal")
    signal: int | None = Field(description="The signal that killed it, if one did")
    reason: str = Field(description="How it ended (sandbox.exited's reasons: error, oom, ...)")
    pid: int = Field(description="The new process's pid on the node")


class SandboxFailed(Payload):
    """A stage could not complete for this sandbox (after bounded retries)."""

    TYPE = "sandbox.failed"
    AGGREGATE = "sandbox"
    TERMINAL = True

    stage: str = Field(description="The service/stage that failed, e.g. 'builder'")
    reason: str
    attempts: int = 1
    failed_event_id: str | None = None


class PolicyViolation(Payload):
    """A sandbox was refused (or, by policy, logged) an action."""

    TYPE = "policy.violation"
    AGGREGATE = "sandbox"

    layer: Literal["kernel", "semantic"]
    rule_id: str
    action: Literal["deny", "log", "redirect", "allow"]
    operation: str = Field(description="open, connect, subprocess, http, dns, ...")
    target: str = Field(description="Path, address or URL involved")
    message: str = ""
    spec_line: int | None = None


class PolicyViolationSummary(Payload):
    """Refusals of one rule past the first few, counted per interval instead of streamed."""

    TYPE = "policy.violation_summary"
    AGGREGATE = "sandbox"

    layer: Literal["kernel", "semantic", "dns"]
    rule_id: str = Field(description="Rule id from the compiled plan (a bounded set)")
    operation: str
    count: int = Field(ge=1, description="Refusals in [first, last] not sent as events")
    first: datetime
    last: datetime
    sample_target: str = Field(default="", description="One target of the interval, escaped")


class PolicyReported(Payload):
    """A decision the in-sandbox semantic layer *reports* (untrusted: said by the sandbox).

    The node agent checks it against the plan (the rule id exists, the action is one the rule
    allows), bounds and escapes its text, and publishes it as this type, never as the node
    agent's own verdict (``policy.violation``).
    """

    TYPE = "policy.reported"
    AGGREGATE = "sandbox"

    rule_id: str
    action: Literal["deny", "log", "redirect", "allow"]
    operation: str
    target: str = Field(description="Bounded and escaped")
    message: str = Field(default="", description="Bounded and escaped")
    spec_line: int | None = None


class SandboxStopRequested(Payload):
    """A user asked to stop a running sandbox (``dsec sandbox stop``); the node agent acts."""

    TYPE = "sandbox.stop_requested"
    AGGREGATE = "sandbox"

    requested_by: str = ""
    grace_s: float = 5.0


# --- snapshots, placement, nodes, audit -----------------------------------------------------


class SnapshotTaken(Payload):
    """A signed, content-addressed snapshot of a sandbox was stored."""

    TYPE = "snapshot.taken"
    AGGREGATE = "sandbox"

    snapshot: str
    manifest_digest: str
    files: int
    bytes_total: int
    bytes_uploaded: int = Field(
        description="Bytes of content new to this snapshot's own series (not in its parent; "
        "all of it without one). Not the object store's dedup count: the store dedups across "
        "every tenant's snapshots, and that count would tell whether another tenant stored "
        "the same content"
    )


class SnapshotRequested(Payload):
    """A user asked for a snapshot of a sandbox (``dsec snapshot create ID``)."""

    TYPE = "snapshot.requested"
    AGGREGATE = "sandbox"

    name: str = Field(description="Snapshot name, unique in the store")
    requested_by: str = ""
    include_code: bool = Field(default=True, description="Record the code tree")
    include_deps: bool = Field(default=True, description="Record the dependency lock")
    full_state: bool = Field(
        default=False, description="Also the process state (not supported: refused)"
    )


class SnapshotRestoreRequested(Payload):
    """A user asked to roll a running sandbox back to a snapshot (``dsec sandbox rollback``)."""

    TYPE = "snapshot.restore_requested"
    AGGREGATE = "sandbox"

    snapshot: str
    requested_by: str = ""


class SnapshotRestored(Payload):
    """A sandbox was rolled back to (or started from) a snapshot."""

    TYPE = "snapshot.restored"
    AGGREGATE = "sandbox"
    VERSION = "1.1"

    snapshot: str
    manifest_digest: str
    duration_ms: float
    compatibility_mode: bool = False
    files_written: int = 0
    files_removed: int = 0
    deps_match: bool | None = Field(
        default=None,
        description="Whether the sandbox's environment has the snapshot's dependency "
        "fingerprint (None: one of them records no environment)",
    )
    note: str = Field(default="", description="What was not restored, and why")


class SnapshotFailed(Payload):
    """A snapshot or rollback could not be done; the sandbox itself is unaffected."""

    TYPE = "snapshot.failed"
    AGGREGATE = "sandbox"

    snapshot: str
    operation: Literal["create", "restore"]
    reason: str


MAX_DELETE_NAMES = 1000
"""Snapshots one ``snapshot.delete_requested`` may name: each costs the snapshot service a read
of its manifest, and a request of 125,000 names (1 MiB) held every tenant's deletes for
minutes."""


class SnapshotDeleteRequested(Payload):
    """A user asked to delete snapshots (``dsec snapshot rm``) or to collect garbage (``gc``)."""

    TYPE = "snapshot.delete_requested"
    AGGREGATE = "snapshot"

    names: list[str] = Field(
        default_factory=list,
        max_length=MAX_DELETE_NAMES,
        description=f"Snapshots to delete (at most {MAX_DELETE_NAMES} a request)",
    )
    gc: bool = Field(default=False, description="Also remove chunks no snapshot refers to")
    gc_grace_s: float = Field(
        default=3600.0,
        ge=0,
        description="GC keeps unreferenced chunks younger than this (a snapshot being taken "
        "has uploaded chunks its manifest does not yet name); the snapshot service applies "
        "at least its DSEC_SNAPSHOT_GC_MIN_GRACE_S (1 h)",
    )
    requested_by: str = ""


class SnapshotDeleted(Payload):
    """The snapshot service deleted snapshots (and/or unreferenced chunks)."""

    TYPE = "snapshot.deleted"
    AGGREGATE = "snapshot"
    TERMINAL = True
    VERSION = "1.2"

    names: list[str] = Field(default_factory=list)
    missing: list[str] = Field(default_factory=list, description="Names that did not exist")
    failed: list[str] = Field(
        default_factory=list,
        description="Names not deleted because the request gave up (its retries ran out, the "
        "object store failing): they may still exist; try again (since 1.2)",
    )
    chunks_removed: int = 0
    bytes_freed: int = 0
    gc_grace_s: float | None = Field(
        default=None,
        ge=0,
        description="The grace the collection ran with, in seconds: the one asked for, or the "
        "service's minimum (DSEC_SNAPSHOT_GC_MIN_GRACE_S) where that is longer; none when no "
        "collection ran",
    )
    gc_skipped: Literal["busy", "unreadable", "gave_up"] | None = Field(
        default=None,
        description="Why a collection that was asked for (gc: true) did not run: busy "
        "(snapshots being taken, or a GC elsewhere, held the store longer than "
        "DSEC_SNAPSHOT_GC_WAIT_S; try again), unreadable (a manifest cannot be read, or a "
        "live chunk does not check, so nothing was deleted; the service's log names it), "
        "gave_up (the request's retries ran out, the object store failing); none when it "
        "ran or was not asked (since 1.2)",
    )


class GpuLink(BaseModel):
    """One NVLink of a GPU."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    link: int
    active: bool
    remote_pci: str | None = Field(default=None, description="PCI bus id at the other end")


class GpuInfo(BaseModel):
    """One GPU as NVML reports it (or as a declared inventory describes it)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    index: int
    uuid: str
    model: str
    pci_bus_id: str = ""
    memory_total_bytes: Bytes
    memory_used_bytes: Bytes = 0
    temperature_c: float | None = None
    utilization_pct: float | None = None
    ecc_corrected: int | None = None
    ecc_uncorrected: int | None = None
    xid_errors: int | None = Field(default=None, description="XID events seen since start")
    mig_enabled: bool = False
    nvlinks: list[GpuLink] = Field(default_factory=list)
    topology: dict[str, str] = Field(
        default_factory=dict,
        description="Peer GPU uuid -> common ancestor (NVLINK, SINGLE, MULTIPLE, HOSTBRIDGE, "
        "NODE, SYSTEM), from nvmlDeviceGetTopologyCommonAncestor",
    )


# Bounds of what a node may claim: a heartbeat is read into every placement decision, so a
# NaN, a negative count or 10^30 bytes from one node agent must not poison it (refused as a
# payload the scheduler cannot read: the node is not in the fleet).
_CPUS = Field(ge=0, le=1_000_000, allow_inf_nan=False)
_BYTES = Field(ge=0, le=2**62)
Cpus = Annotated[float, _CPUS]
Bytes = Annotated[int, _BYTES]
Label = Annotated[str, StringConstraints(max_length=256)]
Problem = Annotated[str, StringConstraints(max_length=500)]
MAX_PROBLEMS = 64
"""A heartbeat names at most this many problems (the node agent keeps the first)."""


class NodeInventory(BaseModel):
    """What a node has and what is in use (bounded: see ``_CPUS`` / ``_BYTES``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    cpus: Cpus = Field(description="CPU cores sandboxes may use")
    memory_bytes: Bytes = Field(description="Memory sandboxes may use")
    cpus_allocated: Cpus = 0.0
    memory_allocated_bytes: Bytes = 0
    memory_available_bytes: Bytes = Field(default=0, description="MemAvailable of the host")
    load1: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    disk_free_bytes: Bytes = 0
    max_sandboxes: int = Field(
        default=64, ge=0, le=100_000, description="Sandboxes this node accepts at most"
    )
    gpus: list[GpuInfo] = Field(default_factory=list, max_length=256)
    gpu_probe: str = Field(
        default="none",
        max_length=500,
        description="'nvml', 'declared', or why there are none ('no NVML: ...')",
    )
    labels: dict[Label, Label] = Field(default_factory=dict, max_length=64)


class NodeJoined(Payload):
    """A node agent started and offers its node (sent once per process start)."""

    TYPE = "node.joined"
    AGGREGATE = "node"

    node_id: str
    hostname: str
    version: str
    inventory: NodeInventory
    heartbeat_s: float = Field(
        gt=0, le=3600, allow_inf_nan=False, description="How often it heartbeats"
    )


class NodeHeartbeat(Payload):
    """A node agent is alive: its inventory, health and sandboxes."""

    TYPE = "node.heartbeat"
    AGGREGATE = "node"
    VERSION = "2.0"

    node_id: str
    seq: int = Field(description="Heartbeat number since the node agent started")
    inventory: NodeInventory
    sandboxes: list[str] = Field(default_factory=list, description="Sandboxes running here")
    problems: list[Problem] = Field(
        default_factory=list, max_length=MAX_PROBLEMS, description="Why it is unhealthy, if so"
    )
    heartbeat_s: float = Field(default=5.0, gt=0, le=3600, allow_inf_nan=False)


class NodeLost(Payload):
    """A node missed its heartbeats; what ran there is reported ``unit.lost``."""

    TYPE = "node.lost"
    AGGREGATE = "node"

    node_id: str
    last_seen: datetime | None = None
    silent_s: float
    sandboxes: list[str] = Field(default_factory=list)


class NodeCordonRequested(Payload):
    """An operator asked to cordon (stop placing), uncordon or drain a node."""

    TYPE = "node.cordon_requested"
    AGGREGATE = "node"

    node_id: str
    action: Literal["cordon", "uncordon", "drain"]
    reason: str = ""
    requested_by: str = ""


class NodeCordoned(Payload):
    """The scheduler's answer: the node's placement state now."""

    TYPE = "node.cordoned"
    AGGREGATE = "node"

    node_id: str
    cordoned: bool
    draining: bool = False
    reason: str = ""
    moved: list[str] = Field(default_factory=list, description="Sandboxes drained away")


class EventRejected(Payload):
    """A consumer refused to act on an event: unsigned, forged, unauthorized, replayed...

    Published by the refusing service (one per refused message and consumer); ``audit verify``
    pairs each injected message with this answer.
    """

    TYPE = "security.event_rejected"
    AGGREGATE = "security"

    stream_seq: int = Field(description="Stream sequence of the refused message")
    event_id: str | None = Field(default=None, description="Its envelope id, if it had one")
    event_type: str | None = None
    producer: str | None = Field(default=None, description="The producer it claimed")
    subject: str
    consumer: str = Field(description="The durable consumer that refused it")
    reason: str = Field(description="unsigned, bad-signature, unknown-key, unauthorized, ...")
    detail: str = ""


# (audit.key_registered and audit.key_revoked: in dsec_core.eventbase, imported above)


# --- the state plane (docs/state.md) --------------------------------------------------------


class StateCheckpointed(Payload):
    """An agent's state checkpoint is durable (payloads never go on the event log)."""

    TYPE = "state.checkpointed"
    AGGREGATE = "sandbox"
    VERSION = "1.1"

    agent: str
    group: str
    tier: Literal["hot", "warm", "cold"]
    seq: int = Field(description="The newest checkpoint this event stands for")
    bytes: int = Field(
        description="Bytes of deltas (hot), of the snapshot (warm), of new objects (cold)"
    )
    records: int
    pause_ms: float = Field(description="The agent's pause (hot); 0 for keeper-side merges")
    durable_ms: float = Field(description="From receipt to durable")
    checkpoints: int = Field(
        default=1,
        ge=1,
        description="Checkpoints this event stands for: an agent's hot and cold checkpoints are "
        "reported at most once a second, those within that second together (bytes and records "
        "summed, pause_ms and durable_ms the longest)",
    )


class StateRecovered(Payload):
    """An agent's state was given back to it (a restart, or a new sandbox on any node)."""

    TYPE = "state.recovered"
    AGGREGATE = "sandbox"

    agent: str
    group: str
    seq: int
    source: Literal["local", "remote"] = Field(
        description="node disk+tmpfs, or object store+JetStream"
    )
    duration_ms: float
    deltas_applied: int
    bytes: int
    from_sandbox: str | None = Field(
        default=None, description="The sandbox that wrote it, when another one"
    )


class StateHandedOver(Payload):
    """A new version of an agent took over the running one's state and tool name (on the NEW
    sandbox; docs/state.md "Hand-over")."""

    TYPE = "state.handed_over"
    AGGREGATE = "sandbox"

    agent: str
    group: str
    from_sandbox: str = Field(description="The old version's sandbox (stopped: handed_over)")
    seq: int = Field(description="The state's sequence number at the switch")
    interruption_ms: float = Field(
        description="From the old one taking no more calls (asked for its final delta) to "
        "the new one serving"
    )
    deltas_streamed: int = Field(description="Records streamed to the new version")


# --- GPU health and migration (docs/migration.md) -------------------------------------------

GpuSignal = Literal[
    "temperature", "xid", "ecc", "throttle", "nvlink_errors", "memory", "lost", "operator"
]


class GpuDegraded(Payload):
    """A GPU crossed a health threshold; the scheduler places nothing new on it and moves the
    units whose spec allows migration (``migration.on``)."""

    TYPE = "gpu.degraded"
    AGGREGATE = "node"

    node_id: str
    gpu_index: int = Field(ge=0)
    gpu_uuid: str = ""
    signal: GpuSignal
    value: Finite = Field(description="The reading that crossed the threshold (°C, count, ...)")
    threshold: Finite
    severity: Literal["warning", "critical"] = "critical"
    detail: str = Field(default="", max_length=500, description="One line an operator can act on")
    source: Literal["nvml", "declared", "simulated"] = "nvml"


class GpuRecovered(Payload):
    """A degraded GPU is back under every threshold (with hysteresis); placement resumes."""

    TYPE = "gpu.recovered"
    AGGREGATE = "node"

    node_id: str
    gpu_index: int = Field(ge=0)
    gpu_uuid: str = ""
    degraded_s: float = Field(ge=0, description="How long it was degraded")


class LinkCongested(Payload):
    """An NVLink between two GPUs is congested or erroring; traffic degrades to PCIe."""

    TYPE = "link.congested"
    AGGREGATE = "node"

    node_id: str
    gpu_index: int = Field(ge=0)
    link: int = Field(ge=0)
    peer_gpu_index: int | None = None
    utilization_pct: Finite = 0.0
    errors: int = Field(default=0, ge=0, description="Replay/recovery/CRC errors since the last")
    action: Literal["pcie_fallback", "warn"] = "warn"
    detail: str = Field(default="", max_length=500)


MigrationReason = Literal["gpu_degraded", "operator", "drain", "link_congested", "rebalance"]
MigrationPath = Literal["handover", "criu", "restart"]
MigrationFailedStage = Literal["choose", "checkpoint", "transfer", "restore", "resume", "timeout"]


class UnitMigrationRequested(Payload):
    """An operator asked to move one sandbox's unit (``dsec unit migrate ID --to NODE``)."""

    TYPE = "unit.migration_requested"
    AGGREGATE = "sandbox"

    unit: str = Field(default="main", max_length=128)
    to_node: str | None = Field(default=None, description="None: the scheduler chooses")
    reason: MigrationReason = "operator"
    requested_by: str = ""


class UnitMigrationStarted(Payload):
    """The scheduler chose where a unit goes and reserved it there; the source node agent now
    moves the unit's state (``path``) and the target node agent resumes it."""

    TYPE = "unit.migration_started"
    AGGREGATE = "sandbox"

    unit: str = Field(default="main", max_length=128)
    migration_id: str = Field(max_length=64, description="Ties the started/migrated/failed events")
    from_node: str
    to_node: str
    from_gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=256)
    to_gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=256)
    reason: MigrationReason
    path: MigrationPath = Field(
        description="handover: the agent's state moves through the state plane; criu: the "
        "process tree is checkpointed and restored; restart: started afresh (stateless)"
    )
    detail: str = Field(default="", max_length=500)


class UnitMigrated(Payload):
    """The unit runs on the target; the source released it (published by the target's node
    agent, or the simulated fleet's)."""

    TYPE = "unit.migrated"
    AGGREGATE = "sandbox"
    TERMINAL = True

    unit: str = Field(default="main", max_length=128)
    migration_id: str = Field(max_length=64)
    from_node: str
    to_node: str
    from_gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=256)
    to_gpus: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list, max_length=256)
    reason: MigrationReason
    path: MigrationPath
    interruption_ms: float = Field(
        ge=0,
        description="From the unit's last served call / frozen process to the first on the target",
    )
    bytes_moved: int = Field(default=0, ge=0)
    precopy_rounds: int = Field(default=0, ge=0, description="CRIU pre-dump rounds before freeze")
    stages_ms: dict[str, Finite] = Field(default_factory=dict, max_length=16)


class UnitMigrationFailed(Payload):
    """A migration could not finish; the unit keeps running on the source when ``still_running``
    (else it is ended with its own sandbox.exited/failed)."""

    TYPE = "unit.migration_failed"
    AGGREGATE = "sandbox"
    TERMINAL = True

    unit: str = Field(default="main", max_length=128)
    migration_id: str = Field(default="", max_length=64)
    from_node: str | None = None
    to_node: str | None = None
    reason: str = Field(max_length=500, description="Why, in a line a user can act on")
    stage: MigrationFailedStage = "choose"
    still_running: bool = True


# --- experiments: record, replay and A/B (docs/experiments.md) -------------------------------

RecordingId = Annotated[str, StringConstraints(pattern=r"^rec_[0-9a-f]{32}$")]
Blake3Hex = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
ExperimentId = Annotated[str, StringConstraints(pattern=r"^exp_[0-9a-z]{8,40}$")]


class RecordingSaved(Payload):
    """A sandbox's recorded calls are stored, encrypted and content-addressed, in the object
    store (``recordings/<tenant>/``); ``replay: RECORDING_ID`` answers from them."""

    TYPE = "recording.saved"
    AGGREGATE = "sandbox"

    recording_id: RecordingId
    root_hash: Blake3Hex = Field(description="BLAKE3 of the recording's manifest (the id's hex)")
    calls: int = Field(ge=0)
    tool_calls: int = Field(ge=0)
    http_calls: int = Field(ge=0)
    failed_calls: int = Field(ge=0, description="Tool errors and HTTP statuses >= 400")
    bytes: int = Field(ge=0, description="Plaintext bytes of the requests and responses")
    new_objects: int = Field(ge=0, description="Objects written (the others were stored already)")


class ExperimentVariant(BaseModel):
    """One arm of an experiment: its name and the spec it runs."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_-]{0,31}$")]
    spec_file: str = Field(max_length=500)
    spec_hash: Blake3Hex = Field(description="BLAKE3 of the spec's YAML as submitted")
    code_hash: Blake3Hex = Field(description="BLAKE3 of the code bundle's file list and bytes")


class ExperimentStarted(Payload):
    """A user started an A/B experiment (``dsec experiment run``): every variant runs over the
    same inputs, each trial in a sandbox of its own."""

    TYPE = "experiment.started"
    AGGREGATE = "experiment"

    name: str = Field(default="", max_length=200)
    inputs_kind: Literal["recording", "dataset"]
    inputs: str = Field(max_length=500, description="The recording id, or the dataset's file")
    inputs_hash: Blake3Hex = Field(
        description="The recording's root hash, or BLAKE3 of the dataset's bytes"
    )
    variants: list[ExperimentVariant] = Field(min_length=2, max_length=16)
    repeats: int = Field(ge=1, le=1000)
    scorer_file: str = Field(default="", max_length=500, description="Empty: outputs are scores")
    scorer_hash: Blake3Hex
    parallel: int = Field(ge=1, le=64)
    timeout_s: float = Field(default=600.0, gt=0, description="Per trial")


class ExperimentTrialCompleted(Payload):
    """One trial (a variant's run over the inputs) ended and was scored."""

    TYPE = "experiment.trial_completed"
    AGGREGATE = "experiment"

    variant: str = Field(max_length=32)
    repeat: int = Field(ge=0)
    sandbox_id: str = Field(max_length=64)
    inputs_hash: Blake3Hex = Field(description="What the trial's sandbox replayed or was given")
    recording_id: RecordingId | None = None
    exit_code: int
    scores: dict[str, Finite] = Field(
        default_factory=dict, max_length=10_000, description="Score per input id"
    )
    error: str = Field(default="", max_length=500, description="Why it scored nothing")


class ExperimentCompleted(Payload):
    """Every trial of an experiment ended; the summary of its result table."""

    TYPE = "experiment.completed"
    AGGREGATE = "experiment"
    TERMINAL = True

    trials: int = Field(ge=0)
    failed_trials: int = Field(ge=0)
    means: dict[str, Finite] = Field(default_factory=dict, max_length=16)
    p_value: Finite | None = Field(default=None, description="Overall test of the first two")
    test: str = Field(default="", max_length=100)
    verdict: str = Field(default="", max_length=300)


# -- tools (issue 16: tools at run time) ----------------------------------------------------------

ToolFailureClass = Literal[
    "timeout",
    "rate_limited",
    "upstream_5xx",
    "unavailable",
    "auth",
    "bad_arguments",
    "network_policy",
    "tool_error",
]


class ToolDegraded(Payload):
    """A tool of a sandbox's agent failed ``degraded_after`` times in a row (spec
    ``tools.<name>.degraded_after``): published by the node agent running the sandbox, from the
    call reports of the SDK in it (docs/tools.md). ``reason`` is the node agent's plain-language
    diagnosis (the sandbox's own messages never reach an event)."""

    TYPE = "tool.degraded"
    AGGREGATE = "sandbox"

    node_id: str
    agent: str = Field(max_length=63)
    tool: str = Field(max_length=63)
    failure_class: ToolFailureClass
    status: int | None = Field(default=None, ge=100, le=599, description="The last HTTP status")
    failures: int = Field(ge=1, description="Failures in a row when it was declared degraded")
    reason: str = Field(max_length=500, description="The diagnosis, in a line a user can act on")
    fallback: str | None = Field(
        default=None, max_length=63, description="The tool calls go to meanwhile, if any"
    )
    trace_id: str = Field(
        default="", max_length=32, description="Trace of the last failing call (tracing on)"
    )


class ToolRecovered(Payload):
    """A degraded tool answered again (its first successful call after ``tool.degraded``)."""

    TYPE = "tool.recovered"
    AGGREGATE = "sandbox"

    node_id: str
    agent: str = Field(max_length=63)
    tool: str = Field(max_length=63)
    degraded_s: float = Field(ge=0, description="How long it was degraded")
    failures: int = Field(ge=0, description="Failed calls while it was degraded")


# --- gpu (issue 15: slicing, health, operator thresholds; docs/gpu.md) -----------------------


class ClusterConfigSet(Payload):
    """An operator changed a cluster setting (``dsec cluster config set KEY VALUE``); carries
    every setting in force after the change, so a reader needs only the latest one (node agents
    and the simulated fleet read it for their GPU health thresholds and slicing modes; keys and
    defaults: ``dsec_core.gpuhealth.CONFIG_KEYS``). Last writer wins."""

    TYPE = "cluster.config_set"
    AGGREGATE = "cluster"

    key: str = Field(max_length=64, description="The key changed")
    value: str = Field(max_length=500, description="Its new value (canonical spelling)")
    previous: str | None = Field(default=None, max_length=500, description="Its value before")
    config: dict[
        Annotated[str, StringConstraints(max_length=64)],
        Annotated[str, StringConstraints(max_length=500)],
    ] = Field(default_factory=dict, max_length=64, description="Every key set, after this change")
    requested_by: str = Field(default="", max_length=200)


EVENT_MODELS: tuple[type[Payload], ...] = (
    PolicyViolationSummary,
    PolicyReported,
    EventRejected,
    SpecSubmitted,
    SpecValidated,
    SpecRejected,
    DepsResolved,
    DepsConflict,
    EnvBuilt,
    SandboxPending,
    SandboxScheduled,
    UnitPlaced,
    UnitLost,
    ContextInjected,
    SandboxReady,
    SandboxExited,
    SandboxRestarted,
    SandboxFailed,
    PolicyViolation,
    SandboxStopRequested,
    SnapshotTaken,
    SnapshotRestored,
    NodeJoined,
    NodeHeartbeat,
    NodeLost,
    NodeCordonRequested,
    NodeCordoned,
    KeyRegistered,
    KeyRevoked,
    SnapshotRequested,
    SnapshotRestoreRequested,
    SnapshotFailed,
    SnapshotDeleteRequested,
    SnapshotDeleted,
    StateCheckpointed,
    StateRecovered,
    StateHandedOver,
    GpuDegraded,
    GpuRecovered,
    LinkCongested,
    UnitMigrationRequested,
    UnitMigrationStarted,
    UnitMigrated,
    UnitMigrationFailed,
    # experiments
    RecordingSaved,
    ExperimentStarted,
    ExperimentTrialCompleted,
    ExperimentCompleted,
    # tools
    ToolDegraded,
    ToolRecovered,
    # gpu
    ClusterConfigSet,
)

EVENT_TYPES: dict[str, type[Payload]] = {m.TYPE: m for m in EVENT_MODELS}
TERMINAL_TYPES: frozenset[str] = frozenset(m.TYPE for m in EVENT_MODELS if m.TERMINAL)


class UnsupportedSchemaVersion(ValueError):
    """The payload's major schema version is newer than this consumer understands."""


def model_for(event_type: str) -> type[Payload]:
    """Return the payload model of ``event_type`` or raise :class:`UnknownEventType`."""
    model = EVENT_TYPES.get(event_type)
    if model is None:
        aggregate_of(event_type)  # UnknownEventType, naming the known types (the same table)
        raise UnknownEventType(f"unknown event type {event_type!r}")  # (the table is out of date)
    return model


def _major_minor(version: str) -> tuple[int, int]:
    major, _, minor = version.partition(".")
    return int(major), int(minor or 0)


def _known_fields(model: type[BaseModel], data: Any) -> Any:
    """``data`` without the keys ``model`` (and the models nested in it) does not know: what a
    newer minor version added. Values of other shapes are left for validation to judge."""
    if not isinstance(data, dict):
        return data
    out = {}
    for key, value in data.items():
        info = model.model_fields.get(key)
        if info is None:
            continue
        out[key] = _known_nested(info.annotation, value)
    return out


def _known_nested(annotation: Any, value: Any) -> Any:
    for inner in _models_in(annotation):
        if isinstance(value, dict):
            return _known_fields(inner, value)
        if isinstance(value, list | tuple):
            return [_known_fields(inner, v) for v in value]
    return value


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (``M``, ``M | None``, ``tuple[M, ...]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found: list[type[BaseModel]] = []
    for arg in getattr(annotation, "__args__", ()):
        found += _models_in(arg)
    return found


def decode_payload(event_type: str, schema_version: str, payload: dict[str, Any]) -> Payload:
    """Validate ``payload`` as ``event_type``, tolerating a newer minor schema version."""
    model = model_for(event_type)
    theirs, ours = _major_minor(schema_version), _major_minor(model.VERSION)
    if theirs[0] != ours[0]:
        raise UnsupportedSchemaVersion(
            f"{event_type} schema {schema_version} is not readable by this consumer "
            f"(understands {ours[0]}.x)"
        )
    if theirs[1] > ours[1]:
        payload = _known_fields(model, payload)
    return model.model_validate(payload)
