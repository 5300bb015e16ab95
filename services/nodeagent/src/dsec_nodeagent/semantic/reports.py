"""What the in-sandbox semantic layer reports, checked against the plan (pure).

The sandbox's Python applies the semantic rules itself, so its reports are *claims*: a hostile
workload can send anything to its events socket. A report is published only as
``policy.reported`` (never as the node agent's ``policy.violation``), and only when it fits the
rules the node agent compiled for that sandbox: the rule exists, applies to the operation, and
the action is the rule's own action (a report claiming ``allow`` for a ``deny`` rule is refused).
Rule ids, actions and spec lines come from the plan; the target is scrubbed (a URL's user and
password, and the value of every secret DSec injected into that sandbox, are replaced), bounded
and escaped; the sandbox's free text (``detail``) is never published.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

from dsec_core import events
from dsec_core.text import bound

from dsec_nodeagent.semantic.models import Action, On, SemanticDecision, SemanticRules

TARGET_LIMIT = 256
MESSAGE_LIMIT = 512
_ONS = frozenset(get_args(On))
_ACTIONS = frozenset(get_args(Action))


@dataclass(frozen=True)
class Refused:
    """A report that does not fit the plan; ``reason`` is a bounded metric label."""

    reason: str


_USERINFO = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*://)[^/\s@?#]*@")
"""A URL's ``user:password@`` (``https://x-access-token:TOKEN@github.com/...``)."""
PARTIAL_SECRET = 6
"""A target ending in this many characters or more of a secret's start (cut by a bound) loses
them too."""


def scrub(text: str, secrets: Sequence[tuple[str, str]] = ()) -> str:
    """``text`` without the secrets a command line or URL carries: every ``(name, value)`` of
    ``secrets`` (those injected into the sandbox) replaced by ``[secret NAME]``, longest value
    first, a value cut at the text's end too; and any URL's user and password."""
    text = _USERINFO.sub(r"\1[userinfo]@", text)
    for name, value in sorted(secrets, key=lambda item: -len(item[1])):
        if not value:
            continue
        text = text.replace(value, f"[secret {name}]")
        for keep in range(min(len(value), len(text) + 1) - 1, PARTIAL_SECRET - 1, -1):
            if text.endswith(value[:keep]):
                text = text[:-keep] + f"[secret {name}]"
                break
    return text


def check_report(
    rules: SemanticRules, decision: SemanticDecision, secrets: Sequence[tuple[str, str]] = ()
) -> events.PolicyReported | Refused:
    """The ``policy.reported`` event of a plausible report, or why it is refused (``secrets``:
    ``(name, value)`` of those injected into the sandbox, never published: :func:`scrub`)."""
    if decision.on not in _ONS:
        return Refused("unknown-operation")
    if decision.action not in _ACTIONS:
        return Refused("unknown-action")
    rule_id, spec_line = _rule_of(rules, decision)
    if rule_id is None:
        return Refused("unknown-rule" if decision.rule is not None else "no-rule")
    if rule_id == "":
        return Refused("action-mismatch")
    target = bound(scrub(decision.subject, secrets), TARGET_LIMIT)
    message = bound(
        f"the sandbox's semantic layer reports: {decision.action} {decision.on} {target} "
        f"(rule {rule_id}; reported by the sandbox, not a kernel verdict)",
        MESSAGE_LIMIT,
    )
    return events.PolicyReported(
        rule_id=bound(rule_id, TARGET_LIMIT),
        action=decision.action,  # checked against _ACTIONS above
        operation=decision.on,
        target=target,
        message=message,
        spec_line=spec_line,
    )


def _rule_of(rules: SemanticRules, decision: SemanticDecision) -> tuple[str | None, int | None]:
    """``(rule id, spec line)`` from the plan; ``(None, _)``: no such rule; ``("", _)``: the
    rule exists but not with this operation and action."""
    if decision.rule is not None:
        rule = next((r for r in rules.rules if r.name == decision.rule), None)
        if rule is None:
            return None, None
        if rule.on != decision.on or rule.action != decision.action:
            return "", None
        return rule.name, rule.spec_line
    if decision.action == "deny" and decision.on == "http":
        # A rate limit's deny names its budget in ``detail``: "... (egress[0] host)".
        for limit in rules.rate_limits:
            if decision.detail is not None and decision.detail.endswith(f"({limit.name})"):
                return limit.name, limit.spec_line
        return None, None
    if decision.action == "log" and rules.default == "log":
        return "default", None
    return None, None
