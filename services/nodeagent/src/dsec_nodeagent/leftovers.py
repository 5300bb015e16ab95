"""What node agents of homes that no longer exist left in node memory and the kernel.

A node agent keeps three node-wide directories named ``dsec-<node>-<8 hex of its home's path>``
(``Settings._node_tag``): its egress maps pinned in bpffs (``/sys/fs/bpf``), their plans in
``/run``, and its agents' state journals in ``/dev/shm``. ``dsec down`` removes them; a node
agent that was killed, or a home deleted while its stack ran (a test run's temporary home),
leaves them behind, and nothing else would ever read or remove them: the pinned hash maps hold
kernel memory, the journals RAM.

Each directory carries an ``owner`` file naming its home (bpffs takes no files: the ``/run``
directory's speaks for it). At start, a node agent removes the directories of other homes
that are gone, when

* the ``owner`` file names a path that no longer exists, and nothing was written there for
  ``min_age_s`` (a node agent just starting has not pinned or written yet);
* for the pinned maps: no loaded BPF program uses them. Programs attached to the cgroups of
  sandboxes still running keep their maps, whatever happened to the home (fail-closed: their
  egress stays enforced until the sandboxes end).

Directories without an ``owner`` file (a custom ``DSEC_BPF_PIN_DIR``, or made before this
existed) are left alone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

OWNER = "owner"
_TAG = re.compile(r"dsec-[A-Za-z0-9_-]{1,64}-[0-9a-f]{8}")


def claim(directory: Path, home: Path) -> None:
    """Write ``directory``'s ``owner`` file (the home's absolute path), atomically."""
    owner = directory / OWNER
    text = str(home.absolute())
    with contextlib.suppress(OSError):
        if owner.read_text() == text:
            return
    tmp = directory / f".{OWNER}.{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, owner)


def release(directory: Path) -> None:
    """Remove ``directory`` if nothing but its ``owner`` file is left in it."""
    with contextlib.suppress(OSError):
        if {p.name for p in directory.iterdir()} <= {OWNER}:
            with contextlib.suppress(FileNotFoundError):
                (directory / OWNER).unlink()
            directory.rmdir()


@dataclass
class Swept:
    journals: list[str] = field(default_factory=list)
    egress: list[str] = field(default_factory=list)
    kept_in_use: list[str] = field(default_factory=list)


def _owner(directory: Path) -> tuple[str, float]:
    """The home an ``owner`` file names and its mtime. In ``/dev/shm`` anyone may have made
    the directory: only a plain file is read (a FIFO would hold the start up), never through
    a link, and no more than a path's worth."""
    fd = os.open(directory / OWNER, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{directory / OWNER} is not a plain file")
        return os.read(fd, 4097).decode("utf-8", "replace"), st.st_mtime
    finally:
        os.close(fd)


def _gone(home: str) -> bool:
    """Whether ``home`` no longer exists: only "no such file" says so. A home that cannot be
    looked at right now (NFS with root_squash: EACCES; a stale handle, a failing disk) may be
    a live node's."""
    try:
        os.stat(home)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except (OSError, ValueError):
        return False
    return False


def _abandoned(directory: Path, min_age_s: float, now: float) -> bool:
    try:
        home, owner_mtime = _owner(directory)
        age = now - max(directory.stat().st_mtime, owner_mtime)
    except OSError:
        return False
    return home.startswith("/") and len(home) <= 4096 and age >= min_age_s and _gone(home)


def _maps_in_use(pins: Path) -> bool:
    """Whether a loaded program uses any map pinned under ``pins`` (fail-closed: errors say
    yes)."""
    from dsec_nodeagent.ebpf import libbpf

    try:
        wanted = set()
        for pin in pins.rglob("*"):
            if pin.is_file():  # a pinned object (bpffs shows them as files)
                fd = libbpf.obj_get(pin)
                try:
                    wanted.add(libbpf.map_id(fd))
                finally:
                    os.close(fd)
        if not wanted:
            return False
        return any(wanted & set(libbpf.prog_map_ids(p)[1]) for p in libbpf.loaded_prog_ids())
    except OSError as exc:
        log.warning("leftovers: cannot tell whether %s is in use (%s); kept", pins, exc)
        return True


def sweep(
    mine: str,
    *,
    shm: Path = Path("/dev/shm"),
    run: Path = Path("/run"),
    bpffs: Path = Path("/sys/fs/bpf"),
    min_age_s: float = 600.0,
) -> Swept:
    """Remove what node agents of vanished homes left (see the module's docstring); ``mine``
    is this node agent's own directory name (``dsec-<node>-<hash>``), never touched."""
    done = Swept()
    now = time.time()
    for root in (shm, run):
        with contextlib.suppress(OSError):
            for directory in root.iterdir():
                name = directory.name
                if name == mine or not _TAG.fullmatch(name) or directory.is_symlink():
                    continue
                if not _abandoned(directory, min_age_s, now):
                    continue
                if root == shm:
                    shutil.rmtree(directory, ignore_errors=True)
                    done.journals.append(name)
                    continue
                pins = bpffs / name
                if pins.is_dir() and _maps_in_use(pins):
                    done.kept_in_use.append(name)
                    continue
                shutil.rmtree(pins, ignore_errors=True)
                shutil.rmtree(directory, ignore_errors=True)
                done.egress.append(name)
    if done.journals or done.egress or done.kept_in_use:
        log.info(
            "leftovers of vanished homes: removed %d state journal(s) %s and %d egress pin "
            "set(s) %s; kept %s (programs attached to running sandboxes use them)",
            len(done.journals),
            done.journals,
            len(done.egress),
            done.egress,
            done.kept_in_use,
        )
    return done
