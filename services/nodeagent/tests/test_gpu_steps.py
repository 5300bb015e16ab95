"""A GPU's MPS daemon and MIG instances stay in step with the units that use them when units
start and end at once, and when a start is cancelled mid-step (pure unit tests: the MPS control
program is a small script with the real one's one-daemon-per-pipe-directory rule, NVML a fake).

Before: two first units of a GPU at once both ran ``nvidia-cuda-mps-control -d`` (the second
failed, and its unit with it); a last unit's release beside a new unit's start let the quit land
after the start; a start cancelled while the daemon started left it running unknown to the node
(the next unit's start then failed); a MIG instance created while a cancel landed was never
destroyed.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from dsec_core import events
from dsec_core.gpuhealth import ClusterConfig
from dsec_core.settings import Settings

from dsec_nodeagent import gpuenforce
from dsec_nodeagent.gpuenforce import MpsServers
from dsec_nodeagent.gpunode import GpuNode, UnitGpu
from dsec_nodeagent.gpuslice import (
    DeviceInfo,
    GpuGrant,
    MigProfile,
    ProcessUsage,
    SliceError,
    SlicePlan,
)

pytestmark = pytest.mark.unit
GIB = 2**30

# The real control program refuses a second daemon on one pipe directory, where it creates its
# ``control`` pipe; ``quit`` ends it a while after it is read (longer than a start takes).
# ``mkdir`` makes "is one running" atomic, as the real pipe's lock is.
FAKE_CONTROL = """#!/bin/sh
dir="$CUDA_MPS_PIPE_DIRECTORY/.."
mode=$(cat "$dir/mode" 2>/dev/null)
if [ "$1" = "-d" ]; then
  echo starting >> "$dir/calls"
  [ "$mode" = hang ] && exec sleep 60
  pipe="$CUDA_MPS_PIPE_DIRECTORY/control"
  [ "$mode" = started-then-hang ] && mkdir "$dir/daemon" && touch "$pipe" && exec sleep 60
  sleep 0.1
  mkdir "$dir/daemon" 2>/dev/null || exit 1
  touch "$pipe"
  echo started >> "$dir/calls"
  exit 0
