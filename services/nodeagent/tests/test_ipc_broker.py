"""The communication plane on one node: broker + SDK, agents as threads and real processes."""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dsec_sdk import (
    AgentNotFound,
    BadArguments,
    BrokerUnavailable,
    CallTimeout,
    DSecClient,
    PayloadTooLarge,
    PeerGone,
    RemoteError,
    ToolNotFound,
)
from dsec_sdk.ipc import control

from dsec_nodeagent.ipc import AgentKey

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the test kit
from _ipc_testkit import (
    BrokerThread,
    agent_tools,
    metric,
    start_agent,
    wait_serving,
    wait_until,
)

pytestmark = pytest.mark.integration

RING = 1 << 16  # small rings, so random payloads wrap often and many exceed a ring


@pytest.fixture(params=["c", "python"])
def ring_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ring implementations (the SDK's C hot path and ring.py), in this process and in the
    agent processes it starts (they inherit the environment)."""
    mode: str = request.param
    monkeypatch.setenv("DSEC_IPC_PURE_PYTHON", "1" if mode == "python" else "0")
    return mode


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    # Short path: a Unix socket path is limited to 107 bytes.
    path = Path(tempfile.mkdtemp(prefix="dsec-ipc-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def broker(sock_dir: Path) -> Iterator[BrokerThread]:
    thread = BrokerThread(sock_dir / "ipc.sock", ring_capacity=RING, max_payload=4 << 20)
    yield thread
    thread.stop()
    assert not (sock_dir / "ipc.sock").exists()


class ThreadServer:
    """An agent serving from a thread of the test process (``release`` ends its ``hang``)."""

    def __init__(
        self,
        broker: BrokerThread,
        name: str,
        tools: dict[str, Any] | None = None,
        group: str = "g1",
    ) -> None:
        self.release = threading.Event()
        self.client = DSecClient(name, group, socket_path=broker.socket_path)
        tools = tools if tools is not None else agent_tools(self.release)
        self.thread = threading.Thread(target=self.client.serve, args=(tools,), daemon=True)
        self.thread.start()
        key = AgentKey(group, name)
        wait_until(lambda: broker.broker.local_server(key), what=f"{name} to register")

    def stop(self) -> None:
        self.release.set()
        self.client.stop()
        self.thread.join(10)
        assert not self.thread.is_alive()


@pytest.fixture
def agent_b(broker: BrokerThread) -> Iterator[ThreadServer]:
    server = ThreadServer(broker, "agent-b")
    yield server
    server.stop()


@pytest.fixture
def caller(broker: BrokerThread, agent_b: ThreadServer) -> Iterator[DSecClient]:
    client = DSecClient("agent-a", "g1", socket_path=broker.socket_path, timeout=20)
    wait_serving(client, "agent-b")
    yield client
    client.close()


def test_sync_and_async_calls_return_the_tools_result(caller: DSecClient) -> None:
    assert caller.call_tool("agent-b", "echo", data="hello") == {"data": "hello", "seq": 0}
    assert caller.call_tool("agent-b", "echo", {"data": [1, 2.5, None, b"\x00"]}, seq=7) == {
        "data": [1, 2.5, None, b"\x00"],
        "seq": 7,
    }

    async def both() -> list[Any]:
        return await asyncio.gather(
            caller.acall_tool("agent-b", "echo", data="x"), caller.acall_tool("agent-b", "ping")
        )

    assert asyncio.run(both()) == [{"data": "x", "seq": 0}, "pong"]


def test_remote_exception_carries_type_message_and_traceback(caller: DSecClient) -> None:
    with pytest.raises(RemoteError) as info:
        caller.call_tool("agent-b", "fail", message="quota exceeded")
    err = info.value
    assert (err.agent, err.tool, err.error_type, err.remote_message) == (
        "agent-b",
        "fail",
        "ValueError",
        "quota exceeded",
    )
    assert "in fail" in err.traceback_summary
    assert "agent-b.fail failed: ValueError: quota exceeded" in str(err)


def test_unknown_tool_and_bad_arguments_are_named(caller: DSecClient) -> None:
    with pytest.raises(ToolNotFound, match="no tool named 'search'; this agent serves: echo"):
        caller.call_tool("agent-b", "search")
    with pytest.raises(BadArguments, match="unexpected keyword argument 'nope'"):
        caller.call_tool("agent-b", "echo", data=1, nope=2)


def test_unknown_agent_and_other_group_are_not_found(broker: BrokerThread, caller: DSecClient):
    with pytest.raises(AgentNotFound, match="no agent named 'agent-z' serves tools in task group"):
        caller.call_tool("agent-z", "ping")
    stranger = DSecClient("agent-a", "g2", socket_path=broker.socket_path)
    with pytest.raises(AgentNotFound, match="task group 'g2'"):
        stranger.call_tool("agent-b", "ping")
    stranger.close()


def test_per_call_timeout_then_channel_still_works(caller: DSecClient) -> None:
    with pytest.raises(CallTimeout, match=r"call agent-b.hang timed out after 0.2 s"):
        caller.call_tool("agent-b", "hang", timeout=0.2)


def test_timed_out_answer_is_not_mistaken_for_the_next(broker: BrokerThread) -> None:
    gate = threading.Event()

    def slow(n: int) -> int:
        gate.wait(10)
        return n

    server = ThreadServer(broker, "slow", {"slow": slow, "ping": lambda: "pong"})
    client = DSecClient("c", "g1", socket_path=broker.socket_path)
    wait_serving(client, "slow")
    with pytest.raises(CallTimeout):
        client.call_tool("slow", "slow", n=1, timeout=0.05)
    gate.set()
    assert client.call_tool("slow", "slow", n=2) == 2
    client.close()
    server.stop()


def test_payload_limits_raise_payload_too_large(caller: DSecClient) -> None:
    with pytest.raises(PayloadTooLarge, match=r"request to agent-b.echo is \d+ bytes; the limit"):
        caller.call_tool("agent-b", "echo", data=b"x" * (5 << 20))
    assert caller.call_tool("agent-b", "echo", data=b"y" * (3 << 20))["data"] == b"y" * (3 << 20)


def test_killed_server_becomes_peer_gone_not_a_hang(broker: BrokerThread, ring_mode: str) -> None:
    proc = start_agent(broker.socket_path, "g1", "victim")
    client = DSecClient("c", "g1", socket_path=broker.socket_path, timeout=None)
    try:
        wait_serving(client, "victim")
        outcome: list[BaseException] = []

        def call() -> None:
            try:
                client.call_tool("victim", "hang")  # no timeout: only liveness can end it
            except BaseException as exc:
                outcome.append(exc)

        caller_thread = threading.Thread(target=call)
        caller_thread.start()
        os.kill(proc.pid, signal.SIGKILL)
        caller_thread.join(30)
        assert not caller_thread.is_alive(), "the call hung after its peer was killed"
        assert len(outcome) == 1 and isinstance(outcome[0], PeerGone)
        assert str(outcome[0]) == "agent 'victim' is gone: its process exited"
        # Once the broker has seen it go, the name is free and unknown.
        key = AgentKey("g1", "victim")
        wait_until(lambda: broker.broker.local_server(key) is None, what="broker to forget it")
        with pytest.raises(AgentNotFound):
            client.call_tool("victim", "ping")
    finally:
        proc.kill()
        proc.wait()
        client.close()


def test_restarted_server_is_reached_again(broker: BrokerThread) -> None:
    client = DSecClient("c", "g1", socket_path=broker.socket_path, timeout=20)
    first = start_agent(broker.socket_path, "g1", "phoenix")
    second = None
    try:
        wait_serving(client, "phoenix")
        first_pid = client.call_tool("phoenix", "pid")
        first.kill()
        first.wait()
        with pytest.raises(PeerGone):
            client.call_tool("phoenix", "pid")
        second = start_agent(broker.socket_path, "g1", "phoenix")
        wait_serving(client, "phoenix")
        assert client.call_tool("phoenix", "pid") not in (first_pid, None)
    finally:
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.wait()
        client.close()


def test_killed_caller_does_not_disturb_the_server(broker: BrokerThread, agent_b: ThreadServer):
    script = (
        "import sys; from dsec_sdk import DSecClient\n"
        "c = DSecClient('doomed', 'g1', socket_path=sys.argv[1])\n"
        "print(c.call_tool('agent-b', 'ping'), flush=True)\n"
        "c.call_tool('agent-b', 'hang', timeout=None)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(broker.socket_path)], stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"pong"
    finally:
        proc.kill()
        proc.wait()
    agent_b.release.set()  # the server now answers a caller that is gone
    client = DSecClient("survivor", "g1", socket_path=broker.socket_path, timeout=20)
    wait_serving(client, "agent-b")
    assert client.call_tool("agent-b", "echo", data="still here")["data"] == "still here"
    client.close()


def test_stress_random_sizes_no_loss_duplicate_or_reorder(
    broker: BrokerThread, ring_mode: str
) -> None:
    # The server is another process, so both sides really run at once on different cores.
    server = start_agent(broker.socket_path, "g1", "sink")
    rng = random.Random(8)
    # Sizes from empty to 3x the ring (overflow memfd), many crossing the wrap point.
    sizes = [
        rng.choice([0, 1, 15, 16, 17, 200, 4000, RING // 2 - 40, RING // 2, 3 * RING])
        for _ in range(150)
    ]
    errors: list[BaseException] = []

    def sync_caller(name: str) -> None:
        client = DSecClient(name, "g1", socket_path=broker.socket_path, timeout=30)
        local = random.Random(name)
        try:
            for seq, size in enumerate(sizes):
                data = local.randbytes(size)
                answer = client.call_tool("sink", "record", who=name, seq=seq, data=data)
                assert answer == {"who": name, "seq": seq, "data": data}
        except BaseException as exc:
            errors.append(exc)
        finally:
            client.close()

    async def pipelined_caller(name: str) -> None:
        client = DSecClient(name, "g1", socket_path=broker.socket_path, timeout=30)
        payloads = [rng.randbytes(size) for size in sizes]
        calls = [
            client.acall_tool("sink", "record", who=name, seq=seq, data=data)
            for seq, data in enumerate(payloads)
        ]
        answers = await asyncio.gather(*calls)
        assert answers == [{"who": name, "seq": s, "data": d} for s, d in enumerate(payloads)]
        client.close()

    probe = DSecClient("probe", "g1", socket_path=broker.socket_path, timeout=30)
    try:
        wait_serving(probe, "sink")
        threads = [threading.Thread(target=sync_caller, args=(f"t{i}",)) for i in range(3)]
        for thread in threads:
            thread.start()
        asyncio.run(pipelined_caller("pipelined"))
        for thread in threads:
            thread.join(60)
        assert not errors, errors
        expected = list(range(len(sizes)))
        for who in ("t0", "t1", "t2", "pipelined"):
            assert probe.call_tool("sink", "recorded", who=who) == expected, who
    finally:
        server.kill()
        server.wait()
        probe.close()


def test_many_callers_are_served_round_robin(broker: BrokerThread, ring_mode: str) -> None:
    entered, release = threading.Event(), threading.Event()
    order: list[str] = []

    def hold() -> None:
        entered.set()
        release.wait(10)

    def record(who: str) -> None:
        order.append(who)

    tools = {"hold": hold, "record": record, "ping": lambda: "pong"}
    server = ThreadServer(broker, "fair", tools)
    callers = [DSecClient(f"c{i}", "g1", socket_path=broker.socket_path) for i in range(5)]
    holder = DSecClient("holder", "g1", socket_path=broker.socket_path)
    for client in [*callers, holder]:
        wait_serving(client, "fair")
    per_caller = 30

    hold_thread = threading.Thread(target=holder.call_tool, args=("fair", "hold"))

    async def flood() -> None:
        for client in callers:  # open each async channel on this loop first
            await client.acall_tool("fair", "ping")
        hold_thread.start()
        assert await asyncio.to_thread(entered.wait, 10)
        tasks = [
            asyncio.ensure_future(client.acall_tool("fair", "record", who=client.agent))
            for client in callers
            for _ in range(per_caller)
        ]
        await asyncio.sleep(0)  # every task writes its request before its first real wait
        release.set()
        await asyncio.gather(*tasks)

    asyncio.run(flood())
    hold_thread.join(10)
    server.stop()
    for client in [*callers, holder]:
        client.close()
    assert len(order) == 5 * per_caller
    counts = dict.fromkeys((c.agent for c in callers), 0)
    for who in order:
        counts[who] += 1
        assert max(counts.values()) - min(counts.values()) <= 1, f"unfair order: {order}"


def test_async_server_runs_async_tools(broker: BrokerThread) -> None:
    async def scenario() -> None:
        server = DSecClient("async-b", "g1", socket_path=broker.socket_path)

        @server.tool("lookup")
        async def lookup(key: str) -> str:
            await asyncio.sleep(0)
            return key.upper()

        @server.tool()
        def ping() -> str:
            return "pong"

        serving = asyncio.ensure_future(server.aserve())
        client = DSecClient("async-a", "g1", socket_path=broker.socket_path, timeout=20)
        for _ in range(3000):
            try:
                await client.acall_tool("async-b", "ping")
                break
            except AgentNotFound:
                await asyncio.sleep(0.01)
        assert await client.acall_tool("async-b", "lookup", key="abc") == "ABC"
        assert await asyncio.to_thread(client.call_tool, "async-b", "lookup", key="x") == "X"
        server.stop()
        await asyncio.wait_for(serving, 10)
        client.close()

    asyncio.run(scenario())


def test_broker_refuses_bad_hello_and_duplicate_names(broker: BrokerThread, agent_b: Any):
    with pytest.raises(ValueError, match="agent name 'bad name' is invalid"):
        DSecClient("bad name", "g1", socket_path=broker.socket_path)
    duplicate = DSecClient("agent-b", "g1", socket_path=broker.socket_path)
    with pytest.raises(
        BrokerUnavailable,
        match="agent 'agent-b' of task group 'g1' is already served by another live process",
    ):
        duplicate.serve({"ping": lambda: "pong"})


def test_a_bad_peer_name_is_the_callers_value_error_and_costs_nothing(
    caller: DSecClient,
) -> None:
    """Said by the client, not refused by the broker (it was BrokerUnavailable, "broker:
    agent name ... is invalid", and the client dropped its broker connection for it)."""
    link = caller._link
    with pytest.raises(ValueError, match=r"agent name 'bad name!' is invalid: use 1-63 of"):
        caller.call_tool("bad name!", "ping")
    assert caller._link is link  # (the connection is kept)
    assert caller.call_tool("agent-b", "ping") == "pong"


def test_missing_broker_is_a_clear_error(sock_dir: Path) -> None:
    client = DSecClient("a", "g1", socket_path=sock_dir / "nothing.sock")
    with pytest.raises(BrokerUnavailable, match=r"cannot reach the DSec IPC broker at .*nothing"):
        client.call_tool("b", "ping")


def test_identify_hook_pins_identity(sock_dir: Path) -> None:
    thread = BrokerThread(sock_dir / "ipc.sock", identify=lambda pid, uid, gid: AgentKey("g1", "a"))
    try:
        ok = DSecClient("a", "g1", socket_path=sock_dir / "ipc.sock")
        with pytest.raises(AgentNotFound):
            ok.call_tool("b", "ping")
        ok.close()
        impostor = DSecClient("b", "g1", socket_path=sock_dir / "ipc.sock")
        with pytest.raises(BrokerUnavailable, match=r"may not act as g1/b"):
            impostor.call_tool("a", "ping")
    finally:
        thread.stop()


def test_broker_restart_ends_serving_and_callers_reconnect(sock_dir: Path) -> None:
    path = sock_dir / "ipc.sock"
    first = BrokerThread(path)
    server = DSecClient("agent-b", "g1", socket_path=path)
    failure: list[BaseException] = []

    def serve() -> None:
        try:
            server.serve(agent_tools())
        except BaseException as exc:
            failure.append(exc)

    serving = threading.Thread(target=serve)
    serving.start()
    client = DSecClient("agent-a", "g1", socket_path=path, timeout=20)
    wait_serving(client, "agent-b")
    first.stop()
    serving.join(10)
    assert len(failure) == 1 and isinstance(failure[0], BrokerUnavailable)
    assert "closed the connection; serving stopped" in str(failure[0])

    second = BrokerThread(path)
    try:
        replacement = ThreadServer(second, "agent-b")
        with pytest.raises((PeerGone, BrokerUnavailable)):
            client.call_tool("agent-b", "ping")  # the old channel's server is gone
        wait_serving(client, "agent-b")
        assert client.call_tool("agent-b", "echo", data=1) == {"data": 1, "seq": 0}
        replacement.stop()
    finally:
        client.close()
        second.stop()


def test_broker_metrics_count_agents_channels_misses_and_refusals(sock_dir: Path) -> None:
    """What a platform team sees on the node agent's /metrics (local calls never pass by)."""
    thread = BrokerThread(sock_dir / "ipc.sock", identify=lambda pid, uid, gid: AgentKey("g1", "a"))
    before = {
        "callers": metric("dsec_ipc_agents", role="caller"),
        "local": metric("dsec_ipc_channels_opened_total", where="local"),
        "not_found": metric("dsec_ipc_connects_failed_total", code="not_found"),
        "refused": metric("dsec_ipc_refused_total"),
    }
    try:
        ok = DSecClient("a", "g1", socket_path=sock_dir / "ipc.sock")
        with pytest.raises(AgentNotFound):
            ok.call_tool("b", "ping")
        assert metric("dsec_ipc_agents", role="caller") == before["callers"] + 1
        assert metric("dsec_ipc_connects_failed_total", code="not_found") == before["not_found"] + 1
        impostor = DSecClient("b", "g1", socket_path=sock_dir / "ipc.sock")
        with pytest.raises(BrokerUnavailable):
            impostor.call_tool("a", "ping")
        assert metric("dsec_ipc_refused_total") == before["refused"] + 1
        ok.close()
        wait_until(
            lambda: metric("dsec_ipc_agents", role="caller") == before["callers"] or None,
            what="the broker to count the caller gone",
        )
        assert metric("dsec_ipc_channels_opened_total", where="local") == before["local"]
    finally:
        thread.stop()


def test_a_served_call_counts_one_local_channel(
    broker: BrokerThread, agent_b: ThreadServer
) -> None:
    before = metric("dsec_ipc_channels_opened_total", where="local")
    servers = metric("dsec_ipc_agents", role="server")
    assert servers >= 1
    client = DSecClient("counted", "g1", socket_path=broker.socket_path, timeout=20)
    try:
        wait_serving(client, "agent-b")
        for _ in range(3):
            client.call_tool("agent-b", "ping")
        assert metric("dsec_ipc_channels_opened_total", where="local") == before + 1
    finally:
        client.close()


def test_a_channel_opens_and_works_when_no_fd_is_left_for_its_move_bell(
    broker: BrokerThread, agent_b: ThreadServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wake-up a hand-over's final notice rings needs one more fd (a duplicate of the
    channel's eventfd): at the fd limit the channel still opens, is kept and works (it learns
    of a move at its next wake-up instead), nothing leaks and no bare OSError reaches the call
    (found by a review, 2026-12-06: the new channel was neither kept nor closed)."""
    from dsec_sdk.ipc import link as lk

    def no_fd_left(*_: Any) -> None:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(lk, "_dup", no_fd_left)  # (the bells' duplicates only)
    client = DSecClient("agent-a", "g1", socket_path=broker.socket_path, timeout=20)
    wait_serving(client, "agent-b")
    assert client.call_tool("agent-b", "ping") == "pong"
    channel = client._channels["agent-b"]
    assert client.call_tool("agent-b", "ping") == "pong"
    assert client._channels["agent-b"] is channel  # kept: one channel for both calls
    assert client._link is not None and client._link._bells == {}  # (no bell: no fd)
    client.close()
    assert channel.end.is_closed  # (and so closed with the client, not left open)


def test_a_caller_that_leaves_mid_connect_costs_the_agent_it_called_nothing(
    broker: BrokerThread, agent_b: ThreadServer
) -> None:
    """A caller sends connect and closes at once: the broker read both in one turn, so the
    connect ran after the caller was dropped, its pidfd already closed, and the
    open notice to the agent it called failed with EBADF; the broker blamed the callee and
    dropped it. Any agent could knock a neighbour off the node that way (found in CI,
    2026-12-06). The callee stays registered and serving."""
    key = AgentKey("g1", "agent-b")
    server = broker.broker.local_server(key)
    baseline = metric("dsec_ipc_connections")
    for n in range(20):
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        raw.connect(os.fspath(broker.socket_path))
        raw.settimeout(10)
        control.send(raw, {"op": "hello", "group": "g1", "agent": f"gone-{n}", "role": "caller"})
        welcome, _ = control.recv(raw) or ({}, [])
        assert welcome.get("op") == "welcome", welcome
        control.send(raw, {"op": "connect", "ref": 1, "peer": "agent-b"})
        raw.close()
    wait_until(
        lambda: metric("dsec_ipc_connections") <= baseline and not broker.broker._connecting,
        what="the leaving callers to be dropped and their connects to end",
    )
    assert broker.broker.local_server(key) is server
    client = DSecClient("agent-a", "g1", socket_path=broker.socket_path, timeout=20)
    try:
        assert client.call_tool("agent-b", "ping") == "pong"
    finally:
        client.close()


def test_an_interrupted_first_call_leaves_the_client_usable_for_every_peer(
    broker: BrokerThread, agent_b: ThreadServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C between a connect and its answer (here: the first call's, sent behind the
    hello) leaves an answer queued: the client drops that connection, and its next calls,
    to this peer or another, open a fresh one (found by a review, 2026-12-06: every later
    call to another peer failed with ProtocolError)."""
    from dsec_sdk.ipc import link as lk

    other = ThreadServer(broker, "agent-c")
    real = lk.BrokerLink.connect
    calls = {"n": 0}

    def interrupted_once(self: Any, peer: str) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise KeyboardInterrupt
        return real(self, peer)

    monkeypatch.setattr(lk.BrokerLink, "connect", interrupted_once)
    client = DSecClient("agent-a", "g1", socket_path=broker.socket_path, timeout=20)
    try:
        with pytest.raises(KeyboardInterrupt):
            client.call_tool("agent-b", "ping")
        assert client._link is None  # dropped: its queued answer is nobody's
        assert client.call_tool("agent-c", "ping") == "pong"
        assert client.call_tool("agent-b", "ping") == "pong"
    finally:
        client.close()
        other.stop()
