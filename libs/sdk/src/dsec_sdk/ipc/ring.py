"""Single-producer/single-consumer ring of frames in shared memory.

Layout of one ring (one direction of a channel), inside the channel's memfd::

    header (512 B, every word on its own 64-byte cache line)  |  data (capacity bytes)

Positions (``head``, ``tail``) are 64-bit byte counters that only grow; ``pos = counter & mask``.
Each record is 16-byte aligned: ``<u32 body_len, u8 record_type, u8 kind, u16 0, u64 call_id>``
followed by the body. A record never wraps: when it does not fit before the end, the producer
writes a WRAP marker and starts again at offset 0, so a body is always one contiguous slice that
MessagePack decodes in place. A body larger than half the ring goes to the direction's overflow
memfd (one in flight at a time) and the ring carries only a LARGE record.

Memory ordering: x86-64 keeps stores in order and loads in order, so "write body, then publish
``head``" and "read ``head``, then read body" need no barrier. Only the sleep handshake (store my
"waiting" flag, then load your counter) needs a full barrier: see :func:`fence`. A sleeper also
re-checks at least every 50 ms, so even a missed wake-up is a delay, never a hang.

The common case of each hot path (an inline record that needs no wrap; spinning while empty) also
exists in C (``_fastring.c``), used when the extension was built (``ACCELERATED``); it falls back
to the methods here for everything else. ``DSEC_IPC_PURE_PYTHON=1`` turns it off (tests run both).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar

from dsec_sdk.errors import PayloadTooLarge, ProtocolError

_fastring: Any
try:
    from dsec_sdk.ipc import _fastring  # type: ignore[attr-defined,no-redef]
except ImportError:  # no C compiler where the SDK was installed, or another Python ABI
    _fastring = None

T = TypeVar("T")

HEADER_SIZE: Final = 512
MIN_CAPACITY: Final = 4096

# Word indexes into the header viewed as u64; 8 words = one 64-byte line apart.
HEAD: Final = 0  # producer: bytes published
PRODUCER_CPU: Final = 1  # producer (C path only): 1 + the CPU it last wrote on; 0 = unknown
TAIL: Final = 8  # consumer: bytes consumed
CONSUMER_CPU: Final = 9  # consumer (C path only): 1 + the CPU it last read on; 0 = unknown
CONSUMER_WAITING: Final = 16  # consumer: 1 while it sleeps (or is about to) on its eventfd
PRODUCER_WAITING: Final = 24  # producer: 1 while it sleeps waiting for space
CLOSED: Final = 32  # either side: 1 once the channel is closed on purpose
LARGE_WRITTEN: Final = 40  # producer: overflow payloads published
LARGE_CONSUMED: Final = 48  # consumer: overflow payloads consumed

RECORD: Final = struct.Struct("<IBBHQ")
_pack_record = RECORD.pack_into
_unpack_record = RECORD.unpack_from
REC_INLINE: Final = 1
REC_WRAP: Final = 2
REC_LARGE: Final = 3

# madvise(MADV_REMOVE) frees the pages of an overflow payload at least this big once consumed.
_RELEASE_LARGE_AT: Final = 1 << 20
_PAGE: Final = mmap.PAGESIZE

# Every memfd of a channel (ring and overflows) is sized by the broker, then sealed so no one can
# resize it or add a seal: a peer that shrank it would SIGBUS the other side's mapping, one that
# grew it to 2**48 would make the other side's mmap() fail. Each end refuses an fd without these.
SEALS: Final[int] = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealed_size(fd: int, what: str) -> int:
    """The size of memfd ``fd``, which must carry :data:`SEALS` (then it can never change).

    Raises:
        ProtocolError: ``fd`` is not a memfd sealed against resizing and further seals.
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
        size = os.fstat(fd).st_size
    except OSError as exc:
        raise ProtocolError(f"the {what} is not a sealed memfd: {exc}") from exc
    if seals & SEALS != SEALS:
        raise ProtocolError(
            f"the {what} is not sealed against resizing (seals {seals:#x}, need {SEALS:#x})"
        )
    return size


_TRUE: Final = frozenset({"1", "true", "yes", "on"})
_FALSE: Final = frozenset({"", "0", "false", "no", "off"})


