"""The pre-exec stage's own wrappers over calls Python lacks, where a mistake would widen a
sandbox: paths resolved inside a root view before ``pivot_root`` must never lead out of it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dsec_nodeagent.sandbox import syscalls


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
