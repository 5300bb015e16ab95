"""Serving loops of an agent: blocking (a thread) and asyncio, both fed by the broker link."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import Awaitable
from typing import Any, Final

from dsec_sdk.errors import BrokerUnavailable, ProtocolError
from dsec_sdk.ipc import codec, control
from dsec_sdk.ipc.aio import AsyncServeLoop
from dsec_sdk.ipc.channel import ServerEnd, Sleeper, Spin
from dsec_sdk.ipc.link import BrokerLink
from dsec_sdk.ipc.server import Dispatcher, ServeCore, await_tool, decode_request

# While busy, look for new channels on the broker link this often.
_CONTROL_EVERY_NS: Final = 2_000_000
# Where FastServer.serve stopped (see _fastring.c): (stage, call_id, value).
_SERVE_REQUEST: Final = 0  # a request to dispatch here
_SERVE_RAISED: Final = 1  # the exception the tool raised
_SERVE_RESULT: Final = 2  # a result that did not encode or fit
_SERVE_BODY: Final = 3  # the encoded result, for a ring that had no room
_IDLE_SLEEP_NS: Final = 1_000_000_000


def open_server_end(
    message: dict[str, Any], fds: list[int], doorbell: int, max_payload: int
) -> ServerEnd:
    """Wrap an ``open`` message from the broker into a :class:`ServerEnd`."""
    if message.get("op") != "open" or len(fds) != control.SERVER_FDS:
        control.close_fds(fds)
        raise ProtocolError(f"unexpected broker message {message.get('op')!r} with {len(fds)} fds")
    return ServerEnd(
        channel_id=int(message["channel"]),
        peer=str(message["caller"]),
        capacity=int(message["ring_capacity"]),
        fds=fds,
        doorbell=doorbell,
        max_payload=max_payload,
    )


def _read_control(sock: socket.socket) -> list[tuple[dict[str, Any], list[int]]] | None:
    """Every message waiting on a non-blocking link; ``None`` once the broker hung up."""
    messages: list[tuple[dict[str, Any], list[int]]] = []
    while True:
        try:
            received = control.recv(sock)
        except (BlockingIOError, InterruptedError):
            return messages
        except ProtocolError:
            continue
        except OSError:
            return None
        if received is None:
            return None
        messages.append(received)


class BlockingServer:
    """Serve tools from the calling thread until :meth:`stop`.

    Args:
        link: The serving connection (its welcome carries the doorbell).
        dispatcher: The tools.
        spin_ns: How long to spin for the next request before sleeping.
    """

    def __init__(self, link: BrokerLink, dispatcher: Dispatcher, spin_ns: int) -> None:
        self.link = link
        self.dispatcher = dispatcher
        self.doorbell = link.welcome_fds[0]
        self.max_payload = int(link.welcome["max_payload"])
        self.sleeper = Sleeper(self.doorbell)
        self.core = ServeCore(on_remove=self._forget)
        self.spin = Spin(spin_ns)
        self.sleeper.watch(link.sock.fileno())
        self._stopped = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        # A hand-over's pause (see pause()).
        self._pause_asked = threading.Event()
        self._paused = threading.Event()
        # [0] is true while a stop or a pause is asked: what the serving loop checks between
        # two calls (a list item: a few nanoseconds, where two Event.is_set() calls cost ~0.1
        # µs of a ~3 µs call).
        self._asked = [False]
        # Each channel's FastServer (the C common case of a request), made on first use.
        self._fast_servers: dict[ServerEnd, Any] = {}

    def stop(self) -> None:
        """Make :meth:`run` return soon (callable from any thread)."""
        self._stopped.set()
        self._asked[0] = True
        control_wake(self.doorbell)

    def pause(self, timeout_s: float = 10.0) -> bool:
        """Finish the requests being answered, then read no new ones until :meth:`resume`
        (the old version of a hand-over; callable from any thread); ``False`` if that took
        longer than ``timeout_s``."""
        self._pause_asked.set()
        self._asked[0] = True
        control_wake(self.doorbell)
        return self._paused.wait(timeout_s)

    def resume(self) -> None:
        """Read requests again (a hand-over that failed)."""
        self._pause_asked.clear()
        self._asked[0] = False
        if self._stopped.is_set():  # (after the line above: a stop meanwhile stays asked)
            self._asked[0] = True
        self._paused.clear()
        control_wake(self.doorbell)

    def run(self) -> None:
        """The serving loop: serve, spin, sleep; returns after :meth:`stop`.

        Raises:
            BrokerUnavailable: The broker closed the connection (node agent stopped).
        """
        self.link.sock.setblocking(False)
        stopped = self._stopped.is_set
        pause_asked = self._pause_asked.is_set
        clock = time.perf_counter_ns
        try:
            while not stopped():
                if pause_asked():
                    self._paused.set()
                    while pause_asked() and not stopped():
                        self._stopped.wait(0.001)
                    continue
                if not self._poll_control():
                    raise BrokerUnavailable(
                        f"the broker at {self.link.path} closed the connection; serving stopped"
                    )
                control_due = clock() + _CONTROL_EVERY_NS
                serve_burst = self._serve_burst
                spin_for_work = self.core.spin_for_work
                spin = self.spin
                # Bounded by control_due too: a caller whose ring never empties (a flood, or a
                # hostile HEAD) must not keep new channels, reaping and stop() waiting.
                while not pause_asked() and clock() < control_due and serve_burst():
                    pass
                # Idle: spin for the next request (and serve it), up to the adaptive budget.
                while True:
                    now = clock()
                    if now >= control_due or stopped() or pause_asked():
                        break
                    until = min(control_due, now + spin.budget_ns)
                    channels = self.core.channels
                    if (
                        len(channels) == 1
                        and not channels[0].backlog
                        and channels[0].requests.fast is not None
                    ):
                        # One caller, C rings: spin and read in one call, serve that, and go on
                        # spinning for the next one without coming back here.
                        found = self._spin_serve_one(channels[0], until, control_due)
                    else:
                        found = spin_for_work(until, spin)
                    if not found:
                        if clock() < control_due:
                            spin.miss()
                            self._sleep()
                        break
                    if not spin.settled:
                        spin.hit()
                    while not pause_asked() and clock() < control_due and serve_burst():
                        pass
        finally:
            self.close()

    def _serve_burst(self) -> bool:
        channels = self.core.channels
        if len(channels) == 1 and not channels[0].backlog:
            return self._serve_one(channels[0])
        work = self.core.next_requests(decode_request)
        dispatcher = self.dispatcher
        for end, call_id, request in work:
            outcome = dispatcher.start(request)
            if not isinstance(outcome, tuple):
                outcome = self._run_async(outcome)
            end.respond(outcome[0], call_id, outcome[1])
            if end.is_closed:  # the tool closed its own channel: stop serving it
                self.core.remove(end)
        return bool(work)

    def _serve_one(self, end: ServerEnd) -> bool:
        # The common single-caller case (no backlog) without the round-robin bookkeeping.
        try:
            frame = end.requests.try_read(decode_request)
        except ProtocolError:
            self.core.remove(end)
            return False
        if frame is None:
            return False
        self._answer(end, frame[1], frame[2])
        return True

    def _answer(self, end: ServerEnd, call_id: int, request: Any) -> None:
        outcome = self.dispatcher.start(request)
        if not isinstance(outcome, tuple):
            outcome = self._run_async(outcome)
        end.respond(outcome[0], call_id, outcome[1])  # a corrupted ring breaks only this channel
        if end.is_closed:  # the tool closed its own channel: stop serving it
            self.core.remove(end)

    def _spin_serve_one(self, end: ServerEnd, until_ns: int, control_due: int) -> bool:
        """Spin for requests on ``end`` and serve them; ``False`` once a spin ran out.

        After each answer it spins again at once, with a fresh budget (as the caller's loop
        would after a hit), until a spin runs out, ``control_due`` comes, a response has to wait
        in the backlog, or a stop or pause is asked: between two calls of a busy caller the
        server goes straight back to the ring instead of through the serving loop.

        Each request's common case (a plain function's result that encodes and fits) is one C
        call, ``FastServer.serve``; where it stops, the rest runs here, as for any request.
        """
        fast = self._fast_servers.get(end)
        if fast is None:
            dispatcher = self.dispatcher
            fast = end.requests.fast_server(
                end.responses,
                decode_request,
                dispatcher.tools,
                dispatcher.async_tools,
                dispatcher.packer.encode,
                dispatcher.max_payload,
            )
            self._fast_servers[end] = fast
        serve = fast.serve
        dispatcher = self.dispatcher
        spin = self.spin
        clock = time.perf_counter_ns
        asked = self._asked
        yield_after = clock() + spin.pure_ns
        while True:
            try:
                got = serve(until_ns, yield_after)
            except ProtocolError:
                self.core.remove(end)
                return True
            if got.__class__ is not int:
                stage, call_id, value = got
                if stage == _SERVE_BODY:  # encoded, but the ring had no room for it here
                    kind, body = codec.RESULT, value
                elif stage == _SERVE_REQUEST:  # not a plain call (async, unknown, malformed...)
                    outcome = dispatcher.start(value)
                    if outcome.__class__ is not tuple:
                        outcome = self._run_async(outcome)  # type: ignore[arg-type]
                    kind, body = outcome
                elif stage == _SERVE_RAISED:
                    kind, body = dispatcher.raised(value, at_call=value.__traceback__ is None)
                else:  # _SERVE_RESULT: it did not encode, or is too large: say so
                    kind, body = dispatcher.finish(value)
                if not spin.settled:
                    spin.hit()
                if end.is_closed:  # the tool closed it (a stop, a hand-over): nobody to answer
                    self.core.remove(end)
                    return True
                end.respond(kind, call_id, body)  # a corrupted ring breaks only this channel
                if end.backlog or end.broken is not None:
                    return True
            elif got != 1:
                if got == 0:  # the spin ran out: the caller counts a miss and may sleep
                    return False
                yield_after = spin.yield_cpu(clock())
                continue
            elif not spin.settled:
                spin.hit()
            if asked[0]:  # a stop or a pause
                return True
            now = clock()
            if now >= control_due:  # the control socket's turn, however busy the ring
                return True
            yield_after = now + spin.pure_ns
            until_ns = now + spin.budget_ns
            if until_ns > control_due:
                until_ns = control_due

    def _forget(self, end: ServerEnd) -> None:
        self.sleeper.unwatch(end.peer_pidfd)
        self._fast_servers.pop(end, None)

    def _run_async(self, pending: Awaitable[Any]) -> tuple[int, bytes]:
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        return self._loop.run_until_complete(await_tool(self.dispatcher, pending))

    def _sleep(self) -> None:
        if self.core.announce_sleep():
            fired = self.sleeper.sleep(_IDLE_SLEEP_NS)
            self.core.woke()
            # Closed flags cost a memory read; pidfds a syscall each, so only when one fired.
            self.core.reap(check_pids=bool(fired))
            self.core.leave_callers_core()

    def _poll_control(self) -> bool:
        messages = _read_control(self.link.sock)
        if messages is None:
            return False
        for message, fds in messages:
            try:
                end = open_server_end(message, fds, self.doorbell, self.max_payload)
            except (ProtocolError, ValueError, OSError):
                continue
            self.sleeper.watch(end.peer_pidfd)
            self.core.add(end)
        return True

    def close(self) -> None:
        """Close every channel and the link."""
        self.core.close()
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        self.link.close()
        control.close_fds(self.link.welcome_fds)


class AsyncServer:
    """Serve tools from the running event loop until :meth:`stop`."""

    def __init__(self, link: BrokerLink, dispatcher: Dispatcher, spin_ns: int) -> None:
        self.link = link
        self.dispatcher = dispatcher
        self.doorbell = link.welcome_fds[0]
        self.max_payload = int(link.welcome["max_payload"])
        self.loop = AsyncServeLoop(self.doorbell, decode_request, self._handle, spin_ns)
        self._aloop = asyncio.get_running_loop()
        self._broker_gone = False

    def _handle(self, end: ServerEnd, call_id: int, request: Any) -> Awaitable[None] | None:
        outcome = self.dispatcher.start(request)
        if isinstance(outcome, tuple):
            self.loop.respond(end, outcome[0], call_id, outcome[1])
            return None
        return self._finish(end, call_id, outcome)

    async def _finish(self, end: ServerEnd, call_id: int, pending: Awaitable[Any]) -> None:
        kind, body = await await_tool(self.dispatcher, pending)
        self.loop.respond(end, kind, call_id, body)

    def stop(self) -> None:
        """Make :meth:`run` return."""
        self.loop.stop()

    def pause(self, timeout_s: float = 10.0) -> bool:
        """From another thread: see :meth:`BlockingServer.pause`."""
        future = asyncio.run_coroutine_threadsafe(self.loop.pause(timeout_s), self._aloop)
        return future.result(timeout_s + 1.0)

    def resume(self) -> None:
        """From another thread: read requests again."""
        self._aloop.call_soon_threadsafe(self.loop.resume)

    async def run(self) -> None:
        """Serve until :meth:`stop` or until the broker hangs up."""
        sock = self.link.sock
        sock.setblocking(False)
        self._aloop.add_reader(sock.fileno(), self._on_control)
        try:
            await self.loop.run()
        finally:
            self._aloop.remove_reader(sock.fileno())
            self.link.close()
            control.close_fds(self.link.welcome_fds)
        if self._broker_gone:
            raise BrokerUnavailable(
                f"the broker at {self.link.path} closed the connection; serving stopped"
            )

    def _on_control(self) -> None:
        messages = _read_control(self.link.sock)
        if messages is None:
            self._broker_gone = True
            self.loop.stop()
            self._aloop.remove_reader(self.link.sock.fileno())
            return
        for message, fds in messages:
            try:
                self.loop.add(open_server_end(message, fds, self.doorbell, self.max_payload))
            except (ProtocolError, ValueError, OSError):
                continue


def control_wake(fd: int) -> None:
    """Ring an eventfd (wakes a sleeping serving loop)."""
    with contextlib.suppress(OSError):
        os.eventfd_write(fd, 1)