fi
read cmd
echo "$cmd" >> "$dir/calls"
[ "$mode" = fail-quit ] && exit 1
sleep 0.3
[ "$cmd" = quit ] && rmdir "$dir/daemon" && rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"
exit 0
"""


async def wait_until_async(check: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


def _servers(tmp_path: Path) -> MpsServers:
    control = tmp_path / "mps-control"
    control.write_text(FAKE_CONTROL)
    control.chmod(0o755)
    return MpsServers(tmp_path / "mps", binary=str(control))


def _calls(servers: MpsServers, uuid: str) -> list[str]:
    path = servers.root / uuid / "calls"
    return path.read_text().split() if path.exists() else []


def _daemon_runs(servers: MpsServers, uuid: str) -> bool:
    return (servers.root / uuid / "daemon").is_dir()


async def test_two_first_units_of_a_gpu_at_once_share_one_daemon(tmp_path: Path) -> None:
    servers = _servers(tmp_path)
    await asyncio.gather(servers.acquire("GPU-0", "sbx_a"), servers.acquire("GPU-0", "sbx_b"))
    assert _calls(servers, "GPU-0") == ["starting", "started"]
    assert servers.users == {"GPU-0": {"sbx_a", "sbx_b"}} and _daemon_runs(servers, "GPU-0")
    await servers.release("GPU-0", "sbx_a")
    assert _daemon_runs(servers, "GPU-0")  # sbx_b still uses it
    await servers.release("GPU-0", "sbx_b")
    assert not _daemon_runs(servers, "GPU-0") and servers.users == {}


async def test_the_last_units_release_beside_a_new_units_start_leaves_the_daemon_running(
    tmp_path: Path,
) -> None:
    servers = _servers(tmp_path)
    await servers.acquire("GPU-0", "sbx_a")
    await asyncio.gather(servers.release("GPU-0", "sbx_a"), servers.acquire("GPU-0", "sbx_b"))
    assert _calls(servers, "GPU-0") == ["starting", "started", "quit", "starting", "started"]
    assert servers.users == {"GPU-0": {"sbx_b"}} and _daemon_runs(servers, "GPU-0")


async def test_a_start_cancelled_while_its_daemon_starts_leaves_it_known(tmp_path: Path) -> None:
    servers = _servers(tmp_path)
    first = asyncio.create_task(servers.acquire("GPU-0", "sbx_a"))
    await wait_until_async(lambda: _calls(servers, "GPU-0") == ["starting"], what="-d running")
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    # The daemon did start; the node knows it, and no unit holds it.
    assert _daemon_runs(servers, "GPU-0") and servers.running == {"GPU-0"}
    assert servers.users == {}
    await servers.acquire("GPU-0", "sbx_b")  # uses it: no second -d
    assert _calls(servers, "GPU-0") == ["starting", "started"]
    await servers.release("GPU-0", "sbx_b")
    assert not _daemon_runs(servers, "GPU-0")

    again = asyncio.create_task(servers.acquire("GPU-1", "sbx_c"))
    await wait_until_async(lambda: _calls(servers, "GPU-1") == ["starting"], what="-d running")
    again.cancel()
    with pytest.raises(asyncio.CancelledError):
        await again
    await servers.close()  # the node's stop quits a daemon no unit holds
    assert not _daemon_runs(servers, "GPU-1") and servers.running == set()


def _mode(servers: MpsServers, uuid: str, mode: str) -> None:
    (servers.root / uuid).mkdir(parents=True, exist_ok=True)
    (servers.root / uuid / "mode").write_text(mode)


@pytest.mark.parametrize("mode", ["hang", "started-then-hang"])
async def test_a_hung_control_program_is_killed_and_holds_the_gpu_no_longer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """A start or quit runs to its end even for a cancelled caller, and holds its GPU's lock:
    one that hangs (a wedged driver) is killed after MPS_CONTROL_TIMEOUT_S, so the GPU's next
    unit, and the node agent's stop, are not held for good. One killed after its daemon had
    started leaves a daemon the node does not know: the next unit uses it."""
    monkeypatch.setattr(gpuenforce, "MPS_CONTROL_TIMEOUT_S", 0.5)
    servers = _servers(tmp_path)
    _mode(servers, "GPU-0", mode)
    with pytest.raises(RuntimeError, match=r"did not end within 0\.5 s; killed"):
        await servers.acquire("GPU-0", "sbx_a")
    assert servers.users == {} and servers.running == set()
    _mode(servers, "GPU-0", "")
    async with asyncio.timeout(5):
        await servers.acquire("GPU-0", "sbx_b")  # the lock is free again
    assert _daemon_runs(servers, "GPU-0") and servers.users == {"GPU-0": {"sbx_b"}}
    await servers.release("GPU-0", "sbx_b")
    assert not _daemon_runs(servers, "GPU-0")


async def test_a_daemon_the_node_did_not_start_is_used_never_quit(tmp_path: Path) -> None:
    """A quit that fails most often means the daemon died (a unit would get a dead pipe if it
    were still counted as running); one that is in fact still there, or one an earlier node
    agent left serving the sandboxes it re-adopted, makes the next ``-d`` fail: the next unit
    uses it, and nothing tells it to quit under its clients. The node agent's stop logs a
    failing quit and goes on (``GpuNode.stop`` closes NVML whatever happens)."""
    servers = _servers(tmp_path)
    await servers.acquire("GPU-0", "sbx_a")
    _mode(servers, "GPU-0", "fail-quit")
    with pytest.raises(RuntimeError, match="quit for GPU-0 exited 1"):
        await servers.release("GPU-0", "sbx_a")
    assert _daemon_runs(servers, "GPU-0") and servers.running == set()
    _mode(servers, "GPU-0", "")
    await servers.acquire("GPU-0", "sbx_b")
    assert _calls(servers, "GPU-0") == ["starting", "started", "quit", "starting"]
    assert servers.users == {"GPU-0": {"sbx_b"}} and _daemon_runs(servers, "GPU-0")

    earlier = _servers(tmp_path)  # a node agent restarted: it knows of no daemon
    await earlier.acquire("GPU-0", "sbx_readopted")
    # its -d failed, and the daemon serving the GPU was used, not told to quit
    assert _calls(earlier, "GPU-0") == ["starting", "started", "quit", "starting", "starting"]
    assert _daemon_runs(earlier, "GPU-0")

    closed: list[bool] = []
    node = _gpu_node(tmp_path, MigNvml(), servers)
    node.backend.close = lambda: closed.append(True)  # type: ignore[method-assign]
    await servers.release("GPU-0", "sbx_b")
    await servers.acquire("GPU-1", "sbx_c")
    await servers.acquire("GPU-0", "sbx_d")
    servers.users.clear()  # both unheld at the stop: close() quits them
    _mode(servers, "GPU-0", "fail-quit")
    await node.stop()
    assert closed == [True] and not _daemon_runs(servers, "GPU-1")


async def test_a_release_cancelled_while_it_waits_leaves_no_holder(tmp_path: Path) -> None:
    """The node agent's stop may cancel a unit's release while another unit of its GPU holds
    the GPU's lock: the release still ends, and the last unit's release quits the daemon."""
    node = _gpu_node(tmp_path, MigNvml(), _servers(tmp_path))
    servers = node.mps
    await servers.acquire("GPU-0", "sbx_1")
    node.units["sbx_1"] = UnitGpu("sbx_1", _mps_plan("GPU-0"), holder="sbx_1")
    waiting = asyncio.create_task(servers.acquire("GPU-0", "sbx_2"))  # holds nothing yet
    async with servers._lock("GPU-0"):  # another unit's step holds the GPU
        release = asyncio.create_task(node.release("sbx_1"))
        await asyncio.sleep(0.01)
        release.cancel()
    with pytest.raises(asyncio.CancelledError):
        await release
    await waiting
    assert servers.users == {"GPU-0": {"sbx_2"}}
    await servers.release("GPU-0", "sbx_2")
    assert servers.users == {} and not _daemon_runs(servers, "GPU-0")


@dataclass
class MigNvml:
    """One MIG-enabled GPU; creating an instance waits for the test."""

    go: threading.Event = field(default_factory=threading.Event)
    creating: threading.Event = field(default_factory=threading.Event)
    created: list[tuple[int, int]] = field(default_factory=list)
    destroyed: list[tuple[int, int]] = field(default_factory=list)

    def devices(self) -> list[DeviceInfo]:
        profile = MigProfile(profile_id=19, name="1g.10gb", slices=1, memory_bytes=10 * GIB, free=7)
        return [DeviceInfo(0, "GPU-0", 0, 80 * GIB, True, True, (profile,))]

    def processes(self) -> list[ProcessUsage]:
        return []

    def create_mig(self, index: int, profile: MigProfile) -> tuple[str, Any, Any]:
        self.creating.set()
        assert self.go.wait(10)
        self.created.append((7, 0))
        return "MIG-7", 7, 0

    def mig_ids(self, gi: Any, ci: Any) -> tuple[int, int]:
        return gi, ci

    def destroy_mig(self, gi: Any, ci: Any) -> None:
        self.destroyed.append((gi, ci))

    def close(self) -> None:
        pass


@pytest.mark.parametrize("stop_first", [False, True])
async def test_a_mig_instance_created_while_its_start_is_cancelled_is_destroyed(
    tmp_path: Path, stop_first: bool
) -> None:
    """NVML creates the instance while the cancel lands; ``stop_first``: the node agent's stop
    has released every unit it knows meanwhile (what ``GpuNode.stop`` does), the start being
    one it abandoned. Either way the start's unwind destroys the instance."""
    nvml = MigNvml()
    node = _gpu_node(tmp_path, nvml, MpsServers(tmp_path / "mps", binary=None))
    node.config = ClusterConfig.of({"gpu.mig": "on"})
    placed = events.UnitPlaced(
        sandbox_id="sbx_1", unit="main", node_id="gpu-1", gpu_indices=[0], gpu_milli=100,
        policy="dsec",
    )  # fmt: skip
    start = asyncio.create_task(node.prepare("sbx_1", placed))
    await wait_until_async(nvml.creating.is_set, what="NVML creating the instance")
    if stop_first:
        for sid in list(node.units):
            await node.release(sid)
    start.cancel()
    await asyncio.sleep(0)  # the cancel is delivered while NVML still works
    nvml.go.set()
    with pytest.raises(asyncio.CancelledError):
        await start
    assert nvml.created == [(7, 0)] and nvml.destroyed == [(7, 0)]
    assert node.units == {}


