"""The snapshot store's thread pools take turns between snapshots (dsec_snapstore.fairpool):
a small snapshot's tasks do not wait behind every task large ones queued before it."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import pytest

from dsec_snapstore.fairpool import FairExecutor

pytestmark = pytest.mark.unit


def _hold(pool: FairExecutor) -> tuple[threading.Event, Future[bool]]:
    """Occupy one of the pool's threads until the event is set (running when this returns)."""
    started, gate = threading.Event(), threading.Event()

    def held() -> bool:
        started.set()
        return gate.wait(10)

    future = pool.submit(held)
    assert started.wait(10)
    return gate, future


def _in_thread(fn: object) -> None:
    worker = threading.Thread(target=fn)  # type: ignore[arg-type]
    worker.start()
    worker.join()


def test_each_submitting_thread_gets_its_turn() -> None:
    pool = FairExecutor(1)
    order: list[str] = []
    gate, first = _hold(pool)  # the pool's one thread
    big = [pool.submit(order.append, f"big{i}") for i in range(5)]
    small: list[Future[None]] = []
    _in_thread(lambda: small.append(pool.submit(order.append, "small")))
    gate.set()
    for future in (first, *big, *small):
        future.result(10)
    # FIFO would put the small one last; it runs right after the big one's first task
    assert order == ["big0", "small", "big1", "big2", "big3", "big4"]
    pool.shutdown()


def test_a_queue_is_one_whichever_thread_submits() -> None:
    pool = FairExecutor(1)
    order: list[str] = []
    gate, _ = _hold(pool)
    uploads = pool.queue()
    for i in range(3):
        _in_thread(lambda i=i: uploads.submit(order.append, f"upload{i}"))
    done = [pool.submit(order.append, f"mine{i}") for i in range(2)]
    gate.set()
    for future in done:
        future.result(10)
    pool.shutdown()
    assert order == ["upload0", "mine0", "upload1", "mine1", "upload2"]


def test_errors_reach_the_caller_and_the_threads_go_on() -> None:
    pool = FairExecutor(2)
    failing = pool.submit(int, "not a number")
    with pytest.raises(ValueError, match="not a number"):
        failing.result(10)
    assert list(pool.map(lambda x: x * 2, range(20))) == [x * 2 for x in range(20)]
    pool.shutdown()


def test_shutdown_waits_for_the_queued_or_cancels_them() -> None:
    pool = FairExecutor(1)
    gate, _ = _hold(pool)
    queued = [pool.submit(lambda: "ran") for _ in range(3)]
    gate.set()
    pool.shutdown(wait=True)
    assert [f.result(0) for f in queued] == ["ran"] * 3
    with pytest.raises(RuntimeError, match="after shutdown"):
        pool.submit(print)

    pool = FairExecutor(1)
    gate, running = _hold(pool)
    dropped = pool.submit(lambda: "ran")
    pool.shutdown(wait=False, cancel_futures=True)
    assert dropped.cancelled()
    gate.set()
    assert running.result(10) is True
    for worker in pool._threads:
        worker.join(10)
        assert not worker.is_alive()


def test_a_pool_dropped_without_shutdown_lets_its_threads_end() -> None:
    import gc

    pool = FairExecutor(2)
    assert pool.submit(lambda: 1).result(10) == 1
    threads = list(pool._threads)
    del pool
    gc.collect()
    for worker in threads:
        worker.join(10)
        assert not worker.is_alive()


def test_a_thread_that_cannot_start_loses_no_task(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = FairExecutor(1)

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    with pytest.raises(RuntimeError, match="can't start"):
        pool.submit(lambda: 1)
    monkeypatch.undo()
    assert pool.submit(lambda: 2).result(10) == 2  # nothing queued behind a dead thread
    pool.shutdown()


def test_snapshots_interleaved_in_threads_leave_the_gc_as_it_was(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two creates at once, each pausing the GC (``dsec_snapstore.store._no_gc``): once both
    ended it is on again. Before, the second could read "off" (the first inside), the first
    then turned it back on, and the second turned it off and, having read "off", never on."""
    import gc

    from dsec_snapstore import store as store_module

    assert gc.isenabled()
    second_started, first_out = threading.Event(), threading.Event()

    class Gc:  # the real GC; the second's read of it returns once the first is out
        enable, disable = staticmethod(gc.enable), staticmethod(gc.disable)

        @staticmethod
        def isenabled() -> bool:
            enabled = gc.isenabled()
            if threading.current_thread().name == "second":
                assert first_out.wait(10)
            return enabled

    monkeypatch.setattr(store_module, "gc", Gc)

    def first() -> None:
        with store_module._no_gc():
            assert second_started.wait(10)
        first_out.set()

    def second() -> None:
        second_started.set()
        with store_module._no_gc():
            assert first_out.wait(10)

    threads = [threading.Thread(target=first), threading.Thread(target=second, name="second")]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert gc.isenabled()
    finally:
        gc.enable()


def test_a_gc_pause_kept_up_by_overlapping_snapshots_still_collects(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dsec_snapstore import store as store_module

    collected: list[int] = []
    monkeypatch.setattr(store_module, "NO_GC_MAX_S", 0.0)
    monkeypatch.setattr(store_module.gc, "collect", lambda *a: collected.append(1) or 0)
    with store_module._no_gc(), store_module._no_gc():  # a second one in the first's pause
        pass
    assert collected == [1]


def test_a_thread_that_cannot_start_beside_running_ones_is_no_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pool = FairExecutor(2)
    assert pool.submit(lambda: 1).result(10) == 1

    def no_thread(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    assert pool.submit(lambda: 2).result(10) == 2  # the running thread takes it
    monkeypatch.undo()
    pool.shutdown()
