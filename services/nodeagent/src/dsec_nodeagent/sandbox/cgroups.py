"""One cgroup per sandbox: a v2 directory always (eBPF attaches there), limits on v2 controllers
where the host offers them and on v1 hierarchies otherwise (hybrid hosts)."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from dsec_nodeagent.sandbox.models import Limits

CONTROLLERS = ("memory", "cpu", "pids", "io")
V1_NAMES = {"blkio": "io"}
"""A controller's name in v1 mount options, where it is not its v2 name."""
GROUP = "dsec"
CPU_PERIOD_US = 100_000


class CgroupError(RuntimeError):
    """A cgroup could not be created, configured or removed."""


@dataclass(frozen=True)
class Hierarchy:
    """The host's cgroup mounts.

    Attributes:
        unified: the cgroup2 mount (``/sys/fs/cgroup`` or ``/sys/fs/cgroup/unified``).
        v2_controllers: controllers enabled at the unified root.
        v1: controller -> its v1 mount, for controllers not on the unified tree.
    """

    unified: Path
    v2_controllers: frozenset[str]
    v1: dict[str, Path] = field(default_factory=dict)

    def backend(self, controller: str) -> str:
        """``"v2"``, ``"v1"`` or ``"none"`` for ``controller``."""
        if controller in self.v2_controllers:
            return "v2"
        return "v1" if controller in self.v1 else "none"


def detect(mounts_file: str = "/proc/self/mounts") -> Hierarchy:
    """Read the cgroup mounts of this host.

    Raises:
        CgroupError: there is no cgroup2 mount (the eBPF egress layer needs one).
    """
    unified: Path | None = None
    v1: dict[str, Path] = {}
    with open(mounts_file) as fh:
        for line in fh:
            _, mountpoint, fstype, options, *_ = line.split()
            if fstype == "cgroup2":
                unified = Path(mountpoint)
            elif fstype == "cgroup":
                for opt in options.split(","):
                    name = V1_NAMES.get(opt, opt)
                    if name in CONTROLLERS:
                        v1[name] = Path(mountpoint)
    if unified is None:
        raise CgroupError("no cgroup2 filesystem mounted; the sandbox needs one for eBPF hooks")
    controllers = frozenset((unified / "cgroup.controllers").read_text().split())
    return Hierarchy(unified, controllers, {c: p for c, p in v1.items() if c not in controllers})


def favor_dynamic_modifications(hierarchy: Hierarchy) -> bool:
    """Remount cgroup2 with ``favordynmods``; return whether it is on.

    Each sandbox moves a task into fresh cgroups. Without this option the first migration after
    an idle spell waits for an RCU grace period on the global threadgroup lock (~12 ms measured
    on our 2-vCPU VMs, the largest single layer of ``sandbox.ready``); with it, ~0.5 ms. The
    kernel's cost is slightly slower fork/exit host-wide. Off with ``tune_cgroups=False``.
    """
    with open("/proc/self/mounts") as fh:
        for line in fh:
            _, mountpoint, fstype, options, *_ = line.split()
            on = fstype == "cgroup2" and mountpoint == str(hierarchy.unified)
            if on and "favordynmods" in options.split(","):
                return True
    result = subprocess.run(
        ["mount", "-o", "remount,favordynmods", str(hierarchy.unified)],
        capture_output=True,
        check=False,
    )
    return result.returncode == 0


NODE_PID_SHARE = 0.75
"""The share of the host's pid table (``kernel.pid_max``) the host's sandboxes hold together."""


def node_pids_max(pid_max: Path = Path("/proc/sys/kernel/pid_max")) -> int | None:
    """:data:`NODE_PID_SHARE` of the host's ``pid_max`` (None: unreadable)."""
    try:
        return max(64, int(int(pid_max.read_text()) * NODE_PID_SHARE))
    except (OSError, ValueError):
        return None


