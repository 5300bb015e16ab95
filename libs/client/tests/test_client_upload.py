"""The client's side of code uploads: what it believes on its request's inbox."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from dsec_core import canonical, codeupload
from dsec_core.codeupload import Grant
from nacl.signing import SigningKey

DIGEST = "ab" * 32
GRANT = Grant(
    url="http://127.0.0.1:8333/dsec",
    fields={"key": f"bundles/acme/{DIGEST}.tar.zst", "policy": "cG9saWN5", "x-amz-signature": "s"},
    object_key=f"bundles/acme/{DIGEST}.tar.zst",
    expires=datetime.now(UTC) + timedelta(minutes=10),
)


def _signer(key: SigningKey) -> Any:
    return lambda data: key.sign(data).signature.hex()


class _Sub:
    def __init__(self, messages: list[bytes]) -> None:
        self.messages = messages

    async def next_msg(self, timeout: float) -> Any:
        import nats.errors

        if not self.messages:
            raise nats.errors.TimeoutError
        return SimpleNamespace(data=self.messages.pop(0))

    async def unsubscribe(self) -> None:
        pass


class _Bus:
    """A bus where an attacker answers first, then the policy service."""

    def __init__(self, policy: SigningKey, forgers: list[Any]) -> None:
        self.policy = policy
        self.forgers = forgers
        self.sub: _Sub | None = None

    def new_inbox(self) -> str:
        return "_INBOX.user-acme.1"

    async def subscribe(self, subject: str) -> _Sub:
        self.sub = _Sub([])
        return self.sub

    async def publish(self, subject: str, data: bytes, reply: str = "") -> None:
        assert subject == codeupload.SUBJECT and self.sub is not None
        request = codeupload.parse_request(data)
        forged = [forge(request) for forge in self.forgers]
        genuine = codeupload.grant(_signer(self.policy), "policy-key", request, GRANT)
        self.sub.messages.extend([*forged, genuine])


def _gate(keys: dict[str, tuple[SigningKey, str]]) -> Any:
    async def certificate(key_id: str) -> Any:
        if key_id not in keys:
            return f"key {key_id} is not registered"
        key, role = keys[key_id]
        return SimpleNamespace(role=role, public_key=bytes(key.verify_key).hex())

    return SimpleNamespace(keys=SimpleNamespace(certificate=certificate))


def test_the_client_believes_only_the_policy_services_grant() -> None:
    """Anyone who reads the request may publish on its inbox: a grant pointing at the attacker's
    store, signed by a node agent's real key, by an unregistered key, or a refusal made up by
    a user, is skipped; the policy service's grant is used."""
    from dsec_client.code import _grant

    policy, node, user = SigningKey.generate(), SigningKey.generate(), SigningKey.generate()
    evil = Grant("http://attacker:9000/loot", GRANT.fields, GRANT.object_key, GRANT.expires)
    forgers = [
        lambda r: codeupload.grant(_signer(node), "node-key", r, evil),
        lambda r: codeupload.grant(_signer(user), "ghost", r, evil),
        lambda r: codeupload.refusal(
            _signer(user), "user-key", r.id, r.hash, "unauthorized", "go away"
        ),
        # the genuine policy service refusing an altered copy of the request
        lambda r: codeupload.refusal(
            _signer(policy), "policy-key", r.id, b"x" * 32, "bad-signature", "altered"
        ),
        # a message shaped to crash the client (bytes(10**12)) instead of being skipped
        lambda r: canonical.canonical_bytes(
            {"k": "refused", "rid": r.id, "key_id": "policy-key", "sig": 10**12}
        ),
        lambda r: b"",  # a NATS "no responders" status: no body (headers unset here)
        lambda r: b"junk",
    ]
    gate = _gate(
        {
            "policy-key": (policy, "policy"),
            "node-key": (node, "nodeagent"),
            "user-key": (user, "user"),
        }
    )
    me = SigningKey.generate()
    cert = SimpleNamespace(tenant="acme", subject="alice", key_id="k1")
    granted = asyncio.run(_grant(_Bus(policy, forgers), gate, (me, cert), DIGEST, 100))
    assert granted.url == GRANT.url


def test_the_client_says_when_no_policy_service_answers() -> None:
    from dsec_client.code import _grant
    from dsec_client.errors import Unreachable

    class Silent(_Bus):
        async def publish(self, subject: str, data: bytes, reply: str = "") -> None:
            assert self.sub is not None
            self.sub.messages.append(b"junk")  # only noise on the inbox

    me = SigningKey.generate()
    cert = SimpleNamespace(tenant="acme", subject="alice", key_id="k1")
    with pytest.raises(Unreachable, match="no policy service answered"):
        asyncio.run(_grant(Silent(SigningKey.generate(), []), _gate({}), (me, cert), DIGEST, 1))
