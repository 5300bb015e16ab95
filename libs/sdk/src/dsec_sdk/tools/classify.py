"""Failure classes of a tool call, and how an exception maps to one.

Every failure gets exactly one class; the class decides what the pipeline does with it:

========================  =========  ======================================================
class                     retried    typical cause
========================  =========  ======================================================
``timeout``               yes        no answer in time (``TimeoutError``, HTTP 408/504)
``rate_limited``          yes        HTTP 429; ``Retry-After`` is honoured
``upstream_5xx``          yes        HTTP 500-599 (except 504)
``unavailable``           yes        connection refused/reset, the peer agent gone
``auth``                  no         HTTP 401/403: a wrong, revoked or expired key
``bad_arguments``         never      HTTP 400/404/405/409/413/422, ``BadArguments``
``network_policy``        never      the sandbox refused it (EPERM, NXDOMAIN of the DNS proxy,
                                     a semantic ``deny``): a spec problem, not the tool's
``tool_error``            no         the tool raised anything else
========================  =========  ======================================================

A tool may also raise :class:`ToolFailure` to say its class itself.
"""

from __future__ import annotations

import email.utils
import errno
import re
import socket
import time
from dataclasses import dataclass
from typing import Any, Final, Literal

FailureClass = Literal[
    "timeout",
    "rate_limited",
    "upstream_5xx",
    "unavailable",
    "auth",
    "bad_arguments",
    "network_policy",
    "tool_error",
]
CLASSES: Final[tuple[FailureClass, ...]] = (
    "timeout",
    "rate_limited",
    "upstream_5xx",
    "unavailable",
    "auth",
    "bad_arguments",
    "network_policy",
    "tool_error",
)
RETRYABLE: Final[frozenset[str]] = frozenset(
    {"timeout", "rate_limited", "upstream_5xx", "unavailable"}
)
"""Classes retried by default (``tools.<name>.retries.on`` in the spec may narrow this)."""
NEVER_RETRIED: Final[frozenset[str]] = frozenset({"bad_arguments", "network_policy"})
"""Classes no policy can retry: the same call fails the same way again."""
BREAKER_CLASSES: Final[frozenset[str]] = frozenset(
    {"timeout", "rate_limited", "upstream_5xx", "unavailable", "auth"}
)
"""Classes that count against a tool's circuit breaker (the tool's health, not the caller's
mistake)."""

_BAD_ARGUMENT_STATUS: Final = frozenset({400, 404, 405, 409, 413, 414, 415, 422})
_MAX_RETRY_AFTER_S: Final = 3600.0
_STATUS_IN_TEXT = re.compile(r"\b(?:HTTP(?: Error)?|status(?: code)?)[ :]*([1-5]\d\d)\b", re.I)


class ToolFailure(Exception):
    """Raised by a tool (or a fallback) that knows how it failed.

    Args:
        failure_class: one of :data:`CLASSES`.
        message: what happened (stays in this process: never sent to the node agent).
        status: the HTTP status, if any.
        retry_after: seconds the provider asked to wait (``rate_limited``).
    """

    def __init__(
        self,
        failure_class: FailureClass,
        message: str = "",
        *,
        status: int | None = None,
        retry_after: float | None = None,
    ) -> None:
        if failure_class not in CLASSES:
            raise ValueError(f"failure class {failure_class!r} is not one of {', '.join(CLASSES)}")
        self.failure_class = failure_class
        self.status = status
        self.retry_after = retry_after
        # "[class] ...": another agent that gets this as a RemoteError reads the class back.
        super().__init__(f"[{failure_class}] {message}" if message else f"[{failure_class}]")


class CircuitOpen(ToolFailure):
    """The tool's circuit breaker is open: the call was not made."""

    def __init__(self, tool: str, retry_in: float, last_class: FailureClass) -> None:
        self.tool = tool
        self.retry_in = retry_in
        self.last_class = last_class
        super().__init__(
            last_class,
            f"{tool}: circuit open after repeated {last_class} failures; "
            f"next trial in {retry_in:.1f} s",
        )


@dataclass(frozen=True)
class Failure:
    """The classification of one exception."""

    failure_class: FailureClass
    status: int | None = None
    retry_after: float | None = None
    host: str | None = None

    @property
    def retryable(self) -> bool:
        return self.failure_class in RETRYABLE


