"""A node agent removes what node agents of vanished homes left in node memory and the kernel,
and never what a running sandbox still uses (root, BCC)."""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from dsec_nodeagent import leftovers
from dsec_nodeagent.ebpf.kernel import EgressKernel

pytestmark = pytest.mark.kernel

HOUR_AGO = 3600.0


def node_dir(root: Path, name: str, home: Path | None, *, age_s: float = HOUR_AGO) -> Path:
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "state").mkdir()
    if home is not None:
        leftovers.claim(directory, home)
    then = os.path.getmtime(directory) - age_s
    for path in (directory, directory / leftovers.OWNER):
        if path.exists():
            os.utime(path, (then, then))
    return directory


def test_journals_of_vanished_homes_go_and_every_other_directory_stays(tmp_path: Path) -> None:
    shm, run, bpffs = tmp_path / "shm", tmp_path / "run", tmp_path / "bpffs"
    for root in (shm, run, bpffs):
        root.mkdir()
    home = tmp_path / "home"
    home.mkdir()
    gone = tmp_path / "deleted-home"
    node_dir(shm, "dsec-node-1-aaaaaaaa", gone)
    kept = {
        node_dir(shm, "dsec-node-1-bbbbbbbb", home),  # its home is there (a stopped node)
        node_dir(shm, "dsec-node-1-cccccccc", gone, age_s=0),  # just written: may be starting
        node_dir(shm, "dsec-node-1-dddddddd", None),  # no owner file: not ours to judge
        node_dir(shm, "dsec-node-1-eeeeeeee", gone),  # this node agent's own
        node_dir(shm, "unrelated-ffffffff", gone),  # not a node directory's name
    }
    swept = leftovers.sweep("dsec-node-1-eeeeeeee", shm=shm, run=run, bpffs=bpffs)
    assert swept.journals == ["dsec-node-1-aaaaaaaa"]
    assert {p for p in shm.iterdir()} == kept


def test_pinned_maps_go_only_once_no_program_uses_them(tmp_path: Path) -> None:
    name = f"dsec-gone-{uuid.uuid4().hex[:8]}"
    run, shm = tmp_path / "run", tmp_path / "shm"
    shm.mkdir()
    node_dir(run, name, tmp_path / "deleted-home")
    pins = Path("/sys/fs/bpf") / name
    kernel = EgressKernel(pins / "egress")
    try:
        kernel.load()  # its programs (held here, as by a sandbox's cgroup) use the pinned maps
        swept = leftovers.sweep("dsec-me-00000000", shm=shm, run=run)
        assert swept.kept_in_use == [name] and swept.egress == []
        assert (pins / "egress" / "sandboxes").exists() and (run / name).is_dir()
        kernel.close()  # the programs are gone: nothing enforces with these maps any more
        swept = leftovers.sweep("dsec-me-00000000", shm=shm, run=run)
        assert swept.egress == [name]
        assert not pins.exists() and not (run / name).exists()
    finally:
        kernel.close()
        shutil.rmtree(pins, ignore_errors=True)


def test_a_directory_holding_only_its_owner_file_is_released(tmp_path: Path) -> None:
    directory = tmp_path / "dsec-node-1-12345678"
    directory.mkdir()
    leftovers.claim(directory, tmp_path)
    (directory / "egress").mkdir()
    leftovers.release(directory)
    assert directory.is_dir()  # something still in it
    (directory / "egress").rmdir()
    leftovers.release(directory)
    assert not directory.exists()


def test_an_owner_file_another_user_made_a_fifo_does_not_hold_up_the_start(
    tmp_path: Path,
) -> None:
    # /dev/shm is everyone's: a local user makes a node-like directory whose owner is a FIFO
    shm, run = tmp_path / "shm", tmp_path / "run"
    run.mkdir()
    planted = shm / "dsec-evil-12345678"
    planted.mkdir(parents=True)
    os.mkfifo(planted / leftovers.OWNER)
    done = threading.Event()
    worker = threading.Thread(
        target=lambda: (leftovers.sweep("dsec-me-00000000", shm=shm, run=run), done.set()),
        daemon=True,
    )
    worker.start()
    try:
        assert done.wait(30), "the sweep (and so the node agent's start) waits on the FIFO"
    finally:
        if not done.is_set():  # let the blocked reader go
            os.close(os.open(planted / leftovers.OWNER, os.O_WRONLY | os.O_NONBLOCK))
            worker.join(10)


def test_a_home_that_cannot_be_looked_at_now_is_not_a_vanished_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A home on NFS with root_squash (EACCES for root), a stale handle (ESTALE) or a failing
    # disk (EIO) is still someone's: only "no such file" says the home is gone.
    shm, run = tmp_path / "shm", tmp_path / "run"
    run.mkdir()
    home = tmp_path / "nfs-home"
    home.mkdir()
    live = node_dir(shm, "dsec-node-2-aaaaaaaa", home)
    real_stat = os.stat

    def stat(path: Any, *args: Any, **kwargs: Any) -> os.stat_result:
        if os.fspath(path) == str(home):
            raise PermissionError(13, "Permission denied", str(home))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", stat)
    swept = leftovers.sweep("dsec-me-00000000", shm=shm, run=run)
    monkeypatch.undo()
    assert swept.journals == [] and (live / "state").is_dir()