def _write(path: Path, value: str) -> None:
    try:
        path.write_text(value)
    except OSError as exc:
        raise CgroupError(f"cannot write {value!r} to {path}: {exc.strerror}") from exc


@dataclass
class SandboxCgroup:
    """The cgroup directories of one sandbox.

    Attributes:
        v2_dir: ``<unified>/dsec/<node id>/<sandbox_id>`` (a node of its own per node agent: a
            sandbox rescheduled to another node agent of the same machine while its stale copy
            still runs gets a cgroup of its own).
        dirs: controller -> directory holding its limit files (v2_dir or a v1 directory).
        disk: ``MAJ:MIN`` of the sandbox's own disk (its ``resources.disk`` image's loop
            device), "" without one: set before :meth:`make`, which bounds its I/O.
    """

    v2_dir: Path
    dirs: dict[str, Path]
    disk: str = ""

    @classmethod
    def planned(cls, hierarchy: Hierarchy, sandbox_id: str, node: str = "node-1") -> SandboxCgroup:
        """The directories :meth:`create` makes, named before they exist (a launch hands its plan
        to the sandbox's init while they are made; init joins them once told they are)."""
        v2_dir = hierarchy.unified / GROUP / node / sandbox_id
        dirs: dict[str, Path] = {}
        for controller in CONTROLLERS:
            backend = hierarchy.backend(controller)
            if backend == "v2":
                dirs[controller] = v2_dir
            elif backend == "v1":
                dirs[controller] = hierarchy.v1[controller] / GROUP / node / sandbox_id
        return cls(v2_dir=v2_dir, dirs=dirs)

    @classmethod
    def create(
        cls,
        hierarchy: Hierarchy,
        sandbox_id: str,
        limits: Limits,
        node: str = "node-1",
        disk: str = "",
    ) -> SandboxCgroup:
        """Create the directories and write ``limits`` (``disk``: see the attribute); on
        failure remove what was made."""
        group = cls.planned(hierarchy, sandbox_id, node)
        group.disk = disk
        group.make(hierarchy, limits)
        return group

    def make(self, hierarchy: Hierarchy, limits: Limits) -> None:
        """Create the :meth:`planned` directories and write ``limits``; on failure remove what
        was made (never a directory that existed before: that is an error)."""
        v2_parent = self.v2_dir.parent
        v2_parent.mkdir(parents=True, exist_ok=True)
        on_v2 = [c for c in CONTROLLERS if hierarchy.backend(c) == "v2"]
        if on_v2:
            enable = " ".join(f"+{c}" for c in on_v2)
            _write(hierarchy.unified / "cgroup.subtree_control", enable)
            _write(v2_parent.parent / "cgroup.subtree_control", enable)
            _write(v2_parent / "cgroup.subtree_control", enable)
        try:
            self.v2_dir.mkdir()
        except FileExistsError as exc:
            raise CgroupError(f"cgroup {self.v2_dir} already exists") from exc
        made = {self.v2_dir}
        try:
            for path in sorted(set(self.dirs.values()) - made):
                path.mkdir(parents=True)
                made.add(path)
            self._bound_node()
            self._apply(limits)
        except BaseException:
            ours = {c: p for c, p in self.dirs.items() if p in made}
            SandboxCgroup(self.v2_dir, ours, self.disk).remove(timeout_s=1.0)
            raise

    def _bound_node(self) -> None:
        """DSec's group (every sandbox of every node agent on this host) holds at most
        :data:`NODE_PID_SHARE` of the host's pid table: before, sandboxes within their own
        ``pids`` could together take every pid, and the host (the node agent, the stack's
        servers) could fork no more."""
        pids = self.dirs.get("pids")
        most = node_pids_max()
        if pids is not None and most is not None:
            _write(pids.parent.parent / "pids.max", str(most))

    def _is_v2(self, controller: str) -> bool:
        return self.dirs.get(controller) == self.v2_dir

    def _apply(self, limits: Limits) -> None:
        if limits.memory_bytes is not None:
            self._set_memory(limits.memory_bytes)
        if limits.cpus is not None:
            quota = max(1000, int(limits.cpus * CPU_PERIOD_US))
            if self._is_v2("cpu"):
                _write(self._need("cpu") / "cpu.max", f"{quota} {CPU_PERIOD_US}")
            else:
                _write(self._need("cpu") / "cpu.cfs_period_us", str(CPU_PERIOD_US))
                _write(self._need("cpu") / "cpu.cfs_quota_us", str(quota))
        if any(
            v is not None for v in (limits.disk_read_bps, limits.disk_write_bps, limits.disk_iops)
        ):
            self._set_io(limits)
        if limits.pids is not None:
            # One more than asked: the process that starts the workload (init's child, see
            # init._spawn_workload) is still there for the workload's first milliseconds, so a
            # workload forking at once may have its `pids` beside it. The slot stays for the
            # sandbox's life (nothing outside it learns when that process is gone).
            _write(self._need("pids") / "pids.max", str(limits.pids + 1))

    def _set_memory(self, limit: int) -> None:
        path = self._need("memory")
        if self._is_v2("memory"):
            _write(path / "memory.max", str(limit))
            if (path / "memory.swap.max").exists():
                _write(path / "memory.swap.max", "0")
            return
        _write(path / "memory.limit_in_bytes", str(limit))
        if (path / "memory.memsw.limit_in_bytes").exists():  # no swapping past the limit
            _write(path / "memory.memsw.limit_in_bytes", str(limit))

    def _set_io(self, limits: Limits) -> None:
        """Bound the sandbox's block I/O (blk-throttle): reads on its disk and on the host's
        disks, writes on its disk. With the io controller on v1 (``blkio``), write-back is the
        root group's I/O (v1 has no cgroup write-back), so the root group's write bounds on the
        sandbox's disk, which no one else writes, bound its buffered writes too."""
        path = self._need("io")
        read, write, iops = limits.disk_read_bps, limits.disk_write_bps, limits.disk_iops
        devices = sorted({*host_disks(), *([self.disk] if self.disk else [])})
        if self._is_v2("io"):
            for dev in devices:
                own = dev == self.disk
                line = f"{dev} rbps={read or 'max'} riops={iops or 'max'}"
                if own:
                    line += f" wbps={write or 'max'} wiops={iops or 'max'}"
                _write_rule(path / "io.max", line, dev, self.disk)
            return
        for dev in devices:
            if read is not None:
                _write_rule(
                    path / "blkio.throttle.read_bps_device", f"{dev} {read}", dev, self.disk
                )
            if iops is not None:
                _write_rule(
                    path / "blkio.throttle.read_iops_device", f"{dev} {iops}", dev, self.disk
                )
        if self.disk:
            for where in (path, _v1_root(path)):
                if write is not None:
                    _write(where / "blkio.throttle.write_bps_device", f"{self.disk} {write}")
                if iops is not None:
                    _write(where / "blkio.throttle.write_iops_device", f"{self.disk} {iops}")

    def _clear_root_io(self) -> None:
        """Take the root group's bounds on the sandbox's disk away (v1), so the loop device's
        next user starts unbounded (a sandbox sets its own)."""
        path = self.dirs.get("io")
        if not self.disk or path is None or self._is_v2("io"):
            return
        _clear_root_rules(_v1_root(path), self.disk)

    def _need(self, controller: str) -> Path:
        if controller not in self.dirs:
            raise CgroupError(f"the {controller} controller is not available on this host")
        return self.dirs[controller]

    @property
    def inode(self) -> int:
        """The v2 directory's inode = ``bpf_get_current_cgroup_id()`` of tasks inside."""
        return os.stat(self.v2_dir).st_ino

    def procs_files(self) -> list[str]:
        """Every ``cgroup.procs`` a sandbox task must join (v2 first)."""
        files = [str(self.v2_dir / "cgroup.procs")]
        files += sorted({str(d / "cgroup.procs") for d in self.dirs.values() if d != self.v2_dir})
        return files

    def pids(self) -> list[int]:
        """Processes currently in the sandbox."""
        try:
            text = (self.v2_dir / "cgroup.procs").read_text()
        except FileNotFoundError:
            return []
        return [int(x) for x in text.split()]

    def oom_kills(self) -> int:
        """How many tasks the OOM killer took in this cgroup."""
        path = self.dirs.get("memory")
        if path is None:
            return 0
        name = "memory.events" if self._is_v2("memory") else "memory.oom_control"
        return _counter(path / name, "oom_kill")

    def pids_limit_hits(self) -> int:
        """How many forks the pids limit refused."""
        path = self.dirs.get("pids")
        return 0 if path is None else _counter(path / "pids.events", "max")

    def reaper_plan(self, marker: Path) -> dict[str, Any]:
        """What the supervisor needs to remove this cgroup itself when the sandbox ends while no
        node agent watches it (``marker`` exists): its directories and its two counters."""
        counters: dict[str, list[str]] = {}
        memory = self.dirs.get("memory")
        if memory is not None:
            name = "memory.events" if self._is_v2("memory") else "memory.oom_control"
            counters["oom_kills"] = [str(memory / name), "oom_kill"]
        pids = self.dirs.get("pids")
        if pids is not None:
            counters["pids_limit_hits"] = [str(pids / "pids.events"), "max"]
        dirs = [self.v2_dir, *(d for d in set(self.dirs.values()) if d != self.v2_dir)]
        return {"marker": str(marker), "dirs": [str(d) for d in dirs], "counters": counters}

    def kill(self) -> None:
        """SIGKILL every task (``cgroup.kill``, or one by one on kernels before 5.14)."""
        kill_file = self.v2_dir / "cgroup.kill"
        if kill_file.exists():
            with contextlib.suppress(FileNotFoundError):
                kill_file.write_text("1")
            return
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kill what is left and remove every directory.

        Raises:
            CgroupError: a directory is still busy after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        dirs = [self.v2_dir, *(d for d in set(self.dirs.values()) if d != self.v2_dir)]
        if self.pids():
            self.kill()
        self._clear_root_io()
        for path in dirs:
            while True:
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:
                    if time.monotonic() > deadline:
                        raise CgroupError(f"cannot remove {path}: {exc.strerror}") from exc
                    self.kill()
                    time.sleep(0.005)

    def to_state(self) -> dict[str, Any]:
        """JSON form for the state file."""
        state: dict[str, Any] = {
            "v2_dir": str(self.v2_dir),
            "dirs": {k: str(v) for k, v in self.dirs.items()},
        }
        if self.disk:
            state["disk"] = self.disk
        return state

    @classmethod
    def from_state(cls, data: dict[str, Any]) -> SandboxCgroup:
        """Inverse of :meth:`to_state`."""
        dirs = {k: Path(v) for k, v in data["dirs"].items()}
        return cls(Path(data["v2_dir"]), dirs, str(data.get("disk", "")))


