"""Tools at run time, the node agent's side: per-tool metrics, ``tool.degraded`` /
``tool.recovered`` with a diagnosis, from the SDK's call reports (docs/tools.md).

The SDK inside a sandbox reports its tool calls over its broker connection (``{"op": "tools"}``,
see :mod:`dsec_sdk.tools.report`). A sandbox has no identity on the bus, so the node agent
speaks for it — and trusts it no further than its own sandbox:

* a report is attributed to the sandbox its connection's process runs in (the broker reads its
  cgroup) and to the agent the broker admitted; what the report claims about either is ignored;
* reports from processes outside a watched sandbox are refused;
* each sandbox may send :data:`REPORTS_PER_S` reports a second (burst :data:`REPORT_BURST`) of
  at most :data:`MAX_CALLS` calls each; malformed records are dropped and counted;
* label values are bounded: a tool its sandbox's policy names has its own within
  :data:`MAX_DECLARED_TOOL_LABELS` such names per node (a spec names at most 64); one it does
  not know, only within :data:`UNKNOWN_TOOLS_PER_SANDBOX` per sandbox and
  :data:`MAX_TOOL_LABELS` such names per node (others count as ``other``): two budgets, so a
  sandbox sending made-up names leaves its neighbours' declared tools their labels and their
  health events; agents within :data:`MAX_AGENT_LABELS`;
* events: at most :data:`EVENTS_PER_MINUTE` per sandbox; their ``reason`` is composed here from
  the failure class, the HTTP status and the plan (secret names, lease times, egress rules) —
  nothing the sandbox wrote reaches an event.

The metrics carry the tool as a label (``dsec_tool_latency_ms{tool="web_search"}``) rather than
in the name (``dsec_tool_web_search_latency_ms``): one series family that PromQL can aggregate
across tools and families, and bounded label values instead of unbounded metric names.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, get_args

from dsec_core import events
from dsec_core.spec.plan import EnforcementPlan, ToolPlan
from prometheus_client import Counter, Gauge, Histogram

log = logging.getLogger(__name__)

REPORTS_PER_S: Final = 20.0
REPORT_BURST: Final = 40.0
MAX_CALLS: Final = 256
MAX_TOOL_LABELS: Final = 256
MAX_DECLARED_TOOL_LABELS: Final = 4096
UNKNOWN_TOOLS_PER_SANDBOX: Final = 16
MAX_AGENT_LABELS: Final = 512
EVENTS_PER_MINUTE: Final = 20
REFUSAL_MEMORY_S: Final = 120.0
OTHER: Final = "other"

_TOOL_RE: Final = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,62}")
_SIDES: Final = frozenset({"call", "serve"})
_OUTCOMES: Final = frozenset({"ok", "error", "rejected"})
_CLASSES: Final = frozenset(get_args(events.ToolFailureClass))
_TRACE_RE: Final = re.compile(r"[0-9a-f]{32}")
# Latency buckets in ms: a cached local tool (1 ms) to a slow search API with retries (60 s).
_BUCKETS_MS: Final = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000)

LATENCY = Histogram(
    "dsec_tool_latency_ms",
    "Latency of tool calls in ms (retries included), by tool, family, agent, side and outcome",
    ["tool", "family", "agent", "side", "outcome"],
    buckets=_BUCKETS_MS,
)
CALLS = Counter(
    "dsec_tool_calls_total",
    "Tool calls: made (side=call), served (serve) or plain HTTP requests the semantic layer saw "
    "(http, outcome=seen)",
    ["tool", "family", "agent", "side", "outcome"],
)
ERRORS = Counter(
    "dsec_tool_errors_total",
    "Failed tool calls by failure class",
    ["tool", "family", "agent", "class"],
)
RETRIES = Counter(
    "dsec_tool_retries_total",
    "Attempts beyond the first of tool calls",
    ["tool", "family", "agent"],
)
FALLBACKS = Counter(
    "dsec_tool_fallbacks_total",
    "Calls served by a fallback tool, by the tool (and its family) it stood in for",
    ["tool", "family", "fallback", "agent"],
)
DEGRADED = Gauge(
    "dsec_tool_degraded",
    "1 while a tool of an agent is degraded (failed degraded_after calls in a row)",
    ["tool", "family", "agent"],
)
REFUSED = Counter(
    "dsec_tool_reports_refused_total",
    "Tool-call reports (or records in them) the node agent refused, by reason",
    ["reason"],
)
SUPPRESSED = Counter(
    "dsec_tool_events_suppressed_total",
    "tool.degraded/recovered not published: the sandbox passed its event budget",
)

Publish = Callable[[events.Payload, str], Coroutine[Any, Any, None]]


@dataclass(frozen=True)
class SecretLease:
    """What the node agent knows of a secret it injected (never its value). ``live``: the
    injector's lease object (its ``ttl_s`` and ``renewed_at`` move as it renews it)."""

    env_var: str
    lease_id: str
    injected_at: float  # wall clock
    ttl_s: float
    live: Any = None

    def expires_at(self) -> float:
        """When the lease runs out unless renewed again."""
        renewed = float(getattr(self.live, "renewed_at", 0.0) or 0.0)
        ttl = float(getattr(self.live, "ttl_s", 0) or self.ttl_s)
        return max(self.injected_at, renewed) + ttl


