"""``/healthz`` says a process cannot serve: its event loop stalled, its descriptors ran out."""

from __future__ import annotations

import asyncio
import os
import resource
import socket
import time

import aiohttp
import pytest
from dsec_core.metrics import LoopWatch, MetricsServer, fd_budget_problem

pytestmark = pytest.mark.unit


async def _healthz(port: int) -> tuple[int, dict[str, object]]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/healthz") as response,
    ):
        return response.status, await response.json()


async def test_a_stalled_event_loop_is_reported_unhealthy_then_recovers() -> None:
    watch = LoopWatch(interval_s=0.05, max_lag_s=0.5)
    watch.start()
    server = MetricsServer("probe", "0", lambda: True, lambda: [p for p in [watch.problem()] if p])
    port = await server.start(0)
    try:
        assert (await _healthz(port))[0] == 200
        time.sleep(0.8)  # a handler blocking the loop
        status, body = await _healthz(port)
        assert status == 503 and "event loop stalled" in str(body["problems"])
        deadline = time.monotonic() + 5
        while (await _healthz(port))[0] != 200:
            assert time.monotonic() < deadline, "never healthy again"
            await asyncio.sleep(0.05)
    finally:
        watch.stop()
        await server.stop()


async def test_running_out_of_file_descriptors_is_reported_unhealthy() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    in_use = len(os.listdir("/proc/self/fd"))
    server = MetricsServer(
        "probe", "0", lambda: True, lambda: [p for p in [fd_budget_problem()] if p]
    )
    port = await server.start(0)
    held: list[int] = []
    try:
        assert (await _healthz(port))[0] == 200
        resource.setrlimit(resource.RLIMIT_NOFILE, (in_use + 40, hard))
        while fd_budget_problem() is None:
            held.append(os.open("/dev/null", os.O_RDONLY))
        status, body = await _healthz(port)
        assert status == 503 and "file descriptors" in str(body["problems"])
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        await server.stop()


async def _raw(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 5)  # the server closes after answering
    finally:
        writer.close()


async def test_the_endpoint_answers_scrapers_and_refuses_the_rest_with_a_status() -> None:
    server = MetricsServer("probe", "1.2", lambda: True)
    port = await server.start(0)
    try:
        async with aiohttp.ClientSession() as session:  # one kept-alive connection, 3 requests
            for _ in range(2):
                async with session.get(f"http://127.0.0.1:{port}/metrics?x=1") as response:
                    assert response.status == 200
                    assert response.headers["Content-Type"].startswith("text/plain; version=")
                    assert "dsec_events_consumed_total" in await response.text()
            async with session.get(f"http://127.0.0.1:{port}/healthz") as response:
                assert await response.json() == {
                    "status": "ok",
                    "service": "probe",
                    "version": "1.2",
                }
            async with session.head(f"http://127.0.0.1:{port}/healthz") as response:
                assert response.status == 200 and await response.read() == b""
            async with session.get(f"http://127.0.0.1:{port}/other") as response:
                assert response.status == 404 and "/metrics" in await response.text()
            async with session.post(f"http://127.0.0.1:{port}/metrics", data=b"x") as response:
                assert response.status in (400, 405)
        assert (
            await _raw(port, b"DELETE /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
        ).startswith(b"HTTP/1.1 405 ")
        assert (await _raw(port, b"nonsense\r\n\r\n")).startswith(b"HTTP/1.1 400 ")
        huge = b"GET /metrics HTTP/1.1\r\n" + b"X-Pad: " + b"a" * 20000 + b"\r\n\r\n"
        assert (await _raw(port, huge)).startswith(b"HTTP/1.1 431 ")
        # a kept-alive connection left open does not hold the stop up
        _, idle = await asyncio.open_connection("127.0.0.1", port)
    finally:
        await asyncio.wait_for(server.stop(), 5)
    idle.close()


async def test_clients_that_never_read_their_answers_cannot_keep_the_endpoint_from_probes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Pipelined requests whose answers are never read fill the socket buffers: the server's
    # write then waits, and a connection it never gives up counts against the limit forever.
    from dsec_core import metrics

    monkeypatch.setattr(metrics, "_WRITE_TIMEOUT_S", 0.5, raising=False)
    monkeypatch.setattr(metrics, "_MAX_CONNECTIONS", 4)  # as with 64, in less time
    server = MetricsServer("probe", "1.2", lambda: True)
    port = await server.start(0)
    hogs: list[socket.socket] = []
    try:
        pipelined = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n" * 4000
        for _ in range(metrics._MAX_CONNECTIONS):
            hog = socket.socket()
            hog.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            hog.setblocking(False)
            await asyncio.get_running_loop().sock_connect(hog, ("127.0.0.1", port))
            await asyncio.get_running_loop().sock_sendall(hog, pipelined)
            hogs.append(hog)
        deadline = asyncio.get_running_loop().time() + 60
        while True:  # a probe gets its answer once the stuck connections were given up
            try:
                answer = await _raw(port, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
            except (OSError, TimeoutError):
                answer = b""
            if answer.startswith(b"HTTP/1.1 200 "):
                break
            assert asyncio.get_running_loop().time() < deadline, "probes are refused for good"
            await asyncio.sleep(0.2)
    finally:
        for hog in hogs:
            hog.close()
        await asyncio.wait_for(server.stop(), 5)


async def test_connections_that_say_nothing_give_way_to_a_probe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Connections that open and send nothing (or trickle a head) would hold every slot for
    # as long as their timeouts allow; at the cap the one that waited longest is closed.
    from dsec_core import metrics

    monkeypatch.setattr(metrics, "_MAX_CONNECTIONS", 4)
    server = MetricsServer("probe", "1.2", lambda: True)
    port = await server.start(0)
    silent = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
    try:
        for _ in range(3):  # each probe is answered at once, the oldest silent one closed
            answer = await _raw(port, b"GET /healthz HTTP/1.1\r\nConnection: close\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 200 ")
            silent.append(await asyncio.open_connection("127.0.0.1", port))  # full again
        for reader, _ in silent[:3]:  # the three that waited longest
            assert await asyncio.wait_for(reader.read(), 5) == b""
    finally:
        for _, writer in silent:
            writer.close()
        await asyncio.wait_for(server.stop(), 5)
