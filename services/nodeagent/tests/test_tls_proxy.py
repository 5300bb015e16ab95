"""The request-counting HTTPS proxy against a real local HTTPS server with its own CA.

A client pipelines requests over one CONNECT tunnel and one TLS connection (what curl or a
keep-alive pool does): the rule's ``requests`` budget holds per request, not per connect.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import shutil
import socket
import ssl
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import pytest
from dsec_core.spec.plan import PlanEgressRule
from dsec_core.spec.units import Rate

from dsec_nodeagent.tlsproxy import (
    MAX_CONNECTIONS,
    PROXY_THREADS,
    CertAuthority,
    ProxyRule,
    SandboxProxy,
    TokenBucket,
)

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the harness
from _nodeagent_harness import NodeAgentHarness
from _socket_testkit import listening_here

pytestmark = pytest.mark.integration

HOST = "localhost"
_UPSTREAM_CA: dict[int, bytes] = {}  # the test server's CA, by its port
# This test process's cgroup: the proxy serves the sockets its processes hold.
OWN_CGROUP = Path("/sys/fs/cgroup") / Path("/proc/self/cgroup").read_text().split("::")[-1].strip(
    "/\n"
)


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
    _UPSTREAM_CA[int(server.server_address[1])] = ca.pem
    try:
        yield int(server.server_address[1]), trust
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _rule(port: int, rate: str | None = "10requests/min", internal: bool = True) -> ProxyRule:
    plan = PlanEgressRule(
        kind="domain",
        domain=HOST,
        ports=(port,),
        internal_only=internal,
        tls_proxy=True,
        rate_limit=None if rate is None else Rate.model_validate(rate),
    )
    return ProxyRule("egress[0]", plan)


def _tunnel(proxy_port: int, target: str, ca: CertAuthority) -> tuple[socket.socket, bytes]:
    """CONNECT through the proxy; the TLS socket (or the raw one) and the proxy's answer (b""
    when it closed the connection unanswered, whether with a FIN or, data unread, a reset)."""
    raw = socket.create_connection(("127.0.0.1", proxy_port), timeout=10)
    answer = b""
    try:
        raw.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        while b"\r\n\r\n" not in answer:
            chunk = raw.recv(4096)
            if not chunk:
                break
            answer += chunk
    except (ConnectionResetError, BrokenPipeError):
        return raw, answer
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


@contextlib.asynccontextmanager
async def serving(proxy: SandboxProxy, cgroup: Path = OWN_CGROUP) -> AsyncIterator[int]:
    """The proxy listening for processes of ``cgroup`` (by default this test's own); its port."""
    proxy.cgroup = cgroup
    port = await proxy.start()
    try:
        yield port
    finally:
        await proxy.close()


async def test_pipelined_requests_over_one_connection_are_counted_one_by_one(
    upstream: tuple[int, ssl.SSLContext], tmp_path: Path
) -> None:
    port, trust = upstream
    ca = CertAuthority("sbx-1", tmp_path)
    refused: list[tuple[str, str]] = []
    proxy = SandboxProxy(
        "sbx-1", [_rule(port)], ca, lambda r, t: refused.append((r, t)), upstream=trust
    )
    async with serving(proxy) as proxy_port:
        tls, answer = await asyncio.to_thread(_tunnel, proxy_port, f"{HOST}:{port}", ca)
        assert answer.startswith(b"HTTP/1.1 200"), answer
        assert isinstance(tls, ssl.SSLSocket)
        assert tls.selected_alpn_protocol() == "http/1.1"  # h2 offered, downgraded
        answers = await asyncio.to_thread(_pipeline, tls, 30)
        tls.close()
    statuses = [status for status, _, _ in answers]
    assert statuses == [200] * 10 + [429] * 20
    assert [body for _, _, body in answers[:10]] == [f"hello /{i}".encode() for i in range(10)]
    # 10/min refills one token every 6 s: the client is told when to come back.
    assert {retry for _, retry, _ in answers[10:]} <= {"1", "2", "3", "4", "5", "6"}
    assert b"rate limit of egress[0]" in answers[10][2]
    assert len(refused) == 20
    assert refused[0] == ("egress[0]", f"GET https://{HOST}/10")


@pytest.mark.parametrize("how", ["cancelled", "closed"])
async def test_a_proxy_cancelled_or_closed_at_any_step_of_its_start_leaves_no_listener(
    tmp_path: Path, how: str
) -> None:
    """The node agent's stop may cancel a proxy's start, or close the proxy, anywhere in that
    start: nothing is left listening (before, a cancel at asyncio's last step of binding left
    a listening socket nobody could close, and a close during the start left the server the
    start then made held by nobody)."""
    before = listening_here()
    ca = CertAuthority("sbx-c", tmp_path)
    for turns in range(8):
        proxy = SandboxProxy("sbx-c", [_rule(1)], ca, lambda r, t: None)
        start = asyncio.create_task(proxy.start())
        for _ in range(turns):
            await asyncio.sleep(0)
        if how == "cancelled":
            start.cancel()
        else:
            await proxy.close()
        with contextlib.suppress(asyncio.CancelledError, ConnectionError):
            await start
        await proxy.close()
        assert listening_here() == before, f"{how} after {turns} turns"


async def test_a_header_the_proxy_will_not_forward_is_a_400(
    upstream: tuple[int, ssl.SSLContext], tmp_path: Path
) -> None:
    port, trust = upstream
    ca = CertAuthority("sbx-h", tmp_path)
    proxy = SandboxProxy("sbx-h", [_rule(port)], ca, lambda r, t: None, upstream=trust)
    async with serving(proxy) as proxy_port:
        tls, answer = await asyncio.to_thread(_tunnel, proxy_port, f"{HOST}:{port}", ca)
        assert answer.startswith(b"HTTP/1.1 200"), answer

        def smuggle() -> tuple[int, str | None, bytes]:
            # a bare LF inside a value: header splitting towards the upstream
            tls.sendall(f"GET / HTTP/1.1\r\nHost: {HOST}\r\nX-A: a\nX-B: b\r\n\r\n".encode())
            return _read_response(tls.makefile("rb"))

        status, _, body = await asyncio.to_thread(smuggle)
        tls.close()
    assert status == 400, body


async def test_a_host_no_rule_grants_gets_403_and_no_tunnel(
    upstream: tuple[int, ssl.SSLContext], tmp_path: Path
) -> None:
    port, trust = upstream
    ca = CertAuthority("sbx-2", tmp_path)
    proxy = SandboxProxy("sbx-2", [_rule(port)], ca, lambda r, t: None, upstream=trust)
    async with serving(proxy) as proxy_port:
        for target in ("example.com:443", f"{HOST}:{port + 1}", f"127.0.0.1:{port}"):
            raw, answer = await asyncio.to_thread(_tunnel, proxy_port, target, ca)
            raw.close()
            assert answer.startswith(b"HTTP/1.1 403"), (target, answer)
            assert b"no tls_proxy rule allows" in answer


async def test_an_upstream_the_system_does_not_trust_is_a_502(
    upstream: tuple[int, ssl.SSLContext], tmp_path: Path
) -> None:
    port, _ = upstream
    ca = CertAuthority("sbx-3", tmp_path)
    proxy = SandboxProxy("sbx-3", [_rule(port)], ca, lambda r, t: None)  # system trust only
    async with serving(proxy) as proxy_port:
        tls, _ = await asyncio.to_thread(_tunnel, proxy_port, f"{HOST}:{port}", ca)
        answers = await asyncio.to_thread(_pipeline, tls, 1)
        tls.close()
    assert answers[0][0] == 502
    assert b"CERTIFICATE_VERIFY_FAILED" in answers[0][2]


async def test_upstreams_are_held_to_what_the_kernel_would_allow(
    upstream: tuple[int, ssl.SSLContext], tmp_path: Path
) -> None:
    """A rule without allow_internal_only never reaches loopback through the proxy, and no rule
    reaches the stack's own servers (the kernel's deny set)."""
    port, trust = upstream
    ca = CertAuthority("sbx-4", tmp_path)
    public = SandboxProxy("sbx-4", [_rule(port, internal=False)], ca, lambda r, t: None)
    stack = SandboxProxy("sbx-4", [_rule(port)], ca, lambda r, t: None, upstream=trust)
    stack.forbidden = lambda address, p: p == port
    answers = []
    for proxy in (public, stack):
        async with serving(proxy) as proxy_port:
            tls, _ = await asyncio.to_thread(_tunnel, proxy_port, f"{HOST}:{port}", ca)
            answers += await asyncio.to_thread(_pipeline, tls, 1)
            tls.close()
    assert [status for status, _, _ in answers] == [502, 502]
    assert b"resolves to a loopback address" in answers[0][2]
    assert b"is a server of the DSec stack" in answers[1][2]


async def test_a_connection_from_outside_the_sandboxs_cgroup_gets_nothing(
    upstream: tuple[int, ssl.SSLContext], tmp_path: Path
) -> None:
    """A neighbour whose rules reach the proxy's port: no answer, the connection closes."""
    port, trust = upstream
    ca = CertAuthority("sbx-5", tmp_path)
    proxy = SandboxProxy("sbx-5", [_rule(port)], ca, lambda r, t: None, upstream=trust)
    elsewhere = tmp_path / "other-cgroup"
    elsewhere.mkdir()
    (elsewhere / "cgroup.procs").write_text("1\n")  # init: not who connects
    async with serving(proxy, elsewhere) as proxy_port:
        raw, answer = await asyncio.to_thread(_tunnel, proxy_port, f"{HOST}:{port}", ca)
        raw.close()
    assert answer == b""


async def test_connections_past_the_bound_are_closed_unanswered(
    upstream: tuple[int, ssl.SSLContext], tmp_path: Path
) -> None:
    port, trust = upstream
    ca = CertAuthority("sbx-6", tmp_path)
    proxy = SandboxProxy("sbx-6", [_rule(port)], ca, lambda r, t: None, upstream=trust)
    proxy.cgroup = OWN_CGROUP
    proxy_port = await proxy.start()
    held = [socket.create_connection(("127.0.0.1", proxy_port)) for _ in range(MAX_CONNECTIONS)]
    try:
        deadline = time.monotonic() + 5
        while proxy.connections < MAX_CONNECTIONS and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        raw, answer = await asyncio.to_thread(_tunnel, proxy_port, f"{HOST}:{port}", ca)
        raw.close()
        assert answer == b""
        held.pop().close()  # one fewer: a new one is served again
        while proxy.connections >= MAX_CONNECTIONS and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        tls, answer = await asyncio.to_thread(_tunnel, proxy_port, f"{HOST}:{port}", ca)
        tls.close()
        assert answer.startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()
        await proxy.close()


def test_a_sandbox_whose_upstream_hangs_holds_none_of_the_node_agents_shared_threads(
    tmp_path: Path,
) -> None:
    """Every connection the proxy allows, each with a request to an upstream that never
    answers: the proxy's blocking work waits on its own threads (``PROXY_THREADS``), and the
    event loop's shared pool (the node agent's, six threads on two cores) stays free for the
    neighbours' work. (A loop of its own: its shared pool is sized as on a 2-core node.)"""
    asyncio.run(_upstream_hangs(tmp_path))


async def _upstream_hangs(tmp_path: Path) -> None:
    shared = ThreadPoolExecutor(6)  # the default pool's size on a 2-core node
    asyncio.get_running_loop().set_default_executor(shared)
    silent = socket.socket()  # takes connections, never speaks TLS
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    port = silent.getsockname()[1]
    upstream: list[socket.socket] = []  # the proxy's connections to it, held open

    def take() -> None:
        with contextlib.suppress(OSError):  # (closed at the end)
            while True:
                upstream.append(silent.accept()[0])

    threading.Thread(target=take, daemon=True).start()
    ca = CertAuthority("sbx-hang", tmp_path)
    proxy = SandboxProxy("sbx-hang", [_rule(port, rate=None)], ca, lambda r, t: None)
    opened: list[socket.socket] = []

    def ask() -> None:
        tls, answer = _tunnel(proxy_port, f"{HOST}:{port}", ca)
        opened.append(tls)
        if answer.startswith(b"HTTP/1.1 200"):
            tls.sendall(f"GET / HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())

    async with serving(proxy) as proxy_port:
        try:
            askers = [threading.Thread(target=ask) for _ in range(MAX_CONNECTIONS)]
            for thread in askers:
                thread.start()
            for thread in askers:
                await asyncio.to_thread(thread.join, 20)  # (while the pool is still free)
            assert len(opened) == MAX_CONNECTIONS
            deadline = time.monotonic() + 20  # the requests reach the upstream and hang there
            while len(upstream) < PROXY_THREADS:
                assert time.monotonic() < deadline, f"{len(upstream)} requests reached upstream"
                await asyncio.sleep(0.01)
            # a neighbour's blocking work meanwhile: done at once, not after the upstreams
            assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 5) == "free"
            assert len(upstream) == PROXY_THREADS  # the rest wait for the sandbox's own threads
        finally:
            for sock in opened + upstream:
                sock.close()
            silent.close()  # the hung handshakes end: so do the proxy's threads


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


SANDBOX = """
import errno, json, os, socket, ssl
PORT = {port}
proxy_host, proxy_port = os.environ["HTTPS_PROXY"].removeprefix("http://").rsplit(":", 1)
raw = socket.create_connection((proxy_host, int(proxy_port)), timeout=20)
raw.sendall(f"CONNECT localhost:{{PORT}} HTTP/1.1\\r\\nHost: localhost\\r\\n\\r\\n".encode())
answer = b""
while b"\\r\\n\\r\\n" not in answer:
    answer += raw.recv(4096)
tls = ssl.create_default_context().wrap_socket(raw, server_hostname="localhost")
tls.sendall(b"".join(
    f"GET /{{i}} HTTP/1.1\\r\\nHost: localhost\\r\\n\\r\\n".encode() for i in range(30)
))
reader = tls.makefile("rb")
statuses = []
for _ in range(30):
    statuses.append(int(reader.readline().split()[1]))
    length = 0
    while (line := reader.readline()) != b"\\r\\n":
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    reader.read(length)
import urllib.error, urllib.request
later = []  # urllib honours HTTPS_PROXY and SSL_CERT_FILE: a new tunnel each, same budget
for i in range(2):
    try:
        later.append(urllib.request.urlopen(f"https://localhost:{{PORT}}/u{{i}}").status)
    except urllib.error.HTTPError as exc:
        later.append(exc.code)
direct = socket.socket()
try:
    direct.connect(("127.0.0.1", PORT))
    bypass = "connected"
except OSError as exc:
    bypass = errno.errorcode.get(exc.errno, str(exc))
print(json.dumps({{"connect": answer.split(b"\\r\\n")[0].decode(), "statuses": statuses,
                  "later": later, "bypass": bypass}}), flush=True)
"""


@pytest.fixture
def short_home() -> Iterator[Path]:
    """A short home: the sandboxes' socket paths must fit in AF_UNIX's 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="dtp-", dir="/tmp"))
    yield path / "home"
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.kernel
async def test_a_sandbox_pipelining_through_the_proxy_gets_its_budget_and_no_bypass(
    upstream: tuple[int, ssl.SSLContext], short_home: Path, nats_url: str, tmp_path: Path
) -> None:
    """30 requests pipelined on one connection from a real sandbox, rule 10requests/min: 10
    answered, 20 refused (429) and reported; urllib's requests (a tunnel each) draw on the same
    budget; connecting to the host directly is EPERM."""
    port, _ = upstream
    trusted = tmp_path / "upstream-ca.pem"
    trusted.write_bytes(_UPSTREAM_CA[port])
    egress = (
        f"{{domain: localhost, ports: [{port}], rate_limit: 10requests/min, tls_proxy: true, "
        "allow_internal_only: true}"
    )
    async with NodeAgentHarness(
        short_home, nats_url, policy_summary_interval_s=1.0, tls_proxy_upstream_ca=trusted
    ) as h:
        sid = await h.submit("proxied", SANDBOX.format(port=port), egress=egress)
        exited = await h.wait_for(sid, "sandbox.exited")
        out, err = (p.read_text() for p in h.agent.manager.log_paths(sid))
        assert exited.payload["reason"] == "ok", err[-3000:]
        result = json.loads(out.splitlines()[-1])
        assert result["connect"] == "HTTP/1.1 200 Connection established"
        assert result["statuses"] == [200] * 10 + [429] * 20
        assert result["later"] == [429, 429]
        assert result["bypass"] == "EPERM"
        rec = h.recorded[sid]
        deadline = time.monotonic() + 10
        while True:  # the first refusals as events, the rest counted in summaries
            http = [v for v in rec.of("policy.violation") if v.payload["operation"] == "http"]
            summed = [
                s for s in rec.of("policy.violation_summary") if s.payload["operation"] == "http"
            ]
            total = len(http) + sum(s.payload["count"] for s in summed)
            if total >= 22 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert total == 22, ([v.payload for v in http], [s.payload for s in summed])
        assert http and http[0].payload["rule_id"] == "egress[0]"
        assert http[0].payload["target"] == "GET https://localhost/10"
        assert summed and summed[0].payload["rule_id"] == "egress[0]"
        assert not (short_home / "tls-proxy" / sid).exists()  # its CA is gone with it


NEIGHBOUR = """
import errno, json, socket
try:
    s = socket.create_connection(("127.0.0.1", {proxy_port}), timeout=20)
except OSError as e:
    print(json.dumps({{"refused": errno.errorcode.get(e.errno)}}), flush=True)
    raise SystemExit(0)
s.sendall(b"CONNECT localhost:{port} HTTP/1.1\\r\\nHost: localhost\\r\\n\\r\\n")
print(json.dumps({{"answer": s.recv(4096).decode()}}), flush=True)
"""


@pytest.mark.kernel
async def test_a_neighbour_reaching_the_proxys_port_gets_no_tunnel(
    upstream: tuple[int, ssl.SSLContext], short_home: Path, nats_url: str
) -> None:
    """Another sandbox whose rules open the proxy's loopback port gets no connection to it: the
    port is private to its sandbox in the kernel (before, the proxy took the connection and
    spent its time finding whose it was), and the attempt is a violation."""
    port, _ = upstream
    owner_rule = (
        f"{{domain: localhost, ports: [{port}], rate_limit: 10requests/min, tls_proxy: true, "
        "allow_internal_only: true}"
    )
    async with NodeAgentHarness(short_home, nats_url) as h:
        owner = await h.submit("owner", "import time; time.sleep(60)", egress=owner_rule)
        await h.wait_for(owner, "sandbox.ready")
        proxy_port = h.agent.proxies.port(owner)
        assert proxy_port is not None
        neighbour = await h.submit(
            "neighbour",
            NEIGHBOUR.format(proxy_port=proxy_port, port=port),
            egress=f"{{cidr: 127.0.0.1/32, ports: [{proxy_port}], allow_internal_only: true}}",
        )
        exited = await h.wait_for(neighbour, "sandbox.exited")
        out, err = (p.read_text() for p in h.agent.manager.log_paths(neighbour))
        assert exited.payload["reason"] == "ok", err[-3000:]
        assert json.loads(out.splitlines()[-1]) == {"refused": "EPERM"}
        violation = await h.wait_for(neighbour, "policy.violation")
        assert violation.payload["rule_id"] == "system.egress", violation.payload
        await h.agent.manager.stop(owner, grace_s=0.5)
