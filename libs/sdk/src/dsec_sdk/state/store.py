"""Where an agent's checkpoints go: the node agent's keeper (:class:`NodeStore`, inside a
sandbox) or a local directory (:class:`LocalStore`, plain Python: tests, benchmarks).

Both implement :class:`Store`, so :class:`~dsec_sdk.state.AgentState` is the same over both:
``hello`` (-> the keeper's ``welcome``), ``fetch`` (-> the records to restore and the
``fetched`` frame), ``checkpoint`` (send one checkpoint frame; a future resolved by its
``ack``), ``start`` (deliver the keeper's unsolicited frames: ``deltas``, ``handover``,
``switched``, ``error``), ``send`` (``ready``), ``close``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import fcntl
import logging
import os
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

import msgpack

from dsec_sdk.state import codec, wire

log = logging.getLogger("dsec_sdk.state")

_LEN: Final = struct.Struct(">I")
Ack = concurrent.futures.Future  # resolved with the keeper's ack frame


class StateError(Exception):
    """The state plane failed: the keeper or the local store refused, went away, or a
    restored value does not fit the container declared."""


class CheckpointRefused(StateError):
    """The keeper refused a checkpoint (an ``error`` frame for its seq, ``code`` its word):
    it took nothing of it, and that seq is still the next one."""

    def __init__(self, message: str, code: str, expected: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.expected = expected  # (``bad-seq``: the seq the keeper takes next)


def encode_checkpoint(
    seq: int, packed: Sequence[bytes], pause_ms: float, tiers: Sequence[str], final: bool
) -> bytes:
    """A ``checkpoint`` frame (length prefix included) whose records are already packed."""
    p = msgpack.Packer(use_bin_type=True)
    parts = [
        p.pack_map_header(6),
        p.pack("op"),
        p.pack("checkpoint"),
        p.pack("seq"),
        p.pack(seq),
        p.pack("pause_ms"),
        p.pack(float(pause_ms)),
        p.pack("tiers"),
        p.pack(list(tiers)),
        p.pack("final"),
        p.pack(bool(final)),
        p.pack("records"),
        p.pack_array_header(len(packed)),
        *packed,
    ]
    body = b"".join(parts)
    if len(body) > wire.MAX_FRAME:
        raise StateError(f"a checkpoint frame of {len(body)} bytes (max {wire.MAX_FRAME})")
    return _LEN.pack(len(body)) + body


class Store(Protocol):
    source: str

    def hello(self, agent: str, group: str, handover: bool) -> dict[str, Any]: ...

    def fetch(self) -> tuple[list[dict[str, Any]], dict[str, Any]]: ...

    def checkpoint(self, seq: int, frame: bytes) -> Ack[dict[str, Any]]: ...

    def start(self, on_frame: Callable[[dict[str, Any]], None]) -> None: ...

    def send(self, frame: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


# ------------------------------------------------------------------------------- local
class LocalStore:
    """A directory: ``snapshot.bin`` (full records at a seq) + ``journal.bin`` (checkpoint
    frames after it), appended and fsync'd before a checkpoint is acknowledged; a crash in the
    middle of an append loses only that (unacknowledged) checkpoint. One process at a time
    (``lock``, an flock). The journal is folded into a new snapshot when it grows past
    ``compact_bytes`` (and twice the snapshot).

    Args:
        path: The directory (created).
        config: What a keeper's ``welcome.config`` would say (intervals, tier overrides).
    """

    source = "local"

    def __init__(
        self,
        path: str | os.PathLike[str],
        config: dict[str, Any] | None = None,
        *,
        compact_bytes: int = 256 << 20,
    ) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.config = dict(config or {})
        self.compact_bytes = compact_bytes
        self._lock_fd = os.open(self.path / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock_fd)
            raise StateError(
                f"the state in {self.path} is held by another process (state-held)"
            ) from None
        self._journal_path = self.path / "journal.bin"
        self._snapshot_path = self.path / "snapshot.bin"
        self._snap_seq = 0
        self._snap_size = 0
        self._records: list[dict[str, Any]] = []
        self._deltas = 0
        self._seq = 0
        self._read()
        # Unbuffered: a frame is in the file or, after a failed write, cut off again (see
        # checkpoint); nothing of it may wait in a buffer to follow the next frame.
        self._journal = os.open(
            self._journal_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600
        )
        self._journal_end = os.fstat(self._journal).st_size
        self._broken: str | None = None  # a failed write that could not be cut off again

    def _read(self) -> None:
        if self._snapshot_path.exists():
            data = self._snapshot_path.read_bytes()
            self._snap_size = len(data)
            frames, _ = _frames(data)
            for frame in frames:
                self._snap_seq = int(frame["seq"])
                self._records.extend(frame["records"])
        self._seq = self._snap_seq
        if self._journal_path.exists():
            data = self._journal_path.read_bytes()
            frames, good = _frames(data)
            if good < len(data):  # a torn append (crash): never acknowledged
                log.warning(
                    "state journal %s: dropping a torn tail of %d bytes",
                    self.path,
                    len(data) - good,
                )
                with open(self._journal_path, "r+b") as f:
                    f.truncate(good)
                    os.fsync(f.fileno())
            for frame in frames:
                seq = int(frame["seq"])
                if seq <= self._snap_seq:
                    continue
                self._records.extend(frame["records"])
                self._deltas += 1
                self._seq = seq

    def hello(self, agent: str, group: str, handover: bool) -> dict[str, Any]:
        if handover:
            raise StateError("a hand-over needs the node agent's keeper (no local store)")
        return {
            "op": "welcome",
            "state_id": f"local:{self.path}",
            "seq": self._seq,
            "config": self.config,
            "handover": False,
        }

    def fetch(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        t0 = time.perf_counter()
        records, self._records = self._records, []
        source = "local" if records else "empty"
        fetched = {
            "op": "fetched",
            "seq": self._seq,
            "deltas": self._deltas,
            "source": source,
            "ms": (time.perf_counter() - t0) * 1000,
        }
        return records, fetched

    def checkpoint(self, seq: int, frame: bytes) -> Ack[dict[str, Any]]:
        fut: Ack[dict[str, Any]] = concurrent.futures.Future()
        if self._broken is not None:
            fut.set_exception(StateError(self._broken))
            return fut
        start = self._journal_end
        try:
            view = memoryview(frame)
            while view:
                view = view[os.write(self._journal, view) :]
            os.fsync(self._journal)
        except OSError as exc:
            # Not acknowledged, so not in the journal either: a part of it left there would
            # hide every later frame behind a torn one (read back as a torn tail and dropped).
            try:
                os.ftruncate(self._journal, start)
            except OSError as cut:
                self._broken = (
                    f"the state journal in {self.path} holds part of a failed checkpoint that "
                    f"could not be cut off ({cut}); reopen the state to go on"
                )
            fut.set_exception(StateError(f"cannot write the state journal in {self.path}: {exc}"))
            return fut
        self._journal_end = start + len(frame)
        self._seq = seq
        if self._journal_end > max(self.compact_bytes, 2 * self._snap_size):
            try:
                self._compact()
            except OSError as exc:  # (the checkpoint is durable: the journal stays as it is)
                log.warning(
                    "state journal %s: compaction failed (%s); tried again later", self.path, exc
                )
        fut.set_result({"op": "ack", "seq": seq, "bytes": len(frame)})
        return fut

    def _compact(self) -> None:
        """Fold snapshot + journal into a new snapshot, then empty the journal."""
        entries: dict[str, codec.Entry] = {}
        for path, skip in ((self._snapshot_path, -1), (self._journal_path, self._snap_seq)):
            if path.exists():
                frames, _ = _frames(path.read_bytes())
                for fr in frames:
                    if int(fr["seq"]) > skip:
                        codec.fold(fr["records"], entries)
        records = codec.snapshot(entries)
        tmp = self.path / "snapshot.tmp"
        size = 0
        with open(tmp, "wb") as f:
            for batch in codec.batches(records):
                data = wire.encode({"op": "snapshot", "seq": self._seq, "records": batch})
                f.write(data)
                size += len(data)
            if not records:
                data = wire.encode({"op": "snapshot", "seq": self._seq, "records": []})
                f.write(data)
                size += len(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self._snapshot_path)
        dfd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self._snap_seq, self._snap_size = self._seq, size
        os.ftruncate(self._journal, 0)  # (its frames are in the snapshot now: skipped if kept)
        self._journal_end = 0
        os.fsync(self._journal)

    def start(self, on_frame: Callable[[dict[str, Any]], None]) -> None:
        pass  # a local store sends nothing unasked

    def send(self, frame: dict[str, Any]) -> None:
        if frame.get("op") == "ready":
            raise StateError("a hand-over needs the node agent's keeper (no local store)")

    def close(self) -> None:
        journal, self._journal = self._journal, -1
        if journal >= 0:  # (once: the number may belong to another file afterwards)
            with contextlib.suppress(OSError):
                os.close(journal)
        lock, self._lock_fd = self._lock_fd, -1
        if lock >= 0:
            with contextlib.suppress(OSError):
                os.close(lock)


def _frames(data: bytes) -> tuple[list[dict[str, Any]], int]:
    """The whole frames in ``data`` and where the last one ends."""
    out: list[dict[str, Any]] = []
    pos = 0
    while pos + _LEN.size <= len(data):
        (size,) = _LEN.unpack_from(data, pos)
        end = pos + _LEN.size + size
        if end > len(data):
            break
        try:
            out.append(wire.decode(data[pos + _LEN.size : end]))
        except wire.WireError:
            break
        pos = end
    return out, pos


def default_dir() -> Path:
    """``$DSEC_STATE_DIR``, else a new temporary directory."""
    explicit = os.environ.get("DSEC_STATE_DIR")
    if explicit:
        return Path(explicit)
    return Path(tempfile.mkdtemp(prefix="dsec-state-"))


# -------------------------------------------------------------------------------- node
class NodeStore:
    """The node agent's state keeper, over the state socket (see :mod:`dsec_sdk.state.wire`).

    Args:
        sock: A connected ``SOCK_STREAM`` socket to the keeper (:meth:`connect` gets one from
            the IPC broker).
        timeout: Seconds to wait for a frame during hello/fetch.
    """

    source = "node"

    def __init__(self, sock: socket.socket, *, timeout: float = 60.0, link: Any = None) -> None:
        self.sock = sock
        self.timeout = timeout
        self._link = link
        self._send_lock = threading.Lock()
        # Per seq, the checkpoints waiting for their answer, oldest first: after a refusal the
        # next checkpoint uses the refused seq again while a later one sent before it (refused
        # in turn) may still wait, and the keeper answers in the order it was sent.
        self._acks: dict[int, collections.deque[Ack[dict[str, Any]]]] = {}
        self._acks_lock = threading.Lock()
        self._reader: threading.Thread | None = None
        self._closed = False
        self._gone: str | None = None

    @classmethod
    def connect(
        cls, socket_path: str | os.PathLike[str], agent: str, group: str, *, timeout: float = 60.0
    ) -> NodeStore:
        """Ask the IPC broker at ``socket_path`` for this sandbox's state socket: a new broker
        connection (hello), then the control op ``{"op": "state", "ref": 1}``; the answer
        carries the socket's fd."""
        from dsec_sdk.errors import IpcError
        from dsec_sdk.ipc import control
        from dsec_sdk.ipc.link import BrokerLink

        try:
            link = BrokerLink(Path(socket_path), agent, group, "caller")
        except IpcError as exc:
            raise StateError(f"cannot reach the node agent for state: {exc}") from exc
        try:
            control.close_fds(link.welcome_fds)
            control.send(link.sock, {"op": "state", "ref": 1})
            reply = control.recv(link.sock)
        except (OSError, IpcError) as exc:
            link.close()
            raise StateError(f"the broker did not hand out the state socket: {exc}") from exc
        if reply is None:
            link.close()
            raise StateError("the broker closed the connection instead of the state socket")
        message, fds = reply
        if message.get("op") != "state" or len(fds) != 1:
            control.close_fds(fds)
            link.close()
            detail = message.get("message") or message.get("op")
            raise StateError(f"the broker refused the state socket: {detail}")
        sock = socket.socket(fileno=fds[0])
        sock.setblocking(True)
        return cls(sock, timeout=timeout, link=link)

    def _recv(self) -> dict[str, Any]:
        self.sock.settimeout(self.timeout)
        try:
            frame = wire.recv(self.sock)
        except (OSError, wire.WireError) as exc:
            raise StateError(f"the state keeper did not answer: {exc}") from exc
        finally:
            self.sock.settimeout(None)
        if frame is None:
            raise StateError("the state keeper closed the connection")
        if frame["op"] == "error":
            raise StateError(
                f"the state keeper refused: {frame.get('code')}: {frame.get('message')}"
            )
        return frame

    def hello(self, agent: str, group: str, handover: bool) -> dict[str, Any]:
        self.send(
            {"op": "hello", "v": wire.VERSION, "agent": agent, "group": group, "handover": handover}
        )
        frame = self._recv()
        if frame["op"] != "welcome":
            raise StateError(f"the state keeper answered hello with {frame['op']!r}")
        return frame

    def fetch(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self.send({"op": "fetch"})
        records: list[dict[str, Any]] = []
        while True:
            frame = self._recv()
            if frame["op"] == "records":
                records.extend(frame.get("records") or [])
            elif frame["op"] == "fetched":
                return records, frame
            else:
                raise StateError(f"the state keeper answered fetch with {frame['op']!r}")

    def checkpoint(self, seq: int, frame: bytes) -> Ack[dict[str, Any]]:
        fut: Ack[dict[str, Any]] = concurrent.futures.Future()
        with self._acks_lock:
            if self._gone is not None:
                fut.set_exception(StateError(self._gone))
                return fut
            self._acks.setdefault(seq, collections.deque()).append(fut)
        try:
            with self._send_lock:
                self.sock.sendall(frame)
        except OSError as exc:
            with self._acks_lock:
                self._forget(seq, fut)
            fut.set_exception(StateError(f"cannot send a checkpoint to the state keeper: {exc}"))
        return fut

    def _oldest(self, seq: int) -> Ack[dict[str, Any]] | None:
        """The oldest checkpoint of ``seq`` waiting for its answer, no longer waiting (under
        ``_acks_lock``)."""
        waiting = self._acks.get(seq)
        if not waiting:
            return None
        fut = waiting.popleft()
        if not waiting:
            del self._acks[seq]
        return fut

    def _forget(self, seq: int, fut: Ack[dict[str, Any]]) -> None:
        """``fut`` (of ``seq``) waits no more (under ``_acks_lock``)."""
        waiting = self._acks.get(seq)
        if waiting is not None and fut in waiting:
            waiting.remove(fut)
            if not waiting:
                del self._acks[seq]

    def send(self, frame: dict[str, Any]) -> None:
        data = wire.encode(frame)
        try:
            with self._send_lock:
                self.sock.sendall(data)
        except OSError as exc:
            raise StateError(f"the state keeper is gone: {exc}") from exc

    def start(self, on_frame: Callable[[dict[str, Any]], None]) -> None:
        self._reader = threading.Thread(
            target=self._read_loop, args=(on_frame,), name="dsec-state-reader", daemon=True
        )
        self._reader.start()

    def _read_loop(self, on_frame: Callable[[dict[str, Any]], None]) -> None:
        reason = "the state keeper closed the connection"
        try:
            while True:
                frame = wire.recv(self.sock)
                if frame is None:
                    break
                op = frame["op"]
                seq = frame.get("seq")
                if op == "ack" or (op == "error" and isinstance(seq, int) and seq in self._acks):
                    with self._acks_lock:
                        fut = self._oldest(int(seq or 0))
                    if fut is None:
                        continue
                    if op == "ack":
                        fut.set_result(frame)
                    else:
                        next_seq = frame.get("expected")
                        fut.set_exception(
                            CheckpointRefused(
                                f"the state keeper refused checkpoint {seq}: "
                                f"{frame.get('code')}: {frame.get('message')}",
                                str(frame.get("code")),
                                next_seq if isinstance(next_seq, int) else None,
                            )
                        )
                    continue
                try:
                    on_frame(frame)
                except Exception:
                    log.exception("state: handling a %r frame failed", op)
        except (OSError, wire.WireError) as exc:
            if not self._closed:
                reason = f"the state connection failed: {exc}"
        with self._acks_lock:
            self._gone = reason
            pending, self._acks = self._acks, {}
        for waiting in pending.values():
            for fut in waiting:
                fut.set_exception(StateError(reason))
        if not self._closed:
            with contextlib.suppress(Exception):
                on_frame({"op": "closed", "message": reason})

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True  # before `bye`: the keeper's answer (end of stream) is expected
        with contextlib.suppress(StateError):
            self.send({"op": "bye"})
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        if self._reader is not None and self._reader is not threading.current_thread():
            self._reader.join(timeout=5)
        if self._link is not None:
            self._link.close()
