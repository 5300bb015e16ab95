"""Org guardrails: rules a spec cannot override, each with an id and a severity.

The org policy is a YAML file (``DSEC_ORG_POLICY``; the packaged ``guardrails.default.yaml``
when unset)::

    version: "1"
    rules:
      - id: ORG-NET-001
        kind: no-egress-anywhere
        severity: error
      - id: ORG-RES-001
        kind: max-memory
        max: 64GiB

Kinds: ``no-egress-anywhere``, ``forbid-domains``, ``forbid-write``, ``max-secret-ttl``,
``max-memory``, ``max-code-size``, ``max-cpu``, ``max-gpus``, ``max-timeout``,
``require-timeout``, ``require-rate-limit``, ``allowed-vault-mounts``, ``allowed-bases``,
``no-dns-passthrough``, ``forbid-host-paths``. ``severities`` raises or lowers any diagnostic by
rule id (e.g. ``infer.path-missing: error``); ``tenants`` maps a tenant to the Vault, S3 and
config map prefixes its specs may use (see :mod:`dsec_rules.scope`).
"""

from __future__ import annotations

import fnmatch
import ipaddress
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Annotated, Literal

from dsec_core.identity import reserved_tenant
from dsec_core.spec import (
    ByteSize,
    DocumentResult,
    Duration,
    SandboxSpec,
    Severity,
    SourceMap,
    SpecError,
    format_duration,
    format_size,
    load_document,
)
from dsec_core.spec.source import FieldPath
from pydantic import BaseModel, ConfigDict, Field

_EGRESS: FieldPath = ("security_policy", "network", "egress")
_WRITE: FieldPath = ("security_policy", "filesystem", "write_allowed")


