"""dsec_snapstore._placefiles.write_files: the C writer of a fresh restore's files.

Its contract is place()'s for a new file: created exclusively, never through a link, with the
recorded mode (at creation when the umask keeps it, else by fchmod after the write), and the
first failure raised as the OSError os.open/os.write would raise, naming the path.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

try:
    from dsec_snapstore._placefiles import write_files
except ImportError:  # pragma: no cover - the fixture below says why
    write_files = None


@pytest.fixture(autouse=True)
def _built() -> None:
    assert write_files is not None, (
        "dsec-snapstore's C extension (dsec_snapstore._placefiles) is not built: `./taskw "
        "setup` needs a C compiler (gcc) and the interpreter's headers"
    )


def test_files_are_written_with_their_bytes_and_modes(tmp_path: Path) -> None:
    big = os.urandom(3 << 20)  # more than one write() may take at once on some filesystems
    old = os.umask(0o022)
    try:
        written = write_files(
            [
                (str(tmp_path / "a.py"), b"print(1)\n", 0o644, True),
                (str(tmp_path / "run.sh"), memoryview(b"#!/bin/sh\n")[:10], 0o755, True),
                (str(tmp_path / "big.bin"), big, 0o600, True),
                (str(tmp_path / "odd"), b"x", 0o4751, False),  # the umask would strip it
                (str(tmp_path / "empty"), b"", 0o640, True),
            ]
        )
    finally:
        os.umask(old)
    assert written == 9 + 10 + len(big) + 1
    assert (tmp_path / "a.py").read_bytes() == b"print(1)\n"
    assert (tmp_path / "big.bin").read_bytes() == big
    modes = {p.name: p.stat().st_mode & 0o7777 for p in tmp_path.iterdir()}
    assert modes == {"a.py": 0o644, "run.sh": 0o755, "big.bin": 0o600, "odd": 0o4751,
                     "empty": 0o640}  # fmt: skip


def test_an_existing_file_is_never_overwritten_and_the_error_names_it(tmp_path: Path) -> None:
    (tmp_path / "b").write_text("keep")
    with pytest.raises(FileExistsError) as caught:
        write_files(
            [(str(tmp_path / "a"), b"1", 0o644, True), (str(tmp_path / "b"), b"2", 0o644, True)]
        )
    assert caught.value.filename == str(tmp_path / "b")
    assert (tmp_path / "a").read_bytes() == b"1"  # written before the failure
    assert (tmp_path / "b").read_text() == "keep"


def test_a_link_at_the_path_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "x").symlink_to(outside)  # dangling: O_CREAT alone would create it
    with pytest.raises(FileExistsError):
        write_files([(str(tmp_path / "dest" / "x"), b"owned", 0o644, True)])
    assert not outside.exists()


def test_a_missing_directory_is_the_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as caught:
        write_files([(str(tmp_path / "no" / "such"), b"x", 0o644, True)])
    assert caught.value.errno == errno.ENOENT


@pytest.mark.parametrize(
    ("items", "error", "text"),
    [
        ("not a list", TypeError, "each item is"),
        ([("a", b"x", 0o644)], TypeError, "each item is"),
        ([("a", "text, not bytes", 0o644, True)], TypeError, "bytes-like"),
        ([("a\0b", b"x", 0o644, True)], ValueError, "null"),
        ([("a", b"x", 0o10000, True)], ValueError, "not a file mode"),
        ([("a", b"x", -1, True)], ValueError, "not a file mode"),
    ],
)
def test_bad_items_are_refused_before_anything_is_written(
    tmp_path: Path,
    items: object,
    error: type[Exception],
    text: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error, match=text):
        write_files(items)
    assert list(tmp_path.iterdir()) == []
