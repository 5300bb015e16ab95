"""Prometheus metrics shared by every service, and the /metrics + /healthz HTTP endpoint."""

from __future__ import annotations

import json
from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest

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


class MetricsServer:
    """Serves ``/metrics`` (Prometheus text) and ``/healthz`` (JSON) for one process."""

    def __init__(self, service: str, version: str, healthy: Callable[[], bool]) -> None:
        self._service = service
        self._version = version
        self._healthy = healthy
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
        ok = self._healthy()
        body = {
            "status": "ok" if ok else "unhealthy",
            "service": self._service,
            "version": self._version,
        }
        return web.Response(
            text=json.dumps(body), status=200 if ok else 503, content_type="application/json"
        )
