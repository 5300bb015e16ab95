"""Calls between nodes: two brokers (two "nodes") bridged by a real nats-server."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from dsec_core import natsperms
from dsec_sdk import (
    AgentBusy,
    AgentNotFound,
    CallTimeout,
    DSecClient,
    PayloadTooLarge,
    PeerGone,
    RemoteError,
    ToolNotFound,
)
from dsec_sdk.ipc import control
from dsec_testing.stack import StackFixture

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the test kit
from _ipc_testkit import (
    BrokerThread,
    drain_soon,
    fill_control_socket,
    metric,
    start_agent,
    wait_serving,
    wait_until,
)

from dsec_nodeagent.ipc import AgentKey

pytestmark = pytest.mark.integration


@pytest.fixture
def nodes(dsec_stack: StackFixture) -> Iterator[tuple[BrokerThread, BrokerThread]]:
    root = Path(tempfile.mkdtemp(prefix="dsec-ipc-"))
    # As node agents connect in the stack: with the nodeagent identity and its permissions.
    url = dsec_stack.nats_plain_url
    auth = {
        "nkeys_seed": str(dsec_stack.nats_seed("nodeagent")),
        "inbox_prefix": natsperms.inbox_prefix("nodeagent"),
    }
    one = BrokerThread(root / "n1.sock", node_id="node-1", nats_url=url, nats_options=auth)
    two = BrokerThread(root / "n2.sock", node_id="node-2", nats_url=url, nats_options=auth)
    yield one, two
    one.stop()
    two.stop()
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def remote_agent(nodes: tuple[BrokerThread, BrokerThread]) -> Iterator[DSecClient]:
    """``agent-b`` serving on node 2; the returned client lives on node 1."""
    one, two = nodes
    proc = start_agent(two.socket_path, "g1", "agent-b")
    client = DSecClient("agent-a", "g1", socket_path=one.socket_path, timeout=20)
    try:
        wait_serving(client, "agent-b")
        yield client
    finally:
        client.close()
        proc.kill()
        proc.wait()


def test_call_reaches_an_agent_on_another_node(remote_agent: DSecClient) -> None:
    assert remote_agent.call_tool("agent-b", "echo", data="across", seq=3) == {
        "data": "across",
        "seq": 3,
    }
    blob = bytes(range(256)) * 1024  # 256 KB: larger than a ring chunk, within NATS' 1 MB
    assert remote_agent.call_tool("agent-b", "echo", data=blob)["data"] == blob


def test_bridged_calls_show_in_both_node_agents_metrics(remote_agent: DSecClient) -> None:
    # Both "nodes" run in this process, so one registry holds both sides' counters.
    out_ok = metric("dsec_ipc_remote_calls_total", direction="out", outcome="result")
    in_ok = metric("dsec_ipc_remote_calls_total", direction="in", outcome="result")
    out_missing = metric("dsec_ipc_remote_calls_total", direction="out", outcome="unknown_tool")
    timed = metric("dsec_ipc_remote_call_seconds_count", direction="out")
    for seq in range(3):
        remote_agent.call_tool("agent-b", "echo", data="x", seq=seq)
    with pytest.raises(ToolNotFound):
        remote_agent.call_tool("agent-b", "no_such_tool")
    assert metric("dsec_ipc_remote_calls_total", direction="out", outcome="result") == out_ok + 3
    assert metric("dsec_ipc_remote_calls_total", direction="in", outcome="result") == in_ok + 3
    assert (
        metric("dsec_ipc_remote_calls_total", direction="out", outcome="unknown_tool")
        == out_missing + 1
    )
    assert metric("dsec_ipc_remote_call_seconds_count", direction="out") == timed + 4


def test_async_calls_across_nodes(remote_agent: DSecClient) -> None:
    import asyncio

    async def many() -> list[dict[str, int]]:
        calls = [remote_agent.acall_tool("agent-b", "echo", data=i, seq=i) for i in range(50)]
        return await asyncio.gather(*calls)

    assert asyncio.run(many()) == [{"data": i, "seq": i} for i in range(50)]


def test_remote_errors_keep_their_type(remote_agent: DSecClient) -> None:
    with pytest.raises(RemoteError, match=r"agent-b\.fail failed: ValueError: no quota") as info:
        remote_agent.call_tool("agent-b", "fail", message="no quota")
    assert "in fail" in info.value.traceback_summary
    with pytest.raises(ToolNotFound, match="no tool named 'nope'"):
        remote_agent.call_tool("agent-b", "nope")
    with pytest.raises(CallTimeout):
        remote_agent.call_tool("agent-b", "hang", timeout=0.3)
    with pytest.raises(PayloadTooLarge, match="NATS between nodes takes at most"):
        remote_agent.call_tool("agent-b", "echo", data=b"x" * (2 << 20))


def test_unknown_name_on_every_node(nodes: tuple[BrokerThread, BrokerThread]) -> None:
    client = DSecClient("agent-a", "g1", socket_path=nodes[0].socket_path)
    with pytest.raises(AgentNotFound, match="not registered on this node or any other"):
        client.call_tool("agent-x", "ping")
    client.close()


def test_remote_agent_killed_is_peer_gone(nodes: tuple[BrokerThread, BrokerThread]) -> None:
    one, two = nodes
    proc = start_agent(two.socket_path, "g1", "agent-k")
    client = DSecClient("agent-a", "g1", socket_path=one.socket_path, timeout=None)
    try:
        wait_serving(client, "agent-k")
        outcome: list[BaseException] = []

        def call() -> None:
            try:
                client.call_tool("agent-k", "hang")  # no timeout: only liveness can end it
            except BaseException as exc:
                outcome.append(exc)

        caller = threading.Thread(target=call)
        caller.start()
        proc.kill()
        caller.join(30)
        assert not caller.is_alive(), "the call hung after the remote agent was killed"
        assert len(outcome) == 1 and isinstance(outcome[0], PeerGone), outcome
        assert str(outcome[0]).startswith("agent 'agent-k' is gone:")
        with pytest.raises((PeerGone, AgentNotFound)):
            client.call_tool("agent-k", "ping")
    finally:
        proc.kill()
        proc.wait()
        client.close()


def test_another_tenants_agent_of_the_same_group_and_name_is_not_found_across_nodes(
    nats_url: str,
) -> None:
    """node-2 serves acme's g1/agent-b; on node-1, evil's g1/agent-a finds no such agent, and
    acme's own agent-a reaches it (the tenant is part of every subject)."""
    root = Path(tempfile.mkdtemp(prefix="dsec-ipc-"))
    me, tenant, served = os.getpid(), ["evil"], {}
    one = BrokerThread(
        root / "n1.sock",
        node_id="node-1",
        nats_url=nats_url,
        identify=lambda pid, uid, gid: AgentKey("g1", "agent-a", tenant[0]) if pid == me else None,
    )
    two = BrokerThread(
        root / "n2.sock",
        node_id="node-2",
        nats_url=nats_url,
        identify=lambda pid, uid, gid: served.get(pid),
    )
    proc = start_agent(two.socket_path, "g1", "agent-b")
    served[proc.pid] = AgentKey("g1", "agent-b", "acme")
    try:
        wait_until(lambda: two.broker.local_server(served[proc.pid]), what="acme's agent-b")
        evil = DSecClient("agent-a", "g1", socket_path=one.socket_path, timeout=20)
        with pytest.raises(AgentNotFound, match="not registered on this node or any other"):
            evil.call_tool("agent-b", "ping")
        evil.close()
        tenant[0] = "acme"
        acme = DSecClient("agent-a", "g1", socket_path=one.socket_path, timeout=20)
        assert acme.call_tool("agent-b", "echo", data="same tenant") == {
            "data": "same tenant",
            "seq": 0,
        }
        acme.close()
    finally:
        proc.kill()
        proc.wait()
        one.stop()
        two.stop()
        shutil.rmtree(root, ignore_errors=True)


