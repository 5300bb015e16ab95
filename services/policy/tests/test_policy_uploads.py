"""A tenant's code-upload grants are bounded: each one lets it store a bundle in the shared
bucket, so one tenant asking without end must not fill it."""

from __future__ import annotations

import pytest

from dsec_policy import uploads
from dsec_policy.uploads import TENANT_BYTES_PER_HOUR, TENANT_GRANTS_PER_MIN, _Allowance


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(uploads.time, "monotonic", fake)
    return fake


def test_a_tenant_gets_a_minutes_grants_then_waits(clock: _Clock) -> None:
    allowance = _Allowance()
    assert all(allowance.take(1) is None for _ in range(TENANT_GRANTS_PER_MIN))
    assert "code uploads a minute" in str(allowance.take(1))
    clock.now += 60 / TENANT_GRANTS_PER_MIN  # one grant's worth of time
    assert allowance.take(1) is None
    assert allowance.take(1) is not None


def test_a_tenant_gets_an_hours_bytes_then_waits(clock: _Clock) -> None:
    allowance = _Allowance()
    assert allowance.take(TENANT_BYTES_PER_HOUR - 10) is None
    assert "GiB of code uploads an hour" in str(allowance.take(11))
    assert allowance.take(10) is None  # a refusal takes nothing
    clock.now += 1800
    assert allowance.take(TENANT_BYTES_PER_HOUR // 2 - 2**20) is None
