"""Durations (``2h``), sizes (``512MiB``) and rates (``100req/min``) as typed values.

Each parser accepts what users write in YAML and raises a located-error-friendly exception
naming what would be valid. The ``Annotated`` aliases plug the parsers into pydantic models and
serialize back to a form the parser accepts, so a dumped spec re-validates to the same value.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainSerializer, model_validator

from dsec_core.spec.errors import invalid

# Bounds keep every value representable downstream (timedelta, MessagePack's 64-bit ints).
MAX_DURATION_S = 10 * 365 * 86400
MAX_SIZE = 2**60
MAX_CORES = 4096

_DURATION_UNITS: dict[str, float] = {
    "ms": 0.001,
    "s": 1,
    "m": 60,
    "min": 60,
    "h": 3600,
    "d": 86400,
    "w": 604800,
}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|min|s|m|h|d|w)")
DURATION_HINT = "a duration such as 300s, 15m, 2h, 1h30m, 7d (units: ms, s, m/min, h, d, w)"

_SIZE_UNITS: dict[str, int] = {
    "B": 1,
    "KB": 10**3,
    "kB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z]*)")
SIZE_HINT = (
    "a size such as 512MiB, 8GiB, 64GB or a number of bytes "
    "(units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, Ki, Mi, Gi, Ti)"
)

_RATE_PERIODS: dict[str, int] = {
    "s": 1,
    "sec": 1,
    "second": 1,
    "m": 60,
    "min": 60,
    "minute": 60,
    "h": 3600,
    "hr": 3600,
    "hour": 3600,
    "d": 86400,
    "day": 86400,
}
_RATE = re.compile(r"(\d+)\s*([a-z]*)\s*/\s*([a-z]+)")
# What a rate counts. ``req`` means requests (HTTP requests, counted where the semantic layer
# sees them); ``connects`` are new connections, counted by the kernel on every connect.
_RATE_UNITS: dict[str, str] = {
    "": "requests",
    "r": "requests",
    "req": "requests",
    "reqs": "requests",
    "request": "requests",
    "requests": "requests",
    "connect": "connects",
    "connects": "connects",
    "conn": "connects",
    "conns": "connects",
    "connection": "connects",
    "connections": "connects",
}
RATE_HINT = (
    "a rate such as 100requests/min, 10req/s or 20connects/min "
    "(units: requests/req, connects; periods: s, min, h, day)"
)

_CPU = re.compile(r"(\d+(?:\.\d+)?)(m?)")
CPU_HINT = "a number of cores such as 2 or 0.5, or millicores such as 500m"


def _reject_bool(value: object, hint: str) -> None:
    # YAML `true` is an int subclass in Python; it is never a sensible size or duration.
    if isinstance(value, bool):
        raise invalid(f"expected {hint.split(' such as')[0]}, got a boolean", hint)


def parse_duration(value: object) -> timedelta:
    """Parse ``90s``, ``15m``, ``2h``, ``1h30m``, ``7d`` or a number of seconds into a timedelta.

    Raises:
        PydanticCustomError: the value is not a positive duration.
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    else:
        _reject_bool(value, DURATION_HINT)
        if isinstance(value, int | float):
            seconds = float(value)
        elif isinstance(value, str):
            seconds = _duration_seconds(value.strip())
        else:
            raise invalid(f"expected a duration, got {type_name(value)}", DURATION_HINT)
    if not math.isfinite(seconds) or seconds <= 0:
        raise invalid(f"duration must be positive, got {value!r}", DURATION_HINT)
    if seconds > MAX_DURATION_S:
        raise invalid(f"duration {value!r} is longer than 10 years", DURATION_HINT)
    return timedelta(seconds=seconds)


def _duration_seconds(text: str) -> float:
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        return float(text)
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise invalid(f"{text!r} is not a duration", DURATION_HINT)
    return sum(float(number) * _DURATION_UNITS[unit] for number, unit in parts)


