"""The demo's world, on loopback only: the search API the websearch agent may call, a tracker it
may not, and the authoritative DNS that names both.

- **DNS**: zone ``websearch.test`` on ``127.0.0.1:PORT`` (UDP and TCP): ``api`` → 127.0.0.53,
  ``tracker`` → 127.0.0.54. The node agent's DNS proxy uses it as upstream
  (``DSEC_DNS_UPSTREAM=127.0.0.1:PORT``).
- **Search API**: ``GET https://api.websearch.test/v1/search?q=..&limit=..`` on 127.0.0.53:443,
  answering JSON only to ``Authorization: Bearer <key>``. Its certificate is issued by a CA made
  at start (``DIR/ca.pem``); private keys never touch the disk longer than it takes to load them.
- **Tracker**: 127.0.0.54:443 accepts TCP connections and reports each one — a sandboxed agent
  must never get there.

- **Faults** (the flaky-search scene, docs/tools.md): the API can be told to misbehave for its
  next requests, one fault each — ``timeout`` (answers after 3 s), ``429`` (``Retry-After: 1``),
  ``401`` (the key refused: "expired"), ``503`` — through an admin endpoint on loopback
  (``python -m dsec_testing.demo_world faults --dir DIR timeout 429 401x6``).

Every request and DNS question is reported on stdout (never the key). ``DIR/world.json`` appears
once everything listens::

    {"dns": "127.0.0.1:PORT", "api_key": "...", "ca": "DIR/ca.pem", "admin": "127.0.0.1:PORT"}

Run (root: port 443)::

    python -m dsec_testing.demo_world --dir DIR [--dns-port 0] [--max-seconds 1800]
    python -m dsec_testing.demo_world seed --dir DIR   # key → OpenBao, queries + CA → S3
    python -m dsec_testing.demo_world faults --dir DIR timeout 429 401x6   # the next requests

It stops on SIGTERM/SIGINT or after ``--max-seconds`` and removes what it wrote.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import hmac
import io
import ipaddress
import json
import os
import re
import secrets
import signal
import socket
import ssl
import sys
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from dsec_core.settings import Settings

from dsec_testing.dns_zone import Question, ZoneServer

ZONE = "websearch.test"
API_HOST = f"api.{ZONE}"
API_ADDRESS = "127.0.0.53"
TRACKER_HOST = f"tracker.{ZONE}"
TRACKER_ADDRESS = "127.0.0.54"
HTTPS_PORT = 443
DNS_HOST = "127.0.0.1"

VAULT_MOUNT = "secret"
VAULT_PATH = "default/agent-tools/websearch"  # tenant "default": secret/default/...
VAULT_FIELD = "key"
BUCKET = "dsec-demo"
QUERIES_KEY = "default/queries/queries.txt"  # tenant "default": <bucket>/default/...
CA_KEY = "default/trust/ca.pem"
DEFAULT_QUERIES = "what is a sandbox\nhow does landlock restrict files\nebpf cgroup connect hooks\n"

WORLD_FILE = "world.json"
CA_FILE = "ca.pem"
DEFAULT_MAX_SECONDS = 1800.0
MAX_LIMIT = 10

ZONE_TEXT = f"""\
$ORIGIN {ZONE}.
$TTL 60
@        SOA   ns.{ZONE}. hostmaster.{ZONE}. 1 3600 600 86400 60
@        NS    ns.{ZONE}.
ns       A     {DNS_HOST}
api      A     {API_ADDRESS}
tracker  A     {TRACKER_ADDRESS}
"""

_CORPUS = (
    (
        "What is a sandbox?",
        "sandbox",
        "A sandbox runs code with exactly the access it was granted: files, network, secrets.",
    ),
    (
        "Landlock: unprivileged access control",
        "landlock",
        "Landlock lets a process restrict which files it and its children may read and write.",
    ),
    (
        "eBPF cgroup socket hooks",
        "ebpf-cgroup",
        "cgroup connect4/connect6 programs decide every connect made by a cgroup's processes.",
    ),
    (
        "seccomp filters",
        "seccomp",
        "seccomp-bpf refuses the system calls a process has no business making, like ptrace.",
    ),
    (
        "DNS as an exfiltration channel",
        "dns-exfiltration",
        "An open resolver lets code leak data in query names; answer only the names allowed.",
    ),
    (
        "Short-lived secrets",
        "leases",
        "Secrets injected as leases expire with the workload and are revoked when it exits.",
    ),
)


_STOPWORDS = frozenset(
    {"a", "an", "and", "do", "does", "for", "how", "in", "is", "it", "of", "on", "the", "to"}
    | {"what", "which", "why", "with"}
)


FAULTS = ("timeout", "429", "401", "503")
FAULT_STALL_S = 3.0


def parse_faults(words: Sequence[str]) -> list[str]:
    """``timeout 429 401x6`` → one fault per request (``NAMExN``: N of them)."""
    faults: list[str] = []
    for word in words:
        name, _, count = word.partition("x")
        if name not in FAULTS or (count and not count.isdigit()):
            raise ValueError(f"fault {word!r}: use {', '.join(FAULTS)}, optionally xN")
        faults += [name] * (int(count) if count else 1)
    return faults


class WorldError(RuntimeError):
    """The world cannot start or be seeded; the message says what to do."""


@dataclass(frozen=True)
class WorldInfo:
    """What ``world.json`` holds.

    Attributes:
        dns: ``host:port`` of the authoritative DNS server (the ``DSEC_DNS_UPSTREAM`` value).
        api_key: the key the search API accepts (the secret the demo puts into OpenBao).
        ca: path of the CA certificate (PEM) that issued the API's certificate.
    """

    dns: str
    api_key: str = field(repr=False)
    ca: Path
    admin: str = ""

    def to_json(self) -> str:
        """The ``world.json`` text."""
        return json.dumps(
            {"dns": self.dns, "api_key": self.api_key, "ca": str(self.ca), "admin": self.admin}
        )

    @classmethod
    def load(cls, path: Path) -> WorldInfo:
        """Read a ``world.json``.

        Raises:
            WorldError: the file is missing or not a world file.
        """
        try:
            data = json.loads(path.read_text())
            return cls(
                dns=data["dns"],
                api_key=data["api_key"],
                ca=Path(data["ca"]),
                admin=str(data.get("admin", "")),
            )
        except FileNotFoundError:
            raise WorldError(f"{path} does not exist: is the demo world running?") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise WorldError(f"{path} is not a demo world file: {exc}") from None


# ---------------------------------------------------------------------------------------- pure


@dataclass(frozen=True)
class Pki:
    """A CA and one server certificate issued by it (PEM). Keys are secrets: keep them off disk."""

    ca_pem: bytes
    cert_pem: bytes
    key_pem: bytes = field(repr=False)


def make_pki(host: str, address: str, *, days: int = 2) -> Pki:
    """A fresh CA and a server certificate for ``host`` (and IP ``address``), EC P-256."""
    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(hours=1), now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "DSec demo CA")])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    san = [x509.DNSName(host), x509.IPAddress(ipaddress.ip_address(address))]
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(cert_sign=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    pem = serialization.Encoding.PEM
    return Pki(ca.public_bytes(pem), cert.public_bytes(pem), key_pem)


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def search(query: str, limit: int) -> dict[str, Any]:
    """The search API's answer: the canned documents ranked by words shared with ``query``."""
    words = set(re.findall(r"[a-z0-9]+", query.lower())) - _STOPWORDS
    scored = []
    for index, (title, slug, snippet) in enumerate(_CORPUS):
        text = set(re.findall(r"[a-z0-9]+", f"{title} {slug} {snippet}".lower()))
        scored.append((-len(words & text), index, title, slug, snippet))
    scored.sort()
    results = [
        {"title": title, "url": f"https://docs.{ZONE}/{slug}", "snippet": snippet, "score": -score}
        for score, _, title, slug, snippet in scored[:limit]
    ]
    return {"query": query, "results": results}


