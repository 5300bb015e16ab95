"""The node's budget of state frame bytes in flight (dsec_nodeagent.state.budget), alone."""

from __future__ import annotations

import asyncio

import pytest

from dsec_nodeagent.state.budget import FrameBudget


async def _held(budget: FrameBudget, sandbox: str, size: int, go: asyncio.Event) -> str:
    async with budget.hold(sandbox, size):
        await go.wait()
    return sandbox


async def test_frames_wait_their_turn_node_wide_and_per_sandbox() -> None:
    budget = FrameBudget(total=100, per_sandbox=60)
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
    budget = FrameBudget(total=10, per_sandbox=10)
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
        async with budget.hold("d", 4):
            raise RuntimeError("a frame that failed")
    assert budget.used == 0
    with pytest.raises(ValueError, match="over a sandbox's"):
        async with budget.hold("d", 11):
            pass
