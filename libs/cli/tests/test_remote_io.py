"""The CLI's side of ``dsec sandbox cp``: what a copy out of a sandbox writes here (the node
is not trusted with this machine's files), what a copy into one reads, how ``ID:/path`` is
told from a local path."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsec_cli.remote_io import (
    Copied,
    CopyError,
    _get_destination,
    _LocalWriter,
    _walk,
    split_remote,
)

pytestmark = pytest.mark.unit


def test_remote_and_local_paths_are_told_apart() -> None:
    assert split_remote("sbx_01ab:/tmp/out") == ("sbx_01ab", "/tmp/out")
    assert split_remote("./sbx_01ab:/tmp") is None
    assert split_remote("C:/data") is None
    assert split_remote("/tmp/file") is None


def test_a_tree_is_written_below_the_destination(tmp_path: Path) -> None:
    copied = Copied()
    writer = _LocalWriter(tmp_path / "out", copied)
    try:
        writer.entry("dir", "", 0o755)
        writer.entry("file", "a.txt", 0o640)
        writer.data(b"hello ")
        writer.data(b"there")
        writer.entry("dir", "sub", 0o755)
        writer.entry("file", "sub/b", 0o644)
    finally:
        writer.close()
    assert (tmp_path / "out" / "a.txt").read_text() == "hello there"
    assert (tmp_path / "out" / "a.txt").stat().st_mode & 0o777 == 0o640
    assert (tmp_path / "out" / "sub" / "b").read_bytes() == b""
    assert (copied.files, copied.bytes) == (4, 11)


def test_a_link_in_the_destination_is_not_written_through(tmp_path: Path) -> None:
    """The node sends ``d/victim`` where the local destination already has ``d`` -> elsewhere,
    or names a file where a link stands: neither is followed."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "victim").write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    (out / "d").symlink_to(elsewhere)
    (out / "f").symlink_to(elsewhere / "victim")

    writer = _LocalWriter(out, Copied())
    try:
        writer.entry("dir", "", 0o755)
        with pytest.raises(CopyError, match="not followed"):
            writer.entry("file", "d/victim", 0o644)
        with pytest.raises(CopyError, match="cannot write f"):
            writer.entry("file", "f", 0o644)
    finally:
        writer.close()
    assert (elsewhere / "victim").read_text() == "mine"


def test_a_copy_must_start_at_its_top(tmp_path: Path) -> None:
    writer = _LocalWriter(tmp_path / "out", Copied())
    try:
        with pytest.raises(CopyError, match="top entry"):
            writer.entry("file", "x", 0o644)
    finally:
        writer.close()


def test_into_an_existing_directory_the_copy_lands_inside(tmp_path: Path) -> None:
    assert _get_destination("/tmp/out", tmp_path) == tmp_path / "out"
    assert _get_destination("/tmp/out", tmp_path / "new") == tmp_path / "new"
    with pytest.raises(CopyError, match="not a directory"):
        _get_destination("/tmp/out", tmp_path / "missing" / "new")


def test_what_is_sent_skips_links_and_puts_parents_first(tmp_path: Path) -> None:
    top = tmp_path / "top"
    (top / "b" / "c").mkdir(parents=True)
    (top / "a.txt").write_text("a")
    (top / "b" / "c" / "d.txt").write_text("d")
    (top / "b" / "link").symlink_to("/etc/passwd")
    (top / "dirlink").symlink_to(tmp_path)
    copied = Copied()

    found = [rel for rel, _, _ in _walk(top, copied)]

    assert found == ["", "a.txt", "b", "b/c", "b/c/d.txt"]
    assert sorted(copied.skipped) == ["b/link", "dirlink"]
