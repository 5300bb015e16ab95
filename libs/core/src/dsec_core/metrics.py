"""Prometheus metrics shared by every service, and the /metrics + /healthz HTTP endpoint."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time
from collections.abc import Callable

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
HANDLER_WAITING = Gauge(
    "dsec_handler_waiting",
    "Verified events a fair handler holds for its workers (the tenants take turns)",
    ["service", "type"],
)
TENANT_FULL = Counter(
    "dsec_handler_tenant_full_total",
    "Requests ended at once because their tenant already had DSEC_TENANT_QUEUE held",
    ["service", "type"],
)
HANDLER_TIMEOUTS = Counter(
    "dsec_handler_timeouts_total",
    "Handler attempts cancelled because they ran past their attempt timeout",
    ["service", "type"],
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


_MAX_HEAD = 8192  # request line + headers; a scraper sends a few hundred bytes
_READ_TIMEOUT_S = 10.0  # a request's head must arrive within this
_IDLE_TIMEOUT_S = 60.0  # a kept-alive connection closes after this long without a request
_WRITE_TIMEOUT_S = 10.0  # a client must take an answer within this (else it is dropped)
_MAX_CONNECTIONS = 64
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    431: "Request Header Fields Too Large",
    503: "Service Unavailable",
}


class MetricsServer:
    """Serves ``/metrics`` (Prometheus text) and ``/healthz`` (JSON) for one process.

    A small HTTP/1.1 server on asyncio streams (GET and HEAD, keep-alive, bounded heads,
    timeouts and connections): every service runs one, and aiohttp's web server cost each
    idle service ~10 MiB of its 120 MB budget for two fixed routes.

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
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        # when each connection last began waiting for a request (absent: answering one)
        self._waiting_since: dict[asyncio.Task[None], float] = {}
        self.port = 0

    async def start(self, port: int, host: str = "127.0.0.1") -> int:
        """Start listening; return the bound port (useful with port 0)."""
        self._server = await asyncio.start_server(
            self._serve, host, port, limit=_MAX_HEAD, reuse_address=True
        )
        sockets = list(self._server.sockets)
        self.port = sockets[0].getsockname()[1] if sockets else port
        return self.port

    async def stop(self) -> None:
        """Stop listening and close open connections."""
        if self._server is not None:
            self._server.close()
            tasks = list(self._connections)
            for writer in self._connections.values():
                writer.transport.abort()  # each handler sees its connection lost and ends
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is None:
            writer.transport.abort()
            return
        if len(self._connections) >= _MAX_CONNECTIONS and not self._evict_one():
            writer.transport.abort()  # every connection is busy answering: come back
            return
        self._connections[task] = writer
        try:
            opening = True
            while await self._one_request(reader, writer, task, opening):
                opening = False
            # what is left of the last answer goes out, unless the client stopped reading
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), _WRITE_TIMEOUT_S)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            # A client that does not take its answers (pipelined requests never read) would
            # otherwise hold its connection, and a descriptor, for as long as it likes.
            writer.transport.abort()
            del self._connections[task]
            self._waiting_since.pop(task, None)

    def _evict_one(self) -> bool:
        """At the connection cap, close the connection that has waited longest for a request
        (connections that say nothing cannot keep a probe out); False when all are answering."""
        if not self._waiting_since:
            return False
        oldest = min(self._waiting_since, key=self._waiting_since.__getitem__)
        del self._waiting_since[oldest]
        self._connections[oldest].transport.abort()  # its handler ends and removes it
        return True

    async def _one_request(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        task: asyncio.Task[None],
        opening: bool,
    ) -> bool:
        """Answer one request; return whether the connection stays open. A new connection's
        first request must come within ``_READ_TIMEOUT_S``, a kept-alive one's next within
        ``_IDLE_TIMEOUT_S``."""
        self._waiting_since[task] = asyncio.get_running_loop().time()
        head: bytes | None = None
        try:
            wait = _READ_TIMEOUT_S if opening else _IDLE_TIMEOUT_S
            request_line = await asyncio.wait_for(reader.readline(), wait)
            if not request_line:
                return False
            head = await asyncio.wait_for(self._read_headers(reader), _READ_TIMEOUT_S)
        except (asyncio.LimitOverrunError, ValueError):
            pass  # head stays None: too large
        finally:
            self._waiting_since.pop(task, None)
        if head is None:
            await self._send(writer, 431, b"request head too large\n", "text/plain", False)
            return False
        parts = request_line.decode("latin-1").split()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            await self._send(writer, 400, b"bad request line\n", "text/plain", False)
            return False
        method, target, version = parts
        headers = head.decode("latin-1").lower()
        if "content-length:" in headers or "transfer-encoding:" in headers:
            # GET and HEAD carry no body here; not reading one would desynchronise the stream
            await self._send(writer, 400, b"no request body expected\n", "text/plain", False)
            return False
        keep = (version == "HTTP/1.1" and "connection: close" not in headers) or (
            "connection: keep-alive" in headers
        )
        path = target.split("?", 1)[0]
        if path not in ("/metrics", "/healthz"):
            status, body, ctype = 404, b"not found: try /metrics or /healthz\n", "text/plain"
        elif method not in ("GET", "HEAD"):
            status, body, ctype = 405, b"GET or HEAD only\n", "text/plain"
        elif path == "/metrics":
            status, body, ctype = 200, generate_latest(), CONTENT_TYPE_LATEST
        else:
            status, body = self._health()
            ctype = "application/json"
        await self._send(writer, status, body, ctype, keep, head_only=method == "HEAD")
        return keep

    @staticmethod
    async def _read_headers(reader: asyncio.StreamReader) -> bytes:
        """The header lines up to the empty one (ValueError past ``_MAX_HEAD`` bytes)."""
        head = b""
        while True:
            line = await reader.readline()
            if not line:
                raise asyncio.IncompleteReadError(head, None)
            if line in (b"\r\n", b"\n"):
                return head
            head += line
            if len(head) > _MAX_HEAD:
                raise ValueError("request head too large")

    @staticmethod
    async def _send(
        writer: asyncio.StreamWriter,
        status: int,
        body: bytes,
        content_type: str,
        keep: bool,
        *,
        head_only: bool = False,
    ) -> None:
        if "charset" not in content_type and content_type != CONTENT_TYPE_LATEST:
            content_type += "; charset=utf-8"
        lines = [
            f"HTTP/1.1 {status} {_REASONS[status]}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
            "Connection: " + ("keep-alive" if keep else "close"),
        ]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        if not head_only:
            writer.write(body)
        await asyncio.wait_for(writer.drain(), _WRITE_TIMEOUT_S)

    def _health(self) -> tuple[int, bytes]:
        problems = self._problems() if self._problems is not None else []
        ok = self._healthy() and not problems
        body: dict[str, object] = {
            "status": "ok" if ok else "unhealthy",
            "service": self._service,
            "version": self._version,
        }
        if problems:
            body["problems"] = problems
        return (200 if ok else 503), json.dumps(body).encode()