@dataclass
class _Health:
    failures: int = 0  # in a row
    degraded: bool = False
    degraded_at: float = 0.0  # monotonic
    failing_since: float = 0.0  # wall clock of the first failure in a row
    failed_while: int = 0
    last_class: str = "tool_error"
    last_status: int = 0
    last_trace: str = ""


@dataclass
class _Sandbox:
    agent: str
    tools: dict[str, dict[str, Any]]  # effective policy per tool (the SDK's $DSEC_TOOLS)
    secrets: dict[str, SecretLease]
    egress: tuple[str, ...]
    hosts: dict[str, str]  # host -> tool (plain HTTP calls)
    tokens: float = REPORT_BURST
    refilled: float = 0.0
    unknown_tools: set[str] = field(default_factory=set)
    health: dict[tuple[str, str], _Health] = field(default_factory=dict)
    event_times: list[float] = field(default_factory=list)
    # The sandbox's latest refusals (monotonic time, layer, rule id, target): a diagnosis names
    # the rule that refused a tool's call.
    refusals: deque[tuple[float, str, str, str]] = field(default_factory=lambda: deque(maxlen=8))


def effective_tools(plan: EnforcementPlan) -> dict[str, dict[str, Any]]:
    """The policies the SDK gets in ``$DSEC_TOOLS``: the catalogue's defaults (family, fallback)
    for the tools the spec names and for catalogue tools with a fallback, the spec's
    ``tools:`` section over them."""
    from dsec_rules.infer.catalogue import load_catalogue

    catalogue = load_catalogue()
    result: dict[str, dict[str, Any]] = {}
    for tool in catalogue.tools:
        if tool.fallback:
            result[tool.name] = {"family": tool.category, "fallback": list(tool.fallback)}
    for name, declared_policy in plan.tools.items():
        known = catalogue.lookup(name)
        base = result.get(name) or {"family": known.category if known else OTHER}
        declared = declared_policy.model_dump(mode="json", exclude={"spec_line", "hosts"})
        merged = {**base, **{k: v for k, v in declared.items() if v not in (None, (), [])}}
        if not declared_policy.fallback and "fallback" in base:
            merged["fallback"] = base["fallback"]
        result[name] = merged
    for policy in list(result.values()):  # fallbacks get a family too
        for other in policy.get("fallback", ()):
            if other not in result:
                known = catalogue.lookup(other)
                result[other] = {"family": known.category if known else OTHER}
    return result


