"""Writing snapshot files into a local tree: no write through a symlink, atomic replaces."""

from __future__ import annotations

import os
import shutil
import stat
from collections import OrderedDict
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


class Parents:
    """Makes the parent directories of files written below ``root``, refusing any that is a
    symlink or not a directory (a write through it could land outside ``root``).

    Each directory is opened with ``O_NOFOLLOW | O_DIRECTORY`` relative to the one above it,
    as :func:`dsec_core.codebundle.open_real_dir` does, but the fds of the directories last
    used are kept (a manifest lists a directory's files together), so a new directory costs one
    ``mkdir`` and one ``open`` instead of a walk from the root. Close it when done.
    """

    _KEPT = 64  # directory fds held at most

    def __init__(self, root: Path) -> None:
        self.root = root
        self._root_fd: int | None = None
        self._fds: OrderedDict[PurePosixPath, int] = OrderedDict()

    def __enter__(self) -> Parents:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def close(self) -> None:
        """Close every fd held."""
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
        if self._root_fd is not None:
            os.close(self._root_fd)
            self._root_fd = None

    def make(self, rel_text: str) -> Path:
        """Create the parents of ``rel_text``; return the path to write it at.

        Raises:
            VerificationFailed: the path is absolute or escapes the root (the manifest is bad).
            InvalidInput: a parent is a symlink or not a directory.
        """
        try:
            rel = domain.validate_member_path(rel_text)
        except InvalidInput as exc:
            raise VerificationFailed("manifest", [str(exc)]) from None
        try:
            self._fd(rel.parent)
        except NotADirectoryError as exc:
            raise InvalidInput(f"{self.root / rel}: parent {exc}") from None
        return self.root / rel

    def _fd(self, rel: PurePosixPath) -> int:
        """The directory ``rel``'s fd: from the nearest directory above it that is held (or
        the root), each one below made and opened in turn."""
        missing: list[PurePosixPath] = []
        while rel.parts and rel not in self._fds:
            missing.append(rel)
            rel = rel.parent
        if rel.parts:
            fd = self._fds[rel]
            self._fds.move_to_end(rel)
        else:
            if self._root_fd is None:
                self._root_fd = os.open(self.root, codebundle.DIR_FLAGS)
            fd = self._root_fd
        for below in reversed(missing):
            fd = codebundle.open_child_dir(fd, below.name, below, create=True)
            self._fds[below] = fd
            if len(self._fds) > self._KEPT:  # (the oldest: never the one just opened above)
                os.close(self._fds.popitem(last=False)[1])
        return fd


def place(
    entry: FileEntry,
    target: str | Path,
    data: bytes,
    *,
    replace: bool,
    umask: int | None = None,
    dir_fd: int | None = None,
) -> None:
    """Write one file or link; with ``replace`` via a temporary name and an atomic rename.

    ``umask``: the process's umask when known; a file whose mode it leaves intact is created
    with that mode (no ``fchmod``), else it is created private and given its mode after.
    ``dir_fd``: ``target`` is a name in that directory (see :func:`place_in`).
    """
    target = os.fspath(target)
    if replace:
        head, slash, name = target.rpartition("/")
        path = f"{head}{slash}.{name}.dsec-{os.getpid()}"
    else:
        path = target
    if entry.kind == "symlink":
        os.symlink(entry.target or "", path, dir_fd=dir_fd)
    else:
        exact = umask is not None and not entry.mode & umask
        fd = os.open(path, _CREATE, entry.mode if exact else 0o600, dir_fd=dir_fd)
        try:
            if data:
                _write_all(fd, data)
            if not exact:
                os.fchmod(fd, entry.mode)
        finally:
            os.close(fd)
    if replace:
        try:
            here = os.stat(target, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            here = None
        if here is not None and stat.S_ISDIR(here.st_mode):
            shutil.rmtree(target, dir_fd=dir_fd)  # a directory where the snapshot has a file
        os.replace(path, target, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


def place_in(root_fd: int, entry: FileEntry, data: bytes, *, umask: int | None = None) -> None:
    """Replace ``entry.path`` below the directory ``root_fd`` (a rollback), its parents opened
    one by one without following a link: a sandbox running in the tree that swaps a directory
    for a symlink while the rollback runs gets nothing written, replaced or removed outside."""
    rel = PurePosixPath(entry.path)
    try:
        parent = codebundle.open_real_dir(root_fd, rel.parent, create=True)
    except NotADirectoryError as exc:
        raise InvalidInput(f"{entry.path}: {exc} (changed while the rollback ran)") from None
    try:
        place(entry, rel.name, data, replace=True, umask=umask, dir_fd=parent)
    finally:
        os.close(parent)


def remove_in(root_fd: int, rel_text: str) -> None:
    """Remove the file or link ``rel_text`` below ``root_fd`` (missing: nothing to do), its
    parents opened without following a link (a parent that is no longer a real directory holds
    nothing of the tree)."""
    rel = PurePosixPath(rel_text)
    try:
        parent = codebundle.open_real_dir(root_fd, rel.parent)
    except (FileNotFoundError, NotADirectoryError):
        return
    try:
        os.unlink(rel.name, dir_fd=parent)
    except FileNotFoundError:
        pass
    finally:
        os.close(parent)


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
