"""What the signed requests outside the event stream share (remote sessions,
:mod:`dsec_core.remote`; code uploads, :mod:`dsec_core.codeupload`): MessagePack maps signed
with Ed25519 under a domain of their own (so a request signature is never valid as an event's or
as another protocol's), and the check of the user who signed one.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import blake3
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from dsec_core import canonical
from dsec_core.ids import canonical_uuid, new_event_id
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


@dataclass(frozen=True)
class Header:
    """What every signed request carries, read strictly (:func:`read_header`)."""

    id: str
    tenant: str
    producer: str
    key_id: str
    time: datetime
    reply_to: str
    client_key: bytes
    fields: dict[str, Any]
    hash: bytes
    """BLAKE3 of the request's bytes: every answer names it (:func:`request_hash`)."""


def sign_request(
    key: SigningKey,
    domain: bytes,
    *,
    tenant: str,
    producer: str,
    key_id: str,
    reply_to: str,
    client_key: bytes,
    now: datetime | None = None,
    **rest: Any,
) -> bytes:
    """A request's wire bytes: :class:`Header`'s fields (a fresh id, the time) and ``rest``,
    version 1, signed by ``key`` under ``domain``."""
    fields = {
        "v": 1, "id": new_event_id(), "tenant": tenant, "producer": producer,
        "key_id": key_id, "time": (now or datetime.now(UTC)).isoformat(),
        "reply_to": reply_to, "client_key": client_key, **rest,
    }  # fmt: skip
    return sign_fields(key, domain, fields)


def read_header(raw: dict[str, Any], data: bytes, error: type[RpcError]) -> Header:
    """The :class:`Header` of the request ``raw`` (unpacked from ``data``), each field of its
    type and bounded, the time with its zone, a 64-byte signature, an inbox to answer on;
    else ``error`` naming what is wrong."""
    if raw.get("v") != 1:
        raise error(f"a request of version {str(raw.get('v'))[:20]!r}; 1 is read")
    when = text(raw, "time", error, limit=64)
    try:
        stamp = datetime.fromisoformat(when)
    except ValueError:
        raise error("time must be an ISO 8601 time") from None
    if stamp.tzinfo is None:
        raise error("time must carry its zone")
    header = Header(
        id=request_id(raw, error),
        tenant=text(raw, "tenant", error, limit=64),
        producer=text(raw, "producer", error, limit=128),
        key_id=text(raw, "key_id", error, limit=64),
        time=stamp,
        reply_to=text(raw, "reply_to", error),
        client_key=blob(raw, "client_key", error, size=32),
        fields=raw,
        hash=request_hash(data),
    )
    blob(raw, "sig", error, size=64)
    if not header.reply_to.startswith(f"{INBOX}."):
        raise error("the reply subject must be an inbox")
    return header


def sign_answer(sign: Any, domain: bytes, body: dict[str, Any]) -> bytes:
    """An answer's wire bytes: ``body`` and its signature under ``domain`` (``sign(bytes) ->
    hex`` is the answering service's certified key)."""
    sig = bytes.fromhex(sign(domain + canonical.canonical_bytes(body)))
    return canonical.canonical_bytes({**body, "sig": sig})


def answer_signed(fields: dict[str, Any], domain: bytes, public_raw: bytes) -> bool:
    """Whether an answer's ``sig`` signs its other fields under ``domain`` for ``public_raw``
    (the signature's type was checked when it was read)."""
    body = {k: v for k, v in fields.items() if k != "sig"}
    try:
        VerifyKey(public_raw).verify(domain + canonical.canonical_bytes(body), fields["sig"])
    except (BadSignatureError, KeyError, ValueError, TypeError):
        return False
    return True


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
