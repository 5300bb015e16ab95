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


def place(entry: FileEntry, target: Path, data: bytes, *, replace: bool) -> None:
    """Write one file or link; with ``replace`` via a temporary name and an atomic rename."""
    path = target.with_name(f".{target.name}.dsec-{os.getpid()}") if replace else target
    if entry.kind == "symlink":
        os.symlink(entry.target or "", path)
    else:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            os.fchmod(fh.fileno(), entry.mode)
    if replace:
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)  # a directory where the snapshot has a file
        os.replace(path, target)
