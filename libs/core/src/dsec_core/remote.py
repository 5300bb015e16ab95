"""Remote logs and exec: the wire protocol between ``dsec sandbox logs|exec`` and the node agent
that runs the sandbox, over core NATS (outside the audited ``dsec.>`` stream).

1. The user's CLI signs a **request** with its certified key (the key it signs events with):
   ``{id, kind, sandbox_id, node_id, tenant, producer, key_id, time, reply_to, client_key,
   args}``, Ed25519 over ``REQUEST_DOMAIN + canonical MessagePack`` (a domain prefix, so a
   request signature is never valid as an event's, nor the reverse). ``client_key`` is a fresh
   X25519 public key; ``reply_to`` the per-request inbox. Published to
   ``dsec_rpc.node.<node_id>.<kind>``.
2. The node agent verifies it like an event (certificate from the operator root, signature, a
   user of the sandbox's tenant, the replay window by request id) and answers on ``reply_to``:
   a **hello** signed by its own certified key, carrying its fresh X25519 key, or a signed
   **refusal** with the reason.
3. Every later frame, both ways, is a NaCl ``Box`` between the two fresh keys (X25519 +
   XSalsa20-Poly1305): only the two ends read it, and each end knows the other wrote it. The
   client's frames (stdin, keep-alive, cancel) go to ``dsec_rpc.node.<node_id>.input`` wrapped
   with the request id. Frames carry a counter; one out of order ends the session.

4. Kinds: ``logs`` (args ``stream``, ``follow``: node frames ``out``, ``end``), ``exec`` (args
   ``argv``; with ``tty: true`` also ``rows``, ``cols``, ``term``: client frames ``stdin``,
   ``eof``, ``resize{rows, cols}``, ``cancel``; node frames ``out``, ``end{code}``) and ``cp``
   (args ``op`` get|put, ``path``, and a put's ``name``: frames ``entry{t: dir|file|skip, p, m}``
   and ``data{d}`` in the copy's direction, ``ack{n}`` from the node for each put frame it
   wrote, ``end{code, files, bytes}``). Every session ends with the node's ``end``.

Everything here is pure (no I/O); the node agent's side is ``dsec_nodeagent.remote_access``, the
CLI's ``dsec_cli.remote`` and ``dsec_cli.remote_io``.
"""

from __future__ import annotations

import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from nacl.exceptions import BadSignatureError, CryptoError
from nacl.public import Box, PrivateKey, PublicKey
from nacl.signing import SigningKey, VerifyKey

from dsec_core import canonical, rpc

SUBJECT_ROOT = "dsec_rpc.node"
KINDS: tuple[str, ...] = ("logs", "exec", "cp")
Kind = Literal["logs", "exec", "cp"]
REQUEST_DOMAIN = b"dsec-rpc/1 request\n"
HELLO_DOMAIN = b"dsec-rpc/1 hello\n"
REFUSAL_DOMAIN = b"dsec-rpc/1 refusal\n"

CHUNK = 32 * 1024
"""Bytes of output or input in one frame."""
RATE_BYTES_PER_S = 4 * 1024 * 1024
"""Output one session may stream per second (burst: one second's worth)."""
ALIVE_S = 2.0
"""Each end sends a keep-alive after this long without another frame."""
GONE_S = 10.0
"""An end that heard nothing for this long ends the session (the other went away)."""
WINDOW_S = 30.0
"""A request dated further from the node's clock is refused (``stale`` / ``future``); ids are
remembered for twice this long, so a replay inside the window is refused (``replayed``)."""
MAX_SESSIONS = 16
"""Sessions one node agent serves at once; more are refused (``busy``)."""
MAX_SESSIONS_PER_TENANT = 4
"""Sessions of one tenant's users one node agent serves at once (a quarter of them: one tenant
holding every session kept every other tenant's logs and execs off the node); more are refused
(``busy``)."""
MAX_ARGV_BYTES = 64 * 1024
MAX_STDIN_BUFFER = 1024 * 1024
"""Input the node holds for a command that does not read it; more ends the session."""
CP_MAX_BYTES = 512 * 1024 * 1024
"""File contents one ``dsec sandbox cp`` moves at most (each way); more ends it."""
CP_MAX_FILES = 10_000
"""Files and directories one ``cp`` moves at most."""
CP_WINDOW = 16
"""Frames (32 KiB of data at most each) a ``cp`` into the sandbox sends ahead of the node's
acknowledgements: below MAX_STDIN_BUFFER, so a slow disk slows the sender instead of ending
the session."""
MAX_PATH_BYTES = 4096
_TERM = re.compile(r"^[A-Za-z0-9._+-]{1,64}\Z")

