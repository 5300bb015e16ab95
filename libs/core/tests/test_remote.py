"""The remote logs/exec protocol as pure code: what a node accepts, what a client trusts."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from dsec_core import canonical, natsperms, remote, rpc
from dsec_core.remote import FrameCodec, RemoteError
from nacl.public import Box, PrivateKey
from nacl.signing import SigningKey

pytestmark = pytest.mark.unit


def _signed(key: SigningKey, **over: Any) -> bytes:
    fields: dict[str, Any] = {
        "kind": "exec",
        "sandbox_id": "sbx_abc",
        "node_id": "node-1",
        "tenant": "default",
        "producer": "user-alice",
        "key_id": "k1",
        "reply_to": "_INBOX.xyz",
        "client_key": bytes(PrivateKey.generate().public_key),
        "args": {"argv": ["python", "-V"]},
    }
    fields.update(over)
    return remote.sign_request(key, **fields)


def test_a_signed_request_verifies_and_an_altered_one_does_not() -> None:
    key = SigningKey.generate()
    request = remote.parse_request(_signed(key), "exec")
    assert remote.verify_request(request, bytes(key.verify_key))
    assert not remote.verify_request(request, bytes(SigningKey.generate().verify_key))

    fields = canonical.unpack(_signed(key))
    fields["args"] = {"argv": ["rm", "-rf", "/workspace"]}
    altered = remote.parse_request(canonical.pack(fields), "exec")
    assert not remote.verify_request(altered, bytes(key.verify_key))


@pytest.mark.parametrize(
    ("over", "kind", "message"),
    [
        ({}, "logs", "on the logs subject"),
        ({"sandbox_id": "sbx_../../etc"}, "exec", "is not a sandbox id"),
        ({"args": {"argv": []}}, "exec", "argv must be"),
        ({"args": {"argv": ["a\0b"]}}, "exec", "argv must be"),
        ({"reply_to": "dsec.sandbox.x.ready"}, "exec", "must be an inbox"),
        ({"client_key": b"short"}, "exec", "32 bytes"),
    ],
)
def test_malformed_requests_name_the_problem(over: dict[str, Any], kind: str, message: str) -> None:
    with pytest.raises(RemoteError, match=message.replace(".", r"\.")):
        remote.parse_request(_signed(SigningKey.generate(), **over), kind)


def test_garbage_and_unsigned_requests_are_malformed() -> None:
    with pytest.raises(RemoteError, match="not MessagePack"):
        remote.parse_request(b"\xc1", "logs")
    fields = canonical.unpack(_signed(SigningKey.generate(), kind="logs", args={}))
    del fields["sig"]
    with pytest.raises(RemoteError, match="sig must be 64 bytes"):
        remote.parse_request(canonical.pack(fields), "logs")


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("client_key", 2**64 - 1, "client_key must be 32 bytes"),  # bytes(2**64-1): no memory
        ("client_key", 10**12, "client_key must be 32 bytes"),
        ("id", "x" * 200_000 + "\n", "id must be a UUID"),  # echoed in answers, logged
        ("id", 7, "id must be a UUID"),
        ("sig", 2**63, "sig must be 64 bytes"),
        ("producer", "a\nforged log line", "producer must be a printable string"),
        ("time", 12, "time must be a printable string"),
        ("args", [1], "args must be a map"),
    ],
)
def test_fields_of_the_wrong_type_are_refused_without_converting_them(
    field: str, value: Any, message: str
) -> None:
    """A request field of another type is refused as it is: converting it (``bytes(n)`` of a
    huge integer) cost what its sender chose, and an id with newlines wrote fake log lines."""
    fields = canonical.unpack(_signed(SigningKey.generate(), kind="logs", args={}))
    fields[field] = value
    with pytest.raises(RemoteError, match=message):
        remote.parse_request(canonical.pack(fields), "logs")


def test_the_replay_window_never_forgets_an_id_inside_it_to_make_room() -> None:
    """After 100,000 other requests the oldest id was dropped while still inside the window,
    so a captured request ran again: a full window refuses (``busy``) until ids age out."""
    window = remote.ReplayWindow(window_s=30, limit=3)
    now = datetime.now(UTC)
    assert [window.refusal(r, now) for r in ("v", "a", "b")] == [None, None, None]
    assert window.refusal("c", now) == ("busy", "3 requests in the last 60 s")
    assert window.refusal("v", now) == ("replayed", "request v was already served")


def test_one_tenant_fills_only_its_own_replay_window() -> None:
    """One tenant's users filling the window (1,700 signed requests a second) made every
    tenant's next request ``busy``; each tenant has its own window now, ids by key and id."""
    windows = remote.TenantReplayWindows(window_s=30, limit=2)
    now = datetime.now(UTC)
    assert windows.refusal("evil", "kE", "1", now) is None
    assert windows.refusal("evil", "kE", "2", now) is None
    assert windows.refusal("evil", "kE", "3", now)[0] == "busy"  # type: ignore[index]
    assert windows.refusal("acme", "kA", "1", now) is None  # its neighbour is not
    assert windows.refusal("acme", "kB", "1", now) is None  # another key, the same id
    assert windows.refusal("acme", "kA", "1", now)[0] == "replayed"  # type: ignore[index]
    # checked without being recorded, then recorded: a refusal in between takes no id
    assert windows.refusal("acme2", "k", "9", now, record=False) is None
    assert windows.refusal("acme2", "k", "9", now, record=False) is None
    windows.record("acme2", "k", "9")
    assert windows.refusal("acme2", "k", "9", now)[0] == "replayed"  # type: ignore[index]


