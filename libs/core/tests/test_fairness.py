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
    blocked = asyncio.create_task(queue.put("b", "b1"))
    await asyncio.sleep(0)  # let it reach the wait
    for _ in range(3):
        await asyncio.sleep(0)
    assert not blocked.done() and queue.held == 2
    ticket = await queue.take()
    assert not blocked.done()  # taken is still held
    await queue.done(ticket)
    await asyncio.wait_for(blocked, 1.0)
    assert queue.held == 2 and queue.held_by("b") == 2


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
    blocked = asyncio.create_task(queue.put("b", "b1"))  # waits for room
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
    await queue.put("b", "b0", 100)
    blocked = asyncio.create_task(queue.put("b", "b1", 600))  # 1,700 > 1,500 for all
    for _ in range(3):
        await asyncio.sleep(0)
    assert not blocked.done() and queue.held_bytes == 1100
    await queue.done(await queue.take())  # a0's 600 bytes free
    await asyncio.wait_for(blocked, 1.0)
    assert queue.held_bytes == 1100


async def test_one_item_larger_than_every_bound_is_still_held_alone() -> None:
    queue: FairQueue[str] = FairQueue(per_tenant=1, total=1, per_tenant_bytes=10, total_bytes=10)
    await queue.put("a", "huge", 10_000)  # a tenant's first, and nothing else held
    ticket = await queue.take()
    assert ticket.size == 10_000
    await queue.done(ticket)
    assert queue.held == 0 and queue.held_bytes == 0


def test_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError, match=">= 1"):
        FairQueue(per_tenant=0, total=1)


async def test_a_tenant_running_its_most_is_passed_over_keeping_its_place() -> None:
    """Slow requests of one tenant never take every worker: at ``per_tenant_running`` it waits
    (even with a worker free) while another tenant's request starts; once one of its own ends,
    its next turn comes first, in its own order."""
    queue: FairQueue[str] = FairQueue(per_tenant=100, total=1000, per_tenant_running=2)
    for n in range(5):
        await queue.put("flood", f"f{n}")
    running = [await queue.take(), await queue.take()]
    assert [t.item for t in running] == ["f0", "f1"]
    third = asyncio.create_task(queue.take())  # a free worker: flood may not run a third
    await asyncio.sleep(0.01)
    assert not third.done()
    await queue.put("late", "l0")
    assert (await asyncio.wait_for(third, 1)).item == "l0"
    fourth = asyncio.create_task(queue.take())
    await asyncio.sleep(0.01)
    assert not fourth.done()
    await queue.done(running[0])
    assert (await asyncio.wait_for(fourth, 1)).item == "f2"
    assert queue.fresh().per_tenant_running == 2


async def test_a_tenant_holding_nothing_gets_past_a_full_instance_by_an_eighth() -> None:
    """Backlogs fill the instance: a neighbour's request already taken from the bus is held
    (an eighth past the bound), not kept behind them; the slack is bounded."""
    queue: FairQueue[str] = FairQueue(per_tenant=100, total=16)
    for n in range(16):
        await queue.put("flood", f"f{n}")
    await asyncio.wait_for(queue.put("neighbour", "n0"), 1.0)
    await asyncio.wait_for(queue.put("other", "o0"), 1.0)  # 16 + 16 // 8 = 18
    more = [
        asyncio.create_task(queue.put("neighbour", "n1")),  # it holds one now: waits
        asyncio.create_task(queue.put("third", "t0")),  # past the slack: waits
        asyncio.create_task(queue.put("flood", "f16")),
    ]
    for _ in range(3):
        await asyncio.sleep(0)
    assert not any(task.done() for task in more) and queue.held == 18
    taken = [await queue.take() for _ in range(3)]
    assert [t.item for t in taken] == ["f0", "n0", "o0"]  # the neighbours' turns come next
    for ticket in taken:
        await queue.done(ticket)
    for _ in range(3):  # room for all three, inside the bound
        await queue.done(await queue.take())
    await asyncio.wait_for(asyncio.gather(*more), 1.0)
    assert queue.held == 15


async def test_the_workers_are_shared_max_min_among_the_busy_tenants() -> None:
    queue: FairQueue[str] = FairQueue(per_tenant=100, total=1000, workers=4, per_tenant_running=3)
    for n in range(10):
        await queue.put("slow", f"s{n}")
    assert queue.share() == 3  # alone: all workers but one
    slow = [await queue.take() for _ in range(3)]
    for n in range(10):
        await queue.put("busy", f"b{n}")
    assert queue.share() == 2  # two tenants with more than enough: two each
    taken = await queue.take()
    assert taken.item == "b0"
    waiting = asyncio.create_task(queue.take())  # slow runs 3 > its share, busy 1 < 2
    assert (await asyncio.wait_for(waiting, 1.0)).item == "b1"
    await queue.done(slow[0])  # slow is at 2 = its share: busy's turn stays busy's
    nxt = asyncio.create_task(queue.take())
    for _ in range(3):
        await asyncio.sleep(0)
    assert not nxt.done()  # busy runs 2, slow runs 2: the share is full
    await queue.done(taken)
    assert (await asyncio.wait_for(nxt, 1.0)).item == "b2"
    small: FairQueue[str] = FairQueue(per_tenant=100, total=1000, workers=8)
    for tenant, count in (("a", 1), ("b", 1), ("c", 1), ("d", 100)):
        for n in range(count):
            await small.put(tenant, f"{tenant}{n}")
    assert small.share() == 5  # a, b and c want one each: d may run the other five


async def test_a_tenant_named_with_an_empty_string_gets_its_turn() -> None:
    queue: FairQueue[str] = FairQueue(per_tenant=10, total=10, workers=2)
    await queue.put("", "e0")
    assert (await asyncio.wait_for(queue.take(), 1.0)).item == "e0"
