"""From a spec's ``security_policy`` to the rules file the sandbox's Python reads (pure)."""

from __future__ import annotations

from collections.abc import Sequence

from dsec_core.spec.models import SecurityPolicy
from dsec_core.spec.plan import EnforcementPlan, PlanEgressRule
from dsec_core.spec.source import SourceMap

from dsec_nodeagent.semantic.models import RateLimit, RuleMatch, SemanticRule, SemanticRules


def _line(source: SourceMap | None, path: tuple[str | int, ...]) -> int | None:
    return source.locate(path).line if source is not None else None


def rules_from_spec(
    policy: SecurityPolicy, source: SourceMap | None = None, spec_file: str = "dsec.yaml"
) -> SemanticRules:
    """Compile ``security_policy.semantic`` rules and HTTP ``rate_limit`` budgets.

    Args:
        policy: the validated policy.
        source: the spec's source map, so deny messages name the line to change.
        spec_file: the file name shown in deny messages.
    """
    rules = []
    for index, rule in enumerate(policy.semantic):
        subject = (
            rule.match.path or rule.match.url or rule.match.host or " ".join(rule.match.argv or ())
        )
        rules.append(
            SemanticRule(
                name=f"semantic[{index}] {rule.action} {rule.on} {subject}",
                on=rule.on,
                match=RuleMatch(
                    path=rule.match.path,
                    argv=rule.match.argv,
                    host=rule.match.host,
                    url=rule.match.url,
                ),
                action=rule.action,
                target=rule.target,
                message=rule.message,
                spec_line=_line(source, ("security_policy", "semantic", index)),
            )
        )
    limits = []
    for index, egress in enumerate(policy.network.egress):
        if egress.rate_limit is None or egress.domain is None:
            continue
        if egress.rate_limit.unit != "requests":  # connects/min: the kernel counts those
            continue
        limits.append(
            RateLimit(
                name=f"egress[{index}] {egress.domain}",
                host=egress.domain,
                requests=egress.rate_limit.requests,
                period_s=egress.rate_limit.period_s,
                spec_line=_line(source, ("security_policy", "network", "egress", index)),
            )
        )
    return SemanticRules(rules=rules, rate_limits=limits, spec_file=spec_file)


def _host_pattern(egress: PlanEgressRule) -> str:
    """The host pattern of an egress rule as the spec wrote it (``*.x``, ``*``, or the name)."""
    if egress.kind == "any":
        return "*"
    return f"*.{egress.domain}" if egress.kind == "wildcard" else str(egress.domain)


def rules_from_plan(
    plan: EnforcementPlan,
    spec_file: str = "dsec.yaml",
    rule_lines: Sequence[int | None] = (),
    egress_lines: Sequence[int | None] = (),
) -> SemanticRules:
    """Compile the enforcement plan's semantic rules and HTTP budgets (what ``spec.validated``
    carries: no YAML is read again). Each rule's line is the plan's (``spec_line``) unless
    ``rule_lines`` / ``egress_lines`` say otherwise; deny messages name the line to change."""
    rules = []
    for index, rule in enumerate(plan.semantic):
        subject = rule.path or rule.url or rule.host or " ".join(rule.argv or ())
        rules.append(
            SemanticRule(
                name=f"semantic[{index}] {rule.action} {rule.on} {subject}",
                on=rule.on,
                match=RuleMatch(path=rule.path, argv=rule.argv, host=rule.host, url=rule.url),
                action=rule.action,
                target=rule.target,
                message=rule.message,
                spec_line=rule_lines[index] if index < len(rule_lines) else rule.spec_line,
            )
        )
    limits = []
    for index, egress in enumerate(plan.egress):
        if egress.rate_limit is None or egress.kind == "cidr":
            continue
        if egress.rate_limit.unit != "requests":  # connects/min: the kernel counts those
            continue
        host = _host_pattern(egress)
        limits.append(
            RateLimit(
                name=f"egress[{index}] {host}",
                host=host,
                requests=egress.rate_limit.requests,
                period_s=egress.rate_limit.period_s,
                spec_line=egress_lines[index] if index < len(egress_lines) else egress.spec_line,
            )
        )
    return SemanticRules(rules=rules, rate_limits=limits, spec_file=spec_file)
