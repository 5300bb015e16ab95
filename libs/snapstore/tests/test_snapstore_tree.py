"""Making a restore's parent directories: no symlink or file followed, every fd given back."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

from dsec_snapstore.adapters.tree import Parents
from dsec_snapstore.errors import InvalidInput, VerificationFailed


def open_fds() -> int:
    """This process's open fds, after a collection: an earlier test's unreachable socket or
    file, closed by the collector mid-test, made a count here drop (CI, 2026-12-06)."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def test_parents_are_made_once_each_and_every_fd_is_closed(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    before = open_fds()
    paths = [f"d{n % 90}/e{n % 7}/f{n}.py" for n in range(600)]  # more directories than kept
    with Parents(root) as made:
        targets = [made.make(p) for p in paths]
        assert open_fds() > before  # (the directories last used stay open)
    assert open_fds() == before
    assert targets == [root / p for p in paths]
    made_dirs = {str(p.relative_to(root)) for p in root.rglob("*")}
    assert made_dirs == {p.rsplit("/", 1)[0] for p in paths} | {p.split("/")[0] for p in paths}


def test_a_parent_that_is_a_link_or_a_file_is_refused_and_nothing_made_through_it(
    tmp_path: Path,
) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "d").mkdir()
    (root / "d" / "link").symlink_to(outside)
    (root / "file").write_text("x")
    before = open_fds()
    with Parents(root) as made:
        made.make("d/ok/a.py")
        with pytest.raises(InvalidInput, match="d/link is a symlink or not a directory"):
            made.make("d/link/sub/a.py")
        with pytest.raises(InvalidInput, match="file is a symlink or not a directory"):
            made.make("file/a.py")
        with pytest.raises(VerificationFailed, match="escapes the root"):
            made.make("d/../../a.py")
        with pytest.raises(VerificationFailed, match="escapes the root"):
            made.make("/etc/a.py")
    assert open_fds() == before
    assert list(outside.iterdir()) == []
    assert (root / "d" / "ok").is_dir()