_NODE = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
_SANDBOX = re.compile(r"^sbx_[A-Za-z0-9_-]{1,64}\Z")


class RemoteError(rpc.RpcError):
    """A message that is not what the protocol allows (malformed, forged, out of order)."""


class ForgedFrame(RemoteError):
    """A frame neither end wrote now: it does not decrypt (anyone who read the request id or
    the inbox can publish bytes there), or it is an earlier frame published again. Dropped,
    never a reason to end the session: only its two ends can break it."""


def request_subject(node_id: str, kind: str) -> str:
    """``dsec_rpc.node.<node_id>.<kind>`` (``kind``: ``logs``, ``exec`` or ``input``)."""
    if not _NODE.match(node_id):
        raise RemoteError(f"node id {node_id!r} must match {_NODE.pattern}")
    return f"{SUBJECT_ROOT}.{node_id}.{kind}"


def node_filter(node_id: str) -> str:
    """Every request subject of one node (what its node agent subscribes to)."""
    return request_subject(node_id, "*")


@dataclass(frozen=True)
class Request(rpc.Header):
    """A verified-shape request (its signature is checked by :func:`verify_request`)."""

    kind: Kind
    sandbox_id: str
    node_id: str
    args: dict[str, Any]

    @property
    def follow(self) -> bool:
        return bool(self.args.get("follow", False))

    @property
    def stream(self) -> str:
        return "stderr" if self.args.get("stream") == "stderr" else "stdout"

    @property
    def argv(self) -> list[str]:
        return [str(a) for a in self.args.get("argv", [])]

    @property
    def tty(self) -> bool:
        """An exec that asked for a pseudo-terminal."""
        return self.kind == "exec" and self.args.get("tty") is True


def sign_request(
    key: SigningKey,
    *,
    kind: Kind,
    sandbox_id: str,
    node_id: str,
    tenant: str,
    producer: str,
    key_id: str,
    reply_to: str,
    client_key: bytes,
    args: dict[str, Any],
    now: datetime | None = None,
) -> bytes:
    """The wire bytes of a signed request."""
    return rpc.sign_request(
        key, REQUEST_DOMAIN, tenant=tenant, producer=producer, key_id=key_id,
        reply_to=reply_to, client_key=client_key, now=now,
        kind=kind, sandbox_id=sandbox_id, node_id=node_id, args=args,
    )  # fmt: skip


def _unpack_map(data: bytes, what: str) -> dict[str, Any]:
    return rpc.unpack_map(data, what, RemoteError)


def parse_request(data: bytes, kind: str) -> Request:
    """The request in ``data`` (shape only), or :class:`RemoteError` naming what is wrong. Each
    field must already be of its type (nothing is converted: a huge integer where bytes belong
    costs what its sender chooses)."""
    raw = _unpack_map(data, "request")
    if raw.get("v") != 1 or raw.get("kind") != kind or kind not in KINDS:
        raise RemoteError(
            f"a {str(raw.get('kind'))[:20]!r} request (v{str(raw.get('v'))[:8]}) on the {kind} "
            "subject"
        )
    header = rpc.read_header(raw, data, RemoteError)
    args = raw.get("args")
    if not isinstance(args, dict):
        raise RemoteError("args must be a map")
    request = Request(
        **vars(header),
        kind=kind,  # type: ignore[arg-type]  # one of KINDS, checked above
        sandbox_id=rpc.text(raw, "sandbox_id", RemoteError, limit=80),
        node_id=rpc.text(raw, "node_id", RemoteError, limit=64),
        args=args,
    )
    if not _SANDBOX.match(request.sandbox_id):
        raise RemoteError(f"sandbox id {request.sandbox_id[:80]!r} is not a sandbox id")
    if kind == "exec" and not _valid_argv(args.get("argv")):
        raise RemoteError(f"argv must be 1 to 256 strings, {MAX_ARGV_BYTES} bytes at most")
    if kind == "exec" and args.get("tty") is True:
        _check_tty_args(args)
    if kind == "cp":
        _check_cp_args(args)
    return request


