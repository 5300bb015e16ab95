"""Helpers for the IPC tests: a broker on its own event-loop thread (so tests may call the
blocking SDK), agents as real processes (so they can be SIGKILLed), and an agent entry point.

Run as a script, this file is an agent: ``python _ipc_testkit.py SOCKET GROUP NAME``.
"""

from __future__ import annotations

import asyncio
import contextlib
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from dsec_sdk import AgentNotFound, DSecClient
from dsec_sdk.ipc import control

from dsec_nodeagent.ipc import Broker

T = TypeVar("T")
HERE = Path(__file__).resolve()


class BrokerThread:
    """A :class:`Broker` serving from a private event loop in a daemon thread."""

    def __init__(self, socket_path: Path, **kwargs: Any) -> None:
        self.broker = Broker(socket_path, **kwargs)
        self.socket_path = socket_path
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.run(self.broker.start())

    def run(self, coro: Any) -> Any:
        """Run a coroutine on the broker's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def stop(self) -> None:
        self.run(self.broker.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def start_agent(socket_path: Path, group: str, name: str) -> subprocess.Popen[bytes]:
    """An agent process serving the tools of :func:`agent_tools`."""
    return subprocess.Popen([sys.executable, str(HERE), str(socket_path), group, name])


def wait_until(predicate: Callable[[], T | None], timeout: float = 30.0, what: str = "") -> T:
    """Poll ``predicate`` until it returns something truthy (a deadline, never a bare sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        time.sleep(0.01)


def wait_serving(client: DSecClient, agent: str, timeout: float = 30.0) -> None:
    """Wait until ``agent`` answers (it registers with the broker a moment after it starts)."""

    def answered() -> bool:
        try:
            return bool(client.call_tool(agent, "ping") == "pong")
        except AgentNotFound:
            return False

    wait_until(answered, timeout, f"agent {agent!r} to serve")


def agent_tools(release: threading.Event | None = None) -> dict[str, Callable[..., Any]]:
    """The tools every test agent serves; ``hang`` waits for ``release`` (or forever)."""
    gate = release or threading.Event()

    def ping() -> str:
        return "pong"

    def echo(data: Any, seq: int = 0) -> Any:
        return {"data": data, "seq": seq}

    def hang() -> None:
        gate.wait()

    def fail(message: str) -> None:
        raise ValueError(message)

    def pid() -> int:
        return os.getpid()

    seen: dict[str, list[int]] = {}
    seen_lock = threading.Lock()

    def record(who: str, seq: int, data: bytes) -> dict[str, Any]:
        with seen_lock:
            seen.setdefault(who, []).append(seq)
        return {"who": who, "seq": seq, "data": data}

    def recorded(who: str) -> list[int]:
        return seen.get(who, [])

    return {
        "ping": ping,
        "echo": echo,
        "hang": hang,
        "fail": fail,
        "pid": pid,
        "record": record,
        "recorded": recorded,
    }


if __name__ == "__main__":
    socket_arg, group_arg, name_arg = sys.argv[1:4]
    DSecClient(name_arg, group_arg, socket_path=socket_arg).serve(agent_tools())


def metric(name: str, **labels: str) -> float:
    """The current value of one sample in this process's Prometheus registry (0 if absent)."""
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value(name, labels) or 0.0


def lingering_tcp_socket(linger_s: int) -> tuple[socket.socket, socket.socket]:
    """A TCP socket with unsent data to a peer that never reads, SO_LINGER on: its last close
    blocks for ``linger_s`` (on whichever thread closes it)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)  # never accepted: the handshake completes, nobody reads
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock.connect(listener.getsockname())
    sock.setblocking(False)
    while True:
        try:
            sock.send(b"x" * 65536)
        except BlockingIOError:
            break
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, linger_s))
    return sock, listener


def fill_control_socket(filler: socket.socket, peer: str) -> dict[str, Any]:
    """Connect ``filler`` (a raw caller, welcomed) to ``peer`` (a raw server that never reads)
    until the broker answers otherwise than with a channel: the server's control socket is
    full. Each channel is marked closed at once, so only the socket fills. The last answer."""
    reply: dict[str, Any] = {}
    for n in range(5000):
        control.send(filler, {"op": "connect", "ref": n, "peer": peer})
        reply, fds = control.recv(filler) or ({}, [])
        if fds:
            with mmap.mmap(fds[0], mmap.PAGESIZE) as header:
                struct.pack_into("<Q", header, 32 * 8, 1)
        control.close_fds(fds)
        if reply.get("op") != "channel":
            break
    return reply


def drain_soon(server: socket.socket, after_s: float) -> None:
    """In a thread, ``after_s`` from now: read (and close) every notice queued on the raw
    server's control socket, as a server does between calls."""

    def drain() -> None:
        time.sleep(after_s)
        server.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:
                control.close_fds((control.recv(server) or ({}, []))[1])

    threading.Thread(target=drain, daemon=True).start()
