"""A hostile sandbox floods refusals beside a victim: a few events and summaries, bounded memory,
the victim's lifecycle on time; forged semantic reports are never the node agent's verdict.

Each test runs the whole node agent in this process (real NATS, real sandboxes, eBPF, DNS proxy)
through ``_nodeagent_harness``.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the harness
from _nodeagent_harness import CONNECT_FLOOD, DNS_FLOOD, NodeAgentHarness, rss_mb

from dsec_nodeagent.ebpf import VerdictEvent

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

SYSCALL_FLOOD = """
import json, socket, time
calls = 0
end = time.monotonic() + {seconds}
while time.monotonic() < end:
    try:
        socket.socket(socket.AF_PACKET, socket.SOCK_RAW)
    except OSError:
        calls += 1
print(json.dumps({{"calls": calls}}), flush=True)
"""

# Datagrams straight to the events socket: an unknown rule, "allow" claimed for the deny rule,
# a rule name the plan has with ANSI escapes in the target, and 2,000 unique 2 KB rule names.
FORGER = r"""
import json, socket
sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
path = "/run/dsec/events.sock"
def send(**d):
    sock.sendto(json.dumps(d).encode(), path)
send(on="connect", action="allow", subject="evil.test:443", rule="approved by security team")
deny = "semantic[0] deny open /tmp/secret*"
send(on="open", action="allow", subject="/tmp/secret.txt", rule=deny)
for i in range(2000):
    send(on="open", action="deny", subject="/x", rule=f"r{i}-" + "A" * 2048)
send(on="open", action="deny", subject="/tmp/secret\x1b[31mred\nline", rule=deny)
print("sent", flush=True)
"""


@pytest.fixture
def home() -> Iterator[Path]:
    """A short home: the sandboxes' socket paths must fit in AF_UNIX's 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="dsf-", dir="/tmp"))
    yield path / "home"
    shutil.rmtree(path, ignore_errors=True)


def _verdicts(h: NodeAgentHarness) -> dict[str, int]:
    """Verdict events the node agent's reader saw, per sandbox (a listener beside the agent's)."""
    seen: dict[str, int] = {}

    def count(event: VerdictEvent) -> None:
        if event.sandbox_id is not None and event.denied:
            seen[event.sandbox_id] = seen.get(event.sandbox_id, 0) + 1

    h.controller.add_listener(count)
    return seen


async def _counted(h: NodeAgentHarness, sid: str, expected: int, timeout_s: float = 20.0) -> int:
    """Poll until the violations + summaries of ``sid`` account for ``expected`` refusals."""
    deadline = time.monotonic() + timeout_s
    total = 0
    while time.monotonic() < deadline:
        rec = h.recorded[sid]
        total = len(rec.of("policy.violation")) + sum(
            e.payload["count"] for e in rec.of("policy.violation_summary")
        )
        if total >= expected:
            return total
        await asyncio.sleep(0.1)
    return total


async def test_connect_flood_is_summarized_and_the_victim_starts_on_time(
    home: Path, nats_url: str
) -> None:
    async with NodeAgentHarness(
        home, nats_url, policy_summary_interval_s=1.0, policy_flood_limit=0
    ) as h:
        seen = _verdicts(h)
        warm = await h.submit("warm-up", "print('hi')")  # the runtime's discovery cache
        await h.wait_for(warm, "sandbox.exited")
        idle = await h.submit("victim-idle", "print('hi')")
        await h.wait_for(idle, "sandbox.ready")
        await h.wait_for(idle, "sandbox.exited")
        idle_ms = h.ready_ms(idle)

        rss_before = rss_mb()
        attacker = await h.submit("attacker", CONNECT_FLOOD.format(seconds=4))
        await h.wait_for(attacker, "sandbox.ready")
        await asyncio.sleep(1.0)  # the flood is on
        victim = await h.submit("victim", "print('hi')")
        await h.wait_for(victim, "sandbox.ready")
        flood_ms = h.ready_ms(victim)
        rss_peak = rss_mb()
        exited = await h.wait_for(attacker, "sandbox.exited")
        stderr = h.agent.manager.log_paths(attacker)[1].read_text()
        assert exited.payload["reason"] == "ok", stderr[-2000:]

        rec = h.recorded[attacker]
        violations = rec.of("policy.violation")
        assert 0 < len(violations) <= 5, [v.payload for v in violations]
        assert all(v.payload["operation"] == "connect" for v in violations)
        refused = json.loads(h.agent.manager.log_paths(attacker)[0].read_text().splitlines()[-1])
        # Every refused connect is in an event or a summary count: those the reader saw one by
        # one, and those the kernel counted while the reader let the ring buffer overflow.
        total = await _counted(h, attacker, refused["refused"])
        assert total == refused["refused"] > seen[attacker] > 0
        summaries = rec.of("policy.violation_summary")
        assert summaries and all(s.payload["rule_id"] == "default-deny" for s in summaries)
        assert summaries[0].payload["sample_target"].startswith("10.77.0.1:80")
        assert len(rec.events) < 60, len(rec.events)  # not one event per refusal
        assert rss_peak - rss_before < 60, (rss_before, rss_peak)
        # Under the flood, the victim's sandbox.ready still arrives: what the node agent adds to
        # the sandbox's own start (consume, publish, queueing behind refusals) stays far below the
        # flood's 4 s, so its loop was never held by the attacker's refusals. The bound is loose on
        # purpose: on a shared 2-core host the attacker's connects, the kernel's refusals and
        # nats-server all compete with the agent for CPU, and CI saw 29 ms idle against 160 ms
        # under the flood with nothing wrong. Publishing every refusal is caught by the counts
        # above, not here (with one event per refusal the victim's overhead stayed under 60 ms:
        # the kernel's ring buffer, not the agent's loop, absorbs the flood).
        idle_overhead, flood_overhead = h.overhead_ms(idle), h.overhead_ms(victim)
        assert flood_overhead < idle_overhead + 500, (idle_overhead, flood_overhead)
        assert flood_ms < 2000, (idle_ms, flood_ms)


