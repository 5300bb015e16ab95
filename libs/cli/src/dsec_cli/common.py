"""Shared CLI plumbing: settings, bus connection with clear errors, output helpers."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

import typer
from dsec_core.text import escape_controls
from rich.console import Console
from rich.markup import escape

if TYPE_CHECKING:  # imported when a command needs them: `dsec --help` stays fast
    from dsec_client import DSec
    from dsec_core.bus import EventPublisher
    from dsec_core.settings import Settings
    from nats.aio.client import Client as NATS
    from nats.js import JetStreamContext

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_UNREACHABLE = 3
EXIT_TIMEOUT = 4

console = Console()
err_console = Console(stderr=True)

T = TypeVar("T")


def safe_text(value: object) -> str:
    """Text from an event, a file name, a log or the read models, safe to print with rich:
    control characters (ANSI escapes, newlines, ``\\r``, other C0/C1, bidi overrides) shown as
    escapes, and rich markup (``[bold]``) printed literally. Use it for everything a sandbox or
    another producer could have written."""
    return escape(escape_controls(str(value)))


def plain_text(value: object) -> str:
    """:func:`safe_text` for output that is not rich markup (``markup=False``, plain ``print``)."""
    return escape_controls(str(value))


def safe_lines(text: str, *, markup: bool = True) -> str:
    """Multi-line text (a diff, a list): each line escaped as :func:`safe_text`, the line
    breaks kept."""
    joined = "\n".join(escape_controls(line) for line in text.split("\n"))
    return escape(joined) if markup else joined


#: The ``code`` of a JSON error for each exit code.
ERROR_CODES = {
    EXIT_FAILED: "failed",
    EXIT_BAD_INPUT: "bad_input",
    EXIT_UNREACHABLE: "unreachable",
    EXIT_TIMEOUT: "timeout",
}

#: Set by the root command when the command line has ``--json``: errors are then one JSON
#: object on stdout (where the command's JSON goes) instead of a line on stderr.
json_errors = False


def json_error(message: str, code: int) -> None:
    """Print ``{"error": {"code", "exit_code", "message"}}`` on stdout (one line)."""
    print_json(
        {"error": {"code": ERROR_CODES.get(code, "error"), "exit_code": code, "message": message}}
    )


def fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    """Print ``message`` to stderr (as a JSON error on stdout with ``--json``) and exit with
    ``code``."""
    if json_errors:
        json_error(message, code)
    else:
        err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def spinner(text: str) -> Iterator[Callable[[str], None]]:
    """A spinner with ``text`` on stderr while a long wait lasts (a build, a snapshot), only
    when stdout and stderr are a terminal (while it spins, rich shows stdout above it: a
    redirected stdout must not end up there) and never with ``--json``; yields a function that
    changes the text."""
    if json_errors or not (err_console.is_terminal and console.is_terminal):
        yield lambda _: None
        return
    with err_console.status(safe_text(text)) as status:
        yield lambda new: status.update(safe_text(new))


def confirm(action: str, yes: bool) -> None:
    """Ask before a destructive ``action`` (``"delete 3 snapshots"``) unless ``--yes``; without
    a terminal to ask on (a script, ``--json``), refuse with exit 2 and say to pass ``--yes``."""
    if yes:
        return
    if not sys.stdin.isatty():
        fail(
            f"refusing to {action} without confirmation: pass --yes (stdin is not a terminal)",
            EXIT_BAD_INPUT,
        )
    if not typer.confirm(f"{action}?", default=False, err=True):
        fail(f"not confirmed: did not {action}", EXIT_FAILED)


def check_event_types(types: list[str]) -> None:
    """Exit 2 naming the valid types when a ``--type`` is not an event type."""
    from dsec_core.events import EVENT_TYPES

    for t in types:
        if t not in EVENT_TYPES:
            fail(
                f"--type {t!r} is not an event type; valid: {', '.join(sorted(EVENT_TYPES))}",
                EXIT_BAD_INPUT,
            )


def run(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine from a synchronous Typer command."""
    import asyncio

    return asyncio.run(coro)


def print_json(value: Any) -> None:
    """Print one JSON document on one line (machine-readable output)."""
    print(json.dumps(value, default=str, separators=(",", ":")), flush=True)


