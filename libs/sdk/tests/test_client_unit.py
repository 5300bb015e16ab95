"""DSecClient configuration, tool registration, dispatch and error mapping (no broker)."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
from collections.abc import Callable, Iterator
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
from dsec_sdk import (
    AgentNotFound,
    BadArguments,
    BrokerUnavailable,
    CallTimeout,
    DSecClient,
    PayloadTooLarge,
    PeerGone,
    ReentrantCall,
    RemoteError,
    ToolNotFound,
)
from dsec_sdk.client import _SyncChannel
from dsec_sdk.errors import ProtocolError
from dsec_sdk.ipc import channel as ch
from dsec_sdk.ipc import codec
from dsec_sdk.ipc.server import Dispatcher, await_tool

pytestmark = pytest.mark.unit


def test_identity_and_socket_come_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DSEC_AGENT_NAME", "agent-a")
    monkeypatch.setenv("DSEC_TASK_GROUP", "team-7")
    monkeypatch.setenv("DSEC_IPC_SOCKET", str(tmp_path / "x.sock"))
    client = DSecClient()
    assert (client.agent, client.group, client.socket_path) == (
        "agent-a",
        "team-7",
        tmp_path / "x.sock",
    )


def test_default_socket_lives_under_dsec_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("DSEC_IPC_SOCKET", raising=False)
    monkeypatch.setenv("DSEC_HOME", str(tmp_path))
    assert DSecClient("a", "g").socket_path == tmp_path / "run" / "ipc.sock"


def test_names_are_checked_with_a_clear_message() -> None:
    with pytest.raises(ValueError, match=r"task group 'a.b' is invalid: use 1-63 of"):
        DSecClient("a", "a.b")
    client = DSecClient("a", "g")
    with pytest.raises(ValueError, match=r"tool name 'web search' is invalid"):
        client.add_tool("web search", lambda: None)
    with pytest.raises(TypeError, match="tool 'x' must be callable, got int"):
        client.add_tool("x", 3)  # type: ignore[arg-type]


def test_decorator_registers_under_the_given_or_function_name() -> None:
    client = DSecClient("a", "g")

    @client.tool("web_search")
    def search(query: str) -> str:
        return query

    @client.tool()
    def summarize(text: str) -> str:
        return text

    assert client._tools == {"web_search": search, "summarize": summarize}


def test_serving_nothing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="nothing to serve"):
        DSecClient("a", "g", socket_path=tmp_path / "s").serve()


def test_no_broker_is_broker_unavailable(tmp_path: Path) -> None:
    client = DSecClient("a", "g", socket_path=tmp_path / "none.sock")
    with pytest.raises(BrokerUnavailable, match="is the node agent running"):
        client.call_tool("b", "x")


def _run(dispatcher: Dispatcher, request: object) -> tuple[int, object]:
    outcome = dispatcher.start(request)
    assert isinstance(outcome, tuple)
    return outcome[0], codec.unpack(outcome[1])


def test_dispatcher_turns_every_failure_into_an_error_frame() -> None:
    def boom() -> None:
        raise KeyError("missing")

    tools = {"echo": lambda x: x, "boom": boom, "bad": lambda: object()}
    dispatcher = Dispatcher(tools, max_payload=1000)
    assert _run(dispatcher, ["echo", {"x": [1, "a"]}, 0]) == (codec.RESULT, [1, "a"])
    kind, body = _run(dispatcher, ["boom", {}, 0])
    assert kind == codec.ERROR and body[:3] == ["remote", "KeyError", "'missing'"]
    assert "in boom" in body[3]
    assert _run(dispatcher, ["echo", {"y": 1}, 0])[1][0] == "bad_arguments"
    assert _run(dispatcher, ["nope", {}, 0])[1][:2] == ["unknown_tool", "ToolNotFound"]
    assert _run(dispatcher, ["bad", {}, 0])[1][0] == "bad_result"
    assert _run(dispatcher, ["echo", {"x": "z" * 2000}, 0])[1][0] == "payload_too_large"
    assert (
        _run(
            dispatcher,
            "garbage",
        )[1][0]
        == "bad_arguments"
    )


def _deep(depth: int) -> list[object]:
    value: list[object] = []
    for _ in range(depth):
        value = [value]
    return value


def test_a_result_nested_past_the_stack_is_a_bad_result_sync_or_async() -> None:
    """A tool that echoes a caller's deep argument: its result cannot be encoded. That is the
    tool's error (``bad_result``), not a RecursionError out of the serving loop."""

    async def echo_later(x: object) -> object:
        return x

    dispatcher = Dispatcher({"echo": lambda x: x, "later": echo_later}, max_payload=1 << 20)
    kind, body = _run(dispatcher, ["echo", {"x": _deep(5000)}, 0])
    assert kind == codec.ERROR and body[:2] == ["bad_result", "RecursionError"]
    pending = dispatcher.start(["later", {"x": _deep(5000)}, 0])
    assert not isinstance(pending, tuple)
    kind, raw = asyncio.run(await_tool(dispatcher, pending))
    assert kind == codec.ERROR and codec.unpack(raw)[:2] == ["bad_result", "RecursionError"]


