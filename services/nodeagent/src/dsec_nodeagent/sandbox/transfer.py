"""Files in and out of a running sandbox (``dsec sandbox cp``), copied from inside it.

The node agent starts this through the exec path (:func:`.init.exec_into`): the copier joins the
sandbox's namespaces and cgroups and takes its uid, Landlock ruleset and seccomp filter, then
calls :func:`serve` instead of ``execve``. So it sees the sandbox's root view (an absolute symlink
points into the sandbox, never at the host), writes only where the sandbox may, as the sandbox.
On top of that it goes only where the spec says a copy may (``read_dirs``: the workdir and the
``write_allowed`` paths; ``write_dirs``: the ``write_allowed`` paths), opens every component of
a path with ``O_NOFOLLOW`` from ``/`` down (a symlink anywhere on the way is refused, not
followed: a link in ``/tmp`` to ``/etc/shadow`` is not a way out of ``/tmp``), copies regular
files and directories only (symlinks, fifos, devices are skipped and named) and stops at the
size limits.

Standard library only, imported before the mount namespace is joined (nothing can be imported
after). The copier and the node agent speak records on the copier's stdin/stdout: a type byte,
a 4-byte big-endian length, the payload::

    D  a directory: 4-byte mode, then its path relative to the top ("" is the top itself)
    F  a regular file: the same; its bytes follow as B records
    B  bytes of the file named last
    X  skipped (a symlink or a special file): its relative path
    E  the end: empty when all went well, else what went wrong (UTF-8)

The node agent reads what the copier writes as untrusted (a process of the sandbox has its uid).
"""

from __future__ import annotations

import errno
import os
import stat
import struct

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Iterator
    from typing import Any

