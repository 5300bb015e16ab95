"""MessagePack bodies of the frames a channel carries.

A frame is ``(kind, call_id, body)``: kind and id live in the ring's fixed record header, so a
proxy (the broker bridging to NATS) forwards a body without decoding it.

* ``REQUEST``: ``[tool, arguments, timeout_ms]`` (``timeout_ms`` 0 = none), or
  ``[tool, arguments, timeout_ms, traceparent]`` when the caller traces (a W3C ``traceparent``,
  see :mod:`dsec_sdk.tools.tracing`)
* ``RESULT``: the tool's return value
* ``ERROR``: ``[code, error_type, message, traceback_summary]``

Encoding and decoding use msgspec's MessagePack codec: the same wire format as ``msgpack`` (the
bus and the control socket keep using that), at about 60 % of its cost on a tool call's frames,
which matters when the whole call takes a few microseconds.
"""

from __future__ import annotations

import traceback
from typing import Any, Final, NoReturn

import msgspec

from dsec_sdk.errors import (
    AgentBusy,
    AgentNotFound,
    BadArguments,
    CallTimeout,
    IpcError,
    PayloadTooLarge,
    PeerGone,
    ProtocolError,
    RemoteError,
    ToolNotFound,
)

REQUEST: Final = 1
RESULT: Final = 2
ERROR: Final = 3

# Error codes carried in ERROR bodies.
E_REMOTE: Final = "remote"
E_UNKNOWN_TOOL: Final = "unknown_tool"
E_BAD_ARGUMENTS: Final = "bad_arguments"
E_BAD_RESULT: Final = "bad_result"
E_TOO_LARGE: Final = "payload_too_large"
E_TIMEOUT: Final = "timeout"
E_PEER_GONE: Final = "peer_gone"
E_NOT_FOUND: Final = "agent_not_found"
# Answered by another node's bridge, never by a tool: the call did not reach it (retry).
E_BUSY: Final = "busy"

_TRACEBACK_FRAMES: Final = 6
_TEXT_LIMIT: Final = 4000


Packer = msgspec.msgpack.Encoder
# Decoding keeps no state between calls: one decoder serves every channel and thread.
unpack = msgspec.msgpack.Decoder().decode
# What unpack raises on a malformed body: msgspec.DecodeError (a ValueError), and
# RecursionError for one nested deeper than the interpreter's stack (5 KB of one-element
# arrays), which a peer can send as easily as any other bytes.
DECODE_ERRORS: Final = (ValueError, RecursionError)


def new_packer() -> Packer:
    """A reusable encoder (one per channel end, used under its lock); ``.encode(obj)``."""
    return msgspec.msgpack.Encoder()


def decode(body: memoryview) -> Any:
    """Decode one body in place (the result owns its data; ``body`` may be reused)."""
    try:
        return unpack(body)
    except DECODE_ERRORS as exc:
        raise ProtocolError(f"undecodable frame body: {exc}") from exc


MAX_TRACEPARENT: Final = 128


def encode_request(
    packer: Packer,
    tool: str,
    arguments: dict[str, Any],
    timeout_ms: int,
    trace: str | None = None,
) -> bytes:
    """Encode a call; ``TypeError`` names the argument MessagePack cannot carry."""
    try:
        frame: list[Any] = [tool, arguments, timeout_ms]
        if trace is not None:
            frame.append(trace)
        body: bytes = packer.encode(frame)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(
            f"arguments of tool {tool!r} are not MessagePack-serialisable: {exc}"
        ) from exc
    return body


def encode_error(
    packer: Packer, code: str, error_type: str, message: str, summary: str = ""
) -> bytes:
    """Encode an ERROR body. Text UTF-8 cannot carry (a lone surrogate in a tool's exception
    message) is sent with those characters escaped, never raised out of the serving loop."""
    parts = [code, error_type, message[:_TEXT_LIMIT], summary[-_TEXT_LIMIT:]]
    try:
        body: bytes = packer.encode(parts)
    except UnicodeEncodeError:
        body = packer.encode([_utf8_safe(part) for part in parts])
    return body


def _utf8_safe(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def describe(exc: BaseException) -> str:
    """``str(exc)``, or what stands for it when the exception's own ``__str__`` raises: a tool's
    exception is the tool's code, and it must not take the serving loop down with it. Always
    a plain ``str`` (a subclass of it may override what slicing or encoding it does)."""
    try:
        text = str(exc)
        return text if text.__class__ is str else str.__str__(text)
    except Exception as failure:  # anything a hostile __str__ raises
        return f"<the exception's text could not be read: str() raised {type_name(failure)}>"


def type_name(value: object) -> str:
    """The name of ``value``'s type, as a plain ``str`` whatever its metaclass says."""
    try:
        name = type(value).__name__
        return name if name.__class__ is str else str.__str__(name)
    except Exception:  # a metaclass whose __name__ raises
        return "<unnamed type>"


def error_from_exception(packer: Packer, code: str, exc: BaseException) -> bytes:
    """Encode an exception raised by a tool, with a short traceback summary. Never raises,
    whatever the exception's own code does (its text, its type's name, its traceback)."""
    try:
        frames = traceback.extract_tb(exc.__traceback__)[-_TRACEBACK_FRAMES:]
        summary = "".join(traceback.format_list(frames)).rstrip()
    except Exception:  # a traceback summary is a courtesy, never a crash
        summary = ""
    return encode_error(packer, code, type_name(exc), describe(exc), summary)


def raise_error(agent: str, tool: str, group: str, timeout: float, body: Any) -> NoReturn:
    """Turn a decoded ERROR body into the matching typed exception."""
    try:  # (a body nested past the stack decodes a few frames up, yet repr/str fail here)
        if not isinstance(body, list) or len(body) != 4:
            raise ProtocolError(f"malformed error frame from {agent!r}: {body!r:.200}")
        code, error_type, message, summary = (str(part) for part in body)
    except RecursionError:
        raise ProtocolError(f"malformed error frame from {agent!r}: nested too deep") from None
    exc: IpcError
    if code == E_UNKNOWN_TOOL:
        exc = ToolNotFound(agent, tool, code, error_type, message, summary)
    elif code == E_BAD_ARGUMENTS:
        exc = BadArguments(agent, tool, code, error_type, message, summary)
    elif code == E_TOO_LARGE:
        exc = PayloadTooLarge("response", 0, 0, text=f"{agent}.{tool}: {message}")
    elif code == E_TIMEOUT:
        exc = CallTimeout(agent, tool, timeout)
    elif code == E_PEER_GONE:
        exc = PeerGone(agent, message)
    elif code == E_NOT_FOUND:
        exc = AgentNotFound(agent, group, message)
    elif code == E_BUSY:
        exc = AgentBusy(agent, tool, code, error_type, message, summary)
    else:
        exc = RemoteError(agent, tool, code, error_type, message, summary)
    raise exc