def valid_size(rows: Any, cols: Any) -> bool:
    """A terminal size a client may ask for (``rows`` x ``cols``, 1 to 10,000 each)."""
    return all(
        isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 10_000 for v in (rows, cols)
    )


def _check_tty_args(args: dict[str, Any]) -> None:
    if not valid_size(args.get("rows"), args.get("cols")):
        raise RemoteError("a tty exec needs rows and cols, integers from 1 to 10000")
    term = args.get("term")
    if term is not None and not (isinstance(term, str) and _TERM.match(term)):
        raise RemoteError(f"term must match {_TERM.pattern}")


def _check_cp_args(args: dict[str, Any]) -> None:
    """``{"op": "get"|"put", "path": "/abs/path"[, "name": "basename"]}`` (put names what it
    sends, as ``cp`` names a copy into an existing directory)."""
    if args.get("op") not in ("get", "put"):
        raise RemoteError("cp needs op: get or put")
    sandbox_path(args.get("path"))
    if args["op"] == "put":
        entry_path(args.get("name"))
        if not args["name"]:
            raise RemoteError("put needs the name of what it sends")


def sandbox_path(path: Any) -> str:
    """An absolute path inside the sandbox, normalized (``//``, ``.`` dropped); a ``..``, a
    NUL or a relative path is a :class:`RemoteError` (never resolved: no traversal)."""
    if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
        raise RemoteError(f"{str(path)[:200]!r} is not an absolute path inside the sandbox")
    if len(path.encode()) > MAX_PATH_BYTES:
        raise RemoteError(f"a path of more than {MAX_PATH_BYTES} bytes")
    parts = [p for p in path.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise RemoteError(f"{path[:200]!r} climbs with '..': give the path without it")
    return "/" + "/".join(parts)


def entry_path(path: Any) -> str:
    """A path relative to what a cp copies (``""`` is its top): components only, none of them
    ``..`` or ``.``, no NUL, no leading slash."""
    if not isinstance(path, str) or "\0" in path or len(path.encode()) > MAX_PATH_BYTES:
        raise RemoteError(f"{str(path)[:200]!r} is not a relative path")
    if path == "":
        return path
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise RemoteError(f"{path[:200]!r} is not a plain relative path (empty, '.' or '..')")
    return path


def under(path: str, base: str) -> bool:
    """Whether the normalized ``path`` is ``base`` or inside it."""
    return base == "/" or path == base or path.startswith(base.rstrip("/") + "/")


def _valid_argv(argv: Any) -> bool:
    if not isinstance(argv, list) or not 0 < len(argv) <= 256:
        return False
    if not all(isinstance(a, str) and "\0" not in a for a in argv):
        return False
    return sum(len(a.encode()) for a in argv) <= MAX_ARGV_BYTES


def verify_request(request: Request, public_raw: bytes) -> bool:
    """Whether the request's signature holds for ``public_raw``."""
    return rpc.verify_fields(request.fields, REQUEST_DOMAIN, public_raw)


class ReplayWindow:
    """Request ids seen within the window; refuses old, future and repeated requests.

    A node agent that restarts forgets the ids it saw, so it also refuses requests dated before
    it started: a request captured before a restart cannot be replayed after it.
    """

    def __init__(self, window_s: float = WINDOW_S, limit: int = 100_000) -> None:
        self.window_s = window_s
        self.started = datetime.now(UTC)
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._limit = limit

    def outside(self, stamp: datetime) -> tuple[str, str] | None:
        """``(reason, detail)`` when a request dated ``stamp`` is outside the window (``stale``
        or ``future``): checked before anything costly, and again by :meth:`refusal`."""
        age = (datetime.now(UTC) - stamp).total_seconds()
        if age > self.window_s or stamp < self.started.replace(microsecond=0):
            return "stale", f"request dated {stamp.isoformat()}, outside the replay window"
        if -age > self.window_s:
            return "future", f"request dated {stamp.isoformat()}, in the future"
        return None

    def refusal(
        self, request_id: str, stamp: datetime, *, record: bool = True
    ) -> tuple[str, str] | None:
        """``(reason, detail)`` when the request must be refused, else None (and it is
        remembered, unless not ``record``: :meth:`record` it once what else it needs held)."""
        outside = self.outside(stamp)
        if outside is not None:
            return outside
        mono = time.monotonic()
        while self._seen and mono - next(iter(self._seen.values())) > 2 * self.window_s:
            self._seen.popitem(last=False)
        if request_id in self._seen:
            return "replayed", f"request {request_id} was already served"
        if len(self._seen) >= self._limit:
            # never forget an id inside the window to make room (100,000 other requests then
            # let a captured one run again): refuse until the oldest ages out
            return "busy", f"{self._limit} requests in the last {2 * self.window_s:.0f} s"
        if record:
            self._seen[request_id] = mono
        return None

    def record(self, request_id: str) -> None:
        """Remember an id :meth:`refusal` passed without recording."""
        self._seen[request_id] = time.monotonic()


class TenantReplayWindows:
    """A :class:`ReplayWindow` per tenant, all started together: one tenant's requests (any
    number of its users' certified keys can sign) fill its own window only, never another
    tenant's. Ids are by key and id, so another user's request taking an id uses none up."""

    def __init__(self, window_s: float = WINDOW_S, limit: int = 100_000) -> None:
        self._first = ReplayWindow(window_s, limit)
        self._limit = limit
        self._windows: dict[str, ReplayWindow] = {}

    def outside(self, stamp: datetime) -> tuple[str, str] | None:
        return self._first.outside(stamp)

    def window(self, tenant: str) -> ReplayWindow:
        found = self._windows.get(tenant)
        if found is None:
            found = self._windows[tenant] = ReplayWindow(self._first.window_s, self._limit)
            found.started = self._first.started
        return found

    def refusal(
        self, tenant: str, key_id: str, request_id: str, stamp: datetime, *, record: bool = True
    ) -> tuple[str, str] | None:
        return self.window(tenant).refusal(f"{key_id}/{request_id}", stamp, record=record)

    def record(self, tenant: str, key_id: str, request_id: str) -> None:
        self.window(tenant).record(f"{key_id}/{request_id}")


def _hello_bytes(rid: str, rh: bytes, node_id: str, node_key: bytes, client_key: bytes) -> bytes:
    return HELLO_DOMAIN + canonical.canonical_bytes(
        {"rid": rid, "rh": rh, "node": node_id, "node_key": node_key, "client_key": client_key}
    )


def hello(sign: Any, key_id: str, request: Request, node_key: PrivateKey) -> tuple[bytes, Box]:
    """The node's signed hello and the session's box. ``sign(bytes) -> hex signature`` is the
    node agent's certified key. The hello names the hash of the request's exact bytes: another
    user's request that copied this one's id, client key and inbox (all readable on the bus)
    gets a hello the client does not take."""
    public = bytes(node_key.public_key)
    signed = _hello_bytes(request.id, request.hash, request.node_id, public, request.client_key)
    message = canonical.canonical_bytes(
        {"k": "hello", "rid": request.id, "rh": request.hash, "node": request.node_id,
         "key_id": key_id, "node_key": public, "sig": bytes.fromhex(sign(signed))}
    )  # fmt: skip
    return message, Box(node_key, PublicKey(request.client_key))


def refusal(sign: Any, key_id: str, rid: str, rh: bytes, reason: str, detail: str) -> bytes:
    """A signed refusal of the request of id ``rid`` whose bytes hash to ``rh`` (plaintext: it
    says only why, never anything of the sandbox)."""
    body = {
        "k": "refused", "rid": rid, "rh": rh, "reason": reason, "detail": detail[:500],
        "key_id": key_id,
    }  # fmt: skip
    return rpc.sign_answer(sign, REFUSAL_DOMAIN, body)


@dataclass(frozen=True)
class NodeAnswer:
    """The first answer to a request, as the client reads it (signature not yet checked)."""

    kind: Literal["hello", "refused"]
    key_id: str
    fields: dict[str, Any]

    def check(
        self, public_raw: bytes, rid: str, node_id: str, client: PrivateKey, rh: bytes
    ) -> Box | tuple[str, str]:
        """The session's box (hello) or ``(reason, detail)`` (refusal), once the node's
        signature holds; :class:`RemoteError` when it does not. Both must name ``rh``, the
        hash of the request's bytes: an answer to a copy of the request someone altered, or to
        another user's request that took its id, client key and inbox (readable on the bus),
        is not one to it."""
        body = {k: v for k, v in self.fields.items() if k != "sig"}
        if self.kind == "hello":
            node_key = body["node_key"]
            signed = _hello_bytes(rid, rh, node_id, node_key, bytes(client.public_key))
        else:
            signed = REFUSAL_DOMAIN + canonical.canonical_bytes(body)
        try:
            VerifyKey(public_raw).verify(signed, self.fields["sig"])
        except (BadSignatureError, ValueError, TypeError):
            raise RemoteError("the answer is not signed by the node agent's key") from None
        if body.get("rid") != rid:
            raise RemoteError("an answer to another request")
        if body.get("rh") != rh:
            raise RemoteError("an answer to another copy of the request")
        if self.kind == "refused":
            return str(body.get("reason"))[:64], str(body.get("detail"))[:500]
        return Box(client, PublicKey(node_key))


def parse_answer(data: bytes) -> NodeAnswer:
    """The node's first answer (hello or refusal), shape only: each field of its type."""
    raw = _unpack_map(data, "answer")
    kind = raw.get("k")
    if kind not in ("hello", "refused"):
        raise RemoteError("the first answer must be a hello or a refusal")
    key_id = rpc.text(raw, "key_id", RemoteError, limit=64)
    rpc.blob(raw, "sig", RemoteError, size=64)
    rpc.blob(raw, "rh", RemoteError, size=32)
    if kind == "hello":
        rpc.blob(raw, "node_key", RemoteError, size=32)
    return NodeAnswer(kind, key_id, raw)


class FrameCodec:
    """Encrypted frames of one direction of a session, numbered from 0."""

    def __init__(self, box: Box) -> None:
        self._box = box
        self._out = 0
        self._in = 0

    def seal(self, frame: dict[str, Any]) -> bytes:
        data = self._box.encrypt(canonical.canonical_bytes({**frame, "n": self._out}))
        self._out += 1
        return bytes(data)

    def open(self, data: bytes) -> dict[str, Any]:
        """The frame in ``data``; :class:`RemoteError` when forged or out of order."""
        try:
            plain = self._box.decrypt(data)
        except (CryptoError, ValueError, TypeError):
            raise ForgedFrame("a frame that does not decrypt (forged or corrupted)") from None
        frame = _unpack_map(plain, "frame")
        n = frame.get("n")
        if isinstance(n, int) and n < self._in:
            raise ForgedFrame(f"frame {n} again (a replay), {self._in} is due")
        if n != self._in:
            raise RemoteError(f"frame {frame.get('n')} where {self._in} was due")
        self._in += 1
        return frame


def input_message(rh: bytes, sealed: bytes) -> bytes:
    """A client frame as published on the input subject: its session (the hash of the
    request's bytes: two requests with one id are two sessions) and the sealed frame."""
    return canonical.canonical_bytes({"rh": rh, "box": sealed})


def parse_input(data: bytes) -> tuple[bytes, bytes]:
    """``(rh, box)`` of a client frame (:func:`input_message`)."""
    raw = _unpack_map(data, "input")
    box = raw.get("box")
    if not isinstance(box, bytes):
        raise RemoteError("input needs box (bytes)")
    return rpc.blob(raw, "rh", RemoteError, size=32), box


class TokenBucket:
    """``rate`` bytes per second, a burst of one second."""

    def __init__(self, rate: float = RATE_BYTES_PER_S) -> None:
        self.rate = rate
        self._tokens = rate
        self._at = time.monotonic()

    def delay(self, amount: int) -> float:
        """Seconds to wait before sending ``amount`` bytes (and take them)."""
        now = time.monotonic()
        self._tokens = min(self.rate, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= amount
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate
