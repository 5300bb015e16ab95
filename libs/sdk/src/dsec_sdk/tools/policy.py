"""Per-tool policies: timeout, retries, circuit breaker, fallbacks, when a tool is degraded.

Where they come from, later winning: built-in defaults, the node agent's effective policy in
``$DSEC_TOOLS`` (the spec's ``tools:`` section merged with the tool catalogue's defaults, e.g.
``web_search``'s fallback ``local_search``), then what the code passes to :class:`ToolRunner`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final

from dsec_sdk.tools.classify import CLASSES, NEVER_RETRIED, RETRYABLE

ENV: Final = "DSEC_TOOLS"


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter: attempt ``n`` waits ``uniform(0, min(max_backoff_s,
    backoff_s * 2**n))`` (or the provider's ``Retry-After``), bounded by ``attempts`` and by
    ``max_time_s`` in total (a wait that would pass it is not taken)."""

    attempts: int = 3
    max_time_s: float = 30.0
    backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    on: frozenset[str] = RETRYABLE


@dataclass(frozen=True)
class BreakerPolicy:
    """Open after ``failures`` consecutive failures; after ``reset_after_s`` let one trial call
    through (half-open): success closes it, failure opens it again."""

    failures: int = 5
    reset_after_s: float = 30.0


@dataclass(frozen=True)
class ToolPolicy:
    """What the pipeline does for one tool."""

    timeout_s: float | None = None
    retries: RetryPolicy = field(default_factory=RetryPolicy)
    breaker: BreakerPolicy = field(default_factory=BreakerPolicy)
    fallback: tuple[str, ...] = ()
    degraded_after: int = 3
    family: str = ""
    secret: str | None = None


DEFAULT: Final = ToolPolicy()


def policy_from_dict(data: Mapping[str, Any]) -> ToolPolicy:
    """A policy from the JSON the node agent writes into ``$DSEC_TOOLS`` (the plan's form:
    seconds as numbers). Unknown keys are ignored (a newer node agent)."""
    retries = data.get("retries") or {}
    breaker = data.get("breaker") or {}
    on = retries.get("on")
    retry = RetryPolicy(
        attempts=int(retries.get("attempts", RetryPolicy.attempts)),
        max_time_s=float(retries.get("max_time_s", RetryPolicy.max_time_s)),
        backoff_s=float(retries.get("backoff_s", RetryPolicy.backoff_s)),
        max_backoff_s=float(retries.get("max_backoff_s", RetryPolicy.max_backoff_s)),
        on=frozenset(c for c in on if c in CLASSES and c not in NEVER_RETRIED)
        if on is not None
        else RETRYABLE,
    )
    timeout = data.get("timeout_s")
    return ToolPolicy(
        timeout_s=float(timeout) if timeout is not None else None,
        retries=retry,
        breaker=BreakerPolicy(
            failures=int(breaker.get("failures", BreakerPolicy.failures)),
            reset_after_s=float(breaker.get("reset_after_s", BreakerPolicy.reset_after_s)),
        ),
        fallback=tuple(str(name) for name in data.get("fallback") or ()),
        degraded_after=int(data.get("degraded_after", ToolPolicy.degraded_after)),
        family=str(data.get("family") or ""),
        secret=data.get("secret") or None,
    )


def from_environment(environ: Mapping[str, str] | None = None) -> dict[str, ToolPolicy]:
    """The node agent's effective policies (``$DSEC_TOOLS``); ``{}`` outside a sandbox or when
    unreadable (the defaults then apply)."""
    raw = (os.environ if environ is None else environ).get(ENV)
    if not raw:
        return {}
    try:
        data = json.loads(raw)
        return {str(name): policy_from_dict(value) for name, value in data.items()}
    except (ValueError, TypeError, AttributeError):
        return {}


def with_overrides(policy: ToolPolicy, **changes: Any) -> ToolPolicy:
    """``policy`` with some fields replaced (what code passes to ``ToolRunner.tool``)."""
    return replace(policy, **{k: v for k, v in changes.items() if v is not None})
