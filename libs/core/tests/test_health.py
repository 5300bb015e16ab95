"""``/healthz`` says a process cannot serve: its event loop stalled, its descriptors ran out."""

from __future__ import annotations

import asyncio
import os
import resource
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
