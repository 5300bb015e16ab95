"""Refusals are summarized, not streamed (pure decisions, no I/O).

Every refusal of a sandbox (a kernel verdict, a DNS refusal, a report of the in-sandbox semantic
layer) goes through one :class:`RefusalGate`. Per sandbox and key ``(layer, rule, operation)``
the first ``burst`` refusals of each ``window_s`` become full events; the rest are counted and
later published as one ``policy.violation_summary`` per key and interval. The table is fixed-size:
at most ``max_keys`` keys per sandbox (further keys share the key ``rule_id="unknown"``), so a
sandbox inventing targets, rule names or operations cannot grow it. A sandbox refused more than
``flood_limit`` times in total is reported once as flooding (the caller may stop it).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from typing import Literal

from dsec_core import events
from dsec_core.text import bound

SummaryLayer = Literal["kernel", "semantic", "dns"]
SAMPLE_LIMIT = 256
FIXED_RULES = frozenset(
    {
        "seccomp",
        "seccomp.denied",
        "seccomp.socket-family",
        "seccomp.not-allowed",
        "landlock",
        "default-deny",
        "rate_limit",
        "default",
        "unknown",
        "report_refused",
        "system.egress",
        "system.bind",
        "dns.qtype",
        "dns.malformed",
        "dns.opcode",
        "dns.name",
        "dns.rate",
        "dns.tcp",
        "dns.rebinding",
        "dns.quota",
    }
)
_PLAN_RULE = re.compile(r"^(egress|semantic|cidr|domain)\[(\d{1,3})\]")


def metric_rule(rule_id: str | None) -> str:
    """A Prometheus label for a rule id, from a bounded set: the fixed ids, or the plan's
    ``egress[i]`` / ``semantic[i]`` prefix (i < 1000); anything else is ``unknown``.

    Never free text: a semantic rule's name carries the spec's pattern after its index.
    """
    if rule_id is None:
        return "unknown"
    if rule_id in FIXED_RULES:
        return rule_id
    match = _PLAN_RULE.match(rule_id)
    return f"{match.group(1)}[{match.group(2)}]" if match else "unknown"


class Admission(Enum):
    """What to do with one refusal."""

    EVENT = "event"
    """Publish it as its own event."""
    COUNTED = "counted"
    """Counted into the key's next summary."""


@dataclass(frozen=True)
class Key:
    """What a summary is about."""

    layer: SummaryLayer
    rule_id: str
    operation: str


@dataclass
class _Slot:
    window_start: float
    sent: int = 0
    pending: int = 0
    first: float = 0.0
    last: float = 0.0
    sample: str = ""


@dataclass
class _Table:
    slots: dict[Key, _Slot] = field(default_factory=dict)
    total: int = 0
    flooded: bool = False


@dataclass(frozen=True)
class Decision:
    """The gate's answer for one refusal: publish or count, and whether this one crossed the
    sandbox's flood limit (true exactly once per sandbox)."""

    admission: Admission
    flooded: bool = False


