"""Per-sandbox state files (``DSEC_HOME/run/sandboxes/<id>.json``): what a restarted node agent
needs to re-adopt or clean up a sandbox. Never holds a secret value."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def process_start_time(pid: int) -> int | None:
    """Field 22 of ``/proc/PID/stat`` (to tell a live process from a reused pid)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            text = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return int(text.rsplit(")", 1)[1].split()[19])


def is_alive(pid: int, start_time: int | None) -> bool:
    """Whether ``pid`` still runs the process that had ``start_time`` (and is not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return fields[0] != "Z" and (start_time is None or int(fields[19]) == start_time)


class StateStore:
    """Reads and writes state files atomically."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        # The "uid" of each state file this store wrote or read (None: not given yet). It is
        # their only writer (a node agent's one manager), so a file is read once, not at every
        # sandbox start (what a node running many sandboxes would pay per start otherwise).
        self._uids: dict[str, int | None] = {}

    def path(self, sandbox_id: str) -> Path:
        """The state file of ``sandbox_id``."""
        return self.run_dir / f"{sandbox_id}.json"

    def write(self, sandbox_id: str, state: dict[str, Any]) -> None:
        """Replace the state file (write + rename).

        Three system calls and a rename on a sandbox's start path (each start writes its state
        twice before its workload runs): no directory creation but the first time, no mode
        change by path."""
        # compact: json's C encoder (an indent takes its pure-Python one, ~0.3 ms a write here,
        # on the CPU a just-started workload runs on)
        data = json.dumps(state, separators=(",", ":"), sort_keys=True).encode()
        tmp = f"{self.run_dir}/.{sandbox_id}.json.tmp"
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)  # a leftover temporary file keeps its mode through O_TRUNC
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        os.replace(tmp, self.path(sandbox_id))
        self._uids[sandbox_id] = _uid_of(state)

    def read(self, sandbox_id: str) -> dict[str, Any] | None:
        """The state, or ``None`` when there is none."""
        try:
            data: dict[str, Any] = json.loads(self.path(sandbox_id).read_text())
        except FileNotFoundError:
            return None
        return data

    def remove(self, sandbox_id: str) -> None:
        """Delete the state file (missing is fine)."""
        self.path(sandbox_id).unlink(missing_ok=True)
        self._uids.pop(sandbox_id, None)

    def exists(self, sandbox_id: str) -> bool:
        """Whether ``sandbox_id`` has a state file (without reading it)."""
        return self.path(sandbox_id).exists()

    def uids(self) -> set[int]:
        """The uids the state files name (a file this store neither wrote nor read yet, such as
        one a node agent before it left, is read now; one gone is forgotten)."""
        listed = set(self.ids())
        for gone in self._uids.keys() - listed:
            del self._uids[gone]
        for sandbox_id in listed - self._uids.keys():
            self._uids[sandbox_id] = _uid_of(self.read(sandbox_id) or {})
        return {uid for uid in self._uids.values() if uid is not None}

    def ids(self) -> list[str]:
        """Every sandbox with a state file."""
        try:
            names = os.listdir(self.run_dir)
        except FileNotFoundError:
            return []
        return sorted(n[:-5] for n in names if n.endswith(".json") and not n.startswith("."))


def _uid_of(state: dict[str, Any]) -> int | None:
    uid = state.get("uid")
    return int(uid) if uid is not None else None