async def _no_publish(*_: Any) -> None:
    raise AssertionError("nothing is published")


def _gpu_node(tmp_path: Path, nvml: Any, servers: MpsServers) -> GpuNode:
    return GpuNode(
        Settings(home=tmp_path, node_id="gpu-1"), _no_publish, lambda: None,  # type: ignore[arg-type, return-value]
        backend=nvml, mps=servers,
    )  # fmt: skip


def _mps_plan(uuid: str) -> SlicePlan:
    grant = GpuGrant(index=0, uuid=uuid, minor=0, mode="mps", memory_quota_bytes=GIB)
    return SlicePlan((grant,), 250)


# --------------------------------------------------------------------------- a restart


@dataclass
class TwoGpus:
    """GPU 0 MIG-enabled, GPU 1 shared by MPS; NVML finds an instance again by its ids."""

    created: list[tuple[int, int]] = field(default_factory=list)
    destroyed: list[tuple[int, int]] = field(default_factory=list)
    found: list[tuple[int, int, int]] = field(default_factory=list)
    reused: dict[tuple[int, int], str] = field(default_factory=dict)
    """Ids NVML gave to a new instance (its uuid) after the recorded one was destroyed."""

    def devices(self) -> list[DeviceInfo]:
        profile = MigProfile(profile_id=19, name="1g.10gb", slices=1, memory_bytes=10 * GIB, free=7)
        return [
            DeviceInfo(0, "GPU-0", 0, 80 * GIB, True, True, (profile,)),
            DeviceInfo(1, "GPU-1", 1, 80 * GIB),
        ]

    def processes(self) -> list[ProcessUsage]:
        return []

    def create_mig(self, index: int, profile: MigProfile) -> tuple[str, Any, Any]:
        gi = 7 + len(self.created)
        self.created.append((gi, 0))
        return f"MIG-{gi}", ("gi", gi), ("ci", gi, 0)

    def mig_ids(self, gi: Any, ci: Any) -> tuple[int, int]:
        return gi[1], ci[2]

    def mig_by_ids(self, index: int, gi_id: int, ci_id: int) -> tuple[Any, Any, str] | None:
        self.found.append((index, gi_id, ci_id))
        if (gi_id, ci_id) in self.destroyed and (gi_id, ci_id) not in self.reused:
            return None
        return ("gi", gi_id), ("ci", gi_id, ci_id), self.reused.get((gi_id, ci_id), f"MIG-{gi_id}")

    def destroy_mig(self, gi: Any, ci: Any) -> None:
        self.destroyed.append((gi[1], ci[2]))

    def close(self) -> None:
        pass


