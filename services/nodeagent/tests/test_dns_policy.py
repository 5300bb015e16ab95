"""Which names a sandbox may resolve (pure)."""

from __future__ import annotations

import pytest

from dsec_nodeagent.dns.policy import QueryAction, decide_query, match_name, rule_matches
from dsec_nodeagent.dns.upstream import parse_upstream
from dsec_nodeagent.ebpf.model import EgressPlan, EgressRule

pytestmark = pytest.mark.unit

EXACT = EgressRule(id="exact", domain="api.example.test", ports=(443,))
WILD = EgressRule(id="wild", domain="*.cdn.test", ports=(443,))
PLAN = EgressPlan(sandbox_id="sbx", rules=(EXACT, WILD))


@pytest.mark.parametrize(
    ("rule", "name", "matches"),
    [
        (EXACT, "api.example.test", True),
        (EXACT, "API.Example.Test.", False),  # match_name normalizes; rule_matches is raw
        (EXACT, "x.api.example.test", False),
        (WILD, "a.cdn.test", True),
        (WILD, "a.b.cdn.test", True),
        (WILD, "cdn.test", False),
        (WILD, "evilcdn.test", False),
    ],
)
def test_rule_matches(rule: EgressRule, name: str, matches: bool) -> None:
    assert rule_matches(rule, name) is matches


def test_match_name_normalizes_and_reports_exactness() -> None:
    exact = match_name(PLAN, "API.Example.Test.")
    assert exact is not None and exact.exact and exact.rules == (EXACT,)
    wild = match_name(PLAN, "img.cdn.test")
    assert wild is not None and not wild.exact and wild.rules == (WILD,)
    assert match_name(PLAN, "other.test") is None


def test_every_matching_rule_is_returned() -> None:
    both = EgressPlan(sandbox_id="s", rules=(WILD, EgressRule(id="x", domain="a.cdn.test")))
    match = match_name(both, "a.cdn.test")
    assert match is not None and match.exact and [r.id for r in match.rules] == ["wild", "x"]


def test_doh_names_need_an_exact_rule() -> None:
    wildcard = EgressPlan(sandbox_id="s", rules=(EgressRule(id="g", domain="*.google"),))
    assert match_name(wildcard, "dns.google") is None
    assert match_name(wildcard, "maps.google") is not None
    exact = EgressPlan(sandbox_id="s", rules=(EgressRule(id="g", domain="dns.google"),))
    assert match_name(exact, "dns.google") is not None
    anything = EgressPlan(sandbox_id="s", rules=(EgressRule(id="a", domain="*"),))
    assert match_name(anything, "cloudflare-dns.com") is None
    assert match_name(anything, "example.org") is not None


def test_decide_query_deny_resolve_passthrough() -> None:
    assert decide_query(PLAN, "api.example.test")[0] is QueryAction.RESOLVE
    assert decide_query(PLAN, "other.test") == (QueryAction.DENY, None)
    passthrough = PLAN.model_copy(update={"dns_passthrough": True})
    assert decide_query(passthrough, "other.test") == (QueryAction.PASSTHROUGH, None)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("127.0.0.1:5353", ("127.0.0.1", 5353)),
        ("10.0.0.2", ("10.0.0.2", 53)),
        ("[::1]:53", ("::1", 53)),
        ("::1", ("::1", 53)),
    ],
)
def test_parse_upstream(text: str, expected: tuple[str, int]) -> None:
    assert parse_upstream(text) == expected


@pytest.mark.parametrize("text", ["dns.example:53", "127.0.0.1:0", "127.0.0.1:x", "[::1"])
def test_parse_upstream_errors_name_the_setting(text: str) -> None:
    with pytest.raises(ValueError, match="DSEC_DNS_UPSTREAM"):
        parse_upstream(text)
