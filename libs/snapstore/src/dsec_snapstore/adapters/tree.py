"""Writing snapshot files into a local tree: no write through a symlink, atomic replaces."""

from __future__ import annotations

import os
import shutil
from pathlib import Path, PurePosixPath

from dsec_core import codebundle
from dsec_core.codebundle import FileEntry, TreeEntry

from dsec_snapstore import domain
from dsec_snapstore.errors import InvalidInput, VerificationFailed


def local_bytes(entry: TreeEntry) -> bytes:
    """The content of a local file (the target text of a link), never following a final link."""
    if entry.kind == "symlink":
        return os.fsencode(entry.target or "")
    fd = os.open(entry.abspath, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def real_parent(root: Path, rel_text: str, checked: set[PurePosixPath]) -> Path:
    """Create the parents of ``rel_text`` under ``root``; refuse a symlink or file on the way."""
    try:
        rel = domain.validate_member_path(rel_text)
    except InvalidInput as exc:
        raise VerificationFailed("manifest", [str(exc)]) from None
    try:
        return codebundle.real_parent(root, rel, checked)
    except NotADirectoryError as exc:
        raise InvalidInput(f"{root / rel}: {exc}") from None


def place(
    entry: FileEntry, target: str | Path, data: bytes, *, replace: bool, umask: int | None = None
) -> None:
    """Write one file or link; with ``replace`` via a temporary name and an atomic rename.

    ``umask``: the process's umask when known; a file whose mode it leaves intact is created
    with that mode (no ``fchmod``), else it is created private and given its mode after.
    """
    target = os.fspath(target)
    if replace:
        head, _, name = target.rpartition("/")
        path = f"{head}/.{name}.dsec-{os.getpid()}"
    else:
        path = target
    if entry.kind == "symlink":
        os.symlink(entry.target or "", path)
    else:
        exact = umask is not None and not entry.mode & umask
        fd = os.open(path, _CREATE, entry.mode if exact else 0o600)
        try:
            if data:
                _write_all(fd, data)
            if not exact:
                os.fchmod(fd, entry.mode)
        finally:
            os.close(fd)
    if replace:
        if os.path.isdir(target) and not os.path.islink(target):
            shutil.rmtree(target)  # a directory where the snapshot has a file
        os.replace(path, target)


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