def _placed(sid: str, index: int, milli: int) -> events.UnitPlaced:
    return events.UnitPlaced(
        sandbox_id=sid, unit="main", node_id="gpu-1", gpu_indices=[index], gpu_milli=milli,
        policy="dsec",
    )  # fmt: skip


def _cgroup(tmp_path: Path, sid: str, running: bool) -> Path:
    """A unit's cgroup as ``GpuNode`` reads it (its ``cgroup.procs``)."""
    cgroup = tmp_path / "cgroup" / sid
    cgroup.mkdir(parents=True, exist_ok=True)
    (cgroup / "cgroup.procs").write_text("4242\n" if running else "")
    return cgroup


async def _node_with_units(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, nvml: TwoGpus
) -> GpuNode:
    """A node agent's GPU side with two running units (one MIG, one MPS) and one whose start
    prepared its slice and never launched."""
    monkeypatch.setattr("dsec_nodeagent.gpunode.attach_device_guard", lambda *_: None)
    node = _gpu_node(tmp_path, nvml, _servers(tmp_path))
    node.config = ClusterConfig.of({"gpu.mig": "on", "gpu.mps": "on"})
    await node.prepare("sbx_mig", _placed("sbx_mig", 0, 100))
    await node.prepare("sbx_mps", _placed("sbx_mps", 1, 250))
    await node.prepare("sbx_unlaunched", _placed("sbx_unlaunched", 1, 250))
    for sid in ("sbx_mig", "sbx_mps"):
        await node.attach(sid, _cgroup(tmp_path, sid, running=True))
    return node


