"""The client side of remote logs and exec (protocol: :mod:`dsec_core.remote`).

The owning node comes from the sandbox's authentic ``sandbox.ready`` / ``sandbox.scheduled``;
the request is signed with the user's certified key; the node agent's answer must be signed by
a key the operator root certified for that node; everything after it is encrypted between two
one-time X25519 keys. Used by :class:`dsec_client.Sandbox` and by ``dsec sandbox logs/exec``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from dsec_core import remote
from dsec_core.remote import FrameCodec, Kind, RemoteError
from dsec_core.subjects import InvalidSubjectToken, subject_for
from nacl.public import PrivateKey

from dsec_client.errors import (
    DSecError,
    InvalidInput,
    NotFound,
    Refused,
    RequestFailed,
    Unreachable,
)

T = TypeVar("T")

StdinFeeder = Callable[["asyncio.Queue[bytes | None]"], None]
"""Starts feeding a command's input into the queue (chunks, then ``None`` at the end)."""
Send = Callable[[dict[str, Any]], Coroutine[Any, Any, None]]
"""Sends one frame to the node (encrypted): what a session's ``driver`` is given."""
Driver = Callable[[Send], Coroutine[Any, Any, None]]
"""Runs alongside an open session and sends what a TTY or a copy sends."""


@dataclass(frozen=True)
class Ended:
    """How a session ended: the command's exit code (exec) and why."""

    code: int | None
    reason: str
    details: dict[str, Any] = field(default_factory=dict)
    """The end frame's other fields (a cp's ``files`` and ``bytes``)."""


async def owning_node(gate: Any, sandbox_id: str) -> str:
    """The node that runs (or ran) the sandbox: that of its latest placement (the trust gate's
    rule: attempts only grow, so an old ``sandbox.scheduled`` published again does not send
    the request to a node the sandbox left), else of its newest authentic ``sandbox.ready``."""
    try:
        subjects = [subject_for(t, sandbox_id) for t in ("sandbox.ready", "sandbox.scheduled")]
    except InvalidSubjectToken as exc:
        raise InvalidInput(str(exc)) from None
    placed = await gate.placement(sandbox_id)
    if placed is not None:
        return str(placed)
    found = [e for e in [await gate.find(s) for s in subjects] if e is not None]
    if not found:
        submitted = await gate.find(subject_for("spec.submitted", sandbox_id))
        if submitted is None:
            raise NotFound(f"no sandbox {sandbox_id!r} in the event log (see `dsec sandbox list`)")
        raise DSecError(f"{sandbox_id} has not been placed on a node yet (`dsec sandbox show`)")
    newest = max(found, key=lambda e: e.time)
    return str(newest.payload["node_id"])


async def session(
    nc: Any,
    gate: Any,
    identity: tuple[Any, Any],
    kind: Kind,
    sandbox_id: str,
    args: dict[str, Any],
    on_output: Callable[[str, bytes], None],
    *,
    stdin: StdinFeeder | None = None,
    driver: Driver | None = None,
    on_frame: Callable[[dict[str, Any]], Any] | None = None,
) -> Ended:
    """Ask the sandbox's node agent for its logs (``kind="logs"``), to run a command
    (``"exec"``) or to copy files (``"cp"``); output goes to ``on_output(stream, bytes)`` as
    it arrives. Once the session is open, ``driver(send)`` runs alongside (what a TTY or a copy
    sends); every other frame from the node goes to ``on_frame`` (awaited when a coroutine).
    The user's key
    (``identity``: key and certificate) must be registered in the log already: the node checks
    it there."""
    key, cert = identity
    node = await owning_node(gate, sandbox_id)
    client = PrivateKey.generate()
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    try:
        request = remote.sign_request(
            key,
            kind=kind,
            sandbox_id=sandbox_id,
            node_id=node,
            tenant=cert.tenant,
            producer=cert.subject,
            key_id=cert.key_id,
            reply_to=inbox,
            client_key=bytes(client.public_key),
            args=args,
        )
        parsed = remote.parse_request(request, kind)
        rid, rh = parsed.id, parsed.hash
        await nc.publish(remote.request_subject(node, kind), request, reply=inbox)
        box = await _answer(gate, sub, rid, rh, node, client)
        return await _stream(
            nc, sub, rh, node, box, on_output, stdin, driver=driver, on_frame=on_frame
        )
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def _next(sub: Any, node: str, what: str, timeout: float = remote.GONE_S) -> bytes:
    import nats.errors

    try:
        msg = await sub.next_msg(timeout=max(timeout, 0.01))
    except nats.errors.TimeoutError:
        raise Unreachable(
            f"the node agent of {node} {what} within {remote.GONE_S:.0f} s; is it running? "
            "(`dsec status`)"
        ) from None
    return bytes(msg.data)


