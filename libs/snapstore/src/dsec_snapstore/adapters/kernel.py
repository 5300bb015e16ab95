"""Key kernel parameters of the node (a ``/proc/sys/kernel`` subset)."""

from __future__ import annotations

from pathlib import Path

KERNEL_PARAMS: tuple[str, ...] = (
    "osrelease",
    "ostype",
    "version",
    "pid_max",
    "threads-max",
    "randomize_va_space",
    "kptr_restrict",
    "dmesg_restrict",
    "perf_event_paranoid",
    "unprivileged_bpf_disabled",
    "unprivileged_userns_clone",
    "yama/ptrace_scope",
    "io_uring_disabled",
    "core_pattern",
    "numa_balancing",
    "sched_autogroup_enabled",
    "shmmax",
    "shmall",
    "shmmni",
    "msgmax",
    "sem",
    "panic_on_oops",
    "sysrq",
    "tainted",
)
"""Parameters that change what an agent's code can do or how it performs."""


def read_kernel_params(
    root: Path = Path("/proc/sys/kernel"), names: tuple[str, ...] = KERNEL_PARAMS
) -> dict[str, str]:
    """Return the parameters that exist here (missing or unreadable ones are left out)."""
    out: dict[str, str] = {}
    for name in names:
        try:
            out[name] = " ".join((root / name).read_text().split())
        except OSError:
            continue
    return out
