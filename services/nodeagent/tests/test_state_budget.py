"""The node's budget of state frame bytes in flight (dsec_nodeagent.state.budget), alone."""

from __future__ import annotations

import asyncio

import pytest

from dsec_nodeagent.state.budget import FrameBudget


async def _held(
    budget: FrameBudget, sandbox: str, size: int, go: asyncio.Event, tenant: str = ""
) -> str:
    async with budget.hold(sandbox, tenant or f"t-{sandbox}", size):
        await go.wait()
    return sandbox


async def test_frames_wait_their_turn_node_wide_and_per_sandbox() -> None:
    budget = FrameBudget(total=100, per_sandbox=60, per_tenant=100)
    go = asyncio.Event()
    first = asyncio.create_task(_held(budget, "a", 60, go))
    await asyncio.sleep(0)
    assert (budget.used, budget.held("a")) == (60, 60)
    # a's second frame waits for a's share; b's, behind it, is not held up by that
    a_again = asyncio.create_task(_held(budget, "a", 10, asyncio.Event()))
    b = asyncio.create_task(_held(budget, "b", 40, go))
    await asyncio.sleep(0)
    assert budget.used == 100 and not a_again.done()
    # c's waits for the node-wide total, and so does d's behind it (in order, not starved)
    c = asyncio.create_task(_held(budget, "c", 50, go))
    d = asyncio.create_task(_held(budget, "d", 5, go))
    await asyncio.sleep(0)
    assert budget.held("c") == 0 and budget.held("d") == 0
    go.set()
    assert {await first, await b, await c, await d} == {"a", "b", "c", "d"}
    a_again.cancel()
    with pytest.raises(asyncio.CancelledError):
        await a_again
    assert budget.used == 0 and budget.held("a") == 0


async def test_a_cancelled_or_failed_holder_gives_its_bytes_back() -> None:
    budget = FrameBudget(total=10, per_sandbox=10, per_tenant=10)
    go = asyncio.Event()
    holder = asyncio.create_task(_held(budget, "a", 10, go))
    await asyncio.sleep(0)
    waiting = asyncio.create_task(_held(budget, "b", 10, go))
    behind = asyncio.create_task(_held(budget, "c", 10, go))
    await asyncio.sleep(0)
    waiting.cancel()  # cancelled while waiting: it takes nothing, and c is next
    with pytest.raises(asyncio.CancelledError):
        await waiting
    holder.cancel()  # cancelled while holding: its bytes go to c
    with pytest.raises(asyncio.CancelledError):
        await holder
    await asyncio.sleep(0)
    assert budget.held("c") == 10
    go.set()
    assert await behind == "c"
    with pytest.raises(RuntimeError):
        async with budget.hold("d", "t", 4):
            raise RuntimeError("a frame that failed")
    assert budget.used == 0
    with pytest.raises(ValueError, match="over a sandbox's"):
        async with budget.hold("d", "t", 11):
            pass


async def test_one_tenants_sandboxes_hold_half_the_budget_at_most() -> None:
    """Eight sandboxes of one tenant announcing largest frames they never send made every other
    tenant's frames wait for their deadlines: a tenant holds half the budget at most, and the
    others' frames pass its waiters."""
    budget = FrameBudget(total=256, per_sandbox=64)
    assert budget.per_tenant == 128
    go = asyncio.Event()
    hostile = [
        asyncio.create_task(_held(budget, f"h{i}", 64, go, tenant="hostile")) for i in range(8)
    ]
    await asyncio.sleep(0)
    assert budget.held_by_tenant("hostile") == 128 and budget.used == 128
    victims = [asyncio.create_task(_held(budget, f"v{i}", 64, go)) for i in range(2)]
    await asyncio.sleep(0)
    assert budget.used == 256  # both victims hold theirs, ahead of six hostile waiters
    assert all(budget.held(f"v{i}") == 64 for i in range(2))
    go.set()
    await asyncio.gather(*hostile, *victims)
    assert budget.used == 0 and budget.held_by_tenant("hostile") == 0
