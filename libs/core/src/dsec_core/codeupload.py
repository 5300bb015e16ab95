"""Code uploads without object-store credentials: the wire protocol between the client (``dsec
submit --code``, :meth:`dsec_client.Client.submit`) and the policy service, over core NATS
(outside the audited ``dsec.>`` stream).

Users hold no credentials of the object store: with the stack's, any tenant could read (or
copy to its own prefix) every other tenant's bundles, snapshots and caches in the system
bucket. Instead, for each bundle:

1. The client signs an **upload request** with its certified user key: ``{v, id, tenant,
   producer, key_id, time, reply_to, client_key, digest, size}``, Ed25519 over
   ``REQUEST_DOMAIN + canonical MessagePack`` (a domain of its own: a request signature is
   never valid as an event's or a remote session's). ``client_key`` is a fresh X25519 public
   key, ``reply_to`` the request's inbox, ``digest`` the bundle's BLAKE3 and ``size`` its exact
   length. Published to :data:`SUBJECT`.
2. A policy service instance (one of a queue group) checks it like an event: the key's
   certificate from the operator root, not revoked, a ``user`` of the request's tenant (not a
   reserved one), the signature, the replay window. It answers on ``reply_to`` with a **grant**
   signed by its own certified key: an S3 POST policy (SigV4) for exactly
   ``bundles/<tenant>/<digest>.tar.zst`` and exactly ``size`` bytes, valid :data:`GRANT_S`,
   encrypted (NaCl ``Box``, X25519 + XSalsa20-Poly1305) to ``client_key``; or a signed
   **refusal** saying why.
3. The client checks the answer is signed by a certified ``policy`` key, decrypts the grant and
   POSTs the bundle to the object store with it. The store refuses any other key or length.

What a grant cannot do: write another tenant's prefix, another key, another length, or anything
after it expires. Its bytes are not bound by it (S3 has no such condition); every reader checks
a bundle against its BLAKE3 (``objectstore.get_bundle``), so an object written under a digest
it does not match is refused, never run.

Everything here is pure (no I/O); the service's side is ``dsec_policy.uploads``, the client's
``dsec_client.code``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal

from nacl.exceptions import CryptoError
from nacl.public import Box, PrivateKey, PublicKey
from nacl.signing import SigningKey

from dsec_core import canonical, rpc
from dsec_core.codebundle import MAX_SIZE_LIMIT
from dsec_core.natsperms import CODE_UPLOADS

SUBJECT = CODE_UPLOADS
"""Where clients publish upload requests (the policy service's instances share them)."""
QUEUE = "policy-code-upload"
"""The policy service's queue group on :data:`SUBJECT`: one instance answers each request."""
REQUEST_DOMAIN = b"dsec-rpc/1 code upload request\n"
ANSWER_DOMAIN = b"dsec-rpc/1 code upload answer\n"
WINDOW_S = 30.0
"""A request dated further from the service's clock is refused (``stale`` / ``future``)."""
ANSWER_S = 10.0
"""How long a client waits for an answer."""
GRANT_S = 600
"""How long a grant lets its holder upload (seconds)."""
MAX_BYTES = MAX_SIZE_LIMIT
"""The largest bundle a grant is given for (the largest ``include_code.max_size``)."""

_DIGEST = re.compile(r"^[0-9a-f]{64}\Z")


class UploadError(rpc.RpcError):
    """A message that is not what the protocol allows (malformed or forged)."""


@dataclass(frozen=True)
class UploadRequest(rpc.Header):
    """A request of the right shape (its signature is checked by :func:`verify_request`)."""

    digest: str
    size: int


@dataclass(frozen=True)
class Grant:
    """What the client POSTs with: ``fields`` (the signed POST policy's form fields, ``key``
    included) to ``url`` (the bucket's address), the bundle as the form's ``file``."""

    url: str
    fields: dict[str, str]
    object_key: str
    expires: datetime

    def as_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "fields": dict(self.fields),
            "object_key": self.object_key,
            "expires": self.expires.isoformat(),
        }


def sign_request(
    key: SigningKey,
    *,
    tenant: str,
    producer: str,
    key_id: str,
    reply_to: str,
    client_key: bytes,
    digest: str,
    size: int,
    now: datetime | None = None,
) -> bytes:
    """The wire bytes of a signed upload request."""
    return rpc.sign_request(
        key, REQUEST_DOMAIN, tenant=tenant, producer=producer, key_id=key_id,
        reply_to=reply_to, client_key=client_key, now=now, digest=digest, size=size,
    )  # fmt: skip


def _unpack_map(data: bytes, what: str) -> dict[str, Any]:
    return rpc.unpack_map(data, what, UploadError)


