"""Fair turns between tenants for a service's request handlers.

A handler registered with ``workers=N`` does not take its events one at a time in stream order:
the runtime verifies each event as it arrives, then holds it in its tenant's queue, and N
workers take the queues in turn (round robin over the tenants with something waiting). A tenant
that submits a thousand slow builds therefore delays another tenant's build by at most the
builds already running, not by its whole backlog.

Bounds, so that holding events costs bounded memory and nothing waits forever:

* ``per_tenant`` / ``per_tenant_bytes``: events, and their bytes, one tenant may have held at
  once (waiting + running). The next one is not held: the runtime ends it at once with the
  handler's failure event, saying how many the tenant has held and the most it may (like HTTP's
  429). Nothing is dropped silently. A tenant's first event is always held.
* ``total`` / ``total_bytes``: events, and their bytes, held for all tenants together. When one
  is reached the runtime stops taking new events from the bus until one ends (JetStream keeps
  them), so that bound is backpressure, not a refusal. A tenant holding nothing may go past
  them by an eighth: a neighbour's request already taken from the bus is not held behind the
  backlogs that filled the instance.
* ``workers`` / ``per_tenant_running``: the workers that take from the queue are shared out
  max-min fairly among the tenants holding something: a tenant runs at most its share (the
  level at which the tenants' demands, capped there, fill the workers), and never more than
  ``per_tenant_running``. A tenant at its share waits for one of its requests to end, even
  with a worker free, so one tenant's slow requests (builds of several minutes) never take
  every worker. The runtime sets ``per_tenant_running`` to one less than its workers: while a
  single tenant is busy, another tenant's request starts at once.

Pure asyncio, no I/O: the runtime (``dsec_core.service``) does the verifying, acking and
keep-alives around it.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


class QueueClosed(Exception):
    """The queue was closed (its service is stopping): the item was not held."""


class TenantFull(Exception):
    """The tenant already holds its share: ``per_tenant`` events or ``per_tenant_bytes``."""

    def __init__(self, tenant: str, held: int, held_bytes: int, limit: int) -> None:
        super().__init__(
            f"tenant {tenant!r} has {held} requests ({held_bytes:,} bytes) held, the most one may"
        )
        self.tenant, self.held, self.held_bytes, self.limit = tenant, held, held_bytes, limit


@dataclass(frozen=True)
class Ticket(Generic[T]):
    """A held item as a worker takes it; give it back to :meth:`FairQueue.done`."""

    tenant: str
    item: T
    size: int


@dataclass
class _Tenant(Generic[T]):
    waiting: deque[Ticket[T]] = field(default_factory=deque)
    running: int = 0
    bytes: int = 0  # waiting and running

    @property
    def held(self) -> int:
        return len(self.waiting) + self.running


class FairQueue(Generic[T]):
    """Per-tenant FIFO queues taken in turn; see the module's docstring for the bounds.

    Each item has a size (its bytes as received): the bounds hold for bytes as for counts, so
    a tenant of large requests holds fewer of them.
    """

    def __init__(
        self,
        *,
        per_tenant: int,
        total: int,
        per_tenant_bytes: int = 1 << 62,
        total_bytes: int = 1 << 62,
        per_tenant_running: int = 1 << 62,
        workers: int | None = None,
    ) -> None:
        bounds = (per_tenant, total, per_tenant_bytes, total_bytes, per_tenant_running)
        if min(bounds) < 1 or (workers is not None and workers < 1):
            raise ValueError("per_tenant, total, their bytes and per_tenant_running must be >= 1")
        self.per_tenant, self.total = per_tenant, total
        self.per_tenant_bytes, self.total_bytes = per_tenant_bytes, total_bytes
        self.per_tenant_running, self.workers = per_tenant_running, workers
        self._tenants: dict[str, _Tenant[T]] = {}
        self._turns: OrderedDict[str, None] = OrderedDict()  # tenants with something waiting
        self._held = 0
        self._bytes = 0
        self._closed = False
        self._changed = asyncio.Condition()
        self._share: int | None = None  # share()'s value until the held counts change

    def fresh(self) -> FairQueue[T]:
        """An empty, open queue with the same bounds."""
        return FairQueue(
            per_tenant=self.per_tenant,
            total=self.total,
            per_tenant_bytes=self.per_tenant_bytes,
            total_bytes=self.total_bytes,
            per_tenant_running=self.per_tenant_running,
            workers=self.workers,
        )

    @property
    def held(self) -> int:
        """Events held for all tenants (waiting + running)."""
        return self._held

    @property
    def held_bytes(self) -> int:
        return self._bytes

    @property
    def waiting(self) -> int:
        """Events held and not taken by a worker yet."""
        return sum(len(t.waiting) for t in self._tenants.values())

    def held_by(self, tenant: str) -> int:
        entry = self._tenants.get(tenant)
        return 0 if entry is None else entry.held

    async def empty(self) -> None:
        """Wait until nothing is held (every item taken and done)."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._held == 0)

    async def put(self, tenant: str, item: T, size: int = 1) -> None:
        """Hold ``item`` in ``tenant``'s queue, waiting for room while ``total`` events or
        ``total_bytes`` are held (one item alone always fits).

        Raises:
            TenantFull: the tenant holds its share, before or while it waits for room (the
                item is never held beyond a bound).
            QueueClosed: :meth:`close` was called, before or while it waited.
        """
        if self._closed:
            raise QueueClosed
        self._check(tenant, size)
        async with self._changed:
            await self._changed.wait_for(
                lambda: self._closed or self._room(tenant, size) or self._full(tenant, size)
            )
            if self._closed:
                raise QueueClosed
            self._check(tenant, size)
            entry = self._tenants.setdefault(tenant, _Tenant())
            entry.waiting.append(Ticket(tenant, item, size))
            entry.bytes += size
            self._held += 1
            self._share = None
            self._bytes += size
            self._turns.setdefault(tenant)
            self._changed.notify_all()

    def _room(self, tenant: str, size: int) -> bool:
        if self._held == 0:
            return True
        if self._held < self.total and self._bytes + size <= self.total_bytes:
            return True
        if self.held_by(tenant):
            return False
        # A tenant holding nothing: up to an eighth past the bounds (see the module's doc).
        return (
            self._held < self.total + max(1, self.total // 8)
            and self._bytes + size <= self.total_bytes + self.total_bytes // 8
        )

    def _full(self, tenant: str, size: int) -> bool:
        entry = self._tenants.get(tenant)
        if entry is None or not entry.held:
            return False  # a tenant's first item is never refused
        return entry.held >= self.per_tenant or entry.bytes + size > self.per_tenant_bytes

    def _check(self, tenant: str, size: int) -> None:
        if self._full(tenant, size):
            entry = self._tenants[tenant]
            raise TenantFull(tenant, entry.held, entry.bytes, self.per_tenant)

    async def take(self) -> Ticket[T]:
        """The next item: the oldest of the tenant whose turn it is; that tenant's next turn
        comes after every other tenant with something waiting. A tenant running its share of
        the workers (see the module's doc) is passed over, keeping its place, until one of its
        items is done. Give the item to :meth:`done` after."""
        async with self._changed:
            await self._changed.wait_for(lambda: self._next_turn() is not None)
            tenant = self._next_turn()
            assert tenant is not None
            entry = self._tenants[tenant]
            del self._turns[tenant]
            ticket = entry.waiting.popleft()
            entry.running += 1
            if entry.waiting:
                self._turns[tenant] = None  # to the back of the turns
            return ticket

    def _next_turn(self) -> str | None:
        """The first tenant in turn order that may start one more item (``None``: none)."""
        if not self._turns:
            return None
        share = self.share()
        for tenant in self._turns:
            if self._tenants[tenant].running < share:
                return tenant
        return None

    def share(self) -> int:
        """The most items one tenant may run now: the max-min fair level of the workers over
        the tenants' held items, at most ``per_tenant_running``."""
        if self.workers is None:
            return self.per_tenant_running
        if self._share is None:
            self._share = self._level(self.workers)
        return self._share

    def _level(self, workers: int) -> int:
        """The max-min level: the tenants' held counts, capped at it, fill ``workers``."""
        demands = sorted(entry.held for entry in self._tenants.values())
        left, count = workers, len(demands)
        for n, demand in enumerate(demands):
            if demand * (count - n) >= left:  # the rest all want at least the level
                return min(self.per_tenant_running, max(1, -(-left // (count - n))))
            left -= demand
        return self.per_tenant_running  # every demand fits

    async def done(self, ticket: Ticket[T]) -> None:
        """A taken item has ended (acked, failed or given back): its room is free."""
        async with self._changed:
            entry = self._tenants[ticket.tenant]
            entry.running -= 1
            entry.bytes -= ticket.size
            self._held -= 1
            self._share = None
            self._bytes -= ticket.size
            if not entry.held:
                del self._tenants[ticket.tenant]
            self._changed.notify_all()

    async def close(self) -> list[T]:
        """Hold nothing more (a waiting :meth:`put` raises :class:`QueueClosed`) and return
        everything still waiting, oldest first per tenant, for a stopping service to give
        back; only the running items stay held, until their :meth:`done`."""
        async with self._changed:
            self._closed = True
            items: list[T] = []
            for tenant, entry in list(self._tenants.items()):
                for ticket in entry.waiting:
                    items.append(ticket.item)
                    entry.bytes -= ticket.size
                    self._bytes -= ticket.size
                self._held -= len(entry.waiting)
                self._share = None
                entry.waiting.clear()
                if not entry.running:
                    del self._tenants[tenant]
            self._turns.clear()
            self._changed.notify_all()
            return items
