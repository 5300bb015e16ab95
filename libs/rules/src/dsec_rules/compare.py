"""Compare what the code needs with what the spec grants.

Inference advises, the kernel decides: every finding here is a warning (an org policy may raise
a rule id to an error with its ``severities`` section).

* A need without a grant is a warning carrying the YAML to add: the call would be denied at run
  time, which is safe; static analysis can also be wrong (dead code, a guarded call).
* A grant no code uses is a warning (static analysis can miss dynamic calls; the warning says how
  many calls it could not resolve).
* A secret the code reads but the spec never injects is a warning (the variable will be unset).
"""

from __future__ import annotations

import ipaddress
import posixpath
from collections.abc import Iterator

from dsec_core.spec import EnforcementPlan, SandboxSpec, Severity, SourceMap, SpecError
from dsec_core.spec.source import FieldPath

from dsec_rules.infer.needs import EgressNeed, EnvNeed, InferredNeeds, implicitly_readable
from dsec_rules.infer.render import VAULT_PLACEHOLDER, scalar

_EGRESS: FieldPath = ("security_policy", "network", "egress")
_FS: FieldPath = ("security_policy", "filesystem")
_ENV: FieldPath = ("runtime_context", "env_vars")


def compare(
    spec: SandboxSpec, plan: EnforcementPlan, needs: InferredNeeds, source: SourceMap
) -> list[SpecError]:
    """Diagnostics for every mismatch between ``needs`` and the spec's grants (pure)."""
    return [
        *_missing_egress(plan, needs, source),
        *_unused_egress(spec, plan, needs, source),
        *_missing_env(spec, needs, source),
        *_unused_secrets(spec, needs, source),
        *_missing_paths(spec, plan, needs, source),
        *_unused_writes(spec, needs, source),
    ]


def _evidence(sources: tuple[str, ...]) -> str:
    more = f" and {len(sources) - 1} more" if len(sources) > 1 else ""
    return f"{sources[0]}{more}"


def _unchecked(needs: InferredNeeds, kind: str) -> str:
    count = sum(1 for u in needs.unresolved if u.kind == kind)
    return f" ({count} call(s) with a dynamic destination could not be checked)" if count else ""


def _egress_allowed(plan: EnforcementPlan, host: str, port: int) -> bool:
    return any(rule.allows(host, port) for rule in plan.egress)


def _missing_egress(
    plan: EnforcementPlan, needs: InferredNeeds, source: SourceMap
) -> Iterator[SpecError]:
    for need in needs.egress:
        if _egress_allowed(plan, need.host, need.port):
            continue
        same_host = [i for i, r in enumerate(plan.egress) if r.allows(need.host, r.ports[0])]
        where: FieldPath = (*_EGRESS, same_host[0], "ports") if same_host else _EGRESS
        yield source.error(
            where,
            f"the code connects to {need.host}:{need.port} ({_evidence(need.sources)}) but the "
            "spec does not allow it: it would be denied at run time",
            hint=_egress_yaml(need),
            severity=Severity.WARNING,
            rule_id="infer.egress-missing",
        )


def _egress_yaml(need: EgressNeed) -> str:
    try:
        address = ipaddress.ip_address(need.host)
        line = f"      - cidr: {ipaddress.ip_network(address)}"
    except ValueError:
        line = f"      - domain: {scalar(need.host)}"
    lines = ["add:", "security_policy:", "  network:", "    egress:", line]
    lines.append(f"        ports: [{need.port}]")
    if need.rate_limit is not None:
        lines.append(f"        rate_limit: {need.rate_limit}")
    return "\n".join(lines)


def _unused_egress(
    spec: SandboxSpec, plan: EnforcementPlan, needs: InferredNeeds, source: SourceMap
) -> Iterator[SpecError]:
    for index, rule in enumerate(plan.egress):
        if any(rule.allows(n.host, n.port) for n in needs.egress):
            continue
        what = spec.security_policy.network.egress[index].domain or rule.cidr
        yield source.error(
            (*_EGRESS, index),
            f"egress to {what} is granted but no code uses it{_unchecked(needs, 'http')}",
            hint="remove the rule if the agent does not need it",
            severity=Severity.WARNING,
            rule_id="infer.egress-unused",
        )


