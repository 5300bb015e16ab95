"""Code bundles are stored without object-store credentials: the CLI asks the policy service for
a grant (``dsec_rpc.upload.code``), and an attacker on the bus who reads and publishes what it
likes gets nothing it could use against another tenant.

Before, users uploaded with the stack's own S3 credentials, which read and write every tenant's
bundles, snapshots and caches in the system bucket.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import blake3
import nats
import pytest
import urllib3
from dsec_core import canonical, codeupload, identity, rpc
from dsec_core.bus import EventPublisher
from dsec_core.signing import Signer
from dsec_testing import trust
from nacl.public import PrivateKey
from nacl.signing import SigningKey

pytestmark = [pytest.mark.integration]

SPEC = "version: '1.2'\nname: hello\nbase: python:3.11\n"


@pytest.fixture
def policy(services: Any) -> Any:
    services.start("policy")
    return services


async def _user(js: Any, home: Path, tenant: str) -> tuple[SigningKey, Any]:
    """A user key of ``tenant`` certified by the stack's root, registered in the log."""
    key, cert = identity.issue_user(trust.stack_root(home), f"u{time.monotonic_ns()}", tenant)
    await EventPublisher(
        js, Signer(cert.subject, key, tenant=tenant), certificate=cert
    ).register_key()
    return key, cert


def _request(key: SigningKey, cert: Any, inbox: str, client: PrivateKey, **over: Any) -> bytes:
    data = b"a bundle"
    fields: dict[str, Any] = {
        "tenant": cert.tenant,
        "producer": cert.subject,
        "key_id": cert.key_id,
        "reply_to": inbox,
        "client_key": bytes(client.public_key),
        "digest": blake3.blake3(data).hexdigest(),
        "size": len(data),
    }
    fields.update(over)
    return codeupload.sign_request(key, **fields)


async def _ask(nc: Any, request: bytes, inbox: str) -> codeupload.Answer:
    """The first answer on ``inbox`` to ``request``."""
    sub = await nc.subscribe(inbox)
    try:
        await nc.publish(codeupload.SUBJECT, request, reply=inbox)
        msg = await sub.next_msg(timeout=10)
        return codeupload.parse_answer(bytes(msg.data))
    finally:
        await sub.unsubscribe()


async def _policy_key(js: Any, home: Path, answer: codeupload.Answer) -> bytes:
    """The public key of the answer's signer, which must be a certified policy key."""
    from dsec_core.trust import KeyRing

    ring = KeyRing(None, js, bytes(trust.stack_root(home).verify_key))
    cert = await ring.certificate(answer.key_id)
    assert not isinstance(cert, str) and cert.role == "policy", cert
    return bytes.fromhex(cert.public_key)


def _post(granted: codeupload.Grant, key: str, data: bytes) -> int:
    fields: dict[str, Any] = {**granted.fields, "key": key, "file": ("b", data)}
    return int(urllib3.request("POST", granted.url, fields=fields, retries=False).status)


def test_submit_stores_code_without_object_store_credentials(
    dsec_cli: Any, policy: Any, nats_url: str, s3: Any, tmp_path: Path
) -> None:
    """The user's environment names no object store at all; the bundle lands under its tenant,
    and with no builder running the chain stops visibly after validation."""
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    code = tmp_path / "code"
    code.mkdir()
    (code / "main.py").write_text("print('hi')\n")
    import os

    os.mkfifo(code / "pipe")  # not code: left out, and said so
    env = {"DSEC_NATS_URL": nats_url, "DSEC_HOME": str(tmp_path / "home")}
    result = dsec_cli(
        "submit", str(spec), "--code", str(code), "--wait", "exited", "--stall", "3", "--json",
        env=env,
    )  # fmt: skip
    outcome = result.last_json()
    assert result.exit_code == 4, result.output
    assert outcome["sandbox_id"].startswith("sbx_")
    assert outcome["stalled_after"] == "spec.validated", outcome
    first = outcome["events"][0]
    assert first["type"] == "spec.submitted"
    bundle = first["payload"]["code"]
    assert bundle["object_key"] == f"bundles/default/{bundle['digest']}.tar.zst"
    assert bundle["files"] == 1
    assert bundle["expanded_size"] == len("print('hi')\n")
    assert outcome["skipped"] == ["pipe (fifo)"]
    assert "left out 1 special file(s) (not code): pipe (fifo)" in " ".join(result.output.split())
    stored = s3.client().get_object(s3.bucket, bundle["object_key"]).read()
    assert blake3.blake3(stored).hexdigest() == bundle["digest"]


