"""The one place that turns settings into ``nats.connect`` arguments (credentials and TLS).

Every NATS client of DSec (service runtime and its FastStream broker, CLI, node agent's KV and
IPC connections, test fixtures, benchmarks) builds its connection here, so a credential or TLS
setting works everywhere at once.

Credentials, first match wins:

1. ``user:password@`` in ``DSEC_NATS_URL`` (kept in the URL);
2. ``DSEC_NATS_CREDS`` — a ``.creds`` file (JWT + nkey seed; NATS operator mode);
3. ``DSEC_NATS_NKEY_SEED`` — a file holding an nkey seed (``SU...``);
4. ``DSEC_NATS_USER`` / ``DSEC_NATS_PASSWORD``;
5. with no ``DSEC_NATS_URL`` (the embedded stack): ``$DSEC_HOME/nats/user-default.nk``, the
   local tenant's credential written by ``dsec up``.

Replies: every connection uses its identity's inbox prefix (``_INBOX.<identity>``, the only
replies the server lets that identity subscribe to, :func:`dsec_core.natsperms.inbox_prefix`).
The identity is the credential's name: the user name, or the stem of an nkey seed / creds file
(``dsec nats credentials`` and the embedded stack write ``<identity>.nk``).

TLS: ``DSEC_NATS_TLS_CA`` (verify the server), ``DSEC_NATS_TLS_CERT`` + ``DSEC_NATS_TLS_KEY``
(client certificate).
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from dsec_core.settings import Settings

if TYPE_CHECKING:  # nats-py is imported when a connection is made: `dsec --help` stays fast
    from nats.aio.client import Client as NATS

CREDENTIALS_DIR = "nats"
DEFAULT_USER_IDENTITY = "user-default"


class NatsSettingsError(ValueError):
    """A NATS credential or TLS setting names a file that cannot be used."""


def credential_path(home: Path, identity: str) -> Path:
    """Where the embedded stack keeps ``identity``'s nkey seed (``$DSEC_HOME/nats/<id>.nk``)."""
    return home / CREDENTIALS_DIR / f"{identity}.nk"


def _readable(path: Path, var: str) -> str:
    if not path.is_file():
        raise NatsSettingsError(f"{var}={path}: no such file (expected a readable file)")
    return str(path)


def _url_has_user(url: str) -> bool:
    return any(urlsplit(u.strip()).username for u in url.split(","))


def credential_options(settings: Settings) -> dict[str, Any]:
    """The credential part of the connect arguments (see the module docstring for the order)."""
    url = settings.nats_endpoint()
    if _url_has_user(url):
        return {}
    if settings.nats_creds is not None:
        return {"user_credentials": _readable(settings.nats_creds, "DSEC_NATS_CREDS")}
    if settings.nats_nkey_seed is not None:
        return {"nkeys_seed": _readable(settings.nats_nkey_seed, "DSEC_NATS_NKEY_SEED")}
    if settings.nats_user is not None:
        password = settings.nats_password.get_secret_value() if settings.nats_password else ""
        return {"user": settings.nats_user, "password": password}
    if settings.nats_url is None:
        default = credential_path(settings.home, DEFAULT_USER_IDENTITY)
        if default.is_file():
            return {"nkeys_seed": str(default)}
    return {}


def identity_of(settings: Settings) -> str | None:
    """The NATS identity the settings connect as (its inbox prefix follows), or ``None`` when
    no credential names one (then nats-py's shared ``_INBOX`` prefix is used)."""
    url = settings.nats_endpoint()
    for u in url.split(","):
        name = urlsplit(u.strip()).username
        if name:
            return name
    creds = credential_options(settings)
    if "user" in creds:
        return str(creds["user"])
    for key in ("nkeys_seed", "user_credentials"):
        if key in creds:
            return Path(creds[key]).stem
    return None


def inbox_options(settings: Settings) -> dict[str, Any]:
    """``{"inbox_prefix": "_INBOX.<identity>"}`` for the settings' identity (empty when none)."""
    from dsec_core.natsperms import inbox_prefix

    identity = identity_of(settings)
    if identity is None:
        return {}
    try:
        return {"inbox_prefix": inbox_prefix(identity)}
    except ValueError:
        return {}


def tls_context(settings: Settings) -> ssl.SSLContext | None:
    """The TLS context from ``DSEC_NATS_TLS_*``, or ``None`` when none is set."""
    ca, cert, key = settings.nats_tls_ca, settings.nats_tls_cert, settings.nats_tls_key
    if ca is None and cert is None and key is None:
        return None
    if (cert is None) != (key is None):
        raise NatsSettingsError(
            "DSEC_NATS_TLS_CERT and DSEC_NATS_TLS_KEY go together: set both or neither"
        )
    ctx = ssl.create_default_context(
        cafile=_readable(ca, "DSEC_NATS_TLS_CA") if ca is not None else None
    )
    if cert is not None and key is not None:
        cert_file = _readable(cert, "DSEC_NATS_TLS_CERT")
        ctx.load_cert_chain(cert_file, _readable(key, "DSEC_NATS_TLS_KEY"))
    return ctx


