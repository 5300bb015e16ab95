"""NVML calls with a deadline (pure unit tests: the "NVML call" is a function that blocks until
the test lets it return, as the real one's do when a GPU falls off the bus). Before, NVML calls
ran on ``asyncio.to_thread`` with no deadline: a hung one held its caller and a thread of the
default pool for good (what the node agent does with :class:`NvmlHung`:
``services/nodeagent/tests/test_nvml_deadline.py``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from dsec_core.nvmlcall import NvmlCalls, NvmlHung
from dsec_testing.inmemory import until

pytestmark = pytest.mark.unit
DEADLINE_S = 0.2


@pytest.fixture
def wedge() -> Iterator[threading.Event]:
    """Set: a hung NVML call returns (every test lets its threads end)."""
    event = threading.Event()
    yield event
    event.set()


async def test_a_hung_call_ends_at_its_deadline_and_nvml_counts_as_not_answering_until_it_returns(
    wedge: threading.Event,
) -> None:
    calls = NvmlCalls(DEADLINE_S)
    tried: list[str] = []

    def hangs() -> str:
        tried.append("hangs")
        wedge.wait(30)
        return "late"

    started = time.monotonic()
    with pytest.raises(NvmlHung, match=r"NVML did not answer reading the GPUs within 0\.2 s"):
        await calls.call("reading the GPUs", hangs)
    assert time.monotonic() - started < 2.0
    (thread,) = [t for t in threading.enumerate() if t.name == "nvml: reading the GPUs"]
    assert thread.daemon  # never holds the process at its exit

    # refused at once, naming the stuck call: no thread piles up behind it
    started = time.monotonic()
    with pytest.raises(NvmlHung, match=r"not answering \(reading the GPUs has not returned for"):
        await calls.call("reading the health", tried.append, "health")
    assert time.monotonic() - started < 0.1 and tried == ["hangs"]
    assert calls.stuck() is not None

    wedge.set()
    await until(lambda: calls.stuck() is None, "the hung call to return")
    assert await calls.call("reading the health", lambda: "fine") == "fine"


async def test_errors_pass_through_and_a_quick_call_answers() -> None:
    calls = NvmlCalls(5.0)

    def fails() -> None:
        raise LookupError("GPU is lost")

    with pytest.raises(LookupError, match="GPU is lost"):
        await calls.call("reading the GPUs", fails)
    assert calls.stuck() is None
    assert await calls.call("adding", lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ValueError, match="more than 0 s"):
        NvmlCalls(0)


async def test_what_a_call_made_after_its_caller_gave_up_is_undone(
    wedge: threading.Event,
) -> None:
    """Past the deadline, and cancelled while it runs: the late result is undone, once."""
    calls = NvmlCalls(DEADLINE_S)
    undone: list[str] = []

    def makes(name: str) -> str:
        wedge.wait(30)
        return name

    with pytest.raises(NvmlHung):
        await calls.call("creating a", makes, "a", undo=undone.append)
    wedge.set()
    await until(lambda: undone == ["a"] and not calls.in_flight(), "the late instance undone")

    wedge.clear()
    task = asyncio.create_task(calls.call("creating b", makes, "b", undo=undone.append))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    wedge.set()
    await until(lambda: undone == ["a", "b"] and not calls.in_flight(), "b undone")
    assert await calls.call("creating c", makes, "c", undo=undone.append) == "c"
    await asyncio.sleep(0.05)
    assert undone == ["a", "b"]  # a result its caller took is its caller's


def test_a_blocking_call_from_a_thread_has_the_same_deadline(wedge: threading.Event) -> None:
    """What code already in a thread uses (the snapshot store's GPU probe)."""
    calls = NvmlCalls(DEADLINE_S)
    assert calls.call_blocking("adding", lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(LookupError, match="GPU is lost"):
        calls.call_blocking("reading", _lost)
    started = time.monotonic()
    with pytest.raises(NvmlHung, match=r"NVML did not answer probing within 0\.2 s"):
        calls.call_blocking("probing", wedge.wait, 30)
    with pytest.raises(NvmlHung, match=r"NVML is not answering \(probing has not returned"):
        calls.call_blocking("adding", lambda: 1)
    assert time.monotonic() - started < 2.0
    wedge.set()
    deadline = time.monotonic() + 5
    while calls.stuck() is not None:
        assert time.monotonic() < deadline, "the hung call never cleared"
        time.sleep(0.01)
    assert calls.call_blocking("adding", lambda: 1) == 1


def _lost() -> None:
    raise LookupError("GPU is lost")


async def test_a_call_past_a_short_deadline_refuses_its_own_kind_not_every_call(
    wedge: threading.Event,
) -> None:
    """The heartbeat's read waits one beat; a slow one must not make NVML "not answering" for
    a launch whose deadline is 30 s. Until it returns, the next read of its kind is refused at
    once (a hung read every beat piles up no threads); past the process deadline, every call."""
    calls = NvmlCalls(30)
    with pytest.raises(NvmlHung, match=r"did not answer the probe's read within 0\.2 s"):
        await calls.call("the probe's read", wedge.wait, 30, timeout_s=DEADLINE_S)
    assert calls.stuck() is None
    assert await calls.call("reading the GPUs", lambda: "devices") == "devices"
    with pytest.raises(
        NvmlHung,
        match=r"the probe.s read not tried again: NVML has not answered the previous",
    ):
        await calls.call("the probe's read", lambda: "again", timeout_s=DEADLINE_S)
    with pytest.raises(NvmlHung, match=r"NVML's shutdown not tried beside the probe's read"):
        await calls.call("NVML's shutdown", lambda: None, alone=True)
    wedge.set()
    await until(lambda: not calls.in_flight(), "the slow read to return")
    assert await calls.call("the probe's read", lambda: "again", timeout_s=DEADLINE_S) == "again"
    assert await calls.call("NVML's shutdown", lambda: "shut", alone=True) == "shut"


async def test_a_cancelled_call_still_hung_stays_in_flight(wedge: threading.Event) -> None:
    """A caller cancelled (the heartbeat's stop) leaves its call running in the driver: a
    shutdown is not tried beside it, and past the process deadline NVML is not answering."""
    calls = NvmlCalls(DEADLINE_S)
    task = asyncio.create_task(calls.call("the probe's read", wedge.wait, 30, timeout_s=10))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    with pytest.raises(NvmlHung, match="not tried beside the probe's read"):
        await calls.call("the probe's shutdown", lambda: None, alone=True)
    await until(lambda: calls.stuck() is not None, "the process deadline to pass")


async def test_a_late_undo_that_hangs_keeps_nvml_not_answering() -> None:
    calls = NvmlCalls(0.1)
    made, undoing, release = threading.Event(), threading.Event(), threading.Event()
    try:
        with pytest.raises(NvmlHung):
            await calls.call(
                "creating", lambda: made.wait(5) and "mig",
                undo=lambda _: (undoing.set(), release.wait(5)),
            )  # fmt: skip
        made.set()
        await until(undoing.is_set, "the late result's undo")
        await asyncio.sleep(0.15)
        assert calls.stuck() is not None  # the undo (a MIG destroy) hangs in the driver
    finally:
        made.set()
        release.set()
    await until(lambda: calls.stuck() is None, "the undo to return")


async def test_a_result_at_the_deadline_whose_caller_is_then_cancelled_is_undone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The call returns as its deadline fires, and a cancel lands while its answer is on the
    way: nobody takes the MIG instance, so it is undone (before: leaked)."""
    calls = NvmlCalls(5.0)
    undone: list[str] = []
    go = threading.Event()

    def makes() -> str:
        go.wait(5)
        return "mig-7"

    async def racy_wait_for(aw: Any, timeout: float) -> Any:
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().call_soon(task.cancel)  # a cancel in the same loop turn
        go.set()
        (thread,) = [t for t in threading.enumerate() if t.name == "nvml: creating"]
        thread.join(5)  # it returned: its answer queued to the loop
        aw.cancel()
        raise TimeoutError  # and the deadline fires in the same turn

    monkeypatch.setattr(asyncio, "wait_for", racy_wait_for)
    with pytest.raises(asyncio.CancelledError):
        await calls.call("creating", makes, undo=undone.append)
    monkeypatch.undo()
    await until(lambda: undone == ["mig-7"], "the unclaimed result to be undone")


async def test_stop_iteration_from_a_call_is_an_error_not_a_hang() -> None:
    calls = NvmlCalls(DEADLINE_S)

    def first_of_none() -> Any:
        return next(iter(()))

    async with asyncio.timeout(2):
        with pytest.raises(RuntimeError, match="StopIteration"):
            await calls.call("reading the GPUs", first_of_none)
