"""What callers give the sandbox launcher and what it gives back (event-friendly, frozen)."""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

SANDBOX_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
# The communication plane's alphabet (names become NATS subject tokens; see dsec_sdk.ipc.control).
DEVICE_NAME_RE = re.compile(
    r"[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63}(/[A-Za-z0-9_-][A-Za-z0-9_.-]{0,63})?\Z"
)
"""A device node's name under /dev: one name, or a directory and a name
(``nvidia-caps/nvidia-cap1``, ``dri/renderD128``); no component starts with a dot (no ``.``,
``..`` or hidden names)."""
AGENT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}\Z")

_FROZEN = ConfigDict(frozen=True, extra="forbid")

RESERVED_PREFIXES = ("/proc", "/dev", "/opt/dsec", "/run/dsec")

DEFAULT_FILES = 1024
DEFAULT_DISK_BYTES = 256 * 2**20
MIN_DISK_BYTES = 16 * 2**20
DEFAULT_LOG_BYTES = 64 * 2**20


def _absolute(path: str, field_name: str) -> str:
    pure = PurePosixPath(path)
    if not pure.is_absolute() or ".." in pure.parts:
        raise ValueError(f"{field_name}: {path!r} must be an absolute path without '..'")
    # One leading slash: POSIX keeps "//x" apart from "/x" (PurePosixPath keeps it), the kernel
    # does not, and every comparison of sandbox paths is by string.
    return "/" + "/".join(pure.parts[1:])


class ExitReason(StrEnum):
    """Why a sandbox ended (``sandbox.exited`` payload)."""

    OK = "ok"
    ERROR = "error"
    OOM = "oom"
    PIDS = "pids"
    TIMEOUT = "timeout"
    STOPPED = "stopped"
    POLICY = "policy"
    DISK = "disk"
    POLICY_FLOOD = "policy_flood"
    HANDED_OVER = "handed_over"  # a new version took over its state and tool name
    GPU_MEMORY = "gpu_memory"  # over its GPU memory quota (dsec_nodeagent.gpuquota)


class Limits(BaseModel):
    """cgroup limits and the sandbox's own bounds; ``None`` leaves a resource unlimited.

    Attributes:
        memory_bytes: hard memory limit (RAM + swap), the OOM killer acts beyond it.
        cpus: CPU bandwidth in cores (``1.5`` = 150 ms per 100 ms period).
        pids: most tasks (processes + threads) alive at once, the sandbox's init included
            (the cgroup's ``pids.max`` is one more, for the sandbox's life: the process that
            starts the workload is still there for the workload's first milliseconds).
        files: ``RLIMIT_NOFILE`` (soft = hard) of every sandbox process, never the node
            agent's own.
        disk_bytes: size of the per-sandbox filesystem (a loop-mounted ext4 image) holding its
            writable directories on the host (``write_allowed`` but ``/tmp``, which is a tmpfs
            charged to the memory limit).
        log_bytes: bytes kept of stdout and of stderr each: the first and the last half.
        disk_read_bps: bytes per second the sandbox reads from block devices: its disk and
            the host's disks (those of its read-only views), each device on its own.
        disk_write_bps: bytes per second written to its disk, write-back included.
        disk_iops: block I/O operations per second, reads and writes each.

    The node agent always sets the block I/O bounds (from the spec's ``resources``, whose
    defaults bound them); ``None`` here is for callers of the manager itself.
    """

    model_config = _FROZEN

    memory_bytes: int | None = Field(default=None, ge=4 * 1024 * 1024)
    cpus: float | None = Field(default=None, gt=0)
    pids: int | None = Field(default=None, ge=4)
    files: int | None = Field(default=DEFAULT_FILES, ge=16)
    disk_bytes: int | None = Field(default=DEFAULT_DISK_BYTES, ge=MIN_DISK_BYTES)
    log_bytes: int | None = Field(default=DEFAULT_LOG_BYTES, ge=4096)
    disk_read_bps: int | None = Field(default=None, ge=4096)
    disk_write_bps: int | None = Field(default=None, ge=4096)
    disk_iops: int | None = Field(default=None, ge=1)


class Mount(BaseModel):
    """A host directory (or file) shown at ``target`` in the sandbox.

    Whether the sandbox may *read* it is still decided by ``read_allowed`` (Landlock), as in the
    spec, where mounts are listed there too.
    """

    model_config = _FROZEN

    source: Path
    target: str
    read_only: bool = True

    @field_validator("target")
    @classmethod
    def _target_absolute(cls, value: str) -> str:
        return _absolute(value, "mount target")


