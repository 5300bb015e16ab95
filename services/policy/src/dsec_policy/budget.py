"""Run one validation in a child process with a time and a memory budget.

The parser is bounded (:mod:`dsec_core.spec.source`), but a validation is still user input
driving a lot of code (YAML, pydantic, the code analyzer on the bundle): a runaway must cost the
service one child process, never its own memory or its event loop. Children come from a
``forkserver`` (a clean, single-threaded process with the policy modules preloaded), so a fork
costs milliseconds and never copies the service's threads. Each child sets ``RLIMIT_AS`` to its
current size plus the budget before it starts, and is killed when the time is up.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_TIMEOUT_S = 20.0
DEFAULT_MEMORY_BYTES = 1024 * 1024 * 1024

_PRELOAD = ["dsec_rules.domain", "dsec_policy.budget"]


class BudgetExceeded(Exception):
    """The validation ran out of time or memory, or its process died; the reason says which."""


@dataclass(frozen=True)
class Budget:
    """How long and how much memory (beyond the child's size at start) one validation may use."""

    timeout_s: float = DEFAULT_TIMEOUT_S
    memory_bytes: int = DEFAULT_MEMORY_BYTES


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _vm_size() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _child(conn: Any, memory: int, fn: Callable[..., Any], args: tuple[Any, ...], kw: Any) -> None:
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_size() + memory
    resource.setrlimit(resource.RLIMIT_AS, (limit if hard < 0 else min(limit, hard), hard))
    try:
        result: tuple[str, Any] = ("ok", fn(*args, **kw))
    except MemoryError:
        result = ("memory", None)
    except RecursionError:
        result = ("error", "the input is nested too deeply")
    except Exception as exc:  # reported by type only: user input may be in the message
        result = ("error", type(exc).__name__)
    try:
        conn.send(result)
    except MemoryError:
        conn.send(("memory", None))
    conn.close()


def run_budgeted(
    fn: Callable[..., Any], *args: Any, budget: Budget | None = None, **kwargs: Any
) -> Any:
    """``fn(*args, **kwargs)`` in a child process (blocking; call from a worker thread).

    Raises:
        BudgetExceeded: the time or memory budget ran out, or the child failed.
    """
    budget = budget or Budget()
    ctx = _context()
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, budget.memory_bytes, fn, args, kwargs))
    proc.start()
    child.close()
    deadline = time.monotonic() + budget.timeout_s
    try:
        if not parent.poll(max(0.0, deadline - time.monotonic())):
            raise BudgetExceeded(f"validation took longer than {budget.timeout_s:g} s")
        try:
            status, value = parent.recv()
        except EOFError:
            raise BudgetExceeded("the validation process died") from None
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join(5)
        parent.close()
    if status == "memory":
        mib = budget.memory_bytes // (1024 * 1024)
        raise BudgetExceeded(f"validation needed more than {mib} MiB of memory")
    if status == "error":
        raise BudgetExceeded(f"validation failed: {value}")
    return value