@functools.cache
def catalogue_hosts() -> dict[str, str]:
    """Host -> tool of the catalogue's providers (``api.tavily.com`` -> ``tavily_search``):
    plain HTTP calls to them count for that tool."""
    from dsec_rules.infer.catalogue import load_catalogue

    return {egress.domain: tool.name for tool in load_catalogue().tools for egress in tool.egress}


def _catalogue_family(tool: str) -> str:
    from dsec_rules.infer.catalogue import load_catalogue

    known = load_catalogue().lookup(tool)
    return known.category if known else OTHER


class ToolWatch:
    """Turns sandboxes' tool-call reports into metrics and events.

    Args:
        node_id: this node (in the events).
        publish: publishes a payload as a lifecycle event of a sandbox (the outlet's).
        clock, wall: monotonic and wall clocks (tests drive them).
    """

    def __init__(
        self,
        node_id: str,
        publish: Publish,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.node_id = node_id
        self._publish = publish
        self._clock = clock
        self._wall = wall
        self._sandboxes: dict[str, _Sandbox] = {}
        self._tool_labels: set[str] = set()
        self._unknown_labels = 0  # of those, names no policy knew when they were given
        self._declared_labels = 0  # and names a policy declared
        self._agent_labels: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.published: list[events.Payload] = []  # the newest few, for tests and `dsec status`

    # ------------------------------------------------------------------ sandboxes
    def watch(
        self,
        sandbox_id: str,
        agent: str,
        plan: EnforcementPlan,
        secrets: Sequence[SecretLease] = (),
    ) -> None:
        """Accept reports from ``sandbox_id`` (its agent named ``agent``)."""
        tools = effective_tools(plan)
        hosts = {**catalogue_hosts()}  # the catalogue's providers, then the spec's own hosts
        hosts.update({host: name for name, policy in plan.tools.items() for host in policy.hosts})
        for tool in set(hosts.values()) - set(tools):
            tools[tool] = {"family": _catalogue_family(tool)}
        egress = tuple(
            f"{rule.domain or rule.cidr}:{','.join(str(p) for p in rule.ports)}"
            for rule in plan.egress
        )
        self._sandboxes[sandbox_id] = _Sandbox(
            agent=agent,
            tools=tools,
            secrets={s.env_var: s for s in secrets},
            egress=egress,
            hosts=hosts,
            refilled=self._clock(),
        )

    def forget(self, sandbox_id: str) -> None:
        """The sandbox ended: its degraded gauges go back to 0."""
        box = self._sandboxes.pop(sandbox_id, None)
        if box is None:
            return
        for (agent, tool), health in box.health.items():
            if health.degraded:
                DEGRADED.labels(tool, self._family(box, tool), agent).set(0)

    def watching(self, sandbox_id: str) -> bool:
        return sandbox_id in self._sandboxes

    # ------------------------------------------------------------------ reports
    def report(self, sandbox_id: str, agent: str, message: Mapping[str, Any]) -> None:
        """One ``tools`` report of a process of ``sandbox_id`` acting as ``agent`` (both as the
        broker established them)."""
        box = self._sandboxes.get(sandbox_id)
        if box is None:
            REFUSED.labels("unknown_sandbox").inc()
            return
        if not self._admit(box):
            REFUSED.labels("rate").inc()
            return
        calls = message.get("calls")
        if not isinstance(calls, list):
            REFUSED.labels("malformed").inc()
            return
        if len(calls) > MAX_CALLS:
            REFUSED.labels("too_many_calls").inc(len(calls) - MAX_CALLS)
            calls = calls[:MAX_CALLS]
        agent_label = self._agent_label(agent)
        for raw in calls:
            record = _parse(raw)
            if record is None:
                REFUSED.labels("malformed").inc()
                continue
            self._observe(sandbox_id, box, agent, agent_label, record)

    def http(self, sandbox_id: str, host: str) -> None:
        """A plain HTTP request the sandbox's semantic layer reported (no latency, no outcome):
        counted for the tool whose ``hosts`` name it."""
        box = self._sandboxes.get(sandbox_id)
        if box is None:
            return
        tool = box.hosts.get(host.lower().rstrip("."))
        if tool is None:
            return
        CALLS.labels(
            tool, self._family(box, tool), self._agent_label(box.agent), "http", "seen"
        ).inc()

    def refused(self, sandbox_id: str, layer: str, rule_id: str, target: str) -> None:
        """The node refused something of the sandbox (a semantic deny, the HTTPS proxy's rate
        limit): kept a while, so that a tool failing because of it is diagnosed by its rule."""
        box = self._sandboxes.get(sandbox_id)
        if box is not None:
            box.refusals.append((self._clock(), layer, rule_id[:128], target[:256]))

    def _recent_refusal(self, box: _Sandbox, layer: str | None = None) -> tuple[str, str] | None:
        now = self._clock()
        for when, kind, rule, target in reversed(box.refusals):
            if now - when <= REFUSAL_MEMORY_S and (layer is None or kind == layer):
                return rule, target
        return None

    def _admit(self, box: _Sandbox) -> bool:
        now = self._clock()
        box.tokens = min(REPORT_BURST, box.tokens + (now - box.refilled) * REPORTS_PER_S)
        box.refilled = now
        if box.tokens < 1.0:
            return False
        box.tokens -= 1.0
        return True

    def _observe(
        self, sandbox_id: str, box: _Sandbox, agent: str, agent_label: str, record: _Record
    ) -> None:
        tool = self._tool_label(box, record.tool)
        family = self._family(box, record.tool) if tool != OTHER else OTHER
        LATENCY.labels(tool, family, agent_label, record.side, record.outcome).observe(record.ms)
        CALLS.labels(tool, family, agent_label, record.side, record.outcome).inc()
        if record.outcome != "ok":
            ERRORS.labels(tool, family, agent_label, record.failure_class).inc()
        if record.attempts > 1:
            RETRIES.labels(tool, family, agent_label).inc(record.attempts - 1)
        if record.via and record.outcome == "ok":
            via = self._tool_label(box, record.via)
            via_family = self._family(box, record.via) if via != OTHER else OTHER
            FALLBACKS.labels(via, via_family, tool, agent_label).inc()
        if record.side == "call" and tool != OTHER:
            self._health(sandbox_id, box, agent, record)

    # ------------------------------------------------------------------ health
    def _health(self, sandbox_id: str, box: _Sandbox, agent: str, record: _Record) -> None:
        health = box.health.setdefault((agent, record.tool), _Health())
        policy = box.tools.get(record.tool, {})
        if record.outcome == "ok":
            if health.degraded:
                degraded_s = max(0.0, self._clock() - health.degraded_at)
                DEGRADED.labels(record.tool, self._family(box, record.tool), agent).set(0)
                self._emit(
                    sandbox_id,
                    box,
                    events.ToolRecovered(
                        node_id=self.node_id,
                        agent=agent,
                        tool=record.tool,
                        degraded_s=round(degraded_s, 3),
                        failures=health.failed_while,
                    ),
                )
            box.health[(agent, record.tool)] = _Health()
            return
        if record.failure_class == "bad_arguments":
            return  # the caller's mistake says nothing about the tool
        if health.failures == 0:
            health.failing_since = self._wall()
        health.failures += 1
        if record.outcome == "error":  # a breaker's refusal keeps the class that opened it
            health.last_class = record.failure_class
            health.last_status = record.status
        health.last_trace = record.trace_id or health.last_trace
        if health.degraded:
            health.failed_while += 1
            return
        threshold = int(policy.get("degraded_after", 3))
        if health.failures < max(1, threshold):
            return
        health.degraded = True
        health.degraded_at = self._clock()
        DEGRADED.labels(record.tool, self._family(box, record.tool), agent).set(1)
        fallback = next(iter(policy.get("fallback") or ()), None)
        self._emit(
            sandbox_id,
            box,
            events.ToolDegraded(
                node_id=self.node_id,
                agent=agent,
                tool=record.tool,
                failure_class=health.last_class,
                status=health.last_status or None,
                failures=health.failures,
                reason=self.diagnose(box, record.tool, health, sandbox_id),
                fallback=fallback,
                trace_id=health.last_trace,
            ),
        )

    def diagnose(self, box: _Sandbox, tool: str, health: _Health, sandbox_id: str) -> str:
        """The plain-language reason of a degraded tool (from the plan, never the sandbox)."""
        policy = box.tools.get(tool, {})
        klass, status, count = health.last_class, health.last_status, health.failures
        since = _clock_time(health.failing_since)
        fallback = next(iter(policy.get("fallback") or ()), None)
        tail = f"; calls go to {fallback} meanwhile" if fallback else "; it has no fallback"
        if klass == "auth":
            return self._auth_reason(box, tool, status, since, policy) + tail
        proxy = self._recent_refusal(box, "http_proxy")
        if klass == "rate_limited" and proxy is not None:
            return (
                f"{tool} is rate limited by the sandbox's own policy, not its provider: rule "
                f"{proxy[0]} ({proxy[1]}) spent its requests budget (HTTP 429 since {since}); "
                f"raise its rate_limit in the spec or call less often{tail}"
            )
        if klass == "rate_limited":
            return (
                f"{tool} is rate limited (HTTP 429 since {since}, {count} calls in a row): the "
                f"provider's quota is spent; Retry-After is honoured. Lower the call rate or raise "
                f"the plan's quota{tail}"
            )
        if klass == "timeout":
            timeout = policy.get("timeout_s")
            limit = f" (timeout {timeout:g} s a try, spec tools.{tool}.timeout)" if timeout else ""
            return (
                f"{tool} timed out on {count} calls in a row since {since}{limit}: the provider "
                f"is slow or unreachable{tail}"
            )
        if klass == "upstream_5xx":
            code = f"HTTP {status}" if status else "5xx errors"
            return (
                f"{tool}'s provider answers {code} since {since} ({count} calls): an outage "
                f"upstream{tail}"
            )
        refusal = self._recent_refusal(box)
        if klass == "network_policy" and refusal is not None:
            what = f" {refusal[1]}" if refusal[1] else " it"
            return (
                f"the sandbox's policy refuses {tool}'s calls since {since}: rule {refusal[0]} "
                f"refused{what} (a spec problem, never retried; change the rule or the "
                f"tool's destination){tail}"
            )
        if klass == "network_policy":
            allowed = ", ".join(box.egress) or "nothing"
            return (
                f"the sandbox's policy refuses {tool}'s connection since {since}: a spec problem, "
                f"never retried. security_policy.network.egress allows {allowed}; the rule that "
                f"refused it is in `dsec audit replay --type policy.violation --sandbox "
                f"{sandbox_id}`{tail}"
            )
        if klass == "unavailable":
            return (
                f"{tool} cannot be reached since {since} (connection refused or reset, or its "
                f"agent is gone){tail}"
            )
        return (
            f"{tool} raised on {count} calls in a row since {since}: a bug in the tool or its "
            f"input{tail}"
        )

    def _auth_reason(
        self, box: _Sandbox, tool: str, status: int, since: str, policy: Mapping[str, Any]
    ) -> str:
        code = f"HTTP {status}" if status else "auth failures"
        name = policy.get("secret")
        lease = box.secrets.get(name) if name else None
        if lease is None and len(box.secrets) == 1:
            lease = next(iter(box.secrets.values()))
        if lease is None:
            return (
                f"{code} from {tool} since {since}: its credentials are refused (no injected "
                f"secret is named for it: set tools.{tool}.secret); check the key rotation"
            )
        expires = lease.expires_at()
        if self._wall() >= expires:
            return (
                f"{code} since the lease of {lease.env_var} expired at {_clock_time(expires)} "
                f"(lease {lease.lease_id}): check the key rotation"
            )
        return (
            f"{code} from {tool} since {since}: the provider refuses {lease.env_var} although its "
            f"lease {lease.lease_id} (injected {_clock_time(lease.injected_at)}, TTL "
            f"{_duration(lease.ttl_s)}) is live: the key was rotated or revoked upstream; check "
            f"the key rotation"
        )

    def _emit(self, sandbox_id: str, box: _Sandbox, payload: events.Payload) -> None:
        now = self._clock()
        box.event_times = [t for t in box.event_times if now - t < 60.0]
        if len(box.event_times) >= EVENTS_PER_MINUTE:
            SUPPRESSED.inc()
            return
        box.event_times.append(now)
        self.published = [*self.published[-31:], payload]
        log.info("%s: %s %s", sandbox_id, payload.TYPE, getattr(payload, "tool", ""))
        try:
            task = asyncio.get_running_loop().create_task(self._publish(payload, sandbox_id))
        except RuntimeError:  # no loop (a unit test calling synchronously)
            return
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("tool event not published: %s", task.exception())

    async def close(self) -> None:
        """Wait for events being published."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    # ------------------------------------------------------------------ labels
    def _tool_label(self, box: _Sandbox, tool: str) -> str:
        if tool in self._tool_labels:
            return tool
        if tool in box.tools:  # named by its policy: a budget of its own, not the one below
            if self._declared_labels >= MAX_DECLARED_TOOL_LABELS:
                return OTHER
            self._declared_labels += 1
            self._tool_labels.add(tool)
            return tool
        if len(box.unknown_tools) >= UNKNOWN_TOOLS_PER_SANDBOX and tool not in box.unknown_tools:
            return OTHER
        if self._unknown_labels >= MAX_TOOL_LABELS:
            return OTHER
        box.unknown_tools.add(tool)
        self._unknown_labels += 1
        self._tool_labels.add(tool)
        return tool

    def _agent_label(self, agent: str) -> str:
        if agent in self._agent_labels:
            return agent
        if len(self._agent_labels) >= MAX_AGENT_LABELS:
            return OTHER
        self._agent_labels.add(agent)
        return agent

    @staticmethod
    def _family(box: _Sandbox, tool: str) -> str:
        policy = box.tools.get(tool)
        family = policy.get("family") if policy else None
        return str(family) if family else OTHER


@dataclass(frozen=True)
class _Record:
    tool: str
    side: str
    outcome: str
    failure_class: str
    ms: float
    attempts: int
    status: int
    via: str
    trace_id: str


def _parse(raw: Any) -> _Record | None:
    """A record as :mod:`dsec_sdk.tools.report` writes it, or ``None`` when anything is off."""
    if not isinstance(raw, list) or len(raw) != 9:
        return None
    tool, side, outcome, klass, ms, attempts, status, via, trace = raw
    if not (isinstance(tool, str) and _TOOL_RE.fullmatch(tool)):
        return None
    if side not in _SIDES or outcome not in _OUTCOMES:
        return None
    if outcome == "ok":
        klass = ""
    elif klass not in _CLASSES:
        return None
    if not isinstance(ms, int | float) or isinstance(ms, bool) or not math.isfinite(ms):
        return None
    if not 0 <= ms <= 24 * 3600 * 1000:
        return None
    if not isinstance(attempts, int) or not 1 <= attempts <= 100:
        return None
    if not isinstance(status, int) or not (status == 0 or 100 <= status <= 599):
        return None
    if not isinstance(via, str) or (via and not _TOOL_RE.fullmatch(via)):
        return None
    if not isinstance(trace, str) or (trace and not _TRACE_RE.fullmatch(trace)):
        trace = ""
    return _Record(tool, side, outcome, klass, float(ms), attempts, status, via, trace)


def _clock_time(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).strftime("%H:%M:%SZ")


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:g}h"
    if seconds >= 60:
        return f"{seconds / 60:g}m"
    return f"{seconds:g}s"


__all__ = ["SecretLease", "ToolPlan", "ToolWatch", "effective_tools"]