def _recorded(node: GpuNode) -> list[str]:
    """The sandboxes with a GPU slice record (``<sandbox id>.<holder>.json``)."""
    return sorted(p.name.split(".")[0] for p in node.records.glob("*.json"))


def _restarted(tmp_path: Path, nvml: TwoGpus) -> GpuNode:
    """The next node agent's GPU side: same home, nothing in memory."""
    node = _gpu_node(tmp_path, nvml, _servers(tmp_path))
    node.config = ClusterConfig.of({"gpu.mig": "on", "gpu.mps": "on"})
    return node


async def test_a_unit_that_outlives_its_node_agent_keeps_its_slice_and_the_next_takes_it_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain restart (the node agent stops, its sandboxes run on): before, its stop released
    every unit, telling the MPS daemon to quit and destroying the MIG instance under units that
    went on running, and the next node agent knew of neither. Now the running units keep them,
    and the next node agent watches their memory and undoes their slices at their exit."""
    nvml = TwoGpus()
    node = await _node_with_units(tmp_path, monkeypatch, nvml)
    servers = node.mps
    node_holder = node.units["sbx_mps"].holder
    await node.stop()
    # the start that never launched is undone; the running units keep their slices
    assert nvml.destroyed == [] and _daemon_runs(servers, "GPU-1")
    assert "quit" not in _calls(servers, "GPU-1")
    assert _recorded(node) == ["sbx_mig", "sbx_mps"]

    after = _restarted(tmp_path, nvml)
    assert sorted(await after.readopt()) == ["sbx_mig", "sbx_mps"]
    assert nvml.found == [(0, 7, 0)]
    holder = after.units["sbx_mps"].holder
    assert holder == node_holder and after.mps.users == {"GPU-1": {holder}}
    assert after.mps.running == {"GPU-1"}
    mig = after.units["sbx_mig"]
    assert mig.plan.env["CUDA_VISIBLE_DEVICES"] == "MIG-7" and mig.watch is not None
    assert after.units["sbx_mps"].cgroup_dir == tmp_path / "cgroup" / "sbx_mps"

    await after.release("sbx_mps")  # its exit: the daemon's last unit
    assert _calls(after.mps, "GPU-1")[-1] == "quit" and not _daemon_runs(after.mps, "GPU-1")
    await after.release("sbx_mig")
    assert nvml.destroyed == [(7, 0)]
    assert list(after.records.iterdir()) == []


async def test_a_unit_that_ended_while_no_node_agent_ran_has_its_slice_undone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml = TwoGpus()
    node = await _node_with_units(tmp_path, monkeypatch, nvml)
    await node.stop()
    for sid in ("sbx_mig", "sbx_mps"):
        _cgroup(tmp_path, sid, running=False)  # ended meanwhile
    (node.records / "sbx_garbled.json").write_text("{not json")

    after = _restarted(tmp_path, nvml)
    assert await after.readopt() == []
    assert after.units == {} and after.mps.users == {}
    assert nvml.destroyed == [(7, 0)]
    assert _calls(after.mps, "GPU-1")[-1] == "quit" and not _daemon_runs(after.mps, "GPU-1")
    assert list(after.records.iterdir()) == []  # the unreadable record is dropped too


async def test_a_mig_instance_nvml_would_not_destroy_stays_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its record is what finds it again: a destroy that failed keeps it, and the next node
    agent's start tries again."""
    nvml = TwoGpus()
    node = await _node_with_units(tmp_path, monkeypatch, nvml)

    def busy(gi: Any, ci: Any) -> None:
        raise RuntimeError("NVML_ERROR_IN_USE")

    monkeypatch.setattr(nvml, "destroy_mig", busy)
    await node.release("sbx_mig")
    assert "sbx_mig" in _recorded(node)
    monkeypatch.undo()
    _cgroup(tmp_path, "sbx_mig", running=False)
    monkeypatch.setattr("dsec_nodeagent.gpunode.attach_device_guard", lambda *_: None)
    await _restarted(tmp_path, nvml).readopt()
    assert nvml.destroyed == [(7, 0)] and "sbx_mig" not in _recorded(node)


