"""The refusal gate and the report check: pure decisions (unit)."""

from __future__ import annotations

import asyncio

import pytest
from dsec_core import events

from dsec_nodeagent.refusals import Admission, Key, RefusalGate, metric_rule
from dsec_nodeagent.semantic.models import SemanticDecision, SemanticRules
from dsec_nodeagent.semantic.reports import Refused, check_report

pytestmark = pytest.mark.unit

KEY = Key("kernel", "default-deny", "connect")


def test_a_burst_is_published_then_counted_and_the_window_starts_again() -> None:
    gate = RefusalGate(burst=5, window_s=60)
    admitted = [gate.admit("s", KEY, f"10.0.0.{i}:80", now=100.0 + i * 0.001) for i in range(1000)]
    assert [d.admission for d in admitted[:5]] == [Admission.EVENT] * 5
    assert {d.admission for d in admitted[5:]} == {Admission.COUNTED}
    (summary,) = gate.take_summaries("s")
    assert summary.count == 995 and summary.rule_id == "default-deny"
    assert summary.sample_target == "10.0.0.5:80"  # the first refusal that was counted
    assert summary.first <= summary.last
    assert gate.take_summaries("s") == []  # taken counts are reset
    assert gate.admit("s", KEY, "x", now=161.0).admission is Admission.EVENT


def test_the_table_is_fixed_size_per_sandbox() -> None:
    gate = RefusalGate(burst=0, max_keys=4)
    for i in range(10_000):
        gate.admit("s", Key("semantic", f"rule-{i}", "open"), "t", now=1.0)
    summaries = gate.take_summaries("s")
    assert len(summaries) == 5  # four keys, then everything else under one overflow key
    overflow = next(s for s in summaries if s.rule_id == "unknown")
    assert overflow.count == 10_000 - 4


def test_the_flood_limit_is_reported_once_and_unseen_counts_count() -> None:
    gate = RefusalGate(burst=1, flood_limit=100)
    flooded = [gate.admit("s", KEY, "t", now=1.0).flooded for _ in range(100)]
    assert not any(flooded)
    assert gate.add("s", KEY, 50, now=2.0) is True  # the kernel's counts cross it
    assert gate.admit("s", KEY, "t", now=3.0).flooded is False  # reported once
    assert sum(s.count for s in gate.take_summaries("s")) == 99 + 50 + 1


def test_a_summary_target_is_bounded_and_escaped() -> None:
    gate = RefusalGate(burst=0)
    gate.admit("s", KEY, "\x1b[31m" + "a" * 1000, now=1.0)
    (summary,) = gate.take_summaries("s")
    assert summary.sample_target.startswith("\\x1b[31m") and len(summary.sample_target) == 256


@pytest.mark.parametrize(
    ("rule_id", "label"),
    [
        ("egress[3]", "egress[3]"),
        ("semantic[0] deny open /tmp/secret*", "semantic[0]"),
        ("approved by security team", "unknown"),
        ("A" * 2048, "unknown"),
        (None, "unknown"),
        ("seccomp", "seccomp"),
    ],
)
def test_metric_labels_come_from_a_bounded_set(rule_id: str | None, label: str) -> None:
    assert metric_rule(rule_id) == label


RULES = SemanticRules.model_validate(
    {
        "rules": [
            {"name": "semantic[0] deny open /tmp/secret*", "on": "open",
             "match": {"path": "/tmp/secret*"}, "action": "deny", "spec_line": 12},
        ],
        "rate_limits": [
            {"name": "egress[0] api.test", "host": "api.test", "requests": 5, "period_s": 60},
        ],
    }
)  # fmt: skip


def _report(**fields: object) -> events.PolicyReported | Refused:
    return check_report(RULES, SemanticDecision.model_validate({"sandbox_id": "s", **fields}))


