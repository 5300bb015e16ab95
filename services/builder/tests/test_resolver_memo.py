"""The resolver remembers a lock for the same requirements and target for ``lock_ttl_s``: a
warm resubmission skips the index round trips; a conflict, other requirements, another target
or an expired entry ask again."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import pytest

from dsec_builder.adapters.uv import Uv
from dsec_builder.models import Lock, LockedPackage, Requirement, Resolved, Target
from dsec_builder.resolver import Resolver, _Unsatisfiable

SIX = LockedPackage(
    name="six",
    version="1.16.0",
    filename="six-1.16.0-py2.py3-none-any.whl",
    url="https://files.example/six-1.16.0-py2.py3-none-any.whl",
    sha256="0" * 64,
)


class Counting(Resolver):
    def __init__(self, ttl: float, answers: list[Lock | _Unsatisfiable] | None = None) -> None:
        super().__init__(Uv(cache_dir=Path("/nonexistent")), rules=(), lock_ttl_s=ttl)
        self.asked = 0
        self.answers = answers

    async def _lock(
        self, requirements: Sequence[Requirement], target: Target, *, lowest_direct: bool = False
    ) -> Lock | _Unsatisfiable:
        self.asked += 1
        if self.answers:
            return self.answers.pop(0)
        return Lock(target=target, packages=(SIX,))


def _resolve(resolver: Resolver, *names: str, target: Target | None = None) -> object:
    return asyncio.run(resolver.resolve([Requirement.parse(n) for n in names], target))


def test_the_same_requirements_are_answered_from_memory_within_the_ttl() -> None:
    resolver = Counting(ttl=300)
    first, second = _resolve(resolver, "six"), _resolve(resolver, "six")
    assert isinstance(first, Resolved) and isinstance(second, Resolved)
    assert first.lock_hash == second.lock_hash
    assert resolver.asked == 1


def test_other_requirements_or_target_ask_again() -> None:
    resolver = Counting(ttl=300)
    _resolve(resolver, "six")
    _resolve(resolver, "six>=1.16")
    _resolve(resolver, "six", target=Target(python_version="3.12"))
    assert resolver.asked == 3


def test_no_memory_with_a_zero_ttl_or_after_expiry(monkeypatch: pytest.MonkeyPatch) -> None:
    off = Counting(ttl=0)
    _resolve(off, "six")
    _resolve(off, "six")
    assert off.asked == 2
    clock = [1000.0]
    monkeypatch.setattr("dsec_builder.resolver.time.monotonic", lambda: clock[0])
    expiring = Counting(ttl=60)
    _resolve(expiring, "six")
    clock[0] += 61
    _resolve(expiring, "six")
    assert expiring.asked == 2


def test_a_conflict_is_never_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    resolver = Counting(ttl=300, answers=[_Unsatisfiable("no solution"), _Unsatisfiable("x")])

    async def no_probes(*_: object, **__: object) -> list[object]:
        return []

    monkeypatch.setattr(resolver, "_bounded", no_probes)
    _resolve(resolver, "six")
    outcome = _resolve(resolver, "six")
    assert not isinstance(outcome, Resolved)
    assert resolver.asked == 2


async def test_a_cancelled_resolution_cancels_its_alternative_probes() -> None:
    """The attempt's timeout cancels it while alternatives are probed: no probe runs on, and
    every slot of the resolver's shared limit is free again for the next resolution."""
    resolver = Counting(ttl=0.0)
    finished: list[int] = []

    def probe(n: int) -> object:
        async def run() -> None:
            await asyncio.sleep(0.4)  # a uv resolution
            finished.append(n)

        return run

    slots = resolver._parallel._value
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await resolver._bounded([probe(n) for n in range(slots + 2)])  # type: ignore[list-item]
    assert resolver._parallel._value == slots
    await asyncio.sleep(0.5)  # past the probes' end: none ran on
    assert finished == []
