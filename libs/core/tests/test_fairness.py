"""The tenants' turns and bounds of a fair handler's queue (pure asyncio)."""

from __future__ import annotations

import asyncio

import pytest
from dsec_core.fairness import FairQueue, QueueClosed, TenantFull


async def _take_all(queue: FairQueue[str], n: int) -> list[str]:
    taken = []
    for _ in range(n):
        ticket = await queue.take()
        taken.append(ticket.item)
        await queue.done(ticket)
    return taken


async def test_tenants_take_turns_and_each_keeps_its_order() -> None:
    queue: FairQueue[str] = FairQueue(per_tenant=100, total=1000)
    for n in range(5):
        await queue.put("a", f"a{n}")
    await queue.put("b", "b0")
    await queue.put("b", "b1")
    await queue.put("c", "c0")
    taken = await _take_all(queue, 8)
    assert taken == ["a0", "b0", "c0", "a1", "b1", "a2", "a3", "a4"]
    assert queue.held == 0 and queue.held_by("a") == 0


async def test_a_tenant_arriving_late_is_next_after_the_turn_in_progress() -> None:
    queue: FairQueue[str] = FairQueue(per_tenant=100, total=1000)
    for n in range(10):
        await queue.put("flood", f"f{n}")
    first = await queue.take()
    await queue.put("late", "l0")
    second = await queue.take()
    third = await queue.take()
    assert (first.item, second.item, third.item) == ("f0", "f1", "l0")


async def test_a_tenant_holds_at_most_per_tenant_counting_what_runs() -> None:
    queue: FairQueue[str] = FairQueue(per_tenant=2, total=1000)
    await queue.put("a", "a0")
    await queue.put("a", "a1")
    with pytest.raises(TenantFull) as full:
        await queue.put("a", "a2")
    assert (full.value.tenant, full.value.held, full.value.limit) == ("a", 2, 2)
    assert "tenant 'a' has 2 requests (2 bytes) held" in str(full.value)
    await queue.put("b", "b0")  # another tenant is not affected
    ticket = await queue.take()  # running still counts
    with pytest.raises(TenantFull):
        await queue.put("a", "a2")
    await queue.done(ticket)
    await queue.put("a", "a2")  # room again once one ended
    assert queue.held_by("a") == 2 and queue.held == 3


async def test_put_waits_while_total_are_held_and_goes_on_when_one_ends() -> None:
    queue: FairQueue[str] = FairQueue(per_tenant=10, total=2)
    await queue.put("a", "a0")
    await queue.put("b", "b0")
    blocked = asyncio.create_task(queue.put("c", "c0"))
    await asyncio.sleep(0)  # let it reach the wait
    for _ in range(3):
        await asyncio.sleep(0)
    assert not blocked.done() and queue.held == 2
    ticket = await queue.take()
    assert not blocked.done()  # taken is still held
    await queue.done(ticket)
    await asyncio.wait_for(blocked, 1.0)
    assert queue.held == 2 and queue.held_by("c") == 1


async def test_a_tenant_full_while_waiting_for_room_is_refused_not_held() -> None:
    queue: FairQueue[str] = FairQueue(per_tenant=1, total=1)
    await queue.put("a", "a0")
    first = asyncio.create_task(queue.put("b", "b0"))
    second = asyncio.create_task(queue.put("b", "b1"))
    for _ in range(3):
        await asyncio.sleep(0)
    await queue.done(await queue.take())
    results = await asyncio.gather(first, second, return_exceptions=True)
    assert results[0] is None and isinstance(results[1], TenantFull)
    assert queue.held == 1


async def test_close_gives_back_what_waits_refuses_more_and_keeps_counting_what_runs() -> None:
    queue: FairQueue[str] = FairQueue(per_tenant=10, total=3)
    for item in ("a0", "a1", "b0"):
        await queue.put(item[0], item)
    blocked = asyncio.create_task(queue.put("c", "c0"))  # waits for room
    running = await queue.take()
    assert running.item == "a0"
    emptied = asyncio.create_task(queue.empty())
    for _ in range(3):
        await asyncio.sleep(0)
    assert not blocked.done()
    assert sorted(await queue.close()) == ["a1", "b0"]
    with pytest.raises(QueueClosed):  # the waiting put is told, not held after the close
        await asyncio.wait_for(blocked, 1.0)
    with pytest.raises(QueueClosed):
        await queue.put("d", "d0")
    assert queue.held == 1 and queue.waiting == 0
    assert not emptied.done()
    await queue.done(running)
    await asyncio.wait_for(emptied, 1.0)
    assert queue.held == 0 and queue.held_bytes == 0


async def test_bytes_are_bounded_like_counts() -> None:
    queue: FairQueue[str] = FairQueue(
        per_tenant=100, total=100, per_tenant_bytes=1000, total_bytes=1500
    )
    await queue.put("a", "a0", 600)
    with pytest.raises(TenantFull) as full:
        await queue.put("a", "a1", 600)  # 1,200 bytes > the tenant's 1,000
    assert full.value.held_bytes == 600
    await queue.put("a", "a1", 400)  # exactly its share
    blocked = asyncio.create_task(queue.put("b", "b0", 600))  # 1,600 > 1,500 for all
    for _ in range(3):
        await asyncio.sleep(0)
    assert not blocked.done() and queue.held_bytes == 1000
    await queue.done(await queue.take())  # a0's 600 bytes free
    await asyncio.wait_for(blocked, 1.0)
    assert queue.held_bytes == 1000


async def test_one_item_larger_than_every_bound_is_still_held_alone() -> None:
    queue: FairQueue[str] = FairQueue(per_tenant=1, total=1, per_tenant_bytes=10, total_bytes=10)
    await queue.put("a", "huge", 10_000)  # a tenant's first, and nothing else held
    ticket = await queue.take()
    assert ticket.size == 10_000
    await queue.done(ticket)
    assert queue.held == 0 and queue.held_bytes == 0


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        FairQueue(per_tenant=0, total=1)