class RefusalGate:
    """Fixed-size per-sandbox counters that turn a flood into a few events and summaries.

    Args:
        burst: full events per key and window (0: every refusal is only counted).
        window_s: the window of ``burst``.
        max_keys: keys per sandbox; more share one overflow key.
        flood_limit: refusals per sandbox after which :attr:`Decision.flooded` is reported once
            (0: never).
    """

    def __init__(
        self, *, burst: int = 5, window_s: float = 60.0, max_keys: int = 64, flood_limit: int = 0
    ) -> None:
        self.burst = burst
        self.window_s = window_s
        self.max_keys = max_keys
        self.flood_limit = flood_limit
        self._tables: dict[str, _Table] = {}

    def admit(
        self,
        sandbox_id: str,
        key: Key,
        target: str,
        now: float,
        *,
        refused: bool = True,
        count: bool = True,
    ) -> Decision:
        """Count one refusal of ``sandbox_id`` at ``now`` (seconds, wall clock).

        Args:
            refused: false for a decision that allowed (a logged request): summarized alike,
                but not counted towards the flood limit.
            count: false when the caller counts the refusals past the burst elsewhere (the
                kernel's counters, added with :meth:`add`): only a burst event is counted here.
        """
        table = self._tables.setdefault(sandbox_id, _Table())
        slot = self._slot(table, key, now)
        if now - slot.window_start >= self.window_s:
            slot.window_start, slot.sent = now, 0
        admission = Admission.COUNTED
        if slot.sent < self.burst:
            slot.sent += 1
            admission = Admission.EVENT
        elif count:
            self._count(slot, target, now)
        flooded = False
        if refused and (count or admission is Admission.EVENT):
            table.total += 1
            if self.flood_limit and not table.flooded and table.total > self.flood_limit:
                table.flooded = flooded = True
        return Decision(admission, flooded)

    def uncount(self, sandbox_id: str) -> None:
        """Take back one refusal of the flood total (its event was not published and the
        caller counts it elsewhere)."""
        table = self._tables.get(sandbox_id)
        if table is not None and table.total > 0:
            table.total -= 1

    def add(self, sandbox_id: str, key: Key, count: int, now: float, sample: str = "") -> bool:
        """Count ``count`` refusals known only as a number (the kernel's counters);
        ``True`` when this crossed the flood limit. ``sample``: one of their targets."""
        table = self._tables.setdefault(sandbox_id, _Table())
        table.total += count
        slot = self._slot(table, key, now)
        if slot.pending == 0:
            slot.first = now
            slot.sample = bound(sample, SAMPLE_LIMIT)
        slot.pending += count
        slot.last = now
        if self.flood_limit and not table.flooded and table.total > self.flood_limit:
            table.flooded = True
            return True
        return False

    def demote(self, sandbox_id: str, key: Key, target: str, now: float) -> None:
        """Count a refusal that was admitted as an event but could not be queued."""
        table = self._tables.setdefault(sandbox_id, _Table())
        self._count(self._slot(table, key, now), target, now)

    def _slot(self, table: _Table, key: Key, now: float) -> _Slot:
        slot = table.slots.get(key)
        if slot is None:
            if len(table.slots) >= self.max_keys:
                key = Key(key.layer, "unknown", "other")
                slot = table.slots.get(key)
            if slot is None:
                slot = table.slots[key] = _Slot(window_start=now)
        return slot

    @staticmethod
    def _count(slot: _Slot, target: str, now: float) -> None:
        if slot.pending == 0:
            slot.first = now
            slot.sample = bound(target, SAMPLE_LIMIT)
        slot.pending += 1
        slot.last = now

    def total(self, sandbox_id: str) -> int:
        """Refusals counted for ``sandbox_id`` so far."""
        table = self._tables.get(sandbox_id)
        return table.total if table is not None else 0

    def sandboxes(self) -> list[str]:
        """Sandboxes with a table."""
        return list(self._tables)

    def take_summaries(
        self, sandbox_id: str, limit: int | None = None
    ) -> list[events.PolicyViolationSummary]:
        """The summaries of ``sandbox_id``'s pending counts (at most ``limit``); those taken are
        reset, the others keep counting (they coalesce into the next interval)."""
        table = self._tables.get(sandbox_id)
        out: list[events.PolicyViolationSummary] = []
        if table is None:
            return out
        for key, slot in table.slots.items():
            if slot.pending == 0:
                continue
            if limit is not None and len(out) >= limit:
                break
            out.append(
                events.PolicyViolationSummary(
                    layer=key.layer,
                    rule_id=key.rule_id,
                    operation=key.operation,
                    count=slot.pending,
                    first=_utc(slot.first),
                    last=_utc(slot.last),
                    sample_target=slot.sample,
                )
            )
            slot.pending = 0
            slot.sample = ""
        return out

    def forget(self, sandbox_id: str) -> None:
        """Drop ``sandbox_id``'s table (after its last summaries were taken)."""
        self._tables.pop(sandbox_id, None)


def _utc(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, UTC)
