"""Control messages between agents and the node agent's broker.

One ``SOCK_SEQPACKET`` Unix socket per connection: each datagram is one MessagePack map, with file
descriptors attached through ``SCM_RIGHTS``. The broker creates every memfd and eventfd, so an agent
needs no ``memfd_create`` and no path to anyone else's memory: sandbox isolation stays intact.

Agent -> broker::

    {"op": "hello", "agent": str, "group": str, "role": "caller" | "server", "tools": [str]}
    {"op": "connect", "ref": int, "peer": str}
    {"op": "tools", "calls": [[...], ...], "dropped": int}   (tool-call reports, unanswered;
                                                           see dsec_sdk.tools.report)

Broker -> agent::

    {"op": "welcome", "node": str, "ring_capacity": int, "max_payload": int}
        + [doorbell eventfd] for a server; ``"standby": true`` for the new version of a
        hand-over registering the name its old version still serves (calls come once the
        broker switched the name to it)
    {"op": "channel", "ref": int, "channel": int, "peer": str, "ring_capacity": int, "remote": bool}
        + CALLER_FDS
    {"op": "open", "channel": int, "caller": str, "ring_capacity": int}  (to a server)
        + SERVER_FDS
    {"op": "error", "ref": int, "code": str, "message": str}
    {"op": "moved", "peer": str}     (to a caller, unasked: a hand-over moved the name ``peer``
                                      to a new server; a call the old one had not read may be
                                      sent again to it once the old one is gone)
    {"op": "moved", "peer": str, "channels": [int]}
                                     (to a caller, unasked, once the hand-over is final: the old
                                      server of these channels of this caller is frozen and
                                      never reads again; a call it had not read may be sent
                                      again to the new server now)
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import msgpack

from dsec_sdk.errors import ProtocolError

MAX_MESSAGE: Final = 1 << 16
MAX_FDS: Final = 8

# fds of a "channel" message: memfd, request overflow, response overflow, caller eventfd,
# server doorbell eventfd, server pidfd.
CALLER_FDS: Final = 6
# fds of an "open" message: memfd, request overflow, response overflow, caller eventfd,
# caller pidfd.
SERVER_FDS: Final = 5

NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}\Z")
TOOL_RE: Final = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,62}\Z")

DEFAULT_SOCKET: Final = Path("run") / "ipc.sock"


def check_name(what: str, value: str) -> str:
    """Return ``value`` if it is a valid agent or task group name, else raise ``ValueError``.

    Names become NATS subject tokens (``dsec_ipc.<group>.<agent>.<tool>``), hence the alphabet.
    """
    if not isinstance(value, str) or not NAME_RE.match(value):
        raise ValueError(
            f"{what} {value!r} is invalid: "
            "use 1-63 of [A-Za-z0-9_-], starting with a letter or digit"
        )
    return value


def check_tool_name(value: str) -> str:
    """Return ``value`` if it is a valid tool name, else raise ``ValueError``."""
    if not isinstance(value, str) or not TOOL_RE.match(value):
        raise ValueError(
            f"tool name {value!r} is invalid: use 1-63 of [A-Za-z0-9_-], starting with a letter"
        )
    return value


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one control message with optional file descriptors."""
    data: bytes = msgpack.packb(message, use_bin_type=True)
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.send(data)


def recv(
    sock: socket.socket,
    flags: int = 0,
    *,
    max_fds: int = MAX_FDS,
    close: Callable[[Sequence[int]], None] | None = None,
) -> tuple[dict[str, Any], list[int]] | None:
    """Receive one control message; ``None`` when the other side closed the connection.

    ``flags``: for ``recvmsg`` (``socket.MSG_DONTWAIT``: raise ``BlockingIOError`` when none
    is queued). ``max_fds``: fds taken at most (the kernel closes any beyond). ``close``: what
    closes the fds of a message refused here (default :func:`close_fds`; a receiver that must
    never block in ``close`` hands them elsewhere).

    Raises:
        ProtocolError: The datagram is not a MessagePack map or its fds were truncated.
    """
    data, fds, flags, _ = socket.recv_fds(sock, MAX_MESSAGE, max_fds, flags)
    if not data and not fds:
        return None
    close = close or close_fds
    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        close(fds)
        raise ProtocolError("control message truncated")
    try:
        message = msgpack.unpackb(data, raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        close(fds)
        raise ProtocolError(f"undecodable control message: {exc}") from exc
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        close(fds)
        raise ProtocolError(f"control message without 'op': {message!r:.200}")
    return message, fds


def close_fds(fds: Sequence[int]) -> None:
    """Close every fd, ignoring ones already closed."""
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