def format_duration(value: timedelta) -> str:
    """Render a timedelta in the shortest unit that keeps it exact (``7200s`` -> ``2h``)."""
    millis = round(value.total_seconds() * 1000)
    for unit, factor in (("w", 604800), ("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if millis % (factor * 1000) == 0:
            return f"{millis // (factor * 1000)}{unit}"
    return f"{millis}ms"


def parse_size(value: object) -> int:
    """Parse ``512MiB``, ``64GB``, ``2Gi`` or a number of bytes into an int number of bytes.

    Raises:
        PydanticCustomError: the value is not a positive size.
    """
    return _bytes(value, SIZE_HINT, "size", "")


def _bytes(value: object, hint: str, noun: str, per: str) -> int:
    """A positive number of bytes (``per``: a unit's suffix a text may end with, e.g. ``/s``)."""
    _reject_bool(value, hint)
    if isinstance(value, int):
        size = value
    elif isinstance(value, str):
        text = value.strip()
        if per and text.endswith(per):
            text = text[: -len(per)].strip()
        size = _size_bytes(text, hint, f"a {noun}")
    else:
        raise invalid(f"expected a {noun}, got {type_name(value)}", hint)
    if size <= 0:
        raise invalid(f"{noun} must be positive, got {value!r}", hint)
    if size > MAX_SIZE:
        raise invalid(f"{noun} {value!r} is larger than 1 EiB{per}", hint)
    return size


def _size_bytes(text: str, hint: str = SIZE_HINT, what: str = "a size") -> int:
    match = _SIZE.fullmatch(text)
    if match is None:
        raise invalid(f"{text!r} is not {what}", hint)
    number, unit = match.groups()
    if unit and unit not in _SIZE_UNITS:
        raise invalid(f"unknown size unit {unit!r} in {text!r}", hint)
    size = float(number) * _SIZE_UNITS.get(unit, 1)
    return int(size) if math.isfinite(size) else MAX_SIZE + 1


def format_size(size: int) -> str:
    """Render bytes in the largest binary unit that keeps the value exact."""
    for unit in ("TiB", "GiB", "MiB", "KiB"):
        if size % _SIZE_UNITS[unit] == 0:
            return f"{size // _SIZE_UNITS[unit]}{unit}"
    return str(size)


def parse_cpu(value: object) -> float:
    """Parse a CPU amount (``2``, ``0.5``, ``"500m"``) into a number of cores.

    Raises:
        PydanticCustomError: the value is not a positive CPU amount.
    """
    _reject_bool(value, CPU_HINT)
    if isinstance(value, int | float):
        cores = float(value)
    elif isinstance(value, str):
        match = _CPU.fullmatch(value.strip())
        if match is None:
            raise invalid(f"{value!r} is not a CPU amount", CPU_HINT)
        cores = float(match.group(1)) / (1000 if match.group(2) else 1)
    else:
        raise invalid(f"expected a CPU amount, got {type_name(value)}", CPU_HINT)
    if not math.isfinite(cores) or cores <= 0 or cores > MAX_CORES:
        raise invalid(f"cpu must be between 0 and {MAX_CORES} cores, got {value!r}", CPU_HINT)
    return cores


class Rate(BaseModel):
    """A request budget: ``requests`` per ``period_s`` seconds (``100req/min``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    requests: int = Field(ge=1, le=2**53, description="How many (requests or connects)")
    period_s: int = Field(ge=1)
    unit: Literal["requests", "connects"] = Field(
        default="requests",
        description="requests: HTTP requests (semantic layer) and at most as many new "
        "connections (kernel); connects: new connections only (kernel)",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        if isinstance(value, str):
            return parse_rate(value)
        if isinstance(value, Rate | dict):
            return value
        raise invalid(f"expected a rate, got {type_name(value)}", RATE_HINT)

    @property
    def per_second(self) -> float:
        """The budget as requests per second (what a token bucket refills at)."""
        return self.requests / self.period_s

    def __str__(self) -> str:
        unit = {1: "s", 60: "min", 3600: "h", 86400: "day"}.get(self.period_s)
        word = "req" if self.unit == "requests" else "connects"
        period = unit or f"{self.period_s}s"
        return f"{self.requests}{word}/{period}"


def parse_rate(text: str) -> dict[str, Any]:
    """Parse ``100req/min`` into ``{"requests": 100, "period_s": 60, "unit": "requests"}``.

    ``20connects/min`` counts new connections instead of requests (``unit: "connects"``).

    Raises:
        PydanticCustomError: the text is not a rate, or names an unknown unit or period.
    """
    match = _RATE.fullmatch(text.strip().lower())
    if match is None:
        raise invalid(f"{text!r} is not a rate", RATE_HINT)
    number, unit, period = match.groups()
    if unit not in _RATE_UNITS:
        raise invalid(f"unknown rate unit {unit!r} in {text!r}", RATE_HINT)
    if period not in _RATE_PERIODS:
        raise invalid(f"unknown rate period {period!r} in {text!r}", RATE_HINT)
    requests = int(number)
    if requests <= 0:
        raise invalid(f"a rate needs at least one request, got {text!r}", RATE_HINT)
    return {"requests": requests, "period_s": _RATE_PERIODS[period], "unit": _RATE_UNITS[unit]}


def type_name(value: object) -> str:
    """Name a YAML value's type the way a user thinks of it."""
    if value is None:
        return "null"
    return {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "a mapping",
    }.get(type(value), type(value).__name__)


Duration = Annotated[
    timedelta,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]
"""A positive duration; YAML ``2h``, JSON ``"2h"``."""

ByteSize = Annotated[int, BeforeValidator(parse_size)]
"""A positive number of bytes; YAML ``512MiB``."""

BYTE_RATE_HINT = "bytes per second such as 128MiB, 128MiB/s or 134217728"


def parse_byte_rate(value: object) -> int:
    """Parse a byte rate (``128MiB/s``, ``128MiB`` or a number of bytes) into bytes per second.

    Raises:
        PydanticCustomError: the value is not a positive size per second.
    """
    return _bytes(value, BYTE_RATE_HINT, "rate", "/s")


ByteRate = Annotated[int, BeforeValidator(parse_byte_rate)]
"""A positive number of bytes per second; YAML ``128MiB/s`` or ``128MiB``."""

Cores = Annotated[float, BeforeValidator(parse_cpu)]
"""A positive number of CPU cores; YAML ``2`` or ``500m``."""


# -- GPU needs: shares, throughput, bandwidth ---------------------------------------------------

GPU_SHARE_HINT = (
    "a share of one GPU: thousandths such as 250m, a fraction such as 0.25, or a percentage "
    "such as 25% (at most one whole GPU: 1000m, 1 or 100%)"
)
_SHARE = re.compile(r"(\d+(?:\.\d+)?)\s*(m|%)?")


def parse_gpu_share(value: object) -> int:
    """Parse a share of one GPU (``250m``, ``0.25``, ``25%``) into thousandths (``250``).

    A bare number is a fraction of one GPU (at most 1); thousandths need the ``m`` suffix.

    Raises:
        PydanticCustomError: the value is not a share of 1 to 1000 thousandths.
    """
    _reject_bool(value, GPU_SHARE_HINT)
    if isinstance(value, int | float):
        number, unit = float(value), ""
    elif isinstance(value, str):
        match = _SHARE.fullmatch(value.strip())
        if match is None:
            raise invalid(f"{value!r} is not a GPU share", GPU_SHARE_HINT)
        number, unit = float(match.group(1)), match.group(2) or ""
    else:
        raise invalid(f"expected a GPU share, got {type_name(value)}", GPU_SHARE_HINT)
    milli = number * {"m": 1, "%": 10, "": 1000}[unit]
    if unit == "" and number > 1:
        raise invalid(
            f"a bare number is a fraction of one GPU; {value!r} is more than one GPU",
            f"for {number:g} thousandths write {number:g}m; for whole GPUs use `gpus:`",
        )
    if not math.isfinite(milli) or round(milli) < 1 or milli > 1000:
        raise invalid(f"a GPU share must be 1m to 1000m, got {value!r}", GPU_SHARE_HINT)
    if abs(milli - round(milli)) > 1e-6:
        raise invalid(f"{value!r} is finer than a thousandth of a GPU", GPU_SHARE_HINT)
    return round(milli)


_PERF = re.compile(r"(\d+(?:\.\d+)?)\s*([A-Za-z/]*)")
TFLOPS_HINT = "a throughput such as 2000 TFLOPS, 2 PFLOPS or 500000 GFLOPS (bare number: TFLOPS)"
_FLOPS_UNITS = {"": 1.0, "tflops": 1.0, "pflops": 1000.0, "gflops": 0.001}
BANDWIDTH_HINT = "a bandwidth such as 3.2 TB/s, 900 GB/s or 3200 GBps (bare number: GB/s)"
_BANDWIDTH_UNITS = {
    "": 1.0,
    "gb/s": 1.0,
    "gbps": 1.0,
    "tb/s": 1000.0,
    "tbps": 1000.0,
    "mb/s": 0.001,
    "mbps": 0.001,
}


FIGURE_MAX = 1e9
"""A throughput (TFLOPS) or bandwidth (GB/s) at most: far above any GPU, below overflow."""


def _figure(value: object, units: dict[str, float], what: str, hint: str) -> float:
    _reject_bool(value, hint)
    if isinstance(value, int | float):
        amount = float(value)
    elif isinstance(value, str):
        match = _PERF.fullmatch(value.strip())
        if match is None:
            raise invalid(f"{value!r} is not a {what}", hint)
        unit = match.group(2).lower()
        if unit not in units:
            raise invalid(f"unknown {what} unit {match.group(2)!r} in {value!r}", hint)
        amount = float(match.group(1)) * units[unit]
    else:
        raise invalid(f"expected a {what}, got {type_name(value)}", hint)
    if not math.isfinite(amount) or amount <= 0:
        raise invalid(f"a {what} must be positive, got {value!r}", hint)
    if amount > FIGURE_MAX:
        base = "TFLOPS" if units is _FLOPS_UNITS else "GB/s"
        raise invalid(f"a {what} of at most {FIGURE_MAX:g} {base}, got {value!r}", hint)
    return amount


def parse_tflops(value: object) -> float:
    """Parse an FP16 throughput need (``2000 TFLOPS``, ``2 PFLOPS``) into TFLOPS.

    Raises:
        PydanticCustomError: the value is not a positive throughput.
    """
    return _figure(value, _FLOPS_UNITS, "throughput", TFLOPS_HINT)


def parse_bandwidth(value: object) -> float:
    """Parse a memory bandwidth need (``3.2 TB/s``, ``900 GB/s``) into GB/s (decimal).

    Raises:
        PydanticCustomError: the value is not a positive bandwidth.
    """
    return _figure(value, _BANDWIDTH_UNITS, "bandwidth", BANDWIDTH_HINT)


def _format_share(milli: int) -> str:
    return f"{milli}m"


GpuShare = Annotated[
    int,
    BeforeValidator(parse_gpu_share),
    PlainSerializer(_format_share, return_type=str),
]
"""A share of one GPU in thousandths; YAML ``250m``, ``0.25`` or ``25%``, JSON ``"250m"``."""

Tflops = Annotated[float, BeforeValidator(parse_tflops)]
"""Dense FP16 throughput in TFLOPS; YAML ``2000 TFLOPS``."""

Bandwidth = Annotated[float, BeforeValidator(parse_bandwidth)]
"""Memory bandwidth in GB/s; YAML ``3.2 TB/s``."""
