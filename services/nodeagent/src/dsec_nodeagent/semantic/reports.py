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

import base64
import re
import urllib.parse
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


_USERINFO = re.compile(r"(?<![A-Za-z0-9+.-])([A-Za-z][A-Za-z0-9+.-]{0,31}://)[^/\s@?#]*@")
"""A URL's ``user:password@`` (``https://x-access-token:TOKEN@github.com/...``); a scheme
starts a word and is short, so a long run of letters costs one pass, not one per letter."""
PARTIAL_SECRET = 6
"""A target ending in this many characters or more of a secret's start (cut by a bound) loses
them too."""
WITHHELD = (("", ""),)
"""``secrets`` of a sandbox whose secret values this node agent does not hold (restored here
from another node): its reports keep their program or host only."""


def forms(value: str) -> set[str]:
    """The forms of a secret a command line or URL carries: as it is, percent-encoded, and
    base64 (with and without padding; an ``Authorization`` header, ``extraheader`` values)."""
    raw = value.encode()
    b64 = base64.b64encode(raw).decode()
    return {value, urllib.parse.quote(value, safe=""), b64, b64.rstrip("=")} - {""}


def scrub(text: str, secrets: Sequence[tuple[str, str]] = ()) -> str:
    """``text`` without the secrets a command line or URL carries: any URL's user and
    password; every form (:func:`forms`) of each ``(name, value)`` of ``secrets`` (those
    injected into the sandbox) replaced by ``[secret NAME]``, longest first, a value cut at the
    text's end too. With :data:`WITHHELD`, only the program (or a URL's scheme and host)."""
    if "://" in text:
        text = _USERINFO.sub(r"\1[userinfo]@", text)
    if secrets == WITHHELD:
        return _program_only(text)
    replaced = _replacements(tuple(secrets))
    for form, name in replaced:
        text = text.replace(form, f"[secret {name}]")
    for form, name in replaced:
        text = _cut_at_end(text, form, name)
    return text


def _replacements(secrets: tuple[tuple[str, str], ...]) -> tuple[tuple[str, str], ...]:
    """``(form, name)`` of every form of ``secrets``, longest first (computed per report: no
    secret value outlives its sandbox in a cache)."""
    pairs = {(form, name) for name, value in secrets for form in forms(value)}
    return tuple(sorted(pairs, key=lambda item: -len(item[0])))


def _cut_at_end(text: str, value: str, name: str) -> str:
    """``text`` without a start of ``value`` (:data:`PARTIAL_SECRET` characters at least) it
    ends with (the sandbox's runtime cut it): the earliest place where the rest of the text
    starts ``value``, among those the published head (:data:`TARGET_LIMIT`) reaches. One search
    per candidate, at most that many: a report costs microseconds whatever the secrets."""
    if len(value) <= PARTIAL_SECRET:
        return text
    head = value[:PARTIAL_SECRET]
    end = min(len(text), TARGET_LIMIT + PARTIAL_SECRET)
    at = text.find(head, max(0, len(text) - len(value) + 1), end)
    while at != -1:
        if value.startswith(text[at:]):
            return text[:at] + f"[secret {name}]"
        at = text.find(head, at + 1, end)
    return text


def _program_only(text: str) -> str:
    """The first word of a command line, or a URL's scheme and host."""
    try:
        parts = urllib.parse.urlsplit(text)
    except ValueError:
        parts = None
    if parts is not None and parts.scheme and parts.netloc:
        return (
            f"{parts.scheme}://{parts.netloc} [the rest withheld: its secrets are not known here]"
        )
    word = text.split(" ", 1)[0]
    return f"{word} [arguments withheld: the sandbox's secrets are not known here]"


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