def parse_request(data: bytes) -> UploadRequest:
    """The request in ``data`` (shape only), or :class:`UploadError` naming what is wrong. Each
    field must already be of its type (nothing is converted: a huge integer where bytes belong
    costs what its sender chooses)."""
    raw = _unpack_map(data, "request")
    header = rpc.read_header(raw, data, UploadError)
    digest = rpc.text(raw, "digest", UploadError, limit=64)
    if not _DIGEST.match(digest):
        raise UploadError("digest must be a BLAKE3 digest: 64 lowercase hex digits")
    size = raw.get("size")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= MAX_BYTES:
        raise UploadError(f"size must be a whole number of bytes from 1 to {MAX_BYTES}")
    return UploadRequest(**vars(header), digest=digest, size=size)


def verify_request(request: UploadRequest, public_raw: bytes) -> bool:
    """Whether the request's signature holds for ``public_raw``."""
    return rpc.verify_fields(request.fields, REQUEST_DOMAIN, public_raw)


def grant(sign: Any, key_id: str, request: UploadRequest, granted: Grant) -> bytes:
    """The signed answer carrying ``granted``, encrypted to the request's client key.
    ``sign(bytes) -> hex signature`` is the policy service's certified key."""
    service_key = PrivateKey.generate()
    box = Box(service_key, PublicKey(request.client_key))
    sealed = bytes(box.encrypt(canonical.canonical_bytes(granted.as_dict())))
    body = {
        "k": "grant",
        "rid": request.id,
        "rh": request.hash,
        "key_id": key_id,
        "client_key": request.client_key,
        "service_key": bytes(service_key.public_key),
        "box": sealed,
    }
    return rpc.sign_answer(sign, ANSWER_DOMAIN, body)


def refusal(sign: Any, key_id: str, rid: str, rh: bytes, reason: str, detail: str) -> bytes:
    """A signed refusal of the request of id ``rid`` whose bytes hash to ``rh`` (plaintext: it
    says only why)."""
    body = {"k": "refused", "rid": rid, "rh": rh, "reason": reason, "detail": detail[:500]}
    return rpc.sign_answer(sign, ANSWER_DOMAIN, {**body, "key_id": key_id})


@dataclass(frozen=True)
class Answer:
    """An answer as the client reads it (signature not yet checked)."""

    kind: Literal["grant", "refused"]
    key_id: str
    fields: dict[str, Any]

    def check(
        self, public_raw: bytes, rid: str, rh: bytes, client: PrivateKey
    ) -> Grant | tuple[str, str]:
        """The grant, or ``(reason, detail)`` for a refusal, once the signature holds for
        ``public_raw`` and the answer is to the request of id ``rid`` whose bytes hash to ``rh``
        (:class:`UploadError` otherwise): an answer to an altered copy of the request is not
        one to it."""
        body = {k: v for k, v in self.fields.items() if k != "sig"}
        if not rpc.answer_signed(self.fields, ANSWER_DOMAIN, public_raw):
            raise UploadError("the answer is not signed by the key it names")
        if body.get("rid") != rid or body.get("rh") != rh:
            raise UploadError("an answer to another request")
        if self.kind == "refused":
            return str(body.get("reason"))[:64], str(body.get("detail"))[:500]
        if body.get("client_key") != bytes(client.public_key):
            raise UploadError("a grant for another client key")
        try:
            plain = Box(client, PublicKey(body["service_key"])).decrypt(body["box"])
            raw = _unpack_map(plain, "grant")
            fields = raw["fields"]
            granted = Grant(
                url=rpc.text(raw, "url", UploadError),
                fields={str(k): str(v) for k, v in fields.items()},
                object_key=rpc.text(raw, "object_key", UploadError),
                expires=datetime.fromisoformat(rpc.text(raw, "expires", UploadError, limit=64)),
            )
        except (CryptoError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UploadError(f"a grant that does not open: {type(exc).__name__}") from None
        if granted.fields.get("key") != granted.object_key:
            raise UploadError("a grant whose form does not name its object")
        return granted


def parse_answer(data: bytes) -> Answer:
    """The service's answer (grant or refusal), shape only: each field of its type, so checking
    it converts nothing an attacker sized."""
    raw = _unpack_map(data, "answer")
    kind = raw.get("k")
    if kind not in ("grant", "refused"):
        raise UploadError("an answer must be a grant or a refusal")
    key_id = rpc.text(raw, "key_id", UploadError, limit=64)
    rpc.blob(raw, "sig", UploadError, size=64)
    rpc.blob(raw, "rh", UploadError, size=32)
    if kind == "grant":
        rpc.blob(raw, "client_key", UploadError, size=32)
        rpc.blob(raw, "service_key", UploadError, size=32)
        if not isinstance(raw.get("box"), bytes) or len(raw["box"]) > 64 * 1024:
            raise UploadError("box must be at most 64 KiB of bytes")
    return Answer(kind, key_id, raw)


__all__ = [
    "ANSWER_S",
    "GRANT_S",
    "MAX_BYTES",
    "QUEUE",
    "SUBJECT",
    "WINDOW_S",
    "Answer",
    "Grant",
    "UploadError",
    "UploadRequest",
    "grant",
    "parse_answer",
    "parse_request",
    "refusal",
    "sign_request",
    "verify_request",
]
