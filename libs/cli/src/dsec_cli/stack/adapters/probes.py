"""Health probes: one real request per server kind, usable for embedded and external servers.

Each probe returns the server's version on success and raises :class:`ProbeError` (a short reason,
never a secret) otherwise.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    import hvac
    import minio


class ProbeError(Exception):
    """The server did not answer as a healthy one would.

    ``fatal`` marks answers that waiting cannot fix (wrong password), so a start fails at once.
    """

    def __init__(self, message: str, *, fatal: bool = False) -> None:
        super().__init__(message)
        self.fatal = fatal


def http_get_json(url: str, timeout: float, headers: dict[str, str] | None = None) -> Any:
    """GET ``url`` and decode JSON; raise :class:`ProbeError` unless the status is 200."""
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            body = resp.read()
    except urllib.error.HTTPError as exc:
        raise ProbeError(f"GET {urlsplit(url).path} returned HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ProbeError(f"GET {urlsplit(url).path}: {reason}") from None
    try:
        return json.loads(body) if body.strip() else None
    except json.JSONDecodeError:
        raise ProbeError(f"GET {urlsplit(url).path}: response is not JSON") from None


def http_ok(url: str, timeout: float) -> None:
    """Raise :class:`ProbeError` unless ``GET url`` answers 200."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            resp.read()
    except urllib.error.HTTPError as exc:
        raise ProbeError(f"GET {urlsplit(url).path} returned HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise ProbeError(f"GET {urlsplit(url).path}: {getattr(exc, 'reason', exc)}") from None


def nats_info(url: str, timeout: float) -> dict[str, Any]:
    """Connect to a NATS server and read the ``INFO`` line it greets every client with."""
    first = url.split(",")[0]
    parts = urlsplit(first)
    host, port = parts.hostname or "127.0.0.1", parts.port or 4222
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            sock.settimeout(timeout)
            buf = b""
            while b"\r\n" not in buf and len(buf) < 65536:
                chunk = sock.recv(4096)
                if not chunk:
                    break
                buf += chunk
    except OSError as exc:
        raise ProbeError(f"cannot connect to {host}:{port}: {exc.strerror or exc}") from None
    line = buf.split(b"\r\n", 1)[0]
    if not line.startswith(b"INFO "):
        raise ProbeError(f"{host}:{port} is not a NATS server (no INFO greeting)")
    try:
        info: dict[str, Any] = json.loads(line[5:])
    except json.JSONDecodeError:
        raise ProbeError(f"{host}:{port}: malformed INFO greeting") from None
    return info


def probe_nats(url: str, timeout: float = 2.0) -> str:
    """Check a NATS server has JetStream; return its version."""
    info = nats_info(url, timeout)
    if not info.get("jetstream"):
        raise ProbeError("NATS server has JetStream disabled (start it with -js)")
    return str(info.get("version", "unknown"))


def _run_coro_in_thread(coro_fn: Any, timeout: float) -> Any:
    """Run an async probe on a fresh loop in its own thread.

    Probes are called from sync code that may itself run inside an event loop (an async test),
    where ``asyncio.run`` is not allowed.
    """
    box: dict[str, Any] = {}

    def runner() -> None:
        try:
            box["value"] = asyncio.run(coro_fn())
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=runner, name="dsec-probe", daemon=True)
    thread.start()
    thread.join(timeout + 5.0)
    if thread.is_alive():
        raise ProbeError("probe did not finish in time")
    if "error" in box:
        raise box["error"]
    return box.get("value")


def probe_postgres(dsn: str, timeout: float = 2.0, *, database: str | None = None) -> str:
    """Open a real connection (password auth) and return ``server_version``."""
    import asyncpg

    async def check() -> str:
        kwargs: dict[str, Any] = {"timeout": timeout}
        if database is not None:
            kwargs["database"] = database
        conn = await asyncpg.connect(dsn, **kwargs)
        try:
            version: str = await conn.fetchval("SHOW server_version")
            return version
        finally:
            await conn.close(timeout=timeout)

    try:
        result: str = _run_coro_in_thread(check, timeout)
    except asyncpg.InvalidAuthorizationSpecificationError as exc:
        # Wrong password/user: the server is up and will keep refusing us.
        raise ProbeError(f"{exc.__class__.__name__}: {exc}", fatal=True) from None
    except (OSError, TimeoutError) as exc:
        raise ProbeError(f"cannot connect: {exc.__class__.__name__}") from None
    except Exception as exc:
        # asyncpg errors carry the server's message (never the password).
        raise ProbeError(f"{exc.__class__.__name__}: {exc}") from None
    return result


def _quoted(identifier: object) -> str:
    """A Postgres identifier, double-quoted (identifiers cannot be bound as parameters)."""
    return '"' + str(identifier).replace('"', '""') + '"'


