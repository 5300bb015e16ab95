"""Serving tools: dispatch requests to functions, round-robin over every caller's channel.

Fairness: each sweep takes at most one request per channel, starting one channel further each
time, so a caller that floods its ring cannot starve the others. A response that does not fit the
caller's ring waits in that channel's backlog, and the channel is not read again until it drains.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from dsec_sdk.errors import ProtocolError
from dsec_sdk.ipc import codec
from dsec_sdk.ipc import ring as r
from dsec_sdk.ipc.channel import CoreMover, ServerEnd, Spin

T = TypeVar("T")
Tool = Callable[..., Any]


class Dispatcher:
    """Maps tool names to functions and turns one request into one response frame.

    Args:
        tools: Tool name -> function (sync or ``async def``), called with keyword arguments.
        max_payload: Largest response body; larger results become a ``payload_too_large`` error.
    """

    def __init__(self, tools: Mapping[str, Tool], max_payload: int) -> None:
        self.tools = dict(tools)
        # Decided once: inspect.isawaitable() on every result costs more than the rest of a call.
        self.async_tools = {name for name, function in self.tools.items() if _is_async(function)}
        self.max_payload = max_payload
        self.packer = codec.new_packer()
        # Bound once: every call's hot path (an attribute lookup is ~20 ns of a ~3 µs call).
        self._tool = self.tools.get
        self._encode = self.packer.encode

    def start(self, request: Any) -> tuple[int, bytes] | Awaitable[Any]:
        """Run a request: a finished ``(kind, body)``, or an awaitable an ``async`` tool returned.

        Pass the awaitable's outcome to :meth:`finish` (or its exception to :meth:`failed`).
        """
        try:
            name, arguments, _ = request
            function = self._tool(name)
        except ValueError:
            return self._start_traced(request)  # [tool, arguments, timeout_ms, traceparent]
        except TypeError:
            return self._malformed()
        if function is None:
            known = ", ".join(sorted(self.tools)) or "none"
            return codec.ERROR, codec.encode_error(
                self.packer,
                codec.E_UNKNOWN_TOOL,
                "ToolNotFound",
                f"no tool named {name!r}; this agent serves: {known}",
            )
        try:
            result = function(**arguments)
        except Exception as exc:
            tb = exc.__traceback__
            # Raised by the call itself, not inside the tool: no frame below this one.
            return self.raised(exc, at_call=tb is not None and tb.tb_next is None)
        if name in self.async_tools:
            return result  # type: ignore[no-any-return]
        try:  # finish(), inlined: this is every call's hot path
            body: bytes = self._encode(result)
        except Exception:  # finish() says what
            return self.finish(result)
        if len(body) > self.max_payload:
            return self.finish(result)
        return _RESULT, body

    def _malformed(self) -> tuple[int, bytes]:
        return codec.ERROR, codec.encode_error(
            self.packer, codec.E_BAD_ARGUMENTS, "ProtocolError", "malformed request frame"
        )

    def _start_traced(self, request: Any) -> tuple[int, bytes] | Awaitable[Any]:
        """A request that carries the caller's W3C ``traceparent`` (tracing is on there): run
        it with the trace context set, so the tool's span is the caller's child. Off the hot
        path: untraced requests have three elements."""
        from dsec_sdk.tools.tracing import INCOMING

        try:
            name, arguments, timeout_ms, trace = request
        except (TypeError, ValueError):
            return self._malformed()
        if not isinstance(trace, str) or len(trace) > codec.MAX_TRACEPARENT:
            trace = None
        token = INCOMING.set(trace)
        try:
            started = self.start([name, arguments, timeout_ms])
        finally:
            INCOMING.reset(token)
        if isinstance(started, tuple):
            return started
        return _with_trace(started, trace)

    def raised(self, exc: Exception, *, at_call: bool) -> tuple[int, bytes]:
        """The ERROR frame for an exception a tool call raised; ``at_call``: raised by the call
        itself, before any frame of the tool ran (for a ``TypeError``: the signature does not
        match)."""
        # (codec tells any exception without raising, whatever its own code does)
        if _bad_arguments(exc, at_call):
            return codec.ERROR, codec.encode_error(
                self.packer, codec.E_BAD_ARGUMENTS, "TypeError", codec.describe(exc)
            )
        return codec.ERROR, codec.error_from_exception(self.packer, codec.E_REMOTE, exc)

    def finish(self, result: Any) -> tuple[int, bytes]:
        """Encode a tool's return value."""
        try:
            body: bytes = self.packer.encode(result)
        except Exception as exc:  # whatever encoding raised, even from the
            # result's own code (a datetime whose utcoffset() raises): the tool's error
            return codec.ERROR, codec.encode_error(
                self.packer,
                codec.E_BAD_RESULT,
                codec.type_name(exc),
                f"the tool's result cannot be sent as MessagePack: {codec.describe(exc)}",
            )
        if len(body) > self.max_payload:
            return codec.ERROR, codec.encode_error(
                self.packer,
                codec.E_TOO_LARGE,
                "PayloadTooLarge",
                f"response is {len(body)} bytes; the limit is {self.max_payload} bytes",
            )
        return codec.RESULT, body

    def failed(self, exc: BaseException) -> tuple[int, bytes]:
        """Encode an exception an ``async`` tool raised."""
        return codec.ERROR, codec.error_from_exception(self.packer, codec.E_REMOTE, exc)


