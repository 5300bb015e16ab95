"""The code-upload protocol (pure): what a request must hold, and what a client believes."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from dsec_core import canonical, codeupload
from dsec_core.codeupload import Grant, UploadError
from nacl.public import PrivateKey
from nacl.signing import SigningKey

DIGEST = "ab" * 32


def _request(key: SigningKey, client: PrivateKey, **over: Any) -> bytes:
    fields: dict[str, Any] = {
        "tenant": "acme",
        "producer": "alice",
        "key_id": "k1",
        "reply_to": "_INBOX.user-acme.x",
        "client_key": bytes(client.public_key),
        "digest": DIGEST,
        "size": 100,
    }
    fields.update(over)
    return codeupload.sign_request(key, **fields)


def _signer(key: SigningKey) -> Any:
    return lambda data: key.sign(data).signature.hex()


GRANT = Grant(
    url="http://127.0.0.1:8333/dsec",
    fields={"key": f"bundles/acme/{DIGEST}.tar.zst", "policy": "cG9saWN5", "x-amz-signature": "s"},
    object_key=f"bundles/acme/{DIGEST}.tar.zst",
    expires=datetime.now(UTC) + timedelta(minutes=10),
)


def test_a_signed_request_verifies_and_any_change_breaks_it() -> None:
    key, client = SigningKey.generate(), PrivateKey.generate()
    request = codeupload.parse_request(_request(key, client))
    assert request.tenant == "acme" and request.size == 100 and request.digest == DIGEST
    assert codeupload.verify_request(request, bytes(key.verify_key))
    assert not codeupload.verify_request(request, bytes(SigningKey.generate().verify_key))
    for field, value in (("tenant", "victim"), ("size", 4096), ("digest", "cd" * 32)):
        raw = canonical.unpack(_request(key, client))
        raw[field] = value
        assert not codeupload.verify_request(
            codeupload.parse_request(canonical.pack(raw)), bytes(key.verify_key)
        ), field


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"digest": "AB" * 32}, "BLAKE3"),
        ({"digest": "../" * 10}, "BLAKE3"),
        ({"size": 0}, "size"),
        ({"size": codeupload.MAX_BYTES + 1}, "size"),
        ({"size": True}, "size"),
        ({"size": 1.5}, "size"),
        ({"reply_to": "dsec.sandbox.x"}, "inbox"),
        ({"client_key": b"short"}, "32 bytes"),
    ],
)
def test_a_request_out_of_shape_is_malformed(over: dict[str, Any], needle: str) -> None:
    data = _request(SigningKey.generate(), PrivateKey.generate(), **over)
    with pytest.raises(UploadError, match=needle):
        codeupload.parse_request(data)


def test_garbage_and_unsigned_requests_are_malformed() -> None:
    for data in (b"", b"\xc1", canonical.pack([1, 2]), canonical.pack({"v": 1})):
        with pytest.raises(UploadError):
            codeupload.parse_request(data)
    raw = canonical.unpack(_request(SigningKey.generate(), PrivateKey.generate()))
    del raw["sig"]
    with pytest.raises(UploadError, match="sig must be 64 bytes"):
        codeupload.parse_request(canonical.pack(raw))
    raw = canonical.unpack(_request(SigningKey.generate(), PrivateKey.generate()))
    raw["v"] = 2
    with pytest.raises(UploadError, match="version"):
        codeupload.parse_request(canonical.pack(raw))


def test_only_the_requesting_client_opens_its_grant() -> None:
    user, service = SigningKey.generate(), SigningKey.generate()
    client = PrivateKey.generate()
    request = codeupload.parse_request(_request(user, client))
    answer = codeupload.parse_answer(codeupload.grant(_signer(service), "svc", request, GRANT))
    granted = answer.check(bytes(service.verify_key), request.id, request.hash, client)
    assert granted == GRANT
    # the form is sealed: its fields are not in the answer's bytes
    assert b"cG9saWN5" not in canonical.canonical_bytes(answer.fields)
    # another client (an eavesdropper with a key of its own) cannot open it
    with pytest.raises(UploadError):
        answer.check(bytes(service.verify_key), request.id, request.hash, PrivateKey.generate())
    # an answer to another request, or checked against another key, is not believed
    with pytest.raises(UploadError, match="another request"):
        answer.check(bytes(service.verify_key), "other-id", request.hash, client)
    with pytest.raises(UploadError, match="not signed"):
        answer.check(bytes(user.verify_key), request.id, request.hash, client)


def test_a_refusal_is_signed_and_says_why() -> None:
    service = SigningKey.generate()
    rh = b"h" * 32
    data = codeupload.refusal(_signer(service), "svc", "r1", rh, "unauthorized", "not yours" * 200)
    answer = codeupload.parse_answer(data)
    reason, detail = answer.check(bytes(service.verify_key), "r1", rh, PrivateKey.generate())
    assert reason == "unauthorized" and len(detail) == 500
    raw = canonical.unpack(data)
    raw["reason"] = "granted"
    with pytest.raises(UploadError, match="not signed"):
        codeupload.parse_answer(canonical.pack(raw)).check(
            bytes(service.verify_key), "r1", rh, PrivateKey.generate()
        )
    # the genuine service's refusal of an altered copy of the request (anyone may publish
    # one, with the request's id, and have it refused) does not end the genuine request
    with pytest.raises(UploadError, match="another request"):
        answer.check(bytes(service.verify_key), "r1", b"x" * 32, PrivateKey.generate())


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("client_key", 2**64 - 1, "client_key must be 32 bytes"),
        ("client_key", 10**12, "client_key must be 32 bytes"),
        ("id", "x" * 200_000 + "\n", "id must be a UUID"),
        ("sig", 2**63, "sig must be 64 bytes"),
        ("tenant", "a\nb", "tenant must be a printable string"),
        ("time", 12, "time must be a printable string"),
    ],
)
def test_request_fields_of_the_wrong_type_are_refused_without_converting_them(
    field: str, value: Any, message: str
) -> None:
    fields = canonical.unpack(_request(SigningKey.generate(), PrivateKey.generate()))
    fields[field] = value
    with pytest.raises(UploadError, match=message):
        codeupload.parse_request(canonical.pack(fields))


def test_answers_with_fields_of_the_wrong_type_are_refused_before_they_are_checked() -> None:
    """Anyone may publish on the client's inbox, naming the policy service's key id: a field of
    another type is refused at once (``bytes(2**64-1)`` raised and ``bytes(10**12)`` ran out of
    memory in the client, which stopped instead of skipping the message)."""
    body = {"k": "refused", "rid": "r", "rh": b"h" * 32, "reason": "no", "detail": "-"}
    for sig in (2**64 - 1, 10**12, "s" * 64):
        with pytest.raises(UploadError, match="sig must be 64 bytes"):
            codeupload.parse_answer(canonical.canonical_bytes({**body, "key_id": "k", "sig": sig}))
    grant = {**body, "k": "grant", "key_id": "k", "sig": b"s" * 64, "client_key": b"c" * 32}
    for service_key in (10**12, b"short"):
        with pytest.raises(UploadError, match="service_key must be 32 bytes"):
            codeupload.parse_answer(
                canonical.canonical_bytes({**grant, "service_key": service_key, "box": b""})
            )


def test_a_grant_whose_form_names_another_object_is_not_used() -> None:
    service, client = SigningKey.generate(), PrivateKey.generate()
    request = codeupload.parse_request(_request(SigningKey.generate(), client))
    odd = Grant(
        GRANT.url, {**GRANT.fields, "key": "bundles/victim/x"}, GRANT.object_key, GRANT.expires
    )
    answer = codeupload.parse_answer(codeupload.grant(_signer(service), "svc", request, odd))
    with pytest.raises(UploadError, match="does not name"):
        answer.check(bytes(service.verify_key), request.id, request.hash, client)
