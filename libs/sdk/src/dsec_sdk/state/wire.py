"""The state plane's wire between an agent (``dsec_sdk.state``) and its node agent's state
keeper (``dsec_nodeagent.state``). The design is in docs/state.md; this module is the contract
both sides import.

Transport: a ``SOCK_STREAM`` Unix socket. Inside a sandbox the agent asks the IPC broker for it
(control op ``{"op": "state", "ref": n}`` on the broker socket; the answer ``{"op": "state",
"ref": n}`` carries one end of a socketpair whose other end the keeper serves: no new mount, no
path into the sandbox, and the keeper knows the sandbox from the broker connection). The op is
sent after the broker connection's ``hello`` (like ``connect``), any number of times up to the
broker's per-sandbox bound of state sockets (4; an ``error`` ``too_many_state_sockets`` beyond);
a broker without a keeper answers ``error`` ``unavailable``. Outside a sandbox (tests, plain
Python) ``dsec_sdk.state`` uses a local store and no socket at all.

Frames: a 4-byte big-endian length, then one MessagePack map (``use_bin_type``; binary fields
are ``bytes``). Every frame has ``op``. At most :data:`MAX_FRAME` bytes. A frame to the keeper
also holds at most ``msgcount.MAX_FRAME_OBJECTS`` MessagePack objects, its map keys are str (or
bytes), it carries no extension type, and its body follows its length within 10 s; the keeper
refuses any other unread (``bad-request``). The SDK keeps to this: it refuses such a value
where it is stored, and cuts a checkpoint into frames within the bound.

Agent -> keeper::

    {"op": "hello", "v": 1, "agent": str, "group": str, "handover": bool}
    {"op": "fetch"}
    {"op": "checkpoint", "seq": int, "records": [record...], "pause_ms": float,
     "tiers": ["hot", "warm", "cold"], "final": bool}
    {"op": "ready"}          # hand-over only: the new version serves; switch to it
    {"op": "bye"}

Keeper -> agent::

    {"op": "welcome", "state_id": str, "seq": int, "config": {...}, "handover": bool}
    {"op": "records", "records": [record...]}          # zero or more, answers fetch
    {"op": "fetched", "seq": int, "deltas": int, "source": "empty"|"local"|"remote",
     "ms": float}
    {"op": "ack", "seq": int, "bytes": int}             # journaled AND durable in JetStream
    {"op": "deltas", "seq": int, "records": [record...]}  # hand-over: the old one's new deltas
    {"op": "handover", "to": str}                        # to the OLD version: final checkpoint
    {"op": "switched", "interruption_ms": float}         # to the NEW version: it owns the state
    {"op": "error", "code": str, "message": str, "seq": int | None, "expected"?: int}

Error codes: ``bad-request`` (a frame that breaks this contract), ``wrong-agent`` (the hello
names another agent than the sandbox's), ``state-held`` (another live session owns that
state), ``no-handover``, ``bad-seq`` (a checkpoint's seq is not the last acked + 1),
``bad-record``, ``not-durable`` (JetStream did not take it: nothing acked, retry the same seq),
``corrupt`` (stored state does not authenticate or is incomplete: nothing was sent),
``unavailable`` (OpenBao, the object store or NATS missing), ``unregistered`` (a sandbox
without a ``state:`` section), ``quota`` (the state on the node is at its ``state.max_size``),
``handed-over`` (a checkpoint of the OLD version after its final hand-over checkpoint: the
state goes to the NEW version as of the final; taken again once told ``handover-aborted``).
A refused checkpoint's seq is not taken: the next checkpoint uses it again. Every refusal of a
checkpoint carries its ``seq``; ``bad-seq`` also carries ``expected``, the seq the keeper takes
next.

Hand-over (docs/state.md): the NEW version's ``hello{handover: true}`` is answered by
``welcome{handover: true}``, then (without a ``fetch`` from it) ``records``... ``fetched`` with
the OLD version's state, then ``deltas`` until it sends ``ready``, then ``switched`` (it owns the
state and serves the tool name), or ``error`` (code ``handover-refused`` / ``handover-failed``
/ ``freezer``: it is stopped). The OLD version, after ``handover``, finishes its tool call in
progress and stops taking calls, then sends its ``final`` checkpoint; an ``error`` with code
``handover-aborted`` afterwards means the hand-over failed: it takes calls again and goes on.

Records (one container's change, or its full value)::

    {"c": name, "k": kind, "t": tier, "o": op, ...}

    kind "log"     o "append": "items": [[id: str, blake3_hex: str, value], ...]
                   o "full":   "items": [...]
    kind "kv"      o "set": "items": {key: value}   o "del": "keys": [key]   o "full": "items"
    kind "array"   o "sparse": "dtype": str, "shape": [int], "idx": bytes (int64, flat, C order),
                               "val": bytes (dtype)
                   o "full":   "dtype", "shape", "data": bytes (C order)
    kind "vectors" o "upsert": "dim": int, "dtype": str, "ids": [str], "vec": bytes (n x dim)
                   o "remove": "ids": [str]
                   o "full":   "dim", "dtype", "ids", "vec"
    kind "blob"    o "full": "data": bytes, "hash": blake3_hex
    kind "ref"     o "cold": "hash": blake3_hex, "size": int   (a cold container's value lives
                   in the object store under that hash; the keeper writes these)

    Added by the SDK (additive; ``codec.apply`` handles them): values too large for one frame
    are written as several records of at most ``codec.MAX_RECORD_BYTES``:
    kind "array"   o "slice":  "dtype", "shape", "start": int (flat element), "val": bytes
    kind "blob"    o "part":   "offset": int, "size": int (total), "hash": blake3_hex,
                               "data": bytes   (parts in order; the value is whole at the last)
    kind "vectors" a "full" followed by "upsert" records
    and a checkpoint with more records than fit a frame is sent as several ``checkpoint``
    frames, each with its own seq (only the last carries ``final: true``). Every record is
    idempotent (a log append skips ids it has), so records sent again change nothing.

Values inside log items and kv entries are MessagePack-able Python values (str, int, float,
bool, None, bytes, lists, dicts with str keys).
"""

