"""The CLI's side of remote logs and exec (protocol: :mod:`dsec_core.remote`).

The owning node comes from the sandbox's authentic ``sandbox.ready`` / ``sandbox.scheduled``;
the request is signed with the user's certified key; the node agent's answer must be signed by
a key the operator root certified for that node; everything after it is encrypted between two
one-time X25519 keys.
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import inspect
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from dsec_core import remote
from dsec_core.remote import FrameCodec, Kind, RemoteError
from dsec_core.subjects import InvalidSubjectToken, subject_for
from dsec_core.text import escape_controls
from nacl.public import PrivateKey

from dsec_cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_UNREACHABLE,
    bus,
    cli_gate,
    cli_publisher,
    fail,
    user_identity,
)

_NOT_THERE = {"not-found", "not-running", "not-allowed"}
Send = Callable[[dict[str, Any]], Coroutine[Any, Any, None]]
"""Sends one frame to the node (encrypted): what a session's ``driver`` is given."""


@dataclass(frozen=True)
class Ended:
    """How a session ended: the command's exit code (exec) and why."""

    code: int | None
    reason: str
    details: dict[str, Any] = field(default_factory=dict)
    """The end frame's other fields (a cp's ``files`` and ``bytes``)."""


class Sink:
    """Where output goes: the raw bytes when piped; on a terminal, text with the control
    characters the sandbox wrote shown escaped (line breaks kept)."""

    def __init__(self, out: BinaryIO, *, terminal: bool) -> None:
        self.out = out
        self.terminal = terminal
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def write(self, data: bytes, *, final: bool = False) -> None:
        if self.terminal:
            text = self._decoder.decode(data, final=final)
            data = "\n".join(escape_controls(line) for line in text.split("\n")).encode()
        if data:
            self.out.write(data)
            self.out.flush()


async def _owning_node(gate: Any, sandbox_id: str) -> str:
    """The node that runs (or ran) the sandbox: that of its latest placement (the trust gate's
    rule: attempts only grow, so an old ``sandbox.scheduled`` published again does not send
    the request to a node the sandbox left), else of its newest authentic ``sandbox.ready``."""
    try:
        subjects = [subject_for(t, sandbox_id) for t in ("sandbox.ready", "sandbox.scheduled")]
    except InvalidSubjectToken as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    placed = await gate.placement(sandbox_id)
    if placed is not None:
        return str(placed)
    found = [e for e in [await gate.find(s) for s in subjects] if e is not None]
    if not found:
        submitted = await gate.find(subject_for("spec.submitted", sandbox_id))
        if submitted is None:
            fail(f"no sandbox {sandbox_id!r} in the event log (see `dsec sandbox list`)", 2)
        fail(f"{sandbox_id} has not been placed on a node yet (`dsec sandbox show`)", 1)
    newest = max(found, key=lambda e: e.time)
    return str(newest.payload["node_id"])


def _stdin_reader(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[bytes | None]) -> None:
    """Read this process's stdin in a daemon thread (a terminal may never give EOF; the
    process must still be able to exit when the command ends)."""
    import sys

    source = getattr(sys.stdin, "buffer", None)

    def pump() -> None:
        try:
            while source is not None:
                read = getattr(source, "read1", source.read)
                data = read(remote.CHUNK)
                if not data:
                    break
                loop.call_soon_threadsafe(queue.put_nowait, data)
        except (OSError, ValueError):
            pass
        loop.call_soon_threadsafe(queue.put_nowait, None)

    threading.Thread(target=pump, name="dsec-stdin", daemon=True).start()