def _write_rule(path: Path, rule: str, dev: str, own: str) -> None:
    """Write one device's throttle rule; a host disk the kernel throttles not (a device with
    no request queue of its own) is passed over, the sandbox's own disk never."""
    try:
        path.write_text(rule)
    except OSError as exc:
        if dev == own or exc.errno not in (errno.ENODEV, errno.EINVAL, errno.ENXIO):
            raise CgroupError(f"cannot write {rule!r} to {path}: {exc.strerror}") from exc


LOOP_MAJOR = 7
"""The block major of loop devices (fixed in Linux)."""


def clear_detached_root_io(
    hierarchy: Hierarchy, sys_dev: Path = Path("/sys/dev/block")
) -> list[str]:
    """Take the v1 root group's write bounds off loop devices no file backs any more (what a
    node agent that died before recording a sandbox left: its next user would be slowed);
    the devices cleared. A loop device still attached may be a live sandbox's (of this node
    agent or another of the host): left alone."""
    root = hierarchy.v1.get("io") if hierarchy.backend("io") == "v1" else None
    if root is None:
        return []
    bounded = set()
    for name in ROOT_WRITE_RULES:
        with contextlib.suppress(OSError):
            bounded |= {rule.split(" ", 1)[0] for rule in (root / name).read_text().split("\n")}
    cleared = []
    for dev in sorted(bounded):
        major, _, minor = dev.partition(":")
        if major == str(LOOP_MAJOR) and minor.isdigit() and not (sys_dev / dev / "loop").is_dir():
            _clear_root_rules(root, dev)
            cleared.append(dev)
    return cleared


