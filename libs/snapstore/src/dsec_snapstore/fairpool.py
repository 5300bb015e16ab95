"""A thread pool that takes turns between the threads that submit to it.

The snapshot store's CPU work (hashing, compressing, decompressing, checking) runs on a few
threads, one per core. A create cuts its tree into a few runs per thread and submits them all at
once; with :class:`concurrent.futures.ThreadPoolExecutor` (one FIFO queue) a small snapshot
submitted while three large ones run waited for every run they had queued before it. Here each
submitting thread has its own queue, and the pool's threads take one task from each queue in
turn: the small snapshot's runs start after at most one task of each other snapshot.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Executor, Future
from typing import Any, ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

_Task = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class _Queues:
    """What the worker threads share (not the executor: one dropped without ``shutdown`` is
    collected, and its threads then end once its queues are empty)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.queues: OrderedDict[Hashable, deque[_Task]] = OrderedDict()
        self.closed = False

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify_all()

    def next(self) -> _Task | None:
        """The next task: the first queue's head, that queue moved to the back (None: closed
        and nothing left)."""
        with self.cv:
            while not self.queues:
                if self.closed:
                    return None
                self.cv.wait()
            key, queue = next(iter(self.queues.items()))
            task = queue.popleft()
            if queue:
                self.queues.move_to_end(key)
            else:
                del self.queues[key]
            return task

    def work(self) -> None:
        while (task := self.next()) is not None:
            future, fn, args, kwargs = task
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)
            del task, future, fn, args, kwargs  # (no reference kept while it waits)


class FairExecutor(Executor):
    """``threads`` worker threads; tasks are queued per submitting thread and taken round-robin
    across those queues (FIFO within one). Threads start with the first tasks."""

    def __init__(self, threads: int, name: str = "fair") -> None:
        if threads < 1:
            raise ValueError("threads must be at least 1")
        self._size = threads
        self._name = name
        self._shared = _Queues()
        self._threads: list[threading.Thread] = []
        weakref.finalize(self, self._shared.close)

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        """``fn(*args, **kwargs)`` in the queue of the calling thread."""
        return self._submit(threading.get_ident(), fn, args, kwargs)

    def queue(self) -> Executor:
        """An executor whose tasks share one queue of their own, whichever thread submits them
        (a snapshot's pack uploads, submitted by the pool's hashing threads)."""
        return _Queue(self, object())

    def _submit(
        self, key: Hashable, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Future[T]:
        future: Future[T] = Future()
        shared = self._shared
        with shared.cv:
            if shared.closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            if len(self._threads) < self._size:
                worker = threading.Thread(
                    target=shared.work, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                try:
                    worker.start()  # (before the task is queued: a failed start loses none)
                except RuntimeError:
                    if not self._threads:  # no thread would ever run it
                        raise
                else:
                    self._threads.append(worker)
            queue = shared.queues.get(key)
            if queue is None:
                queue = shared.queues[key] = deque()
            queue.append((future, fn, args, kwargs))
            shared.cv.notify()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        shared = self._shared
        with shared.cv:  # (closed first: a submit meanwhile is refused, not left behind)
            shared.closed = True
            if cancel_futures:
                for queue in shared.queues.values():
                    for future, *_ in queue:
                        future.cancel()
                shared.queues.clear()
            shared.cv.notify_all()
            threads = list(self._threads)
        if wait:
            for worker in threads:
                if worker is not threading.current_thread():
                    worker.join()


class _Queue(Executor):
    """One queue of a :class:`FairExecutor` (see :meth:`FairExecutor.queue`); its shutdown is
    the pool's owner's."""

    def __init__(self, pool: FairExecutor, key: Hashable) -> None:
        self._pool = pool
        self._key = key

    def submit(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> Future[T]:
        return self._pool._submit(self._key, fn, args, kwargs)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass
