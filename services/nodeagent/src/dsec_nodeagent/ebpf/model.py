"""Typed inputs and outputs of egress enforcement: the plan a sandbox gets, the verdicts it earns.

`EgressPlan` is what `EgressController.attach` takes: the egress half of the compiled enforcement
plan (the policy service's output), one rule per `security_policy.network.egress` entry. The
numeric enums mirror the constants in ``egress.bpf.c``.
"""

from __future__ import annotations

import enum
import ipaddress
import re
from dataclasses import dataclass
from typing import Annotated, Literal, Self

from dsec_core.spec.plan import EnforcementPlan, PlanEgressRule
from dsec_core.spec.units import Rate, parse_rate
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

Port = Annotated[int, Field(ge=1, le=65535)]

_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?\Z")
MAX_RULES = 65535


class Verdict(enum.IntEnum):
    """What a hook decided (``V_*`` in egress.bpf.c)."""

    ALLOW = 1
    DENY_NO_RULE = 2
    DENY_RATE_LIMIT = 3
    DENY_EXPIRED = 4
    DENY_UNKNOWN_SANDBOX = 5
    REDIRECT_DNS = 6
    DENY_DOH = 7
    DENY_STACK = 8
    DENY_PROTOCOL = 9
    DENY_BIND = 10
    DENY_SOCKETS = 11

    @property
    def denied(self) -> bool:
        """True for every verdict that refused the call (EPERM)."""
        return self not in (Verdict.ALLOW, Verdict.REDIRECT_DNS)

    @property
    def label(self) -> str:
        """Lower-case name for metrics and events (``deny_rate_limit``)."""
        return self.name.lower()


class Hook(enum.IntEnum):
    """Which cgroup hook decided (``H_*`` in egress.bpf.c)."""

    CONNECT4 = 1
    CONNECT6 = 2
    SENDMSG4 = 3
    SENDMSG6 = 4
    BIND4 = 5
    BIND6 = 6
    SOCKET = 7


class RateLimit(BaseModel):
    """New connections allowed per period: a token bucket of ``burst`` refilled ``count``/period.

    Connect-time buckets count connections (TCP connects and UDP ``connect()``), not requests:
    keep-alive carries many requests on one connection. For a ``requests`` rate the semantic
    layer also counts HTTP requests against the same number; a ``connects`` rate is the kernel's
    alone.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    count: int = Field(gt=0, description="Connections per period")
    per_seconds: float = Field(gt=0, description="Length of the period in seconds")
    burst: int | None = Field(default=None, gt=0, description="Bucket size; default `count`")

    @model_validator(mode="before")
    @classmethod
    def _from_spec(cls, value: object) -> object:
        # Accept the spec's text ("100req/min") and its typed Rate as well as our own fields.
        if isinstance(value, str):
            value = parse_rate(value)
        if isinstance(value, Rate):
            value = value.model_dump()
        if isinstance(value, dict) and "requests" in value:
            return {"count": value["requests"], "per_seconds": value["period_s"]}
        return value

    @property
    def bucket_size(self) -> int:
        """Connections allowed back to back from a full bucket."""
        return self.burst if self.burst is not None else self.count

    @property
    def interval_ns(self) -> int:
        """Time to earn one token back, in nanoseconds."""
        return max(1, round(self.per_seconds * 1e9 / self.count))


class EgressRule(BaseModel):
    """One egress grant: exactly one of ``domain`` (exact or ``*.`` wildcard) or ``cidr``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str = Field(min_length=1, description="Stable rule id, e.g. 'egress[0]'; names the rule")
    domain: str | None = None
    cidr: IPNetwork | None = None
    ports: tuple[Port, ...] = Field(default=(), description="Empty = every port")
    rate_limit: RateLimit | None = None
    allow_internal_only: bool = False
    protocols: tuple[Literal["tcp", "udp"], ...] = Field(
        default=("tcp",), min_length=1, description="Transports the rule opens"
    )

    @field_validator("domain")
    @classmethod
    def _normalize_domain(cls, value: str | None) -> str | None:
        if value is None:
            return None
        name = value.strip().lower().rstrip(".")
        if name == "*":
            return name
        body = name[2:] if name.startswith("*.") else name
        labels = body.split(".")
        if not body or len(name) > 253 or not all(_LABEL.match(lb) for lb in labels):
            raise ValueError(
                f"domain {value!r}: expected a DNS name (labels of a-z, 0-9, '-') optionally"
                " starting with '*.'"
            )
        return name

    @model_validator(mode="after")
    def _exactly_one_target(self) -> Self:
        if (self.domain is None) == (self.cidr is None):
            raise ValueError(f"rule {self.id!r}: set exactly one of 'domain' or 'cidr'")
        return self

    @property
    def is_wildcard(self) -> bool:
        """True for ``*.example.com`` rules and the ``*`` (any destination) rule."""
        return self.domain is not None and self.domain.startswith("*")

    @property
    def is_any(self) -> bool:
        """True for ``domain: "*"``: every name and every address (on the rule's ports)."""
        return self.domain == "*"