ROOT_WRITE_RULES = ("blkio.throttle.write_bps_device", "blkio.throttle.write_iops_device")
"""The v1 root group's files a sandbox's disk is bounded in (its write-back)."""


def _clear_root_rules(root: Path, dev: str) -> None:
    """Take ``dev``'s write bounds off the v1 root group ``root`` (0: no rule)."""
    for name in ROOT_WRITE_RULES:
        with contextlib.suppress(OSError):  # (no such rule, or the device is gone)
            (root / name).write_text(f"{dev} 0")


def _v1_root(path: Path) -> Path:
    """The v1 hierarchy's root above a sandbox's ``<root>/dsec/<node>/<sandbox id>``."""
    return path.parents[2]


NOT_DISKS = ("loop", "ram", "zram")
"""Block devices that are no host disk (a loop device is bounded as one sandbox's disk)."""


def host_disks(sys_block: Path = Path("/sys/block")) -> list[str]:
    """``MAJ:MIN`` of the host's disks (what a sandbox reads through its read-only views)."""
    disks = []
    try:
        entries = list(sys_block.iterdir())
    except OSError:
        return []
    for entry in entries:
        if entry.name.startswith(NOT_DISKS):
            continue
        with contextlib.suppress(OSError):
            disks.append((entry / "dev").read_text().strip())
    return disks


