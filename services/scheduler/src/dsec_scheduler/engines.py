"""Which placement engine the scheduler uses: ``DSEC_SCHEDULER_POLICY`` (default ``dsec``).

The engine (:mod:`dsec_scheduler.placement.engine`) serves ``random``, ``bestfit``, ``fgd``
and ``dsec`` (fragmentation-aware packing of GPU units; units without GPUs spread over the
nodes without GPUs, least loaded first: docs/placement.md); the reference engine
(:mod:`dsec_scheduler.placement.simple`) serves ``leastloaded`` (the scheduler's placement
before GPU placement existed). The policy a decision was made by is the one its
``unit.placed`` names.
"""

from __future__ import annotations

from dsec_scheduler.placement import engine as tuned
from dsec_scheduler.placement.api import PlacementEngine
from dsec_scheduler.placement.simple import POLICIES as SIMPLE_POLICIES
from dsec_scheduler.placement.simple import SimpleEngine

DEFAULT_POLICY = "dsec"


def make_engine(policy: str = DEFAULT_POLICY) -> PlacementEngine:
    """The engine for ``policy``.

    Raises:
        ValueError: an unknown policy (the message lists the valid ones).
    """
    policy = policy.strip().lower() or DEFAULT_POLICY
    if policy in tuned.POLICIES:
        return tuned.make_engine(policy)
    if policy in SIMPLE_POLICIES:
        return SimpleEngine(policy)
    valid = ", ".join(sorted({*tuned.POLICIES, *SIMPLE_POLICIES}))
    raise ValueError(f"DSEC_SCHEDULER_POLICY={policy!r}: unknown; valid: {valid}")