def _bad_arguments(exc: Exception, at_call: bool) -> bool:
    """A ``TypeError`` of the call itself (the signature does not match), or one the observing
    wrapper of ``dsec_sdk.tools`` marked so (``dsec_binding``); ``False`` when asking raised
    (the exception's own code: it is told as the tool's error)."""
    try:
        return isinstance(exc, TypeError) and bool(at_call or getattr(exc, "dsec_binding", False))
    except Exception:
        return False


async def _with_trace(awaitable: Awaitable[Any], trace: str | None) -> Any:
    from dsec_sdk.tools.tracing import INCOMING

    token = INCOMING.set(trace)
    try:
        return await awaitable
    finally:
        INCOMING.reset(token)


class ServeCore:
    """The channels one server (or the broker's proxy) serves, swept round-robin."""

    def __init__(self, on_remove: Callable[[ServerEnd], None] | None = None) -> None:
        self.channels: list[ServerEnd] = []
        self._next = 0
        self.placement = CoreMover()
        self._on_remove = on_remove

    def add(self, end: ServerEnd) -> None:
        """Start serving a new caller."""
        self.channels.append(end)

    def remove(self, end: ServerEnd) -> None:
        """Stop serving a caller and free its channel."""
        if end in self.channels:
            self.channels.remove(end)
            if self._on_remove is not None:
                self._on_remove(end)
        end.close()

    def next_requests(self, decode: Callable[[memoryview], T]) -> list[tuple[ServerEnd, int, T]]:
        """At most one request per channel, in round-robin order. Broken channels are dropped."""
        channels = self.channels
        count = len(channels)
        if count == 1:
            return self._next_single(channels[0], decode)
        if not count:
            return []
        start = self._next % count
        self._next = start + 1
        found: list[tuple[ServerEnd, int, T]] = []
        broken: list[ServerEnd] = []
        for index in range(start, start + count):
            end = channels[index % count]
            if end.backlog and not end.flush_backlog():
                continue
            try:
                frame = end.requests.try_read(decode)
            except ProtocolError:
                broken.append(end)
                continue
            if frame is not None:
                found.append((end, frame[1], frame[2]))
        for end in broken:
            self.remove(end)
        return found

    def _next_single(
        self, end: ServerEnd, decode: Callable[[memoryview], T]
    ) -> list[tuple[ServerEnd, int, T]]:
        # The common case of one caller, without the round-robin bookkeeping.
        if end.backlog and not end.flush_backlog():
            return []
        try:
            frame = end.requests.try_read(decode)
        except ProtocolError:
            self.remove(end)
            return []
        return [] if frame is None else [(end, frame[1], frame[2])]

    def spin_for_work(self, until_ns: int, spin: Spin) -> bool:
        """Spin until a channel without backlog has a request (``True``) or ``until_ns``."""
        ready = [end for end in self.channels if not end.backlog]
        clock = time.perf_counter_ns
        yield_after = clock() + spin.pure_ns
        if len(ready) == 1:
            spin_until = ready[0].requests.spin_until
            while True:
                outcome = spin_until(until_ns, yield_after)
                if outcome != 2:
                    return outcome == 1
                yield_after = spin.yield_cpu(clock())
        headers = [end.requests.hdr for end in ready]
        while True:
            for hdr in headers:
                if hdr[0] != hdr[8]:
                    return True
            now = clock()
            if now >= until_ns:
                return False
            if now >= yield_after:
                yield_after = spin.yield_cpu(now)

    def leave_callers_core(self) -> bool:
        """Just woken by a caller: if it runs on this core, move to another (``True`` if moved).

        A wake-up usually lands next to the task that woke us, and two agents on one core pay a
        context switch per call for as long as they talk. The caller's C write path records
        its core in the ring header. At most once per ``MIGRATE_EVERY_NS``.
        """
        for end in self.channels:
            hdr = end.requests.hdr
            if hdr[r.HEAD] != hdr[r.TAIL]:
                return self.placement.leave(int(hdr[r.PRODUCER_CPU]) - 1)
        return False

    @property
    def moves(self) -> int:
        """Times this server left a caller's core after a wake-up."""
        return self.placement.moves

    def has_work(self) -> bool:
        """Whether any channel has a request waiting (or a backlog that may drain)."""
        return any(end.requests.readable() or end.backlog for end in self.channels)

    def announce_sleep(self) -> bool:
        """Tell every caller we are about to sleep; ``False`` (and no sleep) if work came in."""
        for end in self.channels:
            end.requests.hdr[r.CONSUMER_WAITING] = 1
            if end.backlog:
                end.responses.hdr[r.PRODUCER_WAITING] = 1
        r.fence()
        for end in self.channels:
            end.requests.wake_waiting_producer()
        if self.has_work_now():
            self.woke()
            return False
        return True

    def has_work_now(self) -> bool:
        """Like :meth:`has_work`, but a backlog counts only if its ring now has room."""
        for end in self.channels:
            if end.requests.readable() and not end.backlog:
                return True
            if end.backlog and end.responses.writable(len(end.backlog[0][2])):
                return True
        return False

    def woke(self) -> None:
        """Clear the sleep announcements."""
        for end in self.channels:
            end.requests.hdr[r.CONSUMER_WAITING] = 0
            end.responses.hdr[r.PRODUCER_WAITING] = 0

    def reap(self, *, check_pids: bool = True) -> list[ServerEnd]:
        """Drop channels whose caller closed them (or exited: ``check_pids``); return them."""
        gone = [
            end for end in self.channels if end.peer_gone_reason(check_pid=check_pids) is not None
        ]
        for end in gone:
            self.remove(end)
        return gone

    def close(self) -> None:
        """Close every channel."""
        for end in list(self.channels):
            self.remove(end)


def _is_async(function: Tool) -> bool:
    call = getattr(function, "__call__", None)  # noqa: B004 - async __call__ of an object
    return inspect.iscoroutinefunction(function) or inspect.iscoroutinefunction(call)


_unpack = codec.unpack
_RESULT = codec.RESULT


decode_request: Callable[[memoryview], Any] = r.lenient(_unpack)
"""Decode a request body; a malformed one becomes ``None`` (answered as bad arguments)."""


async def await_tool(dispatcher: Dispatcher, pending: Awaitable[Any]) -> tuple[int, bytes]:
    """Await an ``async`` tool's result and encode it."""
    try:
        result = await pending
    except asyncio.CancelledError as exc:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise  # the server cancelled it (a stop): not the tool's to answer
        # The tool's own: a task it cancelled and then awaited. An error answer, as any.
        return dispatcher.failed(exc)
    except Exception as exc:
        return dispatcher.failed(exc)
    return dispatcher.finish(result)
