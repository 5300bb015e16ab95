"""Pure DNS policy: which names a sandbox may resolve, and under which egress rules.

Also the lookup the semantic layer needs to count HTTP requests per rule: `match_name` gives the
domain rules (with their ``rate_limit``) that govern a host name.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from dsec_nodeagent.ebpf.domain import DOH_HOSTNAMES
from dsec_nodeagent.ebpf.model import EgressPlan, EgressRule


def normalize_name(name: str) -> str:
    """Lower case, no trailing dot: the form rules are stored in."""
    return name.strip().lower().rstrip(".")


def rule_matches(rule: EgressRule, name: str) -> bool:
    """``example.com`` matches itself only; ``*.example.com`` matches every name below it
    (``a.example.com``, ``a.b.example.com``) but not ``example.com`` itself; ``*`` matches all."""
    if rule.domain is None:
        return False
    if rule.is_any:
        return True
    if rule.is_wildcard:
        return name.endswith(rule.domain[1:])
    return name == rule.domain


@dataclass(frozen=True, slots=True)
class NameMatch:
    """Domain rules that allow a name; ``exact`` when one of them names it without a wildcard."""

    rules: tuple[EgressRule, ...]
    exact: bool


def match_name(plan: EgressPlan, name: str) -> NameMatch | None:
    """The domain rules of ``plan`` that allow ``name``, or None.

    Well-known DoH/DoT resolver names count only when a rule names them exactly.
    """
    name = normalize_name(name)
    rules = tuple(r for r in plan.rules if rule_matches(r, name))
    if not rules:
        return None
    exact = any(not r.is_wildcard for r in rules)
    if name in DOH_HOSTNAMES and not exact:
        return None
    return NameMatch(rules=rules, exact=exact)


class QueryAction(enum.Enum):
    """What the proxy does with a question."""

    RESOLVE = "resolve"  # forward, then open the answered addresses for the matched rules
    PASSTHROUGH = "passthrough"  # forward, open nothing (``dns_passthrough``)
    DENY = "deny"  # answer NXDOMAIN (or REFUSED) without asking upstream


def decide_query(plan: EgressPlan, name: str) -> tuple[QueryAction, NameMatch | None]:
    """Decide one question of a sandbox."""
    match = match_name(plan, name)
    if match is not None:
        return QueryAction.RESOLVE, match
    if plan.dns_passthrough:
        return QueryAction.PASSTHROUGH, None
    return QueryAction.DENY, None


@dataclass(frozen=True, slots=True)
class DnsBounds:
    """Operator bounds of the DNS proxy and of the allow-map entries its answers create.

    The defaults are the README's "Egress and DNS bounds" table.
    """

    max_ttl_s: int = 300  # an answered address stays open at most this long (then re-resolve)
    sandbox_quota: int = 1024  # allow-map entries (address x port) one sandbox may hold
    node_capacity: int = 65536  # the kernel's host maps (MAX_HOSTS): shared fairly when full
    max_addresses: int = 32  # addresses kept from one answer (the first ones)
    queries_per_s: float = 50.0  # per sandbox, refilling bucket
    query_burst: int = 100
    max_query_bytes: int = 512  # one question + an OPT record fits in ~300 bytes
    max_wildcard_prefix: int = 64  # characters a wildcard rule lets a sandbox choose in a name
    max_tcp_connections: int = 16  # open TCP connections to the proxy per sandbox
    extra_qtypes: frozenset[str] = field(default_factory=frozenset)  # besides A/AAAA, e.g. HTTPS

    def __post_init__(self) -> None:
        for name in (
            "max_ttl_s",
            "sandbox_quota",
            "node_capacity",
            "max_addresses",
            "query_burst",
            "max_query_bytes",
            "max_wildcard_prefix",
            "max_tcp_connections",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be at least 1, got {getattr(self, name)}")
        if self.queries_per_s <= 0:
            raise ValueError(f"queries_per_s: must be positive, got {self.queries_per_s}")


def wildcard_prefix(match: NameMatch, name: str) -> int:
    """How many characters of ``name`` the sandbox chose freely (0 under an exact rule).

    Under ``*.example.com`` that is everything left of ``.example.com``; under ``*`` the name.
    """
    if match.exact:
        return 0
    name = normalize_name(name)
    prefixes = [len(name) if r.is_any else len(name) - len(r.domain or "") + 1 for r in match.rules]
    return min(prefixes)