def without_credentials(url: str) -> str:
    """``url`` with any ``user:password@`` (or ``token@``) part removed, for messages."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    return f"{scheme}://{rest.rpartition('@')[2]}"


def submitter() -> str:
    """``user@host`` of the person running the CLI."""
    import getpass
    import socket

    return f"{getpass.getuser()}@{socket.gethostname()}"


@asynccontextmanager
async def bus(
    settings: Settings | None = None, *, check_stream: bool = True
) -> AsyncIterator[tuple[NATS, JetStreamContext]]:
    """Connect to NATS as this user (:mod:`dsec_core.natsclient`), or exit 3 with a message
    that says what to do. The stream is checked, never changed (only the operator may)."""
    from dsec_core.bus import EventTooLarge, StreamWeakened, require_stream
    from dsec_core.natsclient import NatsSettingsError, connect
    from dsec_core.settings import Settings

    settings = settings or Settings()
    url = settings.nats_endpoint()

    async def _quiet(exc: Exception) -> None:
        """nats-py prints a traceback for each failed attempt; the user gets one line below."""

    try:
        nc = await connect(
            settings,
            "dsec-cli",
            fail_fast=True,
            connect_timeout=3,
            max_reconnect_attempts=3,
            allow_reconnect=True,
            error_cb=_quiet,
        )
    except NatsSettingsError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    except Exception as exc:  # any connect failure means "unreachable" to the user
        # a refusal names where (fail_fast); nats-py's errors say little beyond their kind
        reason = (
            str(exc)
            if isinstance(exc, ConnectionRefusedError) or "authorization" in str(exc).lower()
            else type(exc).__name__
        )
        fail(
            f"cannot reach NATS at {without_credentials(url)} ({reason}); "
            "start the stack with `dsec up` or set DSEC_NATS_URL (and its credentials: "
            "DSEC_NATS_CREDS, DSEC_NATS_NKEY_SEED or DSEC_NATS_USER/PASSWORD)",
            EXIT_UNREACHABLE,
        )
    try:
        js = nc.jetstream()
        try:
            if check_stream:
                await require_stream(js)
        except StreamWeakened as exc:
            if "does not exist" in str(exc):
                fail(str(exc), EXIT_UNREACHABLE)
            err_console.print(f"[bold yellow]warning:[/] {escape(str(exc))}", highlight=False)
        yield nc, js
    except EventTooLarge as exc:
        # Every CLI publish goes through here: bad input (too big an event), not a crash.
        fail(
            f"{exc}; nothing was published. Make it smaller (code goes in the bundle)",
            EXIT_BAD_INPUT,
        )
    finally:
        await nc.close()


@asynccontextmanager
async def client(settings: Settings | None = None) -> AsyncIterator[DSec]:
    """The Python client (:class:`dsec_client.DSec`) connected as this user: the CLI's commands
    are built on it; its errors (:class:`dsec_client.DSecError`) become a one-line message and
    the exit code of their class, its warnings go to stderr."""
    from dsec_client import DSec, DSecError

    def warn(message: str) -> None:
        err_console.print(f"[bold yellow]warning:[/] {escape(message)}", highlight=False)

    try:
        async with DSec(settings, on_warning=warn, name="dsec-cli") as d:
            yield d
    except DSecError as exc:
        fail(str(exc), exc.EXIT)


def operator_root() -> Any:
    """The operator root key of this stack, or exit 2 (only the operator may do this)."""
    from dsec_core import identity
    from dsec_core.settings import Settings

    paths = identity.TrustPaths(Settings().home)
    if not os.access(paths.root_key, os.R_OK):
        fail(
            f"only the operator can do this: the root key {paths.root_key} is not readable here",
            EXIT_BAD_INPUT,
        )
    return identity.ensure_root(paths)


def operator_identity() -> tuple[Any, Any]:
    """The operator's signing key and its root-issued certificate (role ``operator``)."""
    from dsec_core import identity
    from dsec_core.settings import Settings
    from dsec_core.signing import load_or_create_key

    root = operator_root()
    paths = identity.TrustPaths(Settings().home)
    key = load_or_create_key(paths.key("operator"))
    try:
        cert = identity.read_cert(paths.cert("operator"))
        identity.check(cert, bytes(root.verify_key))
        if cert.public_key == bytes(key.verify_key).hex():
            return key, cert
    except identity.CertificateError:
        pass
    cert = identity.issue(root, bytes(key.verify_key), subject="operator", role="operator")
    identity.write_cert(paths.cert("operator"), cert)
    return key, cert


def user_identity(settings: Settings | None = None) -> tuple[Any, Any]:
    """This machine's user key and its certificate (``dsec login``), or exit 2 saying how
    (:func:`dsec_client.identity.user_identity`: on the operator's own machine a first use logs
    in as the local user in tenant ``default``, and says so)."""
    from dsec_client.errors import ConfigError
    from dsec_client.identity import user_identity as load
    from dsec_core.settings import Settings

    try:
        key, cert, note = load(settings or Settings())
    except ConfigError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    if note:
        err_console.print(escape(note), highlight=False)
    return key, cert


