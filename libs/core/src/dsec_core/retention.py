"""Retention of ended sandboxes' directories on a node (``DSEC_HOME/sandboxes/<id>``).

Shared by the node agent (its automatic policy) and ``dsec sandbox gc`` (run on the node, as
root), which works on the node's directories only, like ``dsec sandbox logs``: the CLI imports no
service. What may be removed is decided here, purely, from what the node agent leaves on disk:

* a sandbox is **running** (never removed) while its state file ``run/sandboxes/<id>.json`` or
  its run directory ``run/sandboxes/<id>/`` exists, or its disk quota is still mounted;
* it **ended** when the node agent wrote ``sandboxes/<id>/ended.json`` after cleaning it up;
* a directory of neither kind (left by a node agent older than the mark, or a start that never
  got to write its state) counts as ended at its newest modification, once that is older than
  :data:`UNMARKED_MIN_AGE_S`: a start in progress is never that old.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ENDED_MARK = "ended.json"
UNMARKED_MIN_AGE_S = 3600.0


def down_marker(home: Path) -> Path:
    """Present while ``dsec down`` stops the stack (without ``--keep-sandboxes``): the node
    agent then stops its sandboxes, cleans each up (cgroup, egress programs, quota, leases) and
    removes the pinned egress maps once no sandbox uses them, instead of leaving everything for
    the next ``dsec up``."""
    return home / "run" / "stack-down"


@dataclass(frozen=True)
class SandboxDir:
    """One sandbox's directory on this node.

    Attributes:
        ended_at: when it ended (epoch seconds); ``None`` while it runs.
    """

    sandbox_id: str
    path: Path
    ended_at: float | None


@dataclass(frozen=True)
class Removal:
    """A directory chosen for removal, and why."""

    entry: SandboxDir
    why: str


def _running(home: Path, sid: str) -> bool:
    run = home / "run" / "sandboxes"
    return (
        (run / f"{sid}.json").exists()
        or (run / sid).exists()
        or os.path.ismount(home / "sandboxes" / sid / "fs")
    )


def _ended_at(path: Path) -> float | None:
    try:
        record = json.loads((path / ENDED_MARK).read_text())
        return float(record["ended_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _entries(path: Path) -> Iterator[os.stat_result]:
    """``lstat`` of everything below ``path``, walked without recursion (a sandbox can make a
    tree deeper than Python's recursion limit: ``os.walk`` raised there in 3.11 and stopped
    the whole sweep, for every tenant)."""
    stack = [str(path)]
    while stack:
        try:
            with os.scandir(stack.pop()) as it:
                for entry in it:
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    yield info
                    if entry.is_dir(follow_symlinks=False):
                        stack.append(entry.path)
        except OSError:
            continue


def _newest_mtime(path: Path) -> float:
    newest = path.stat().st_mtime
    for info in _entries(path):
        newest = max(newest, info.st_mtime)
    return newest


def size_of(path: Path) -> int:
    """Bytes the files under ``path`` take on disk (walked only for what is removed)."""
    return sum(info.st_blocks * 512 for info in _entries(path) if not stat.S_ISDIR(info.st_mode))


def scan(home: Path, now: float) -> list[SandboxDir]:
    """Every sandbox directory of this node, oldest end first (running ones included)."""
    root = home / "sandboxes"
    found: list[SandboxDir] = []
    if not root.is_dir():
        return found
    for path in sorted(root.iterdir()):
        if not path.is_dir() or path.name.startswith("."):
            continue
        sid = path.name
        ended: float | None = None
        if not _running(home, sid):
            ended = _ended_at(path)
            if ended is None:
                newest = _newest_mtime(path)
                ended = newest if now - newest >= UNMARKED_MIN_AGE_S else None
        found.append(SandboxDir(sid, path, ended))
    return sorted(found, key=lambda d: (d.ended_at is None, d.ended_at or 0.0, d.sandbox_id))


def choose(
    entries: Iterable[SandboxDir],
    now: float,
    *,
    older_than_s: float | None,
    keep_max: int | None = None,
) -> list[Removal]:
    """The ended sandboxes to remove: ended more than ``older_than_s`` ago, and beyond the
    ``keep_max`` most recently ended. Running ones are never chosen."""
    ended = sorted((e for e in entries if e.ended_at is not None), key=lambda e: e.ended_at or 0.0)
    chosen: dict[str, Removal] = {}
    for entry in ended:
        age = now - (entry.ended_at or now)
        if older_than_s is not None and age >= older_than_s:
            chosen[entry.sandbox_id] = Removal(entry, f"ended {_age(age)} ago")
    if keep_max is not None:
        excess = len(ended) - keep_max
        for entry in ended[: max(0, excess)]:
            chosen.setdefault(
                entry.sandbox_id, Removal(entry, f"more than {keep_max} ended sandboxes kept")
            )
    return [chosen[e.sandbox_id] for e in ended if e.sandbox_id in chosen]


def remove(home: Path, removal: Removal) -> int | None:
    """Delete one chosen directory; return the bytes freed, or ``None`` when the sandbox turned
    out to run (re-checked)."""
    if _running(home, removal.entry.sandbox_id):
        return None
    size = size_of(removal.entry.path)
    # rm walks any depth (shutil.rmtree recursed once per level) and stays on this file
    # system; it never follows a link the sandbox left
    done = subprocess.run(
        ["rm", "-rf", "--one-file-system", "--", str(removal.entry.path)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if done.returncode != 0 or removal.entry.path.exists():
        raise OSError(f"rm -rf {removal.entry.path}: {done.stderr.strip()[:300]}")
    return size


def _age(seconds: float) -> str:
    if seconds >= 86400:
        return f"{seconds / 86400:.1f} d"
    if seconds >= 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 60:.0f} min"
