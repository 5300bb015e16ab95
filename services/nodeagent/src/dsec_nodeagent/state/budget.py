"""The node agent's memory for state frames in flight, shared fairly by the node's sandboxes.

A state socket's frame may be 64 MiB (``wire.MAX_FRAME``), and the keeper holds a frame's bytes
from its read until it is served (decoded, made durable). Without a bound, every sandbox of the
node could have one in flight at once, each as large as it likes, and a sandbox that announces
a frame and then sends its body slowly holds that memory as long as it likes: the node agent,
which serves every sandbox's IPC and state, runs out of memory for all of them.

A frame's reader takes its size from :class:`FrameBudget` before it reads the body, and gives
it back once the frame is served: at most ``total`` bytes node-wide, at most ``per_tenant``
(half of it) for one tenant's sandboxes together and ``per_sandbox`` (one largest frame) for one
sandbox, granted first come, first served (a waiter that its own sandbox's or tenant's share
holds back does not hold up the others behind it). The body must then come within the keeper's
deadline (``BODY_TIMEOUT_S``), so a sandbox cannot keep the bytes it took by sending slowly,
and one tenant's sandboxes announcing frames they never send hold up other tenants' frames not
at all: half the budget is always theirs (an adversarial review: 8 sandboxes of one tenant
made every other checkpoint of the node wait for their deadlines).
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
    tenant: str
    size: int
    future: asyncio.Future[None] = field(repr=False)


class FrameBudget:
    """Bytes of state frames in flight, node-wide and per sandbox (see the module)."""

    def __init__(self, total: int, per_sandbox: int, per_tenant: int | None = None) -> None:
        per_tenant = total // 2 if per_tenant is None else per_tenant
        if not per_sandbox <= per_tenant <= total:
            raise ValueError(
                f"per_sandbox ({per_sandbox}) <= per_tenant ({per_tenant}) <= total ({total})"
            )
        self.total = total
        self.per_sandbox = per_sandbox
        self.per_tenant = per_tenant
        self.used = 0
        self._held: defaultdict[str, int] = defaultdict(int)
        self._tenants: defaultdict[str, int] = defaultdict(int)
        self._waiters: deque[_Waiter] = deque()

    def held(self, sandbox: str) -> int:
        """The bytes ``sandbox`` holds now."""
        return self._held.get(sandbox, 0)

    def held_by_tenant(self, tenant: str) -> int:
        """The bytes ``tenant``'s sandboxes hold now."""
        return self._tenants.get(tenant, 0)

    @contextlib.asynccontextmanager
    async def hold(self, sandbox: str, tenant: str, size: int) -> AsyncIterator[None]:
        """Hold ``size`` bytes for ``sandbox`` of ``tenant`` (waiting for them first) until the
        block ends."""
        if size > self.per_sandbox:
            raise ValueError(f"a frame of {size} bytes is over a sandbox's {self.per_sandbox}")
        await self._take(sandbox, tenant, size)
        try:
            yield
        finally:
            self._give(sandbox, tenant, size)

    async def _take(self, sandbox: str, tenant: str, size: int) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiter = _Waiter(sandbox, tenant, size, future)
        self._waiters.append(waiter)
        self._wake()  # (granted at once when nothing holds it back)
        if future.done():
            return
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():
                self._give(sandbox, tenant, size)  # granted as it was cancelled: handed on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
                self._wake()
            raise

    def _shares_allow(self, sandbox: str, tenant: str, size: int) -> bool:
        return (
            self.held(sandbox) + size <= self.per_sandbox
            and self.held_by_tenant(tenant) + size <= self.per_tenant
        )

    def _grant(self, sandbox: str, tenant: str, size: int) -> None:
        self.used += size
        self._held[sandbox] += size
        self._tenants[tenant] += size

    def _give(self, sandbox: str, tenant: str, size: int) -> None:
        self.used -= size
        self._held[sandbox] -= size
        self._tenants[tenant] -= size
        if not self._held[sandbox]:
            del self._held[sandbox]
        if not self._tenants[tenant]:
            del self._tenants[tenant]
        self._wake()

    def _wake(self) -> None:
        """Grant waiters in order; one its own sandbox's or tenant's share holds back is passed
        over, one the node-wide total holds back stops the scan (a large frame is not starved
        by small ones behind it)."""
        for waiter in list(self._waiters):
            if waiter.future.done():
                self._waiters.remove(waiter)
                continue
            if not self._shares_allow(waiter.sandbox, waiter.tenant, waiter.size):
                continue
            if self.used + waiter.size > self.total:
                break
            self._waiters.remove(waiter)
            self._grant(waiter.sandbox, waiter.tenant, waiter.size)
            waiter.future.set_result(None)