def test_an_error_answer_nested_past_the_stack_is_a_protocol_error() -> None:
    for body in (_deep(5000), ["remote", _deep(5000), "text", ""]):
        with pytest.raises(ProtocolError, match="malformed error frame"):
            codec.raise_error("b", "t", "g", 1.0, body)


@pytest.mark.parametrize(
    ("code", "expected"),
    [
        ("remote", RemoteError),
        ("unknown_tool", ToolNotFound),
        ("bad_arguments", BadArguments),
        ("payload_too_large", PayloadTooLarge),
        ("timeout", CallTimeout),
        ("peer_gone", PeerGone),
        ("agent_not_found", AgentNotFound),
    ],
)
def test_error_codes_map_to_typed_errors(code: str, expected: type[Exception]) -> None:
    with pytest.raises(expected):
        codec.raise_error("b", "t", "g", 1.0, [code, "E", "text", ""])


# ------------------------------------------------------------ call_tool over an in-process channel
# The client's channel to agent "b" is a ring pair in this process, answered by a scripted server
# thread: every way a call can end, through the C common case (and what it hands back to Python)
# and through the Python path alone (ring_mode "python"), must look the same to the caller.
class _Channel:
    def __init__(self, tmp_path: Path, max_payload: int = 1 << 16) -> None:
        fds = ch.create_channel(4096)
        self.doorbell = ch.new_eventfd()
        pidfd = os.pidfd_open(os.getpid())
        caller = ch.CallerEnd(
            channel_id=1,
            peer="b",
            capacity=4096,
            fds=[os.dup(fd) for fd in fds.all()] + [os.dup(self.doorbell), os.dup(pidfd)],
            max_payload=max_payload,
            spin_ns=1000,
        )
        self.server = ch.ServerEnd(
            channel_id=1,
            peer="a",
            capacity=4096,
            fds=[os.dup(fd) for fd in fds.all()] + [pidfd],
            doorbell=self.doorbell,
            max_payload=max_payload,
        )
        fds.close()
        self.client = DSecClient("a", "g", socket_path=tmp_path / "none.sock", observe=False)
        self.channel = _SyncChannel(caller, max_payload)
        self.client._channels["b"] = self.channel
        self.requests: list[object] = []

    def answer(self, *script: Callable[[int], list[tuple[int, int, bytes]]]) -> threading.Thread:
        """Serve one request per step: each step maps its id to the records to answer with."""

        def run() -> None:
            for step in script:
                frame = None
                while frame is None:
                    frame = self.server.requests.try_read(codec.unpack)
                self.requests.append(frame[2])
                for kind, call_id, body in step(frame[1]):
                    assert self.server.responses.try_write(kind, call_id, body)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self.client.close()
        self.server.close()
        os.close(self.doorbell)


@pytest.fixture
def channel(tmp_path: Path) -> Iterator[_Channel]:
    made = _Channel(tmp_path)
    yield made
    made.close()


_encode = codec.new_packer().encode


