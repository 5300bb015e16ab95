"""The pre-exec stage's own wrappers over calls Python lacks, where a mistake would widen a
sandbox: paths resolved inside a root view before ``pivot_root`` must never lead out of it,
device nodes are made inside the sandbox's /dev only."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from dsec_nodeagent.sandbox import SandboxConfig, init, syscalls


def _same(fd: int, path: Path) -> bool:
    st, want = os.fstat(fd), path.stat()
    return (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino)


@pytest.mark.unit
def test_paths_resolved_in_a_root_view_never_lead_out_of_it(tmp_path: Path) -> None:
    # The Landlock ruleset is built before init pivots to the root view (init.py,
    # _build_landlock): an absolute symlink or a ".." in the view must resolve in the view, as
    # it will once the view is "/", not on the host.
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    (root / "data").mkdir()
    (root / "lib").symlink_to("/etc")  # absolute: the view's /etc
    (root / "up").symlink_to("../../..")  # tries to climb out
    root_fd = os.open(root, os.O_PATH | os.O_DIRECTORY)
    try:
        for path, inside in (
            ("/lib", root / "etc"),
            ("lib", root / "etc"),
            ("/up/data", root / "data"),
            ("/../../data", root / "data"),
        ):
            fd = syscalls.open_in_root(root_fd, path, os.O_PATH)
            try:
                assert _same(fd, inside), path
            finally:
                os.close(fd)
        with pytest.raises(FileNotFoundError):  # the host's /proc is not in the view
            syscalls.open_in_root(root_fd, "/proc/self", os.O_PATH)
    finally:
        os.close(root_fd)


@pytest.mark.kernel
def test_device_nodes_are_made_below_the_sandboxs_dev_only(tmp_path: Path) -> None:
    # /dev of a root view (a tmpfs in a private mount namespace): the host's device numbers
    # and modes, a nested name's directory 0755, and a name that climbs out refused before
    # anything is made (the config refuses it first: test_a_device_name_that_climbs_is_refused).
    dev = tmp_path / "dev"
    dev.mkdir()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # (the namespace and its tmpfs end with this process)
        result = b"ok"
        try:
            syscalls.unshare(syscalls.CLONE_NEWNS)
            syscalls.mount(None, "/", None, syscalls.MS_REC | syscalls.MS_PRIVATE, None)
            syscalls.mount("tmpfs", str(dev), "tmpfs", syscalls.MS_NOSUID, "size=64k")
            init._dev_nodes(str(dev), ["null", "net/tun"])
            for name in ("null", "net/tun"):
                here, host = os.lstat(dev / name), os.stat(f"/dev/{name}")
                assert (here.st_rdev, here.st_mode) == (host.st_rdev, host.st_mode), name
            assert stat.S_IMODE(os.lstat(dev / "net").st_mode) == 0o755
            try:
                init._dev_nodes(str(dev), ["../escaped"])
                result = b"a climbing name was made"
            except OSError as exc:
                assert exc.errno == errno.EINVAL
            assert not (tmp_path / "escaped").exists()
        except BaseException as exc:  # reported to the parent
            result = repr(exc).encode()
        os.write(write, result)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as fh:
        outcome = fh.read()
    os.waitpid(pid, 0)
    assert outcome == b"ok"
    assert os.listdir(dev) == []  # nothing of it on the host


@pytest.mark.unit
def test_a_device_name_that_climbs_is_refused(tmp_path: Path) -> None:
    base = {"sandbox_id": "s", "argv": ["python"], "runtime": "/usr/bin/python3"}
    ok = SandboxConfig(**base, gpu_devices=["nvidia0", "nvidia-caps/nvidia-cap1", "dri/card0"])
    assert ok.gpu_devices[1] == "nvidia-caps/nvidia-cap1"
    for bad in ("../../../../dev/null", "a/../b", ".hidden", "a/b/c", "/abs", ""):
        with pytest.raises(ValidationError, match="not a device name under /dev"):
            SandboxConfig(**base, gpu_devices=[bad])