def cli_gate(nc: NATS, js: JetStreamContext) -> Any:
    """A trust gate for what the CLI follows (only authentic events count), or ``None`` when
    no trust root is known here (then events are shown as they come)."""
    from dsec_core import identity
    from dsec_core.settings import Settings
    from dsec_core.trust import Gate, KeyRing

    settings = Settings()
    try:
        anchor = identity.read_anchor(identity.TrustPaths(settings.home), settings.trust_root)
    except identity.CertificateError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    if anchor is None:
        err_console.print(
            "[bold yellow]warning:[/] no trust root known here (DSEC_TRUST_ROOT, or `dsec login "
            "--credential FILE`): events are shown as they come, unverified",
            highlight=False,
        )
        return None
    return Gate(KeyRing(nc, js, anchor), js, None)


async def cli_publisher(js: JetStreamContext, settings: Settings | None = None) -> EventPublisher:
    """A publisher signing as the logged-in user (``user-<name>``, its tenant from the
    operator-issued certificate, never from a spec)."""
    from dsec_core.bus import EventPublisher
    from dsec_core.signing import Signer

    key, cert = user_identity(settings)
    signer = Signer(cert.subject, key, tenant=cert.tenant)
    publisher = EventPublisher(js, signer, certificate=cert)
    await publisher.register_key()
    return publisher


def parse_since(value: str) -> datetime:
    """Parse ``--since``: an ISO time (``2026-11-30T10:00``) or an age like ``15m``, ``2h``."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    if value and value[-1] in units and value[:-1].isdigit():
        return datetime.now(UTC) - timedelta(seconds=int(value[:-1]) * units[value[-1]])
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise typer.BadParameter(
            f"{value!r} is not a time: use ISO 8601 (2026-11-30T10:00) or an age (30s, 15m, 2h, 1d)"
        ) from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def read_refused() -> NoReturn:
    """Exit 3: the read role may not read a read model (its grant comes with the projector)."""
    fail(
        "the read-only role may not read the read models yet (the scheduler grants them as it "
        "creates them): run `dsec up` again, or ask your operator to grant SELECT to dsec_reader",
        EXIT_UNREACHABLE,
    )


def s3_client(settings: Settings | None = None) -> Any:
    """A ``minio.Minio`` client for the configured object store, or exit 3 when unset."""
    from dsec_core import objectstore  # imported lazily: most commands never touch S3
    from dsec_core.settings import Settings

    try:
        return objectstore.client(settings or Settings())
    except objectstore.ObjectStoreNotConfigured as exc:
        fail(str(exc), EXIT_UNREACHABLE)


async def pg_connect(settings: Settings | None = None) -> Any:
    """A read-only asyncpg connection to the read models, or exit 3 with what to do: as the
    read-only role (``DSEC_POSTGRES_READ_DSN``, which `dsec up` records) where one is set, else
    with the stack's own DSN, and in both cases every transaction read-only."""
    import asyncpg
    from dsec_core.settings import Settings

    settings = settings or Settings()
    # what the environment names comes first (a DSN set there is never traded for stack.json's)
    stack = settings.stack_state
    source, dsn = next(
        (
            (name, value)
            for name, value in (
                ("DSEC_POSTGRES_READ_DSN", settings.postgres_read_dsn),
                ("DSEC_POSTGRES_DSN", settings.postgres_dsn),
                ("stack.json's postgres_read_dsn", stack.get("postgres_read_dsn")),
                ("stack.json's postgres_dsn", stack.get("postgres_dsn")),
            )
            if value
        ),
        ("", None),
    )
    if not dsn:
        fail(
            "no PostgreSQL configured: run `dsec up`, or set DSEC_POSTGRES_READ_DSN (the "
            "read-only role's DSN your operator gives you)",
            EXIT_UNREACHABLE,
        )
    try:
        return await asyncpg.connect(
            str(dsn),
            timeout=5,
            server_settings={"default_transaction_read_only": "on", "statement_timeout": "30s"},
        )
    except ValueError:  # (asyncpg's ClientConfigurationError is one; the DSN is never shown)
        fail(
            f"{source} is not a PostgreSQL DSN: expected postgresql://USER:PASSWORD@HOST:PORT/DB",
            EXIT_BAD_INPUT,
        )
    except asyncpg.InvalidAuthorizationSpecificationError:
        fail(
            f"PostgreSQL refused the login of {source}: a wrong user or password? (`dsec up` "
            "sets the read-only role's password again)",
            EXIT_UNREACHABLE,
        )
    except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
        fail(
            f"cannot reach PostgreSQL ({type(exc).__name__}); is the stack up? (`dsec status`)",
            EXIT_UNREACHABLE,
        )