async def session(
    kind: Kind,
    sandbox_id: str,
    args: dict[str, Any],
    on_output: Callable[[str, bytes], None],
    *,
    forward_stdin: bool = False,
    driver: Callable[[Send], Coroutine[Any, Any, None]] | None = None,
    on_frame: Callable[[dict[str, Any]], Any] | None = None,
) -> Ended:
    """Ask the sandbox's node agent for its logs (``kind="logs"``), to run a command
    (``"exec"``) or to copy files (``"cp"``); output goes to ``on_output(stream, bytes)`` as
    it arrives. Once the session is open, ``driver(send)`` runs alongside (what a TTY or a copy
    sends); every other frame from the node goes to ``on_frame`` (awaited when a coroutine)."""
    key, cert = user_identity()
    async with bus() as (nc, js):
        gate = cli_gate(nc, js)
        if gate is None:
            fail("remote logs and exec need the operator's trust root (`dsec login`)", 2)
        node = await _owning_node(gate, sandbox_id)
        await cli_publisher(js)  # the key is registered in the log, where the node checks it
        client = PrivateKey.generate()
        inbox = nc.new_inbox()
        sub = await nc.subscribe(inbox)
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
        rid = str(remote.parse_request(request, kind).id)
        await nc.publish(remote.request_subject(node, kind), request, reply=inbox)
        box = await _answer(gate, sub, rid, node, client)
        return await _stream(
            nc, sub, rid, node, box, on_output, forward_stdin, driver=driver, on_frame=on_frame
        )


async def _next(sub: Any, node: str, what: str, timeout: float = remote.GONE_S) -> bytes:
    import nats.errors

    try:
        msg = await sub.next_msg(timeout=max(timeout, 0.01))
    except nats.errors.TimeoutError:
        fail(
            f"the node agent of {node} {what} within {remote.GONE_S:.0f} s; is it running? "
            "(`dsec status`)",
            EXIT_UNREACHABLE,
        )
    return bytes(msg.data)


async def _answer(gate: Any, sub: Any, rid: str, node: str, client: PrivateKey) -> Any:
    """The session's box from the node's signed hello; a signed refusal exits. Anything else
    on the inbox (anyone who read the request may publish there) is skipped, not believed;
    with nothing genuine within GONE_S, the node did not answer."""
    deadline = time.monotonic() + remote.GONE_S
    problem = ""
    while True:
        try:
            data = await _next(sub, node, f"did not answer{problem}", deadline - time.monotonic())
            answer = remote.parse_answer(data)
            cert = await gate.keys.certificate(answer.key_id)
            if isinstance(cert, str) or cert.role != "nodeagent" or cert.node_id != node:
                raise RemoteError(f"an answer not signed by the node agent of {node}")
            outcome = answer.check(bytes.fromhex(cert.public_key), rid, node, client)
            break
        except RemoteError as exc:
            problem = f" (ignored: {exc})"
    if isinstance(outcome, tuple):
        reason, detail = outcome
        fail(f"node {node} refused: {reason}: {detail}", 2 if reason in _NOT_THERE else 1)
    return outcome


async def _stream(
    nc: Any,
    sub: Any,
    rid: str,
    node: str,
    box: Any,
    on_output: Callable[[str, bytes], None],
    forward_stdin: bool,
    *,
    driver: Callable[[Send], Coroutine[Any, Any, None]] | None = None,
    on_frame: Callable[[dict[str, Any]], Any] | None = None,
) -> Ended:
    incoming, outgoing = FrameCodec(box), FrameCodec(box)
    input_subject = remote.request_subject(node, "input")

    async def send(frame: dict[str, Any]) -> None:
        await nc.publish(input_subject, remote.input_message(rid, outgoing.seal(frame)))

    async def keep_alive() -> None:
        while True:
            await asyncio.sleep(remote.ALIVE_S)
            await send({"k": "alive"})

    async def forward() -> None:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        _stdin_reader(asyncio.get_running_loop(), queue)
        while (data := await queue.get()) is not None:
            await send({"k": "stdin", "d": data})
        await send({"k": "eof"})

    tasks = [asyncio.create_task(keep_alive())]
    if forward_stdin:
        tasks.append(asyncio.create_task(forward()))
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
                fail(f"the stream from {node} broke: {exc}", EXIT_FAILED)
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
        if not ended:  # Ctrl-C: tell the node at once rather than after its timeout
            with contextlib.suppress(Exception):
                await asyncio.shield(send({"k": "cancel"}))
                await nc.flush(timeout=1)