def _hello_and_leave(path: Path, name: str) -> None:
    """A server's hello, and the connection closed before the broker answers it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(os.fspath(path))
    control.send(sock, {"op": "hello", "group": "g1", "agent": name, "role": "server"})
    sock.close()


def _settled(thread: BrokerThread) -> bool:
    """No connection left and no background task (exports, unexports) under way."""
    broker = thread.broker
    return not broker._connections and not broker._tasks


def test_a_server_that_leaves_before_its_welcome_is_exported_nowhere(
    nodes: tuple[BrokerThread, BrokerThread],
) -> None:
    """The welcome to a server gone already fails, the drop's unexport finds nothing yet, and
    the export scheduled after it subscribed anyway: the name stayed answered over NATS for
    good (callers anywhere got PeerGone, not AgentNotFound), and once the real server came,
    two subscriptions ran each call from another node twice."""
    one, two = nodes
    for _ in range(10):
        # All of this test's connections are one sandbox's to the broker: it refuses (closes) a
        # ninth still waiting for its hello to be read, so a loaded broker is let catch up first.
        wait_until(
            lambda: one.broker._admission.pending <= one.broker.limits.pending_per_sandbox - 2,
            what="room for two more connections without hello",
        )
        _hello_and_leave(one.socket_path, "ghost")
        _hello_and_leave(one.socket_path, "dup")
    wait_until(lambda: _settled(one), what="the leavers dropped and their exports settled")
    assert one.broker._remote._subs == {}
    client = DSecClient("agent-a", "g1", socket_path=two.socket_path, timeout=20)
    proc = start_agent(one.socket_path, "g1", "dup")
    local = DSecClient("local", "g1", socket_path=one.socket_path, timeout=20)
    try:
        with pytest.raises(AgentNotFound):
            client.call_tool("ghost", "ping")
        wait_serving(client, "dup")
        assert client.call_tool("dup", "record", who="remote", seq=1, data=b"") is not None
        assert local.call_tool("dup", "recorded", who="remote") == [1]  # run once
    finally:
        client.close()
        local.close()
        proc.kill()
        proc.wait()


def _raw_caller(
    path: Path, name: str, role: str = "caller"
) -> tuple[socket.socket, dict[str, Any]]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(os.fspath(path))
    sock.settimeout(20)
    control.send(sock, {"op": "hello", "group": "g1", "agent": name, "role": role})
    welcome, fds = control.recv(sock) or ({}, [])
    control.close_fds(fds)
    assert welcome.get("op") == "welcome", welcome
    return sock, welcome


def test_one_sandbox_holds_at_most_its_share_of_the_channels_to_other_nodes(
    nodes: tuple[BrokerThread, BrokerThread], remote_agent: DSecClient
) -> None:
    """One sandbox kept every channel to agents of other nodes the node may serve (204, under
    its 256 channels per agent): no other sandbox could call another node. Now it holds a
    quarter of them at most, and another sandbox's call goes through."""
    one, _ = nodes
    share = one.broker.proxy_channels_per_sandbox
    assert share == one.broker._proxy_fd_budget // 5 // 4
    hostile, _ = _raw_caller(one.socket_path, "hostile")
    # (this process is one sandbox here: the fixture's client holds a channel of its share)
    already = one.broker._live_proxies(f"pid-{os.getpid()}")
    held: list[list[int]] = []
    try:
        reply: dict[str, Any] = {}
        for n in range(share + 1 - already):
            control.send(hostile, {"op": "connect", "ref": n, "peer": "agent-b"})
            reply, fds = control.recv(hostile) or ({}, [])
            if reply.get("op") != "channel":
                break
            held.append(fds)
        assert len(held) + already == share
        assert reply.get("code") == "too_many_channels", reply
        assert f"holds {share} channels to agents of other nodes" in reply["message"]
        # another sandbox of this node (a process of its own: another pid-... sandbox here)
        victim = subprocess.run(
            [sys.executable, "-c", VICTIM_CALL, os.fspath(one.socket_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert victim.returncode == 0 and victim.stdout.strip() == "pong", victim.stderr[-500:]
    finally:
        for fds in held:
            control.close_fds(fds)
        hostile.close()


VICTIM_CALL = r"""
import sys
from dsec_sdk import DSecClient
client = DSecClient("victim", "g1", socket_path=sys.argv[1], timeout=20)
print(client.call_tool("agent-b", "ping"))
client.close()
"""


def test_calls_in_flight_to_other_nodes_are_bounded_per_sandbox(
    nodes: tuple[BrokerThread, BrokerThread], remote_agent: DSecClient
) -> None:
    """A caller wrote 3,000 requests into one channel to another node and read no answer: 3,000
    forwarding tasks here and as many answering tasks there, each asking NATS every second
    whether the agent still lives. Now a sandbox has 256 in flight at most; the rest are
    answered `busy` at once."""
    from dsec_sdk.ipc import channel as ch
    from dsec_sdk.ipc import codec

    from dsec_nodeagent.ipc.remote import FORWARDS_PER_SANDBOX

    one, _ = nodes
    hostile, welcome = _raw_caller(one.socket_path, "hostile")
    try:
        control.send(hostile, {"op": "connect", "ref": 1, "peer": "agent-b"})
        reply, fds = control.recv(hostile) or ({}, [])
        assert reply.get("op") == "channel" and reply["remote"], reply
        end = ch.CallerEnd(
            channel_id=reply["channel"],
            peer="agent-b",
            capacity=reply["ring_capacity"],
            fds=fds,
            max_payload=welcome["max_payload"],
            spin_ns=0,
        )
        body = codec.encode_request(codec.new_packer(), "hang", {}, 0)  # 0: the longest
        deadline = time.perf_counter_ns() + 10_000_000_000
        wanted = FORWARDS_PER_SANDBOX + 100
        for call_id in range(1, wanted + 1):
            assert end.send(codec.REQUEST, call_id, body, deadline)
        busy = 0
        while busy < wanted - FORWARDS_PER_SANDBOX:
            assert end.wait_response(deadline), f"{busy} busy answers before the deadline"
            frame = end.responses.try_read(bytes)
            assert frame is not None
            kind, _call_id, value = frame
            assert kind == codec.ERROR
            assert codec.unpack(value)[0] == "busy"
            busy += 1
        assert sum(one.broker._remote._forwarding.values()) == FORWARDS_PER_SANDBOX
        assert len(one.broker._remote._tasks) <= FORWARDS_PER_SANDBOX + 8
        end.close()
    finally:
        hostile.close()


def test_a_busy_agent_on_another_node_is_retried_then_said_busy(
    nodes: tuple[BrokerThread, BrokerThread],
) -> None:
    """An agent on another node whose control socket is full (it has not read the channels
    offered to it) cannot take a bridged call: the bridge there answers `busy`, and the tool
    does not run. The SDK raised that at once as a plain RemoteError; now it retries for the
    call's timeout (10 s at most), then raises AgentBusy saying how long, and a call whose
    agent reads its notices meanwhile goes through."""
    one, two = nodes
    server, _ = _raw_caller(two.socket_path, "busy", role="server")
    filler, _ = _raw_caller(two.socket_path, "filler")
    client = DSecClient("agent-a", "g1", socket_path=one.socket_path, timeout=1.0)
    try:
        assert fill_control_socket(filler, "busy").get("code") == "busy"
        for call in (
            lambda: client.call_tool("busy", "ping"),
            lambda: asyncio.run(client.acall_tool("busy", "ping")),
            lambda: client.call_tool("busy", "ping", timeout=Decimal("1")),  # (any real number)
        ):
            started = time.monotonic()
            with pytest.raises(AgentBusy) as busy:
                call()
            assert time.monotonic() - started >= 0.9  # retried for the call's timeout
            assert busy.value.code == "busy" and busy.value.error_type == "ServerBusy"
            text = str(busy.value)
            assert "has not yet read the channels offered to it" in text
            assert "still busy after" in text and "; retry" not in text

        drain_soon(server, 0.3)
        with pytest.raises(CallTimeout):  # it reached the agent, which never answers
            client.call_tool("busy", "ping")
    finally:
        client.close()
        filler.close()
        server.close()