HEADER = struct.Struct(">cI")
MODE = struct.Struct(">I")
CHUNK = 32 * 1024
MAX_RECORD = CHUNK + 8192
MAX_DEPTH = 64
KINDS = frozenset((b"D", b"F", b"B", b"X", b"E"))
_DIR = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""A directory to walk through (O_PATH: Landlock does not ask to read ``/`` on the way)."""
_LIST = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
"""A directory to list (inside a directory the copy may read, so Landlock allows it)."""
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class TransferError(Exception):
    """What a copy cannot do, in words for the user."""


# ----------------------------------------------------------------------------- records


def record(kind: bytes, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, len(payload)) + payload


def entry(kind: bytes, mode: int, path: str) -> bytes:
    """A D or F record."""
    return record(kind, MODE.pack(mode & 0o7777) + path.encode())


def parse_entry(payload: bytes) -> tuple[int, str]:
    """``(mode, relative path)`` of a D or F record; :class:`TransferError` when malformed."""
    if len(payload) < MODE.size:
        raise TransferError("an entry record without its mode")
    try:
        path = payload[MODE.size :].decode()
    except UnicodeDecodeError:
        raise TransferError("an entry path that is not UTF-8") from None
    return MODE.unpack_from(payload)[0] & 0o7777, relative(path)


def relative(path: str) -> str:
    """``path`` when it is a plain relative path (no ``..``, ``.``, empty component, NUL)."""
    if "\0" in path or len(path.encode()) > 4096:
        raise TransferError(f"{path[:200]!r} is not a valid path")
    if path and any(p in ("", ".", "..") for p in path.split("/")):
        raise TransferError(f"{path[:200]!r} is not a plain relative path")
    return path


class Reader:
    """Records out of a byte stream, as it arrives."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """The records completed by ``data``; :class:`TransferError` on a malformed stream."""
        self._buf += data
        out: list[tuple[bytes, bytes]] = []
        while len(self._buf) >= HEADER.size:
            kind, size = HEADER.unpack_from(self._buf)
            if kind not in KINDS or size > MAX_RECORD:
                raise TransferError("a malformed record in the copy stream")
            end = HEADER.size + size
            if len(self._buf) < end:
                break
            out.append((kind, bytes(self._buf[HEADER.size : end])))
            del self._buf[:end]
        return out

    @property
    def pending(self) -> int:
        return len(self._buf)


# ----------------------------------------------------------------------------- the copier


def under(path: str, base: str) -> bool:
    return base == "/" or path == base or path.startswith(base.rstrip("/") + "/")


def allowed(path: str, dirs: list[str], verb: str) -> None:
    """Refuse ``path`` unless inside one of ``dirs``, naming them (and any ``..``: a path is
    compared as written, never resolved)."""
    if not path.startswith("/") or "\0" in path or ".." in path.split("/"):
        raise TransferError(f"{path[:200]!r} is not an absolute path without '..'")
    if not any(under(path, d) for d in dirs):
        named = ", ".join(dirs) or "none"
        raise TransferError(f"{path} is outside the directories a copy may {verb} ({named})")


def _open_dir(path: str) -> int:
    """An fd of the directory ``path``, each component opened with O_NOFOLLOW from ``/``."""
    fd = os.open("/", _DIR)
    done = ""
    for part in path.split("/"):
        if not part:
            continue
        done += "/" + part
        try:
            child = os.open(part, _DIR, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            raise _located(exc, done) from None
        os.close(fd)
        fd = child
    return fd


def _located(exc: OSError, path: str) -> TransferError:
    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return TransferError(f"{path} is a symlink or not a directory; not followed")
    return TransferError(f"{path}: {os.strerror(exc.errno or 0)}")


def _split(path: str) -> tuple[str, str]:
    parent, _, name = path.rpartition("/")
    return parent or "/", name


class _Out:
    """Records to the node agent, within the limits."""

    def __init__(self, fd: int, max_bytes: int, max_files: int) -> None:
        self.fd = fd
        self.max_bytes = max_bytes
        self.max_files = max_files
        self.bytes = 0
        self.files = 0

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def entry(self, kind: bytes, mode: int, path: str) -> None:
        self.files += 1
        if self.files > self.max_files:
            raise TransferError(f"more than {self.max_files} files and directories")
        self.send(entry(kind, mode, path))

    def data(self, data: bytes) -> None:
        self.bytes += len(data)
        if self.bytes > self.max_bytes:
            raise TransferError(f"more than {self.max_bytes} bytes")
        self.send(record(b"B", data))


def serve(spec: dict[str, Any], inp: int = 0, out: int = 1) -> int:
    """Copy as ``spec`` says (``op`` get or put, ``path``, ``name`` of a put, ``read_dirs``,
    ``write_dirs``, ``max_bytes``, ``max_files``); the last record is E. Returns the exit code."""
    writer = _Out(out, spec["max_bytes"], spec["max_files"])
    try:
        if spec["op"] == "get":
            _get(spec, writer)
        else:
            _put(spec, _records(inp), writer)
    except (TransferError, OSError) as exc:
        if isinstance(exc, TransferError):
            text = str(exc)
        else:
            text = f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc.strerror or exc)
        writer.send(record(b"E", text.encode()[:2000] or b"failed"))
        return 1
    writer.send(record(b"E"))
    return 0


def _get(spec: dict[str, Any], out: _Out) -> None:
    path = spec["path"]
    allowed(path, spec["read_dirs"], "read")
    parent_path, name = _split(path)
    parent = _open_dir(parent_path)
    try:
        if not name:  # "/" itself
            _send_dir(os.open("/", _LIST), "", out, 0)
            return
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except OSError as exc:
            raise _located(exc, path) from None
        if stat.S_ISLNK(st.st_mode):
            raise TransferError(f"{path} is a symlink; not followed")
        if stat.S_ISREG(st.st_mode):
            _send_file(parent, name, "", out)
        elif stat.S_ISDIR(st.st_mode):
            _send_dir(os.open(name, _LIST, dir_fd=parent), "", out, 0)
        else:
            raise TransferError(f"{path} is neither a regular file nor a directory")
    finally:
        os.close(parent)


def _send_file(parent: int, name: str, rel: str, out: _Out) -> None:
    fd = os.open(name, _READ, dir_fd=parent)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced since it was looked at
            out.send(record(b"X", rel.encode()))
            return
        os.set_blocking(fd, True)
        out.entry(b"F", st.st_mode, rel)
        while data := os.read(fd, CHUNK):
            out.data(data)
    finally:
        os.close(fd)


def _send_dir(fd: int, rel: str, out: _Out, depth: int) -> None:
    """Send the directory open at ``fd`` (closed here) and what it holds."""
    try:
        if depth > MAX_DEPTH:
            raise TransferError(f"{rel} is nested more than {MAX_DEPTH} directories deep")
        out.entry(b"D", os.fstat(fd).st_mode, rel)
        with os.scandir(fd) as listing:
            names = sorted(e.name for e in listing)
        for name in names:
            child = f"{rel}/{name}" if rel else name
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed meanwhile
            if stat.S_ISREG(st.st_mode):
                _send_file(fd, name, child, out)
            elif stat.S_ISDIR(st.st_mode):
                try:
                    sub = os.open(name, _LIST, dir_fd=fd)
                except OSError:  # replaced by a link meanwhile
                    out.send(record(b"X", child.encode()))
                    continue
                _send_dir(sub, child, out, depth + 1)
            else:
                out.send(record(b"X", child.encode()))
    finally:
        os.close(fd)


def _records(fd: int) -> Iterator[tuple[bytes, bytes]]:
    reader = Reader()
    while data := os.read(fd, 65536):
        yield from reader.feed(data)
    if reader.pending:
        raise TransferError("the copy stream ended inside a record")


def _put(spec: dict[str, Any], records: Iterator[tuple[bytes, bytes]], out: _Out) -> None:
    path, name = spec["path"], relative(spec["name"])
    if not name or "/" in name:
        raise TransferError(f"{name!r} is not a file name")
    allowed(path, spec["write_dirs"], "write")
    parent_path, last = _split(path)
    parent = _open_dir(parent_path)
    try:
        st = os.stat(last, dir_fd=parent, follow_symlinks=False) if last else None
    except FileNotFoundError:
        st = None
    except OSError as exc:
        os.close(parent)
        raise _located(exc, path) from None
    if st is not None and stat.S_ISLNK(st.st_mode):
        os.close(parent)
        raise TransferError(f"{path} is a symlink; not followed")
    if (st is not None and stat.S_ISDIR(st.st_mode)) or not last:  # into it, as cp does
        into = _open_dir(path)
        os.close(parent)
        parent, last = into, name
    writer = _Writer(parent, last, out)
    try:
        for kind, payload in records:
            if kind == b"E":
                return
            writer.take(kind, payload)
        raise TransferError("the copy stream ended without its end record")
    finally:
        writer.close()


class _Writer:
    """Creates what the records describe below (``parent``, ``top``), never through a link."""

    def __init__(self, parent: int, top: str, out: _Out) -> None:
        self.parent = parent
        self.top = top
        self.out = out
        self.file: int | None = None

    def _locate(self, rel: str) -> tuple[int, str]:
        """``(fd of the parent directory, name)`` of ``rel`` (an fd the caller closes)."""
        parts = [self.top, *rel.split("/")] if rel else [self.top]
        fd = os.dup(self.parent)
        done: list[str] = []
        for part in parts[:-1]:
            done.append(part)
            try:
                child = os.open(part, _DIR, dir_fd=fd)
            except OSError as exc:
                os.close(fd)
                raise _located(exc, "/".join(done)) from None
            os.close(fd)
            fd = child
        return fd, parts[-1]

    def take(self, kind: bytes, payload: bytes) -> None:
        if kind == b"B":
            if self.file is None:
                raise TransferError("file bytes before any file")
            self.out.bytes += len(payload)
            if self.out.bytes > self.out.max_bytes:
                raise TransferError(f"more than {self.out.max_bytes} bytes")
            view = memoryview(payload)
            while view:
                view = view[os.write(self.file, view) :]
            return
        if kind not in (b"D", b"F"):
            raise TransferError("an unexpected record in the copy stream")
        self._close_file()
        mode, rel = parse_entry(payload)
        self.out.files += 1
        if self.out.files > self.out.max_files:
            raise TransferError(f"more than {self.out.max_files} files and directories")
        fd, leaf = self._locate(rel)
        try:
            if kind == b"D":
                try:
                    os.mkdir(leaf, (mode & 0o777) | 0o700, dir_fd=fd)
                except FileExistsError:
                    os.close(os.open(leaf, _DIR, dir_fd=fd))  # a real directory, or refused
            else:
                self.file = os.open(leaf, _WRITE, (mode & 0o777) | 0o600, dir_fd=fd)
                if not stat.S_ISREG(os.fstat(self.file).st_mode):
                    raise TransferError(f"{rel or self.top} is not a regular file")
                os.set_blocking(self.file, True)
        except OSError as exc:
            raise _located(exc, rel or self.top) from None
        finally:
            os.close(fd)

    def _close_file(self) -> None:
        if self.file is not None:
            os.close(self.file)
            self.file = None

    def close(self) -> None:
        self._close_file()
        os.close(self.parent)
