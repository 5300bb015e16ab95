"""A circuit breaker per tool: closed → open → half-open → closed.

* **closed**: calls go through; ``failures`` consecutive failures of a class that says something
  about the tool's health (:data:`~dsec_sdk.tools.classify.BREAKER_CLASSES`) open it.
* **open**: calls fail at once with :class:`~dsec_sdk.tools.classify.CircuitOpen` (the fallback
  chain takes over) until ``reset_after_s`` has passed.
* **half-open**: one trial call goes through; success closes the breaker, failure opens it
  again for another ``reset_after_s``. Other calls meanwhile are refused as when open.

The clock is injected (``time.monotonic`` by default): tests drive it without sleeping.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Literal

from dsec_sdk.tools.classify import BREAKER_CLASSES, CircuitOpen, FailureClass
from dsec_sdk.tools.policy import BreakerPolicy

State = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """One tool's breaker (thread-safe)."""

    def __init__(
        self,
        tool: str,
        policy: BreakerPolicy,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.tool = tool
        self.policy = policy
        self._clock = clock
        self._lock = threading.Lock()
        self._state: State = "closed"
        self._failures = 0
        self._opened_at = 0.0
        self._trial = False
        self.last_class: FailureClass = "tool_error"

    @property
    def state(self) -> State:
        """The state now (an open breaker whose wait has passed reads ``half_open``)."""
        with self._lock:
            return self._current()

    def _current(self) -> State:
        if self._state == "open" and self._clock() - self._opened_at >= self.policy.reset_after_s:
            self._state = "half_open"
            self._trial = False
        return self._state

    def before(self) -> None:
        """Admit a call, or raise ``CircuitOpen``."""
        with self._lock:
            state = self._current()
            if state == "closed":
                return
            if state == "half_open" and not self._trial:
                self._trial = True  # this call is the trial
                return
            wait = max(0.0, self.policy.reset_after_s - (self._clock() - self._opened_at))
        raise CircuitOpen(self.tool, wait, self.last_class)

    def success(self) -> None:
        with self._lock:
            self._state = "closed"
            self._failures = 0
            self._trial = False

    def failure(self, failure_class: FailureClass) -> None:
        """Count a failure; classes outside ``BREAKER_CLASSES`` only end a trial."""
        with self._lock:
            state = self._current()
            if failure_class not in BREAKER_CLASSES:
                self._trial = False
                return
            self.last_class = failure_class
            self._failures += 1
            if state == "half_open" or self._failures >= self.policy.failures:
                self._state = "open"
                self._opened_at = self._clock()
                self._trial = False