def accelerated() -> bool:
    """Whether new rings use the C hot path (built, and not turned off by the environment).

    Raises:
        ValueError: ``DSEC_IPC_PURE_PYTHON`` is neither a yes nor a no.
    """
    raw = os.environ.get("DSEC_IPC_PURE_PYTHON", "")
    value = raw.strip().lower()
    if value not in _TRUE and value not in _FALSE:
        raise ValueError(
            f"DSEC_IPC_PURE_PYTHON={raw!r} is invalid: use 1/true/yes/on (ring.py alone) or "
            "0/false/no/off or unset (the C hot path when built)"
        )
    return _fastring is not None and value in _FALSE


def lenient(decode: Callable[[memoryview], T]) -> Callable[[memoryview], T | None]:
    """``decode``, reading a body it cannot decode (``ValueError``, ``RecursionError``) as
    ``None``: in C when the extension is built (no Python frame per request), else in Python."""
    if _fastring is not None:
        return _fastring.lenient(decode)  # type: ignore[no-any-return]

    def lenient_decode(body: memoryview) -> T | None:
        try:
            return decode(body)
        except (ValueError, RecursionError):
            return None

    return lenient_decode


_fence_lock = threading.Lock()
_U64: Final = (1 << 64) - 1  # header words are u64: a hostile peer's values wrap, as in C


def fence() -> None:
    """Issue a full memory barrier.

    CPython's lock is a POSIX semaphore whose uncontended acquire and release are ``lock``-prefixed
    read-modify-writes, which on x86-64 order every earlier store before every later load: what
    the Dekker-style sleep handshake needs (~0.1 µs, versus a lost wake-up without it). A
    ``with`` block, so an interrupt cannot leave the lock held (and every later fence stuck).
    """
    with _fence_lock:
        pass


def ring_size(capacity: int) -> int:
    """Bytes one ring of ``capacity`` data bytes takes in the channel memfd."""
    return HEADER_SIZE + capacity


def check_capacity(capacity: int) -> None:
    """Raise ``ValueError`` unless ``capacity`` is a power of two of at least 4 KiB."""
    if capacity < MIN_CAPACITY or capacity & (capacity - 1):
        raise ValueError(
            f"ring capacity {capacity} is invalid: use a power of two >= {MIN_CAPACITY} bytes"
        )


def _notify(fd: int) -> None:
    # A failure means the counter is saturated (the peer will wake anyway) or the fd is gone
    # (the peer learns of it through its pidfd).
    with contextlib.suppress(OSError):
        os.eventfd_write(fd, 1)


