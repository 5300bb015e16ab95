"""Compile a validated spec into the :class:`EnforcementPlan` the other services enforce.

The plan is what ``spec.validated`` carries (typed: ``SpecValidated.plan``): every value
normalized and typed for its enforcer (seconds, bytes, millicores, sorted de-duplicated ports
and paths), secrets as references only — never a value; each egress and semantic rule with the
spec line it came from, so an enforcer names the line to change without re-reading the YAML.
"""

from __future__ import annotations

import ipaddress
from typing import Any, Literal

import blake3
from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsec_core.spec.models import (
    Dependency,
    GpuNeeds,
    Mount,
    SandboxSpec,
    State,
    ToolPolicySpec,
    accepted_models,
)
from dsec_core.spec.models import EgressRule as SpecEgressRule
from dsec_core.spec.source import SourceMap
from dsec_core.spec.units import Rate

PLAN_SCHEMA_VERSION: Literal["1"] = "1"


class PlanModel(BaseModel):
    """Base of every plan model: immutable, strict about fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class PackageRequirement(PlanModel):
    """A dependency for the builder: canonical name, specifier, extras, marker."""

    name: str
    specifier: str
    extras: tuple[str, ...] = ()
    marker: str | None = None

    def requirement(self) -> str:
        """As a PEP 508 requirement string (``rich[jupyter]>=13; python_version>='3.11'``)."""
        extras = f"[{','.join(self.extras)}]" if self.extras else ""
        marker = f"; {self.marker}" if self.marker else ""
        return f"{self.name}{extras}{self.specifier}{marker}"


class PlanEgressRule(PlanModel):
    """One allowed destination. ``kind`` says how to match: exact name, wildcard suffix, CIDR."""

    kind: Literal["domain", "wildcard", "cidr", "any"]
    domain: str | None = Field(default=None, description="Exact name, or suffix for wildcard")
    cidr: str | None = None
    ports: tuple[int, ...]
    rate_limit: Rate | None = None
    internal_only: bool = False
    protocols: tuple[Literal["tcp", "udp"], ...] = Field(
        default=("tcp",), description="Transports the rule opens (UDP only when declared)"
    )
    tls_proxy: bool = Field(
        default=False, description="Reached only through the node agent's request-counting proxy"
    )
    spec_line: int | None = Field(default=None, description="Line of the rule in the spec")

    def allows(self, host: str, port: int) -> bool:
        """Whether this rule admits ``host:port`` (``host`` may be a name or an address)."""
        if port not in self.ports:
            return False
        host = host.lower().rstrip(".")
        if self.kind == "any":
            return True
        if self.kind == "domain":
            return host == self.domain
        if self.kind == "wildcard":
            return host.endswith(f".{self.domain}")
        try:
            return ipaddress.ip_address(host) in ipaddress.ip_network(str(self.cidr))
        except ValueError:
            return False


class FilesystemPlan(PlanModel):
    """Landlock rules: paths readable, paths writable (writable implies readable)."""

    read: tuple[str, ...]
    write: tuple[str, ...]


class SemanticPlanRule(PlanModel):
    """A rule of the in-process layer, in order (first match wins)."""

    on: Literal["open", "subprocess", "connect", "http"]
    path: str | None = None
    argv: tuple[str, ...] | None = None
    host: str | None = None
    url: str | None = None
    action: Literal["allow", "redirect", "log", "deny"]
    target: str | None = None
    message: str | None = None
    spec_line: int | None = Field(default=None, description="Line of the rule in the spec")


class GpuLimits(PlanModel):
    """GPU placement needs."""

    count: int
    memory_bytes: int | None
    type: str | None


class ResourceLimits(PlanModel):
    """cgroup limits, the wall-clock timeout and the sandbox's own bounds (defaults: what a
    plan compiled before they existed gets)."""

    cpu_millicores: int
    memory_bytes: int
    pids: int
    gpu: GpuLimits | None
    timeout_s: int | None
    files: int = 1024
    disk_bytes: int = 256 * 2**20
    log_bytes: int = 64 * 2**20
    disk_read_bps: int = 256 * 2**20
    disk_write_bps: int = 128 * 2**20
    disk_iops: int = 4096


class SecretInjection(PlanModel):
    """A secret to fetch from Vault before start and expose as an env var (reference only)."""

    env_var: str
    vault_mount: str
    vault_path: str
    key: str
    ttl_s: int


class PlainEnv(PlanModel):
    """A non-secret environment variable."""

    name: str
    value: str


class MountPlan(PlanModel):
    """A mount to prepare before start."""

    path: str
    scheme: Literal["s3", "configmap"]
    bucket: str | None = None
    prefix: str | None = None
    configmap: str | None = None
    key: str | None = None
    mode: Literal["ro", "ro-encrypted", "rw"]
    encrypted: bool
    cache_ttl_s: int | None = None


class UnitPlan(PlanModel):
    """One compute unit the scheduler places: a task of a topology, or a single sandbox's
    ``main``."""

    name: str
    gpu_models: tuple[str, ...] = Field(
        default=(), description="Acceptable canonical GPU models; empty: any, or no GPU"
    )
    gpus: int = Field(default=0, description="Whole GPUs (0: none, or a share)")
    gpu_milli: int = Field(default=0, description="A share of one GPU in thousandths")
    min_gpu_memory_bytes: int = 0
    cpu_millicores: int
    memory_bytes: int
    nvlink_group: str | None = Field(
        default=None, description="NVLink group label: the unit's GPUs share one NVLink domain"
    )
    max_temperature_c: float | None = None
    entrypoint: tuple[str, ...] | None = None
    spec_line: int | None = Field(default=None, description="Line of the task in the spec")


class EdgePlan(PlanModel):
    """Two units that talk, and the transport they need."""

    src: str
    dst: str
    protocol: Literal["nvlink-p2p", "rdma-over-converged-ethernet", "shm"]


class MigrationPlan(PlanModel):
    """When and how a running unit should move (the spec's ``migration:``)."""

    max_temperature_c: float | None = None
    nvlink_congestion_threshold_pct: float | None = None
    on: tuple[str, ...] = Field(
        default=("temperature", "xid", "ecc", "lost"),
        description="Signals that move it (gpu.degraded's signal); empty: none",
    )
    paths: tuple[str, ...] = Field(
        default=("handover", "criu"), description="Allowed paths, preferred first"
    )
    max_interruption_ms: float | None = None
    thresholds: dict[str, float] = Field(
        default_factory=dict,
        description="The unit's own limits (temperature_c, xid_errors, ecc_uncorrected, "
        "nvlink_errors, nvlink_utilization_pct): stricter than the operator's only",
    )


class TopologyPlan(PlanModel):
    """The compute units of a spec, the edges between them, and how they are scheduled."""

    units: tuple[UnitPlan, ...]
    edges: tuple[EdgePlan, ...] = ()
    migration: MigrationPlan = MigrationPlan()
    priority: int = 0


class ToolPlan(PlanModel):
    """The spec's ``tools.<name>``, compiled (seconds as numbers): the form the node agent
    hands the SDK in ``$DSEC_TOOLS`` (merged with the catalogue's defaults) and reads to
    diagnose a degraded tool."""

    timeout_s: float | None = None
    retries: dict[str, Any] = Field(default_factory=dict)
    breaker: dict[str, float] = Field(default_factory=dict)
    fallback: tuple[str, ...] = ()
    degraded_after: int = 3
    secret: str | None = None
    hosts: tuple[str, ...] = ()
    family: str | None = None
    spec_line: int | None = None


class StatePlan(PlanModel):
    """The spec's ``state:`` section, compiled: how the node agent's state keeper checkpoints,
    merges, uploads and keeps an agent's state, and whether the sandbox restarts after a crash
    (see docs/state.md). Durations in seconds."""

    checkpoint_interval_s: float | None = Field(
        default=5.0, description="Automatic checkpoint period (hot tier); None: explicit only"
    )
    warm_interval_s: float = Field(
        default=300.0, description="Warm tier: captured and merged to the node's disk this often"
    )
    cold_interval_s: float = Field(
        default=3600.0, description="Cold tier: re-verified in the object store this often"
    )
    tiers: tuple[tuple[str, Literal["hot", "warm", "cold"]], ...] = Field(
        default=(), description="Container name -> tier overrides (others: their kind's default)"
    )
    warm_snapshots_kept: int = Field(default=3, description="Warm snapshots kept per agent")
    max_bytes: int = Field(
        default=1 << 30,
        description="The agent's state on the node (its warm snapshot + the journal after it) "
        "may not pass this: further checkpoints are refused (error `quota`)",
    )
    hot_retention_s: float = Field(
        default=7 * 24 * 3600.0,
        description="Hot deltas older than this are dropped even without a warm merge",
    )
    encryption: Literal["tenant-key"] = Field(
        default="tenant-key", description="Deltas and snapshots are encrypted with the tenant key"
    )
    restart: Literal["on-failure", "never"] = Field(
        default="on-failure", description="Restart the sandbox in place when it dies"
    )
    max_restarts: int = Field(default=5, description="Restarts before it ends for good")


class RecordPlan(PlanModel):
    """The spec's ``record:`` section (docs/experiments.md)."""

    tools: bool = True
    http: tuple[str, ...] = ()


class EnforcementPlan(PlanModel):
    """Everything the builder, the context injector and the node agent enforce for one spec."""

    schema_version: Literal["1"] = PLAN_SCHEMA_VERSION
    name: str
    tenant: str = Field(
        default="default",
        description="The submitter's tenant, from its signed identity (never from the YAML)",
    )
    tenant_vault: tuple[str, ...] = Field(
        default=(),
        description=(
            "The tenant's Vault prefixes (MOUNT/PATH-PREFIX/) from the org policy: the node agent "
            "reads secrets with a token limited to them; empty means secret/<tenant>/"
        ),
    )
    task_group: str | None = Field(
        default=None, description="The spec's task group; None: a group of its own (the name)"
    )
    base: str
    entrypoint: tuple[str, ...] | None
    workdir: str
    dependencies: tuple[PackageRequirement, ...]
    build_options: tuple[str, ...]
    resources: ResourceLimits
    dns_passthrough: bool
    egress: tuple[PlanEgressRule, ...]
    filesystem: FilesystemPlan
    semantic: tuple[SemanticPlanRule, ...]
    secrets: tuple[SecretInjection, ...]
    env: tuple[PlainEnv, ...]
    mounts: tuple[MountPlan, ...]
    exclude_patterns: tuple[str, ...]
    code_max_size: int = Field(
        default=256 * 2**20, description="Bytes the code bundle may expand to on the node"
    )
    spec_file: str = Field(
        default="dsec.yaml", description="The spec's file name, as the rules' lines refer to it"
    )
    state: StatePlan | None = Field(
        default=None, description="The spec's `state:` section; None: no state plane"
    )
    record: RecordPlan | None = Field(
        default=None, description="The spec's `record:` section; None: nothing recorded"
    )
    replay: str | None = Field(
        default=None, description="The recording every recorded call is answered from"
    )
    tools: dict[str, ToolPlan] = Field(
        default_factory=dict, description="The spec's `tools:` section (docs/tools.md)"
    )
    topology: TopologyPlan = Field(
        description="The compute units to place (a single sandbox: one unit, main); a plan "
        "compiled before topologies gets main from its resources"
    )

    @model_validator(mode="before")
    @classmethod
    def _main_unit_of_older_plans(cls, data: Any) -> Any:
        if isinstance(data, dict) and "topology" not in data and "resources" in data:
            limits = ResourceLimits.model_validate(data["resources"])
            data = {**data, "topology": TopologyPlan(units=(_main_unit(limits, None),))}
        return data

    @property
    def effective_task_group(self) -> str:
        """The task group the sandbox's agent joins: ``task_group``, else its own ``name``."""
        return self.task_group or self.name

    def digest(self) -> str:
        """BLAKE3 of the plan's canonical JSON: equal plans, equal digests."""
        return blake3.blake3(self.model_dump_json().encode()).hexdigest()


def compile_plan(
    spec: SandboxSpec,
    tenant: str = "default",
    source: SourceMap | None = None,
    spec_file: str = "dsec.yaml",
) -> EnforcementPlan:
    """Compile a validated spec into its enforcement plan (pure) for ``tenant``; with the
    spec's ``source`` map, each egress and semantic rule carries its line in ``spec_file``."""
    context = spec.runtime_context
    policy = spec.security_policy
    return EnforcementPlan(
        name=spec.name,
        tenant=tenant,
        task_group=spec.task_group,
        base=spec.base,
        entrypoint=spec.entrypoint,
        workdir=spec.workdir,
        dependencies=tuple(_requirement(d) for d in spec.dependencies),
        build_options=spec.build_options,
        resources=_resources(spec),
        dns_passthrough=spec.security_policy.dns_passthrough,
        egress=tuple(
            _egress(rule, _line(source, ("security_policy", "network", "egress", i)))
            for i, rule in enumerate(policy.network.egress)
        ),
        filesystem=_filesystem(spec),
        semantic=tuple(
            SemanticPlanRule(
                on=r.on,
                path=r.match.path,
                argv=r.match.argv,
                host=r.match.host,
                url=r.match.url,
                action=r.action,
                target=r.target,
                message=r.message,
                spec_line=_line(source, ("security_policy", "semantic", i)),
            )
            for i, r in enumerate(policy.semantic)
        ),
        secrets=_secrets(spec),
        env=tuple(PlainEnv(name=e.name, value=e.value) for e in context.env_vars if e.value),
        mounts=tuple(_mount(m) for m in context.mounts),
        exclude_patterns=spec.include_code.exclude_patterns,
        code_max_size=spec.include_code.max_size,
        spec_file=spec_file,
        state=None if spec.state is None else _state(spec.state),
        record=None
        if spec.record is None
        else RecordPlan(tools=spec.record.tools, http=spec.record.http),
        replay=spec.replay,
        tools={
            name: _tool(policy, _line(source, ("tools", name)))
            for name, policy in spec.tools.items()
        },
        topology=_topology(spec, source),
    )


def _tool(policy: ToolPolicySpec, line: int | None) -> ToolPlan:
    retries = policy.retries
    return ToolPlan(
        timeout_s=policy.timeout.total_seconds() if policy.timeout else None,
        retries={
            "attempts": retries.attempts,
            "max_time_s": retries.max_time.total_seconds(),
            "backoff_s": retries.backoff.total_seconds(),
            "max_backoff_s": retries.max_backoff.total_seconds(),
            "on": list(retries.on),
        },
        breaker={
            "failures": policy.breaker.failures,
            "reset_after_s": policy.breaker.reset_after.total_seconds(),
        },
        fallback=policy.fallback,
        degraded_after=policy.degraded_after,
        secret=policy.secret,
        hosts=policy.hosts,
        family=policy.family,
        spec_line=line,
    )


def _state(state: State) -> StatePlan:
    interval = state.checkpoint_interval.total_seconds()
    return StatePlan(
        checkpoint_interval_s=interval or None,
        warm_interval_s=state.warm_interval.total_seconds(),
        cold_interval_s=state.cold_interval.total_seconds(),
        tiers=tuple(sorted(state.tiers.items())),
        warm_snapshots_kept=state.retention.warm_snapshots,
        max_bytes=int(state.max_size),
        hot_retention_s=state.retention.hot.total_seconds(),
        encryption=state.encryption,
        restart=state.restart,
        max_restarts=state.max_restarts,
    )


def _line(source: SourceMap | None, path: tuple[str | int, ...]) -> int | None:
    return source.locate(path).line if source is not None else None


def _requirement(dep: Dependency) -> PackageRequirement:
    return PackageRequirement(
        name=dep.canonical_name,
        specifier=dep.version,
        extras=tuple(sorted(set(dep.extras))),
        marker=dep.markers,
    )


def _resources(spec: SandboxSpec) -> ResourceLimits:
    res = spec.resources
    gpu = None
    if res.gpu is not None:
        gpu = GpuLimits(count=res.gpu.count, memory_bytes=res.gpu.memory, type=res.gpu.type)
    return ResourceLimits(
        cpu_millicores=max(1, round(res.cpu * 1000)),
        memory_bytes=res.memory,
        pids=res.pids,
        gpu=gpu,
        timeout_s=None if spec.timeout is None else max(1, round(spec.timeout.total_seconds())),
        files=res.files,
        disk_bytes=res.disk,
        log_bytes=res.log_bytes,
        disk_read_bps=res.disk_read_rate,
        disk_write_bps=res.disk_write_rate,
        disk_iops=res.disk_iops,
    )


def _main_unit(
    limits: ResourceLimits,
    entrypoint: tuple[str, ...] | None,
    max_temperature_c: float | None = None,
) -> UnitPlan:
    """A single sandbox's one unit, from its resources (``gpu.type`` resolved when known)."""
    gpu = limits.gpu
    models: tuple[str, ...] = ()
    if gpu is not None and gpu.type is not None:
        known = accepted_models((gpu.type,))
        if gpu.memory_bytes:
            roomy = tuple(
                m for m in known if not m.memory_bytes or m.memory_bytes >= gpu.memory_bytes
            )
            known = roomy or known
        # An unknown model stays as written: no node matches it (the loader warns).
        models = tuple(m.name for m in known) or (gpu.type,)
    return UnitPlan(
        name="main",
        gpu_models=models,
        gpus=gpu.count if gpu is not None else 0,
        min_gpu_memory_bytes=(gpu.memory_bytes or 0) if gpu is not None else 0,
        cpu_millicores=limits.cpu_millicores,
        memory_bytes=limits.memory_bytes,
        max_temperature_c=max_temperature_c,
        entrypoint=entrypoint,
    )


def _topology(spec: SandboxSpec, source: SourceMap | None) -> TopologyPlan:
    mig = spec.migration
    limit = (
        mig.max_temperature_c if mig.max_temperature_c is not None else mig.thresholds.temperature_c
    )
    thresholds = {k: float(v) for k, v in mig.thresholds.model_dump().items() if v is not None}
    if mig.max_temperature_c is not None:
        thresholds.setdefault("temperature_c", mig.max_temperature_c)
    if mig.nvlink_congestion_threshold is not None:
        thresholds.setdefault("nvlink_utilization_pct", mig.nvlink_congestion_threshold)
    migration = MigrationPlan(
        max_temperature_c=limit,
        nvlink_congestion_threshold_pct=mig.nvlink_congestion_threshold,
        on=mig.signals,
        paths=mig.paths,
        max_interruption_ms=mig.max_interruption_ms,
        thresholds=thresholds,
    )
    if not spec.tasks:
        main = _main_unit(_resources(spec), spec.entrypoint, limit)
        return TopologyPlan(units=(main,), migration=migration, priority=spec.scheduling.priority)
    needs = spec.unit_needs()
    units = []
    for index, task in enumerate(spec.tasks):
        unit = task.compute_unit
        need = needs.get(task.name, GpuNeeds())
        cpu = unit.cpu if unit.cpu is not None else spec.resources.cpu
        temperature = unit.max_temperature_c
        units.append(
            UnitPlan(
                name=task.name,
                gpu_models=need.models,
                gpus=need.gpus,
                gpu_milli=need.gpu_milli,
                min_gpu_memory_bytes=need.min_memory_bytes,
                cpu_millicores=max(1, round(cpu * 1000)),
                memory_bytes=unit.memory if unit.memory is not None else spec.resources.memory,
                nvlink_group=unit.nvlink_affinity,
                max_temperature_c=temperature if temperature is not None else limit,
                entrypoint=task.command,
                spec_line=_line(source, ("tasks", index)),
            )
        )
    return TopologyPlan(
        units=tuple(units),
        edges=tuple(
            EdgePlan(src=edge.src, dst=edge.to, protocol=edge.protocol)
            for edge in spec.communication
        ),
        migration=migration,
        priority=spec.scheduling.priority,
    )


def _egress(rule: SpecEgressRule, line: int | None = None) -> PlanEgressRule:
    kind: Literal["domain", "wildcard", "cidr", "any"] = "domain"
    domain = rule.domain
    if rule.cidr is not None:
        kind = "cidr"
    elif domain == "*":
        kind, domain = "any", None
    elif domain is not None and domain.startswith("*."):
        kind, domain = "wildcard", domain[2:]
    return PlanEgressRule(
        kind=kind,
        domain=domain,
        cidr=rule.cidr,
        ports=tuple(sorted(set(rule.ports))),
        rate_limit=rule.rate_limit,
        internal_only=rule.allow_internal_only,
        protocols=rule.transports,
        tls_proxy=rule.tls_proxy,
        spec_line=line,
    )


def _filesystem(spec: SandboxSpec) -> FilesystemPlan:
    # Mounts are granted by their mode; the code directory is always readable.
    fs = spec.security_policy.filesystem
    mounts = spec.runtime_context.mounts
    write = set(fs.write_allowed) | {m.path for m in mounts if m.mode == "rw"}
    read = set(fs.read_allowed) | {m.path for m in mounts} | {spec.workdir}
    return FilesystemPlan(read=tuple(sorted(read - write)), write=tuple(sorted(write)))


def _secrets(spec: SandboxSpec) -> tuple[SecretInjection, ...]:
    out = []
    for env in spec.runtime_context.env_vars:
        ref = env.vault
        if ref is None:
            continue
        out.append(
            SecretInjection(
                env_var=env.name,
                vault_mount=ref.mount,
                vault_path=ref.path,
                key=ref.key,
                ttl_s=max(1, round(env.effective_ttl.total_seconds())),
            )
        )
    return tuple(out)


def _mount(mount: Mount) -> MountPlan:
    src = mount.parsed_source
    return MountPlan(
        path=mount.path,
        scheme=src.scheme,
        bucket=src.bucket,
        prefix=src.prefix,
        configmap=src.name,
        key=src.key,
        mode=mount.mode,
        encrypted=mount.mode == "ro-encrypted",
        cache_ttl_s=None if mount.cache_ttl is None else round(mount.cache_ttl.total_seconds()),
    )