def test_without_a_policy_service_the_upload_says_so(
    dsec_cli: Any, nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsec_core import codeupload

    monkeypatch.setattr(codeupload, "ANSWER_S", 1.0)  # the wait for an answer, shortened
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    code = tmp_path / "code"
    code.mkdir()
    (code / "main.py").write_text("print('hi')\n")
    env = {"DSEC_NATS_URL": nats_url, "DSEC_HOME": str(tmp_path / "home")}
    result = dsec_cli("submit", str(spec), "--code", str(code), env=env)
    assert result.exit_code == 3, result.output
    assert "no policy service answered the code-upload request within 1 s" in result.output


async def test_a_grant_writes_one_object_of_one_length_of_its_own_tenant(
    policy: Any, nats_url: str, dsec_stack: Any, s3: Any
) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        key, cert = await _user(js, dsec_stack.home, "team-a")
        client = PrivateKey.generate()
        inbox = nc.new_inbox()
        data = b"tenant a's code " * 64
        digest = blake3.blake3(data).hexdigest()
        request = _request(key, cert, inbox, client, digest=digest, size=len(data))
        answer = await _ask(nc, request, inbox)
        assert answer.kind == "grant", answer.fields
        parsed = codeupload.parse_request(request)
        key_raw = await _policy_key(js, dsec_stack.home, answer)
        granted = answer.check(key_raw, parsed.id, parsed.hash, client)
        assert isinstance(granted, codeupload.Grant)
        own = f"bundles/team-a/{digest}.tar.zst"
        assert granted.object_key == own
        # what an eavesdropper saw is sealed: no form field of the grant is in the clear
        assert granted.fields["policy"].encode() not in canonical.canonical_bytes(answer.fields)

        # the holder of the grant cannot write another tenant's prefix, another key of its
        # own, or another length
        assert _post(granted, f"bundles/team-b/{digest}.tar.zst", data) == 403
        assert _post(granted, f"bundles/team-a/{'0' * 64}.tar.zst", data) == 403
        assert _post(granted, own, data + b"x") == 400
        assert _post(granted, own, data[:-1]) == 400
        assert _post(granted, own, data) in (200, 204)
        assert s3.client().get_object(s3.bucket, own).read() == data
        from minio.error import S3Error

        with pytest.raises(S3Error):
            s3.client().stat_object(s3.bucket, f"bundles/team-b/{digest}.tar.zst")
    finally:
        await nc.close()


async def test_forged_foreign_and_replayed_upload_requests_are_refused(
    policy: Any, nats_url: str, dsec_stack: Any
) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        key, cert = await _user(js, dsec_stack.home, "team-a")
        client = PrivateKey.generate()

        async def reason(request: bytes, inbox: str) -> str:
            answer = await _ask(nc, request, inbox)
            assert answer.kind == "refused", answer.fields
            # the refusal is the policy service's too: a forged one would not be believed
            key_raw = await _policy_key(js, dsec_stack.home, answer)
            parsed = codeupload.parse_request(request)
            outcome = answer.check(key_raw, parsed.id, parsed.hash, client)
            assert isinstance(outcome, tuple)
            return outcome[0]

        # a user of team-a asking to write team-b's prefix
        inbox = nc.new_inbox()
        assert await reason(_request(key, cert, inbox, client, tenant="team-b"), inbox) == (
            "unauthorized"
        )
        # a key the operator never certified, signing as the certified user
        inbox = nc.new_inbox()
        rogue = SigningKey.generate()
        assert await reason(_request(rogue, cert, inbox, client), inbox) == "bad-signature"
        # a genuine request altered (a larger size) after signing
        inbox = nc.new_inbox()
        fields = canonical.unpack(_request(key, cert, inbox, client))
        fields["size"] = 2**30
        assert await reason(canonical.pack(fields), inbox) == "bad-signature"
        # a service's key (certified, but not a user's)
        inbox = nc.new_inbox()
        node_key = SigningKey.generate()
        node_cert = identity.issue(
            trust.stack_root(dsec_stack.home), bytes(node_key.verify_key),
            subject="nodeagent", role="nodeagent", node_id="node-1",
        )  # fmt: skip
        await EventPublisher(
            js, Signer("nodeagent", node_key, tenant="system"), certificate=node_cert
        ).register_key()
        request = codeupload.sign_request(
            node_key,
            tenant="team-a",
            producer=node_cert.subject,
            key_id=node_cert.key_id,
            reply_to=inbox,
            client_key=bytes(client.public_key),
            digest="0" * 64,
            size=1,
        )
        assert await reason(request, inbox) == "unauthorized"
        # an unregistered key
        inbox = nc.new_inbox()
        other, other_cert = identity.issue_user(trust.stack_root(dsec_stack.home), "ghost", "x")
        assert await reason(_request(other, other_cert, inbox, client), inbox) == "unknown-key"
        # a genuine request is granted once; the same bytes again are a replay
        inbox = nc.new_inbox()
        genuine = _request(key, cert, inbox, client)
        assert (await _ask(nc, genuine, inbox)).kind == "grant"
        assert await reason(genuine, inbox) == "replayed"
        # a copy of a user's request sent with another reply subject, or altered: refused to
        # whoever sent it, never to the user's inbox (the genuine policy service's refusal
        # there, with the user's request id, ended the user's upload)
        signed_inbox, other = nc.new_inbox(), nc.new_inbox()
        victim = await nc.subscribe(signed_inbox)
        sender = await nc.subscribe(other)
        try:
            genuine = _request(key, cert, signed_inbox, client)
            parsed = codeupload.parse_request(genuine)
            await nc.publish(codeupload.SUBJECT, genuine, reply=other)
            first = codeupload.parse_answer(bytes((await sender.next_msg(timeout=10)).data))
            assert first.fields["reason"] == "malformed", first.fields
            altered = canonical.unpack(genuine)
            altered["size"] += 1
            await nc.publish(codeupload.SUBJECT, canonical.pack(altered), reply=signed_inbox)
            refusal = codeupload.parse_answer(bytes((await victim.next_msg(timeout=10)).data))
            assert refusal.fields["reason"] == "bad-signature", refusal.fields
            key_raw = await _policy_key(js, dsec_stack.home, refusal)
            with pytest.raises(codeupload.UploadError, match="another request"):
                refusal.check(key_raw, parsed.id, parsed.hash, client)  # the client skips it
            # the user's own request still gets its grant
            await nc.publish(codeupload.SUBJECT, genuine, reply=signed_inbox)
            answer = codeupload.parse_answer(bytes((await victim.next_msg(timeout=10)).data))
            assert answer.kind == "grant", answer.fields
            # a request naming a service's inbox gets no answer there
            assert not rpc.answerable("_INBOX.scheduler.abc.1")
        finally:
            await victim.unsubscribe()
            await sender.unsubscribe()
        # revoked: the operator revokes the user's key; its next request is refused
        from dsec_core.events import KeyRevoked

        operator = await trust.publisher(js, dsec_stack.home, "operator", subject="operator")
        revocation = KeyRevoked(key_id=cert.key_id, producer=cert.subject, reason="left")
        await operator.publish(revocation, aggregate_id=cert.key_id)
        deadline = time.monotonic() + 10
        while True:  # the revocation reaches the service live, a moment after it is stored
            inbox = nc.new_inbox()
            answer = await _ask(nc, _request(key, cert, inbox, client), inbox)
            got = str(answer.fields.get("reason", answer.kind))
            if got != "grant" or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert got == "revoked-key"
    finally:
        await nc.close()
