"""CRIU for the migration path ``criu``: pre-dump rounds, the final dump, the restore's command.

What CRIU is given and why (docs/migration.md has the findings in full):

* the tree dumped is the sandbox's pid 1 and below (its supervisor stays outside, on the host):
  a sandbox launched ``checkpointable`` (:class:`~dsec_nodeagent.sandbox.SandboxConfig`) has a
  pid 1 that re-executed the sandbox's own interpreter after ``pivot_root``, a session of its
  own and ``/dev/null`` of its own root, so nothing of it names the host's mount tree;
* every bind mount of the root view (runtime, code, outputs, device nodes) is an *external*
  mount, dumped under a key (its path in the sandbox) and bound again on restore from the
  target's own paths (``--external mnt[KEY]:PATH``); tmpfs mounts (root, ``/tmp``, ``/dev``,
  ``/dev/shm``) travel inside the images;
* stdout, stderr and pid 1's status pipe lead to the source's supervisor: on restore they are
  new pipes of the target's restorer (``--inherit-fd fd[N]:pipe:[INODE]``);
* ``--network-lock skip``: a sandbox shares the host's network namespace (its egress is the
  cgroup's eBPF programs), which CRIU must neither lock nor dump.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

_FOUND = shutil.which("criu", path="/usr/local/sbin:/usr/sbin:/sbin:/usr/local/bin:/usr/bin")
CRIU = os.environ.get("DSEC_CRIU") or _FOUND or "criu"
"""The CRIU binary (``$DSEC_CRIU``; else the first on the system path, /usr/local first: the
one ``scripts/setup-criu.sh`` builds when the distribution's cannot run on this kernel)."""

_IN_IMAGES = frozenset({"tmpfs", "proc", "mqueue", "devpts", "sysfs"})
"""File systems CRIU carries itself (their contents, or nothing to carry)."""


class CriuError(RuntimeError):
    """CRIU failed; ``detail`` holds the last lines of its log."""

    def __init__(self, action: str, detail: str) -> None:
        super().__init__(f"criu {action} failed: {detail}")
        self.action = action
        self.detail = detail


@dataclass(frozen=True)
class MountPoint:
    """One line of ``/proc/<pid>/mountinfo``."""

    mount_id: int
    parent_id: int
    device: str
    root: str
    mountpoint: str
    fstype: str


def read_mountinfo(pid: int | str) -> list[MountPoint]:
    """The mounts ``pid`` sees (``self`` for this process)."""
    found = []
    for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        found.append(
            MountPoint(
                int(fields[0]),
                int(fields[1]),
                fields[2],
                _unescape(fields[3]),
                _unescape(fields[4]),
                fields[sep + 1],
            )
        )
    return found


def _unescape(path: str) -> str:
    return path.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")


def external_mounts(init_pid: int) -> dict[str, str]:
    """Each bind mount of the sandbox's root view: its path inside -> the host path it shows.

    A mount of a file system CRIU carries itself (tmpfs, proc) is not external; a bind of a
    proc file inside the sandbox (``/proc/sys`` read-only) neither. The host path is found by
    the device: the host's mount of that device whose root is a prefix of the bind's root.
    """
    host = [m for m in read_mountinfo("self") if m.fstype not in _IN_IMAGES]
    result: dict[str, str] = {}
    for m in read_mountinfo(init_pid):
        if m.fstype in _IN_IMAGES:
            continue
        best: MountPoint | None = None
        for h in host:
            if h.device != m.device or not _under(m.root, h.root):
                continue
            if best is None or len(h.root) > len(best.root):
                best = h
        if best is None:
            raise CriuError("dump", f"{m.mountpoint}: no host mount shows {m.device}:{m.root}")
        rest = m.root[len(best.root) :].lstrip("/") if best.root != "/" else m.root.lstrip("/")
        result[m.mountpoint] = os.path.join(best.mountpoint, rest) if rest else best.mountpoint
    return result


def _under(path: str, base: str) -> bool:
    return base == "/" or path == base or path.startswith(base.rstrip("/") + "/")


def pipe_inodes(init_pid: int) -> dict[int, str]:
    """pid 1's pipes to the supervisor: fd -> ``pipe:[inode]`` (1, 2: output; others: the
    workload's wait status)."""
    found = {}
    for entry in os.listdir(f"/proc/{init_pid}/fd"):
        try:
            target = os.readlink(f"/proc/{init_pid}/fd/{entry}")
        except OSError:
            continue
        if target.startswith("pipe:["):
            found[int(entry)] = target
    return found


@dataclass
class Round:
    """One pass of the pre-copy (or the final dump)."""

    name: str
    ms: float
    pages_bytes: int
    total_bytes: int


@dataclass
class DumpResult:
    """Everything the pre-copy wrote, round by round."""

    rounds: list[Round] = field(default_factory=list)

    @property
    def precopy_rounds(self) -> int:
        return sum(1 for r in self.rounds if r.name != "final")


def images_bytes(directory: Path) -> tuple[int, int]:
    """(bytes of memory pages, bytes of every image) in one round's directory."""
    pages = total = 0
    for entry in os.scandir(directory):
        if entry.is_file(follow_symlinks=False):
            size = entry.stat(follow_symlinks=False).st_size
            total += size
            if entry.name.startswith("pages-"):
                pages += size
    return pages, total


def dump_args(
    action: str,
    init_pid: int,
    directory: Path,
    previous: str | None,
    mounts: dict[str, str],
    track_mem: bool = True,
) -> list[str]:
    """The command line of a ``pre-dump`` or the final ``dump`` (tasks left stopped)."""
    args = [
        CRIU,
        action,
        "-t",
        str(init_pid),
        "-D",
        str(directory),
        "-o",
        "criu.log",
        "-v2",
        "--network-lock",
        "skip",
    ]
    if track_mem:
        args.append("--track-mem")
    if previous is not None:
        args += ["--prev-images-dir", f"../{previous}"]
    if action == "dump":
        args.append("--leave-stopped")
        for index, mountpoint in enumerate(sorted(mounts)):
            args += ["--external", f"mnt[{mountpoint}]:m{index}"]
    return args


async def run(args: list[str], directory: Path, action: str) -> float:
    """Run CRIU; return its wall time in ms. Raises :class:`CriuError` with its log's tail."""
    start = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate()
    ms = (time.perf_counter() - start) * 1000
    if proc.returncode != 0:
        raise CriuError(action, _log_tail(directory / "criu.log", out))
    return ms


def _log_tail(path: Path, fallback: bytes) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return fallback.decode(errors="replace")[-500:]
    errors = [ln for ln in lines if "Error" in ln and "RLIMIT_NOFILE for self" not in ln]
    return " | ".join((errors or lines)[-4:])[-500:]


async def precopy(
    init_pid: int,
    root: Path,
    mounts: dict[str, str],
    *,
    max_rounds: int = 4,
    converged_bytes: int = 8 << 20,
    on_round: Callable[[Round, Path], Awaitable[None]] | None = None,
) -> DumpResult:
    """Pre-dump rounds (memory only, the sandbox runs on) until the pages written in a round
    fall below ``converged_bytes`` or ``max_rounds`` were done, then the final dump (the
    sandbox is frozen from here on and left stopped). ``on_round`` is awaited after each
    round, with its directory (stream it to the target there)."""
    result = DumpResult()
    previous: str | None = None
    if not await dirty_tracking():
        max_rounds = 0  # every round would copy all memory again: straight to the final dump
    for index in range(1, max_rounds + 1):
        name = f"pre{index}"
        directory = root / name
        directory.mkdir(parents=True)
        ms = await run(
            dump_args("pre-dump", init_pid, directory, previous, mounts), directory, name
        )
        pages, total = images_bytes(directory)
        done = Round(name, ms, pages, total)
        result.rounds.append(done)
        if on_round is not None:
            await on_round(done, directory)
        previous = name
        if pages < converged_bytes:
            break
    directory = root / "final"
    directory.mkdir(parents=True)
    args = dump_args("dump", init_pid, directory, previous, mounts, track_mem=previous is not None)
    ms = await run(args, directory, "dump")
    pages, total = images_bytes(directory)
    result.rounds.append(Round("final", ms, pages, total))
    return result


def restore_args(
    directory: Path,
    mounts: dict[str, str],
    keys: dict[str, str],
    inherit: dict[int, str],
    pidfile: Path,
    root: Path,
) -> list[str]:
    """The target's ``criu restore``: the root task as the caller's child
    (``--restore-sibling``), detached, left stopped until the source has released its copy.

    ``mounts``: path in the sandbox -> the target's host path; ``keys``: path in the sandbox ->
    the key it was dumped under; ``inherit``: fd of the caller -> ``pipe:[inode]`` it replaces.
    """
    args = [
        CRIU,
        "restore",
        "-D",
        str(directory),
        "-o",
        "criu-restore.log",
        "-v2",
        "--restore-detached",
        "--restore-sibling",
        "--leave-stopped",
        "--manage-cgroups=ignore",
        "--network-lock",
        "skip",
        "--pidfile",
        str(pidfile),
        "--root",
        str(root),
    ]
    for mountpoint, key in sorted(keys.items()):
        args += ["--external", f"mnt[{key}]:{mounts[mountpoint]}"]
    for fd, name in sorted(inherit.items()):
        args += ["--inherit-fd", f"fd[{fd}]:{name}"]
    return args


def mount_keys(mounts: dict[str, str]) -> dict[str, str]:
    """The key each external mount is dumped under (as :func:`dump_args` names them)."""
    return {mountpoint: f"m{index}" for index, mountpoint in enumerate(sorted(mounts))}


_DIRTY_TRACKING: bool | None = None


async def dirty_tracking() -> bool:
    """Whether the kernel tracks the pages written since a pre-dump (soft-dirty bits,
    ``CONFIG_MEM_SOFT_DIRTY``): without it a pre-dump round cannot shorten the final dump."""
    global _DIRTY_TRACKING
    if _DIRTY_TRACKING is None:
        try:
            proc = await asyncio.create_subprocess_exec(
                CRIU,
                "check",
                "--feature",
                "mem_dirty_track",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            out, _ = await proc.communicate()
            _DIRTY_TRACKING = proc.returncode == 0 and b"OFF" not in out
        except OSError:
            _DIRTY_TRACKING = False
    return _DIRTY_TRACKING


async def check() -> str | None:
    """Why CRIU cannot run here (``None``: it can)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            CRIU,
            "check",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    except OSError as exc:
        return f"no CRIU ({CRIU}): {exc}; run scripts/setup-criu.sh"
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        lines = [ln for ln in out.decode(errors="replace").splitlines() if "Error" in ln]
        return f"`criu check` fails: {' | '.join(lines[-2:])[-300:]}"
    return None
