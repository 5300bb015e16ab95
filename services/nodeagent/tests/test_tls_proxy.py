"""The request-counting HTTPS proxy against a real local HTTPS server with its own CA.

A client pipelines requests over one CONNECT tunnel and one TLS connection (what curl or a
keep-alive pool does): the rule's ``requests`` budget holds per request, not per connect.
"""

from __future__ import annotations

import asyncio
import http.server
import socket
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import pytest
from dsec_core.spec.plan import PlanEgressRule
from dsec_core.spec.units import Rate

from dsec_nodeagent.tlsproxy import CertAuthority, ProxyRule, SandboxProxy, TokenBucket

pytestmark = pytest.mark.integration

HOST = "localhost"


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = f"hello {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[tuple[int, ssl.SSLContext]]:
    """An HTTPS server on 127.0.0.1 for ``localhost``, and a client context trusting its CA."""
    ca = CertAuthority("upstream", tmp_path)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.socket = ca.server_context(HOST).wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    trust = ssl.create_default_context(cadata=ca.pem.decode())
    try:
        yield int(server.server_address[1]), trust
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _rule(port: int, rate: str | None = "10requests/min") -> ProxyRule:
    plan = PlanEgressRule(
        kind="domain",
        domain=HOST,
        ports=(port,),
        rate_limit=None if rate is None else Rate.model_validate(rate),
    )
    return ProxyRule("egress[0]", plan)


def _tunnel(proxy_port: int, target: str, ca: CertAuthority) -> tuple[socket.socket, bytes]:
    """CONNECT through the proxy; the TLS socket (or the raw one) and the proxy's answer."""
    raw = socket.create_connection(("127.0.0.1", proxy_port), timeout=10)
    raw.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        chunk = raw.recv(4096)
        if not chunk:
            break
        answer += chunk
    if not answer.startswith(b"HTTP/1.1 200"):
        return raw, answer
    ctx = ssl.create_default_context(cadata=ca.pem.decode())
    ctx.set_alpn_protocols(["h2", "http/1.1"])
    return ctx.wrap_socket(raw, server_hostname=target.rpartition(":")[0]), answer


def _pipeline(tls: socket.socket, count: int) -> list[tuple[int, str | None, bytes]]:
    """Send ``count`` GETs in one write, then read the ``count`` responses in order."""
    requests = b"".join(f"GET /{i} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode() for i in range(count))
    tls.sendall(requests)
    reader = tls.makefile("rb")
    return [_read_response(reader) for _ in range(count)]


def _read_response(reader: BinaryIO) -> tuple[int, str | None, bytes]:
    """One response with a Content-Length body (all the proxy sends): status, Retry-After, body."""
    status = int(reader.readline().split(b" ")[1])
    headers: dict[str, str] = {}
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    body = reader.read(int(headers["content-length"]))
    return status, headers.get("retry-after"), body


async def test_pipelined_requests_over_one_connection_are_counted_one_by_one(
    upstream: tuple[int, ssl.SSLContext], tmp_path: Path
) -> None:
    port, trust = upstream
    ca = CertAuthority("sbx-1", tmp_path)
    refused: list[tuple[str, str]] = []
    proxy = SandboxProxy(
        "sbx-1", [_rule(port)], ca, lambda r, t: refused.append((r, t)), upstream=trust
    )
    proxy_port = await proxy.start()
    try:
        tls, answer = await asyncio.to_thread(_tunnel, proxy_port, f"{HOST}:{port}", ca)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert isinstance(tls, ssl.SSLSocket)
        assert tls.selected_alpn_protocol() == "http/1.1"  # h2 offered, downgraded
        answers = await asyncio.to_thread(_pipeline, tls, 30)
        tls.close()
    finally:
        await proxy.close()
    statuses = [status for status, _, _ in answers]
    assert statuses == [200] * 10 + [429] * 20
    assert [body for _, _, body in answers[:10]] == [f"hello /{i}".encode() for i in range(10)]
    # 10/min refills one token every 6 s: the client is told when to come back.
    assert {retry for _, retry, _ in answers[10:]} <= {"1", "2", "3", "4", "5", "6"}
    assert b"rate limit of egress[0]" in answers[10][2]
    assert len(refused) == 20
    assert refused[0] == ("egress[0]", f"GET https://{HOST}/10")


async def test_a_host_no_rule_grants_gets_403_and_no_tunnel(
    upstream: tuple[int, ssl.SSLContext], tmp_path: Path
) -> None:
    port, trust = upstream
    ca = CertAuthority("sbx-2", tmp_path)
    proxy = SandboxProxy("sbx-2", [_rule(port)], ca, lambda r, t: None, upstream=trust)
    proxy_port = await proxy.start()
    try:
        for target in ("example.com:443", f"{HOST}:{port + 1}", f"127.0.0.1:{port}"):
            raw, answer = await asyncio.to_thread(_tunnel, proxy_port, target, ca)
            raw.close()
            assert answer.startswith(b"HTTP/1.1 403"), (target, answer)
            assert b"no tls_proxy rule allows" in answer
    finally:
        await proxy.close()


async def test_an_upstream_the_system_does_not_trust_is_a_502(
    upstream: tuple[int, ssl.SSLContext], tmp_path: Path
) -> None:
    port, _ = upstream
    ca = CertAuthority("sbx-3", tmp_path)
    proxy = SandboxProxy("sbx-3", [_rule(port)], ca, lambda r, t: None)  # system trust only
    proxy_port = await proxy.start()
    try:
        tls, _ = await asyncio.to_thread(_tunnel, proxy_port, f"{HOST}:{port}", ca)
        answers = await asyncio.to_thread(_pipeline, tls, 1)
        tls.close()
    finally:
        await proxy.close()
    assert answers[0][0] == 502
    assert b"CERTIFICATE_VERIFY_FAILED" in answers[0][2]


@pytest.mark.unit
def test_token_bucket_refills_at_the_rate() -> None:
    now = [0.0]
    bucket = TokenBucket(2.0, 1.0 / 6.0, clock=lambda: now[0])
    assert [bucket.take(), bucket.take()] == [0.0, 0.0]
    assert bucket.take() == pytest.approx(6.0)
    now[0] = 3.0
    assert bucket.take() == pytest.approx(3.0)
    now[0] = 6.0
    assert bucket.take() == 0.0
