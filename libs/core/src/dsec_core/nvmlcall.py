"""NVML calls with a deadline.

Every NVML call blocks in the driver, and a GPU that fell off the bus (XID 79) or a wedged
driver can make one block for minutes or for good (``nvidia-smi`` hangs the same way). Run on
``asyncio.to_thread``, such a call held a worker of the default thread pool forever, and what
awaited it waited forever: the heartbeat that reads the GPUs stopped, so after three missed
beats the scheduler declared the node lost and placed its sandboxes again elsewhere while
they still ran here; the quota watch and the health check stopped; a launch creating a MIG
instance never ended.

:class:`NvmlCalls` runs each call in a daemon thread of its own and waits at most its deadline
(``DSEC_NVML_TIMEOUT_S``, 30 s; the heartbeat's GPU read and the health check at most one
beat). A call past its deadline raises :class:`NvmlHung` to its caller, and is then:

* **not tried again while it runs:** the next call of the same kind (the same ``what``) is
  refused at once, naming it and for how long, so a hung read every beat piles up no threads;
* **NVML as a whole, once it has run longer than the process deadline** (``timeout_s``):
  every call is refused at once (:meth:`NvmlCalls.stuck`) until it returns.

What callers do with it: the heartbeat reports no GPUs and the problem (the node is unhealthy
for placement, not lost), the health check reads every GPU as lost (``gpu.degraded``), a launch
fails with the reason, a release keeps its record for the next start; a shutdown (``alone``)
is not tried beside a call still in flight. A call that creates something passes ``undo``: if
it returns after its caller gave up (the deadline, a cancel), what it made is undone there and
then, and the call counts as in flight until the undo has returned too.
:meth:`NvmlCalls.call_blocking` is the same for code already in a thread (the snapshot store's
GPU probe: a snapshot or rollback records "NVML did not answer" instead of never ending).
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
from typing import Any, TypeVar, cast

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
        self._running: dict[int, _Call] = {}  # every call (and late undo) not returned yet
        self._ids = itertools.count()

    def stuck(self) -> str | None:
        """A call running longer than the process deadline (None: NVML answers)."""
        now = time.monotonic()
        with self._lock:
            oldest = min(self._running.values(), key=lambda c: c.started, default=None)
        if oldest is None or now - oldest.started < self.timeout_s:
            return None
        return f"{oldest.what} has not returned for {now - oldest.started:.0f} s"

    def in_flight(self) -> int:
        """Calls (and late undos) that have not returned yet, given up on or not."""
        with self._lock:
            return len(self._running)

    def _refusal(self, what: str, alone: bool) -> str | None:
        """Why a call of ``what`` is not tried now (None: it is)."""
        if (stuck := self.stuck()) is not None:
            return f"NVML is not answering ({stuck}); {what} not tried"
        now = time.monotonic()
        with self._lock:
            running = list(self._running.values())
        for call in running:
            if call.what == what and call.abandoned:
                return (
                    f"{what} not tried again: NVML has not answered the previous one for "
                    f"{now - call.started:.0f} s"
                )
            if alone:
                return (
                    f"{what} not tried beside {call.what}, which has not returned for "
                    f"{now - call.started:.0f} s"
                )
        return None

    def _start(
        self,
        what: str,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        undo: Callable[[Any], object] | None,
        deliver: Callable[[Any, BaseException | None], None],
        alone: bool = False,
    ) -> _Call:
        """``fn(*args)`` started in a daemon thread; ``deliver(result, error)`` called from it
        unless its caller gave up first (then a result is undone)."""
        if (refusal := self._refusal(what, alone)) is not None:
            raise NvmlHung(refusal)
        call, key = _Call(what), next(self._ids)
        with self._lock:
            self._running[key] = call

        def run() -> None:
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn(*args)
            except StopIteration as exc:  # cannot be set on a future
                error = RuntimeError(f"{what}: StopIteration: {exc}")
            except BaseException as exc:  # handed to the caller, as to_thread would
                error = exc
            with self._lock:
                call.done = True
                abandoned = call.abandoned
                if not abandoned:  # (before its caller can hear of it)
                    self._running.pop(key, None)
            if not abandoned:
                deliver(result, error)
                return
            try:
                log.warning(
                    "NVML answered %s after %.1f s, its caller gone",
                    what, time.monotonic() - call.started,
                )  # fmt: skip
                self._undo(what, undo, result, error)
            finally:  # in flight until its undo returned too
                with self._lock:
                    self._running.pop(key, None)

        threading.Thread(target=run, name=f"nvml: {what}", daemon=True).start()
        return call

    def _gave_up(self, call: _Call, limit: float) -> None:
        """The deadline passed: unless the call returned meanwhile, raise
        :class:`NvmlHung` (the call stays in flight until it returns)."""
        with self._lock:
            if not call.done:
                call.abandoned = True
        if call.abandoned:
            raise NvmlHung(f"NVML did not answer {call.what} within {limit:g} s")

    async def call(
        self,
        what: str,
        fn: Callable[..., R],
        *args: Any,
        timeout_s: float | None = None,
        undo: Callable[[R], object] | None = None,
        alone: bool = False,
    ) -> R:
        """``fn(*args)`` in a thread of its own, waited for at most ``timeout_s`` (default: the
        process deadline). ``what`` names the call in errors and logs; ``alone``: not tried
        while any other call is in flight (a shutdown).

        Raises:
            NvmlHung: it did not return in time, or is refused (see the module's docstring).
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        loop = asyncio.get_running_loop()
        answer: asyncio.Future[R] = loop.create_future()

        def settle(result: Any, error: BaseException | None) -> None:
            if answer.done():
                return
            if error is not None:
                answer.set_exception(error)
            else:
                answer.set_result(result)

        def deliver(result: Any, error: BaseException | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(settle, result, error)

        call = self._start(what, fn, args, undo, deliver, alone)
        try:
            try:
                return await asyncio.wait_for(asyncio.shield(answer), limit)
            except TimeoutError:
                self._gave_up(call, limit)
                # it returned just now: its answer is on its way
                return await asyncio.shield(answer)
        except asyncio.CancelledError:
            with self._lock:
                call.abandoned = not call.done
            if not call.abandoned and undo is not None:
                # it returned, and its answer is on its way to a caller that is gone
                answer.add_done_callback(lambda done: self._undo_answer(what, undo, done))
            raise

    def call_blocking(
        self,
        what: str,
        fn: Callable[..., R],
        *args: Any,
        timeout_s: float | None = None,
    ) -> R:
        """:meth:`call` for code that already runs in a thread (never on the event loop): waits
        at most ``timeout_s`` for ``fn(*args)`` in a thread of its own.

        Raises:
            NvmlHung: it did not return in time, or is refused.
        """
        limit = self.timeout_s if timeout_s is None else timeout_s
        returned = threading.Event()
        box: list[Any] = []

        def deliver(result: Any, error: BaseException | None) -> None:
            box[:] = [result, error]
            returned.set()

        call = self._start(what, fn, args, None, deliver)
        if not returned.wait(limit):
            self._gave_up(call, limit)
            returned.wait()  # it returned just now: its answer is being handed over
        result, error = box
        if error is not None:
            raise error
        return cast(R, result)

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
