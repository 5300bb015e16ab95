"""Calls between nodes: the brokers bridge shared-memory channels over NATS request-reply.

Caller on node A -> (shm) -> broker A -> NATS ``dsec_ipc.<tenant>.<group>.<agent>.<tool>``
-> broker B -> (shm) -> agent on node B, and back. Agents see the same API and the same errors as
locally, and sandboxes need no network access to NATS: only the node agents talk to it. The
tenant in every subject keeps two tenants' agents of one group name apart across nodes too.

A reply carries one byte of frame kind (RESULT or ERROR) then the frame body, unchanged.
A broker answers ``dsec_ipc.<tenant>.<group>.<agent>._locate`` for every agent it serves, which
is how another broker learns that a name lives elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import Counter
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

import nats
import nats.errors
from dsec_sdk.errors import PeerGone
from dsec_sdk.ipc import channel as ch
from dsec_sdk.ipc import codec, control
from dsec_sdk.ipc.aio import AsyncCaller, AsyncServeLoop
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from dsec_nodeagent.ipc import metrics
from dsec_nodeagent.ipc.limits import ServerBusy
from dsec_nodeagent.ipc.registry import AgentKey

if TYPE_CHECKING:
    from dsec_nodeagent.ipc.broker import Broker, Connection

log = logging.getLogger(__name__)

LOCATE: Final = "_locate"
# A node that serves nobody by that name answers at once (NATS: no responders); this bounds only
# a serving node that is slow to say so (a loaded machine missed 1 s: a false "not found").
LOCATE_TIMEOUT_S: Final = 5.0
LIVENESS_EVERY_S: Final = 1.0
# A call without a timeout still gets one across nodes: a vanished node must not hold it forever.
DEFAULT_REMOTE_TIMEOUT_S: Final = 300.0
# The longest a call across nodes may wait, whatever its caller asks: each holds a task here and
# one on the serving node.
MAX_REMOTE_TIMEOUT_S: Final = 3600.0
# Calls of one sandbox forwarded to other nodes at once (each a task here and one on the serving
# node, and a liveness question a second): beyond it a call is answered ``busy`` at once. One
# sandbox wrote 3,000 requests into a proxy channel without reading an answer and held 3,000
# tasks on both nodes.
FORWARDS_PER_SANDBOX: Final = 256


class RemoteBridge:
    """The NATS side of one broker."""

    def __init__(self, broker: Broker) -> None:
        self.broker = broker
        self.nc: NATS | None = None
        self._packer = codec.new_packer()
        self._subs: dict[AgentKey, Subscription] = {}
        self._targets: dict[int, tuple[AgentKey, str]] = {}  # channel -> (callee, caller sandbox)
        self._forwarding: Counter[str] = Counter()  # caller sandbox -> its calls in flight
        # key -> (when asked, the answer): one liveness question a key at a time, not one a call
        self._liveness: dict[AgentKey, tuple[float, asyncio.Future[bool]]] = {}
        # This node's own channel to each local agent called from other nodes, and the server
        # connection it reaches (a hand-over's release moves only a channel to the old one).
        self._inbound: dict[AgentKey, tuple[AsyncCaller, Connection]] = {}
        self._doorbell = -1
        self._proxy: AsyncServeLoop | None = None
        self._proxy_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        """Connect to NATS (``options``: credentials, TLS) and start serving proxy channels."""
        self.nc = await nats.connect(
            url.split(","),  # a cluster's servers, comma-separated (DSEC_NATS_URL)
            name=f"dsec-ipc-{self.broker.node_id}",
            **dict(options or {}),
        )
        self._doorbell = ch.new_eventfd()
        self._proxy = AsyncServeLoop(self._doorbell, bytes, self._on_proxy_request)
        self._proxy_task = asyncio.get_running_loop().create_task(self._proxy.run())

    async def stop(self) -> None:
        """Stop serving, unsubscribe, close NATS."""
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._proxy is not None and self._proxy_task is not None:
            self._proxy.stop()
            await self._proxy_task
        for caller, _ in self._inbound.values():
            caller.close()
        self._inbound.clear()
        if self.nc is not None:
            for sub in self._subs.values():
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
            self._subs.clear()
            await self.nc.close()
            self.nc = None
        if self._doorbell >= 0:
            os.close(self._doorbell)
            self._doorbell = -1

    # ------------------------------------------------------------------ registry over NATS
    async def export(self, key: AgentKey) -> None:
        """Answer calls from other nodes for the local agent ``key``."""
        assert self.nc is not None

        async def on_message(msg: Msg) -> None:
            self._spawn(self._on_remote_call(key, msg))

        sub = await self.nc.subscribe(key.subject("*"), cb=on_message)
        await self.nc.flush()
        # Checked after the awaits: the server may have left meanwhile (its unexport found
        # nothing yet), or another export of the name finished first. A subscription kept then
        # answered for a name nobody here serves, for good (unexport only knows the one in
        # _subs), and two ran each call from another node twice.
        if key in self._subs or self.broker.local_server(key) is None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
            return
        self._subs[key] = sub

    async def unexport(self, key: AgentKey) -> None:
        """Stop answering for ``key`` (it left this node)."""
        sub = self._subs.pop(key, None)
        if sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
        inbound = self._inbound.pop(key, None)
        if inbound is not None:
            inbound[0].close()

    def moved(self, key: AgentKey, server: Connection) -> int:
        """A final hand-over took ``key`` from ``server`` for good (the broker's ``release``):
        if calls from other nodes reach it through this bridge's channel, that channel moves
        now, not when the old process dies. An answer already written is delivered; a call
        the old server never read ends untaken and :meth:`_call_local` sends it again, to the
        new server. Returns how many channels moved (0 or 1)."""
        inbound = self._inbound.get(key)
        if inbound is None or inbound[1] is not server:
            return 0
        del self._inbound[key]
        caller = inbound[0]
        if caller.closed:  # (failed already: the next call opens a channel to the new server)
            return 0
        caller.moved()
        return 1

    async def locate(self, key: AgentKey) -> bool:
        """Whether another node's broker serves ``key``."""
        assert self.nc is not None
        try:
            await self.nc.request(key.subject(LOCATE), b"", timeout=LOCATE_TIMEOUT_S)
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError, TimeoutError):
            return False
        return True

    async def _still_there(self, key: AgentKey) -> bool:
        """:meth:`locate`, asked once for all the calls to ``key`` waiting now (each asked
        every second: a sandbox's calls in flight were as many questions a second)."""
        now = time.monotonic()
        asked = self._liveness.get(key)
        if asked is None or now - asked[0] >= LIVENESS_EVERY_S / 2:
            if len(self._liveness) > 1024:  # forget old answers (one per key called)
                cutoff = now - LIVENESS_EVERY_S
                self._liveness = {k: a for k, a in self._liveness.items() if a[0] >= cutoff}
            task = asyncio.get_running_loop().create_task(self.locate(key))
            self._tasks.add(task)  # (stop() cancels it)
            task.add_done_callback(self._tasks.discard)
            asked = (now, task)
            self._liveness[key] = asked
        return await asyncio.shield(asked[1])

    def proxy_channels(self) -> int:
        """Proxy channels this broker serves now (each holds 5 fds here)."""
        return len(self._proxy.core.channels) if self._proxy is not None else 0

    def forget(self, conn: Connection) -> None:
        """A connection closed; its proxy channels are reaped through their pidfds."""

    # ------------------------------------------------------------------ outbound (caller here)
    def open_proxy(self, key: AgentKey, caller: Connection) -> tuple[int, list[int]]:
        """A channel whose server end is this broker, forwarding to ``key`` over NATS.

        Returns the channel id and the fds for the caller (the broker sends, then closes them).
        """
        assert self._proxy is not None
        fds = ch.create_channel(self.broker.ring_capacity, self.broker.max_payload)
        channel_id = self.broker.new_channel_id()
        server_fds = [os.dup(fd) for fd in fds.all()] + [os.dup(caller.pidfd)]
        end = ch.ServerEnd(
            channel_id=channel_id,
            peer=caller.name,
            capacity=self.broker.ring_capacity,
            fds=server_fds,
            doorbell=self._doorbell,
            max_payload=self.broker.max_payload,
        )
        if len(self._targets) > 2 * len(self._proxy.core.channels) + 64:  # forget closed ones
            live = {e.channel_id for e in self._proxy.core.channels}
            self._targets = {c: t for c, t in self._targets.items() if c in live}
        self._targets[channel_id] = (key, caller.sandbox)
        self._proxy.add(end)
        return channel_id, [*fds.all(), os.dup(self._doorbell), os.dup(self.broker.self_pidfd)]

    def _on_proxy_request(self, end: ch.ServerEnd, call_id: int, body: bytes) -> None:
        assert self._proxy is not None
        target = self._targets.get(end.channel_id)
        sandbox = target[1] if target is not None else ""
        if self._forwarding[sandbox] >= FORWARDS_PER_SANDBOX:
            text = (
                f"this sandbox has {FORWARDS_PER_SANDBOX} calls to other nodes in flight, the "
                "most one sandbox may; retry when one ends"
            )
            reply = self._busy(text)
            metrics.observe_remote("out", codec.ERROR, reply, 0.0)
            self._proxy.respond(end, codec.ERROR, call_id, reply)
            return
        self._forwarding[sandbox] += 1
        self._spawn(self._forward(end, call_id, body, sandbox))

    async def _forward(self, end: ch.ServerEnd, call_id: int, body: bytes, sandbox: str) -> None:
        assert self._proxy is not None
        started = time.perf_counter()
        try:
            kind, reply = await self._forward_body(end, body)
        except Exception as exc:
            log.exception("ipc: forwarding a call over NATS failed")
            text = f"the bridge to the other node failed: {type(exc).__name__}: {exc}"
            kind, reply = codec.ERROR, self._error(codec.E_PEER_GONE, "PeerGone", text)
        finally:
            self._forwarding[sandbox] -= 1
            if self._forwarding[sandbox] <= 0:
                del self._forwarding[sandbox]
        # Counted before answering: whoever reads the metrics after the call sees it.
        metrics.observe_remote("out", kind, reply, time.perf_counter() - started)
        self._proxy.respond(end, kind, call_id, reply)

    async def _forward_body(self, end: ch.ServerEnd, body: bytes) -> tuple[int, bytes]:
        assert self.nc is not None
        target = self._targets.get(end.channel_id)
        key = target[0] if target is not None else None
        kind, reply = codec.ERROR, b""
        try:
            tool, timeout_s = _parse_request(body)
        except ValueError as exc:
            reply = self._error(codec.E_BAD_ARGUMENTS, "ProtocolError", str(exc))
        else:
            if key is None:
                reply = self._error(codec.E_PEER_GONE, "PeerGone", "the channel is unknown")
            elif len(body) > self.nc.max_payload:
                reply = self._error(
                    codec.E_TOO_LARGE,
                    "PayloadTooLarge",
                    f"request is {len(body)} bytes; NATS between nodes takes at most "
                    f"{self.nc.max_payload} bytes",
                )
            else:
                kind, reply = await self._request(key, tool, body, timeout_s)
        return kind, reply

    async def _request(
        self, key: AgentKey, tool: str, body: bytes, timeout_s: float
    ) -> tuple[int, bytes]:
        assert self.nc is not None
        request = asyncio.ensure_future(self.nc.request(key.subject(tool), body, timeout=timeout_s))
        try:
            # NATS drops a request whose responder unsubscribes at the wrong moment (only the
            # timeout would end it), so while waiting, ask now and then whether the agent still
            # lives: the cross-node twin of watching a local peer's pidfd.
            while not (await asyncio.wait({request}, timeout=LIVENESS_EVERY_S))[0]:
                if not await self._still_there(key):
                    request.cancel()
                    text = "it left its node during the call"
                    return codec.ERROR, self._error(codec.E_PEER_GONE, "PeerGone", text)
            msg = request.result()
        except nats.errors.NoRespondersError:
            text = "no node serves it any more"
            return codec.ERROR, self._error(codec.E_PEER_GONE, "PeerGone", text)
        except (nats.errors.TimeoutError, TimeoutError):
            text = f"no answer from the remote node within {timeout_s:g} s"
            return codec.ERROR, self._error(codec.E_TIMEOUT, "CallTimeout", text)
        finally:
            if not request.done():
                request.cancel()
        data = msg.data
        if not data or data[0] not in (codec.RESULT, codec.ERROR):
            return codec.ERROR, self._error(codec.E_REMOTE, "ProtocolError", "malformed reply")
        return data[0], data[1:]

    # ------------------------------------------------------------------ inbound (server here)
    async def _on_remote_call(self, key: AgentKey, msg: Msg) -> None:
        try:
            await self._answer_remote_call(key, msg)
        except Exception as exc:
            # Whatever broke, the calling node gets an answer rather than waiting out its timeout.
            log.exception("ipc: remote call to %s failed", key)
            text = f"the serving node failed: {type(exc).__name__}: {exc}"
            await self._reply(msg, codec.ERROR, self._error(codec.E_PEER_GONE, "PeerGone", text))

    async def _answer_remote_call(self, key: AgentKey, msg: Msg) -> None:
        tool = msg.subject.rsplit(".", 1)[-1]
        if tool == LOCATE:
            await msg.respond(self.broker.node_id.encode())
            return
        try:
            _, timeout_s = _parse_request(msg.data)
        except ValueError as exc:
            await self._reply(
                msg, codec.ERROR, self._error(codec.E_BAD_ARGUMENTS, "ProtocolError", str(exc))
            )
            return
        started = time.perf_counter()
        kind, body = await self._call_local(key, msg.data, timeout_s)
        metrics.observe_remote("in", kind, body, time.perf_counter() - started)
        assert self.nc is not None
        if len(body) + 1 > self.nc.max_payload:
            kind, body = (
                codec.ERROR,
                self._error(
                    codec.E_TOO_LARGE,
                    "PayloadTooLarge",
                    f"response is {len(body)} bytes; NATS between nodes takes at most "
                    f"{self.nc.max_payload} bytes",
                ),
            )
        await self._reply(msg, kind, body)

    async def _call_local(self, key: AgentKey, body: bytes, timeout_s: float) -> tuple[int, bytes]:
        try:
            return await self._call_local_server(key, body, timeout_s)
        except ServerBusy as exc:  # (its control socket is full: it stays, the caller retries)
            return codec.ERROR, self._busy(str(exc))

    async def _call_local_server(
        self, key: AgentKey, body: bytes, timeout_s: float
    ) -> tuple[int, bytes]:
        caller = self._inbound_caller(key)
        if caller is None:
            return codec.ERROR, self._error(codec.E_PEER_GONE, "PeerGone", "it left its node")
        deadline = time.perf_counter_ns() + int(timeout_s * 1e9)
        try:
            frame = await caller.call(codec.REQUEST, body, deadline)
        except PeerGone as exc:
            self._forget_inbound(key, caller)
            retry = self._inbound_caller(key) if exc.untaken else None
            if retry is None:
                return codec.ERROR, self._error(codec.E_PEER_GONE, "PeerGone", exc.reason)
            # The server left before reading it, and another serves the name now (a hand-over
            # switched it): once more, to that one.
            try:
                frame = await retry.call(codec.REQUEST, body, deadline)
            except PeerGone as again:
                self._forget_inbound(key, retry)
                return codec.ERROR, self._error(codec.E_PEER_GONE, "PeerGone", again.reason)
        if frame is None:
            text = f"no answer within {timeout_s:g} s"
            return codec.ERROR, self._error(codec.E_TIMEOUT, "CallTimeout", text)
        kind, value = frame
        return kind, bytes(value)

    def _forget_inbound(self, key: AgentKey, caller: AsyncCaller) -> None:
        """``caller`` failed: the next call to ``key`` opens a channel afresh (unless another
        call already did)."""
        inbound = self._inbound.get(key)
        if inbound is not None and inbound[0] is caller:
            del self._inbound[key]

    def _inbound_caller(self, key: AgentKey) -> AsyncCaller | None:
        inbound = self._inbound.get(key)
        if inbound is not None and not inbound[0].closed:
            return inbound[0]
        server = self.broker.local_server(key)
        if server is None:
            return None
        caller_name = f"remote-via-{self.broker.node_id}"
        opened = self.broker.open_channel(server, caller_name, self.broker.self_pidfd)
        if opened is None:
            return None
        channel_id, fds = opened
        end = ch.CallerEnd(
            channel_id=channel_id,
            peer=key.agent,
            capacity=self.broker.ring_capacity,
            fds=fds,
            max_payload=self.broker.max_payload,
            spin_ns=0,
        )
        caller = AsyncCaller(end, bytes)
        self._inbound[key] = (caller, server)
        return caller

    # ------------------------------------------------------------------ helpers
    async def _reply(self, msg: Msg, kind: int, body: bytes) -> None:
        with contextlib.suppress(nats.errors.Error):
            await msg.respond(bytes([kind]) + body)

    def _error(self, code: str, error_type: str, text: str) -> bytes:
        return codec.encode_error(self._packer, code, error_type, text)

    def _busy(self, text: str) -> bytes:
        return self._error(codec.E_BUSY, "ServerBusy", text)

    def _spawn(self, coro: Any) -> None:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(_finished)
        task.add_done_callback(self._tasks.discard)


def _parse_request(body: bytes) -> tuple[str, float]:
    """The tool name and the timeout of a REQUEST body (``ValueError`` if malformed)."""
    try:
        frame = codec.unpack(body)
        if isinstance(frame, list) and len(frame) == 4:  # with the caller's traceparent
            frame = frame[:3]
        tool, arguments, timeout_ms = frame
    except (ValueError, TypeError) as exc:
        raise ValueError(f"malformed request: {exc}") from exc
    if not isinstance(arguments, dict) or not isinstance(timeout_ms, int) or timeout_ms < 0:
        raise ValueError("malformed request: expected [tool, {arguments}, timeout_ms]")
    control.check_tool_name(tool)
    if not timeout_ms:
        return tool, DEFAULT_REMOTE_TIMEOUT_S
    return tool, min(timeout_ms / 1000, MAX_REMOTE_TIMEOUT_S)


def _finished(task: asyncio.Task[None]) -> None:
    """Log a background task's crash (it would otherwise vanish silently)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("ipc: background task failed", exc_info=task.exception())
