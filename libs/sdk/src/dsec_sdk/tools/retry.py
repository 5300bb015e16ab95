"""Retries with exponential backoff and full jitter (tenacity), bounded by attempts and by
total time, honouring ``Retry-After``.

``sleep`` and ``clock`` are injected: tests run the schedule without sleeping, with a fake clock
that the fake sleep advances.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import tenacity

from dsec_sdk.tools.classify import NEVER_RETRIED, Failure, classify
from dsec_sdk.tools.policy import RetryPolicy

T = TypeVar("T")


def backoff(attempt: int, policy: RetryPolicy, rng: Callable[[], float] = random.random) -> float:
    """Full jitter: ``uniform(0, min(max_backoff_s, backoff_s * 2**(attempt-1)))``."""
    ceiling = min(policy.max_backoff_s, policy.backoff_s * 2.0 ** max(0, attempt - 1))
    return float(rng()) * ceiling


def _strategy(
    policy: RetryPolicy,
    clock: Callable[[], float],
    rng: Callable[[], float],
    on_retry: Callable[[int, Failure, float], None] | None,
    retry_if: Callable[[BaseException], bool] | None,
) -> dict[str, Any]:
    """tenacity's stop, wait, retry and before_sleep for ``policy`` (sync and async alike)."""
    start = clock()
    last: dict[str, Failure] = {}

    def should_retry(state: tenacity.RetryCallState) -> bool:
        assert state.outcome is not None
        exc = state.outcome.exception()
        if exc is None:
            return False
        failure = classify(exc)
        last["failure"] = failure
        if retry_if is not None and not retry_if(exc):
            return False
        return failure.failure_class in policy.on and failure.failure_class not in NEVER_RETRIED

    def wait(state: tenacity.RetryCallState) -> float:
        failure = last["failure"]
        jitter = backoff(state.attempt_number, policy, rng)
        if failure.retry_after is not None:
            return max(failure.retry_after, jitter)  # the provider said when; never sooner
        return jitter

    def stop(state: tenacity.RetryCallState) -> bool:
        if state.attempt_number >= policy.attempts:
            return True
        return clock() - start + (state.upcoming_sleep or 0.0) > policy.max_time_s

    def before_sleep(state: tenacity.RetryCallState) -> None:
        if on_retry is not None:
            on_retry(state.attempt_number, last["failure"], state.upcoming_sleep or 0.0)

    return {
        "stop": stop,
        "wait": wait,
        "retry": should_retry,
        "before_sleep": before_sleep,
        "reraise": True,
    }


def call_with_retries(
    fn: Callable[[], T],
    policy: RetryPolicy,
    *,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: Callable[[], float] = random.random,
    on_retry: Callable[[int, Failure, float], None] | None = None,
    retry_if: Callable[[BaseException], bool] | None = None,
) -> tuple[T, int]:
    """Run ``fn`` until it succeeds or the policy says stop: ``(result, attempts)``.

    The last exception is re-raised with ``dsec_attempts`` set on it. A failure whose class is
    not in ``policy.on`` (or is never retried) is raised at once. A wait that would end past
    ``max_time_s`` is not taken.
    """
    retrying = tenacity.Retrying(sleep=sleep, **_strategy(policy, clock, rng, on_retry, retry_if))
    attempts = 0

    def attempt() -> T:
        nonlocal attempts
        attempts += 1
        return fn()

    try:
        result: Any = retrying(attempt)
    except BaseException as exc:
        exc.dsec_attempts = attempts  # type: ignore[attr-defined]
        raise
    return result, attempts


async def acall_with_retries(
    fn: Callable[[], Awaitable[T]],
    policy: RetryPolicy,
    *,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    clock: Callable[[], float] = time.monotonic,
    rng: Callable[[], float] = random.random,
    on_retry: Callable[[int, Failure, float], None] | None = None,
    retry_if: Callable[[BaseException], bool] | None = None,
) -> tuple[T, int]:
    """``async`` twin of :func:`call_with_retries` (waits with ``asyncio.sleep``)."""
    retrying = tenacity.AsyncRetrying(
        sleep=sleep, **_strategy(policy, clock, rng, on_retry, retry_if)
    )
    attempts = 0

    async def attempt() -> T:
        nonlocal attempts
        attempts += 1
        return await fn()

    try:
        result: Any = await retrying(attempt)
    except BaseException as exc:
        exc.dsec_attempts = attempts  # type: ignore[attr-defined]
        raise
    return result, attempts
