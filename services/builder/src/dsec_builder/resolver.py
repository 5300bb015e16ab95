"""Submission-time resolution: a lock, or a conflict explained with alternatives that resolve.

uv is the resolver (no resolver of our own). When it proves the spec unsatisfiable, each
requirement its derivation names is probed a few ways in parallel within a time budget: its
range moved to the nearest newer versions (resolved lowest-first, so the *nearest* one is
found) and to the nearest older ones. Every alternative offered comes from a probe that
resolved, so it is proved to resolve. Locks that resolve but match a curated known-bad
combination are blocked the same way, with the rule's alternatives proved by resolving.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from importlib import resources

from dsec_core.settings import Settings
from packaging.utils import canonicalize_name

from dsec_builder.adapters.uv import DEFAULT_INDEX_URL, Uv, UvTimeoutError
from dsec_builder.domain import (
    KnownBadRule,
    LockFormatError,
    Relaxation,
    alternative_reason,
    clean_resolver_output,
    conflicting_requirements,
    find_requirement,
    fingerprint,
    lock_hash,
    match_known_bad,
    parse_known_bad,
    parse_pylock,
    propose,
    redact_text,
    redact_url,
    relaxations,
    requirements_text,
    summarize_conflict,
    with_requirement,
)
from dsec_builder.errors import ResolverUnavailableError
from dsec_builder.models import (
    Alternative,
    Conflict,
    KnownBadHit,
    Lock,
    Requirement,
    Resolved,
    Target,
)

log = logging.getLogger(__name__)

# Requirements of one conflict probed for alternatives; a derivation rarely names more.
MAX_PROBED_REQUIREMENTS = 4

_Probe = Callable[[], Awaitable[Alternative | None]]


def load_known_bad() -> tuple[KnownBadRule, ...]:
    """The curated known-bad combinations shipped with the builder."""
    text = resources.files("dsec_builder").joinpath("data/known_bad.toml").read_text()
    return parse_known_bad(text)


@dataclass(frozen=True)
class _Unsatisfiable:
    output: str


class Resolver:
    """Resolves a spec's requirements for a target interpreter and platform.

    Args:
        uv: The resolver engine.
        rules: Known-bad combinations; defaults to the curated file.
        alternatives_budget_s: Wall-clock limit of the whole alternatives search.
        max_parallel: Probing resolutions run at once.
        lock_ttl_s: How long a lock stays the answer for the same requirements and target
            without asking the index again (0: always ask). A version published in that window
            is picked up by the next resolution after it; a spec that pins exact versions is
            unaffected.
    """

    def __init__(
        self,
        uv: Uv,
        rules: Sequence[KnownBadRule] | None = None,
        *,
        alternatives_budget_s: float = 30.0,
        max_parallel: int = 4,
        lock_ttl_s: float = 0.0,
    ) -> None:
        self.uv = uv
        self.lock_ttl_s = lock_ttl_s
        self._locks: dict[tuple[str, Target], tuple[float, Lock]] = {}
        self.rules = tuple(load_known_bad() if rules is None else rules)
        self.alternatives_budget_s = alternatives_budget_s
        self._parallel = asyncio.Semaphore(max_parallel)

    @classmethod
    def from_settings(cls, settings: Settings, index_url: str = DEFAULT_INDEX_URL) -> Resolver:
        """A resolver whose uv cache lives under ``$DSEC_HOME/cache/uv``; locks are remembered
        for ``DSEC_RESOLVE_CACHE_S`` seconds."""
        home = settings.home.resolve()
        return cls(
            Uv(cache_dir=home / "cache" / "uv", index_url=index_url),
            lock_ttl_s=settings.resolve_cache_s,
        )

    async def resolve(
        self, requirements: Sequence[Requirement], target: Target | None = None
    ) -> Resolved | Conflict:
        """Resolve ``requirements``: the lock, or why not and what would resolve instead.

        Raises:
            ResolverUnavailableError: no verdict (index unreachable, resolver timed out).
        """
        started = time.monotonic()
        target = target or Target()
        outcome = await self._remembered_lock(requirements, target)
        if isinstance(outcome, _Unsatisfiable):
            return await self._unsatisfiable(requirements, target, outcome.output, started)
        hit = match_known_bad(outcome, self.rules)
        if hit is not None:
            return await self._known_bad(requirements, target, hit, started)
        return Resolved(
            lock=outcome,
            lock_hash=lock_hash(outcome),
            fingerprint=fingerprint(outcome.packages),
            duration_s=time.monotonic() - started,
        )

    async def _remembered_lock(
        self, requirements: Sequence[Requirement], target: Target
    ) -> Lock | _Unsatisfiable:
        """:meth:`_lock`, answered from memory for the same requirements and target within
        ``lock_ttl_s`` (only locks are remembered: a conflict is asked again, it may be fixed
        upstream)."""
        if self.lock_ttl_s <= 0:
            return await self._lock(requirements, target)
        key = (requirements_text(requirements), target)
        now = time.monotonic()
        remembered = self._locks.get(key)
        if remembered is not None and now - remembered[0] < self.lock_ttl_s:
            return remembered[1]
        outcome = await self._lock(requirements, target)
        if isinstance(outcome, Lock):
            if len(self._locks) >= 1024:  # bounded: forget the oldest
                del self._locks[min(self._locks, key=lambda k: self._locks[k][0])]
            self._locks[key] = (now, outcome)
        return outcome

    async def _lock(
        self,
        requirements: Sequence[Requirement],
        target: Target,
        *,
        lowest_direct: bool = False,
    ) -> Lock | _Unsatisfiable:
        """One resolver run: the lock, or the resolver's derivation of why none exists."""
        try:
            run = await self.uv.compile(
                requirements_text(requirements), target, lowest_direct=lowest_direct
            )
        except UvTimeoutError as exc:
            raise ResolverUnavailableError(f"resolution timed out: {exc}") from None
        if run.unsatisfiable:
            return _Unsatisfiable(run.stderr)
        if run.returncode != 0:
            detail = redact_text(" ".join(clean_resolver_output(run.stderr).split()))
            raise ResolverUnavailableError(
                f"resolver failed (exit {run.returncode}) against "
                f"{redact_url(self.uv.index_url)}: {detail}"
            )
        try:
            return parse_pylock(run.stdout, target)
        except LockFormatError as exc:
            raise ResolverUnavailableError(str(exc)) from None

    # ------------------------------------------------------------------ conflicts

    async def _unsatisfiable(
        self, requirements: Sequence[Requirement], target: Target, stderr: str, started: float
    ) -> Conflict:
        output = redact_text(clean_resolver_output(stderr))
        involved = conflicting_requirements(output, requirements) or list(requirements)
        involved = involved[:MAX_PROBED_REQUIREMENTS]
        probes = [probe for requirement in involved for probe in relaxations(requirement)]
        found = await self._bounded(
            [partial(self._probe, requirements, target, probe) for probe in probes]
        )
        return Conflict(
            kind="unsatisfiable",
            summary=summarize_conflict(output, requirements),
            resolver_output=output,
            packages=tuple(str(r) for r in involved),
            alternatives=tuple(found),
            duration_s=time.monotonic() - started,
        )

    async def _probe(
        self, requirements: Sequence[Requirement], target: Target, probe: Relaxation
    ) -> Alternative | None:
        outcome = await self._lock(
            with_requirement(requirements, probe.probe), target, lowest_direct=probe.lowest
        )
        if isinstance(outcome, _Unsatisfiable) or match_known_bad(outcome, self.rules):
            return None
        version = _pinned_version(outcome, probe.original.key)
        if version is None:
            return None
        proposal = propose(probe, version)
        return Alternative(
            requirement=str(proposal),
            replaces=str(probe.original),
            line=probe.original.line,
            resolved_version=version,
            lock_hash=lock_hash(outcome),
            reason=alternative_reason(probe, version),
        )

    # ------------------------------------------------------------------ known-bad

    async def _known_bad(
        self,
        requirements: Sequence[Requirement],
        target: Target,
        hit: KnownBadHit,
        started: float,
    ) -> Conflict:
        rule = next(r for r in self.rules if r.id == hit.rule_id)
        found = await self._bounded(
            [partial(self._try_change, requirements, target, t, rule) for t in rule.alternatives]
        )
        involved = [
            r
            for r in requirements
            if any(canonicalize_name(m.split("==")[0]) == r.key for m in hit.matched)
        ]
        return Conflict(
            kind="known-bad",
            summary=f"The spec resolves to {' with '.join(hit.matched)}, a combination known "
            f"to break at run time: {hit.reason}",
            resolver_output="",
            packages=tuple(str(r) for r in involved) or hit.matched,
            alternatives=tuple(found),
            known_bad=hit,
            duration_s=time.monotonic() - started,
        )

    async def _try_change(
        self, requirements: Sequence[Requirement], target: Target, text: str, rule: KnownBadRule
    ) -> Alternative | None:
        change = Requirement.parse(text)
        existing = find_requirement(requirements, change.key)
        outcome = await self._lock(with_requirement(requirements, change), target)
        if isinstance(outcome, _Unsatisfiable) or match_known_bad(outcome, self.rules):
            return None
        version = _pinned_version(outcome, change.key) or ""
        return Alternative(
            requirement=str(change),
            replaces=str(existing) if existing else None,
            line=existing.line if existing else None,
            resolved_version=version,
            lock_hash=lock_hash(outcome),
            reason=f"avoids {rule.id} ({change.name} {version})",
        )

    # ------------------------------------------------------------------ bounding

    async def _bounded(self, probes: Sequence[_Probe]) -> list[Alternative]:
        """Run probes a few at a time within the budget; keep the ones that resolved, in order.

        A probe that fails to reach a verdict (index error, timeout) offers nothing.
        """

        async def limited(probe: _Probe) -> Alternative | None:
            async with self._parallel:
                try:
                    return await probe()
                except ResolverUnavailableError as exc:
                    log.info("alternative probe gave no verdict: %s", exc)
                    return None

        tasks = [asyncio.ensure_future(limited(probe)) for probe in probes]
        if not tasks:
            return []
        try:
            done, _ = await asyncio.wait(tasks, timeout=self.alternatives_budget_s)
        finally:  # past the budget, and when the attempt itself is cancelled (its timeout)
            unfinished = [t for t in tasks if not t.done()]
            for task in unfinished:
                task.cancel()
            await asyncio.gather(*unfinished, return_exceptions=True)
        return [r for t in tasks if t in done and (r := t.result()) is not None]


def _pinned_version(lock: Lock, key: str) -> str | None:
    return next((p.version for p in lock.packages if canonicalize_name(p.name) == key), None)