def test_a_report_that_fits_the_plan_is_a_policy_reported_with_the_plans_facts() -> None:
    report = _report(
        on="open", action="deny", subject="/tmp/secret\n.txt", rule=RULES.rules[0].name,
        spec_line=999, detail="allow: approved by security team",
    )  # fmt: skip
    assert isinstance(report, events.PolicyReported)
    assert report.spec_line == 12  # from the plan, not from the sandbox
    assert report.target == "/tmp/secret\\n.txt"
    assert "approved" not in report.message and "not a kernel verdict" in report.message


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"on": "connect", "action": "allow", "subject": "x", "rule": "approved by security team"},
         "unknown-rule"),
        ({"on": "open", "action": "allow", "subject": "/tmp/secret", "rule":
          "semantic[0] deny open /tmp/secret*"}, "action-mismatch"),
        ({"on": "connect", "action": "deny", "subject": "/tmp/secret", "rule":
          "semantic[0] deny open /tmp/secret*"}, "action-mismatch"),
        ({"on": "open", "action": "log", "subject": "/x"}, "no-rule"),
        ({"on": "exec", "action": "deny", "subject": "/x"}, "unknown-operation"),
        ({"on": "open", "action": "approve", "subject": "/x"}, "unknown-action"),
        ({"on": "http", "action": "deny", "subject": "u", "detail": "rate limit (egress[9] x)"},
         "no-rule"),
    ],
)  # fmt: skip
def test_a_report_that_does_not_fit_the_plan_is_refused(
    fields: dict[str, object], reason: str
) -> None:
    assert _report(**fields) == Refused(reason)


def test_a_rate_limit_deny_of_a_configured_budget_is_reported() -> None:
    report = _report(on="http", action="deny", subject="https://api.test/q",
                     detail="rate limit 5 requests per 60s (egress[0] api.test)")  # fmt: skip
    assert isinstance(report, events.PolicyReported) and report.rule_id == "egress[0] api.test"


def test_logged_decisions_are_summarized_but_never_a_flood() -> None:
    gate = RefusalGate(burst=1, flood_limit=10)
    log_key = Key("semantic", "semantic[0] log http api.test", "http")
    assert not any(
        gate.admit("s", log_key, "u", now=1.0, refused=False).flooded for _ in range(1000)
    )
    assert gate.total("s") == 0
    assert sum(s.count for s in gate.take_summaries("s")) == 999


async def test_an_exit_never_waits_behind_a_full_queue_and_no_summary_is_lost() -> None:
    from dsec_nodeagent.outlet import EventOutlet

    published: list[tuple[events.Payload, str]] = []
    release = asyncio.Event()

    async def publish(payload: events.Payload, sid: str, event_id: str | None) -> None:
        await release.wait()  # the bus is slow: the queue fills up
        published.append((payload, sid))

    outlet = EventOutlet(publish, RefusalGate(burst=1), queue_size=2)
    await outlet.start()
    for i in range(50):
        outlet.refusal(f"s{i % 5}", Key("kernel", f"egress[{i % 3}]", "connect"), "t", _event)
    await asyncio.wait_for(outlet.sandbox_done("s0"), 1.0)  # returns at once, queue full
    release.set()
    await outlet.stop()
    counted = sum(
        p.count if isinstance(p, events.PolicyViolationSummary) else 1 for p, _ in published
    )
    assert counted == 50  # every refusal in an event or a count


def _event() -> events.PolicyViolation:
    return events.PolicyViolation(
        layer="kernel", rule_id="default-deny", action="deny", operation="connect", target="t"
    )


def test_refusals_counted_elsewhere_are_only_events_here() -> None:
    gate = RefusalGate(burst=5, flood_limit=1_000)
    admitted = [gate.admit("s", KEY, "t", now=1.0, count=False) for _ in range(10_000)]
    assert sum(d.admission is Admission.EVENT for d in admitted) == 5
    assert gate.total("s") == 5 and gate.take_summaries("s") == []  # the kernel counts the rest
    assert gate.add("s", KEY, 9_995, now=2.0) is True  # ... and crosses the flood limit
    (summary,) = gate.take_summaries("s")
    assert summary.count == 9_995
