"""Sockets of this test process, for tests that a cancelled or closed start leaves nothing
listening."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def listening_here() -> set[int]:
    """Socket inodes of this process that listen on TCP (IPv4 and IPv6)."""
    ours = set()
    for fd in Path("/proc/self/fd").iterdir():
        with contextlib.suppress(OSError):
            target = os.readlink(fd)
            if target.startswith("socket:["):
                ours.add(int(target[8:-1]))
    listening = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/self/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A":  # LISTEN
                listening.add(int(fields[9]))
    return ours & listening