def auth_options(settings: Settings) -> dict[str, Any]:
    """Only the credential, TLS and inbox arguments (for a client that already has its URL)."""
    opts = credential_options(settings)
    opts.update(inbox_options(settings))
    ctx = tls_context(settings)
    if ctx is not None:
        opts["tls"] = ctx
    return opts


def nats_options(settings: Settings, *, name: str, **overrides: Any) -> dict[str, Any]:
    """Keyword arguments for ``nats.connect`` (and FastStream's ``NatsBroker``): servers, name,
    credentials, TLS; ``overrides`` (reconnect policy, timeouts) win.

    Raises:
        NatsSettingsError: a credential or TLS file is missing, or cert/key are not paired.
    """
    opts: dict[str, Any] = {"servers": settings.nats_endpoint().split(","), "name": name}
    opts.update(auth_options(settings))
    opts.update(overrides)
    return opts


async def connect(
    settings: Settings, name: str, *, fail_fast: bool = False, **overrides: Any
) -> NATS:
    """``nats.connect`` with :func:`nats_options`.

    ``fail_fast`` (commands a person waits on): a URL that is no NATS URL raises
    :class:`NatsSettingsError`, and when no server of it can be reached at all (each refuses
    the TCP connection, or names a host that does not exist: the stack is down, a typo)
    ``ConnectionRefusedError`` says which, at once instead of after nats-py's reconnect
    attempts (seconds). A server that answers, or does not answer in time, is left to nats-py
    as before."""
    import nats

    options = nats_options(settings, name=name, **overrides)
    if fail_fast:
        why = await refused_everywhere(settings.nats_endpoint())
        if why:
            raise ConnectionRefusedError(why)
    return await nats.connect(**options)


_DEFAULT_PORTS = {"ws": 80, "wss": 443}


def _address(server: str) -> tuple[str, int]:
    """``(host, port)`` of one server of a NATS URL, as nats-py reads it (a bare ``host:port``
    is ``nats://``; WebSocket URLs without a port are the web ports)."""
    server = server.strip()
    parts = urlsplit(server if "://" in server else f"nats://{server}")
    shown = f"{parts.scheme}://{parts.netloc.rpartition('@')[2]}"  # never the credentials
    try:
        port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 4222)
    except ValueError as exc:
        raise NatsSettingsError(f"DSEC_NATS_URL: {shown!r}: {exc}") from None
    if not parts.hostname:
        raise NatsSettingsError(f"DSEC_NATS_URL: {shown!r} names no host")
    return parts.hostname, port


async def refused_everywhere(url: str, timeout_s: float = 1.0) -> str | None:
    """Why no server of a NATS URL (comma-separated) can be reached, when each refuses a TCP
    connection or names a host that does not exist; ``None`` when one might answer.

    Raises:
        NatsSettingsError: a server is no ``[scheme://][user:pass@]host[:port]``.
    """
    import asyncio
    import socket

    async def why(server: str) -> str | None:
        host, port = _address(server)
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
        except ConnectionRefusedError:
            return f"nothing listens at {host}:{port}"
        except socket.gaierror as exc:
            if exc.errno == socket.EAI_NONAME:
                return f"no such host {host!r}"
            return None  # DNS failing now: nats-py says so, as before
        except (OSError, TimeoutError):
            return None  # unreachable in another way: nats-py says so, as before
        writer.close()
        return None

    servers = [u for u in url.split(",") if u.strip()]
    reasons = await asyncio.gather(*(why(u) for u in servers))
    if not servers or None in reasons:
        return None
    return "; ".join(r for r in reasons if r)


def broker_options(settings: Settings, *, name: str, **overrides: Any) -> dict[str, Any]:
    """:func:`nats_options` in the shape FastStream's ``NatsBroker`` takes (credentials and TLS
    as its ``security=`` object)."""
    from faststream.nats.security import (
        NatsCredentials,
        NatsNKey,
        NatsSecurity,
        NatsUserPassword,
    )

    opts = nats_options(settings, name=name, **overrides)
    ctx = opts.pop("tls", None)
    security: NatsSecurity | None = None
    if "user_credentials" in opts:
        security = NatsCredentials.from_file(opts.pop("user_credentials"), ssl_context=ctx)
    elif "nkeys_seed" in opts:
        security = NatsNKey.from_file(opts.pop("nkeys_seed"), ssl_context=ctx)
    elif "user" in opts:
        security = NatsUserPassword(opts.pop("user"), opts.pop("password"), ssl_context=ctx)
    elif ctx is not None:
        security = NatsSecurity(ssl_context=ctx)
    if security is not None:
        opts["security"] = security
    return opts