class _Rule(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(pattern=r"^[A-Z][A-Z0-9]*(-[A-Z0-9]+)+$", examples=["ORG-NET-001"])
    severity: Severity = Severity.ERROR
    message: str | None = Field(default=None, description="Extra text shown with each violation")


class NoEgressAnywhere(_Rule):
    """No ``domain: "*"``, no wildcard of a whole TLD (``*.com``), no ``/0`` network."""

    kind: Literal["no-egress-anywhere"]


class ForbidDomains(_Rule):
    """Egress to domains matching these globs is forbidden."""

    kind: Literal["forbid-domains"]
    domains: tuple[str, ...] = Field(min_length=1)


class ForbidWrite(_Rule):
    """No write grant to (or above) these paths; ``/`` matches only ``/`` itself."""

    kind: Literal["forbid-write"]
    paths: tuple[str, ...] = Field(min_length=1)


class MaxSecretTtl(_Rule):
    """Secret leases no longer than ``max``."""

    kind: Literal["max-secret-ttl"]
    max: Duration


class MaxMemory(_Rule):
    """Memory limit no larger than ``max``."""

    kind: Literal["max-memory"]
    max: ByteSize


class MaxCodeSize(_Rule):
    """``include_code.max_size`` (the code bundle's size once extracted) no larger than ``max``;
    the spec's default (256MiB) counts when unset."""

    kind: Literal["max-code-size"]
    max: ByteSize


class MaxCpu(_Rule):
    """CPU limit no larger than ``max`` cores."""

    kind: Literal["max-cpu"]
    max: float = Field(gt=0)


class MaxGpus(_Rule):
    """At most ``max`` GPUs."""

    kind: Literal["max-gpus"]
    max: int = Field(ge=0)


class MaxTimeout(_Rule):
    """A timeout no longer than ``max`` (unset counts as infinite)."""

    kind: Literal["max-timeout"]
    max: Duration


class RequireRateLimit(_Rule):
    """Every egress rule to a public destination has a ``rate_limit``."""

    kind: Literal["require-rate-limit"]


class AllowedVaultMounts(_Rule):
    """Secrets only from these Vault mounts."""

    kind: Literal["allowed-vault-mounts"]
    mounts: tuple[str, ...] = Field(min_length=1)


class AllowedBases(_Rule):
    """Base images only with these prefixes."""

    kind: Literal["allowed-bases"]
    prefixes: tuple[str, ...] = Field(min_length=1)


class NoDnsPassthrough(_Rule):
    """DNS must go through the sandbox's filtering resolver."""

    kind: Literal["no-dns-passthrough"]


class ForbidHostPaths(_Rule):
    """No ``read_allowed``/``write_allowed`` grant at, inside or above these host paths (a
    ``read_allowed`` path that exists on the host is bound into the sandbox from the host).

    Grants inside the sandbox's own view (its workdir, its mounts' targets, ``/tmp``) are always
    fine. ``stack_dirs: true`` also protects ``DSEC_HOME`` and the stack's data directories.
    ``allow`` lists exceptions the operator accepts (e.g. ``/usr/share/dict``).
    """

    kind: Literal["forbid-host-paths"]
    paths: tuple[str, ...] = Field(min_length=1)
    stack_dirs: bool = True
    allow: tuple[str, ...] = ()


Rule = Annotated[
    NoEgressAnywhere
    | ForbidDomains
    | ForbidWrite
    | MaxSecretTtl
    | MaxMemory
    | MaxCodeSize
    | MaxCpu
    | MaxGpus
    | MaxTimeout
    | RequireRateLimit
    | AllowedVaultMounts
    | AllowedBases
    | NoDnsPassthrough
    | ForbidHostPaths,
    Field(discriminator="kind"),
]


TenantName = Annotated[str, Field(pattern=r"^[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?$")]


_SEGMENT = r"[A-Za-z0-9_-][A-Za-z0-9_.-]*/"  # no ".", ".." nor hidden segments
VaultPrefix = Annotated[
    str, Field(pattern=rf"^{_SEGMENT}(?:{_SEGMENT})*$", examples=["secret/acme/"])
]
"""``MOUNT/PATH-PREFIX/``: whole path segments, ending with ``/`` (``secret/acme`` would also
match ``secret/acme-other/``)."""
S3Prefix = Annotated[
    str, Field(pattern=rf"^(?:\*|[a-z0-9][a-z0-9.-]{{1,61}}[a-z0-9])/(?:{_SEGMENT})*$")
]
"""``BUCKET/KEY-PREFIX/`` (``*`` = any bucket but the system bucket), ending with ``/``."""


class TenantScope(BaseModel):
    """What a tenant's specs may reference. Every entry is a prefix (or glob for config maps).

    * ``vault``: ``MOUNT/PATH-PREFIX/`` of KV v2 secrets, e.g. ``secret/acme/``.
    * ``s3``: ``BUCKET/KEY-PREFIX/``; the bucket ``*`` means any bucket but the system bucket.
    * ``configmaps``: globs on config map names, e.g. ``acme-*``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    vault: tuple[VaultPrefix, ...] = ()
    s3: tuple[S3Prefix, ...] = ()
    configmaps: tuple[str, ...] = ()


def conventional_scope(tenant: str) -> TenantScope:
    """The scope of a tenant the org policy does not list: ``secret/<t>/``, ``*/<t>/``,
    ``<t>.*``. Each is bounded by a character no tenant name holds (``/``, ``.``): before,
    tenant ``acme``'s config maps were ``acme-*``, which held tenant ``acme-corp``'s. A
    reserved name (:func:`dsec_core.identity.reserved_tenant`) gets nothing."""
    if reserved_tenant(tenant) is not None:  # the stack's own paths: nothing by convention
        return TenantScope()
    return TenantScope(
        vault=(f"secret/{tenant}/",), s3=(f"*/{tenant}/",), configmaps=(f"{tenant}.*",)
    )


class OrgPolicy(BaseModel):
    """An organisation's guardrails, tenants' scopes and severity overrides."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal["1"]
    severities: dict[str, Severity] = Field(
        default_factory=dict,
        description="Rule id -> severity, e.g. infer.path-missing: error (any diagnostic's id)",
    )
    tenants: dict[TenantName, TenantScope] = Field(
        default_factory=dict, description="Tenant -> its scope; unlisted tenants: the convention"
    )
    rules: tuple[Rule, ...] = ()

    def scope(self, tenant: str) -> TenantScope:
        """The tenant's scope: listed, or :func:`conventional_scope`."""
        return self.tenants.get(tenant) or conventional_scope(tenant)


@dataclass(frozen=True)
class StackFacts:
    """What the policy service knows about the stack it protects.

    Attributes:
        system_bucket: the S3 bucket of bundles, snapshots and caches (``Settings.s3_bucket``).
        endpoints: ``(name, host, port)`` of the stack's own servers (NATS, Postgres, S3, ...).
        dirs: absolute host directories of the stack (``DSEC_HOME``, data directories).
    """

    system_bucket: str = "dsec"
    endpoints: tuple[tuple[str, str, int], ...] = ()
    dirs: tuple[str, ...] = ()


def parse_org_policy(text: str | bytes, filename: str) -> DocumentResult[OrgPolicy]:
    """Parse an org policy file, with located errors like a spec."""
    return load_document(text, filename, OrgPolicy)


@cache
def default_org_policy() -> OrgPolicy:
    """The packaged baseline guardrails (used when no org policy file is configured)."""
    name = "guardrails.default.yaml"
    text = resources.files("dsec_rules").joinpath(name).read_text("utf-8")
    result = parse_org_policy(text, name)
    if result.value is None:
        raise ValueError("\n".join(e.format() for e in result.errors))
    return result.value


Violation = tuple[FieldPath, str, str | None]
"""(where in the spec, what is wrong, what would be allowed)."""


def check_guardrails(
    spec: SandboxSpec, policy: OrgPolicy, source: SourceMap, facts: StackFacts | None = None
) -> list[SpecError]:
    """Every violation of every rule, located in the spec (pure)."""
    facts = facts or StackFacts()
    out = []
    for rule in policy.rules:
        for path, message, hint in _CHECKS[rule.kind](spec, rule, facts):
            text = f"[{rule.id}] {message} (org policy)"
            if rule.message:
                text += f": {rule.message}"
            out.append(source.error(path, text, hint=hint, severity=rule.severity, rule_id=rule.id))
    return out


def _no_egress_anywhere(spec: SandboxSpec, rule: _Rule, facts: StackFacts) -> Iterator[Violation]:
    for index, egress in enumerate(spec.security_policy.network.egress):
        domain = egress.domain or ""
        if domain == "*" or (domain.startswith("*.") and "." not in domain[2:]):
            yield (
                (*_EGRESS, index),
                f"egress to {domain} allows every destination",
                ("name the domains the agent needs, e.g. domain: api.example.com"),
            )
    yield from _cidr_union_everywhere(spec)


def _cidr_union_everywhere(spec: SandboxSpec) -> Iterator[Violation]:
    """The UNION of the CIDR rules, per port: ``0.0.0.0/1`` + ``128.0.0.0/1`` on one port is
    ``0.0.0.0/0`` there, however it is split (IPv4 and IPv6 alike)."""
    by_port: dict[tuple[int, int], list[int]] = {}  # (ip version, port) -> rule indexes
    rules = spec.security_policy.network.egress
    for index, egress in enumerate(rules):
        if egress.cidr is None:
            continue
        version = ipaddress.ip_network(egress.cidr, strict=False).version
        for port in egress.ports:
            by_port.setdefault((version, port), []).append(index)
    offending: dict[tuple[int, ...], list[int]] = {}
    for (_, port), members in sorted(by_port.items()):
        nets = [ipaddress.ip_network(rules[i].cidr or "", strict=False) for i in members]
        if any(n.prefixlen == 0 for n in ipaddress.collapse_addresses(nets)):  # type: ignore[type-var]
            offending.setdefault(tuple(members), []).append(port)
    for group, open_ports in offending.items():
        cidrs = " + ".join(str(rules[i].cidr) for i in group)
        shown = ", ".join(map(str, open_ports))
        yield (
            (*_EGRESS, group[0]),
            f"egress to {cidrs} allows every destination on port(s) {shown}",
            "name the networks the agent needs, e.g. cidr: 10.1.2.0/24",
        )


def _forbid_domains(spec: SandboxSpec, rule: _Rule, facts: StackFacts) -> Iterator[Violation]:
    assert isinstance(rule, ForbidDomains)
    for index, egress in enumerate(spec.security_policy.network.egress):
        domain = egress.domain
        if domain is None:
            continue
        bare = domain[2:] if domain.startswith("*.") else domain
        for pattern in rule.domains:
            if fnmatch.fnmatch(bare, pattern) or fnmatch.fnmatch(f"x.{bare}", pattern):
                yield (*_EGRESS, index, "domain"), f"egress to {domain} is forbidden", None
                break


def _within(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _forbid_write(spec: SandboxSpec, rule: _Rule, facts: StackFacts) -> Iterator[Violation]:
    assert isinstance(rule, ForbidWrite)
    grants: list[tuple[FieldPath, str]] = [
        ((*_WRITE, i), p) for i, p in enumerate(spec.security_policy.filesystem.write_allowed)
    ]
    grants += [
        (("runtime_context", "mounts", i, "mode"), m.path)
        for i, m in enumerate(spec.runtime_context.mounts)
        if m.mode == "rw"
    ]
    for path, grant in grants:
        for protected in map(posixpath.normpath, rule.paths):
            if _within(protected, grant) or (protected != "/" and _within(grant, protected)):
                yield (
                    path,
                    f"write access to {grant} covers protected path {protected}",
                    ("grant a narrower directory, e.g. /workspace/output"),
                )
                break


def _max_secret_ttl(spec: SandboxSpec, rule: _Rule, facts: StackFacts) -> Iterator[Violation]:
    assert isinstance(rule, MaxSecretTtl)
    for index, env in enumerate(spec.runtime_context.env_vars):
        if env.source is not None and env.effective_ttl > rule.max:
            shown = format_duration(env.effective_ttl)
            yield (
                ("runtime_context", "env_vars", index, "ttl"),
                (f"secret {env.name} has ttl {shown}, longer than {format_duration(rule.max)}"),
                f"ttl: {format_duration(rule.max)} or less",
            )


def _max_memory(spec: SandboxSpec, rule: _Rule, facts: StackFacts) -> Iterator[Violation]:
    assert isinstance(rule, MaxMemory)
    if spec.resources.memory > rule.max:
        yield (
            ("resources", "memory"),
            (f"memory {format_size(spec.resources.memory)} is above {format_size(rule.max)}"),
            f"memory: {format_size(rule.max)} or less",
        )
    for index, task in enumerate(spec.tasks):
        memory = task.compute_unit.memory
        if memory is not None and memory > rule.max:
            yield (
                ("tasks", index, "compute_unit", "memory"),
                f"task {task.name}: memory {format_size(memory)} is above {format_size(rule.max)}",
                f"memory: {format_size(rule.max)} or less",
            )


def _max_code_size(spec: SandboxSpec, rule: _Rule, facts: StackFacts) -> Iterator[Violation]:
    assert isinstance(rule, MaxCodeSize)
    size = spec.include_code.max_size
    if size > rule.max:
        yield (
            ("include_code", "max_size"),
            f"include_code.max_size {format_size(size)} is above {format_size(rule.max)}",
            f"include_code: {{max_size: {format_size(rule.max)}}} or less",
        )


def _max_cpu(spec: SandboxSpec, rule: _Rule, facts: StackFacts) -> Iterator[Violation]:
    assert isinstance(rule, MaxCpu)
    if spec.resources.cpu > rule.max:
        yield (
            ("resources", "cpu"),
            f"cpu {spec.resources.cpu:g} is above {rule.max:g}",
            (f"cpu: {rule.max:g} or less"),
        )
    for index, task in enumerate(spec.tasks):
        cpu = task.compute_unit.cpu
        if cpu is not None and cpu > rule.max:
            yield (
                ("tasks", index, "compute_unit", "cpu"),
                f"task {task.name}: cpu {cpu:g} is above {rule.max:g}",
                f"cpu: {rule.max:g} or less",
            )


def _max_gpus(spec: SandboxSpec, rule: _Rule, facts: StackFacts) -> Iterator[Violation]:
    assert isinstance(rule, MaxGpus)
    gpu = spec.resources.gpu
    if gpu is not None and gpu.count > rule.max:
        yield (
            ("resources", "gpu", "count"),
            f"{gpu.count} GPUs is above {rule.max}",
            (f"count: {rule.max} or less"),
        )
    # A task topology holds all its units' GPUs at once (a gang): the rule bounds their sum,
    # a share counting as one GPU.
    needs = spec.unit_needs()
    total = sum(n.gpus or (1 if n.gpu_milli else 0) for n in needs.values())
    if total > rule.max:
        each = ", ".join(
            f"{name} {n.gpus or n.gpu_milli / 1000:g}" for name, n in needs.items() if n.any_gpu
        )
        yield (
            ("tasks",),
            f"the tasks take {total} GPUs in all ({each}), above {rule.max}",
            f"{rule.max} GPUs or fewer across the tasks (lower gpus or the throughput needs)",
        )


def _max_timeout(spec: SandboxSpec, rule: _Rule, facts: StackFacts) -> Iterator[Violation]:
    assert isinstance(rule, MaxTimeout)
    limit = format_duration(rule.max)
    if spec.timeout is None:
        yield (
            ("timeout",),
            f"no timeout is set; the longest allowed is {limit}",
            f"timeout: {limit}",
        )
    elif spec.timeout > rule.max:
        yield (
            ("timeout",),
            f"timeout {format_duration(spec.timeout)} is above {limit}",
            (f"timeout: {limit} or less"),
        )


def _require_rate_limit(spec: SandboxSpec, rule: _Rule, facts: StackFacts) -> Iterator[Violation]:
    for index, egress in enumerate(spec.security_policy.network.egress):
        if egress.rate_limit is None and not egress.allow_internal_only:
            what = egress.domain or egress.cidr
            yield (*_EGRESS, index), f"egress to {what} has no rate_limit", "rate_limit: 100req/min"


def _allowed_vault_mounts(spec: SandboxSpec, rule: _Rule, facts: StackFacts) -> Iterator[Violation]:
    assert isinstance(rule, AllowedVaultMounts)
    for index, env in enumerate(spec.runtime_context.env_vars):
        ref = env.vault
        if ref is not None and ref.mount not in rule.mounts:
            yield (
                ("runtime_context", "env_vars", index, "source"),
                (f"secret {env.name} comes from Vault mount {ref.mount!r}"),
                f"one of the mounts: {', '.join(rule.mounts)}",
            )


def _allowed_bases(spec: SandboxSpec, rule: _Rule, facts: StackFacts) -> Iterator[Violation]:
    assert isinstance(rule, AllowedBases)
    if not spec.base.startswith(rule.prefixes):
        yield (
            ("base",),
            f"base image {spec.base!r} is not an approved base",
            (f"an image starting with {' or '.join(rule.prefixes)}"),
        )


def _no_dns_passthrough(spec: SandboxSpec, rule: _Rule, facts: StackFacts) -> Iterator[Violation]:
    if spec.security_policy.dns_passthrough:
        yield (
            ("security_policy", "dns_passthrough"),
            "DNS pass-through bypasses the filtering resolver",
            ("dns_passthrough: false"),
        )


def _own_view(spec: SandboxSpec) -> tuple[str, ...]:
    """Paths that exist only inside the sandbox: its workdir, its mounts, and ``/tmp`` when it
    is writable (a fresh tmpfs then: named in ``write_allowed``, or the default when that is
    empty); a ``/tmp`` that is not would be the host's."""
    mounts = spec.runtime_context.mounts
    # what the plan makes writable (as dsec_core.spec.plan compiles it; the node agent gives
    # /tmp as a tmpfs when that is empty)
    write = {*spec.security_policy.filesystem.write_allowed}
    write |= {m.path for m in mounts if m.mode == "rw"}
    tmp = ("/tmp",) if "/tmp" in write or not write else ()
    return (spec.workdir, *tmp, *(m.path for m in mounts))


def _forbid_host_paths(spec: SandboxSpec, rule: _Rule, facts: StackFacts) -> Iterator[Violation]:
    assert isinstance(rule, ForbidHostPaths)
    protected = [posixpath.normpath(p) for p in rule.paths]
    if rule.stack_dirs:
        protected += [posixpath.normpath(d) for d in facts.dirs]
    own = _own_view(spec)
    stack = [posixpath.normpath(d) for d in facts.dirs] if rule.stack_dirs else []
    fs = spec.security_policy.filesystem
    # A read grant binds the host's path; a write grant gets a fresh directory (ORG-FS-001 keeps
    # those off system paths), so only the stack's own directories matter for writes.
    checks = (
        ("read_allowed", fs.read_allowed, protected),
        ("write_allowed", fs.write_allowed, stack),
    )
    for field, grants, guarded in checks:
        for index, grant in enumerate(grants):
            path = posixpath.normpath(grant)
            if any(_within(path, o) for o in own) or any(_within(path, a) for a in rule.allow):
                continue
            hit = next(
                (p for p in guarded if _within(p, path) or (p != "/" and _within(path, p))),
                None,
            )
            if hit is not None:
                yield (
                    ("security_policy", "filesystem", field, index),
                    f"{field} {grant} exposes the host path {hit} to the sandbox",
                    "grant a path inside the sandbox (its workdir, a mount's path, /tmp), or ask "
                    "the operator to add it to the rule's allow list",
                )


_CHECKS: dict[str, Callable[[SandboxSpec, _Rule, StackFacts], Iterator[Violation]]] = {
    "no-egress-anywhere": _no_egress_anywhere,
    "forbid-domains": _forbid_domains,
    "forbid-write": _forbid_write,
    "max-secret-ttl": _max_secret_ttl,
    "max-memory": _max_memory,
    "max-code-size": _max_code_size,
    "max-cpu": _max_cpu,
    "max-gpus": _max_gpus,
    "max-timeout": _max_timeout,
    "require-rate-limit": _require_rate_limit,
    "allowed-vault-mounts": _allowed_vault_mounts,
    "allowed-bases": _allowed_bases,
    "no-dns-passthrough": _no_dns_passthrough,
    "forbid-host-paths": _forbid_host_paths,
}