def test_a_call_ends_the_same_whichever_path_carries_it(channel: _Channel) -> None:
    call = channel.client.call_tool
    served = channel.answer(
        lambda i: [(codec.RESULT, i, _encode({"hits": [1, 2]}))],
        # the late answer to an earlier call first: dropped, the right one returned
        lambda i: [(codec.RESULT, i - 1, _encode("late")), (codec.RESULT, i, _encode("right"))],
        lambda i: [(codec.ERROR, i, _encode(["remote", "KeyError", "'k'", "in tool"]))],
        lambda i: [(codec.ERROR, i, _encode(["bad_arguments", "TypeError", "no x", ""]))],
    )
    assert call("b", "search", query="memfd") == {"hits": [1, 2]}
    assert call("b", "search", {"timeout": 3}, timeout=None) == "right"
    with pytest.raises(RemoteError, match="KeyError") as err:
        call("b", "search")
    assert err.value.traceback_summary == "in tool"
    with pytest.raises(BadArguments, match="no x"):
        call("b", "search", x=1)
    served.join()
    assert channel.requests == [
        ["search", {"query": "memfd"}, 30_000],
        ["search", {"timeout": 3}, 0],
        ["search", {}, 30_000],
        ["search", {"x": 1}, 30_000],
    ]
    # What cannot be sent is refused before anything is sent.
    with pytest.raises(TypeError, match="arguments of tool 'search' are not MessagePack-serial"):
        call("b", "search", when=object())
    with pytest.raises(PayloadTooLarge, match=r"request to b.search is \d+ bytes; the limit is"):
        call("b", "search", text="x" * (1 << 16))
    # A timeout that is no number of seconds names the argument and what it takes.
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds.*got nan"):
        call("b", "search", timeout=float("nan"))
    for bad in ("soon", True, [1]):
        with pytest.raises(TypeError, match=r"timeout must be a number of seconds, or None for"):
            call("b", "search", timeout=bad)
    assert not channel.server.requests.readable()
    # No answer in time; then an answer that does not decode: the channel is dropped.
    with pytest.raises(CallTimeout, match=r"timed out after 0\.02 s"):
        call("b", "search", timeout=0.02)
    channel.server.requests.try_read(len)
    served = channel.answer(lambda i: [(codec.RESULT, i, b"\xc1")])
    with pytest.raises(ProtocolError, match="undecodable answer from 'b'"):
        call("b", "search")
    served.join()
    assert "b" not in channel.client._channels


def test_a_timeout_past_any_deadline_is_no_limit_and_a_bad_default_is_refused_at_once(
    channel: _Channel, tmp_path: Path
) -> None:
    longest = (float("inf"), 1e12, 2**70, 10**400)
    served = channel.answer(*[lambda i: [(codec.RESULT, i, _encode("ok"))]] * len(longest))
    for timeout in longest:
        assert channel.client.call_tool("b", "t", timeout=timeout) == "ok"
    served.join()
    assert channel.requests == [["t", {}, 0]] * len(longest)  # sent as "no limit"
    for due in (-1, float("-inf"), -(10**400), Fraction(-1, 2)):  # 0 or less: due at once
        with pytest.raises(CallTimeout):
            channel.client.call_tool("b", "t", timeout=due)
        assert channel.server.requests.try_read(codec.unpack)[2] == ["t", {}, 1]
    # Numbers of other types convert; a value equal to the last timeout is still checked as
    # itself (True == 1, and only one of them is a timeout), on either path.
    served = channel.answer(*[lambda i: [(codec.RESULT, i, _encode("ok"))]] * 3)
    for timeout in (Fraction(3, 2), Decimal("1.5"), 1):
        assert channel.client.call_tool("b", "t", timeout=timeout) == "ok"
    served.join()
    assert [r[2] for r in channel.requests[-3:]] == [1500, 1500, 1000]  # type: ignore[index]
    with pytest.raises(TypeError, match="got bool"):
        channel.client.call_tool("b", "t", timeout=True)
    assert not channel.server.requests.readable()
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds.*got nan"):
        DSecClient("a", "g", socket_path=tmp_path / "s", timeout=float("nan"))
    with pytest.raises(TypeError, match=r"timeout must be a number of seconds.*got str"):
        DSecClient("a", "g", socket_path=tmp_path / "s", timeout="30")  # type: ignore[arg-type]
    no_broker = DSecClient("a", "g", socket_path=tmp_path / "none.sock", observe=False)
    with pytest.raises(ValueError, match=r"timeout must be a number of seconds.*got nan"):
        asyncio.run(no_broker.acall_tool("b", "t", timeout=float("nan")))


