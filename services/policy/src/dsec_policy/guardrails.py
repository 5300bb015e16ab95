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
``max-memory``, ``max-code-size``, ``max-cpu``, ``max-gpus``, ``max-timeout``, ``require-timeout``,
``require-rate-limit``, ``allowed-vault-mounts``, ``allowed-bases``, ``no-dns-passthrough``.
"""

from __future__ import annotations

import fnmatch
import ipaddress
import posixpath
from collections.abc import Callable, Iterator
from functools import cache
from importlib import resources
from typing import Annotated, Literal

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
    | NoDnsPassthrough,
    Field(discriminator="kind"),
]


class OrgPolicy(BaseModel):
    """An organisation's guardrails."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    version: Literal["1"]
    rules: tuple[Rule, ...] = ()


def parse_org_policy(text: str | bytes, filename: str) -> DocumentResult[OrgPolicy]:
    """Parse an org policy file, with located errors like a spec."""
    return load_document(text, filename, OrgPolicy)


@cache
def default_org_policy() -> OrgPolicy:
    """The packaged baseline guardrails (used when no org policy file is configured)."""
    name = "guardrails.default.yaml"
    text = resources.files("dsec_policy").joinpath(name).read_text("utf-8")
    result = parse_org_policy(text, name)
    if result.value is None:
        raise ValueError("\n".join(e.format() for e in result.errors))
    return result.value


Violation = tuple[FieldPath, str, str | None]
"""(where in the spec, what is wrong, what would be allowed)."""


def check_guardrails(spec: SandboxSpec, policy: OrgPolicy, source: SourceMap) -> list[SpecError]:
    """Every violation of every rule, located in the spec (pure)."""
    out = []
    for rule in policy.rules:
        for path, message, hint in _CHECKS[rule.kind](spec, rule):
            text = f"[{rule.id}] {message} (org policy)"
            if rule.message:
                text += f": {rule.message}"
            out.append(source.error(path, text, hint=hint, severity=rule.severity, rule_id=rule.id))
    return out


def _no_egress_anywhere(spec: SandboxSpec, rule: _Rule) -> Iterator[Violation]:
    for index, egress in enumerate(spec.security_policy.network.egress):
        domain = egress.domain or ""
        too_wide = domain == "*" or (domain.startswith("*.") and "." not in domain[2:])
        if egress.cidr is not None and ipaddress.ip_network(egress.cidr).prefixlen == 0:
            too_wide = True
        if too_wide:
            what = egress.domain or egress.cidr
            yield (
                (*_EGRESS, index),
                f"egress to {what} allows every destination",
                ("name the domains the agent needs, e.g. domain: api.example.com"),
            )


def _forbid_domains(spec: SandboxSpec, rule: _Rule) -> Iterator[Violation]:
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


def _forbid_write(spec: SandboxSpec, rule: _Rule) -> Iterator[Violation]:
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


def _max_secret_ttl(spec: SandboxSpec, rule: _Rule) -> Iterator[Violation]:
    assert isinstance(rule, MaxSecretTtl)
    for index, env in enumerate(spec.runtime_context.env_vars):
        if env.source is not None and env.effective_ttl > rule.max:
            shown = format_duration(env.effective_ttl)
            yield (
                ("runtime_context", "env_vars", index, "ttl"),
                (f"secret {env.name} has ttl {shown}, longer than {format_duration(rule.max)}"),
                f"ttl: {format_duration(rule.max)} or less",
            )


def _max_memory(spec: SandboxSpec, rule: _Rule) -> Iterator[Violation]:
    assert isinstance(rule, MaxMemory)
    if spec.resources.memory > rule.max:
        yield (
            ("resources", "memory"),
            (f"memory {format_size(spec.resources.memory)} is above {format_size(rule.max)}"),
            f"memory: {format_size(rule.max)} or less",
        )


def _max_code_size(spec: SandboxSpec, rule: _Rule) -> Iterator[Violation]:
    assert isinstance(rule, MaxCodeSize)
    size = spec.include_code.max_size
    if size > rule.max:
        yield (
            ("include_code", "max_size"),
            f"include_code.max_size {format_size(size)} is above {format_size(rule.max)}",
            f"include_code: {{max_size: {format_size(rule.max)}}} or less",
        )


def _max_cpu(spec: SandboxSpec, rule: _Rule) -> Iterator[Violation]:
    assert isinstance(rule, MaxCpu)
    if spec.resources.cpu > rule.max:
        yield (
            ("resources", "cpu"),
            f"cpu {spec.resources.cpu:g} is above {rule.max:g}",
            (f"cpu: {rule.max:g} or less"),
        )


def _max_gpus(spec: SandboxSpec, rule: _Rule) -> Iterator[Violation]:
    assert isinstance(rule, MaxGpus)
    gpu = spec.resources.gpu
    if gpu is not None and gpu.count > rule.max:
        yield (
            ("resources", "gpu", "count"),
            f"{gpu.count} GPUs is above {rule.max}",
            (f"count: {rule.max} or less"),
        )


def _max_timeout(spec: SandboxSpec, rule: _Rule) -> Iterator[Violation]:
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


def _require_rate_limit(spec: SandboxSpec, rule: _Rule) -> Iterator[Violation]:
    for index, egress in enumerate(spec.security_policy.network.egress):
        if egress.rate_limit is None and not egress.allow_internal_only:
            what = egress.domain or egress.cidr
            yield (*_EGRESS, index), f"egress to {what} has no rate_limit", "rate_limit: 100req/min"


def _allowed_vault_mounts(spec: SandboxSpec, rule: _Rule) -> Iterator[Violation]:
    assert isinstance(rule, AllowedVaultMounts)
    for index, env in enumerate(spec.runtime_context.env_vars):
        ref = env.vault
        if ref is not None and ref.mount not in rule.mounts:
            yield (
                ("runtime_context", "env_vars", index, "source"),
                (f"secret {env.name} comes from Vault mount {ref.mount!r}"),
                f"one of the mounts: {', '.join(rule.mounts)}",
            )


def _allowed_bases(spec: SandboxSpec, rule: _Rule) -> Iterator[Violation]:
    assert isinstance(rule, AllowedBases)
    if not spec.base.startswith(rule.prefixes):
        yield (
            ("base",),
            f"base image {spec.base!r} is not an approved base",
            (f"an image starting with {' or '.join(rule.prefixes)}"),
        )


def _no_dns_passthrough(spec: SandboxSpec, rule: _Rule) -> Iterator[Violation]:
    if spec.security_policy.dns_passthrough:
        yield (
            ("security_policy", "dns_passthrough"),
            "DNS pass-through bypasses the filtering resolver",
            ("dns_passthrough: false"),
        )


_CHECKS: dict[str, Callable[[SandboxSpec, _Rule], Iterator[Violation]]] = {
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
}