class Ring:
    """One direction of a channel. Exactly one process produces and one consumes.

    Args:
        buf: The ring's bytes (header + data) inside the channel mapping.
        capacity: Data bytes (power of two).
        overflow_fd: memfd for payloads too large for the ring.
        consumer_wake_fd: eventfd the consumer sleeps on.
        producer_wake_fd: eventfd the producer sleeps on when the ring is full.
        max_payload: Largest body accepted in either direction.
        c_path: Use the C hot path (``None``: :func:`accelerated` decides).

    Raises:
        ProtocolError: ``overflow_fd`` is not a sealed memfd (see :func:`sealed_size`).
    """

    def __init__(
        self,
        buf: memoryview,
        capacity: int,
        overflow_fd: int,
        consumer_wake_fd: int,
        producer_wake_fd: int,
        max_payload: int,
        *,
        c_path: bool | None = None,
    ) -> None:
        check_capacity(capacity)
        self.capacity = capacity
        self._mask = capacity - 1
        self.max_inline = capacity // 2 - RECORD.size
        self.max_payload = max_payload
        self.hdr = buf[:HEADER_SIZE].cast("Q")
        self._data = buf[HEADER_SIZE : HEADER_SIZE + capacity]
        self._overflow_fd = overflow_fd
        self._overflow: mmap.mmap | None = None
        # What is mapped of the overflow memfd (once, on first use): its sealed size, at most
        # max_payload. No size a peer writes is ever mapped.
        self.overflow_limit = min(sealed_size(overflow_fd, "overflow memfd"), max_payload)
        self.consumer_wake_fd = consumer_wake_fd
        self.producer_wake_fd = producer_wake_fd
        # Producer's last look at the consumer's tail: re-read only when the ring looks full, so
        # the tail's cache line is not pulled across cores on every write.
        self._tail_seen = self.hdr[TAIL]
        self._write_limit = self._tail_seen + capacity  # head may grow up to this
        self._fast = None
        if accelerated() if c_path is None else (c_path and _fastring is not None):
            # Instance attributes shadow the Python methods: callers bind ``ring.try_write``
            # once and call the C function directly; C calls back the slow paths below.
            fast = _fastring.FastRing(
                buf,
                capacity,
                consumer_wake_fd,
                producer_wake_fd,
                self._try_write_slow,
                self._read_slow,
            )
            self._fast = fast
            self.try_write = fast.try_write  # type: ignore[method-assign]
            self.try_read = fast.try_read  # type: ignore[method-assign]
            self.spin_until = fast.spin_until  # type: ignore[method-assign]

    @property
    def accelerated(self) -> bool:
        """Whether this ring runs its hot path in C."""
        return self._fast is not None

    @property
    def fast(self) -> object | None:
        """The C half of this ring (``None`` when not accelerated)."""
        return self._fast

    @property
    def fast_call(self) -> Callable[..., Any] | None:
        """The C round trip publishing on this ring (see ``_fastring.c``), if accelerated.

        ``fast_call(responses.fast, kind, call_id, body, decode, spin_ns, pure_ns, deadline_ns)``
        returns the response frame, or -1 (nothing sent), 0 (sent, spin budget spent) or 2 (sent,
        pure-spin span passed).
        """
        return None if self._fast is None else self._fast.call

    def fast_caller(
        self,
        responses: Ring,
        pack: Callable[[Any], bytes],
        unpack: Callable[[memoryview], Any],
        lock: threading.Lock,
        spin: Any,
        settled_budget_ns: int,
        settled_pure_ns: int,
    ) -> Any:
        """A caller channel's whole common-case call in C (``_fastring.FastCaller``), publishing
        on this ring and reading ``responses``; ``None`` unless both rings are accelerated.

        ``spin`` is the channel's ``Spin`` (its ``settled``, ``budget_ns`` and ``pure_ns`` are
        read at each call); a settled one spins ``settled_budget_ns`` with ``settled_pure_ns``
        of pure spinning.
        """
        if self._fast is None or responses._fast is None:
            return None
        return _fastring.FastCaller(
            self._fast,
            responses._fast,
            pack,
            unpack,
            lock,
            spin,
            self.max_payload,
            settled_budget_ns,
            settled_pure_ns,
        )

    def fast_server(
        self,
        responses: Ring,
        decode: Callable[[memoryview], Any],
        tools: dict[str, Callable[..., Any]],
        async_tools: set[str],
        pack: Callable[[Any], bytes],
        max_payload: int,
    ) -> Any:
        """A served channel's common-case request in C (``_fastring.FastServer``), reading this
        ring and answering on ``responses``; ``None`` unless both rings are accelerated.

        ``decode`` must read an undecodable body as ``None`` (see :func:`lenient`); ``tools``
        and ``async_tools`` are the dispatcher's own (read at each request); a result encoded
        larger than ``max_payload`` is handed back (the dispatcher answers the error).
        """
        if self._fast is None or responses._fast is None:
            return None
        return _fastring.FastServer(
            self._fast, responses._fast, decode, tools, async_tools, pack, max_payload
        )

    # ---------------------------------------------------------------- producer
    # The hot paths below use literal header indexes and local names on purpose: each attribute
    # or global lookup costs tens of nanoseconds, and a call's whole budget is a few microseconds.
    def try_write(self, kind: int, call_id: int, body: bytes) -> bool:
        """Publish one record; ``False`` when there is no space yet (backpressure).

        Raises:
            PayloadTooLarge: ``body`` exceeds ``max_payload``.
        """
        n = len(body)
        hdr = self.hdr
        head = hdr[0]  # HEAD
        end = head + 16 + ((n + 15) & ~15)
        pos = head & self._mask
        # Fast path: an inline record that fits before the end of the data area, in space the
        # consumer is already known to have freed.
        if n > self.max_inline or end > self._write_limit or pos + end - head > self.capacity:
            return self._try_write_slow(kind, call_id, body)
        data = self._data
        _pack_record(data, pos, n, 1, kind, 0, call_id)  # REC_INLINE
        data[pos + 16 : pos + 16 + n] = body
        hdr[0] = end & _U64
        with _fence_lock:  # fence(), inlined
            pass
        if hdr[16]:  # CONSUMER_WAITING
            _notify(self.consumer_wake_fd)
        return True

    def _try_write_slow(self, kind: int, call_id: int, body: bytes) -> bool:
        n = len(body)
        if n > self.max_inline:
            return self._try_write_large(kind, call_id, body)
        hdr = self.hdr
        head = hdr[HEAD]
        if head & 15:  # only a hostile consumer moves it: a WRAP there would not fit
            raise ProtocolError(f"the ring's head {head} is not record-aligned")
        capacity = self.capacity
        need = RECORD.size + ((n + 15) & ~15)
        self._tail_seen = hdr[TAIL]
        self._write_limit = self._tail_seen + capacity
        free = capacity - (head - self._tail_seen)
        pos = head & self._mask
        room = capacity - pos
        data = self._data
        if room < need:
            if free < room + need:
                return False
            _pack_record(data, pos, 0, REC_WRAP, 0, 0, 0)
            head += room
            pos = 0
        elif free < need:
            return False
        _pack_record(data, pos, n, REC_INLINE, kind, 0, call_id)
        data[pos + RECORD.size : pos + RECORD.size + n] = body
        hdr[HEAD] = (head + need) & _U64
        fence()
        if hdr[CONSUMER_WAITING]:
            _notify(self.consumer_wake_fd)
        return True

    def _try_write_large(self, kind: int, call_id: int, body: bytes) -> bool:
        n = len(body)
        if n > self.overflow_limit:
            raise PayloadTooLarge("message", n, self.overflow_limit)
        hdr = self.hdr
        head = hdr[HEAD]
        if head & 15:
            raise ProtocolError(f"the ring's head {head} is not record-aligned")
        # A LARGE record needs 16 bytes and never wraps (the room before the end is >= 16).
        if hdr[LARGE_WRITTEN] != hdr[LARGE_CONSUMED] or self.capacity - (head - hdr[TAIL]) < 16:
            return False
        overflow = self._map_overflow()
        overflow[:n] = body
        hdr[LARGE_WRITTEN] = (hdr[LARGE_WRITTEN] + 1) & _U64
        RECORD.pack_into(self._data, head & self._mask, n, REC_LARGE, kind, 0, call_id)
        hdr[HEAD] = (head + 16) & _U64
        fence()
        if hdr[CONSUMER_WAITING]:
            _notify(self.consumer_wake_fd)
        return True

    def writable(self, size: int) -> bool:
        """Whether a body of ``size`` bytes would fit now."""
        hdr = self.hdr
        free = self.capacity - (hdr[HEAD] - hdr[TAIL])
        if size > self.max_inline:
            return hdr[LARGE_WRITTEN] == hdr[LARGE_CONSUMED] and free >= 16
        # Worst case: a wrap wastes less than one maximal record.
        return free >= 2 * (RECORD.size + ((size + 15) & ~15))

    # ---------------------------------------------------------------- consumer
    def spin_until(self, until_ns: int, yield_after_ns: int) -> int:
        """Spin while empty: 1 once readable, 0 at ``until_ns``, 2 at ``yield_after_ns``.

        Times are :func:`time.perf_counter_ns` values; on 2 the caller yields and spins again.
        """
        hdr = self.hdr
        clock = time.perf_counter_ns
        spins = 0
        while hdr[0] == hdr[8]:  # HEAD == TAIL
            spins += 1
            if not spins & 15:
                now = clock()
                if now >= until_ns:
                    return 0
                if now >= yield_after_ns:
                    return 2
        return 1

    def readable(self) -> bool:
        """Whether a record is waiting."""
        hdr = self.hdr
        return bool(hdr[HEAD] != hdr[TAIL])

    def try_read(self, decode: Callable[[memoryview], T]) -> tuple[int, int, T] | None:
        """Consume one record: ``(kind, call_id, decode(body))``, or ``None`` when empty.

        ``decode`` runs on the body in place; the record is consumed even when it raises.
        It must copy what it keeps: the body view itself is released after it returns, but
        a slice or cast of it (``body[4:]``) would still see the ring's memory, which the
        peer reuses for later records. msgspec's decoders (every decoder DSec passes) copy.

        Raises:
            ProtocolError: The record is malformed (a peer wrote garbage).
        """
        hdr = self.hdr
        tail = hdr[8]  # TAIL
        if hdr[0] == tail:
            return None
        data = self._data
        pos = tail & self._mask
        try:
            n, rec, kind, _, call_id = _unpack_record(data, pos)
        except struct.error:  # a hostile peer moved TAIL to the last bytes: no record fits
            return self._read_slow(decode, tail, pos, 0, 0, 0, 0)
        if rec == 1 and n <= self.max_inline:  # REC_INLINE; a hostile n is clamped by slicing
            body = data[pos + 16 : pos + 16 + n]
            try:
                value = decode(body)
            finally:
                body.release()  # a decoder that kept the view cannot read a reused slot
                hdr[8] = (tail + 16 + ((n + 15) & ~15)) & _U64
                # No fence here (it would cost ~0.2 µs on every read, on the critical path): a
                # producer whose "waiting" flag this load misses is woken by our next read, or by
                # wake_waiting_producer() which every consumer runs, fenced, before it sleeps.
                if hdr[24]:  # PRODUCER_WAITING
                    _notify(self.producer_wake_fd)
            return kind, call_id, value
        return self._read_slow(decode, tail, pos, n, rec, kind, call_id)

    def _read_slow(
        self,
        decode: Callable[[memoryview], T],
        tail: int,
        pos: int,
        n: int,
        rec: int,
        kind: int,
        call_id: int,
    ) -> tuple[int, int, T]:
        hdr = self.hdr
        data = self._data
        if pos & 15:  # TAIL is in shared memory: a hostile peer may have moved it
            raise ProtocolError(f"record at ring offset {pos} is not 16-byte aligned")
        if rec == REC_WRAP:
            tail += self.capacity - pos
            pos = 0
            n, rec, kind, _, call_id = _unpack_record(data, 0)
        try:
            if rec == REC_INLINE:
                if n > self.max_inline or pos + RECORD.size + n > self.capacity:
                    raise ProtocolError(f"record of {n} bytes at offset {pos} leaves the ring")
                tail += RECORD.size + ((n + 15) & ~15)
                with data[pos + 16 : pos + 16 + n] as body:
                    value = decode(body)
            elif rec == REC_LARGE:
                tail += RECORD.size
                value = self._read_large(n, decode)
            else:
                raise ProtocolError(f"unknown record type {rec} at ring offset {pos}")
        finally:
            hdr[TAIL] = tail & _U64
            fence()
            if hdr[PRODUCER_WAITING]:
                _notify(self.producer_wake_fd)
        return kind, call_id, value

    def _read_large(self, n: int, decode: Callable[[memoryview], T]) -> T:
        hdr = self.hdr
        try:
            if n > self.overflow_limit:
                raise ProtocolError(
                    f"overflow payload of {n} bytes exceeds the {self.overflow_limit} bytes "
                    "this end maps"
                )
            if n <= self.max_inline:  # a writer sends these inline: garbage from a peer
                raise ProtocolError(f"overflow record of {n} bytes would have fit the ring")
            overflow = self._map_overflow()
            body = memoryview(overflow)[:n]
            try:
                return decode(body)
            finally:
                body.release()
                if n >= _RELEASE_LARGE_AT:
                    used = min(len(overflow), (n + _PAGE - 1) // _PAGE * _PAGE)
                    with contextlib.suppress(OSError):
                        overflow.madvise(mmap.MADV_REMOVE, 0, used)
        finally:
            hdr[LARGE_CONSUMED] = (hdr[LARGE_CONSUMED] + 1) & _U64

    def wake_waiting_producer(self) -> None:
        """Wake a producer waiting for space. Call after :func:`fence`, before sleeping."""
        if self.hdr[PRODUCER_WAITING]:
            _notify(self.producer_wake_fd)

    # ---------------------------------------------------------------- both
    def _map_overflow(self) -> mmap.mmap:
        """The overflow memfd, mapped once at its sealed size (at most ``max_payload``)."""
        current = self._overflow
        if current is None:
            try:
                current = mmap.mmap(self._overflow_fd, self.overflow_limit)
            except (OSError, ValueError) as exc:  # e.g. ENOMEM: this channel fails, no other
                raise ProtocolError(f"cannot map the overflow memfd: {exc}") from exc
            self._overflow = current
        return current

    @property
    def closed(self) -> bool:
        """Whether a side closed the channel on purpose."""
        return bool(self.hdr[CLOSED])

    def mark_closed(self) -> None:
        """Tell the other side this channel is finished, and wake it."""
        self.hdr[CLOSED] = 1
        fence()
        _notify(self.consumer_wake_fd)
        _notify(self.producer_wake_fd)

    def release(self) -> None:
        """Drop this ring's views so the channel mapping can be unmapped."""
        if self._fast is not None:
            self._fast.release()
            # Drop the C methods too: they hold the callbacks, which hold this ring.
            for name in ("try_write", "try_read", "spin_until"):
                self.__dict__.pop(name, None)
        self.hdr.release()
        self._data.release()
        if self._overflow is not None:
            self._overflow.close()
            self._overflow = None