def test_calls_from_many_threads_on_one_channel_each_get_their_own_answer(
    channel: _Channel,
) -> None:
    calls = 200
    served = channel.answer(*[lambda i: [(codec.RESULT, i, _encode(i))]] * calls)
    results: list[tuple[int, object]] = []

    def caller(n: int) -> None:
        for k in range(calls // 4):
            # each answer is the id its request carried: ids in order, none shared
            results.append((n, channel.client.call_tool("b", "count", n=n, k=k)))

    threads = [threading.Thread(target=caller, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    served.join()
    assert sorted(value for _, value in results) == list(range(1, calls + 1))  # type: ignore[type-var]
    assert len(channel.requests) == calls


def _outer_call_interrupted_by(channel: _Channel, handler: Callable[[], None]) -> None:
    """Call "b.outer" while nobody answers; a SIGALRM runs ``handler`` above that call, and
    only then is the call answered ("outer done", asserted)."""
    handled = threading.Event()

    def on_alarm(signum: int, frame: object) -> None:
        handler()
        handled.set()

    def after_the_handler(call_id: int) -> list[tuple[int, int, bytes]]:
        assert handled.wait(10)
        return [(codec.RESULT, call_id, _encode("outer done"))]

    previous = signal.signal(signal.SIGALRM, on_alarm)
    try:
        served = channel.answer(after_the_handler)
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        assert channel.client.call_tool("b", "outer", timeout=20) == "outer done"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    served.join()


def test_a_call_on_the_same_channel_from_a_signal_handler_is_refused_and_the_outer_goes_on(
    channel: _Channel,
) -> None:
    """A signal handler calls the same agent while this thread's call waits for its answer.
    The nested call cannot have the channel before the outer call ends, and the outer call
    cannot end before the handler returns: it used to wait for ever. It is refused at once
    (``ReentrantCall``), the outer call's lock untouched, and the outer call gets its answer."""
    seen: list[tuple[bool, str]] = []

    def nested_call() -> None:
        try:
            channel.client.call_tool("b", "nested", timeout=5)
        except ReentrantCall as exc:
            seen.append((channel.channel.lock.locked(), str(exc)))

    _outer_call_interrupted_by(channel, nested_call)
    assert len(seen) == 1
    locked, text = seen[0]
    assert locked  # the outer call still held its lock: the nested one never took or freed it
    assert "call b.nested made while this thread's call to 'b' is in flight" in text
    assert [r[0] for r in channel.requests] == ["outer"]  # type: ignore[index]  # (nested never sent)
    assert not channel.server.requests.readable() and not channel.channel.lock.locked()
    served = channel.answer(lambda i: [(codec.RESULT, i, _encode("after"))])
    assert channel.client.call_tool("b", "search") == "after"
    served.join()


def test_a_client_closed_from_a_signal_handler_closes_the_channel_once_the_call_it_interrupted_ends(
    channel: _Channel,
) -> None:
    """A SIGTERM handler that calls ``client.close()`` while this thread's call waits for
    its answer: ``close`` used to wait for that call's lock, which the call could not give
    back before the handler returned. The channel is closed once the call ends instead (its
    rings are in use below the handler): the call gets its answer, then the channel is gone."""
    sync = channel.channel
    closed_in_handler: list[bool] = []

    def close_client() -> None:
        channel.client.close()
        closed_in_handler.append(sync.end.is_closed)

    _outer_call_interrupted_by(channel, close_client)
    assert closed_in_handler == [False]  # not under the call that was using it ...
    assert sync.end.is_closed and not sync.lock.locked()  # ... but as soon as it ended
    assert "b" not in channel.client._channels


_TRACE = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"  # (a traced call takes the Python path)


def test_an_interrupt_as_a_call_marks_its_thread_never_leaves_the_thread_marked(
    channel: _Channel,
) -> None:
    """Found by a review of the refusal above: a KeyboardInterrupt handled right after the
    call marked its thread (before its ``try``) left the mark for good, so every later call
    of that thread on the channel was refused and ``close()`` never closed it. Here the
    interrupt comes from the marking itself, at exactly that point."""
    sync = channel.channel

    class InterruptedOnce(set[int]):
        armed = True

        def add(self, item: int) -> None:
            super().add(item)
            if self.armed:
                self.armed = False
                raise KeyboardInterrupt

    sync._callers = InterruptedOnce()
    with pytest.raises(KeyboardInterrupt):
        sync.call("search", {}, 1.0, "g", _TRACE)
    assert not sync._callers and not sync.lock.locked()
    served = channel.answer(lambda i: [(codec.RESULT, i, _encode("next"))])
    assert sync.call("search", {}, 1.0, "g", _TRACE) == "next"
    served.join()
    channel.client.close()
    assert sync.end.is_closed


def test_a_close_from_a_handler_above_a_close_defers_and_a_call_there_is_refused(
    channel: _Channel,
) -> None:
    """Found by the same review: a SIGTERM handled while this thread closes the client
    (leaving ``with DSecClient() as c:``) whose handler closes it again, or calls that agent,
    waited for ever for the lock the close below it held."""
    sync = channel.channel
    seen: list[object] = []

    def on_term(signum: int, frame: object) -> None:
        try:
            channel.client.call_tool("b", "ping", timeout=1)
        except ReentrantCall as exc:
            seen.append(type(exc))
        channel.client.close()  # the client is being closed below: this one only asks

    real_close = sync.end.close

    def close_with_signal() -> None:
        signal.raise_signal(signal.SIGTERM)  # handled as the end starts closing
        real_close()

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        sync.end.close = close_with_signal  # type: ignore[method-assign]
        with channel.client:
            pass
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [ReentrantCall] and sync.end.is_closed and not sync.lock.locked()


@pytest.mark.parametrize("ring_mode", ["c"], indirect=True)
def test_a_close_from_a_handler_inside_the_c_call_closes_the_channel_when_it_returns(
    channel: _Channel,
) -> None:
    """Found by the same review: a handler can run inside the C call (from a finalizer that
    its allocations trigger) while it holds the lock; a ``close()`` there is deferred, and
    the C call then returned its value straight to the caller, which never closed the
    channel (its file descriptors stayed open until the process ended)."""
    sync = channel.channel
    ran_inside: list[bool] = []

    def on_term(signum: int, frame: object) -> None:
        ran_inside.append(sync._held_by_me())
        channel.client.close()

    class Bait:
        """Cyclic garbage whose finalizer raises SIGTERM once collected inside the C call."""

        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            if sync._held_by_me() and not ran_inside:
                signal.raise_signal(signal.SIGTERM)
            elif not ran_inside:
                Bait()  # (collected too early: leave another)

    previous = signal.signal(signal.SIGTERM, on_term)
    threshold = gc.get_threshold()
    try:
        caller = sync._caller
        assert caller is not None
        answered = channel.server.responses.try_write(
            codec.RESULT, caller.next_id, _encode("outer done")
        )  # (answered already: the C call returns the value itself)
        assert answered
        Bait()
        gc.set_threshold(1)
        assert channel.client.call_tool("b", "outer", timeout=5) == "outer done"
    finally:
        gc.set_threshold(*threshold)
        signal.signal(signal.SIGTERM, previous)
    assert ran_inside == [True]  # the handler ran above the C call, the lock held
    assert sync.end.is_closed and not sync.lock.locked()


@pytest.mark.parametrize("ring_mode", ["c"], indirect=True)
def test_the_c_caller_says_which_thread_holds_the_channel(channel: _Channel) -> None:
    """What the refusal above rests on where the C caller holds the lock: a held call is this
    thread's until it is released, never another thread's."""
    sync = channel.channel
    assert sync.fast is not None
    status = sync.fast("search", {}, 0.001)  # nobody answers: handed over with the lock held
    assert status[0] == 1 and sync.lock.locked()
    assert sync._held_by_me()
    elsewhere: list[bool] = []
    other = threading.Thread(target=lambda: elsewhere.append(sync._held_by_me()))
    other.start()
    other.join()
    assert elsewhere == [False]
    with pytest.raises(ReentrantCall):
        sync.call("again", {}, 1.0, "g")  # (it would have waited for ever)
    assert sync.release_held() and not sync._held_by_me() and not sync.lock.locked()


@pytest.mark.parametrize("ring_mode", ["c"], indirect=True)
def test_an_interrupt_between_the_c_call_and_its_python_rest_leaves_the_channel_usable(
    channel: _Channel,
) -> None:
    sync = channel.channel
    real = sync.fast
    assert real is not None

    def interrupted(tool: str, arguments: dict[str, object], timeout: float | None) -> object:
        status = real(tool, arguments, timeout)
        if status.__class__ is tuple and status[0] == 1:  # sent, lock held: Ctrl-C lands here
            raise KeyboardInterrupt
        return status

    sync.fast = interrupted
    for call in (
        lambda: channel.client.call_tool("b", "search", timeout=0.01),  # the inlined path
        lambda: sync.invoke("search", {}, 0.01, "g"),
    ):
        with pytest.raises(KeyboardInterrupt):
            call()  # nobody answers: the C spin runs out and hands over with the lock held
        assert not sync.lock.locked()
        assert channel.server.requests.try_read(codec.unpack) is not None  # it was sent
    sync.fast = real
    served = channel.answer(lambda i: [(codec.RESULT, i, _encode("after"))])
    assert channel.client.call_tool("b", "search") == "after"
    served.join()
