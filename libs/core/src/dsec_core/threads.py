"""Work in a thread that a cancellation waits for.

``asyncio.to_thread`` returns at once when its caller is cancelled, but the thread cannot be
stopped: it goes on, while the caller's cleanup (``finally``, a lock's release) runs beside
it. For work whose end the cleanup depends on (committing a tree that a failed attempt's
cleanup removes, an upload under a lock that a retry then takes), :func:`to_thread_to_the_end`
lets the thread finish first, then raises the cancellation; :func:`to_the_end` does the same
for any awaitable.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


async def to_the_end(step: Awaitable[R]) -> R:
    """``step`` run to its end: if the caller is cancelled meanwhile (once or more), ``step``
    still ends first (its result or error dropped), then :class:`asyncio.CancelledError`. For a
    step whose bookkeeping must match what it did (a daemon started, a device created)."""
    work = asyncio.ensure_future(step)
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        while not work.done():  # every further cancellation too waits for the step
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait({work})
        if not work.cancelled() and (error := work.exception()) is not None:
            # the caller is cancelled and its result is not wanted; its error is still told
            log.warning("a step a cancel waited for failed: %s: %s", type(error).__name__, error)
        raise


async def to_thread_to_the_end(fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
    """``fn(*args, **kwargs)`` in a thread; if the caller is cancelled meanwhile (once or more),
    the thread's work ends first (its result or error dropped), then
    :class:`asyncio.CancelledError`."""
    return await to_the_end(asyncio.to_thread(fn, *args, **kwargs))
