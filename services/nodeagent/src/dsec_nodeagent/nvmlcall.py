"""NVML calls with a deadline.

Every NVML call blocks in the driver, and a GPU that fell off the bus (XID 79) or a wedged
driver can make one block for minutes or for good (``nvidia-smi`` hangs the same way). Run on
``asyncio.to_thread``, such a call held a worker of the default thread pool forever, and what
awaited it waited forever: the heartbeat that reads the GPUs stopped, so after three missed
beats the scheduler declared the node lost and placed its sandboxes again elsewhere while
they still ran here; the quota watch and the health check stopped; a launch creating a MIG
instance never ended.

:class:`NvmlCalls` runs each call in a daemon thread of its own and waits at most its deadline
(``DSEC_NVML_TIMEOUT_S``, 30 s; the heartbeat's read at most one beat). A call past it raises
:class:`NvmlHung`, and NVML counts as not answering until that call returns: every further
call is refused at once with :class:`NvmlHung` naming the stuck call and for how long, so no
thread piles up behind it and nothing waits. What callers do with it: the heartbeat reports no
GPUs and the problem (the node is unhealthy for placement, not lost), the health check reads
every GPU as lost (``gpu.degraded``), a launch fails with the reason, a release keeps its
record for the next start. A call that creates something passes ``undo``: if it returns after
its caller gave up (the deadline, a cancel), what it made is undone there and then.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

log = logging.getLogger(__name__)

R = TypeVar("R")

NVML_TIMEOUT_S = 30.0
"""How long one NVML call may take before NVML counts as not answering (the default of
``DSEC_NVML_TIMEOUT_S``)."""


class NvmlHung(RuntimeError):
    """NVML did not answer a call within its deadline, or is still busy with one that did not."""


@dataclass
class _Call:
    what: str
    started: float = field(default_factory=time.monotonic)
    done: bool = False
    abandoned: bool = False
    """Its caller gave up: a late result is undone, not delivered."""


class NvmlCalls:
    """NVML calls of one process, each with a deadline (see the module's docstring)."""

    def __init__(self, timeout_s: float = NVML_TIMEOUT_S) -> None:
        if not timeout_s > 0:
            raise ValueError(f"an NVML deadline must be more than 0 s, not {timeout_s!r}")
        self.timeout_s = timeout_s
        self._lock = threading.Lock()  # held only around the calls' bookkeeping
        self._stuck: dict[int, _Call] = {}  # calls past their deadline that have not returned
        self._ids = itertools.count()

    def stuck(self) -> str | None:
        """The oldest call past its deadline that still has not returned (None: NVML answers)."""
        with self._lock:
            oldest = min(self._stuck.values(), key=lambda c: c.started, default=None)
        if oldest is None:
            return None
        return f"{oldest.what} has not returned for {time.monotonic() - oldest.started:.0f} s"

    async def call(
        self,
        what: str,
        fn: Callable[..., R],
        *args: Any,
        timeout_s: float | None = None,
        undo: Callable[[R], object] | None = None,
    ) -> R:
        """``fn(*args)`` in a thread of its own, waited for at most ``timeout_s`` (default: the
        gate's). ``what`` names the call in errors and logs.

        Raises:
            NvmlHung: it did not return in time, or an earlier call still has not.
        """
        if (stuck := self.stuck()) is not None:
            raise NvmlHung(f"NVML is not answering ({stuck}); {what} not tried")
        limit = self.timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[R] = loop.create_future()
        call, key = _Call(what), next(self._ids)

        def deliver(result: Any, error: BaseException | None) -> None:
            if answer.done():
                return
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(result)

        def run() -> None:
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn(*args)
            except BaseException as exc:  # handed to the caller, as to_thread would
                error = exc
            with self._lock:
                call.done = True
                late = self._stuck.pop(key, None) is not None
                abandoned = call.abandoned
            if late:
                log.warning("NVML answered %s after %.1f s", what, time.monotonic() - call.started)
            if abandoned:
                self._undo(what, undo, result, error)
                return
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(deliver, result, error)

        threading.Thread(target=run, name=f"nvml: {what}", daemon=True).start()
        try:
            return await asyncio.wait_for(asyncio.shield(answer), limit)
        except TimeoutError:
            with self._lock:
                if not call.done:
                    call.abandoned = True
                    self._stuck[key] = call
            if call.abandoned:
                raise NvmlHung(f"NVML did not answer {what} within {limit:g} s") from None
            return await answer  # it returned just now: its answer is on its way
        except asyncio.CancelledError:
            with self._lock:
                call.abandoned = not call.done
            if not call.abandoned and undo is not None:
                # it returned, and its answer is on its way to a caller that is gone
                answer.add_done_callback(lambda done: self._undo_answer(what, undo, done))
            raise

    def _undo_answer(
        self, what: str, undo: Callable[[Any], object], done: asyncio.Future[Any]
    ) -> None:
        if done.cancelled() or done.exception() is not None:
            return
        threading.Thread(
            target=self._undo, args=(what, undo, done.result(), None), daemon=True
        ).start()

    @staticmethod
    def _undo(
        what: str, undo: Callable[[Any], object] | None, result: Any, error: BaseException | None
    ) -> None:
        """What a call made after its caller gave up, undone (in the call's thread)."""
        if undo is None or error is not None:
            return
        try:
            undo(result)
            log.warning("NVML: %s returned after its caller gave up; what it made is undone", what)
        except Exception:
            log.exception("NVML: %s returned after its caller gave up and was not undone", what)