class EgressPlan(BaseModel):
    """The egress policy of one sandbox, as compiled by the policy service."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    sandbox_id: str = Field(min_length=1)
    rules: tuple[EgressRule, ...] = ()
    dns_passthrough: bool = Field(
        default=False,
        description="Resolve every name (visibility); only rule-matched names open connects",
    )
    log_allowed: bool = Field(default=False, description="Emit verdict events for allows too")
    private_ports: tuple[Port, ...] = Field(
        default=(),
        max_length=8,
        description="Loopback ports of the node agent's listeners that serve this sandbox "
        "alone (its HTTPS proxy): no other sandbox reaches them, whatever its rules",
    )

    @model_validator(mode="after")
    def _unique_ids(self) -> Self:
        if len(self.rules) > MAX_RULES:
            raise ValueError(f"rules: at most {MAX_RULES} egress rules per sandbox")
        seen: set[str] = set()
        for rule in self.rules:
            if rule.id in seen:
                raise ValueError(f"rules: duplicate rule id {rule.id!r}")
            seen.add(rule.id)
        return self

    def slot(self, rule_id: str) -> int:
        """The rule's number in the kernel maps (1-based; 0 means "no rule")."""
        for i, rule in enumerate(self.rules, start=1):
            if rule.id == rule_id:
                return i
        raise KeyError(rule_id)

    def rule_at(self, slot: int) -> EgressRule | None:
        """The rule for a kernel slot, or None for 0/out of range."""
        return self.rules[slot - 1] if 0 < slot <= len(self.rules) else None

    def rate_limited_rules(self) -> tuple[EgressRule, ...]:
        """Rules with a rate limit: what the semantic layer counts requests against."""
        return tuple(r for r in self.rules if r.rate_limit is not None)

    @classmethod
    def from_enforcement_plan(
        cls,
        sandbox_id: str,
        plan: EnforcementPlan,
        *,
        log_allowed: bool = False,
        private_ports: tuple[int, ...] = (),
    ) -> EgressPlan:
        """The egress half of the policy service's compiled plan.

        Rule ids are ``egress[i]``, the index of the rule under
        ``security_policy.network.egress`` in the spec.
        """
        return cls(
            sandbox_id=sandbox_id,
            dns_passthrough=plan.dns_passthrough,
            log_allowed=log_allowed,
            private_ports=private_ports,
            # A tls_proxy rule is reached through the node agent's proxy only: the agent
            # replaces it by a grant of the proxy's port; left as is, it opens nothing.
            rules=tuple(
                _from_plan_rule(i, r) for i, r in enumerate(plan.egress) if not r.tls_proxy
            ),
        )