def loop_device_of(path: Path, sys_dev: Path = Path("/sys/dev/block")) -> str:
    """``MAJ:MIN`` of the loop device whose filesystem holds ``path`` ("" where ``path`` is
    on anything else: never a host disk, whose write-back the root group's bounds would
    slow for the whole host)."""
    dev = os.stat(path).st_dev
    name = f"{os.major(dev)}:{os.minor(dev)}"
    return name if (sys_dev / name / "loop").is_dir() else ""


def sandbox_of_cgroup(proc_cgroup: str) -> str | None:
    """The sandbox id named by a ``/proc/PID/cgroup`` text (its cgroup v2 line), or ``None``.

    A sandbox's tasks live in ``<unified>/dsec/<node>/<sandbox_id>`` and cannot leave it (the
    cgroup files belong to root), so this is an identity the task cannot forge.
    """
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy != "0" or controllers:
            continue
        parts = PurePosixPath(path).parts
        if len(parts) >= 4 and parts[0] == "/" and parts[1] == GROUP:
            return parts[3]
    return None


def remove_node_group(hierarchy: Hierarchy, node: str) -> None:
    """Remove a node's parent cgroups once no sandbox is left in them (``dsec down``)."""
    parents = [hierarchy.unified / GROUP / node, hierarchy.unified / GROUP]
    parents += [p / GROUP / node for p in set(hierarchy.v1.values())]
    parents += [p / GROUP for p in set(hierarchy.v1.values())]
    for path in parents:
        with contextlib.suppress(OSError):  # busy or absent: another node's, or in use
            path.rmdir()


def sandbox_of_process(pid: int) -> str | None:
    """The sandbox process ``pid`` belongs to, or ``None`` (not in a sandbox, or gone)."""
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return None
    return sandbox_of_cgroup(text)


def _counter(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except FileNotFoundError:
        pass
    return 0