class AgentIdentity(BaseModel):
    """Who a sandbox's processes are on the communication plane (the IPC broker pins it).

    Attributes:
        name: the agent name other agents call it by (the spec's ``name``).
        task_group: only agents of one group reach each other.
        tenant: the spec's tenant (``EnforcementPlan.tenant``): groups and names are granted per
            tenant, so two tenants using one group name never meet.
    """

    model_config = _FROZEN

    name: str
    task_group: str
    tenant: str = Field(default="default", min_length=1, max_length=253)

    @field_validator("name", "task_group")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if not AGENT_NAME_RE.match(value):
            raise ValueError(
                f"{value!r}: use 1-63 of [A-Za-z0-9_-], starting with a letter or digit"
            )
        return value


class SandboxConfig(BaseModel):
    """Everything needed to start one sandbox; the lead maps the spec + ``env.built`` onto it.

    Attributes:
        sandbox_id: unique name (``[A-Za-z0-9][A-Za-z0-9_.-]{0,63}``).
        argv: the command; ``argv[0] == "python"`` means the runtime's interpreter, otherwise an
            absolute path inside the sandbox.
        runtime: host path of the Python interpreter (a venv's ``bin/python`` is resolved to its
            base installation, which is shown read-only at the same path).
        env_dir: the built environment (a ``site-packages`` dir, or a prefix holding
            ``lib/pythonX.Y/site-packages``), shown read-only at ``/opt/dsec/env``.
        code_dir: the code bundle, shown read-only at ``workdir``.
        workdir: the working directory (and where the code bundle appears).
        env: plain environment variables.
        secret_env: values from the runtime context; they reach only the workload's environment,
            never a file, log or event.
        mounts: declared mounts (materialized context, extra data).
        read_allowed: sandbox paths the workload may read (Landlock), beyond the runtime, the
            environment and ``workdir``. A path not provided by a mount is bound read-only from
            the host at the same path when it exists there (e.g. ``/etc/resolv.conf``).
        write_allowed: sandbox paths the workload may write; ``/tmp`` is a private tmpfs, others
            are per-sandbox host directories kept after exit (outputs), or ``write_sources``.
        write_sources: optional host directory backing a ``write_allowed`` path.
        extra_ro_paths: host files or dirs (e.g. ``/bin/sh``) shown read-only at the same path;
            their shared libraries are discovered too.
        host_denied: host directories no ``read_allowed`` path may bind, once its symlinks are
            resolved (the node agent's: its home, with every sandbox's code, logs and keys; the
            host's shared temporary and runtime directories). The org's rules decide the rest
            before a spec is accepted; this holds whatever they allow.
        limits: memory / CPU / pids limits.
        timeout_s: wall-clock limit; the sandbox is stopped with reason ``timeout`` after it.
        network: keep the host network namespace (the eBPF egress layer then applies through the
            sandbox's cgroup); ``False`` gives an empty network namespace (no network at all).
        tcp_connect_ports: if set, Landlock lets TCP ``connect`` reach only these ports.
        semantic_rules: compiled semantic rules (see :mod:`dsec_nodeagent.semantic`), or ``None``.
        hostname: UTS hostname (default: the sandbox id).
        agent: the sandbox's identity on the communication plane: its processes get
            ``DSEC_AGENT_NAME``/``DSEC_TASK_GROUP`` and, when the manager runs with an IPC broker,
            the broker's socket (``DSEC_IPC_SOCKET``) and the SDK on their import path.
        metadata: caller data stored in the state file and echoed in results (e.g. lease ids).
        gpu_devices: NVIDIA device nodes (names under ``/dev``: ``nvidia0``, ``nvidiactl``,
            ``nvidia-caps/nvidia-cap21``) bound into the sandbox's ``/dev`` (its granted GPUs
            only, ``dsec_nodeagent.gpuslice``).
        gpu_binds: sandbox path -> host directory bound read-write (an MPS server's pipe
            directory).
        checkpointable: CRIU can checkpoint the whole sandbox (migration path ``criu``,
            docs/migration.md): pid 1 re-executes the sandbox's own interpreter once the root
            view is built (no process maps a file of the host's mount tree), and Landlock does
            not scope abstract unix sockets (CRIU's parasite, run inside the workload, connects
            to one CRIU made) — the one isolation a checkpointable sandbox gives up.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    sandbox_id: str
    argv: list[str] = Field(min_length=1)
    runtime: Path
    env_dir: Path | None = None
    code_dir: Path | None = None
    workdir: str = "/workspace/code"
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: dict[str, SecretStr] = Field(default_factory=dict)
    mounts: list[Mount] = Field(default_factory=list)
    read_allowed: list[str] = Field(default_factory=list)
    write_allowed: list[str] = Field(default_factory=lambda: ["/tmp"])
    write_sources: dict[str, Path] = Field(default_factory=dict)
    extra_ro_paths: list[Path] = Field(default_factory=list)
    host_denied: list[Path] = Field(default_factory=list)
    limits: Limits = Field(default_factory=Limits)
    timeout_s: float | None = Field(default=None, gt=0)
    network: bool = True
    tcp_connect_ports: list[int] | None = None
    semantic_rules: dict[str, Any] | None = None
    hostname: str | None = None
    agent: AgentIdentity | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    gpu_devices: list[str] = Field(default_factory=list, max_length=512)
    gpu_binds: dict[str, Path] = Field(default_factory=dict, max_length=64)
    checkpointable: bool = False

    @field_validator("gpu_devices")
    @classmethod
    def _device_names(cls, values: list[str]) -> list[str]:
        for value in values:
            if not DEVICE_NAME_RE.match(value):
                raise ValueError(
                    f"gpu_devices: {value!r} is not a device name under /dev (one or two "
                    "components of [A-Za-z0-9_.-], none starting with '.')"
                )
        return values

    @field_validator("sandbox_id")
    @classmethod
    def _id_format(cls, value: str) -> str:
        if not SANDBOX_ID_RE.match(value):
            raise ValueError(
                f"sandbox_id {value!r}: use 1-64 of [A-Za-z0-9_.-], starting with a letter/digit"
            )
        return value

    @field_validator("workdir")
    @classmethod
    def _workdir_absolute(cls, value: str) -> str:
        return _absolute(value, "workdir")

    @field_validator("read_allowed", "write_allowed")
    @classmethod
    def _paths_absolute(cls, values: list[str]) -> list[str]:
        return [_absolute(v, "read_allowed/write_allowed") for v in values]

    @model_validator(mode="after")
    def _no_reserved_targets(self) -> SandboxConfig:
        targets = [m.target for m in self.mounts] + [p for p in self.write_allowed]
        for target in [*targets, self.workdir]:
            for prefix in RESERVED_PREFIXES:
                if target == prefix or target.startswith(prefix + "/"):
                    raise ValueError(f"{target}: {prefix} is reserved for the sandbox itself")
        for name in self.secret_env:
            if name in self.env:
                raise ValueError(f"env var {name} is given both as plain env and as a secret")
        return self


class SandboxReady(BaseModel):
    """The sandbox runs with every layer on (``sandbox.ready`` payload).

    Attributes:
        timings_ms: start latency per layer (``plan``, ``cgroup``, ``spawn``, ``fork``,
            ``cgroup_join``, ``namespaces``, ``mounts``, ``credentials``, ``landlock``,
            ``seccomp``, ``exec``) in milliseconds.
        ready_ms: from the launch call to a successful ``execve`` of the workload.
        cgroup_path: the sandbox's cgroup v2 directory (eBPF programs attach here).
        cgroup_id: its inode number, equal to ``bpf_get_current_cgroup_id()`` inside.
    """

    model_config = _FROZEN

    sandbox_id: str
    pid: int
    uid: int
    cgroup_path: str
    cgroup_id: int
    started_at: float
    ready_ms: float
    timings_ms: dict[str, float]
    stdout_path: str
    stderr_path: str
    warnings: list[str] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)


class SandboxExited(BaseModel):
    """How a sandbox ended (``sandbox.exited`` payload). Everything was cleaned up before it."""

    model_config = _FROZEN

    sandbox_id: str
    exit_code: int | None
    signal: int | None
    reason: ExitReason
    detail: str
    started_at: float
    ended_at: float
    oom_kills: int = 0
    pids_limit_hits: int = 0
    stdout_path: str
    stderr_path: str
    metadata: dict[str, Any] = Field(default_factory=dict)
    disk_full: bool = False
    log_dropped_bytes: dict[str, int] = Field(default_factory=dict)


class SandboxStartError(RuntimeError):
    """The sandbox could not start; nothing is left behind (``sandbox.failed`` payload).

    Attributes:
        sandbox_id: which sandbox.
        stage: the layer that failed (``plan``, ``cgroup``, ``mounts``, ``landlock``, ...).
        message: what went wrong, naming the path or setting involved.
    """

    def __init__(self, sandbox_id: str, stage: str, message: str) -> None:
        super().__init__(f"sandbox {sandbox_id}: {stage}: {message}")
        self.sandbox_id = sandbox_id
        self.stage = stage
        self.message = message

    def payload(self) -> dict[str, str]:
        """Event payload for ``sandbox.failed``."""
        return {"sandbox_id": self.sandbox_id, "stage": self.stage, "reason": self.message}
