"""The node agent's end of the semantic layer: a Unix datagram socket per sandbox.

A datagram socket (not a pipe fd) because every Python process of the sandbox — including
children started with ``close_fds=True`` — can reach it by path, each decision is one message
(no framing), and a slow node agent drops decisions instead of blocking the workload.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

from prometheus_client import Counter
from pydantic import ValidationError

from dsec_nodeagent.refusals import metric_rule
from dsec_nodeagent.semantic.models import SemanticDecision

log = logging.getLogger(__name__)

DECISIONS = Counter(
    "dsec_semantic_decisions_total",
    "Decisions the in-sandbox semantic layer reported (labels from a bounded set; unknown "
    "values of a sandbox are counted as 'unknown')",
    ["on", "action", "rule"],
)
_ONS = frozenset({"open", "subprocess", "connect", "http"})
_ACTIONS = frozenset({"allow", "redirect", "log", "deny"})
MAX_DATAGRAM = 16 * 1024

DecisionHandler = Callable[[SemanticDecision], Awaitable[None]]


class _Protocol(asyncio.DatagramProtocol):
    def __init__(self, channel: DecisionChannel) -> None:
        self.channel = channel

    def datagram_received(self, data: bytes, addr: object) -> None:
        self.channel.received(data)


class DecisionChannel:
    """Receives a sandbox's decisions, counts them and hands them to ``handler``."""

    def __init__(self, sandbox_id: str, path: Path, handler: DecisionHandler | None) -> None:
        self.sandbox_id = sandbox_id
        self.path = path
        self.handler = handler
        self._transport: asyncio.DatagramTransport | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @classmethod
    async def open(
        cls, sandbox_id: str, path: Path, uid: int, handler: DecisionHandler | None
    ) -> DecisionChannel:
        """Bind ``path`` (only ``uid`` and root may send) and start receiving."""
        channel = cls(sandbox_id, path, handler)
        path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.bind(str(path))
        os.chown(path, uid, uid)
        os.chmod(path, 0o600)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(lambda: _Protocol(channel), sock=sock)
        channel._transport = transport
        return channel

    def received(self, data: bytes) -> None:
        """Decode one datagram; malformed ones are logged, never trusted."""
        try:
            raw = json.loads(data)
            decision = SemanticDecision.model_validate({**raw, "sandbox_id": self.sandbox_id})
        except (ValueError, ValidationError, TypeError) as exc:
            log.warning("sandbox %s sent a malformed decision: %s", self.sandbox_id, exc)
            return
        DECISIONS.labels(
            decision.on if decision.on in _ONS else "unknown",
            decision.action if decision.action in _ACTIONS else "unknown",
            metric_rule(decision.rule) if decision.rule else "-",
        ).inc()
        if self.handler is not None:
            task = asyncio.ensure_future(self.handler(decision))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        """Stop receiving, wait for handlers in flight, remove the socket file."""
        if self._transport is not None:
            self._transport.close()
            self._transport = None
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
