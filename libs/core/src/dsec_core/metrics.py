"""Prometheus metrics shared by every service, and the /metrics + /healthz HTTP endpoint."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

EVENTS_CONSUMED = Counter(
    "dsec_events_consumed_total", "Events taken from the bus by a handler", ["service", "type"]
)
EVENTS_PUBLISHED = Counter(
    "dsec_events_published_total", "Events published and acknowledged", ["service", "type"]
)
HANDLER_SECONDS = Histogram(
    "dsec_handler_seconds",
    "Handler latency, decode to acknowledged outputs",
    ["service", "type"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
HANDLER_FAILURES = Counter(
    "dsec_handler_failures_total",
    "Handler errors; final=true when retries were exhausted and a failure event was published",
    ["service", "type", "final"],
)
REDELIVERIES = Counter(
    "dsec_redeliveries_total", "Events delivered more than once to a handler", ["service", "type"]
)
MALFORMED = Counter(
    "dsec_malformed_events_total", "Bytes on the bus that were not a DSec envelope", ["service"]
)
EVENTS_REJECTED = Counter(
    "dsec_events_rejected_total",
    "Events a consumer refused to act on (unsigned, forged, unauthorized, replayed, ...)",
    ["service", "type", "reason"],
)
# ``reason`` is one of the gate's fixed refusal names (dsec_core.trust: unknown-key,
# revoked-key, uncertified-key, bad-signature, unauthorized, replayed, malformed, ...).

CONSUMER_PENDING = Gauge(
    "dsec_consumer_pending",
    "Messages of the stream a durable consumer has not been delivered yet (its lag), as "
    "JetStream reports it (num_pending)",
    ["service", "durable"],
)
CONSUMER_ACK_PENDING = Gauge(
    "dsec_consumer_ack_pending",
    "Messages delivered to a durable consumer and not acknowledged yet (num_ack_pending)",
    ["service", "durable"],
)
CONSUMER_REDELIVERED = Gauge(
    "dsec_consumer_redelivered",
    "Messages a durable consumer has redelivered and not acknowledged yet (num_redelivered)",
    ["service", "durable"],
)
CONSUMER_INFO_FAILURES = Counter(
    "dsec_consumer_info_failures_total",
    "Times a service could not read one of its durable consumers' state from JetStream",
    ["service"],
)


FD_BUDGET_SHARE = 0.9
"""A process using more than this share of its ``RLIMIT_NOFILE`` reports itself unhealthy."""


def fd_budget_problem() -> str | None:
    """Why this process is short of file descriptors, or ``None``."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError as exc:  # EMFILE: not even one descriptor left to look
        return f"file descriptors exhausted ({exc.strerror}; RLIMIT_NOFILE {soft})"
    if soft != resource.RLIM_INFINITY and used > FD_BUDGET_SHARE * soft:
        return f"{used} of {soft} file descriptors in use (RLIMIT_NOFILE)"
    return None


class LoopWatch:
    """Measures how late the event loop runs a periodic tick (lag), for ``/healthz``.

    A loop that was blocked (a synchronous call, a CPU-bound handler) reports the stall once it
    runs again; one that stays behind by more than ``max_lag_s`` is unhealthy.
    """

    def __init__(self, interval_s: float = 0.5, max_lag_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self.max_lag_s = max_lag_s
        self.lag_s = 0.0
        self._last = time.monotonic()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Begin ticking on the running loop."""
        self._last = time.monotonic()
        self._task = asyncio.get_running_loop().create_task(self._tick())

    def stop(self) -> None:
        """Stop ticking."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            self.lag_s = max(0.0, now - self._last - self.interval_s)
            self._last = now

    def problem(self) -> str | None:
        """Why the loop is unhealthy (stalled now, or late), or ``None``."""
        if self._task is None:
            return None
        behind = time.monotonic() - self._last - self.interval_s
        lag = max(self.lag_s, behind)
        if lag > self.max_lag_s:
            return f"event loop stalled: a tick ran {lag:.1f} s late"
        return None


class MetricsServer:
    """Serves ``/metrics`` (Prometheus text) and ``/healthz`` (JSON) for one process.

    Args:
        healthy: whether the process can serve.
        problems: why it cannot (each a sentence, shown in ``/healthz``); any makes it
            unhealthy.
    """

    def __init__(
        self,
        service: str,
        version: str,
        healthy: Callable[[], bool],
        problems: Callable[[], list[str]] | None = None,
    ) -> None:
        self._service = service
        self._version = version
        self._healthy = healthy
        self._problems = problems
        self._runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, port: int, host: str = "127.0.0.1") -> int:
        """Start listening; return the bound port (useful with port 0)."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        server = site._server
        sockets = getattr(server, "sockets", None) or []
        self.port = sockets[0].getsockname()[1] if sockets else port
        return self.port

    async def stop(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()

    async def _metrics(self, _: web.Request) -> web.Response:
        return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _health(self, _: web.Request) -> web.Response:
        problems = self._problems() if self._problems is not None else []
        ok = self._healthy() and not problems
        body: dict[str, object] = {
            "status": "ok" if ok else "unhealthy",
            "service": self._service,
            "version": self._version,
        }
        if problems:
            body["problems"] = problems
        return web.Response(
            text=json.dumps(body), status=200 if ok else 503, content_type="application/json"
        )