def test_the_replay_window_refuses_repeats_old_and_future_requests() -> None:
    window = remote.ReplayWindow(window_s=30)
    now = datetime.now(UTC)
    assert window.refusal("r1", now) is None
    assert window.refusal("r1", now) == ("replayed", "request r1 was already served")
    assert window.refusal("r2", now - timedelta(seconds=31))[0] == "stale"  # type: ignore[index]
    assert window.refusal("r3", now + timedelta(seconds=31))[0] == "future"  # type: ignore[index]
    # a node agent that restarted forgot r1: requests from before its start are refused
    later = remote.ReplayWindow(window_s=30)
    assert later.refusal("r1", now - timedelta(seconds=2))[0] == "stale"  # type: ignore[index]


def test_frames_are_sealed_numbered_and_readable_by_the_two_ends_only() -> None:
    client, node = PrivateKey.generate(), PrivateKey.generate()
    sender = FrameCodec(Box(node, client.public_key))
    frames = [sender.seal({"k": "out", "d": b"secret %d" % i}) for i in range(3)]
    assert all(b"secret" not in f for f in frames)

    reader = FrameCodec(Box(client, node.public_key))
    assert reader.open(frames[0])["d"] == b"secret 0"
    with pytest.raises(RemoteError, match="frame 2 where 1 was due"):
        reader.open(frames[2])  # a frame dropped or replayed ends the session
    eve = FrameCodec(Box(PrivateKey.generate(), node.public_key))
    with pytest.raises(RemoteError, match="does not decrypt"):
        eve.open(frames[1])


def test_the_client_trusts_a_hello_only_from_the_node_key_for_its_request() -> None:
    node_signing = SigningKey.generate()

    def sign(data: bytes) -> str:
        return node_signing.sign(data).signature.hex()

    client = PrivateKey.generate()
    request = remote.parse_request(
        _signed(SigningKey.generate(), client_key=bytes(client.public_key)), "exec"
    )
    message, node_box = remote.hello(sign, "nodekey", request, PrivateKey.generate())
    answer = remote.parse_answer(message)
    box = answer.check(bytes(node_signing.verify_key), request.id, "node-1", client, request.hash)
    assert isinstance(box, Box)
    assert FrameCodec(box).open(FrameCodec(node_box).seal({"k": "alive"}))["k"] == "alive"
    with pytest.raises(RemoteError, match="not signed"):
        answer.check(
            bytes(SigningKey.generate().verify_key), request.id, "node-1", client, request.hash
        )
    with pytest.raises(RemoteError, match="not signed"):  # another node's hello
        answer.check(bytes(node_signing.verify_key), request.id, "node-2", client, request.hash)

    # another user's request that copied this one's id, client key and inbox off the bus
    # (another tenant's sandbox, its own key): the node's hello to it is not taken for this one
    fields = {k: v for k, v in request.fields.items() if k != "sig"}
    fields.update(tenant="evil", producer="user-evil", key_id="k-evil", sandbox_id="sbx_evil")
    copied = remote.parse_request(
        rpc.sign_fields(SigningKey.generate(), remote.REQUEST_DOMAIN, fields), "exec"
    )
    assert copied.id == request.id and copied.hash != request.hash
    foreign, _ = remote.hello(sign, "nodekey", copied, PrivateKey.generate())
    with pytest.raises(RemoteError, match="not signed"):  # it signs the other request's hash
        remote.parse_answer(foreign).check(
            bytes(node_signing.verify_key), request.id, "node-1", client, request.hash
        )

    rh = request.hash
    refused = remote.parse_answer(remote.refusal(sign, "nodekey", request.id, rh, "busy", "16"))
    assert refused.check(bytes(node_signing.verify_key), request.id, "node-1", client, rh) == (
        "busy",
        "16",
    )
    # the genuine node's refusal of an altered copy of the request (anyone may publish one,
    # with the request's id) does not end the genuine request
    copy = remote.parse_answer(remote.refusal(sign, "nodekey", request.id, b"x" * 32, "no", "-"))
    with pytest.raises(RemoteError, match="another copy"):
        copy.check(bytes(node_signing.verify_key), request.id, "node-1", client, rh)