def parse_limit(raw: str | None) -> int:
    """``limit`` from the query string (default 5).

    Raises:
        ValueError: not an integer from 1 to ``MAX_LIMIT``.
    """
    if raw is None:
        return 5
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_LIMIT:
        raise ValueError(f"limit must be an integer from 1 to {MAX_LIMIT}, got {raw!r}")
    return int(raw)


# ---------------------------------------------------------------------------------------- world


def _say(line: str) -> None:
    print(line, flush=True)


class DemoWorld:
    """DNS + search API + tracker on loopback, with ``world.json`` and ``ca.pem`` in ``directory``.

    Args:
        directory: where ``world.json`` and ``ca.pem`` go (created if missing).
        dns_port: port of the DNS server on 127.0.0.1 (0: a free one).
        https_port: port of the API and the tracker (443; 0 picks a free one, for tests of the
            world itself: the agent's URL names no port).
        api_key: the key the API accepts (default: a fresh random one).
    """

    def __init__(
        self,
        directory: Path,
        *,
        dns_port: int = 0,
        https_port: int = HTTPS_PORT,
        api_key: str | None = None,
    ) -> None:
        self.directory = directory.resolve()
        self.https_port = https_port
        self.api_key = api_key or f"wsk_{secrets.token_hex(16)}"
        self.dns = ZoneServer([ZONE_TEXT], host=DNS_HOST, port=dns_port, on_question=_dns_said)
        self.api_requests = 0
        self.tracker_connections = 0
        self.faults: list[str] = []  # what the API does to its next requests, one each
        self._admin: web.AppRunner | None = None
        self._admin_address = ""
        self._runner: web.AppRunner | None = None
        self._tracker: asyncio.Server | None = None
        self._written: list[Path] = []
        self._made_directory = False

    @property
    def world_file(self) -> Path:
        """``DIR/world.json``."""
        return self.directory / WORLD_FILE

    async def start(self) -> WorldInfo:
        """Generate the PKI, start every server, then write ``ca.pem`` and ``world.json``.

        Raises:
            WorldError: an address is taken or not allowed (port 443 needs root); nothing is
                left running.
        """
        if not self.directory.exists():
            self.directory.mkdir(parents=True)
            self._made_directory = True
        pki = make_pki(API_HOST, API_ADDRESS)
        try:
            await self._listen(pki)
        except BaseException:
            await self.close()
            raise
        ca = self._write(CA_FILE, pki.ca_pem, 0o644)
        info = WorldInfo(
            dns=self.dns.address, api_key=self.api_key, ca=ca, admin=self._admin_address
        )
        self._write(WORLD_FILE, info.to_json().encode(), 0o600)  # holds the key
        _say(
            f"world: dns {info.dns} (zone {ZONE}), api https://{API_HOST} "
            f"({API_ADDRESS}:{self.https_port}), tracker {TRACKER_HOST} "
            f"({TRACKER_ADDRESS}:{self.https_port}); {self.world_file}"
        )
        return info

    async def _listen(self, pki: Pki) -> None:
        try:
            await self.dns.start()
        except OSError as exc:
            raise WorldError(f"DNS cannot listen on {DNS_HOST}:{self.dns.port}: {exc}") from None
        tls = self._tls(pki)
        try:
            api = socket.create_server((API_ADDRESS, self.https_port))
        except OSError as exc:
            raise WorldError(_bind_problem(API_ADDRESS, self.https_port, exc)) from None
        self.https_port = api.getsockname()[1]  # port 0 (tests): the tracker takes the same one
        admin = web.Application()
        admin.router.add_post("/faults", self._set_faults)
        self._admin = web.AppRunner(admin, access_log=None)
        await self._admin.setup()
        admin_socket = socket.create_server((DNS_HOST, 0))
        self._admin_address = f"{DNS_HOST}:{admin_socket.getsockname()[1]}"
        await web.SockSite(self._admin, admin_socket).start()
        app = web.Application()
        app.router.add_get("/v1/search", self._search)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.SockSite(self._runner, api, ssl_context=tls).start()
        try:
            self._tracker = await asyncio.start_server(
                self._tracker_client, TRACKER_ADDRESS, self.https_port
            )
        except OSError as exc:
            raise WorldError(_bind_problem(TRACKER_ADDRESS, self.https_port, exc)) from None

    def _tls(self, pki: Pki) -> ssl.SSLContext:
        # ssl loads a key only from a file: a 0600 file that lives for the duration of the call.
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        chain = self.directory / f".server-{secrets.token_hex(4)}.pem"
        fd = os.open(chain, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(pki.cert_pem + pki.key_pem)
            context.load_cert_chain(chain)
        finally:
            chain.unlink(missing_ok=True)
        return context

    def _write(self, name: str, data: bytes, mode: int) -> Path:
        path = self.directory / name
        tmp = path.with_name(f".{name}.tmp")
        tmp.write_bytes(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)  # readers never see half a file
        self._written.append(path)
        return path

    async def close(self) -> None:
        if self._admin is not None:
            await self._admin.cleanup()
            self._admin = None
        await self._close()

    async def _close(self) -> None:
        """Stop every server and remove what the world wrote."""
        if self._tracker is not None:
            self._tracker.close()
            await self._tracker.wait_closed()
            self._tracker = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.dns.close()
        for path in reversed(self._written):
            path.unlink(missing_ok=True)
        self._written.clear()
        if self._made_directory:
            with contextlib.suppress(OSError):  # not empty: someone else's files, keep them
                self.directory.rmdir()

    async def __aenter__(self) -> WorldInfo:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _set_faults(self, request: web.Request) -> web.Response:
        try:
            faults = await request.json()
            if not isinstance(faults, list) or not all(f in FAULTS for f in faults):
                raise ValueError(f"a list of {', '.join(FAULTS)}")
        except ValueError as exc:
            return web.json_response({"error": str(exc)}, status=400)
        self.faults = list(faults)
        _say(f"api: the next {len(faults)} requests fail: {' '.join(faults)}")
        return web.json_response({"faults": self.faults})

    async def _fault(self) -> web.Response | None:
        """The next fault, if one is set: an answer, or a wait (``timeout``) then none."""
        if not self.faults:
            return None
        fault = self.faults.pop(0)
        if fault == "timeout":
            _say(f"api: GET /v1/search stalls {FAULT_STALL_S:g} s (fault)")
            await asyncio.sleep(FAULT_STALL_S)
            return None
        status = int(fault)
        text = {
            "429": "rate limit exceeded",
            "401": "API key expired",
            "503": "search backend unavailable",
        }[fault]
        _say(f"api: GET /v1/search {status} ({text}, fault)")
        headers = {"Retry-After": "1"} if status == 429 else None
        return web.json_response({"error": text}, status=status, headers=headers)

    async def _search(self, request: web.Request) -> web.Response:
        self.api_requests += 1
        faulty = await self._fault()
        if faulty is not None:
            return faulty
        wanted = f"Bearer {self.api_key}".encode()
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, wanted):
            _say("api: GET /v1/search 401 (missing or wrong API key)")
            return web.json_response({"error": "missing or wrong API key"}, status=401)
        query = request.query.get("q", "").strip()
        try:
            if not query:
                raise ValueError("q is required")
            limit = parse_limit(request.query.get("limit"))
        except ValueError as exc:
            _say(f"api: GET /v1/search 400 ({exc})")
            return web.json_response({"error": str(exc)}, status=400)
        answer = search(query, limit)
        _say(f"api: GET /v1/search 200 ({len(answer['results'])} results for {query!r})")
        return web.json_response(answer)

    async def _tracker_client(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        self.tracker_connections += 1
        peer = writer.get_extra_info("peername")
        _say(f"tracker: connection from {peer[0]}:{peer[1]} (a sandbox must never get here)")
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def _dns_said(question: Question, rcode: str) -> None:
    name, rdtype, proto = question
    _say(f"dns: {rdtype} {name} ({proto}) -> {rcode}")


def _bind_problem(host: str, port: int, exc: OSError) -> str:
    hint = "another demo world may be running"
    if port < 1024 and os.geteuid() != 0:
        hint = f"port {port} needs root"
    return f"cannot listen on {host}:{port}: {exc.strerror or exc} ({hint})"


async def serve(
    directory: Path, *, dns_port: int = 0, max_seconds: float = DEFAULT_MAX_SECONDS
) -> None:
    """Run the world until SIGTERM/SIGINT or ``max_seconds``, then clean up."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    world = DemoWorld(directory, dns_port=dns_port)
    try:
        async with world:
            try:
                await asyncio.wait_for(stop.wait(), max_seconds)
            except TimeoutError:
                _say(f"world: stopping after --max-seconds {max_seconds:g}")
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    _say("world: stopped, nothing left behind")


# ---------------------------------------------------------------------------------------- seed


@dataclass(frozen=True)
class SeedReport:
    """Where :func:`seed` put things (no values)."""

    secret: str
    objects: tuple[str, ...]


def seed(
    world: WorldInfo, settings: Settings | None = None, queries: str = DEFAULT_QUERIES
) -> SeedReport:
    """Put the API key into OpenBao and the queries and CA into S3, where the example's spec
    expects them: ``vault://secret/default/agent-tools/websearch#key``, ``s3://dsec-demo/default/queries/``,
    ``s3://dsec-demo/default/trust/``.

    Args:
        world: the running world (its key and CA).
        settings: :class:`dsec_core.settings.Settings` (default: from the environment, so
            ``DSEC_HOME/stack.json`` written by ``dsec up`` provides the endpoints).
        queries: text of ``queries.txt``, one query a line.

    Raises:
        WorldError: no Vault or S3 is configured, or one refused the write.
    """
    # Imported here: serving the world needs none of the stack's clients.
    import hvac
    import hvac.exceptions
    import requests
    import urllib3.exceptions
    from dsec_core import objectstore
    from minio.error import S3Error

    settings = settings or Settings()
    addr, token = settings.endpoint("vault_addr"), settings.endpoint("vault_token")
    if not addr or not token:
        raise WorldError(
            "no OpenBao/Vault: run `dsec up` (DSEC_HOME/stack.json) or set DSEC_VAULT_ADDR and "
            "DSEC_VAULT_TOKEN"
        )
    secret = f"vault://{VAULT_MOUNT}/{VAULT_PATH}#{VAULT_FIELD}"
    try:
        vault = hvac.Client(url=str(addr), token=str(token), timeout=10)
        vault.secrets.kv.v2.create_or_update_secret(
            path=VAULT_PATH, secret={VAULT_FIELD: world.api_key}, mount_point=VAULT_MOUNT
        )
    except (hvac.exceptions.VaultError, requests.RequestException) as exc:
        raise WorldError(f"cannot write {secret}: {type(exc).__name__}") from None
    try:
        store = objectstore.client(settings)
        objectstore.ensure_bucket(store, BUCKET)
        for key, data in ((QUERIES_KEY, queries.encode()), (CA_KEY, world.ca.read_bytes())):
            store.put_object(BUCKET, key, io.BytesIO(data), len(data))
    except objectstore.ObjectStoreNotConfigured as exc:
        raise WorldError(str(exc)) from None
    except (S3Error, OSError, urllib3.exceptions.HTTPError) as exc:
        raise WorldError(f"cannot write to s3://{BUCKET}/: {exc}") from None
    return SeedReport(
        secret=secret, objects=(f"s3://{BUCKET}/{QUERIES_KEY}", f"s3://{BUCKET}/{CA_KEY}")
    )


# ---------------------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dsec_testing.demo_world",
        description="The DSec demo's loopback world (serve, the default), or seed the stack "
        "with its key, queries and CA (seed).",
    )
    parser.add_argument("command", nargs="?", choices=("serve", "seed", "faults"), default="serve")
    parser.add_argument("faults", nargs="*", help="faults: e.g. timeout 429 401x6")
    parser.add_argument("--dir", type=Path, required=True, help="where world.json and ca.pem go")
    parser.add_argument("--dns-port", type=int, default=0, help="DNS port on 127.0.0.1 (0: free)")
    parser.add_argument(
        "--max-seconds", type=float, default=DEFAULT_MAX_SECONDS, help="stop after this long"
    )
    parser.add_argument("--queries", type=Path, help="seed: queries.txt to upload")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m dsec_testing.demo_world``."""
    args = _parser().parse_intermixed_args(argv)
    try:
        if args.command == "faults":
            info = WorldInfo.load(args.dir / WORLD_FILE)
            body = json.dumps(parse_faults(args.faults)).encode()
            request = urllib.request.Request(
                f"http://{info.admin}/faults", data=body, method="POST"
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                _say(f"faults set: {json.load(response)['faults']}")
            return 0
        if args.command == "seed":
            queries = args.queries.read_text() if args.queries else DEFAULT_QUERIES
            report = seed(WorldInfo.load(args.dir / WORLD_FILE), queries=queries)
            _say(f"seeded: {report.secret}, {', '.join(report.objects)}")
            return 0
        asyncio.run(serve(args.dir, dns_port=args.dns_port, max_seconds=args.max_seconds))
    except (WorldError, OSError, ValueError) as exc:
        print(f"demo world: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