def postgres_ensure_database(dsn: str, database: str, timeout: float = 5.0) -> None:
    """Create ``database`` (owned by the DSN's user) unless it exists; connects to ``postgres``."""
    import asyncpg

    async def run() -> None:
        conn = await asyncpg.connect(dsn, database="postgres", timeout=timeout)
        try:
            exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database)
            if not exists:
                await conn.execute(f"CREATE DATABASE {_quoted(database)}")
        finally:
            await conn.close(timeout=timeout)

    _run_coro_in_thread(run, timeout)


_PUBLIC_FUNCTIONS_REVOKED = (
    # a reader could hold the projectors' and `dsec up`'s advisory locks with them (every
    # signature of each name is revoked)
    "pg_advisory_lock", "pg_advisory_lock_shared", "pg_try_advisory_lock",
    "pg_try_advisory_lock_shared", "pg_advisory_xact_lock", "pg_advisory_xact_lock_shared",
    "pg_try_advisory_xact_lock", "pg_try_advisory_xact_lock_shared",
    # ... or write: large objects persist, a logical message goes to the WAL
    "lo_create", "lo_creat", "lo_from_bytea", "lo_put", "lo_import", "lo_open", "lo_unlink",
    "pg_logical_emit_message",
)  # fmt: skip


def scram_verifier(password: str, *, iterations: int = 4096) -> str:
    """The SCRAM-SHA-256 verifier Postgres stores for ``password`` (RFC 5802/7677), so the
    password itself never reaches the server, nor its log when a statement fails."""
    import base64
    import hashlib
    import hmac
    import os

    salt = os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", "sha256").digest()
    server_key = hmac.new(salted, b"Server Key", "sha256").digest()
    b64 = base64.b64encode
    stored = b64(hashlib.sha256(client_key).digest()).decode()
    return f"SCRAM-SHA-256${iterations}:{b64(salt).decode()}${stored}:{b64(server_key).decode()}"


def postgres_ensure_reader(dsn: str, role: str, password: str, timeout: float = 30.0) -> None:
    """Create the read-only login ``role`` in the DSN's database, or bring an existing one back
    to exactly that, whatever it was given meanwhile (the DSN's user must be a superuser):
    - it may connect to this database only, and SELECT the read-model tables (granted here for
      those that exist, and by each projector as it creates them); nothing else: no role
      membership, nothing owned, no temporary table, none of the functions that take advisory
      locks or write large objects or the WAL;
    - its sessions start read-only, with a 30 s statement timeout, transactions idle for 60 s
      ended, at most 256 MB of temporary files (a setting it cannot change), 16 connections;
    - its sessions open now are ended (a password it changed, locks it held).
    """
    import asyncpg
    from dsec_core.projections import READ_TABLES, READER_GUARD, reader_settings_sql

    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", role) or not re.fullmatch(
        r"[\w-]{16,}", password
    ):
        raise ValueError("postgres_ensure_reader: an unsafe role name or password")
    verifier = scram_verifier(password)
    end_sessions = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1"

    async def run() -> None:
        conn = await asyncpg.connect(dsn, timeout=timeout)
        try:
            database = await conn.fetchval("SELECT current_database()")
            quoted_db = _quoted(database)
            await conn.execute(end_sessions, role)
            async with conn.transaction():
                await conn.execute("SET LOCAL lock_timeout = '5s'")
                await conn.execute("SELECT pg_advisory_xact_lock(7272)")  # two `dsec up` at once
                await conn.execute("SELECT pg_advisory_xact_lock(7271)")  # and the projectors
                if not await conn.fetchval("SELECT 1 FROM pg_roles WHERE rolname = $1", role):
                    await conn.execute(f"CREATE ROLE {role}")
                # (identifiers cannot be bound; the role name was checked above)
                await conn.execute(
                    f"ALTER ROLE {role} WITH LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE "
                    f"NOREPLICATION NOBYPASSRLS NOINHERIT CONNECTION LIMIT 16 "
                    f"PASSWORD '{verifier}'"
                )
                for group in await conn.fetch(
                    "SELECT r.rolname FROM pg_auth_members m JOIN pg_roles r ON r.oid = m.roleid"
                    " WHERE m.member = (SELECT oid FROM pg_roles WHERE rolname = $1)",
                    role,
                ):
                    await conn.execute(f"REVOKE {_quoted(group['rolname'])} FROM {role}")
                # a role may set its own defaults, per database too, and its own password: the
                # projectors set both back to these (restore_reader)
                await conn.execute(reader_settings_sql(role))
                await conn.execute(
                    f"CREATE TABLE IF NOT EXISTS {READER_GUARD}"
                    " (role text PRIMARY KEY, verifier text NOT NULL)"
                )
                await conn.execute(f"REVOKE ALL ON {READER_GUARD} FROM PUBLIC")
                await conn.execute(
                    f"INSERT INTO {READER_GUARD} VALUES ($1, $2)"
                    " ON CONFLICT (role) DO UPDATE SET verifier = EXCLUDED.verifier",
                    role,
                    verifier,
                )
                # what it owns is dropped, never handed on; every privilege granted it too
                await conn.execute(f"DROP OWNED BY {role}")
                await conn.execute(f"REVOKE ALL ON DATABASE {quoted_db} FROM PUBLIC")
                await conn.execute(f"GRANT CONNECT ON DATABASE {quoted_db} TO {role}")
                for other in await conn.fetch(
                    "SELECT datname FROM pg_database WHERE datname <> $1", database
                ):  # (template0 takes no connection; postgres and template1 took any role's)
                    other_db = _quoted(other["datname"])
                    await conn.execute(f"REVOKE CONNECT, TEMP ON DATABASE {other_db} FROM PUBLIC")
                await conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
                await conn.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
                for function in await conn.fetch(
                    "SELECT oid::regprocedure::text AS sig FROM pg_proc WHERE proname = ANY($1)"
                    " AND pronamespace = 'pg_catalog'::regnamespace",
                    list(_PUBLIC_FUNCTIONS_REVOKED),
                ):  # (regprocedure's text is a quoted, qualified signature)
                    await conn.execute(f"REVOKE EXECUTE ON FUNCTION {function['sig']} FROM PUBLIC")
                for table in READ_TABLES:
                    if await conn.fetchval("SELECT to_regclass($1)", f"public.{table}"):
                        await conn.execute(f"GRANT SELECT ON {table} TO {role}")
            await conn.execute(end_sessions, role)  # again: one may have come back meanwhile
        finally:
            await conn.close(timeout=timeout)

    _run_coro_in_thread(run, timeout)


