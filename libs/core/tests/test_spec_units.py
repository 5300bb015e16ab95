"""Durations, sizes, CPU amounts and rates parse to typed values, or fail saying what is valid."""

from __future__ import annotations

from datetime import timedelta

import pytest
from dsec_core.spec import (
    Rate,
    format_duration,
    format_size,
    parse_cpu,
    parse_duration,
    parse_rate,
    parse_size,
)
from pydantic_core import PydanticCustomError

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("300s", 300),
        ("15m", 900),
        ("15min", 900),
        ("2h", 7200),
        ("1h30m", 5400),
        ("7d", 604800),
        ("1w", 604800),
        ("250ms", 0.25),
        (90, 90),
        ("45", 45),
        ("1.5h", 5400),
    ],
)
def test_durations_parse(text: object, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["2 hours", "h", "", "-5s", "0s", "1h 30m", True, [1], "3y"])
def test_bad_durations_say_what_is_valid(text: object) -> None:
    with pytest.raises(PydanticCustomError) as info:
        parse_duration(text)
    assert "such as 300s" in (info.value.context or {})["hint"]


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("512MiB", 512 * 2**20),
        ("64GB", 64 * 10**9),
        ("2Gi", 2 * 2**30),
        (1024, 1024),
        ("1.5GiB", 3 * 2**29),
        ("100 MB", 10**8),
        ("7", 7),
    ],
)
def test_sizes_parse(text: object, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["2 gigs", "MiB", "-1", "0", False, 1.5, "12mb"])
def test_bad_sizes_are_rejected(text: object) -> None:
    with pytest.raises(PydanticCustomError, match="size"):
        parse_size(text)


@pytest.mark.parametrize(("text", "cores"), [(2, 2.0), (0.5, 0.5), ("500m", 0.5), ("4", 4.0)])
def test_cpu_amounts_parse(text: object, cores: float) -> None:
    assert parse_cpu(text) == cores


@pytest.mark.parametrize(
    ("text", "requests", "period", "unit"),
    [
        ("100req/min", 100, 60, "requests"),
        ("10req/s", 10, 1, "requests"),
        ("5000 req / h", 5000, 3600, "requests"),
        ("20/day", 20, 86400, "requests"),
        ("3requests/second", 3, 1, "requests"),
        ("100requests/min", 100, 60, "requests"),
        ("10connects/min", 10, 60, "connects"),
        ("10 connections / s", 10, 1, "connects"),
    ],
)
def test_rates_parse(text: str, requests: int, period: int, unit: str) -> None:
    assert parse_rate(text) == {"requests": requests, "period_s": period, "unit": unit}


@pytest.mark.parametrize("text", ["100 per minute", "100req/fortnight", "0req/s", "req/min"])
def test_bad_rates_are_rejected(text: str) -> None:
    with pytest.raises(PydanticCustomError, match="rate"):
        parse_rate(text)


def test_unknown_rate_unit_names_the_unit_and_the_valid_ones() -> None:
    with pytest.raises(PydanticCustomError) as info:
        parse_rate("10bytes/min")
    assert "unknown rate unit 'bytes'" in str(info.value)
    assert "connects" in str(info.value.context)


def test_values_round_trip_through_their_text_form() -> None:
    assert format_duration(parse_duration("1h30m")) == "90m"
    assert format_size(parse_size("2GiB")) == "2GiB"
    rate = Rate.model_validate("100req/min")
    assert str(rate) == "100req/min"
    assert rate.per_second == pytest.approx(100 / 60)
    connects = Rate.model_validate("20connects/h")
    assert str(connects) == "20connects/h" and Rate.model_validate(str(connects)) == connects