async def test_a_unit_the_node_agent_did_not_readopt_has_its_slice_undone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Its cgroup still had a process when the GPU side started, and the node agent's
    reconcile cleaned it up instead of adopting it (a half-started sandbox)."""
    nvml = TwoGpus()
    node = await _node_with_units(tmp_path, monkeypatch, nvml)
    await node.stop()
    after = _restarted(tmp_path, nvml)
    await after.readopt()
    await after.keep_only(["sbx_mps"])
    assert list(after.units) == ["sbx_mps"] and nvml.destroyed == [(7, 0)]
    assert _recorded(after) == ["sbx_mps"]


async def test_a_record_nvml_cannot_resolve_now_is_kept_for_the_next_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml = TwoGpus()
    node = await _node_with_units(tmp_path, monkeypatch, nvml)
    await node.stop()

    def flaky(index: int, gi_id: int, ci_id: int) -> Any:
        raise RuntimeError("NVML_ERROR_UNKNOWN")

    monkeypatch.setattr(nvml, "mig_by_ids", flaky)
    after = _restarted(tmp_path, nvml)
    assert await after.readopt() == ["sbx_mps"]
    assert "sbx_mig" in _recorded(after) and nvml.destroyed == []
    monkeypatch.undo()
    monkeypatch.setattr("dsec_nodeagent.gpunode.attach_device_guard", lambda *_: None)
    assert "sbx_mig" in await _restarted(tmp_path, nvml).readopt()


async def test_a_record_whose_instance_ids_now_name_another_is_not_destroyed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node agent died after destroying a unit's instance and before removing its record,
    and NVML gave the ids to a new unit's instance meanwhile: that one is not destroyed."""
    nvml = TwoGpus()
    node = await _node_with_units(tmp_path, monkeypatch, nvml)
    await node.stop()
    _cgroup(tmp_path, "sbx_mig", running=False)
    nvml.reused[(7, 0)] = "MIG-of-another-unit"
    after = _restarted(tmp_path, nvml)
    await after.readopt()
    assert nvml.destroyed == [] and "sbx_mig" not in after.units
    assert "sbx_mig" not in _recorded(after)


async def test_a_second_slice_of_a_sandbox_still_holding_one_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    nvml = TwoGpus()
    node = await _node_with_units(tmp_path, monkeypatch, nvml)
    with pytest.raises(SliceError, match="still holds a GPU slice"):
        await node.prepare("sbx_mig", _placed("sbx_mig", 0, 100))
    assert nvml.created == [(7, 0)]  # nothing made for it
    await node.release("sbx_mig")
    assert nvml.destroyed == [(7, 0)]