def test_an_answer_with_fields_of_the_wrong_type_is_refused_before_it_is_checked() -> None:
    """Anyone may publish on a request's inbox: a signature field of another type (a huge
    integer) is refused at once, not converted (``bytes(2**64-1)`` raised, ``bytes(10**12)``
    ran out of memory, and the client stopped instead of skipping it)."""
    body = {"k": "refused", "rid": "r", "rh": b"h" * 32, "reason": "no", "detail": "-"}
    for sig in (2**64 - 1, 10**12, "s" * 64, b"short"):
        with pytest.raises(RemoteError, match="sig must be 64 bytes"):
            remote.parse_answer(canonical.canonical_bytes({**body, "key_id": "k", "sig": sig}))
    hello = {
        "k": "hello",
        "rid": "r",
        "rh": b"h" * 32,
        "node": "n",
        "key_id": "k",
        "sig": b"s" * 64,
    }
    with pytest.raises(RemoteError, match="node_key must be 32 bytes"):
        remote.parse_answer(canonical.canonical_bytes({**hello, "node_key": 10**12}))


def test_users_may_ask_and_a_node_agent_listens_to_its_own_node_only() -> None:
    assert natsperms.RPC_REQUESTS in natsperms.publish_allow(natsperms.USER)
    assert natsperms.RPC_REQUESTS not in natsperms.subscribe_allow(natsperms.USER)
    own = natsperms.Identity("nodeagent-node-2", nkey="UX").entry()["permissions"]
    assert "dsec_rpc.node.node-2.*" in own["subscribe"]["allow"]
    assert natsperms.RPC_REQUESTS not in own["subscribe"]["allow"]
    assert remote.request_subject("node-2", "logs") == "dsec_rpc.node.node-2.logs"
    with pytest.raises(RemoteError):
        remote.request_subject("node.*", "logs")


def test_tty_and_cp_requests_are_checked_before_anything_runs() -> None:
    key = SigningKey.generate()
    tty = {"argv": ["bash"], "tty": True, "rows": 40, "cols": 120, "term": "xterm-256color"}
    assert remote.parse_request(_signed(key, args=tty), "exec").tty
    assert not remote.parse_request(_signed(key), "exec").tty
    for bad in ({"rows": 0}, {"cols": 10**6}, {"rows": True}, {"term": "x; rm -rf /"}):
        with pytest.raises(RemoteError):
            remote.parse_request(_signed(key, args={**tty, **bad}), "exec")

    get = {"op": "get", "path": "/tmp/out"}
    assert remote.parse_request(_signed(key, kind="cp", args=get), "cp").args == get
    for bad in (
        {"op": "delete", "path": "/tmp"},
        {"op": "get", "path": "tmp/out"},
        {"op": "get", "path": "/tmp/../etc/passwd"},
        {"op": "get", "path": "/tmp/\0"},
        {"op": "put", "path": "/tmp"},  # no name
        {"op": "put", "path": "/tmp", "name": "../x"},
    ):
        with pytest.raises(RemoteError):
            remote.parse_request(_signed(key, kind="cp", args=bad), "cp")


def test_paths_are_normalized_never_resolved() -> None:
    assert remote.sandbox_path("//tmp/./out/") == "/tmp/out"
    assert remote.sandbox_path("/") == "/"
    with pytest.raises(RemoteError, match=r"'\.\.'"):
        remote.sandbox_path("/tmp/a/../../etc")
    assert remote.entry_path("a/b.txt") == "a/b.txt"
    for bad in ("/abs", "a//b", "a/./b", "..", "a/..", "x\0"):
        with pytest.raises(RemoteError):
            remote.entry_path(bad)
    assert remote.under("/tmp/x", "/tmp") and not remote.under("/tmpfoo", "/tmp")