async def first_genuine(
    sub: Any,
    timeout_s: float,
    believe: Callable[[bytes], Awaitable[T]],
    skip: type[Exception],
    unanswered: Callable[[str], Exception],
) -> T:
    """The first message on a request's inbox that ``believe`` takes (it raises ``skip`` for one
    it does not: anyone who read the request may publish there); ``unanswered(why)`` is raised
    when none came within ``timeout_s``, ``why`` saying what was skipped. A NATS "no
    responders" status is said then, not believed at once (anyone may publish one too)."""
    import nats.errors

    deadline = time.monotonic() + timeout_s
    ignored = ""
    while True:
        try:
            msg = await sub.next_msg(timeout=max(deadline - time.monotonic(), 0.01))
        except nats.errors.TimeoutError:
            raise unanswered(ignored) from None
        if not msg.data and (getattr(msg, "headers", None) or {}).get("Status") == "503":
            ignored = " (NATS: nothing subscribes to the request's subject)"
            continue
        try:
            return await believe(bytes(msg.data))
        except skip as exc:
            ignored = f" (ignored: {exc})"


async def _answer(gate: Any, sub: Any, rid: str, rh: bytes, node: str, client: PrivateKey) -> Any:
    """The session's box from the node's signed hello; a signed refusal raises. Anything else
    on the inbox is skipped, not believed; with nothing genuine within GONE_S, the node did
    not answer."""

    async def believe(data: bytes) -> Any:
        answer = remote.parse_answer(data)
        cert = await gate.keys.certificate(answer.key_id)
        if isinstance(cert, str) or cert.role != "nodeagent" or cert.node_id != node:
            raise RemoteError(f"an answer not signed by the node agent of {node}")
        return answer.check(bytes.fromhex(cert.public_key), rid, node, client, rh)

    def unanswered(why: str) -> Exception:
        return Unreachable(
            f"the node agent of {node} did not answer{why} within {remote.GONE_S:.0f} s; is it "
            "running? (`dsec status`)"
        )

    outcome = await first_genuine(sub, remote.GONE_S, believe, RemoteError, unanswered)
    if isinstance(outcome, tuple):
        reason, detail = outcome
        raise Refused(f"node {node} refused: {reason}: {detail}", reason)
    return outcome


async def _stream(
    nc: Any,
    sub: Any,
    rh: bytes,
    node: str,
    box: Any,
    on_output: Callable[[str, bytes], None],
    stdin: StdinFeeder | None,
    *,
    driver: Driver | None = None,
    on_frame: Callable[[dict[str, Any]], Any] | None = None,
) -> Ended:
    incoming, outgoing = FrameCodec(box), FrameCodec(box)
    input_subject = remote.request_subject(node, "input")

    async def send(frame: dict[str, Any]) -> None:
        await nc.publish(input_subject, remote.input_message(rh, outgoing.seal(frame)))

    async def keep_alive() -> None:
        while True:
            await asyncio.sleep(remote.ALIVE_S)
            await send({"k": "alive"})

    async def forward(feed: StdinFeeder) -> None:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        feed(queue)
        while (data := await queue.get()) is not None:
            await send({"k": "stdin", "d": data})
        await send({"k": "eof"})

    tasks = [asyncio.create_task(keep_alive())]
    if stdin is not None:
        tasks.append(asyncio.create_task(forward(stdin)))
    if driver is not None:
        tasks.append(asyncio.create_task(driver(send)))
    ended = False
    try:
        while True:
            try:
                frame = incoming.open(await _next(sub, node, "stopped answering"))
            except remote.ForgedFrame:
                continue  # not from the node (anyone may publish on the inbox): ignored
            except RemoteError as exc:
                raise RequestFailed(f"the stream from {node} broke: {exc}", str(exc)) from None
            if frame.get("k") == "out" and isinstance(frame.get("d"), bytes):
                on_output(str(frame.get("s")), frame["d"])
            elif frame.get("k") == "end":
                ended = True
                code = frame.get("code")
                details = {k: v for k, v in frame.items() if k not in ("k", "n", "code", "reason")}
                return Ended(
                    code if isinstance(code, int) else None, str(frame.get("reason")), details
                )
            elif on_frame is not None and frame.get("k") != "alive":
                result = on_frame(frame)
                if inspect.isawaitable(result):
                    await result
    finally:
        for task in tasks:
            task.cancel()
        if not ended:  # cancelled (Ctrl-C): tell the node at once rather than after its timeout
            with contextlib.suppress(Exception):
                await asyncio.shield(send({"k": "cancel"}))
                await nc.flush(timeout=1)


def bytes_feeder(data: bytes) -> StdinFeeder:
    """A feeder that sends ``data`` as the command's whole input, then its end."""

    def feed(queue: asyncio.Queue[bytes | None]) -> None:
        for i in range(0, len(data), remote.CHUNK):
            queue.put_nowait(data[i : i + remote.CHUNK])
        queue.put_nowait(None)

    return feed