def minio_client(
    endpoint: str, access_key: str, secret_key: str, *, secure: bool = False, timeout: float = 5.0
) -> minio.Minio:
    """A MinIO SDK client that fails fast (no retries) — for probes and tests."""
    import minio
    import urllib3

    http = urllib3.PoolManager(
        timeout=urllib3.Timeout(connect=timeout, read=timeout),
        retries=False,
        maxsize=4,
    )
    return minio.Minio(
        endpoint, access_key=access_key, secret_key=secret_key, secure=secure, http_client=http
    )


def probe_s3(
    endpoint: str, access_key: str, secret_key: str, *, secure: bool = False, timeout: float = 2.0
) -> list[str]:
    """List buckets with the credentials (a signed request, so auth is checked)."""
    from minio.error import MinioException

    client = minio_client(endpoint, access_key, secret_key, secure=secure, timeout=timeout)
    try:
        return [b.name for b in client.list_buckets()]
    except MinioException as exc:
        code = getattr(exc, "code", None) or exc.__class__.__name__
        raise ProbeError(f"S3 list_buckets failed: {code}") from None
    except Exception as exc:
        raise ProbeError(f"S3 list_buckets failed: {exc.__class__.__name__}") from None


def s3_roundtrip(
    endpoint: str,
    access_key: str,
    secret_key: str,
    bucket: str,
    *,
    secure: bool = False,
    timeout: float = 30.0,
) -> None:
    """Create ``bucket`` if needed, then write and read back a small object until it works or
    ``timeout`` passes.

    Listing buckets only needs SeaweedFS's filer; reading objects also needs its volume server
    registered with the master, which can lag a restart by a second or more.

    Raises:
        ProbeError: the store did not serve a write and a read within ``timeout``.
    """
    import io
    import time

    import urllib3
    from minio.error import MinioException

    client = minio_client(endpoint, access_key, secret_key, secure=secure)
    key, body = ".dsec-health", b"ok"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if not client.bucket_exists(bucket):
                client.make_bucket(bucket)
            client.put_object(bucket, key, io.BytesIO(body), len(body))
            response = client.get_object(bucket, key)
            try:
                if response.read() == body:
                    return
            finally:
                response.close()
                response.release_conn()
        except (MinioException, urllib3.exceptions.HTTPError, OSError) as exc:
            last = f"{exc.__class__.__name__}: {getattr(exc, 'code', '') or exc}"
        else:
            last = "read back different bytes"
        if time.monotonic() > deadline:
            raise ProbeError(f"S3 write/read of {bucket}/{key} failed for {timeout:.0f} s: {last}")
        time.sleep(0.1)


def vault_client(addr: str, token: str, timeout: float = 5.0) -> hvac.Client:
    """An hvac client for ``addr`` authenticated with ``token``."""
    import hvac

    return hvac.Client(url=addr, token=token, timeout=timeout)


def probe_vault(addr: str, token: str, timeout: float = 2.0) -> str:
    """Check Vault/OpenBao is initialised, unsealed and accepts the token; return its version."""
    import hvac.exceptions
    import requests

    client = vault_client(addr, token, timeout)
    try:
        health = client.sys.read_health_status(method="GET")
        if not isinstance(health, dict):
            code = getattr(health, "status_code", "?")
            raise ProbeError(f"sys/health returned HTTP {code} (sealed or standby)")
        if not client.is_authenticated():
            raise ProbeError("the token is not accepted")
    except requests.RequestException as exc:
        raise ProbeError(f"cannot connect: {exc.__class__.__name__}") from None
    except hvac.exceptions.VaultError as exc:
        raise ProbeError(f"vault answered {exc.__class__.__name__}") from None
    return str(health.get("version", "unknown"))
