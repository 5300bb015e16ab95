"""``DSecClient``: call other agents' tools, and serve your own, over shared memory.

Example:
    >>> client = DSecClient()                       # identity from DSEC_AGENT_NAME/DSEC_TASK_GROUP
    >>> @client.tool("web_search")
    ... def web_search(query: str) -> list[str]: ...
    >>> client.serve()                               # blocks; or: await client.aserve()

    >>> client.call_tool("agent-b", "web_search", query="memfd")        # from another agent
    >>> await client.acall_tool("agent-b", "web_search", query="memfd")

The node agent's broker hands each pair of agents a shared-memory channel; a peer on another node is
reached through the brokers over NATS request-reply, with the same calls and the same errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from types import EllipsisType, TracebackType
from typing import TYPE_CHECKING, Any, Final, NoReturn, TypeVar

from dsec_sdk.errors import (
    AgentBusy,
    AgentNotFound,
    BrokerRefused,
    BrokerUnavailable,
    CallTimeout,
    IpcError,
    PayloadTooLarge,
    PeerGone,
    ProtocolError,
    ReentrantCall,
    RemoteError,
)
from dsec_sdk.ipc import codec, control, ring
from dsec_sdk.ipc.aio import AsyncCaller
from dsec_sdk.ipc.channel import PURE_SPIN_NS, CallerEnd
from dsec_sdk.ipc.link import BrokerLink
from dsec_sdk.ipc.runner import AsyncServer, BlockingServer
from dsec_sdk.ipc.server import Dispatcher, Tool

if TYPE_CHECKING:
    from dsec_sdk.recording import Recorder, Replayer

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_TIMEOUT: Final = 30.0
DEFAULT_GROUP: Final = "default"
BUSY_RETRY_S: Final = 10.0
"""How long a `busy` answer is retried (at most the client's timeout): one to opening a
channel (:class:`BrokerRefused`), or to a call across nodes (:class:`AgentBusy`)."""
_BUSY_FIRST_PAUSE_S: Final = 0.005
_BUSY_MAX_PAUSE_S: Final = 0.2
_NO_DEADLINE: Final = 1 << 62
_unpack = codec.unpack
_clock = time.perf_counter_ns
_thread_id = threading.get_ident
_REQUEST: Final = codec.REQUEST
_RESULT: Final = codec.RESULT
_HEAD: Final = ring.HEAD
_TAIL: Final = ring.TAIL
# FastCaller.call's status codes (see _fastring.c; the same numbers with or without it).
_CALL_BUSY: Final = 0
_CALL_HELD: Final = 1
_CALL_UNENCODABLE: Final = 2
_CALL_TOO_LARGE: Final = 3
_CALL_CLOSED: Final = 4
_CALL_UNDECODABLE: Final = 5


def default_socket_path() -> Path:
    """``$DSEC_IPC_SOCKET``, else ``$DSEC_HOME/run/ipc.sock`` (``DSEC_HOME`` default: ``.dsec``)."""
    explicit = os.environ.get("DSEC_IPC_SOCKET")
    if explicit:
        return Path(explicit)
    from dsec_core.settings import Settings

    return Settings().home / control.DEFAULT_SOCKET


def _nothing_held() -> bool:
    return False


def _async_moves(client_ref: weakref.ref[DSecClient], link_ref: weakref.ref[BrokerLink]) -> None:
    """After the notice thread of ``link`` read notices: each async channel it opened that a
    final hand-over moved ends its waiting calls, in its own event loop."""
    client, link = client_ref(), link_ref()
    if client is None or link is None:
        return
    for caller in list(client._async_channels.values()):
        if caller.link is link and not caller.closed and link.moved_known(caller.end.channel_id):
            with contextlib.suppress(RuntimeError):  # (its event loop is closed)
                caller.loop.call_soon_threadsafe(caller.moved)


class _SyncChannel:
    """A caller channel used from threads: one call at a time (the lock).

    With C rings a call's common case is one C call, ``fast`` (``_fastring.FastCaller.call``):
    it takes the lock without blocking, encodes, sends, spins, decodes, and returns the result.
    Anything else comes back as a status tuple and :meth:`resume` goes on in Python. Without
    them (or ``fast`` busy in another thread, or a traced call), :meth:`call` is the Python path.
    """

    def __init__(self, end: CallerEnd, max_payload: int) -> None:
        self.end = end
        self.max_payload = max_payload
        self.lock = threading.Lock()
        self.packer = codec.new_packer()
        self._pack = self.packer.encode
        self._write = end.requests.try_write
        self._read = end.responses.try_read
        self._wait = end.wait_response
        self._resp_hdr = end.responses.hdr
        # The C round trip when both rings have it (see Ring.fast_call), else None.
        self._fast_call = end.requests.fast_call
        self._fast_responses = end.responses.fast
        # The last timeout seen and its (timeout_ms, ns): calls usually repeat the same one.
        self._timeout: float | None = None
        self._timeout_parts = (0, 0)
        spin = end.spin
        self._caller = end.requests.fast_caller(
            end.responses, self._pack, _unpack, self.lock, spin, spin.max_ns, PURE_SPIN_NS
        )
        self.fast: Callable[[str, dict[str, Any], float | None], Any] | None = (
            None if self._caller is None else self._caller.call
        )
        # Releases the lock a CALL_HELD status left held by this thread (else a no-op): run on
        # every way out of a call, so an interrupt between ``fast`` and :meth:`resume` (a
        # KeyboardInterrupt, a signal handler that raises) cannot leave the channel locked.
        self.release_held: Callable[[], bool] = (
            _nothing_held if self._caller is None else self._caller.release_held
        )
        # The threads whose Python-path call holds (or is taking) the lock, and whether this
        # thread's C call left it held: a call from above either is refused (ReentrantCall).
        self._callers: set[int] = set()
        self.closing = False  # closed from above a call in flight: closed when invoke() ends
        self._held_by_me: Callable[[], bool] = (
            _nothing_held if self._caller is None else self._caller.held_by_this_thread
        )

    def held_here(self) -> bool:
        """Whether a call of this thread on the channel is in flight: code running now is
        above it (a signal handler that interrupted it)."""
        return _thread_id() in self._callers or self._held_by_me()

    def close(self) -> None:
        """Close the channel (waiting for another thread's call on it to end). From above a
        call of this thread on it (a signal handler calling ``DSecClient.close()``), which
        would wait for itself, it is closed once that call ends instead: its rings are in
        use below."""
        if self.held_here():
            self.closing = True
            return
        self._close_now()

    def _close_now(self) -> None:
        me = _thread_id()
        try:
            self._callers.add(me)  # (a handler above this close defers, never waits for it)
            with self.lock:
                self.end.close()
        finally:
            self._callers.discard(me)

    def _take_id(self) -> int:
        """The next call id (the C caller's counter when there is one: both paths share it)."""
        caller = self._caller
        if caller is None:
            call_id: int = self.end.next_id
            self.end.next_id = call_id + 1
            return call_id
        call_id = caller.next_id
        caller.next_id = call_id + 1
        return call_id

    def invoke(
        self,
        tool: str,
        arguments: dict[str, Any],
        timeout: float | None,
        group: str,
        trace: str | None = None,
    ) -> Any:
        """One call: the C common case when there is one (untraced), else the Python path."""
        fast = self.fast
        try:
            if fast is None or trace is not None:
                return self.call(tool, arguments, timeout, group, trace)
            value = fast(tool, arguments, timeout)
            if value.__class__ is not tuple:  # (the decoder makes lists, never tuples)
                return value
            return self.resume(value, tool, arguments, timeout, group)
        except BaseException:
            self.release_held()
            raise
        finally:
            # A close() from a handler above this call, deferred: now the call has ended. (Here
            # and in DSecClient's call_tool, the two ways in: every path of a call ends there.)
            if self.closing:  # (still held here: the call below this one closes it)
                self.close()

    def resume(
        self,
        status: tuple[Any, ...],
        tool: str,
        arguments: dict[str, Any],
        timeout: float | None,
        group: str,
    ) -> Any:
        """Go on from the status tuple :attr:`fast` returned instead of a result."""
        code = status[0]
        end = self.end
        if code == _CALL_HELD:  # sent or not, the lock is held: wait as the Python path does
            _, outcome, call_id, body, deadline = status
            try:
                frame = self._after_fast_call(end, tool, timeout, call_id, body, deadline, outcome)
            finally:
                self.release_held()
            if frame[0] == _RESULT:
                return frame[2]
            codec.raise_error(end.peer, tool, group, timeout or 0.0, frame[2])
        if code == _CALL_TOO_LARGE:
            raise PayloadTooLarge(f"request to {end.peer}.{tool}", status[1], self.max_payload)
        if code == _CALL_CLOSED:
            raise PeerGone(end.peer, "the channel was closed", untaken=True)  # (nothing sent)
        if code == _CALL_UNDECODABLE:
            exc = status[1]
            raise ProtocolError(f"undecodable answer from {end.peer!r}: {exc}") from exc
        # _CALL_BUSY (another thread's call, or a timeout only Python handles), or
        # _CALL_UNENCODABLE (the Python path names the argument MessagePack cannot carry).
        return self.call(tool, arguments, timeout, group)

    def call(
        self,
        tool: str,
        arguments: dict[str, Any],
        timeout: float | None,
        group: str,
        trace: str | None = None,
    ) -> Any:
        """The Python path of a call (see the class docstring)."""
        end = self.end
        # A call on this channel already in flight in this thread, or waiting for the channel
        # (this one comes from a signal handler that interrupted it), would wait for itself;
        # refused even when that call only waits behind another thread's: from here the two
        # cannot be told apart without a moment where the lock is this thread's unmarked.
        me = _thread_id()
        callers = self._callers
        if me in callers or self._held_by_me():
            raise ReentrantCall(end.peer, tool)
        try:
            callers.add(me)  # (inside the try: an interrupt right after it still unmarks)
            with self.lock:
                if timeout is None:
                    timeout_ms, deadline = 0, _NO_DEADLINE
                else:
                    # (the type too: 1 and True are equal, and only one of them is a timeout)
                    if timeout.__class__ is not self._timeout.__class__ or timeout != self._timeout:
                        self._timeout_parts = timeout_parts(timeout)
                        self._timeout = timeout
                    timeout_ms, timeout_ns = self._timeout_parts
                    deadline = _clock() + timeout_ns if timeout_ns >= 0 else _NO_DEADLINE
                try:
                    body = self._pack(
                        [tool, arguments, timeout_ms]
                        if trace is None
                        else [tool, arguments, timeout_ms, trace]  # W3C traceparent (tracing on)
                    )
                except (TypeError, ValueError, OverflowError):
                    body = codec.encode_request(
                        self.packer, tool, arguments, timeout_ms, trace
                    )  # raises
                if len(body) > self.max_payload:
                    raise PayloadTooLarge(
                        f"request to {end.peer}.{tool}", len(body), self.max_payload
                    )
                if end.is_closed:  # (another thread's call dropped it: a hand-over, a death)
                    raise PeerGone(
                        end.peer, "the channel was closed", untaken=True
                    )  # (nothing sent)
                call_id = self._take_id()
                outcome: Any = -1
                if self._fast_call is not None:
                    spin = end.spin
                    try:
                        outcome = self._fast_call(
                            self._fast_responses,
                            _REQUEST,
                            call_id,
                            body,
                            _unpack,
                            spin.budget_ns,
                            spin.pure_ns,
                            deadline,
                        )
                    except codec.DECODE_ERRORS as exc:
                        raise ProtocolError(f"undecodable answer from {end.peer!r}: {exc}") from exc
                frame = self._after_fast_call(end, tool, timeout, call_id, body, deadline, outcome)
        finally:
            callers.discard(me)
        if frame[0] == _RESULT:
            return frame[2]
        codec.raise_error(end.peer, tool, group, timeout or 0.0, frame[2])

    def _after_fast_call(
        self,
        end: CallerEnd,
        tool: str,
        timeout: float | None,
        call_id: int,
        body: bytes,
        deadline: int,
        outcome: Any,
    ) -> tuple[int, int, Any]:
        """The rest of a call after the C round trip's ``outcome`` (-1: nothing was sent)."""
        frame = None
        sent = False
        spin = end.spin
        if outcome.__class__ is tuple:
            if not spin.settled:
                spin.hit()
            if outcome[1] == call_id:
                frame = outcome
            sent = True
        elif outcome != -1:
            sent = True
            if outcome == 2:  # spun past the pure-spin span: give the core away once
                spin.yield_cpu(_clock())
            else:
                spin.miss()
        if frame is None:
            try:
                frame = self._general(end, tool, timeout, call_id, body, deadline, sent)
            except PeerGone as exc:
                # One call at a time on this channel: a request still unread is this one.
                if not end.is_closed:
                    hdr = end.requests.hdr
                    exc.untaken = hdr[_TAIL] != hdr[_HEAD]
                raise
        return frame

    def _general(
        self,
        end: CallerEnd,
        tool: str,
        timeout: float | None,
        call_id: int,
        body: bytes,
        deadline: int,
        sent: bool,
    ) -> tuple[int, int, Any]:
        """Send (unless ``sent``) and wait for the answer to ``call_id``, sleeping if need be."""
        if (
            not sent
            and not self._write(_REQUEST, call_id, body)
            and not end.send(_REQUEST, call_id, body, deadline)
        ):
            raise CallTimeout(end.peer, tool, timeout or 0.0)
        hdr = self._resp_hdr
        while True:
            if hdr[0] == hdr[8] and not self._wait(deadline):  # nothing readable yet
                raise CallTimeout(end.peer, tool, timeout or 0.0)
            try:
                frame = self._read(_unpack)
            except codec.DECODE_ERRORS as exc:
                raise ProtocolError(f"undecodable answer from {end.peer!r}: {exc}") from exc
            # Another id: the late answer to a call that timed out; drop it.
            if frame is not None and frame[1] == call_id:
                return frame


_LONGEST_TIMEOUT: Final = 9e9
"""Seconds (~285 years); a longer timeout (``inf`` included) is no limit, like ``None``."""


def timeout_parts(timeout: object) -> tuple[int, int]:
    """A call's timeout in seconds as ``(ms, ns)``: the ``timeout_ms`` its request carries
    (``0``: none) and the nanoseconds to its deadline (``-1``: none; a timeout of 0 or less
    is due at once).

    Raises:
        TypeError: Not a number (nor ``None``).
        ValueError: NaN.
    """
    if timeout is None:
        return 0, -1
    value: int | float
    if isinstance(timeout, bool | str | bytes | bytearray):
        value = _not_seconds(timeout)
    elif isinstance(timeout, int | float):
        value = timeout
    else:  # a Fraction, a Decimal, a NumPy number: what converts to a float
        try:
            value = float(timeout)  # type: ignore[arg-type]
        except (TypeError, ValueError, OverflowError):
            value = _not_seconds(timeout)
    if value != value:
        raise ValueError("timeout must be a number of seconds, or None for no limit; got nan")
    if value <= 0:  # (-inf and an int too large for a float included)
        return 1, 0
    if value > _LONGEST_TIMEOUT:
        return 0, -1
    seconds = float(value)
    return max(1, int(seconds * 1000)), int(seconds * 1e9)


def _not_seconds(timeout: object) -> NoReturn:
    raise TypeError(
        f"timeout must be a number of seconds, or None for no limit; got {type(timeout).__name__}"
    )


def _deadline(timeout_ns: int) -> int:
    return time.perf_counter_ns() + timeout_ns if timeout_ns >= 0 else _NO_DEADLINE


class DSecClient:
    """An agent's handle on the communication plane.

    Args:
        agent: This agent's name (default ``$DSEC_AGENT_NAME``; required to serve tools).
        group: Its task group (default ``$DSEC_TASK_GROUP``, else ``default``); only agents of one
            group can call each other.
        socket_path: The broker's socket (default :func:`default_socket_path`).
        timeout: Default per-call timeout in seconds (``None``: wait as long as the peer lives).
        spin_us: How long a caller spins for an answer before sleeping on its eventfd.
        serve_spin_us: How long a server spins for the next request before sleeping.
        takeover: When serving, replace a live server of the same name (of the same tenant and
            task group) instead of being refused; the replaced one's ``serve()`` ends with
            ``BrokerUnavailable``.
            Without it, a name is owned by the first live server until its process exits.
        observe: Report every call made and served to the node agent (the ``dsec_tool_*``
            metrics, ``tool.degraded``) and trace it when tracing is on (docs/tools.md).
            Default: on inside a DSec sandbox (``DSEC_SANDBOX_ID`` set), off elsewhere (the
            raw communication plane, e.g. its benchmarks).
    """

    def __init__(
        self,
        agent: str | None = None,
        group: str | None = None,
        *,
        socket_path: str | os.PathLike[str] | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        spin_us: float = 50.0,
        serve_spin_us: float = 100.0,
        takeover: bool = False,
        observe: bool | None = None,
    ) -> None:
        raw_agent = agent or os.environ.get("DSEC_AGENT_NAME") or f"agent-{os.getpid()}"
        self.agent = control.check_name("agent name", raw_agent)
        raw_group = group or os.environ.get("DSEC_TASK_GROUP") or DEFAULT_GROUP
        self.group = control.check_name("task group", raw_group)
        self.socket_path = Path(socket_path) if socket_path else default_socket_path()
        timeout_parts(timeout)  # a bad default is said here, not at the first call
        self.timeout = timeout
        self._spin_ns = int(spin_us * 1000)
        self._serve_spin_ns = int(serve_spin_us * 1000)
        self.takeover = takeover
        self._tools: dict[str, Tool] = {}
        self._link: BrokerLink | None = None
        self._link_lock = threading.Lock()
        self._channels: dict[str, _SyncChannel] = {}
        self._async_channels: dict[str, AsyncCaller] = {}
        self._opening: dict[str, asyncio.Future[AsyncCaller]] = {}
        self._server: BlockingServer | AsyncServer | None = None
        self._state: Any = None  # an AgentState (dsec_sdk.state) this client serves with
        self._watched: Any = None  # the state whose hand-over callbacks are registered
        # Record or replay (docs/experiments.md): None when calls go live as they are
        self._recording: Recorder | Replayer | None = _recording_layer()
        if observe is None:
            observe = bool(os.environ.get("DSEC_SANDBOX_ID"))
        self._runner: Any = None  # a dsec_sdk.tools.ToolRunner when calls are observed
        if observe:
            from dsec_sdk.tools.pipeline import ToolRunner
            from dsec_sdk.tools.report import shared_reporter

            self._runner = ToolRunner(
                reporter=shared_reporter(self.socket_path, self.agent, self.group)
            )
        if self._runner is None and self._recording is None:
            # No layer to pass through (decided here, once): the hot path without their checks.
            self.call_tool = self._unlayered_call_tool()  # type: ignore[method-assign]

    # ------------------------------------------------------------------ tools
    @property
    def tool_runner(self) -> Any:
        """The ``dsec_sdk.tools.ToolRunner`` observing this client's calls (``None`` when not
        observing): ``client.tool_runner.wrap_transport(...)`` puts a layer (recording,
        replay) under every ``call_tool`` / ``acall_tool`` (docs/tools.md)."""
        return self._runner

    def tool(self, name: str | None = None) -> Callable[[F], F]:
        """Register the decorated function as a tool (named ``name`` or after the function)."""

        def register(function: F) -> F:
            self.add_tool(name or function.__name__, function)
            return function

        return register

    def add_tool(self, name: str, function: Tool) -> None:
        """Register ``function`` as tool ``name`` (before :meth:`serve`)."""
        if not callable(function):
            raise TypeError(f"tool {name!r} must be callable, got {type(function).__name__}")
        name = control.check_tool_name(name)
        self._tools[name] = (
            function if self._runner is None else self._runner.served(name, function)
        )

    def serve(self, tools: Mapping[str, Tool] | None = None) -> None:
        """Serve the registered tools (plus ``tools``) from this thread until :meth:`stop`.

        Raises:
            BrokerUnavailable: The broker cannot be reached, refused the name, or went away.
        """
        link = self._register(tools)
        server = BlockingServer(link, self._dispatcher(link), self._serve_spin_ns)
        self._server = server
        self._watch_handover()
        self._standby_ready(link)
        try:
            server.run()
        finally:
            self._server = None

    async def aserve(self, tools: Mapping[str, Tool] | None = None) -> None:
        """Serve the registered tools (plus ``tools``) from the running loop until :meth:`stop`."""
        link = await asyncio.to_thread(self._register, tools)
        server = AsyncServer(link, self._dispatcher(link), self._serve_spin_ns)
        self._server = server
        self._watch_handover()
        await asyncio.to_thread(self._standby_ready, link)
        try:
            await server.run()
        finally:
            self._server = None

    def stop(self) -> None:
        """Stop :meth:`serve` / :meth:`aserve` (thread-safe for ``serve``)."""
        if self._server is not None:
            self._server.stop()

    def pause_serving(self, timeout_s: float = 10.0) -> bool:
        """Finish the tool calls being answered, then take no new ones (they wait in their
        channels) until :meth:`resume_serving`: the old version of a live hand-over does this
        before its final checkpoint, so a call it has not taken goes to the new version.
        Thread-safe; not from the loop of :meth:`aserve` (there: ``await
        client.apause_serving()``). ``False`` when not serving or it took over ``timeout_s``."""
        server = self._server
        return server is not None and server.pause(timeout_s)

    async def apause_serving(self, timeout_s: float = 10.0) -> bool:
        """:meth:`pause_serving` from the loop :meth:`aserve` runs on."""
        server = self._server
        if isinstance(server, AsyncServer):
            return await server.loop.pause(timeout_s)
        return await asyncio.to_thread(self.pause_serving, timeout_s)

    def resume_serving(self) -> None:
        """Take calls again (a hand-over that failed)."""
        if self._server is not None:
            self._server.resume()

    def attach_state(self, state: Any) -> None:
        """Serve with this agent's DSec state (a ``dsec_sdk.state.AgentState``): in a live
        hand-over the old version stops taking calls before its final checkpoint (and takes
        them again if the hand-over fails), and the new version tells the keeper ``ready``
        once its tool server is registered as the standby. Call before :meth:`serve`."""
        self._state = state
        if self._server is not None:
            self._watch_handover()

    def _standby_ready(self, link: BrokerLink) -> None:
        """The new version of a hand-over registered its tools as the standby: ready."""
        state = self._state
        if not link.welcome.get("standby") or state is None:
            return
        if getattr(state, "handover", False) and getattr(state, "switched", None) is None:
            state.ready()

    def _watch_handover(self) -> None:
        """When this process keeps DSec state (:meth:`attach_state`, or the state API's
        current ``AgentState``), let a hand-over pause the serving before the final checkpoint
        (``AgentState.on_handover``) and resume it if the hand-over fails
        (``AgentState.on_handover_aborted``, when the state API has it)."""
        state = self._state
        if state is None:
            try:
                from dsec_sdk import state as state_api
            except ImportError:  # pragma: no cover - the state package ships with the SDK
                return
            agent_state = getattr(state_api, "AgentState", None)
            current = getattr(agent_state, "current", None)
            state = current() if callable(current) else None
        if state is None or state is self._watched:
            return
        self._watched = state  # its callbacks are registered once
        on_handover = getattr(state, "on_handover", None)
        if callable(on_handover):
            on_handover(self.pause_serving)
        on_aborted = getattr(state, "on_handover_aborted", None)
        if callable(on_aborted):
            on_aborted(self.resume_serving)

    def _register(self, tools: Mapping[str, Tool] | None) -> BrokerLink:
        for name, function in (tools or {}).items():
            self.add_tool(name, function)
        if not self._tools:
            raise ValueError(
                "nothing to serve: register a tool with @client.tool() or serve({...})"
            )
        if self._server is not None:
            raise RuntimeError(f"agent {self.agent!r} is already serving")
        return BrokerLink(
            self.socket_path,
            self.agent,
            self.group,
            "server",
            sorted(self._tools),
            takeover=self.takeover,
        )

    def _dispatcher(self, link: BrokerLink) -> Dispatcher:
        return Dispatcher(self._tools, int(link.welcome["max_payload"]))

    # ------------------------------------------------------------------ calls
    def call_tool(
        self,
        agent: str,
        tool: str,
        arguments: Mapping[str, Any] | None = None,
        /,
        *,
        timeout: float | EllipsisType | None = ...,
        **kwargs: Any,
    ) -> Any:
        """Call ``tool`` of ``agent`` and return its result.

        Arguments go as keywords, or as a mapping when a name clashes (``{"timeout": 3}``).
        ``timeout`` is in seconds: ``None`` or ``inf`` wait as long as the agent lives, 0 or
        less is due at once.

        Raises:
            CallTimeout: No answer within ``timeout`` (default: the client's).
            TypeError, ValueError: ``timeout`` is no number of seconds (NaN, a string).
            RemoteError: The tool raised (``ToolNotFound``, ``BadArguments`` are subclasses).
            PeerGone: The agent died or left during the call.
            AgentNotFound: No agent of that name in this task group.
            ValueError: ``agent`` is no valid agent name.
            PayloadTooLarge: The request or response exceeds the limit.
            BrokerUnavailable: The node agent cannot be reached.
        """
        # Layers, outside in: observed (metrics, traces: docs/tools.md), then recorded or
        # replayed (docs/experiments.md) closest to the transport, so a replayed call is
        # observed like a live one.
        if self._runner is not None:
            return self._observed_call(agent, tool, _merge(arguments, kwargs), timeout)
        if self._recording is not None:
            return self._call_recorded(agent, tool, _merge(arguments, kwargs), timeout, None)
        merged = kwargs if arguments is None else _merge(arguments, kwargs)
        seconds = self.timeout if timeout is ... else timeout
        channel = self._channels.get(agent)
        if channel is None or channel.end.is_closed:
            channel = self._channel(agent, seconds)
        try:
            try:
                return channel.invoke(tool, merged, seconds, self.group)
            except (PeerGone, ProtocolError) as exc:
                return self._call_again(agent, tool, merged, seconds, channel, exc)
        except AgentBusy as exc:
            return self._busy_again(agent, tool, merged, seconds, None, exc)

    def _unlayered_call_tool(self) -> Callable[..., Any]:
        """:meth:`call_tool` for a client that neither observes nor records nor replays, with
        what it uses held in closure cells (a call's whole budget is a few microseconds)."""
        channels_get = self._channels.get
        open_channel = self._channel
        call_again = self._call_again
        busy_again = self._busy_again
        merge = _merge

        def call_tool(
            agent: str,
            tool: str,
            arguments: Mapping[str, Any] | None = None,
            /,
            *,
            timeout: float | EllipsisType | None = ...,
            **kwargs: Any,
        ) -> Any:
            merged = kwargs if arguments is None else merge(arguments, kwargs)
            seconds = self.timeout if timeout is ... else timeout
            channel = channels_get(agent)
            if channel is None or channel.end.is_closed:
                channel = open_channel(agent, seconds)
            try:  # channel.invoke(), inlined: a method call is ~0.05 µs of a ~2 µs call
                fast = channel.fast
                if fast is None:
                    return channel.call(tool, merged, seconds, self.group)
                value = fast(tool, merged, seconds)
                if value.__class__ is not tuple:  # (the decoder makes lists, never tuples)
                    return value
                return channel.resume(value, tool, merged, seconds, self.group)
            except (PeerGone, ProtocolError) as exc:
                try:
                    return call_again(agent, tool, merged, seconds, channel, exc)
                except AgentBusy as busy:  # (the call's second try, to the new version)
                    return busy_again(agent, tool, merged, seconds, None, busy)
            except AgentBusy as exc:  # (raised after resume() released the channel)
                return busy_again(agent, tool, merged, seconds, None, exc)
            except BaseException:  # an interrupt between fast() and resume(): see release_held
                channel.release_held()
                raise
            finally:
                if channel.closing:  # (close() from a handler above the C call)
                    channel.close()

        call_tool.__doc__ = DSecClient.call_tool.__doc__
        return call_tool

    def _call_again(
        self,
        agent: str,
        tool: str,
        merged: dict[str, Any],
        seconds: float | None,
        channel: _SyncChannel,
        exc: PeerGone | ProtocolError,
    ) -> Any:
        """After a failed call: raise, or (a hand-over moved the agent to its new version
        before the old one read this call) send it once more, to the new one (the caller sees
        a slower call, not an error)."""
        self._drop(agent, channel)
        if isinstance(exc, ProtocolError) or not (exc.untaken and self._moved(agent)):
            raise exc
        channel = self._channel(agent, seconds)
        try:
            return channel.invoke(tool, merged, seconds, self.group)
        except (PeerGone, ProtocolError):
            self._drop(agent, channel)
            raise

    def _call_live(
        self,
        agent: str,
        tool: str,
        merged: dict[str, Any],
        timeout: float | EllipsisType | None,
        trace: str | None,
    ) -> Any:
        """:meth:`call_tool` without the layers (the record/replay layer's ``live``)."""
        seconds = self.timeout if timeout is ... else timeout
        try:
            return self._call_live_once(agent, tool, merged, seconds, trace)
        except AgentBusy as exc:
            return self._busy_again(agent, tool, merged, seconds, trace, exc)

    def _call_live_once(
        self,
        agent: str,
        tool: str,
        merged: dict[str, Any],
        seconds: float | None,
        trace: str | None,
    ) -> Any:
        channel = self._channels.get(agent)
        if channel is None or channel.end.is_closed:
            channel = self._channel(agent, seconds)
        try:
            return channel.invoke(tool, merged, seconds, self.group, trace)
        except (PeerGone, ProtocolError) as exc:
            return self._call_again(agent, tool, merged, seconds, channel, exc)

    def _busy_again(
        self,
        agent: str,
        tool: str,
        merged: dict[str, Any],
        seconds: float | None,
        trace: str | None,
        exc: AgentBusy,
    ) -> Any:
        """After a `busy` answer from another node's bridge (the tool did not run): the call
        again, with backoff, for up to its timeout (:data:`BUSY_RETRY_S` at most)."""
        return _again_while_busy(
            exc, seconds, lambda left: self._call_live_once(agent, tool, merged, left, trace)
        )

    def _call_recorded(
        self,
        agent: str,
        tool: str,
        merged: dict[str, Any],
        timeout: float | EllipsisType | None,
        trace: str | None,
    ) -> Any:
        from dsec_sdk import recording

        layer = self._recording
        assert layer is not None
        key = recording.tool_key(agent, tool, merged)

        def live() -> bytes:
            return _outcome(lambda: self._call_live(agent, tool, merged, timeout, trace))

        return _unwrap(agent, tool, self.group, layer.call_sync(key, live, recording.is_error))

    def _observed_call(
        self,
        agent: str,
        tool: str,
        merged: dict[str, Any],
        timeout: float | EllipsisType | None,
    ) -> Any:
        """:meth:`call_tool` observed: reported to the node agent, traced when tracing is on
        (the ``traceparent`` goes in the request frame)."""
        seconds = self.timeout if timeout is ... else timeout

        def send(_call: Any, trace: str | None) -> Any:
            if self._recording is not None:
                return self._call_recorded(agent, tool, merged, seconds, trace)
            return self._call_live(agent, tool, merged, seconds, trace)

        return self._runner.call_remote(agent, tool, merged, seconds, send)

    def _moved(self, agent: str) -> bool:
        """Whether the broker said that ``agent`` moved to a new server (a hand-over)."""
        link = self._link
        return link is not None and link.take_moved(agent)

    async def acall_tool(
        self,
        agent: str,
        tool: str,
        arguments: Mapping[str, Any] | None = None,
        /,
        *,
        timeout: float | EllipsisType | None = ...,
        **kwargs: Any,
    ) -> Any:
        """``async`` twin of :meth:`call_tool`; many calls may be in flight at once."""
        seconds = self.timeout if isinstance(timeout, EllipsisType) else timeout
        merged = _merge(arguments, kwargs)
        if self._runner is not None:
            return await self._runner.acall_remote(
                agent,
                tool,
                merged,
                seconds,
                lambda trace: self._acall_layered(agent, tool, merged, seconds, trace),
            )
        return await self._acall_layered(agent, tool, merged, seconds, None)

    async def _acall_layered(
        self,
        agent: str,
        tool: str,
        merged: dict[str, Any],
        seconds: float | None,
        trace: str | None,
    ) -> Any:
        """The call under the observing layer: recorded or replayed when the sandbox says so."""
        if self._recording is None:
            return await self._acall(agent, tool, merged, seconds, trace)
        from dsec_sdk import recording

        layer = self._recording
        key = recording.tool_key(agent, tool, merged)

        async def live() -> bytes:
            try:
                value = await self._acall(agent, tool, merged, seconds, trace)
            except IpcError as exc:
                frame = _frame(exc)
                if frame is None:
                    raise
                return recording.encode_error(frame)
            return recording.encode_result(value)

        return _unwrap(agent, tool, self.group, await layer.call(key, live, recording.is_error))

    async def _acall(
        self,
        agent: str,
        tool: str,
        merged: dict[str, Any],
        seconds: float | None,
        trace: str | None,
    ) -> Any:
        try:
            return await self._acall_once(agent, tool, merged, seconds, trace)
        except AgentBusy as first:  # (as _again_while_busy, without blocking the loop)
            last, retries = first, _BusyRetries(seconds)
            while (pause := retries.next_pause()) is not None:
                await asyncio.sleep(pause)
                try:
                    return await self._acall_once(agent, tool, merged, retries.left(), trace)
                except AgentBusy as again:
                    last = again
            raise retries.gave_up(last) from None

    async def _acall_once(
        self,
        agent: str,
        tool: str,
        merged: dict[str, Any],
        seconds: float | None,
        trace: str | None,
    ) -> Any:
        timeout_ms, timeout_ns = timeout_parts(seconds)  # a bad one is said before anything
        caller = await self._async_channel(agent)
        packer = codec.new_packer()
        body = codec.encode_request(packer, tool, merged, timeout_ms, trace)
        limit = caller.end.requests.max_payload
        if len(body) > limit:
            raise PayloadTooLarge(f"request to {agent}.{tool}", len(body), limit)
        try:
            frame = await caller.call(codec.REQUEST, body, _deadline(timeout_ns))
        except PeerGone as exc:
            if self._async_channels.get(agent) is caller:
                del self._async_channels[agent]
            if not (exc.untaken and self._moved(agent)):
                raise
            # Moved by a hand-over before the old server read it: once more, to the new one.
            caller = await self._async_channel(agent)
            try:
                frame = await caller.call(codec.REQUEST, body, _deadline(timeout_ns))
            except PeerGone:
                if self._async_channels.get(agent) is caller:
                    del self._async_channels[agent]
                raise
        if frame is None:
            raise CallTimeout(agent, tool, seconds or 0.0)
        kind, value = frame
        if kind == codec.RESULT:
            return value
        codec.raise_error(agent, tool, self.group, seconds or 0.0, value)

    # ------------------------------------------------------------------ channels
    def _broker(self, connect_to: str | None = None) -> BrokerLink:
        """The broker connection; a new one sends ``connect_to``'s connect behind its hello."""
        if self._link is None:
            self._link = BrokerLink(
                self.socket_path, self.agent, self.group, "caller", connect_to=connect_to
            )
        return self._link

    def _open_on(
        self, agent: str, timeout: float | EllipsisType | None = ...
    ) -> tuple[CallerEnd, BrokerLink]:
        """A new channel to ``agent``, and the broker connection that opened it (whose notices
        name it: channel ids are the broker's, a restarted broker counts from 1 again);
        ``timeout``: the call's that needs it (``...``: the client's), which bounds how long a
        busy answer is retried."""
        # (here, not from the broker: a bad name is the caller's mistake, not the broker's)
        control.check_name("agent name", agent)
        # A busy answer (the agent has not read the channels offered to it yet, or this
        # sandbox's connects are at their bound) says retry: the client does, for a while.
        try:
            return self._open_once(agent)
        except BrokerRefused as exc:
            if exc.code != "busy":
                raise
            seconds = self.timeout if timeout is ... else timeout
            return _again_while_busy(exc, seconds, lambda _left: self._open_once(agent))

    def _open_once(self, agent: str) -> tuple[CallerEnd, BrokerLink]:
        with self._link_lock:
            fresh = self._link is None
            try:
                try:
                    link = self._broker(agent)
                    message, fds = link.connect(agent)
                except BrokerRefused:
                    raise  # (a refusal: the connection stays, as it is)
                except BrokerUnavailable:
                    self._drop_link()
                    if fresh:
                        raise
                    # An old connection to a broker that has since restarted: once afresh.
                    link = self._broker(agent)
                    message, fds = link.connect(agent)
            except (AgentNotFound, BrokerUnavailable):
                raise  # (answered, or the connection is gone already)
            except BaseException:
                # Interrupted between a connect and its answer, or out of step with the
                # broker: an answer may still be queued, so the next call starts afresh.
                self._drop_link()
                raise
        end = CallerEnd(
            channel_id=int(message["channel"]),
            peer=agent,
            capacity=int(message["ring_capacity"]),
            fds=fds,
            max_payload=int(message["max_payload"]),
            spin_ns=self._spin_ns,
        )
        return end, link

    def _drop_link(self) -> None:
        if self._link is not None:
            self._link.close()
            self._link = None

    def _channel(self, agent: str, timeout: float | EllipsisType | None = ...) -> _SyncChannel:
        channel = self._channels.get(agent)
        if channel is not None and not channel.end.is_closed:
            return channel
        end, link = self._open_on(agent, timeout)
        # A final hand-over's notice, on the connection that opened it, wakes a call waiting here.
        fd = link.sock.fileno()
        if fd >= 0:  # (closed by another thread meanwhile: the old process's death tells it)
            end.watch_moves(fd, link.moved_channel, link.moved_known)
            # (and wherever another thread reads that notice, it wakes the call at once)
            link.ring_on_move(end)
        channel = _SyncChannel(end, end.requests.max_payload)
        self._channels[agent] = channel
        return channel

    async def _async_channel(self, agent: str) -> AsyncCaller:
        caller = self._async_channels.get(agent)
        if caller is not None:
            if not caller.closed and caller.loop is asyncio.get_running_loop():
                return caller
            caller.close()  # dead, or bound to an event loop that is gone (asyncio.run again)
            del self._async_channels[agent]
        # Calls made while the channel is being opened wait for that one channel (in call
        # order: a future wakes its waiters first come, first served) instead of opening more.
        opening = self._opening.get(agent)
        if opening is None:
            opening = asyncio.ensure_future(self._open_async(agent))
            self._opening[agent] = opening
            opening.add_done_callback(lambda _: self._opening.pop(agent, None))
        return await asyncio.shield(opening)

    async def _open_async(self, agent: str) -> AsyncCaller:
        end, link = await asyncio.to_thread(self._open_on, agent)
        caller = AsyncCaller(end, codec.decode)
        caller.link = link
        self._async_channels[agent] = caller
        # A final hand-over's notice ends the calls waiting on it at once (the loop never sleeps
        # in a call that could watch the connection: a thread reads the notices for it).
        link.watch_notices(functools.partial(_async_moves, weakref.ref(self), weakref.ref(link)))
        return caller

    def _drop(self, agent: str, channel: _SyncChannel) -> None:
        if self._channels.get(agent) is channel:
            del self._channels[agent]
        # (its moved notice stays noted: another thread may still be about to wait on it)
        channel.close()

    def close(self) -> None:
        """Stop serving and close every channel and the broker connection."""
        self.stop()
        for channel in list(self._channels.values()):
            channel.close()  # (from a signal handler above a call on it: once that call ends)
        self._channels.clear()
        for caller in self._async_channels.values():
            caller.close()
        self._async_channels.clear()
        if self._link is not None:
            self._link.close()
            self._link = None

    def __enter__(self) -> DSecClient:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> DSecClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _as_seconds(timeout: Any) -> float | None:
    """A timeout the call took (any real number, ``Decimal`` and huge ints included) as the
    float a retry's arithmetic can use: ``None`` stays, too large for a float is ``inf``."""
    if timeout is None:
        return None
    try:
        return float(timeout)
    except OverflowError:
        return math.inf


_Busy = TypeVar("_Busy", AgentBusy, BrokerRefused)
_T = TypeVar("_T")


class _BusyRetries:
    """When to try again after a `busy` answer: pauses doubling from 5 ms to 0.2 s, for up to
    the call's timeout (:data:`BUSY_RETRY_S` at most), each try given the time left."""

    def __init__(self, seconds: Any) -> None:
        self.seconds = _as_seconds(seconds)
        self.budget = BUSY_RETRY_S if self.seconds is None else min(self.seconds, BUSY_RETRY_S)
        self.started = time.monotonic()
        self.pause = _BUSY_FIRST_PAUSE_S
        self.tried = False

    def next_pause(self) -> float | None:
        """The pause before the next try; ``None``: no time left for one."""
        pause = self.pause
        if time.monotonic() - self.started + pause > self.budget:
            return None
        self.pause = min(pause * 2, _BUSY_MAX_PAUSE_S)
        self.tried = True
        return pause

    def left(self) -> float | None:
        """The call's time left (``None``: no timeout)."""
        if self.seconds is None:
            return None
        return self.seconds - (time.monotonic() - self.started)

    def gave_up(self, last: _Busy) -> _Busy:
        """The last answer to raise: saying how long it was retried (as it came when it was
        not)."""
        return last.retried(time.monotonic() - self.started) if self.tried else last


def _again_while_busy(exc: _Busy, seconds: float | None, again: Callable[[float | None], _T]) -> _T:
    """After the `busy` answer ``exc``: ``again(time left)`` on :class:`_BusyRetries`' schedule
    while it answers busy; then the last answer."""
    retries = _BusyRetries(seconds)
    while (pause := retries.next_pause()) is not None:
        time.sleep(pause)
        try:
            return again(retries.left())
        except (AgentBusy, BrokerRefused) as answer:
            if type(answer) is not type(exc) or answer.code != "busy":
                raise
            exc = answer
    raise retries.gave_up(exc) from None


def _merge(arguments: Mapping[str, Any] | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    if not arguments:
        return kwargs
    merged = dict(arguments)
    for key, value in kwargs.items():
        if key in merged:
            raise TypeError(f"argument {key!r} given both in the mapping and as a keyword")
        merged[key] = value
    return merged


def _frame(exc: IpcError) -> list[str] | None:
    """The error frame of a failed tool call, as it is recorded; ``None``: not the tool's
    outcome (the broker unreachable, a protocol error) and not recorded."""
    if isinstance(exc, RemoteError):
        return [exc.code, exc.error_type, exc.remote_message, exc.traceback_summary]
    if isinstance(exc, CallTimeout):
        return [codec.E_TIMEOUT, "CallTimeout", str(exc), ""]
    if isinstance(exc, PeerGone):
        return [codec.E_PEER_GONE, "PeerGone", exc.reason, ""]
    if isinstance(exc, AgentNotFound):
        return [codec.E_NOT_FOUND, "AgentNotFound", exc.detail, ""]
    if isinstance(exc, PayloadTooLarge):
        return [codec.E_TOO_LARGE, "PayloadTooLarge", str(exc), ""]
    return None


def _recording_layer() -> Recorder | Replayer | None:
    """The record/replay layer the node agent asked for (its environment), else None; the
    recording module is imported only then (an agent that records nothing never pays for it)."""
    if not (os.environ.get("DSEC_RECORD_FILE") or os.environ.get("DSEC_REPLAY_FILE")):
        return None
    from dsec_sdk import recording

    active = recording.active_layer()
    return None if isinstance(active, recording.Passthrough) else active


def _outcome(call: Callable[[], Any]) -> bytes:
    """Run a live tool call; its result or its error as recorded bytes."""
    from dsec_sdk import recording

    try:
        value = call()
    except IpcError as exc:
        frame = _frame(exc)
        if frame is None:
            raise
        return recording.encode_error(frame)
    return recording.encode_result(value)


def _unwrap(agent: str, tool: str, group: str, body: bytes) -> Any:
    """The result in a recorded outcome, or its error raised as the live call raised it."""
    from dsec_sdk import recording

    ok, value = recording.decode_outcome(body)
    if ok:
        return value
    codec.raise_error(agent, tool, group, 0.0, value)