def _missing_env(spec: SandboxSpec, needs: InferredNeeds, source: SourceMap) -> Iterator[SpecError]:
    injected = {env.name for env in spec.runtime_context.env_vars}
    for need in needs.env:
        if need.name in injected or (need.has_default and not need.secret):
            continue
        if need.secret:
            yield source.error(
                _ENV,
                f"the code reads secret {need.name} ({_evidence(need.sources)}) but the spec "
                "never injects it",
                hint=_env_yaml(need),
                severity=Severity.WARNING,
                rule_id="infer.secret-not-injected",
            )
        else:
            yield source.error(
                _ENV,
                f"the code reads {need.name} ({_evidence(need.sources)}) without a default but "
                "the spec does not set it",
                hint=_env_yaml(need),
                severity=Severity.WARNING,
                rule_id="infer.env-not-set",
            )


def _env_yaml(need: EnvNeed) -> str:
    lines = ["add:", "runtime_context:", "  env_vars:", f"    - name: {need.name}"]
    if need.secret:
        slug = need.name.lower().replace("_", "-")
        lines += [f"      source: {VAULT_PLACEHOLDER.format(slug=slug)}", "      ttl: 1h"]
    else:
        lines.append('      value: ""')
    return "\n".join(lines)


def _unused_secrets(
    spec: SandboxSpec, needs: InferredNeeds, source: SourceMap
) -> Iterator[SpecError]:
    read = {need.name for need in needs.env}
    for index, env in enumerate(spec.runtime_context.env_vars):
        if env.source is None or env.name in read:
            continue
        yield source.error(
            (*_ENV, index),
            f"secret {env.name} is injected but no code reads it{_unchecked(needs, 'env')}",
            hint="remove it: every injected secret widens what a compromised agent can leak",
            severity=Severity.WARNING,
            rule_id="infer.secret-unused",
        )


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def _missing_paths(
    spec: SandboxSpec, plan: EnforcementPlan, needs: InferredNeeds, source: SourceMap
) -> Iterator[SpecError]:
    # One diagnostic per directory to grant, however many files the code touches there.
    missing: dict[tuple[str, str], list[str]] = {}
    fs = plan.filesystem
    for need in needs.paths:
        path = posixpath.normpath(posixpath.join(spec.workdir, need.path))
        if need.write and not _under(path, fs.write):
            field = "write_allowed"
        elif not need.write and not (
            _under(path, fs.read + fs.write) or implicitly_readable(path, spec.workdir)
        ):
            field = "read_allowed"
        else:
            continue
        missing.setdefault((field, need.grant(spec.workdir)), []).extend(need.sources)
    for (field, grant), sources in missing.items():
        verb = "writes" if field == "write_allowed" else "reads"
        yield source.error(
            (*_FS, field),
            f"the code {verb} under {grant} ({_evidence(tuple(sources))}) but the spec does not "
            "allow it: it would be denied at run time",
            hint=_path_yaml(field, grant),
            severity=Severity.WARNING,
            rule_id="infer.path-missing",
        )


def _path_yaml(field: str, grant: str) -> str:
    return f"add:\nsecurity_policy:\n  filesystem:\n    {field}: [{scalar(grant)}]"


def _unused_writes(
    spec: SandboxSpec, needs: InferredNeeds, source: SourceMap
) -> Iterator[SpecError]:
    written = [
        posixpath.normpath(posixpath.join(spec.workdir, n.path)) for n in needs.paths if n.write
    ]
    for index, grant in enumerate(spec.security_policy.filesystem.write_allowed):
        if any(_under(path, (grant,)) for path in written):
            continue
        yield source.error(
            (*_FS, "write_allowed", index),
            f"write access to {grant} is granted but no code writes there"
            f"{_unchecked(needs, 'file')}",
            hint="remove it if the agent does not need it",
            severity=Severity.WARNING,
            rule_id="infer.path-unused",
        )
