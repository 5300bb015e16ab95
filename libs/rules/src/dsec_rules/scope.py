"""Checks no spec can opt out of: its tenant's data only, never the stack's own data or servers.

* ``tenant.vault`` / ``tenant.s3`` / ``tenant.configmap``: a ``vault://``, ``s3://`` or
  ``configmap://`` reference outside the tenant's scope (:meth:`OrgPolicy.scope`).
* ``system.bucket``: an ``s3://`` mount of the system bucket (bundles, snapshots, caches).
* ``system.egress``: an egress rule that admits one of the stack's endpoints (NATS, PostgreSQL,
  S3, OpenBao, Prometheus, metrics); the node agent also denies them at run time.

The tenant comes from the submitter's signed identity, never from the YAML.
"""

from __future__ import annotations

import fnmatch
import ipaddress
from collections.abc import Iterator

from dsec_core.spec import EnforcementPlan, SandboxSpec, SourceMap, SpecError
from dsec_core.spec.source import FieldPath
from dsec_core.stackinfo import is_local

from dsec_rules.guardrails import StackFacts, TenantScope

_ENV: FieldPath = ("runtime_context", "env_vars")
_MOUNTS: FieldPath = ("runtime_context", "mounts")
_EGRESS: FieldPath = ("security_policy", "network", "egress")


def check_scope(
    spec: SandboxSpec,
    plan: EnforcementPlan,
    tenant: str,
    scope: TenantScope,
    facts: StackFacts,
    source: SourceMap,
) -> list[SpecError]:
    """Every reference outside the tenant's scope and every egress to the stack (pure)."""
    return [
        *_vault(spec, tenant, scope, source),
        *_mounts(spec, tenant, scope, facts, source),
        *_stack_egress(plan, facts, source),
    ]


def _clean(path: str) -> bool:
    """No ``.``/``..``/empty segment: a prefix check on such a path proves nothing."""
    return all(part not in ("", ".", "..") for part in path.rstrip("/").split("/"))


def _vault(
    spec: SandboxSpec, tenant: str, scope: TenantScope, source: SourceMap
) -> Iterator[SpecError]:
    for index, env in enumerate(spec.runtime_context.env_vars):
        ref = env.vault
        if ref is None:
            continue
        full = f"{ref.mount}/{ref.path}"
        if _clean(full) and any(full.startswith(p) for p in scope.vault):
            continue
        yield source.error(
            (*_ENV, index, "source"),
            f"secret {env.name} reads vault://{full}, outside the secrets of tenant {tenant!r}",
            hint=_valid("vault://", scope.vault, "vault://secret/{t}/my-tool#key", tenant),
            rule_id="tenant.vault",
        )


def _mounts(
    spec: SandboxSpec, tenant: str, scope: TenantScope, facts: StackFacts, source: SourceMap
) -> Iterator[SpecError]:
    for index, mount in enumerate(spec.runtime_context.mounts):
        parsed = mount.parsed_source
        where = (*_MOUNTS, index, "source")
        if parsed.scheme == "configmap":
            name = parsed.name or ""
            if not any(fnmatch.fnmatchcase(name, g) for g in scope.configmaps):
                yield source.error(
                    where,
                    f"config map {name!r} is not one of the config maps of tenant {tenant!r}",
                    hint=_valid("configmap://", scope.configmaps, "configmap://{t}.x/k", tenant),
                    rule_id="tenant.configmap",
                )
            continue
        bucket, prefix = parsed.bucket or "", parsed.prefix or ""
        if bucket == facts.system_bucket:
            yield source.error(
                where,
                f"s3://{bucket}/ is the stack's system bucket (code bundles, snapshots, caches); "
                "no spec may mount it",
                hint=_valid(
                    "s3://", scope.s3, "s3://my-bucket/{t}/data/", tenant, facts.system_bucket
                ),
                rule_id="system.bucket",
            )
        elif not (_clean(prefix) and any(_s3_match(bucket, prefix, p) for p in scope.s3)):
            yield source.error(
                where,
                f"s3://{bucket}/{prefix} is outside the data of tenant {tenant!r}",
                hint=_valid(
                    "s3://", scope.s3, "s3://my-bucket/{t}/data/", tenant, facts.system_bucket
                ),
                rule_id="tenant.s3",
            )


def _s3_match(bucket: str, prefix: str, allowed: str) -> bool:
    want_bucket, _, want_prefix = allowed.partition("/")
    return want_bucket in ("*", bucket) and prefix.startswith(want_prefix)


def _valid(
    scheme: str, entries: tuple[str, ...], example: str, tenant: str, system: str = ""
) -> str:
    if not entries:
        return f"tenant {tenant!r} may not reference {scheme} sources (org policy)"
    any_bucket = f"<any bucket but {system}>/"
    shown = ", ".join(f"{scheme}{e}" for e in entries).replace("*/", any_bucket)
    return f"valid for tenant {tenant!r}: {shown}, e.g. {example.format(t=tenant)}"


def _stack_egress(
    plan: EnforcementPlan, facts: StackFacts, source: SourceMap
) -> Iterator[SpecError]:
    for index, rule in enumerate(plan.egress):
        hits = [
            f"{what} ({host}:{port})"
            for what, host, port in facts.endpoints
            if any(rule.allows(h, port) for h in _names(host))
        ]
        if hits:
            yield source.error(
                (*_EGRESS, index),
                f"this rule admits the stack's own server(s): {', '.join(hits)}; sandboxes never "
                "reach the stack (refused at run time whatever the spec says)",
                hint="remove the rule, or narrow it to the destination the agent needs",
                rule_id="system.egress",
            )


def _names(host: str) -> tuple[str, ...]:
    """How a sandbox could name ``host``: itself, and for the node's own addresses any loopback
    address and ``localhost``."""
    if not is_local(host):
        return (host,)
    loopback = [str(ipaddress.ip_address(host))] if host != "localhost" else []
    return (*loopback, "127.0.0.1", "::1", "localhost", "0.0.0.0")
