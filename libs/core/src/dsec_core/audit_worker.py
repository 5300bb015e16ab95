"""The audit verifier on a core of its own while the caller reads the stream.

Reading a replay (:func:`dsec_core.bus.replay_batches`) and verifying it
(:class:`dsec_core.audit.Verifier`) each cost a few microseconds of Python an event, and one
interpreter runs one at a time: in one process, ``dsec audit verify`` went at the speed of their
sum. :class:`VerifierWorker` runs the verifier in a forked child, fed the batches the caller
reads through a pipe, so reading and verifying overlap on two cores.

The child is a fork of the caller: the same :class:`~dsec_core.audit.Verifier`, fed the same
``(stream_seq, data)`` pairs in the same order, so its report is the one an in-process verifier
gives (``libs/core/tests/test_audit_batch.py`` holds them equal). :func:`open_verifier` picks it
where ``os.fork`` exists for a long stream or one of unknown length (``dsec audit verify`` forks
before it connects: the child imports the verifier while the caller reads), and the in-process
verifier otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import pickle
import select
import signal
from typing import Any, Protocol

import blake3
import msgspec

from dsec_core.audit_report import SIGNATURE_EVERY, VerifyReport, fewer_collections

# The verifier (:mod:`dsec_core.audit`: the signature checks and certificates, not the event
# models; 0.05 s of imports beside the reader's) is imported where it runs: by the forked child,
# on its own core, while the caller connects and reads; the caller never needs it (the report
# it unpickles is :mod:`dsec_core.audit_report`'s).

WORKER_MIN_EVENTS = 20_000
"""Streams shorter than this are verified in the caller's process (a fork is not worth it)."""

# A batch on the pipe: MessagePack of [(stream_seq, data, chain hash), ...]. msgspec's encode
# takes 0.12 us an event where pickle.dumps took 1.2 (it memoizes every object) on the reader,
# the pipeline's slower half; the child's decode costs what unpickling did (0.36 us).
_encode_batch = msgspec.msgpack.Encoder().encode
_decode_batch = msgspec.msgpack.Decoder(list[tuple[int, bytes, str]]).decode

_FOUND = b"!"  # the child's early note: a finding holds, the caller may stop reading
_PIPE_BYTES = 1 << 20
_WRITE_AHEAD = 8 << 20  # bytes the caller may have written ahead of the child


class VerifierFailed(RuntimeError):
    """The verifier process failed (its error, or that it ended without a report)."""


class BatchVerifier(Protocol):
    """What ``dsec audit verify`` feeds: batches in stream order, then :meth:`finish`."""

    async def feed(self, batch: list[tuple[int, bytes]]) -> bool:
        """Verify a batch; True once a finding holds (what follows changes nothing)."""

    async def finish(self) -> VerifyReport:
        """Check what is pending and return the report."""

    def close(self) -> None:
        """Release what it holds (after :meth:`finish`, or instead of it on an error)."""


class InlineVerifier:
    """:class:`BatchVerifier` in the caller's process (short streams; no ``os.fork``)."""

    def __init__(self, anchor: bytes | None, signature_every: int = SIGNATURE_EVERY) -> None:
        from dsec_core.audit import Verifier

        self.verifier = Verifier(anchor, signature_every)

    async def feed(self, batch: list[tuple[int, bytes]]) -> bool:
        with fewer_collections():
            return self.verifier.feed_many(batch) is not None

    async def finish(self) -> VerifyReport:
        return self.verifier.finish()

    def close(self) -> None:
        pass


class _Drain(asyncio.Protocol):
    """Flow control of the pipe to the child (the transport buffers what the pipe refuses)."""

    def __init__(self) -> None:
        self._writable = asyncio.Event()
        self._writable.set()
        self.lost: BaseException | None = None

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = exc or BrokenPipeError("the verifier process closed its input")
        self._writable.set()

    async def drain(self) -> None:
        await self._writable.wait()
        if self.lost is not None:
            raise self.lost


