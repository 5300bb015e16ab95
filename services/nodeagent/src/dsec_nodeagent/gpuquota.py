"""The GPU memory quota watch of one unit (pure: fed readings, says what to do).

Each check the node agent reads NVML's per-process GPU memory
(``nvmlDeviceGetComputeRunningProcesses``: host pids) and sums it over the pids of the unit's
cgroup (:func:`usage_of`). :class:`QuotaWatch` then decides:

* at ``warn_pct`` of the quota: ``warn`` once (``policy.violation``, action ``log``), re-armed
  once the unit is back under;
* over the quota: ``warn`` (``over``) at once, then, still over ``grace_s`` later, ``stop``:
  the node agent publishes ``policy.violation`` (action ``deny``) and stops the unit, which ends
  in ``sandbox.exited{reason: gpu_memory}`` with the figures in its detail. Back under within
  the grace: nothing more happens.

So a unit that grows past its slice is stopped, by name, before the GPU runs out: its
neighbours never meet an out-of-memory error it caused.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

from dsec_nodeagent.gpuslice import ProcessUsage


def usage_of(processes: Iterable[ProcessUsage], pids: Iterable[int]) -> dict[int, int]:
    """GPU index -> bytes the given pids use there."""
    mine = set(pids)
    out: dict[int, int] = {}
    for p in processes:
        if p.pid in mine:
            out[p.gpu_index] = out.get(p.gpu_index, 0) + p.used_bytes
    return out


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclass(frozen=True, slots=True)
class Verdict:
    """What one check calls for."""

    action: Literal["warn", "over", "stop"]
    gpu_index: int
    used_bytes: int
    quota_bytes: int
    message: str


@dataclass
class QuotaWatch:
    """One unit's quota per GPU (``quotas``: GPU index -> bytes)."""

    quotas: dict[int, int]
    warn_pct: float = 90.0
    grace_s: float = 5.0
    _warned: bool = False
    _over_since: float | None = None
    stopped: bool = False

    def observe(self, now: float, usage: dict[int, int]) -> Verdict | None:
        """The verdict of a check at ``now`` (None: nothing to say)."""
        if self.stopped:
            return None
        worst: tuple[float, int, int, int] | None = None
        for index, quota in self.quotas.items():
            used = usage.get(index, 0)
            ratio = used / quota if quota else 0.0
            if worst is None or ratio > worst[0]:
                worst = (ratio, index, used, quota)
        if worst is None:
            return None
        ratio, index, used, quota = worst
        where = f"GPU {index}: {gib(used)} of its {gib(quota)} GPU memory quota"
        if ratio > 1.0:
            if self._over_since is None:
                self._over_since = now
                self._warned = True
                return Verdict(
                    "over", index, used, quota,
                    f"{where}: over it; stopped in {self.grace_s:g} s unless it frees memory",
                )  # fmt: skip
            if now - self._over_since >= self.grace_s:
                self.stopped = True
                return Verdict(
                    "stop", index, used, quota,
                    f"{where}: over it for {now - self._over_since:.1f} s; stopped so its "
                    "neighbours on the GPU keep their memory",
                )  # fmt: skip
            return None
        self._over_since = None
        if ratio * 100 >= self.warn_pct:
            if not self._warned:
                self._warned = True
                return Verdict("warn", index, used, quota, f"{where} ({ratio * 100:.0f} %)")
            return None
        self._warned = False
        return None
