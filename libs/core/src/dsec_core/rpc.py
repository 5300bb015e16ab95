"""What the signed requests outside the event stream share (remote sessions,
:mod:`dsec_core.remote`; code uploads, :mod:`dsec_core.codeupload`): MessagePack maps signed
with Ed25519 under a domain of their own (so a request signature is never valid as an event's or
as another protocol's), and the check of the user who signed one.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import blake3
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from dsec_core import canonical
from dsec_core.ids import canonical_uuid
from dsec_core.natsperms import INBOX, TABLE, USER


class RpcError(ValueError):
    """A message that is not what its protocol allows."""


def unpack_map(data: bytes, what: str, error: type[RpcError] = RpcError) -> dict[str, Any]:
    """The MessagePack map in ``data``; ``error`` naming ``what`` when it is none."""
    try:
        value = canonical.unpack(data)
    except Exception:  # msgpack raises several unrelated exception types
        raise error(f"{what} is not MessagePack") from None
    if not isinstance(value, dict):
        raise error(f"{what} must be a map")
    return value


def text(raw: dict[str, Any], name: str, error: type[RpcError], *, limit: int = 256) -> str:
    """Field ``name`` of a message: a string of at most ``limit`` characters and no control
    character (it may reach a log line), else ``error``. Never converted from another type:
    ``bytes(2**64)`` or ``str()`` of a huge value costs what an attacker chooses."""
    value = raw.get(name)
    if not isinstance(value, str) or len(value) > limit or not value.isprintable():
        raise error(f"{name} must be a printable string of at most {limit} characters")
    return value


def blob(raw: dict[str, Any], name: str, error: type[RpcError], *, size: int) -> bytes:
    """Field ``name`` of a message: exactly ``size`` bytes, else ``error``."""
    value = raw.get(name)
    if not isinstance(value, bytes) or len(value) != size:
        raise error(f"{name} must be {size} bytes")
    return value


def request_id(raw: dict[str, Any], error: type[RpcError]) -> str:
    """The ``id`` field: a canonical UUID (it is echoed in answers and logged)."""
    value = raw.get("id")
    if not isinstance(value, str) or not canonical_uuid(value):
        raise error("id must be a UUID")
    return value


def request_hash(data: bytes) -> bytes:
    """What an answer names its request by: the BLAKE3 of the request's exact bytes. A client
    believes only answers to the bytes it sent, so a copy of its request altered by someone else
    (answered ``bad-signature``, signed by the genuine service, on the client's inbox) cannot
    end it."""
    return blake3.blake3(data).digest()


def answerable(reply: str | None) -> bool:
    """Whether a service may answer on ``reply``: an inbox, and none of a service's own
    (``_INBOX.<identity>.…``): a request names the subject, and an answer must not land among a
    service's own replies."""
    if not reply or not reply.startswith(f"{INBOX}."):
        return False
    identity = reply.split(".", 2)[1]
    service = identity in TABLE and identity != USER  # a person's CLI: users and the operator
    return not (service or identity.startswith("nodeagent-"))


def sign_fields(key: SigningKey, domain: bytes, fields: dict[str, Any]) -> bytes:
    """The wire bytes of ``fields`` with their signature (``sig``) under ``domain``."""
    body = canonical.canonicalize(fields)
    sig = key.sign(domain + canonical.pack(body)).signature
    return canonical.pack({**body, "sig": sig})


def verify_fields(fields: dict[str, Any], domain: bytes, public_raw: bytes) -> bool:
    """Whether ``fields["sig"]`` signs the other fields under ``domain`` for ``public_raw``."""
    body = {k: v for k, v in fields.items() if k != "sig"}
    try:
        VerifyKey(public_raw).verify(domain + canonical.pack(body), bytes(fields["sig"]))
    except (BadSignatureError, KeyError, ValueError, TypeError):
        return False
    return True


async def user_refusal(
    keys: Any, key_id: str, producer: str, tenant: str, fields: dict[str, Any], domain: bytes,
    *, action: str,
) -> tuple[str, str] | None:  # fmt: skip
    """Why a request signed as ``producer`` (a user of ``tenant``) with ``key_id`` is refused,
    checked like an event (``keys``: the trust gate's key ring): a certificate from the
    operator root, not revoked, the signature, a *user* acting for its own tenant. ``action``
    says what the request asks (``"store code"``). None when the user may ask it."""
    cert = await keys.certificate(key_id)
    if isinstance(cert, str):
        return ("revoked-key" if "revoked" in cert else "unknown-key"), cert
    if not verify_fields(fields, domain, bytes.fromhex(cert.public_key)):
        return "bad-signature", f"signature invalid for key {key_id}"
    if cert.role != "user" or cert.subject != producer:
        return "unauthorized", f"only a user may {action}; key of {cert.subject!r} ({cert.role})"
    if cert.tenant != tenant:
        return "unauthorized", f"user of tenant {cert.tenant!r} may not {action} for {tenant!r}"
    return None


class RefusalLog:
    """Refusals logged one line per ``every_s`` at most, the line saying how many more there
    were (a flood of forged requests must not fill the log; count them in a metric)."""

    def __init__(self, logger: logging.Logger, what: str, every_s: float = 10.0) -> None:
        self.logger = logger
        self.what = what
        self.every_s = every_s
        self._last = -every_s
        self._held = 0

    def refused(self, rid: str, reason: str, detail: str) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self._held += 1
            return
        more, self._last, self._held = self._held, now, 0
        self.logger.warning(
            "%s %r refused: %s (%r)%s",
            self.what, rid[:80], reason[:64], detail[:200],
            f"; {more} more refused before" if more else "",
        )  # fmt: skip
