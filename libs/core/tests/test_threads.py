"""A cancelled caller of thread work waits for the thread to end before its cleanup runs."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from dsec_core.threads import to_thread_to_the_end


async def test_a_cancellation_waits_for_the_thread_then_is_raised() -> None:
    events: list[str] = []
    started = threading.Event()

    def commit() -> str:
        started.set()
        time.sleep(0.2)  # renaming a tree into place
        events.append("committed")
        return "done"

    async def attempt() -> None:
        try:
            await to_thread_to_the_end(commit)
        finally:
            events.append("cleanup")  # e.g. removing the staging tree

    task = asyncio.create_task(attempt())
    await asyncio.to_thread(started.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert events == ["committed", "cleanup"]  # with asyncio.to_thread: cleanup first


async def test_the_result_and_the_error_come_back_as_from_the_function() -> None:
    assert await to_thread_to_the_end(lambda x, y=1: x + y, 2, y=3) == 5

    def fails() -> None:
        raise ValueError("disk full")

    with pytest.raises(ValueError, match="disk full"):
        await to_thread_to_the_end(fails)


async def test_a_second_cancellation_waits_for_the_thread_too() -> None:
    """A handler cancelled by its timeout, then again by a stop, while it waits for its
    commit: the cleanup still comes after the commit."""
    events: list[str] = []
    started = threading.Event()

    def commit() -> None:
        started.set()
        time.sleep(0.3)
        events.append("committed")

    async def attempt() -> None:
        try:
            await to_thread_to_the_end(commit)
        finally:
            events.append("cleanup")

    task = asyncio.create_task(attempt())
    await asyncio.to_thread(started.wait, 5)
    task.cancel()
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert events == ["committed", "cleanup"]
