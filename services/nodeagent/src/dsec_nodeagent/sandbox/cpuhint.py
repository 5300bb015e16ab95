"""Scheduling hints on a sandbox's start path: keep two busy processes off one CPU.

On the project's 2-vCPU VM (kernel 6.18, KVM) a process woken by another that keeps running is
mostly queued on the waker's CPU, behind it, while the other CPU idles: it waited until the
waker slept or the next balancing tick (a pipe wake-up measured 0.06-2 ms; pinned to the idle
CPU, 0.11 ms). A start has three such moments: the node agent wakes the sandbox's init and goes
on planning, init wakes the workload's process with its plan and goes on binding the root view
(both :func:`elsewhere`), and the workload's ``execve`` wakes the node agent, whose bookkeeping
then ran on the CPU of the workload's first milliseconds (:func:`leave_cpu_of`).

Both only move a process between the CPUs it may use already and restore its mask at once;
where a call fails (no ``sched_getcpu``, one CPU, a process gone) nothing happens.
"""

from __future__ import annotations

import os

# (standard library and ctypes only: init imports this module, and every import of the
# pre-exec stage is start-up latency)
from dsec_nodeagent.sandbox import syscalls


def elsewhere(pid: int) -> None:
    """Keep ``pid`` off the CPU this process runs on until it widens its own mask again.

    For init, right before the node agent wakes it and goes on planning, and for the
    workload's process, right before init hands it the plan and goes on binding: each widens
    its mask back to the one it was forked with as it wakes (:func:`.init._init_main`,
    :func:`.init._fork_early`), so nothing of the sandbox keeps it. The caller must know that
    ``pid`` is still the process it means (init: the child of a live supervisor, which reaps
    it only after the hand-over; the workload's process: init's child, not reaped yet)."""
    cpus = os.sched_getaffinity(0)
    here = syscalls.current_cpu()
    if len(cpus) < 2 or here not in cpus:
        return
    os.sched_setaffinity(pid, cpus - {here})


def leave_cpu_of(init_pid: int) -> None:
    """Move this process off the CPU the workload of the sandbox whose init is ``init_pid``
    last ran on, if it is this one (its mask restored at once: the move has happened)."""
    try:
        with open(f"/proc/{init_pid}/task/{init_pid}/children", "rb") as fh:
            children = fh.read().split()
        # The workload, and perhaps the process that started it, ending (init's child too
        # for a moment: the later one is the workload); more: not the moment this is for.
        if not 1 <= len(children) <= 2:
            return
        latest = (-1, -1, -1)  # (start time in ticks, pid: a tie's later one, CPU)
        for child in children:
            with open(f"/proc/{int(child)}/stat", "rb") as fh:
                # after the command's closing parenthesis: field 3 on ("state"); "starttime"
                # is field 22, "processor" field 39
                fields = fh.read().rsplit(b")", 1)[1].split()
            if fields[0] not in (b"Z", b"X"):
                latest = max(latest, (int(fields[19]), int(child), int(fields[36])))
        cpu = latest[2]
    except (OSError, ValueError, IndexError):
        return
    if cpu < 0:
        return
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2 or cpu != syscalls.current_cpu() or cpu not in cpus:
        return
    os.sched_setaffinity(0, cpus - {cpu})
    os.sched_setaffinity(0, cpus)
