"""The node agent's memory for state frames in flight, shared fairly by the node's sandboxes.

A state socket's frame may be 64 MiB (``wire.MAX_FRAME``), and the keeper holds a frame's bytes
from its read until it is served (decoded, made durable). Without a bound, every sandbox of the
node could have one in flight at once, each as large as it likes, and a sandbox that announces
a frame and then sends its body slowly holds that memory as long as it likes: the node agent,
which serves every sandbox's IPC and state, runs out of memory for all of them.

A frame's reader takes its size from :class:`FrameBudget` before it reads the body, and gives
it back once the frame is served: at most ``total`` bytes node-wide, at most ``per_sandbox``
(one largest frame) for one sandbox, granted first come, first served (a waiter that its own
sandbox's share holds back does not hold up the others behind it). The body must then come
within the keeper's deadline (``BODY_TIMEOUT_S``), so a sandbox cannot keep the bytes it took
by sending slowly.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import defaultdict, deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field


@dataclass
class _Waiter:
    sandbox: str
    size: int
    future: asyncio.Future[None] = field(repr=False)


class FrameBudget:
    """Bytes of state frames in flight, node-wide and per sandbox (see the module)."""

    def __init__(self, total: int, per_sandbox: int) -> None:
        if per_sandbox > total:
            raise ValueError(f"per_sandbox ({per_sandbox}) may not exceed total ({total})")
        self.total = total
        self.per_sandbox = per_sandbox
        self.used = 0
        self._held: defaultdict[str, int] = defaultdict(int)
        self._waiters: deque[_Waiter] = deque()

    def held(self, sandbox: str) -> int:
        """The bytes ``sandbox`` holds now."""
        return self._held.get(sandbox, 0)

    @contextlib.asynccontextmanager
    async def hold(self, sandbox: str, size: int) -> AsyncIterator[None]:
        """Hold ``size`` bytes for ``sandbox`` (waiting for them first) until the block ends."""
        if size > self.per_sandbox:
            raise ValueError(f"a frame of {size} bytes is over a sandbox's {self.per_sandbox}")
        await self._take(sandbox, size)
        try:
            yield
        finally:
            self._give(sandbox, size)

    async def _take(self, sandbox: str, size: int) -> None:
        if not self._waiters and self._fits(sandbox, size):
            self._grant(sandbox, size)
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(sandbox, size, future)
        self._waiters.append(waiter)
        self._wake()  # (those ahead may wait on their own sandbox's share only)
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():
                self._give(sandbox, size)  # granted as it was cancelled: handed on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
                self._wake()
            raise

    def _fits(self, sandbox: str, size: int) -> bool:
        return self.used + size <= self.total and self.held(sandbox) + size <= self.per_sandbox

    def _grant(self, sandbox: str, size: int) -> None:
        self.used += size
        self._held[sandbox] += size

    def _give(self, sandbox: str, size: int) -> None:
        self.used -= size
        self._held[sandbox] -= size
        if not self._held[sandbox]:
            del self._held[sandbox]
        self._wake()

    def _wake(self) -> None:
        """Grant waiters in order; one its own sandbox's share holds back is passed over, one
        the node-wide total holds back stops the scan (a large frame is not starved by small
        ones behind it)."""
        for waiter in list(self._waiters):
            if waiter.future.done():
                self._waiters.remove(waiter)
                continue
            if self.held(waiter.sandbox) + waiter.size > self.per_sandbox:
                continue
            if self.used + waiter.size > self.total:
                break
            self._waiters.remove(waiter)
            self._grant(waiter.sandbox, waiter.size)
            waiter.future.set_result(None)