async def test_dns_refusal_flood_is_summarized(home: Path, nats_url: str) -> None:
    async with NodeAgentHarness(home, nats_url, policy_summary_interval_s=1.0) as h:
        attacker = await h.submit("dnsflood", DNS_FLOOD.format(seconds=2))
        await h.wait_for(attacker, "sandbox.exited")
        rec = h.recorded[attacker]
        violations = [v for v in rec.of("policy.violation") if v.payload["operation"] == "dns"]
        # The first few of each rule (no egress rule; then the per-sandbox query rate) are
        # events; everything after them is counted in summaries.
        per_rule = Counter(v.payload["rule_id"] for v in violations)
        assert per_rule and set(per_rule) <= {"default-deny", "dns.rate"}
        assert all(1 <= n <= 5 for n in per_rule.values()), per_rule
        refused = json.loads(h.agent.manager.log_paths(attacker)[0].read_text().splitlines()[-1])
        # Each failed lookup asked the proxy at least once (A and AAAA), all counted.
        total = await _counted(h, attacker, refused["refused"])
        summaries = rec.of("policy.violation_summary")
        assert summaries and {s.payload["layer"] for s in summaries} == {"dns"}
        assert total >= refused["refused"] > 5


async def test_a_sandbox_passing_the_flood_limit_is_stopped(home: Path, nats_url: str) -> None:
    async with NodeAgentHarness(
        home, nats_url, policy_flood_limit=300, policy_summary_interval_s=1.0
    ) as h:
        attacker = await h.submit("flooder", CONNECT_FLOOD.format(seconds=30))
        exited = await h.wait_for(attacker, "sandbox.exited", timeout_s=30)
        assert exited.payload["reason"] == "policy_flood"
        assert exited.payload["duration_s"] < 20


async def test_a_seccomp_flood_is_summarized(home: Path, nats_url: str) -> None:
    async with NodeAgentHarness(
        home, nats_url, policy_summary_interval_s=1.0, policy_flood_limit=0
    ) as h:
        attacker = await h.submit("sysflood", SYSCALL_FLOOD.format(seconds=2))
        await h.wait_for(attacker, "sandbox.exited")
        out = json.loads(h.agent.manager.log_paths(attacker)[0].read_text().splitlines()[-1])
        rec = h.recorded[attacker]
        by_rule: dict[str, int] = {}
        for v in rec.of("policy.violation"):
            by_rule[v.payload["rule_id"]] = by_rule.get(v.payload["rule_id"], 0) + 1
        rule = "seccomp.socket-family"  # AF_PACKET: a family no sandbox may open
        assert by_rule.get(rule, 0) == 5, by_rule
        # Every refused system call was answered and counted (the sandbox waited for each).
        deadline = time.monotonic() + 15
        seccomp = 0
        while time.monotonic() < deadline:
            seccomp = by_rule[rule] + sum(
                s.payload["count"]
                for s in rec.of("policy.violation_summary")
                if s.payload["rule_id"] == rule
            )
            if seccomp >= out["calls"]:
                break
            await asyncio.sleep(0.1)
        assert seccomp == out["calls"] > 5
        assert len(rec.events) < 40, len(rec.events)


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_forged_semantic_reports_are_refused_and_never_signed_as_verdicts(
    home: Path, nats_url: str
) -> None:
    before = {
        r: _sample("dsec_semantic_reports_refused_total", reason=r)
        for r in ("unknown-rule", "action-mismatch")
    }
    async with NodeAgentHarness(home, nats_url) as h:
        sid = await h.submit("forger", FORGER)
        await h.wait_for(sid, "sandbox.exited")
        await h.outlet.drain()
        reported = await h.wait_for(sid, "policy.reported")
        rec = h.recorded[sid]
        assert rec.of("policy.violation") == []  # nothing the sandbox said became a verdict
        texts = json.dumps(
            [a.envelope.payload for a in rec.events if a.envelope.producer == "nodeagent"]
        )
        assert "approved by security team" not in texts
        assert "AAAA" not in texts
        # The one plausible report: the plan's rule and action, its target escaped.
        assert reported.payload["rule_id"] == "semantic[0] deny open /tmp/secret*"
        assert reported.payload["action"] == "deny"
        assert reported.payload["target"] == "/tmp/secret\\x1b[31mred\\nline"
        assert len(rec.of("policy.reported")) == 1
    after = {r: _sample("dsec_semantic_reports_refused_total", reason=r) for r in before}
    assert after["unknown-rule"] - before["unknown-rule"] == 2001
    assert after["action-mismatch"] - before["action-mismatch"] == 1
    # The metric labels stay a bounded set: no rule name of the sandbox became a label.
    families = [m for m in REGISTRY.collect() if m.name == "dsec_semantic_decisions"]
    labels = {s.labels["rule"] for f in families for s in f.samples}
    assert all(len(label) < 40 for label in labels), labels
