"""What one sandbox may take from the IPC broker, and who owns a name: pure rules, then the
broker with real processes. (Real sandboxes beside a victim: test_ipc_sandbox.py.)"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dsec_sdk import AgentNotFound, BrokerUnavailable, DSecClient
from dsec_sdk.ipc import control

from dsec_nodeagent.ipc import AgentKey
from dsec_nodeagent.ipc.limits import REASONS, Admission, BrokerLimits, RefusalLog
from dsec_nodeagent.ipc.registry import Registry, tenant_token

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the test kit
from _ipc_testkit import (
    BrokerThread,
    agent_tools,
    drain_soon,
    fill_control_socket,
    lingering_tcp_socket,
    metric,
    start_agent,
    wait_serving,
    wait_until,
)

# --------------------------------------------------------------------------- pure


@pytest.mark.unit
def test_a_sandbox_is_held_to_its_connections_and_waiting_connections() -> None:
    limits = BrokerLimits(connections_per_sandbox=3, pending_per_sandbox=2, pending_total=10)
    admission: Admission[object] = Admission(limits, max_connections=100)
    conns = [object() for _ in range(3)]
    for conn in conns[:2]:
        assert admission.admit("a") == (None, None)
        admission.add(conn, "a")
    assert admission.admit("a") == ("pending_sandbox", None)
    assert admission.admit("b") == (None, None)  # another sandbox is not affected
    admission.greeted(conns[0])
    assert admission.admit("a") == (None, None)
    admission.add(conns[2], "a")
    assert admission.admit("a") == ("sandbox_connections", None)
    admission.remove(conns[1])
    assert admission.admit("a") == (None, None)
    assert (admission.connections, admission.pending) == (2, 1)


@pytest.mark.unit
def test_a_full_waiting_pool_evicts_the_greediest_sandbox_not_the_newcomer() -> None:
    limits = BrokerLimits(pending_per_sandbox=4, pending_total=4)
    admission: Admission[str] = Admission(limits, max_connections=100)
    for i in range(4):
        admission.add(f"flood-{i}", "flooder")
    assert admission.admit("victim") == (None, "flood-0")  # the oldest of the greediest
    admission.remove("flood-0")
    admission.add("victim-0", "victim")
    # Evicting would not be fairer for a sandbox already holding as many as the greediest less 1.
    admission.add("flood-4", "other")
    admission.remove("flood-1")
    admission.add("victim-1", "victim")
    assert admission.admit("victim")[0] == "pending_total"


@pytest.mark.unit
def test_the_fd_budget_stays_within_half_of_rlimit_nofile() -> None:
    assert BrokerLimits(fd_budget=4096).max_connections(nofile=20_000) == 4096 // 3
    assert BrokerLimits(fd_budget=4096).max_connections(nofile=1024) == 512 // 3
    admission: Admission[str] = Admission(BrokerLimits(), max_connections=1)
    admission.add("one", "a")
    assert admission.admit("b") == ("fd_budget", None)


@pytest.mark.unit
def test_limits_refuse_nonsense_with_the_setting_named() -> None:
    with pytest.raises(ValueError, match="pending_total=0 is invalid"):
        BrokerLimits(pending_total=0)
    with pytest.raises(ValueError, match="hello_timeout_s=0 is invalid"):
        BrokerLimits(hello_timeout_s=0)


@pytest.mark.unit
def test_refusals_are_logged_once_per_interval_with_counts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = RefusalLog(logging.getLogger("test.refusals"), interval_s=10)
    with caplog.at_level(logging.WARNING, "test.refusals"):
        assert log.refused("pending_sandbox", "sbx-a", now=100.0)
        for i in range(1000):
            assert not log.refused("pending_sandbox", "sbx-a", now=100.0 + i / 1000)
        assert log.refused("hello_timeout", "sbx-b", now=111.0)
    assert len(caplog.records) == 2
    assert "hello_timeout=1, pending_sandbox=1000" in caplog.records[1].getMessage()
    assert "sbx-a=1000" in caplog.records[1].getMessage()
    assert set(REASONS) >= {"pending_sandbox", "hello_timeout", "name_taken", "channels"}


@pytest.mark.unit
def test_two_tenants_with_one_group_and_name_never_meet() -> None:
    registry: Registry[str] = Registry()
    acme, evil = AgentKey("team", "researcher", "acme"), AgentKey("team", "researcher", "evil")
    assert registry.claim(evil, "evil-conn", "sbx-evil").reason is None
    assert registry.claim(acme, "acme-conn", "sbx-acme").reason is None  # not refused
    assert registry.lookup(acme) == "acme-conn"
    assert registry.lookup(evil) == "evil-conn"
    assert acme.subject("lookup") == "dsec_ipc.acme.team.researcher.lookup"
    assert evil.subject("lookup") != acme.subject("lookup")
    # A tenant that is no plain token cannot collide with one that is.
    assert tenant_token("a.b") == "%" + b"a.b".hex()
    assert tenant_token("a.b") != tenant_token("2e")


@pytest.mark.unit
def test_a_name_belongs_to_one_live_server_until_it_leaves_or_is_taken_over() -> None:
    registry: Registry[str] = Registry()
    key = AgentKey("team", "researcher", "acme")
    assert registry.claim(key, "first", "sbx-1").reason is None
    refused = registry.claim(key, "second", "sbx-2")
    assert refused.reason is not None
    assert "already served by another live process of sandbox sbx-1" in refused.reason
    assert "takeover=True" in refused.reason
    taken = registry.claim(key, "third", "sbx-3", takeover=True)
    assert (taken.reason, taken.displaced) == (None, "first")
    assert registry.release("third") == [key]
    assert registry.claim(key, "second", "sbx-2").reason is None  # freed


# --------------------------------------------------------------------------- broker


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dsec-ipc-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _raw(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(os.fspath(path))  # blocking: waits while the listen backlog is full
    sock.settimeout(10)
    return sock


VICTIM = r"""
import sys
from dsec_sdk import DSecClient
client = DSecClient("victim-a", "g1", socket_path=sys.argv[1], timeout=10)
print(client.call_tool("victim-b", "echo", data="through"))
"""


@pytest.mark.integration
def test_a_flood_of_silent_connections_is_bounded_and_a_victim_still_calls(
    sock_dir: Path,
) -> None:
    """This process floods (300 connections, no hello); other processes count as another
    sandbox and still connect and call; the broker's own fds stay bounded."""
    me = os.getpid()
    limits = BrokerLimits(pending_per_sandbox=4, hello_timeout_s=0.5)
    thread = BrokerThread(
        sock_dir / "ipc.sock",
        limits=limits,
        sandbox_of=lambda pid, uid: "flooder" if pid == me else "victim",
    )
    before = metric("dsec_ipc_refusals_total", reason="pending_sandbox")
    timeouts = metric("dsec_ipc_refusals_total", reason="hello_timeout")
    server = start_agent(thread.socket_path, "g1", "victim-b")
    flood: list[socket.socket] = []
    try:
        fds_before = len(os.listdir("/proc/self/fd"))
        for _ in range(300):
            flood.append(_raw(thread.socket_path))
        # Our own 300 client sockets are counted here; the broker adds at most 4 waiting ones
        # (+ a pidfd each) and the victims' connections.
        wait_until(
            lambda: metric("dsec_ipc_refusals_total", reason="pending_sandbox") - before >= 296,
            what="the flood to be turned away",
        )
        key = AgentKey("g1", "victim-b")
        wait_until(lambda: thread.broker.local_server(key), what="the victim's server")
        victim = subprocess.run(
            [sys.executable, "-c", VICTIM, str(thread.socket_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert victim.returncode == 0, victim.stderr[-2000:]
        assert victim.stdout.strip() == "{'data': 'through', 'seq': 0}"
        broker_fds = len(os.listdir("/proc/self/fd")) - fds_before - len(flood)
        assert broker_fds <= 2 * 4 + 3 * 4, broker_fds
        # A turned-away connection is told why.
        message, _ = control.recv(flood[-1]) or ({}, [])
        assert "this sandbox has its maximum of 4 connections that have not said hello" in (
            message.get("message", "")
        )
        # The 4 admitted ones are closed after the hello timeout.
        wait_until(
            lambda: metric("dsec_ipc_refusals_total", reason="hello_timeout") - timeouts >= 4,
            what="the silent connections to time out",
        )
    finally:
        for sock in flood:
            sock.close()
        server.kill()
        server.wait()
        thread.stop()


@pytest.mark.integration
def test_an_agent_is_held_to_its_live_channels_and_a_closed_one_frees_its_place(
    sock_dir: Path,
) -> None:
    thread = BrokerThread(sock_dir / "ipc.sock", limits=BrokerLimits(channels_per_agent=2))
    stop = threading.Event()
    server = DSecClient("b", "g1", socket_path=thread.socket_path)
    serving = threading.Thread(target=server.serve, args=(agent_tools(stop),), daemon=True)
    serving.start()
    callers = [DSecClient("a", "g1", socket_path=thread.socket_path) for _ in range(3)]
    try:
        wait_serving(callers[0], "b")
        assert callers[1].call_tool("b", "ping") == "pong"
        with pytest.raises(BrokerUnavailable, match="this agent holds 2 live channels"):
            callers[2].call_tool("b", "ping")
        callers[0].close()  # marks its channel closed: its place frees
        assert callers[2].call_tool("b", "ping") == "pong"
    finally:
        for client in callers:
            client.close()
        stop.set()
        server.stop()
        serving.join(10)
        thread.stop()


class _SlowRemote:
    """The other nodes, reached over a NATS that does not answer until ``answer`` is set: each
    connect to an agent there waits in ``locate``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, found: bool = False) -> None:
        self.answer = asyncio.Event()
        self.waiting = 0
        self.found = found
        self.proxies: list[str] = []
        self._loop = loop

    async def locate(self, key: AgentKey) -> bool:
        self.waiting += 1
        try:
            await self.answer.wait()
        finally:
            self.waiting -= 1
        return self.found  # registered on another node, or nowhere

    def proxy_channels(self) -> int:
        return len(self.proxies)

    def open_proxy(self, key: AgentKey, caller: Any) -> tuple[int, list[int]]:
        self.proxies.append(caller.name)  # (only a test that finds nobody left gets here)
        raise AssertionError(f"a proxy channel opened for {caller.name}, pidfd {caller.pidfd}")

    async def export(self, key: AgentKey) -> None:
        pass

    async def unexport(self, key: AgentKey) -> None:
        pass

    def forget(self, conn: object) -> None:
        pass

    async def stop(self) -> None:
        pass


@pytest.mark.integration
def test_connects_under_way_are_bounded_per_sandbox(sock_dir: Path) -> None:
    """A caller asks for 100 channels to agents of other nodes at once while NATS is slow: 4
    wait (DSEC_IPC_CONNECTS_PER_SANDBOX here), the other 96 are answered `busy` at once instead
    of each holding a task and a lookup in the node agent; once answered, connects go on."""
    thread = BrokerThread(sock_dir / "ipc.sock", limits=BrokerLimits(connects_per_sandbox=4))
    remote = _SlowRemote(thread.loop)
    thread.broker._remote = remote
    before = metric("dsec_ipc_refusals_total", reason="connects")
    caller = _raw(thread.socket_path)
    try:
        control.send(caller, {"op": "hello", "group": "g1", "agent": "a", "role": "caller"})
        welcome, _ = control.recv(caller) or ({}, [])
        assert welcome.get("op") == "welcome", welcome
        for n in range(100):
            control.send(caller, {"op": "connect", "ref": n, "peer": f"far-{n}"})
        busy = [control.recv(caller) for _ in range(96)]
        assert all(m is not None and m[0].get("code") == "busy" for m in busy), busy[:2]
        assert "4 connects under way" in busy[0][0]["message"]  # type: ignore[index]
        assert remote.waiting == 4
        assert metric("dsec_ipc_refusals_total", reason="connects") - before == 96
        thread.loop.call_soon_threadsafe(remote.answer.set)
        ended = [control.recv(caller) for _ in range(4)]
        assert all(m is not None and m[0].get("code") == "not_found" for m in ended), ended
        control.send(caller, {"op": "connect", "ref": 100, "peer": "far-100"})
        again, _ = control.recv(caller) or ({}, [])
        assert again.get("code") == "not_found"  # its place is free again
    finally:
        caller.close()
        thread.broker._remote = None
        thread.stop()


@pytest.mark.integration
def test_a_caller_that_leaves_while_another_node_is_asked_gets_no_channel(sock_dir: Path) -> None:
    """A caller asks for an agent of another node and closes while NATS is asked: when the
    answer comes, the broker opens no proxy channel for it (it duplicated the caller's pidfd,
    already closed, and the connect crashed holding a fresh channel's fds)."""
    thread = BrokerThread(sock_dir / "ipc.sock")
    remote = _SlowRemote(thread.loop, found=True)
    thread.broker._remote = remote
    baseline = metric("dsec_ipc_connections")
    try:
        caller = _raw(thread.socket_path)
        control.send(caller, {"op": "hello", "group": "g1", "agent": "a", "role": "caller"})
        welcome, _ = control.recv(caller) or ({}, [])
        assert welcome.get("op") == "welcome", welcome
        control.send(caller, {"op": "connect", "ref": 1, "peer": "far"})
        wait_until(lambda: remote.waiting == 1, what="the connect to ask the other nodes")
        caller.close()
        wait_until(lambda: metric("dsec_ipc_connections") == baseline, what="the drop")
        thread.loop.call_soon_threadsafe(remote.answer.set)
        wait_until(lambda: not thread.broker._connecting, what="the connect to end")
        assert remote.proxies == []
    finally:
        thread.broker._remote = None
        thread.stop()


@pytest.mark.integration
def test_a_takeover_must_be_explicit_and_ends_the_old_servers_serve(sock_dir: Path) -> None:
    thread = BrokerThread(sock_dir / "ipc.sock")
    first = DSecClient("b", "g1", socket_path=thread.socket_path)
    ended: list[BaseException] = []

    def serve_first() -> None:
        try:
            first.serve({"who": lambda: "first"})
        except BaseException as exc:
            ended.append(exc)

    serving = threading.Thread(target=serve_first, daemon=True)
    serving.start()
    caller = DSecClient("a", "g1", socket_path=thread.socket_path, timeout=10)
    second = DSecClient("b", "g1", socket_path=thread.socket_path, takeover=True)
    try:
        wait_until(lambda: thread.broker.local_server(AgentKey("g1", "b")), what="first")
        assert caller.call_tool("b", "who") == "first"
        with pytest.raises(BrokerUnavailable, match="is already served by another live process"):
            DSecClient("b", "g1", socket_path=thread.socket_path).serve({"who": lambda: "x"})
        taking = threading.Thread(target=second.serve, args=({"who": lambda: "second"},))
        taking.start()
        serving.join(10)
        assert not serving.is_alive() and ended  # the old server was told and stopped
        fresh = DSecClient("a", "g1", socket_path=thread.socket_path, timeout=10)
        wait_until(lambda: fresh.call_tool("b", "who") == "second", what="the new server")
        fresh.close()
        second.stop()
        taking.join(10)
    finally:
        caller.close()
        thread.stop()


@pytest.mark.integration
def test_a_client_turned_away_at_accept_is_told_why(sock_dir: Path) -> None:
    thread = BrokerThread(sock_dir / "ipc.sock", limits=BrokerLimits(connections_per_sandbox=1))
    first = DSecClient("a", "g1", socket_path=thread.socket_path)
    second = DSecClient("b", "g1", socket_path=thread.socket_path)
    before = metric("dsec_ipc_refusals_total", reason="sandbox_connections")
    try:
        with pytest.raises(AgentNotFound):
            first.call_tool("nobody", "ping")  # holds this process's one connection
        for _ in range(20):  # whichever moment the broker closes, the reason arrives
            with pytest.raises(
                BrokerUnavailable, match="this sandbox holds its maximum of 1 broker connections"
            ):
                second.call_tool("nobody", "ping")
        assert metric("dsec_ipc_refusals_total", reason="sandbox_connections") == before + 20
    finally:
        first.close()
        second.close()
        thread.stop()


@pytest.mark.unit
def test_a_sandbox_identity_carries_the_plan_tenant() -> None:
    from dsec_core.spec import compile_plan, load_spec

    from dsec_nodeagent.agent import agent_identity

    loaded = load_spec(
        'version: "1.2"\nname: researcher\ntask_group: research-team\n'
        "base: dsec/python311:latest\nentrypoint: [python, agent.py]\n",
        "dsec.yaml",
    )
    assert loaded.spec is not None, loaded
    identity = agent_identity(compile_plan(loaded.spec, tenant="acme"))
    assert (identity.tenant, identity.task_group, identity.name) == (
        "acme",
        "research-team",
        "researcher",
    )
    assert agent_identity(compile_plan(loaded.spec)).tenant == "default"


def test_a_connection_that_keeps_sending_is_read_in_turns_and_odd_shapes_end_only_it(
    sock_dir: Path,
) -> None:
    """A sandbox's connection is read at most READS_PER_TURN messages at a time, then the node
    agent's loop serves everyone else (a sender that never stops held it for up to 0.25 s);
    every message is still answered. A hello whose fields have odd types ends that connection,
    with no error escaping to the loop, and the broker serves the next client."""
    import time

    from dsec_nodeagent.ipc.broker import READS_PER_TURN

    thread = BrokerThread(sock_dir / "ipc.sock")
    broker = thread.broker
    per_turn: list[int] = []
    dispatched = [0]
    errors: list[dict[str, object]] = []
    thread.loop.call_soon_threadsafe(
        thread.loop.set_exception_handler, lambda _loop, context: errors.append(context)
    )
    real_readable, real_dispatch = broker._on_readable, broker._dispatch

    def readable(conn: object) -> None:
        before = dispatched[0]
        real_readable(conn)  # type: ignore[arg-type]
        per_turn.append(dispatched[0] - before)

    def dispatch(conn: object, message: dict[str, object]) -> None:
        dispatched[0] += 1
        real_dispatch(conn, message)  # type: ignore[arg-type]

    broker._on_readable = readable  # type: ignore[method-assign]
    broker._dispatch = dispatch  # type: ignore[method-assign]
    flooder = _raw(thread.socket_path)
    try:
        time.sleep(0.2)  # accepted
        thread.loop.call_soon_threadsafe(time.sleep, 0.5)  # the loop busy while they queue
        for n in range(200):
            control.send(flooder, {"op": "nonsense", "id": n})
        answers = [control.recv(flooder) for _ in range(200)]
        assert all(a is not None and a[0]["op"] == "error" for a in answers)
        assert sum(per_turn) == 200 and max(per_turn) <= READS_PER_TURN < 200
        odd = _raw(thread.socket_path)
        control.send(
            odd, {"op": "hello", "group": "g1", "agent": "a", "role": "caller", "tools": 5}
        )
        assert control.recv(odd) is None  # dropped
        odd.close()
        with pytest.raises(AgentNotFound):  # the broker serves the next client
            DSecClient("b", "g1", socket_path=thread.socket_path).call_tool("nobody", "ping")
        assert errors == []
    finally:
        flooder.close()
        thread.stop()


LINGER_S = 5


@pytest.mark.integration
@pytest.mark.parametrize("kernel", ["refuses fds", "before 6.16"])
def test_an_fd_sent_to_the_broker_cannot_stall_its_loop(
    sock_dir: Path, kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A connection hands the broker a lingering TCP socket and closes its own copy: the
    broker's close of it blocked its loop for as long as the sender chose (every neighbour's
    connect waited). Where the kernel can (SO_PASSRIGHTS, Linux 6.16+), the fds are refused at
    the sender's sendmsg; before it, they are closed on a thread of their own and the
    connection is refused."""
    from dsec_nodeagent.ipc import broker as broker_mod

    if kernel == "before 6.16":
        monkeypatch.setattr(broker_mod, "_SO_PASSRIGHTS", -1)  # setsockopt fails: the fallback
    thread = BrokerThread(sock_dir / "ipc.sock")
    tcp, listener = lingering_tcp_socket(LINGER_S)
    attacker = _raw(thread.socket_path)
    victim = DSecClient("victim", "g1", socket_path=thread.socket_path, timeout=30)
    try:
        with pytest.raises(AgentNotFound):
            victim.call_tool("nobody", "ping")  # connected and greeted
        assert thread.broker._fds_refused is (kernel == "refuses fds")
        hello = {"op": "hello", "group": "g1", "agent": "a", "role": "caller"}
        if kernel == "refuses fds":
            with pytest.raises(PermissionError):
                socket.send_fds(attacker, [control_bytes(hello)], [tcp.fileno()])
            return
        socket.send_fds(attacker, [control_bytes(hello)], [tcp.fileno()])
        tcp.close()  # the broker holds the last reference
        refused, _ = control.recv(attacker) or ({}, [])
        assert refused.get("code") == "refused", refused
        assert "file descriptors" in refused["message"]
        started = time.monotonic()
        with pytest.raises(AgentNotFound):
            victim.call_tool("nobody-2", "ping")  # a fresh connect through the loop
        assert time.monotonic() - started < LINGER_S / 2
    finally:
        victim.close()
        attacker.close()
        tcp.close()
        listener.close()
        # (the lingering close ends once its peer is gone: no closer outlives the test)
        wait_until(lambda: not thread.broker._closing, LINGER_S + 15, "the closes to end")
        thread.stop()


def control_bytes(message: dict[str, Any]) -> bytes:
    """A control message as the wire carries it (MessagePack)."""
    import msgpack

    return bytes(msgpack.packb(message))


@pytest.mark.integration
def test_a_callers_connects_cannot_knock_a_busy_server_off_the_node(sock_dir: Path) -> None:
    """A server reads its control socket between calls. A caller connecting to it again and
    again (closing each channel at once, so it stays under its channel limit) filled that
    socket, and the broker took EAGAIN for a dead server and dropped it. Now the caller is told
    `busy` and the server stays registered."""
    thread = BrokerThread(sock_dir / "ipc.sock")
    server = _raw(thread.socket_path)
    caller = _raw(thread.socket_path)
    before = metric("dsec_ipc_refusals_total", reason="server_busy")
    try:
        control.send(server, {"op": "hello", "group": "g1", "agent": "busy", "role": "server"})
        welcome, fds = control.recv(server) or ({}, [])
        control.close_fds(fds)
        assert welcome.get("op") == "welcome"
        control.send(caller, {"op": "hello", "group": "g1", "agent": "hostile", "role": "caller"})
        assert (control.recv(caller) or ({}, []))[0].get("op") == "welcome"
        reply = fill_control_socket(caller, "busy")
        assert reply.get("code") == "busy", reply
        assert "has not yet read the channels offered to it" in reply["message"]
        assert thread.broker.local_server(AgentKey("g1", "busy")) is not None
        assert metric("dsec_ipc_refusals_total", reason="server_busy") - before == 1
        # once it reads its notices, channels to it open again
        server.setblocking(False)
        while True:
            try:
                _, fds = control.recv(server) or ({}, [])
            except BlockingIOError:
                break
            control.close_fds(fds)
        control.send(caller, {"op": "connect", "ref": "again", "peer": "busy"})
        again, fds = control.recv(caller) or ({}, [])
        control.close_fds(fds)
        assert again.get("op") == "channel", again
    finally:
        caller.close()
        server.close()
        thread.stop()


LINGERER = r"""
import os, socket, sys, time
import msgpack
sys.path.insert(0, sys.argv[3])
from _ipc_testkit import lingering_tcp_socket
tcp, listener = lingering_tcp_socket(int(sys.argv[2]))
broker = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
broker.connect(sys.argv[1])
hello = {"op": "hello", "group": "g1", "agent": "lingerer", "role": "caller"}
socket.send_fds(broker, [msgpack.packb(hello)], [tcp.fileno()])
tcp.close()
print("sent", flush=True)
time.sleep(60)
"""


@pytest.mark.integration
def test_a_sandbox_sending_a_lingering_fd_holds_up_only_its_own_closes(
    sock_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before Linux 6.16 (simulated): the fds an agent sends are closed off the loop, and the
    review of that fallback found one closer thread for the node: a lingering socket one sandbox
    sent held every later close, and the connections the broker dropped for other sandboxes
    stayed open (no EOF; fds piling up). Each sandbox's closes run on its own thread now."""
    from dsec_nodeagent.ipc import broker as broker_mod

    monkeypatch.setattr(broker_mod, "_SO_PASSRIGHTS", -1)
    me = os.getpid()
    thread = BrokerThread(
        sock_dir / "ipc.sock",
        sandbox_of=lambda pid, uid: "victim" if pid == me else "lingerer",
    )
    attacker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            LINGERER,
            os.fspath(thread.socket_path),
            str(LINGER_S),
            str(Path(__file__).parent),
        ],
        stdout=subprocess.PIPE,
    )
    victim = _raw(thread.socket_path)
    before = metric("dsec_ipc_refusals_total", reason="passed_fds")
    try:
        assert attacker.stdout is not None and attacker.stdout.readline() == b"sent\n"
        wait_until(
            lambda: metric("dsec_ipc_refusals_total", reason="passed_fds") > before,
            what="the sender refused (its lingering socket closing)",
        )
        started = time.monotonic()
        control.send(victim, {"op": "hello", "group": "g1", "agent": "v", "role": "nobody"})
        refused, _ = control.recv(victim) or ({}, [])
        assert refused.get("code") == "refused", refused
        assert control.recv(victim) is None  # its connection closed: EOF
        assert time.monotonic() - started < LINGER_S / 2
    finally:
        attacker.kill()
        attacker.wait()
        victim.close()
        wait_until(lambda: not thread.broker._closing, LINGER_S + 15, "the closes to end")
        thread.stop()


@pytest.mark.integration
def test_the_sdk_retries_a_busy_server_and_keeps_its_connection(sock_dir: Path) -> None:
    """`busy` says retry: the SDK does, for up to its timeout (10 s at most), on the same
    broker connection (a refusal used to close it and open another). A server that reads its
    notices meanwhile gets the call; one that does not leaves `BrokerRefused` (code busy)."""
    from dsec_sdk import BrokerRefused, CallTimeout

    thread = BrokerThread(sock_dir / "ipc.sock")
    server = _raw(thread.socket_path)
    filler = _raw(thread.socket_path)
    client = DSecClient("caller", "g1", socket_path=thread.socket_path, timeout=1.0)
    try:
        control.send(server, {"op": "hello", "group": "g1", "agent": "busy", "role": "server"})
        _, fds = control.recv(server) or ({}, [])
        control.close_fds(fds)
        control.send(filler, {"op": "hello", "group": "g1", "agent": "filler", "role": "caller"})
        control.recv(filler)
        reply = fill_control_socket(filler, "busy")
        assert reply.get("code") == "busy", reply
        with pytest.raises(AgentNotFound):
            client.call_tool("nobody", "ping")  # (its broker connection, before)
        link = client._link
        started = time.monotonic()
        with pytest.raises(BrokerRefused) as refused:
            client.call_tool("busy", "ping")
        assert refused.value.code == "busy"
        assert time.monotonic() - started >= 0.9  # retried for its timeout
        assert client._link is link  # the connection kept
        started = time.monotonic()
        with pytest.raises(BrokerRefused):  # the call's own timeout bounds the retries
            client.call_tool("busy", "ping", timeout=0.2)
        assert 0.15 <= time.monotonic() - started < 0.9

        drain_soon(server, 0.3)
        with pytest.raises(CallTimeout):  # the channel opened; the raw server never answers
            client.call_tool("busy", "ping")
    finally:
        client.close()
        filler.close()
        server.close()
        thread.stop()