from __future__ import annotations

import socket
import struct
from typing import Any, Final, Literal

import msgpack

from dsec_sdk.state import msgcount

VERSION: Final = 1
MAX_FRAME: Final = 64 << 20
MAX_HELLO: Final = 64 << 10
"""The largest hello the keeper reads (before it knows whom it serves; a hello is ~100 bytes)."""
_LEN: Final = struct.Struct(">I")

Tier = Literal["hot", "warm", "cold"]
Kind = Literal["log", "kv", "array", "vectors", "blob", "ref"]
TIERS: Final[tuple[Tier, ...]] = ("hot", "warm", "cold")
DEFAULT_TIER: Final[dict[str, Tier]] = {
    "log": "hot",
    "kv": "hot",
    "array": "warm",
    "vectors": "warm",
    "blob": "cold",
}


class WireError(Exception):
    """A frame that breaks this contract (too large, not a map, no ``op``)."""


def encode(frame: dict[str, Any]) -> bytes:
    """One frame: length prefix + MessagePack map."""
    body: bytes = msgpack.packb(frame, use_bin_type=True)
    if len(body) > MAX_FRAME:
        raise WireError(f"a {frame.get('op')!r} frame of {len(body)} bytes (max {MAX_FRAME})")
    return _LEN.pack(len(body)) + body


def decode(body: bytes, *, strict: bool = False) -> dict[str, Any]:
    """A frame's body (without the length prefix). ``strict`` (the keeper's, for frames from
    agents): every map key a str or bytes, and no extension type (an int's or a timestamp's
    hash is not salted, and a dict of keys made to collide costs the square of its size to
    build); checked by ``msgcount.count(strict=True)`` before a byte is decoded."""
    if strict:
        try:
            msgcount.count(body, len(body), strict=True)
        except ValueError as exc:
            raise WireError(f"refused unread: {exc}") from None
    try:
        frame = msgpack.unpackb(body, raw=False, strict_map_key=strict)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise WireError(f"not MessagePack: {exc}") from None
    except TypeError as exc:  # a map key that cannot be one in Python (a list, a map)
        raise WireError(f"not a frame: {exc}") from None
    if not isinstance(frame, dict) or not isinstance(frame.get("op"), str):
        raise WireError("a frame must be a map with an 'op'")
    return frame


def send(sock: socket.socket, frame: dict[str, Any]) -> None:
    """Blocking send of one frame."""
    sock.sendall(encode(frame))


def recv(sock: socket.socket) -> dict[str, Any] | None:
    """Blocking receive of one frame; ``None`` at a clean end of stream."""
    head = _read_exact(sock, _LEN.size)
    if head is None:
        return None
    (size,) = _LEN.unpack(head)
    if size > MAX_FRAME:
        raise WireError(f"a frame of {size} bytes announced (max {MAX_FRAME})")
    body = _read_exact(sock, size)
    if body is None:
        raise WireError("the stream ended inside a frame")
    return decode(body)


def _read_exact(sock: socket.socket, size: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < size:
        chunk = sock.recv(min(size - len(buf), 1 << 20))
        if not chunk:
            if not buf:
                return None
            raise WireError("the stream ended inside a frame")
        buf += chunk
    return bytes(buf)


async def read_frame(
    reader: Any, max_size: int = MAX_FRAME, *, strict: bool = False
) -> dict[str, Any] | None:
    """Async receive (an ``asyncio.StreamReader``); ``None`` at a clean end of stream.
    ``max_size``: the largest frame taken (a hello is small: :data:`MAX_HELLO`); ``strict``:
    as :func:`decode`'s."""
    body = await read_body(reader, max_size)
    return None if body is None else decode(body, strict=strict)


async def read_body(reader: Any, max_size: int = MAX_FRAME) -> bytes | None:
    """:func:`read_frame`'s body, not decoded (for a reader that checks it first)."""
    size = await read_size(reader, max_size)
    return None if size is None else await read_exactly(reader, size)


async def read_size(reader: Any, max_size: int = MAX_FRAME) -> int | None:
    """The next frame's length prefix (at most ``max_size``); ``None`` at a clean end of
    stream. Its body follows: :func:`read_exactly`."""
    import asyncio

    try:
        head = await reader.readexactly(_LEN.size)
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise WireError("the stream ended inside a frame") from None
    (size,) = _LEN.unpack(head)
    if size > max_size:
        raise WireError(f"a frame of {size} bytes announced (max {max_size})")
    return int(size)


async def read_exactly(reader: Any, size: int) -> bytes:
    """A frame's body of ``size`` bytes."""
    import asyncio

    try:
        body: bytes = await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        raise WireError("the stream ended inside a frame") from None
    return body
