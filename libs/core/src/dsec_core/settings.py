"""Settings for every DSec process: environment variables with the ``DSEC_`` prefix.

Each endpoint left unset means "use the embedded stack under ``DSEC_HOME``"; set it to point at
an existing server (NATS cluster, managed Postgres, S3/MinIO, Vault) and the stack will not start
that server.
"""

from __future__ import annotations

import json
import re
from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import blake3
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

TENANT_QUEUE_MAX = 512
"""The most ``DSEC_TENANT_QUEUE`` may be: what an instance of a service's request handlers
holds for all tenants (``dsec_core.service.FAIR_INSTANCE_HELD``)."""


class Settings(BaseSettings):
    """All DSec settings. See the README's settings table."""

    model_config = SettingsConfigDict(env_prefix="DSEC_", extra="ignore", frozen=True)

    home: Path = Field(default=Path(".dsec"), description="State, data and logs of the stack")
    nats_url: str | None = Field(default=None, description="NATS server URL (external)")
    nats_creds: Path | None = Field(default=None, description="NATS credentials file (JWT)")
    nats_nkey_seed: Path | None = Field(default=None, description="NATS nkey seed file")
    nats_user: str | None = Field(default=None, description="NATS user name")
    nats_password: SecretStr | None = Field(default=None, description="NATS password")
    nats_tls_ca: Path | None = Field(default=None, description="CA bundle to verify NATS")
    nats_tls_cert: Path | None = Field(default=None, description="client certificate for NATS")
    nats_tls_key: Path | None = Field(default=None, description="client key for NATS")
    postgres_dsn: str | None = Field(
        default=None, repr=False, description="PostgreSQL DSN (external)"
    )
    postgres_read_dsn: str | None = Field(
        default=None,
        repr=False,
        description="PostgreSQL DSN of the read-only role (dsec_reader) the CLI's read commands "
        "use; give users this one, never postgres_dsn",
    )
    s3_endpoint: str | None = Field(default=None, description="S3 endpoint host:port (external)")
    s3_access_key: str | None = Field(default=None, description="S3 access key")
    s3_secret_key: str | None = Field(default=None, repr=False, description="S3 secret key")
    s3_secure: bool = Field(default=False, description="Use TLS for S3")
    s3_bucket: str = Field(default="dsec", description="Bucket for bundles, caches, snapshots")
    s3_public_url: str | None = Field(
        default=None,
        description=(
            "The object store as users reach it (http[s]://host:port), where `dsec submit "
            "--code` uploads with the policy service's grant; default: DSEC_S3_ENDPOINT"
        ),
    )
    vault_addr: str | None = Field(default=None, description="Vault/OpenBao address (external)")
    vault_token: str | None = Field(default=None, repr=False, description="Vault/OpenBao token")
    key_source: Literal["file", "vault"] = Field(
        default="file",
        description="Where a service reads its certified key: $DSEC_HOME/keys (file) or a "
        "Vault KV v2 secret <mount>/<prefix>/<producer> (vault)",
    )
    vault_key_mount: str = Field(default="secret", description="KV v2 mount of producer keys")
    vault_key_prefix: str = Field(default="dsec/keys", description="Path of producer keys")
    key_check_s: float = Field(
        default=5.0, gt=0, description="How often a service re-reads its key source (rotation)"
    )
    trust_root: str | None = Field(
        default=None,
        description="Operator root public key (hex) that certifies every producer key; unset: "
        "$DSEC_HOME/trust/root.pub",
    )
    credential: Path | None = Field(
        default=None,
        description="A user credential file (`dsec admin issue-user`) the CLI signs with, "
        "instead of the identity `dsec login` installed",
    )
    stream_check_s: float = Field(
        default=30.0, gt=0, description="How often a service re-checks the stream's guarantees"
    )
    metrics_port: int = Field(default=0, description="Port for /metrics and /healthz (0 = free)")
    metrics_host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="Address /metrics and /healthz listen on: loopback for the embedded stack, "
        "0.0.0.0 (or ::) in containers, where Prometheus and probes reach it from outside",
    )
    node_id: str = Field(default="node-1", description="Name of this node")
    bpf_pin_dir: Path | None = Field(
        default=None,
        description="bpffs directory of this node agent's pinned egress maps (unset: "
        "/sys/fs/bpf/dsec-<node id>-<8 hex of the home's path>); node agents of one machine "
        "each have their own, and so do two stacks of one machine (e.g. the demo and a test run)",
    )
    sandbox_uid_base: int = Field(
        default=200_000,
        ge=1000,
        description="First of the 60,000 uids this node gives its sandboxes; node agents of one "
        "machine need disjoint ranges (`dsec up --nodes` sets them)",
    )
    org_policy: Path | None = Field(default=None, description="Org guardrail policy file")
    dns_upstream: str | None = Field(default=None, description="Upstream DNS host:port")
    tls_proxy_upstream_ca: Path | None = Field(
        default=None,
        description="CA bundle the node agent's HTTPS proxy verifies upstream hosts with "
        "(unset: the system trust store)",
    )
    dns_max_ttl_s: int = Field(
        default=300, ge=1, description="DNS answers open addresses at most this long"
    )
    egress_sandbox_quota: int = Field(
        default=1024, ge=1, description="Allow-map entries (address x port) per sandbox"
    )
    dns_max_answer_addresses: int = Field(
        default=32, ge=1, description="Addresses kept from one DNS answer"
    )
    dns_queries_per_s: float = Field(
        default=50.0, gt=0, description="DNS queries per second per sandbox (burst: twice)"
    )
    dns_trusted_targets: str = Field(
        default="",
        description="Addresses/networks DNS answers may open although loopback or the node's",
    )
    dns_max_wildcard_prefix: int = Field(
        default=64, ge=1, description="Characters of a name a wildcard rule lets a sandbox choose"
    )
    log_level: str = Field(default="INFO", description="Log level of services")
    resolve_cache_s: float = Field(
        default=300.0,
        ge=0,
        description="The builder answers the same requirements with the same lock for this "
        "long without asking the package index again (0 = always ask)",
    )
    snapshot_interval_s: float = Field(
        default=0.0, ge=0, description="Periodic snapshot of each running sandbox (0 = off)"
    )
    snapshot_keep: int = Field(
        default=10, ge=1, description="Periodic snapshots kept per sandbox (older are deleted)"
    )
    snapshot_pack_cache_mb: int = Field(
        default=1024,
        ge=0,
        description="The node's copies of the snapshot packs it stored or read, kept to this "
        "many MiB (least recently used removed first): a restore or rollback on the node "
        "reads them from local disk, not S3; every chunk is still checked (0 = off)",
    )
    snapshot_gc_min_grace_s: float = Field(
        default=3600.0,
        ge=0,
        description="The shortest grace a GC asked for on the bus gets: chunks younger than "
        "this stay (a snapshot being taken has uploaded packs no manifest names yet)",
    )
    snapshot_gc_wait_s: float = Field(
        default=30.0,
        ge=0,
        description="How long a GC waits for the snapshots being taken (in any process) to "
        "end before it gives up (a GC and a create never run at once)",
    )
    # The node agent's IPC broker: what one sandbox may take (see the README's
    # "Communication-plane bounds and identity").
    ipc_fd_budget: int = Field(
        default=4096, ge=3, description="fds the IPC broker may hold (at most RLIMIT_NOFILE / 2)"
    )
    ipc_connections_per_sandbox: int = Field(
        default=32, ge=1, description="IPC broker connections one sandbox may hold"
    )
    ipc_pending_per_sandbox: int = Field(
        default=8, ge=1, description="IPC connections of one sandbox that have not said hello"
    )
    ipc_pending_total: int = Field(
        default=64, ge=1, description="IPC connections of the node that have not said hello"
    )
    ipc_hello_timeout_s: float = Field(
        default=2.0, gt=0, description="An IPC connection without hello is closed after this"
    )
    ipc_channels_per_agent: int = Field(
        default=256, ge=1, description="Live shared-memory channels one agent may hold as caller"
    )
    ipc_connects_per_sandbox: int = Field(
        default=16, ge=1, description="IPC connects one sandbox may have under way at once"
    )
    sandbox_max_files: int = Field(
        default=65_536, ge=64, description="Node maximum of a spec's resources.files"
    )
    sandbox_max_pids: int = Field(
        default=16_384,
        ge=16,
        description="Node maximum of a spec's resources.pids (the node's sandboxes together "
        "also hold at most 3/4 of the host's pid_max)",
    )
    sandbox_max_sockets: int = Field(
        default=4096,
        ge=16,
        description="IP sockets one sandbox may hold at once (the node's sandboxes together "
        "at most half of its ephemeral port range: sandboxes share the host's ports)",
    )
    sandbox_max_disk: int = Field(
        default=64 * 2**30, ge=16 * 2**20, description="Node maximum of resources.disk (bytes)"
    )
    sandbox_max_log_bytes: int = Field(
        default=2**30, ge=64 * 2**10, description="Node maximum of resources.log_bytes (bytes)"
    )
    sandbox_max_disk_read_rate: int = Field(
        default=4 * 2**30,
        ge=2**20,
        description="Node maximum of resources.disk_read_rate (bytes per second)",
    )
    sandbox_max_disk_write_rate: int = Field(
        default=4 * 2**30,
        ge=2**20,
        description="Node maximum of resources.disk_write_rate (bytes per second)",
    )
    sandbox_max_disk_iops: int = Field(
        default=1_000_000, ge=64, description="Node maximum of resources.disk_iops"
    )
    sandbox_keep_hours: float = Field(
        default=24.0, ge=0, description="Ended sandboxes' directories are removed after this"
    )
    sandbox_keep_max: int = Field(
        default=200, ge=0, description="At most this many ended sandboxes' directories are kept"
    )

    tenant_queue: int = Field(
        default=256,
        ge=1,
        le=TENANT_QUEUE_MAX,
        description="Requests one tenant may have waiting or running at once at an instance of "
        "a service's request handlers (policy, builder, a node agent's launches, snapshots and "
        "rollbacks); the next is ended with its failure event. At most 512, what an instance "
        "holds for all tenants",
    )

    policy_event_burst: int = Field(
        default=5, ge=0, description="Refusals per sandbox, rule and minute sent as events"
    )
    policy_summary_interval_s: float = Field(
        default=10.0, gt=0, description="How often further refusals are published as counts"
    )
    policy_flood_limit: int = Field(
        default=100_000, ge=0, description="Refusals after which a sandbox is flooding (0 = none)"
    )
    policy_flood_stop: bool = Field(
        default=True, description="Stop a flooding sandbox (sandbox.exited reason policy_flood)"
    )

    # Migration, path criu (docs/migration.md).
    migration_checkpointable: bool = Field(
        default=False,
        description="Start sandboxes so that CRIU can checkpoint them (migration path criu); "
        "they give up Landlock's abstract-unix-socket scope (docs/migration.md)",
    )

    # Node presence (README, "Nodes and inventory").
    heartbeat_s: float = Field(
        default=5.0, gt=0, description="How often a node agent publishes node.heartbeat"
    )
    node_labels: str = Field(
        default="", description="Labels of this node for placement: k=v,k=v (node agent)"
    )
    node_inventory: Path | None = Field(
        default=None,
        description="A declared inventory (YAML/JSON: GPUs, optionally cpus/memory) that "
        "replaces the GPU probe, for nodes without NVML (tests, simulations)",
    )
    nvml_timeout_s: float = Field(
        default=30.0,
        gt=0,
        le=3600,
        description="How long a node agent waits for one NVML call; past it NVML counts as not "
        "answering until that call returns (docs/gpu.md)",
    )
    cpu_allocation_ratio: float = Field(
        default=4.0,
        gt=0,
        le=64,
        description="CPUs a node offers per core for placement (CPU is compressible: each "
        "sandbox is capped by its own cpu.max; memory is never overcommitted)",
    )
    max_sandboxes: int = Field(default=64, ge=1, description="Sandboxes this node accepts at most")
    # The scheduler (README, "Scheduling").
    node_lost_s: float = Field(
        default=15.0, gt=0, description="A node silent this long is lost; its sandboxes move"
    )
    max_placements: int = Field(
        default=3, ge=1, description="Placements of a sandbox before a lost node fails it"
    )
    scheduler_policy: str = Field(
        default="dsec",
        description="Placement policy of compute units (README, 'Placement'): dsec, fgd, "
        "bestfit, random, leastloaded",
    )
    scheduler_quotas: str | None = Field(
        default=None,
        description="Path of a YAML/JSON file {tenant: {gpus, gpu_milli, cpus, units}}: what each "
        "team may hold at once (validated at start)",
    )

    @field_validator("s3_public_url")
    @classmethod
    def _public_url(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"https?://[A-Za-z0-9.\[\]:_-]+", value):
            raise ValueError(
                f"{value[:80]!r} is not an address users reach the object store at: expected "
                "http://HOST:PORT or https://HOST:PORT, without a path"
            )
        return value

    def endpoint(self, name: str) -> Any:
        """Return setting ``name`` if set, else the value ``dsec up`` recorded in stack.json."""
        value = getattr(self, name)
        return value if value is not None else self.stack_state.get(name)

    def egress_dirs(self) -> tuple[Path, Path]:
        """``(pin dir, state dir)`` of this node agent's egress layer: the maps pinned in bpffs
        and each sandbox's plan in tmpfs (both gone at reboot, like the programs)."""
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.node_id):
            raise ValueError(
                f"DSEC_NODE_ID {self.node_id!r}: letters, digits, '_' and '-' only (it names "
                "this node's directories)"
            )
        tag = self._node_tag()
        pins = self.bpf_pin_dir or Path(f"/sys/fs/bpf/dsec-{tag}")
        return pins / "egress", Path(f"/run/dsec-{tag}") / "egress"

    def _node_tag(self) -> str:
        # Two stacks on one machine (a demo and a test run) may both have a ``node-1``: the home
        # tells them apart, so neither adopts nor removes the other's pinned maps.
        return f"{self.node_id}-{blake3.blake3(str(self.home.absolute()).encode()).hexdigest()[:8]}"

    def state_journal_dir(self, shm: Path = Path("/dev/shm")) -> Path:
        """Where this node agent's state keeper journals hot deltas: node-local shared memory
        (``/dev/shm/dsec-<node>-<8 hex of the home's path>/state``: survives sandboxes, not the
        node); without ``/dev/shm``, ``$DSEC_HOME/state/journal``."""
        if not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", self.node_id):
            raise ValueError(
                f"DSEC_NODE_ID {self.node_id!r}: letters, digits, '_' and '-' only (it names "
                "this node's directories)"
            )
        if shm.is_dir():
            return shm / f"dsec-{self._node_tag()}" / "state"
        return self.home.absolute() / "state" / "journal"

    def nats_endpoint(self) -> str:
        """The NATS URL to use (setting, stack.json, or the conventional local default)."""
        return str(self.endpoint("nats_url") or "nats://127.0.0.1:4222")

    @cached_property
    def stack_state(self) -> dict[str, Any]:
        """Endpoints written by ``dsec up`` (``$DSEC_HOME/stack.json``), or ``{}``."""
        path = self.home / "stack.json"
        if not path.exists():
            return {}
        data: dict[str, Any] = json.loads(path.read_text())
        return data


def settings_problem(exc: BaseException) -> str | None:
    """A bad ``DSEC_*`` setting, as one line naming the variable (``None``: ``exc`` is not
    the settings' validation error). Pydantic is not imported to tell."""
    if type(exc).__name__ != "ValidationError" or getattr(exc, "title", None) != "Settings":
        return None
    first = exc.errors()[0]  # type: ignore[attr-defined]
    field = "DSEC_" + ".".join(str(p) for p in first["loc"]).upper()
    return f"{field}: {first['msg']}"
