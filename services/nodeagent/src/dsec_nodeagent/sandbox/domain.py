"""Pure decisions of the sandbox lifecycle: why it ended, which uid it gets, its start latency."""

from __future__ import annotations

import signal as _signal
from typing import Any

import blake3

from dsec_nodeagent.sandbox.models import ExitReason

UID_BASE = 200_000
UID_COUNT = 60_000

STAGE_ORDER = (
    "plan",
    "cgroup",
    "spawn",
    "fork",
    "cgroup_join",
    "namespaces",
    "mounts",
    "credentials",
    "landlock",
    "seccomp",
    "exec",
)


def classify_exit(
    requested: ExitReason | None,
    exit_code: int | None,
    signal: int | None,
    oom_kills: int,
    pids_limit_hits: int,
    disk_full: str | None = None,
) -> tuple[ExitReason, str]:
    """Decide the exit reason and a one-line detail a user can act on.

    A reason the node agent caused (``stopped``, ``timeout``, ``policy``) wins; then the kernel's
    own records (an OOM kill, a refused fork, a full disk quota: ``disk_full`` says which),
    then the exit status. A workload that filled its quota but still exited 0 handled the
    ``ENOSPC``: ``ok``, and the detail says the quota was full.
    """
    if requested is not None:
        return requested, f"{requested.value} by the node agent"
    if oom_kills > 0:
        return ExitReason.OOM, f"memory limit reached: the OOM killer ended {oom_kills} task(s)"
    if pids_limit_hits > 0 and exit_code != 0:
        return ExitReason.PIDS, f"pids limit reached: {pids_limit_hits} fork(s) refused"
    if disk_full is not None and exit_code != 0:
        return ExitReason.DISK, f"{disk_full}; the workload exited with code {exit_code}"
    if disk_full is not None:
        return ExitReason.OK, f"exited with code 0 ({disk_full})"
    if signal == _signal.SIGSYS:
        return ExitReason.POLICY, "killed by seccomp (a foreign-architecture system call)"
    if exit_code is None:
        return ExitReason.ERROR, "the sandbox ended without a recorded status"
    if signal is not None:
        return ExitReason.ERROR, f"killed by signal {_signal.Signals(signal).name}"
    if exit_code == 0:
        return ExitReason.OK, "exited with code 0"
    return ExitReason.ERROR, f"exited with code {exit_code}"


def log_truncation(logs: Any) -> dict[str, int]:
    """``{stream: bytes dropped}`` of the streams the supervisor had to cut (from exit.json)."""
    if not isinstance(logs, dict):
        return {}
    return {
        name: int(info["dropped"])
        for name, info in sorted(logs.items())
        if isinstance(info, dict) and int(info.get("dropped", 0)) > 0
    }


def describe_truncation(dropped: dict[str, int]) -> str:
    """One clause for the exit detail: which log lost how much (the middle of the output)."""
    parts = [f"{name} {count} bytes" for name, count in dropped.items()]
    return (
        "output larger than resources.log_bytes; the middle was dropped from the log: "
        + ", ".join(parts)
    )


def allocate_uid(
    sandbox_id: str, in_use: set[int], base: int = UID_BASE, count: int = UID_COUNT
) -> int:
    """A per-sandbox uid (so no two sandboxes share file or signal permissions).

    Deterministic start from the id's hash, then the next free one.

    Raises:
        RuntimeError: every uid of the range is in use.
    """
    start = int.from_bytes(blake3.blake3(sandbox_id.encode()).digest()[:4], "big") % count
    for offset in range(count):
        uid = base + (start + offset) % count
        if uid not in in_use:
            return uid
    raise RuntimeError(f"no free sandbox uid in [{base}, {base + count})")


def stage_timings(
    t0_ns: int, host_marks: dict[str, int], records: list[dict[str, Any]], ready_ns: int
) -> dict[str, float]:
    """Per-layer milliseconds from the manager's marks and the child's stage records.

    Args:
        t0_ns: launch call start (``time.monotonic_ns``).
        host_marks: ``{"plan": end_ns, "cgroup": end_ns, "spawn_start": ns}`` from the manager,
            and ``"cgroup_start"`` when the hook on the cgroups (the node agent's egress
            programs) ran after the plan's hand-over.
        records: the child's ``{"stage", "start_ns", "end_ns"}`` lines.
        ready_ns: when the report pipe closed (``execve`` succeeded).
    """
    out = {"plan": (host_marks["plan"] - t0_ns) / 1e6}
    if "cgroup_start" in host_marks:
        # The hook ran while the sandbox's init binds its root view, after the hand-over: the
        # host's own preparation before it (state, directories, decision channel, the cgroups
        # themselves) counts here too.
        host = host_marks["spawn_start"] - host_marks["plan"]
        out["cgroup"] = (host + host_marks["cgroup"] - host_marks["cgroup_start"]) / 1e6
    else:
        out["cgroup"] = (host_marks["cgroup"] - host_marks["plan"]) / 1e6
    for record in records:
        name = record.get("stage")
        if name == "spawn":
            out["spawn"] = (record["end_ns"] - host_marks["spawn_start"]) / 1e6
        elif name == "exec":
            out["exec"] = (ready_ns - record["start_ns"]) / 1e6
        elif name in STAGE_ORDER and "end_ns" in record:  # a stage done in parts: their sum
            out[name] = out.get(name, 0.0) + (record["end_ns"] - record["start_ns"]) / 1e6
    return {k: round(out[k], 3) for k in STAGE_ORDER if k in out}
