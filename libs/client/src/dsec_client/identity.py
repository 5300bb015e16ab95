"""Who the client signs as: the user's certified key, found as ``dsec`` finds it."""

from __future__ import annotations

import getpass
import os
import socket
from typing import Any

from dsec_core import identity
from dsec_core.settings import Settings

from dsec_client.errors import ConfigError


def submitter() -> str:
    """``user@host`` of the person running the client (recorded in requests)."""
    return f"{getpass.getuser()}@{socket.gethostname()}"


def user_identity(settings: Settings) -> tuple[Any, Any, str | None]:
    """This machine's user key, its certificate, and a note to tell the user (or ``None``).

    In order: ``DSEC_CREDENTIAL`` (a credential file the operator issued); the identity saved by
    ``dsec login`` in ``$DSEC_HOME/identity``; on the operator's own machine (the root key of the
    embedded stack is readable), a first use logs in as the local user in tenant ``default``,
    and the note says so.

    Raises:
        ConfigError: none of these is usable (the message says what to run).
    """
    paths = identity.TrustPaths(settings.home)
    if settings.credential is not None:
        try:
            key, cert = identity.load_credential(settings.credential.read_text())
        except OSError as exc:
            raise ConfigError(f"DSEC_CREDENTIAL {settings.credential}: {exc.strerror}") from None
        except identity.CertificateError as exc:
            raise ConfigError(f"DSEC_CREDENTIAL {settings.credential}: {exc}") from None
        return key, cert, None
    if paths.user_key.exists() and paths.user_cert.exists():
        try:
            key, cert = identity.load_user(paths)
        except identity.CertificateError as exc:
            raise ConfigError(
                f"your identity is unusable ({exc}); run `dsec login` again"
            ) from None
        return key, cert, None
    if os.access(paths.root_key, os.R_OK):
        key, cert = identity.issue_user(
            identity.ensure_root(paths), getpass.getuser(), identity.DEFAULT_TENANT
        )
        identity.save_identity(paths, key, cert)
        note = (
            f"logged in as {cert.subject} (tenant {cert.tenant}) with the local operator's root "
            "key; `dsec login` chooses another user or tenant"
        )
        return key, cert, note
    raise ConfigError(
        "no identity on this machine: run `dsec login --credential FILE` with the credential "
        "your operator issued (`dsec admin issue-user`)"
    )


def trust_anchor(settings: Settings) -> bytes | None:
    """The operator root's public key (``DSEC_TRUST_ROOT`` or the one ``dsec login`` saved),
    or ``None`` when none is known here.

    Raises:
        ConfigError: the configured root is unreadable or malformed.
    """
    try:
        return identity.read_anchor(identity.TrustPaths(settings.home), settings.trust_root)
    except identity.CertificateError as exc:
        raise ConfigError(str(exc)) from None
