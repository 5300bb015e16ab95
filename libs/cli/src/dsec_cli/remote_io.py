"""The CLI's side of ``dsec sandbox exec --tty`` and ``dsec sandbox cp`` (protocol:
:mod:`dsec_core.remote`; sessions opened by :func:`dsec_cli.remote.session`).

A TTY exec puts the local terminal in raw mode (every key, Ctrl-C and Ctrl-D included, goes to
the sandbox's pseudo-terminal, which interprets them), sends the window size at start and on
each SIGWINCH, and writes the output unchanged. A copy streams entries (``dir``/``file``, a
path relative to the top, a mode) and 32 KiB data frames; what arrives is written under the
destination without ever following a link there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from dsec_core import remote

from dsec_cli.remote import Ended, Send, session

_TERM = re.compile(r"^[A-Za-z0-9._+-]{1,64}\Z")
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_WRITE = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC


class CopyError(Exception):
    """What a copy could not do on this side, in words for the user."""


# ----------------------------------------------------------------------------- tty


def _fileno(stream: Any) -> int:
    try:
        return int(stream.fileno())
    except (OSError, ValueError, AttributeError):  # a stream without a descriptor
        return -1


def terminal_size(*fds: int) -> tuple[int, int]:
    """``(rows, cols)`` of the first of ``fds`` that is a terminal, else 24x80."""
    for fd in fds:
        with contextlib.suppress(OSError):
            size = os.get_terminal_size(fd)
            if size.lines > 0 and size.columns > 0:
                return min(size.lines, 10_000), min(size.columns, 10_000)
    return 24, 80


async def exec_tty(sandbox_id: str, argv: list[str], stdin_fd: int, out: BinaryIO) -> Ended:
    """Run ``argv`` on a pseudo-terminal in the sandbox, this terminal in raw mode meanwhile
    (restored however the session ends)."""
    rows, cols = terminal_size(_fileno(out), stdin_fd)
    term = os.environ.get("TERM", "xterm")
    args = {
        "argv": argv,
        "tty": True,
        "rows": rows,
        "cols": cols,
        "term": term if _TERM.match(term) else "xterm",
    }
    saved: list[Any] | None = None
    loop = asyncio.get_running_loop()

    async def drive(send: Send) -> None:
        nonlocal saved
        if os.isatty(stdin_fd):  # only now that the node answered: errors before print plainly
            import termios
            import tty

            saved = termios.tcgetattr(stdin_fd)
            tty.setraw(stdin_fd, termios.TCSANOW)  # not TCSAFLUSH: keep what was typed ahead

        resizes: set[asyncio.Task[None]] = set()

        def resized() -> None:
            rows, cols = terminal_size(stdin_fd, _fileno(out))
            task = loop.create_task(send({"k": "resize", "rows": rows, "cols": cols}))
            resizes.add(task)
            task.add_done_callback(resizes.discard)

        with contextlib.suppress(ValueError, RuntimeError):  # not the main thread: no signals
            loop.add_signal_handler(signal.SIGWINCH, resized)
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        stop = _read_fd(loop, stdin_fd, queue)
        try:
            while (data := await queue.get()) is not None:
                await send({"k": "stdin", "d": data})
            await send({"k": "eof"})  # the node types Ctrl-D for it
        finally:
            stop()

    def write(_: str, data: bytes) -> None:
        out.write(data)
        out.flush()

    try:
        return await session("exec", sandbox_id, args, write, driver=drive)
    finally:
        with contextlib.suppress(ValueError, RuntimeError):
            loop.remove_signal_handler(signal.SIGWINCH)
        if saved is not None:
            import termios

            termios.tcsetattr(stdin_fd, termios.TCSADRAIN, saved)


def _read_fd(
    loop: asyncio.AbstractEventLoop, fd: int, queue: asyncio.Queue[bytes | None]
) -> Callable[[], None]:
    """Put what ``fd`` gives in ``queue`` (None at EOF), from the event loop when ``fd`` can be
    polled (a terminal, a pipe), else from a daemon thread with plain ``os.read`` (no buffered
    stdin whose lock a thread would hold at exit). Returns how to stop."""

    def readable() -> None:
        try:
            data = os.read(fd, remote.CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
        queue.put_nowait(data or None)

    try:
        loop.add_reader(fd, readable)
    except (OSError, ValueError):  # a regular file or /dev/null: not pollable
        import threading

        def pump() -> None:
            with contextlib.suppress(OSError):
                while data := os.read(fd, remote.CHUNK):
                    loop.call_soon_threadsafe(queue.put_nowait, data)
            loop.call_soon_threadsafe(queue.put_nowait, None)

        threading.Thread(target=pump, name="dsec-stdin", daemon=True).start()
        return lambda: None

    def stop() -> None:
        loop.remove_reader(fd)

    return stop


# ----------------------------------------------------------------------------- cp


_REMOTE = re.compile(r"^(sbx_[A-Za-z0-9_-]{1,64}):(.*)$", re.DOTALL)


def split_remote(arg: str) -> tuple[str, str] | None:
    """``(sandbox_id, path)`` of ``sbx_ID:/path``, None for a local path."""
    match = _REMOTE.match(arg)
    return (match[1], match[2]) if match else None


@dataclass
class Copied:
    """What a copy moved (this side's count; the node's end frame says the same)."""

    files: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)


class _LocalWriter:
    """Writes a copy out of the sandbox below ``dest`` (whose parent exists): directories and
    files only, each path component opened with O_NOFOLLOW from ``dest``'s parent, so neither a
    hostile entry name nor a symlink already in the destination sends a write elsewhere."""

    def __init__(self, dest: Path, copied: Copied) -> None:
        self.parent = os.open(dest.parent, _DIR)
        self.top = dest.name
        self.copied = copied
        self.file: int | None = None
        self.started = False

    def _locate(self, rel: str) -> tuple[int, str]:
        parts = [self.top, *rel.split("/")] if rel else [self.top]
        fd = os.dup(self.parent)
        for done, part in enumerate(parts[:-1]):
            try:
                child = os.open(part, _DIR, dir_fd=fd)
            except OSError as exc:
                raise CopyError(
                    f"{'/'.join(parts[: done + 1])} is a symlink or not a directory here; "
                    f"not followed ({exc.strerror})"
                ) from None
            finally:
                os.close(fd)
            fd = child
        return fd, parts[-1]

    def entry(self, kind: str, rel: str, mode: int) -> None:
        self._close_file()
        if not self.started and rel != "":
            raise CopyError("the copy did not start with its top entry")
        self.started = True
        fd, leaf = self._locate(rel)
        try:
            if kind == "dir":
                try:
                    os.mkdir(leaf, (mode & 0o777) | 0o700, dir_fd=fd)
                except FileExistsError:
                    os.close(os.open(leaf, _DIR, dir_fd=fd))  # a real directory, or refused
            else:
                self.file = os.open(leaf, _WRITE, (mode & 0o777) | 0o600, dir_fd=fd)
                if not stat.S_ISREG(os.fstat(self.file).st_mode):
                    raise CopyError(f"{rel or self.top} is not a regular file here")
            self.copied.files += 1
        except OSError as exc:
            raise CopyError(f"cannot write {rel or self.top}: {exc.strerror}") from None
        finally:
            os.close(fd)

    def data(self, data: bytes) -> None:
        if self.file is None:
            raise CopyError("file bytes before any file")
        view = memoryview(data)
        while view:
            view = view[os.write(self.file, view) :]
        self.copied.bytes += len(data)

    def _close_file(self) -> None:
        if self.file is not None:
            os.close(self.file)
            self.file = None

    def close(self) -> None:
        self._close_file()
        os.close(self.parent)


def _get_destination(path: str, local: Path) -> Path:
    """Where ``cp ID:path LOCAL`` writes: into LOCAL when it is a directory, else LOCAL."""
    name = path.rstrip("/").rpartition("/")[2]
    if local.is_dir():
        if not name:
            raise CopyError("copy / into a new directory name, not into an existing one")
        return local / name
    if not local.parent.is_dir():
        raise CopyError(f"{local.parent} is not a directory")
    return local


async def copy_from(sandbox_id: str, path: str, local: Path) -> tuple[Ended, Copied]:
    """``dsec sandbox cp ID:PATH LOCAL``."""
    copied = Copied()
    dest = _get_destination(path, local)
    writer = _LocalWriter(dest, copied)

    async def on_frame(frame: dict[str, Any]) -> None:
        kind = frame.get("k")
        if kind == "data" and isinstance(frame.get("d"), bytes):
            await asyncio.to_thread(writer.data, frame["d"])
        elif kind == "entry":
            try:
                rel = remote.entry_path(frame.get("p"))
            except remote.RemoteError as exc:
                raise CopyError(f"the node sent a bad path: {exc}") from None
            if frame.get("t") == "skip":
                copied.skipped.append(rel)
            elif frame.get("t") in ("dir", "file") and isinstance(frame.get("m"), int):
                await asyncio.to_thread(writer.entry, str(frame["t"]), rel, int(frame["m"]))

    args = {"op": "get", "path": path}
    try:
        ended = await session("cp", sandbox_id, args, lambda *_: None, on_frame=on_frame)
    finally:
        writer.close()
    return ended, copied


def _walk(local: Path, copied: Copied) -> list[tuple[str, Path, os.stat_result]]:
    """What ``local`` holds, top first, parents before children: (relative path, path, stat);
    symlinks and special files below the top are skipped (and named)."""
    top = local.stat()  # the top is what the user named: a link there is followed
    if not (stat.S_ISDIR(top.st_mode) or stat.S_ISREG(top.st_mode)):
        raise CopyError(f"{local} is neither a regular file nor a directory")
    found = [("", local, top)]
    if stat.S_ISDIR(top.st_mode):
        for root, dirs, files in os.walk(local):
            dirs.sort()
            base = Path(root)
            for name in [*sorted(files), *dirs]:
                path = base / name
                rel = path.relative_to(local).as_posix()
                st = path.lstat()
                if stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode):
                    found.append((rel, path, st))
                else:
                    copied.skipped.append(rel)
            dirs[:] = [d for d in dirs if not (base / d).is_symlink()]
        found[1:] = sorted(found[1:], key=lambda f: f[0].split("/"))
    return found


async def copy_to(sandbox_id: str, local: Path, path: str) -> tuple[Ended, Copied]:
    """``dsec sandbox cp LOCAL ID:PATH`` (into PATH when it is a directory there, as cp)."""
    copied = Copied()
    try:
        entries = await asyncio.to_thread(_walk, local, copied)
    except OSError as exc:
        raise CopyError(f"cannot read {local}: {exc.strerror}") from None
    acked = 0
    moved = asyncio.Event()

    def on_frame(frame: dict[str, Any]) -> None:
        nonlocal acked
        if frame.get("k") == "ack" and isinstance(frame.get("n"), int):
            acked = max(acked, frame["n"])
            moved.set()

    sent = 0

    async def frame(send: Send, body: dict[str, Any]) -> None:
        nonlocal sent
        while sent - acked >= remote.CP_WINDOW:
            moved.clear()
            await moved.wait()
        await send(body)
        sent += 1

    failure: list[str] = []

    async def drive(send: Send) -> None:
        try:
            for rel, path, st in entries:
                kind = "dir" if stat.S_ISDIR(st.st_mode) else "file"
                await frame(send, {"k": "entry", "t": kind, "p": rel, "m": st.st_mode & 0o7777})
                copied.files += 1
                if kind == "file":
                    await _send_file(path, lambda d: frame(send, {"k": "data", "d": d}), copied)
            await frame(send, {"k": "eof"})
        except (OSError, CopyError) as exc:
            failure.append(f"cannot read {local}: {getattr(exc, 'strerror', None) or exc}")
            await send({"k": "cancel"})

    name = local.resolve().name or "root"
    args = {"op": "put", "path": path, "name": name}
    ended = await session("cp", sandbox_id, args, lambda *_: None, driver=drive, on_frame=on_frame)
    if failure:
        raise CopyError(failure[0])
    return ended, copied


async def _send_file(path: Path, send: Callable[[bytes], Awaitable[None]], copied: Copied) -> None:
    fd = await asyncio.to_thread(os.open, path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        while data := await asyncio.to_thread(os.read, fd, remote.CHUNK):
            await send(data)
            copied.bytes += len(data)
    finally:
        os.close(fd)


def summary(
    direction: str, sandbox_id: str, path: str, local: Path, copied: Copied
) -> dict[str, Any]:
    """The ``--json`` result of a copy."""
    return {
        "sandbox_id": sandbox_id,
        "direction": direction,
        "path": path,
        "local": str(local),
        "files": copied.files,
        "bytes": copied.bytes,
        "skipped": copied.skipped,
    }