def _from_plan_rule(index: int, rule: PlanEgressRule) -> EgressRule:
    domain = {"domain": rule.domain, "wildcard": f"*.{rule.domain}", "any": "*"}.get(rule.kind)
    return EgressRule(
        id=f"egress[{index}]",
        domain=domain,
        cidr=ipaddress.ip_network(rule.cidr) if rule.kind == "cidr" and rule.cidr else None,
        ports=rule.ports,
        rate_limit=RateLimit.model_validate(rule.rate_limit) if rule.rate_limit else None,
        allow_internal_only=rule.internal_only,
        protocols=rule.protocols,
    )


@dataclass(frozen=True, slots=True)
class VerdictEvent:
    """One decision of a hook, read from the ring buffer.

    ``time_ns`` is CLOCK_MONOTONIC (``time.monotonic_ns()``); ``wall_time`` is the host clock when
    user space read it. ``sandbox_id``/``rule_id`` are None when the cgroup or slot is unknown.
    """

    time_ns: int
    wall_time: float
    cgroup_id: int
    sandbox_id: str | None
    pid: int
    comm: str
    verdict: Verdict
    hook: Hook
    rule_id: str | None
    family: int
    protocol: str
    address: str
    port: int

    @property
    def denied(self) -> bool:
        """True when the call was refused with EPERM."""
        return self.verdict.denied

    @property
    def destination(self) -> str:
        """``addr:port`` (``[v6]:port`` for IPv6)."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"

    def message(self) -> str:
        """A sentence for humans and ``policy.violation`` events."""
        call = self.hook.name.lower().rstrip("46")
        what = f"{call} to {self.destination}/{self.protocol} by {self.comm} (pid {self.pid})"
        if self.hook is Hook.SOCKET:
            what = f"socket (IPv{self.family} {self.protocol}) by {self.comm} (pid {self.pid})"
        reasons = {
            Verdict.ALLOW: f"allowed by rule {self.rule_id}",
            Verdict.REDIRECT_DNS: "DNS redirected to the node agent's DNS proxy",
            Verdict.DENY_NO_RULE: "denied: no egress rule allows this address and port",
            Verdict.DENY_EXPIRED: f"denied: the DNS answer for rule {self.rule_id} expired",
            Verdict.DENY_RATE_LIMIT: f"denied: rate limit of rule {self.rule_id} exceeded",
            Verdict.DENY_UNKNOWN_SANDBOX: "denied: cgroup has no egress plan",
            Verdict.DENY_PROTOCOL: (
                f"denied: rule {self.rule_id} does not open {self.protocol} (add "
                f"`protocol: {self.protocol}` or `protocols: [tcp, udp]` to it)"
            ),
            Verdict.DENY_DOH: (
                f"denied: DNS-over-HTTPS/TLS endpoint not named by rule {self.rule_id}"
            ),
            Verdict.DENY_STACK: (
                "denied: this is one of the DSec stack's own servers, which no sandbox may "
                "reach whatever its rules say"
                if call != "bind"
                else "denied: this port belongs to the DSec stack's servers or the node's DNS "
                "proxy, which no sandbox may take"
            ),
            Verdict.DENY_BIND: (
                "denied: a sandbox shares the host's network and listens on loopback only "
                "(bind 127.0.0.1 or ::1; a bind to 0.0.0.0 or :: is made a loopback one)"
            ),
            Verdict.DENY_SOCKETS: (
                "denied: the sandbox holds as many IP sockets as it may "
                "(DSEC_SANDBOX_MAX_SOCKETS), or the node's sandboxes together do (half of the "
                "node's ephemeral ports): each takes a port of the host's, which it shares, "
                "and a TCP connection it closed first keeps its port for a minute (TIME_WAIT)"
            ),
        }
        return f"{what}: {reasons[self.verdict]}"

    def as_dict(self) -> dict[str, object]:
        """JSON-ready view (the lead's ``policy.violation`` payload)."""
        return {
            "sandbox_id": self.sandbox_id,
            "cgroup_id": self.cgroup_id,
            "rule_id": self.rule_id,
            "verdict": self.verdict.label,
            "hook": self.hook.name.lower(),
            "protocol": self.protocol,
            "address": self.address,
            "port": self.port,
            "pid": self.pid,
            "comm": self.comm,
            "message": self.message(),
        }
