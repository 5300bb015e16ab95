"""``dsec_core.projections.until_set``: the read models' followers stop as soon as their service
stops, not after the idle read they were waiting on; an item handed out is never cut short."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from dsec_core.projections import until_set

pytestmark = [pytest.mark.unit]


class Source:
    """Yields 1, 2, then waits forever (an idle follow); remembers that it was closed."""

    def __init__(self) -> None:
        self.closed = False
        self.waiting = asyncio.Event()

    async def items(self) -> AsyncIterator[int]:
        try:
            yield 1
            yield 2
            self.waiting.set()
            await asyncio.Event().wait()  # never set: only a cancellation ends this
            yield 3
        finally:
            self.closed = True


async def test_a_stop_while_waiting_ends_the_loop_and_closes_the_source() -> None:
    stop, source = asyncio.Event(), Source()
    got: list[int] = []

    async def consume() -> None:
        async for item in until_set(stop, source.items()):
            got.append(item)

    task = asyncio.create_task(consume())
    await source.waiting.wait()
    assert not task.done()
    stop.set()
    await asyncio.wait_for(task, 5)  # (a bound, should it hang: the assertions say what broke)
    assert got == [1, 2]
    assert source.closed


async def test_an_item_being_handled_is_not_cut_short_by_the_stop() -> None:
    stop, source = asyncio.Event(), Source()
    handled: list[int] = []

    async for item in until_set(stop, source.items()):
        stop.set()  # set while the caller still works on the item
        await asyncio.sleep(0)
        handled.append(item)
    assert handled == [1]  # handled to its end; nothing asked for after the stop
    assert source.closed


async def test_a_source_that_ends_ends_the_loop() -> None:
    async def two() -> AsyncIterator[int]:
        yield 1
        yield 2

    assert [i async for i in until_set(asyncio.Event(), two())] == [1, 2]


async def test_a_cancelled_consumer_closes_the_source_it_was_waiting_on() -> None:
    stop, source = asyncio.Event(), Source()

    async def consume() -> None:
        async for _ in until_set(stop, source.items()):
            pass

    task = asyncio.create_task(consume())
    await source.waiting.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert source.closed
