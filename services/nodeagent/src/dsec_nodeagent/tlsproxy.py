"""An HTTPS proxy that counts requests: ``requests`` rate limits for clients other than Python.

The in-sandbox semantic layer counts HTTP requests made from Python only; the kernel counts
connects. A client that pipelines many requests over one TLS connection (curl, a keep-alive
pool) is bounded per connect, not per request. For an egress rule that asks (``tls_proxy``),
the node agent runs one :class:`SandboxProxy` per sandbox on a loopback port: the sandbox
reaches the rule's hosts only through it (``HTTPS_PROXY``), it terminates TLS with a leaf
certificate its per-sandbox :class:`CertAuthority` signs, charges every HTTP/1.1 request to the
rule's token bucket, answers 429 with ``Retry-After`` when the bucket is empty, and forwards the
others to the real host over TLS verified against the system trust store.

What it does not see: HTTP/2 (ALPN offers http/1.1 only, so clients downgrade); clients that
pin certificates fail; request bodies with ``Transfer-Encoding: chunked`` are refused (411).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import errno
import functools
import http.client
import ipaddress
import math
import os
import shutil
import socket
import ssl
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgpack
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from dsec_core.spec.plan import EnforcementPlan, PlanEgressRule
from dsec_core.threads import to_the_end
from dsec_sdk.recording import Recorder, Replayer, ReplayMiss, http_key

from dsec_nodeagent.dns.proxy import ports_to_try, proxy_port_range

HEAD_LIMIT = 64 * 1024  # request line + headers
BODY_LIMIT = 8 * 1024 * 1024  # a request body, and a response body (buffered)
MAX_CONNECTIONS = 16  # open connections to one sandbox's proxy; more are closed at once
MAX_LEAVES = 256  # leaf certificates kept per sandbox (a wildcard rule admits many hosts)
IDLE_TIMEOUT_S = 60.0
UPSTREAM_TIMEOUT_S = 30.0
PROXY_THREADS = 4
"""Threads one sandbox's proxy holds at most for its blocking work (the upstream requests, their
address lookups, the check of whose socket connected). They are its own: a sandbox whose
upstream is slow, or that holds its connections open, waits on itself. On the event loop's
shared pool (six threads on two cores) it would stall the node agent's other blocking work
(its neighbours' launches, state files, snapshots) for up to ``UPSTREAM_TIMEOUT_S``."""

T = TypeVar("T")

Refused = Callable[[str, str], None]  # (rule_id, target) for each request refused (429)


class CertAuthority:
    """A per-sandbox CA: its certificate goes into the sandbox's trust bundle; it signs one
    leaf per host the sandbox connects to through the proxy (cached)."""

    def __init__(self, name: str, workdir: Path) -> None:
        self._dir = workdir
        self._key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"dsec proxy CA {name}")])
        now = datetime.datetime.now(datetime.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self._contexts: dict[str, ssl.SSLContext] = {}

    @property
    def pem(self) -> bytes:
        """The CA certificate (what a sandbox must trust)."""
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a leaf for ``host`` (ALPN http/1.1 only)."""
        ctx = self._contexts.pop(host, None) or self._leaf_context(host)
        self._contexts[host] = ctx  # the most recently used last
        while len(self._contexts) > MAX_LEAVES:
            del self._contexts[next(iter(self._contexts))]
        return ctx

    def _leaf_context(self, host: str) -> ssl.SSLContext:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        name = _san(host)
        leaf = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host[:64])]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=7))
            .add_extension(x509.SubjectAlternativeName([name]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        pem = leaf.public_bytes(serialization.Encoding.PEM) + key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        # load_cert_chain reads files only; the file lives just long enough to be read.
        with tempfile.NamedTemporaryFile(dir=self._dir, suffix=".pem") as handle:
            handle.write(pem)
            handle.flush()
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.minimum_version = ssl.TLSVersion.TLSv1_2
            ctx.load_cert_chain(handle.name)
        ctx.set_alpn_protocols(["http/1.1"])
        return ctx


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


@dataclass
class TokenBucket:
    """``capacity`` tokens, refilled at ``rate`` per second; one request takes one."""

    capacity: float
    rate: float
    clock: Callable[[], float] = time.monotonic
    tokens: float = field(init=False)
    stamp: float = field(init=False)

    def __post_init__(self) -> None:
        self.tokens = self.capacity
        self.stamp = self.clock()

    def take(self) -> float:
        """0.0 when a token was taken; else the seconds until one is available."""
        now = self.clock()
        self.tokens = min(self.capacity, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return 0.0
        return (1.0 - self.tokens) / self.rate


@dataclass(frozen=True)
class ProxyRule:
    """A ``tls_proxy`` rule of the plan, under its plan id (``egress[0]``)."""

    rule_id: str
    rule: PlanEgressRule


@dataclass(frozen=True)
class _Request:
    head: bytes
    method: str
    target: str
    headers: list[tuple[str, str]]
    body: bytes
    close: bool


class BadRequest(Exception):
    """A request the proxy will not parse; ``status`` is what the client gets."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


class SandboxProxy:
    """One sandbox's CONNECT proxy on a loopback port (the port identifies the sandbox: the
    egress plan lets only that sandbox reach it)."""

    def __init__(
        self,
        sandbox_id: str,
        rules: Sequence[ProxyRule],
        authority: CertAuthority,
        on_refused: Refused,
        upstream: ssl.SSLContext | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sandbox_id = sandbox_id
        self.rules = list(rules)
        self.authority = authority
        self.on_refused = on_refused
        self.upstream = upstream or ssl.create_default_context()
        self.buckets = {
            r.rule_id: TokenBucket(
                float(r.rule.rate_limit.requests),
                r.rule.rate_limit.per_second,
                clock,
            )
            for r in self.rules
            if r.rule.rate_limit is not None
        }
        self.forbidden: Callable[[str, int], bool] = lambda address, port: False
        # The sandbox's cgroup (set before its first instruction): a connection is served only
        # when a process of that cgroup holds its client socket; None serves nobody.
        self.cgroup: Path | None = None
        self.port: int | None = None
        # Record or replay (docs/experiments.md): the layer and the hosts it applies to
        self.recording: tuple[Recorder | Replayer, frozenset[str]] | None = None
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._tunnels: set[asyncio.Task[None]] = set()  # the sandbox's own connections
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False

    async def _blocking(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on this proxy's own threads (:data:`PROXY_THREADS`), made on first use."""
        if self._closed:  # (a connection accepted while close() ran: no new pool after it)
            raise ConnectionError("the proxy is closed")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(PROXY_THREADS, thread_name_prefix="dsec-tls-proxy")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, functools.partial(fn, *args))

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Listen; returns the port. A cancel that lands while the listener starts waits for
        it, so :meth:`close` finds it (asyncio's ``start_server`` drops a server it has bound
        when cancelled at its last step, leaving the socket listening)."""
        await to_the_end(self._listen(host, port))
        assert self._server is not None
        if self._closed:  # closed while it started (``_listen`` closed its server)
            raise ConnectionError("the proxy was closed while it started")
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def _listen(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._client, host, port, limit=HEAD_LIMIT)
        if self._closed:  # close() ran while it started (it found no server to close)
            self._server.close()

    async def close(self) -> None:
        """Stop listening and drop the open connections."""
        self._closed = True
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task
        if self._pool is not None:  # (a request still upstream ends by its own timeout)
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
        if self._server is not None:
            await self._server.wait_closed()

    def _from_sandbox(self, writer: asyncio.StreamWriter) -> bool:
        """Whether the connecting socket belongs to this proxy's sandbox (a neighbour whose
        rules reach loopback could otherwise spend its budget and use its grants)."""
        peer, local = writer.get_extra_info("peername"), writer.get_extra_info("sockname")
        if self.cgroup is None or peer is None or local is None:
            return False
        inode = tcp_inode(peer[:2], local[:2])
        return inode is not None and holds_socket(self.cgroup, inode)

    @property
    def connections(self) -> int:
        """The sandbox's own connections open now (what :data:`MAX_CONNECTIONS` bounds)."""
        return len(self._tunnels)

    def rule_for(self, host: str, port: int) -> ProxyRule | None:
        """The first tls_proxy rule that grants ``host:port``."""
        return next((r for r in self.rules if r.rule.allows(host, port)), None)

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            if self._closed or len(self._tasks) > 4 * MAX_CONNECTIONS:
                return  # (connections not yet known to be the sandbox's: a bound too)
            # whose connection it is first: a neighbour whose rules reach loopback must not
            # use up this sandbox's bound (its connections are closed once known)
            if not await self._blocking(self._from_sandbox, writer):
                return
            if len(self._tunnels) >= MAX_CONNECTIONS:
                return  # a bound on what one sandbox's connections may hold in the node agent
            self._tunnels.add(task)
            try:
                await self._tunnel(reader, writer)
            finally:
                self._tunnels.discard(task)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError, TimeoutError):
            pass
        except asyncio.CancelledError:
            pass  # close(): this task is the connection's own, awaited only there
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _tunnel(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(_read_request(reader), IDLE_TIMEOUT_S)
        except BadRequest as exc:
            await _reply(writer, exc.status, exc.reason, close=True)
            return
        if request is None:
            return
        if request.method != "CONNECT":
            await _reply(writer, 405, "only CONNECT (HTTPS) goes through this proxy", close=True)
            return
        host, port = _authority(request.target)
        rule = self.rule_for(host, port) if host else None
        if rule is None:
            await _reply(writer, 403, f"no tls_proxy rule allows {host}:{port}", close=True)
            return
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        await writer.start_tls(self.authority.server_context(host))
        await self._serve(rule, host, port, reader, writer)

    async def _serve(
        self,
        rule: ProxyRule,
        host: str,
        port: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        upstream: http.client.HTTPSConnection | None = None
        try:
            while True:
                try:
                    request = await asyncio.wait_for(_read_request(reader), IDLE_TIMEOUT_S)
                except BadRequest as exc:
                    await _reply(writer, exc.status, exc.reason, close=True)
                    return
                if request is None:
                    return
                wait = self._charge(rule)
                if wait > 0:
                    self.on_refused(
                        rule.rule_id, f"{request.method} https://{host}{request.target}"
                    )
                    retry = str(max(1, math.ceil(wait)))
                    await _reply(
                        writer,
                        429,
                        f"rate limit of {rule.rule_id} reached",
                        close=request.close,
                        extra=[("Retry-After", retry)],
                    )
                    if request.close:
                        return
                    continue
                recorded = self._recorded(host)
                if recorded is not None:
                    if not await self._through_recording(recorded, host, port, request, writer):
                        return
                    continue
                if upstream is None:
                    try:
                        addresses = await self._blocking(self._address, rule, host, port)
                    except (OSError, UnicodeError) as exc:
                        await _reply(writer, 502, f"upstream {host}: {exc}", close=True)
                        return
                    upstream = _Pinned(host, port, addresses, self.upstream)
                try:
                    status, reason, headers, body = await self._blocking(
                        _forward, upstream, request
                    )
                except (OSError, http.client.HTTPException) as exc:  # incl. certificate errors
                    upstream.close()
                    upstream = None
                    await _reply(writer, 502, f"upstream {host}: {exc}", close=True)
                    return
                except ValueError as exc:  # a header http.client will not send (CR/LF in it)
                    await _reply(writer, 400, f"bad request header: {exc}"[:200], close=True)
                    return
                writer.write(_response(status, reason, headers, body, request.close))
                await writer.drain()
                if request.close:
                    return
        finally:
            if upstream is not None:
                upstream.close()

    def _recorded(self, host: str) -> Recorder | Replayer | None:
        if self.recording is None:
            return None
        layer, hosts = self.recording
        return layer if host in hosts else None

    async def _through_recording(
        self,
        layer: Recorder | Replayer,
        host: str,
        port: int,
        request: _Request,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Answer a request to a recorded host: from the recording (replay: never upstream;
        a request it lacks gets 502 with ``X-DSec-Replay: miss``), or live and recorded
        (status, reason, headers and body, kept byte for byte). ``False``: connection ended."""
        key = http_key(request.method, host, port, request.target, request.headers, request.body)
        if isinstance(layer, Replayer):
            try:
                recorded = layer.answer(key)
            except ReplayMiss as exc:
                await _reply(
                    writer, 502, str(exc), close=request.close, extra=[("X-DSec-Replay", "miss")]
                )
                return not request.close
        else:

            async def live() -> bytes:
                addresses = await self._blocking(self._address_of, host, port)
                connection = _Pinned(host, port, addresses, self.upstream)
                try:
                    answer = await self._blocking(_forward, connection, request)
                finally:
                    connection.close()
                return pack_response(*answer)

            try:
                recorded = await layer.call(key, live, lambda body: unpack_response(body)[0] >= 400)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                await _reply(writer, 502, f"upstream {host}: {exc}"[:300], close=True)
                return False
        status, reason, headers, body = unpack_response(recorded)
        writer.write(_response(status, reason, headers, body, request.close))
        await writer.drain()
        return not request.close

    def _address_of(self, host: str, port: int) -> list[str]:
        rule = self.rule_for(host, port)
        if rule is None:
            raise OSError(f"no tls_proxy rule grants {host}:{port}")
        return self._address(rule, host, port)

    def _address(self, rule: ProxyRule, host: str, port: int) -> list[str]:
        """The addresses to reach ``host`` at, held to what the kernel would allow the sandbox:
        no internal address unless the rule says ``allow_internal_only``, never the stack's
        own servers. Blocking (resolves); the connection then goes to these very addresses."""
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = [str(info[4][0]) for info in infos]
        for address in addresses:
            why = _unreachable(ipaddress.ip_address(address), rule.rule.internal_only)
            if why is not None:
                raise OSError(f"resolves to {why} address {address}, refused by {rule.rule_id}")
            if self.forbidden(address, port):
                raise OSError(f"{address}:{port} is a server of the DSec stack")
        if not addresses:
            raise OSError("no address")
        return addresses

    def _charge(self, rule: ProxyRule) -> float:
        bucket = self.buckets.get(rule.rule_id)
        return 0.0 if bucket is None else bucket.take()


def _unreachable(ip: ipaddress.IPv4Address | ipaddress.IPv6Address, internal: bool) -> str | None:
    """Why a resolved address is refused, as the DNS proxy refuses rebinding answers: link-local,
    multicast and unspecified always; loopback unless ``allow_internal_only``, which then admits
    only loopback and private addresses."""
    if ip.is_link_local or ip.is_multicast or ip.is_unspecified:
        return "a link-local, multicast or unspecified"
    if internal and not (ip.is_loopback or ip.is_private):
        return "a public"
    if not internal and ip.is_loopback:
        return "a loopback"
    return None


def tcp_inode(client: tuple[str, int], server: tuple[str, int]) -> int | None:
    """The inode of the IPv4 TCP socket at ``client`` connected to ``server``, from
    ``/proc/net/tcp`` (this network namespace)."""

    def hexed(address: tuple[str, int]) -> str:
        packed = int.from_bytes(socket.inet_aton(address[0]), "little")
        return f"{packed:08X}:{address[1]:04X}"

    want = (hexed(client), hexed(server))
    with open("/proc/net/tcp") as table:
        next(table)
        for line in table:
            fields = line.split()
            if (fields[1], fields[2]) == want and fields[9] != "0":
                return int(fields[9])
    return None


def holds_socket(cgroup: Path, inode: int) -> bool:
    """Whether a process of ``cgroup`` (or a cgroup below it) holds socket ``inode``."""
    target = f"socket:[{inode}]"
    for procs in cgroup.rglob("cgroup.procs"):
        try:
            pids = procs.read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                with os.scandir(f"/proc/{pid}/fd") as fds:
                    if any(os.readlink(fd.path) == target for fd in fds):
                        return True
            except OSError:
                continue  # it exited, or the descriptor closed while we looked
    return False


class _Pinned(http.client.HTTPSConnection):
    """An HTTPS connection to ``host`` (SNI, certificate check) at a checked address."""

    def __init__(self, host: str, port: int, addresses: list[str], context: ssl.SSLContext) -> None:
        super().__init__(host, port, timeout=UPSTREAM_TIMEOUT_S, context=context)
        self._addresses = addresses
        self._tls = context

    def connect(self) -> None:
        error: OSError = OSError(f"no address of {self.host} answers")
        for address in self._addresses:
            try:
                raw = socket.create_connection((address, self.port), UPSTREAM_TIMEOUT_S)
            except OSError as exc:
                error = exc
                continue
            self.sock = self._tls.wrap_socket(raw, server_hostname=self.host)
            return
        raise error


def _authority(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not port.isdigit() or not host:
        return "", 0
    return host.strip("[]").lower().rstrip("."), int(port)


async def _read_request(reader: asyncio.StreamReader) -> _Request | None:
    """One HTTP/1.1 request, or None at a clean end of stream."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial.strip():
            return None
        raise BadRequest(400, "incomplete request head") from None
    except asyncio.LimitOverrunError:
        raise BadRequest(431, f"request head over {HEAD_LIMIT} bytes") from None
    lines = head[:-4].decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest(400, "malformed request line")
    method, target, version = parts
    headers: list[tuple[str, str]] = []
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise BadRequest(400, "malformed header line")
        headers.append((name, value.strip()))
    lookup = {n.lower(): v for n, v in headers}
    if "transfer-encoding" in lookup:
        raise BadRequest(411, "chunked request bodies are not supported; send Content-Length")
    length = lookup.get("content-length", "0")
    if not length.isdigit() or int(length) > BODY_LIMIT:
        raise BadRequest(413, f"Content-Length must be 0..{BODY_LIMIT}")
    body = await reader.readexactly(int(length)) if int(length) else b""
    connection = lookup.get("connection", "").lower()
    close = "close" in connection or (version == "HTTP/1.0" and "keep-alive" not in connection)
    return _Request(head, method, target, headers, body, close)


_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
     "upgrade", "proxy-authorization", "content-length"}
)  # fmt: skip


def _forward(
    upstream: http.client.HTTPSConnection, request: _Request
) -> tuple[int, str, list[tuple[str, str]], bytes]:
    """Send one request upstream (blocking; run in a thread); the whole response, bounded."""
    upstream.putrequest(request.method, request.target, skip_host=True, skip_accept_encoding=True)
    for name, value in request.headers:
        if name.lower() not in _HOP:
            upstream.putheader(name, value)
    upstream.putheader("Content-Length", str(len(request.body)))
    upstream.endheaders(request.body or None)
    response = upstream.getresponse()
    body = response.read(BODY_LIMIT + 1)
    if len(body) > BODY_LIMIT:
        upstream.close()
        raise http.client.HTTPException(f"response body over {BODY_LIMIT} bytes")
    if response.will_close:
        upstream.close()  # reopened (auto_open) on the next request
    headers = [(n, v) for n, v in response.getheaders() if n.lower() not in _HOP]
    return response.status, response.reason, headers, body


def pack_response(status: int, reason: str, headers: list[tuple[str, str]], body: bytes) -> bytes:
    """A response as recorded: MessagePack ``[status, reason, [[name, value]...], body]``."""
    packed: bytes = msgpack.packb([status, reason, [list(h) for h in headers], body])
    return packed


def unpack_response(data: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
    status, reason, headers, body = msgpack.unpackb(data)
    return int(status), str(reason), [(str(n), str(v)) for n, v in headers], bytes(body)


def _response(
    status: int, reason: str, headers: list[tuple[str, str]], body: bytes, close: bool
) -> bytes:
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines += [f"{n}: {v}" for n, v in headers]
    lines.append(f"Content-Length: {len(body)}")
    if close:
        lines.append("Connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def _reply(
    writer: asyncio.StreamWriter,
    status: int,
    message: str,
    *,
    close: bool,
    extra: Sequence[tuple[str, str]] = (),
) -> None:
    reason = http.client.responses.get(status, "Error")
    body = (message + "\n").encode()
    headers = [("Content-Type", "text/plain; charset=utf-8"), *extra]
    writer.write(_response(status, reason, headers, body, close))
    await writer.drain()


# ------------------------------------------------------------------ one proxy per sandbox

PROXY_HOST = "127.0.0.1"
CA_BUNDLE_PATH = "/etc/dsec/proxy-ca.pem"  # where the sandbox sees its trust bundle
CA_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")
PROXY_ENV = ("HTTPS_PROXY", "https_proxy")

SandboxRefused = Callable[[str, str, str], None]  # (sandbox_id, rule_id, target)


@dataclass(frozen=True)
class ProxyGrant:
    """What a sandbox with ``tls_proxy`` rules gets: its environment, its trust bundle (a host
    file shown at :data:`CA_BUNDLE_PATH`) and the plan its egress layer enforces instead."""

    port: int
    env: dict[str, str]
    bundle: Path
    egress_plan: EnforcementPlan


def proxied_rules(plan: EnforcementPlan) -> list[ProxyRule]:
    """The plan's ``tls_proxy`` rules under their plan ids."""
    return [ProxyRule(f"egress[{i}]", r) for i, r in enumerate(plan.egress) if r.tls_proxy]


def egress_through_proxy(plan: EnforcementPlan, port: int) -> EnforcementPlan:
    """The plan with each ``tls_proxy`` rule replaced by a grant of the proxy's port alone: the
    sandbox never reaches those hosts directly (same rule id, so refusals still name it)."""
    rules = [
        PlanEgressRule(
            kind="cidr",
            cidr=f"{PROXY_HOST}/32",
            ports=(port,),
            internal_only=True,
            protocols=("tcp",),
        )
        if r.tls_proxy
        else r
        for r in plan.egress
    ]
    return plan.model_copy(update={"egress": tuple(rules)})


def system_bundle() -> bytes:
    """The system's trust store as PEM (what the sandbox trusts besides its proxy CA)."""
    paths = ssl.get_default_verify_paths()
    for candidate in (paths.cafile, paths.openssl_cafile):
        if candidate and Path(candidate).is_file():
            return Path(candidate).read_bytes()
    import certifi

    return Path(certifi.where()).read_bytes()


class TlsProxies:
    """The node agent's proxies, one per sandbox that has ``tls_proxy`` rules."""

    def __init__(
        self, workdir: Path, on_refused: SandboxRefused, upstream_ca: Path | None = None
    ) -> None:
        self.workdir = workdir
        self.on_refused = on_refused
        self.upstream = ssl.create_default_context(
            cafile=str(upstream_ca) if upstream_ca is not None else None
        )
        self._proxies: dict[str, SandboxProxy] = {}
        self.forbidden: Callable[[str, int], bool] = lambda address, port: False
        # Listen above the kernel's ephemeral range, as the DNS proxy does: no sandbox binds
        # there (the bind hooks refuse it) and no autobind lands there, also while the node
        # agent restarts and the listener is gone (a neighbour would take its connections).
        self.ports = proxy_port_range()

    async def open(self, sid: str, plan: EnforcementPlan) -> ProxyGrant | None:
        """Start ``sid``'s proxy (None when its plan has no ``tls_proxy`` rule)."""
        rules = proxied_rules(plan)
        if not rules:
            return None
        await self.close(sid)
        directory = self.workdir / sid
        directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        authority = CertAuthority(sid, directory)
        bundle = directory / "ca-bundle.pem"
        bundle.write_bytes(system_bundle() + b"\n" + authority.pem)
        bundle.chmod(0o644)

        def refused(rule_id: str, target: str) -> None:
            self.on_refused(sid, rule_id, target)

        proxy = SandboxProxy(sid, rules, authority, refused, upstream=self.upstream)
        proxy.forbidden = self.forbidden
        self._proxies[sid] = proxy  # known before it listens: close(sid) ends it whatever happens
        port = await self._listen(proxy)
        url = f"http://{PROXY_HOST}:{port}"
        env = dict.fromkeys(PROXY_ENV, url) | dict.fromkeys(CA_ENV, CA_BUNDLE_PATH)
        return ProxyGrant(port, env, bundle, egress_through_proxy(plan, port))

    async def _listen(self, proxy: SandboxProxy) -> int:
        """Start ``proxy`` on a free port of :attr:`ports` (the kernel's choice without one)."""
        if self.ports is None:
            return await proxy.start(PROXY_HOST)
        for port in ports_to_try(self.ports):
            try:
                return await proxy.start(PROXY_HOST, port)
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
        low, high = self.ports
        raise OSError(errno.EADDRINUSE, f"no free port for the HTTPS proxy in {low}-{high}")

    def port(self, sid: str) -> int | None:
        """The loopback port of ``sid``'s proxy, if it has one."""
        proxy = self._proxies.get(sid)
        return None if proxy is None else proxy.port

    def record(self, sid: str, recording: tuple[Recorder | Replayer, frozenset[str]]) -> None:
        """Record (or replay) ``sid``'s requests to these hosts (docs/experiments.md)."""
        proxy = self._proxies.get(sid)
        if proxy is not None:
            proxy.recording = recording

    def bind(self, sid: str, cgroup: Path) -> None:
        """Serve ``sid``'s proxy to the processes of ``cgroup`` alone."""
        proxy = self._proxies.get(sid)
        if proxy is not None:
            proxy.cgroup = cgroup

    async def close(self, sid: str) -> None:
        """Stop ``sid``'s proxy and remove its CA (idempotent)."""
        proxy = self._proxies.pop(sid, None)
        if proxy is not None:
            await proxy.close()
        shutil.rmtree(self.workdir / sid, ignore_errors=True)

    def forget_all(self) -> None:
        """Remove what proxies of an earlier node agent left (none survives a restart)."""
        shutil.rmtree(self.workdir, ignore_errors=True)

    async def close_all(self) -> None:
        """Stop every proxy (the node agent is going down)."""
        for sid in list(self._proxies):
            await self.close(sid)
