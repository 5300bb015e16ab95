"""Scheduling hints on a sandbox's start path: keep two busy processes off one CPU.

On the project's 2-vCPU VM (kernel 6.18, KVM) a process woken by another that keeps running is
mostly queued on the waker's CPU, behind it, while the other CPU idles: it waited until the
waker slept or the next balancing tick (a pipe wake-up measured 0.06-2 ms; pinned to the idle
CPU, 0.11 ms). A start has two such moments: the node agent wakes the sandbox's init and goes
on planning (:func:`elsewhere`), and the workload's ``execve`` wakes the node agent, whose
bookkeeping then ran on the CPU of the workload's first milliseconds (:func:`leave_cpu_of`).

Both only move a process between the CPUs it may use already and restore its mask at once;
where a call fails (no ``sched_getcpu``, one CPU, a process gone) nothing happens.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from typing import cast


def _libc_sched_getcpu() -> Callable[[], int] | None:
    try:
        getcpu = ctypes.CDLL(None, use_errno=True).sched_getcpu
    except (OSError, AttributeError):  # not glibc/musl: no hints
        return None
    getcpu.argtypes = []
    getcpu.restype = ctypes.c_int
    return cast("Callable[[], int]", getcpu)


_sched_getcpu = _libc_sched_getcpu()


def elsewhere(pid: int) -> None:
    """Keep ``pid`` off the CPU this process runs on until it widens its own mask again.

    For init, right before the node agent wakes it and goes on planning: init widens its mask
    back to the one it was forked with before it does anything else
    (:func:`.init._init_main`), so nothing of the sandbox keeps it. The caller must know that
    ``pid`` is still the process it means (init: the child of a live supervisor, which reaps
    it only after the hand-over)."""
    if _sched_getcpu is None:
        return
    cpus = os.sched_getaffinity(0)
    here = _sched_getcpu()
    if len(cpus) < 2 or here not in cpus:
        return
    os.sched_setaffinity(pid, cpus - {here})


def leave_cpu_of(init_pid: int) -> None:
    """Move this process off the CPU the workload of the sandbox whose init is ``init_pid``
    last ran on, if it is this one (its mask restored at once: the move has happened)."""
    if _sched_getcpu is None:
        return
    try:
        with open(f"/proc/{init_pid}/task/{init_pid}/children", "rb") as fh:
            children = fh.read().split()
        if len(children) != 1:  # the workload only, else not the moment this is for
            return
        with open(f"/proc/{int(children[0])}/stat", "rb") as fh:
            # after the command's closing parenthesis: field 3 on; "processor" is field 39
            cpu = int(fh.read().rsplit(b")", 1)[1].split()[36])
    except (OSError, ValueError, IndexError):
        return
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2 or cpu != _sched_getcpu() or cpu not in cpus:
        return
    os.sched_setaffinity(0, cpus - {cpu})
    os.sched_setaffinity(0, cpus)