def classify(exc: BaseException, *, now: float | None = None) -> Failure:
    """The class of ``exc`` (looking through ``__cause__``/``__context__`` for an HTTP status or
    an OS error when the outer exception says nothing)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        found = _classify_one(current, now)
        if found is not None:
            return found
        current = current.__cause__ or current.__context__
    return Failure("tool_error")


def _classify_one(exc: BaseException, now: float | None) -> Failure | None:
    if isinstance(exc, ToolFailure):
        return Failure(exc.failure_class, exc.status, exc.retry_after)
    status, headers = _http_status(exc)
    if status is not None:
        return _from_status(status, headers, now)
    from dsec_sdk import errors

    if isinstance(exc, errors.BadArguments | errors.ToolNotFound):
        return Failure("bad_arguments")
    if isinstance(exc, errors.RemoteError):
        return _from_remote(exc)
    if isinstance(exc, errors.AgentNotFound | errors.PeerGone | errors.BrokerUnavailable):
        return Failure("unavailable")
    if isinstance(exc, TimeoutError) or "Timeout" in type(exc).__name__:
        return Failure("timeout")
    if isinstance(exc, socket.gaierror):
        # Inside a sandbox the node's DNS proxy answers NXDOMAIN for every name the spec does
        # not allow; a transient resolver failure (EAI_AGAIN) is worth a retry.
        if exc.errno == socket.EAI_AGAIN:
            return Failure("unavailable")
        return Failure("network_policy")
    if isinstance(exc, PermissionError):
        return Failure("network_policy")
    if isinstance(exc, ConnectionError):
        return Failure("unavailable")
    if isinstance(exc, OSError) and exc.errno in (
        errno.ENETUNREACH,
        errno.EHOSTUNREACH,
        errno.ECONNREFUSED,
    ):
        return Failure("unavailable")
    reason = getattr(exc, "reason", None)  # urllib.error.URLError wraps the socket error
    if isinstance(reason, BaseException) and reason is not exc:
        return _classify_one(reason, now)
    if isinstance(reason, str) and "timed out" in reason:
        return Failure("timeout")
    return None


def _http_status(exc: BaseException) -> tuple[int | None, Any]:
    """The HTTP status and headers of urllib's ``HTTPError``, requests' and httpx's errors, or
    anything with ``status``/``status_code``."""
    response = getattr(exc, "response", None)
    for holder in (exc, response):
        if holder is None:
            continue
        for attribute in ("code", "status_code", "status"):
            value = getattr(holder, attribute, None)
            if isinstance(value, int) and 100 <= value <= 599:
                headers = getattr(holder, "headers", None)
                return value, headers
    return None, None


def _from_status(status: int, headers: Any, now: float | None) -> Failure | None:
    if status == 429:
        return Failure("rate_limited", status, retry_after(headers, now))
    if status in (401, 403):
        return Failure("auth", status)
    if status in (408, 504):
        return Failure("timeout", status)
    if status == 503:
        return Failure("upstream_5xx", status, retry_after(headers, now))
    if 500 <= status <= 599:
        return Failure("upstream_5xx", status)
    if status in _BAD_ARGUMENT_STATUS:
        return Failure("bad_arguments", status)
    if 400 <= status <= 499:
        return Failure("tool_error", status)
    return None


def _from_remote(exc: Any) -> Failure:
    """An error another agent's tool raised: its class name and message are all we have."""
    error_type = str(getattr(exc, "error_type", ""))
    message = str(getattr(exc, "remote_message", ""))
    match = re.match(r"\[(\w+)\]", message)
    if error_type in ("ToolFailure", "CircuitOpen") and match and match.group(1) in CLASSES:
        return Failure(match.group(1))  # type: ignore[arg-type]
    if "Timeout" in error_type:
        return Failure("timeout")
    found = _STATUS_IN_TEXT.search(message)
    if found:
        mapped = _from_status(int(found.group(1)), None, None)
        if mapped is not None:
            return mapped
    return Failure("tool_error")


def retry_after(headers: Any, now: float | None = None) -> float | None:
    """Seconds of a ``Retry-After`` header (delta-seconds or an HTTP date), capped at an hour;
    ``None`` when absent or unreadable."""
    if headers is None:
        return None
    try:
        raw = headers.get("Retry-After")
    except AttributeError:
        return None
    if raw is None:
        return None
    text = str(raw).strip()
    try:
        seconds = float(text)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(text)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds:  # NaN
        return None
    return min(max(seconds, 0.0), _MAX_RETRY_AFTER_S)