class VerifierWorker:
    """:class:`BatchVerifier` in a forked child process (forked when constructed).

    The caller writes each batch (with each envelope's chain hash, MessagePack, length-prefixed)
    into a pipe without waiting for the child to take it (up to a few MB ahead), and reads on.
    The child writes one byte as soon as a finding holds (:meth:`feed` then returns True) and
    its report once its input ends.
    """

    def __init__(self, anchor: bytes | None, signature_every: int = SIGNATURE_EVERY) -> None:
        data_r, data_w = os.pipe()
        result_r, result_w = os.pipe()
        with contextlib.suppress(OSError, AttributeError):  # Linux: fewer, larger writes
            import fcntl

            fcntl.fcntl(data_w, getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_BYTES)
        pid = os.fork()
        if pid == 0:  # the child: never returns from here
            code = 1
            try:
                os.close(data_w)
                os.close(result_r)
                _serve(data_r, result_w, anchor, signature_every)
                code = 0
            finally:
                os._exit(code)
        os.close(data_r)
        os.close(result_w)
        self._pid: int | None = pid
        self._data_fd: int | None = data_w
        self._result_fd: int | None = result_r
        self._transport: asyncio.WriteTransport | None = None
        self._drain: _Drain | None = None
        self._hasher = blake3.blake3()
        self.found = False

    async def feed(self, batch: list[tuple[int, bytes]]) -> bool:
        if self._transport is None:
            if self._data_fd is None:
                raise VerifierFailed("the verifier process was closed")
            pipe = open(self._data_fd, "wb", buffering=0)  # noqa: SIM115 (the transport's)
            self._data_fd = None
            drain = _Drain()
            transport, _ = await asyncio.get_running_loop().connect_write_pipe(lambda: drain, pipe)
            transport.set_write_buffer_limits(high=_WRITE_AHEAD)
            self._transport, self._drain = transport, drain
        assert self._drain is not None
        # The chain hashes (envelope_hash) are computed here, on the reader's core: the child's
        # share shrinks. One hasher, reset after each digest: 1.17 against 1.55 us an event
        # for a new hasher each.
        update, hexdigest, reset = self._hasher.update, self._hasher.hexdigest, self._hasher.reset
        hashed: list[tuple[int, bytes, str]] = []
        add = hashed.append
        for seq, data in batch:
            update(data)
            add((seq, data, hexdigest()))
            reset()
        blob = _encode_batch(hashed)
        self._transport.write(len(blob).to_bytes(4, "big"))
        self._transport.write(blob)
        try:
            await self._drain.drain()
        except OSError:  # the child is gone: finish() says why
            self.found = True
            return True
        if not self.found and self._result_fd is not None:
            poller = select.poll()  # (not select.select: a descriptor may be above 1023)
            poller.register(self._result_fd, select.POLLIN)
            self.found = bool(poller.poll(0))
        return self.found

    async def finish(self) -> VerifyReport:
        """End the child's input; its report (raises :class:`VerifierFailed` if the child
        failed)."""
        if self._transport is not None:
            self._transport.close()  # after what is buffered is written
            self._transport = None
        elif self._data_fd is not None:
            os.close(self._data_fd)
            self._data_fd = None
        if self._result_fd is None or self._pid is None:
            raise VerifierFailed("the verifier process was closed")
        fd, pid = self._result_fd, self._pid
        loop = asyncio.get_running_loop()
        raw = await loop.run_in_executor(None, _read_all, fd)
        os.close(fd)
        self._result_fd = None
        _, status = await loop.run_in_executor(None, os.waitpid, pid, 0)
        self._pid = None
        try:
            kind, value = pickle.loads(raw.lstrip(_FOUND))
        except Exception as exc:
            why = "ended without a report"
            if os.WIFSIGNALED(status):
                why = f"was stopped by {signal.Signals(os.WTERMSIG(status)).name}"
            raise VerifierFailed(f"the verifier process {why}") from exc
        if kind != "report":
            raise VerifierFailed(f"the verifier process failed: {value}")
        report: VerifyReport = value
        return report

    def close(self) -> None:
        """Stop the child if it still runs (an error in the caller) and release the pipes."""
        if self._transport is not None:
            self._transport.abort()
            self._transport = None
        for name in ("_data_fd", "_result_fd"):
            fd = getattr(self, name)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, name, None)
        if self._pid is not None:
            with contextlib.suppress(OSError):
                os.kill(self._pid, 9)
                os.waitpid(self._pid, 0)
            self._pid = None


def open_verifier(
    anchor: bytes | None, expected_events: int | None = None, signature_every: int = SIGNATURE_EVERY
) -> BatchVerifier:
    """A :class:`VerifierWorker` where ``os.fork`` exists and ``expected_events`` is unknown
    (``None``: fork first, before connecting, so the child loads the verifier while the caller
    reads) or >= :data:`WORKER_MIN_EVENTS`; else an :class:`InlineVerifier`."""
    long = expected_events is None or expected_events >= WORKER_MIN_EVENTS
    if long and hasattr(os, "fork"):
        try:
            return VerifierWorker(anchor, signature_every)
        except OSError:  # no process or pipe to be had (limits): verify in this one
            pass
    return InlineVerifier(anchor, signature_every)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _serve(data_fd: int, result_fd: int, anchor: bytes | None, signature_every: int) -> None:
    """The child: verify the batches read from ``data_fd``; the report to ``result_fd``."""
    with contextlib.suppress(ValueError, OSError):  # the caller's event loop is not the child's
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends it with its caller
    gc.freeze()  # the objects inherited from the caller: no collection walks them again
    result: tuple[str, Any]
    try:
        gc.disable()  # (an import makes objects, no cycles worth a collection: 5 % of it)
        try:
            from dsec_core.audit import Verifier  # (meanwhile the caller reads ahead)
        finally:
            gc.enable()
        verifier = Verifier(anchor, signature_every)
        feed_many = verifier.feed_many
        told = False
        with open(data_fd, "rb", buffering=_PIPE_BYTES) as src, fewer_collections():
            while len(head := src.read(4)) == 4:
                batch = _decode_batch(src.read(int.from_bytes(head, "big")))
                if verifier.report.finding is not None:
                    continue  # (the caller stops soon; what follows changes nothing)
                feed_many(batch)
                if verifier.report.finding is not None and not told:
                    os.write(result_fd, _FOUND)
                    told = True
        result = ("report", verifier.finish())
    except Exception as exc:
        result = ("error", f"{type(exc).__name__}: {exc}")
    _write_all(result_fd, pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    os.close(result_fd)
