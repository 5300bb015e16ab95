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
import re
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

from prometheus_client import Counter

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
MAX_BRACKETS = 64
"""Brackets and braces a decision datagram may hold outside its strings: the layer sends one
flat object; more is refused unparsed (nesting that deep could only be an attack)."""
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')
"""A JSON string literal (what the bracket count skips)."""


def _brackets(data: bytes) -> int:
    return data.count(b"[") + data.count(b"{")


SLICE_BUDGET = 128
"""Datagrams read per :data:`SLICE_S` at most (about 2,500/s per sandbox)."""
SLICE_S = 0.05
MALFORMED = Counter(
    "dsec_semantic_reports_malformed_total", "Datagrams on a sandbox's events socket not decodable"
)
THROTTLED = Counter(
    "dsec_semantic_reports_throttled_total",
    "Times a sandbox's semantic channel spent its read budget (further datagrams wait or drop)",
)

DecisionHandler = Callable[[SemanticDecision], Awaitable[None]]


class DecisionChannel:
    """Receives a sandbox's decisions, counts them and hands them to ``handler``.

    Reads at most :data:`SLICE_BUDGET` datagrams per :data:`SLICE_S`: a sandbox sending
    datagrams in a loop costs the node agent a bounded share of its loop. Past the budget the
    socket is left alone until the next slice; its queue fills and the sandbox's non-blocking
    sends fail (its runtime drops the report; a forger's blocking send waits).
    """

    def __init__(self, sandbox_id: str, path: Path, handler: DecisionHandler | None) -> None:
        self.sandbox_id = sandbox_id
        self.path = path
        self.handler = handler
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._watching = False
        self._slice_start = 0.0
        self._slice_used = 0
        self._resume: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._warned = False

    @classmethod
    async def open(
        cls, sandbox_id: str, path: Path, uid: int, handler: DecisionHandler | None
    ) -> DecisionChannel:
        """Bind ``path`` (only ``uid`` and root may send) and start receiving."""
        channel = cls(sandbox_id, path, handler)
        path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_NONBLOCK)
        # Bound through its directory's descriptor: a node's home may be deep (the extra nodes of
        # one machine live in $DSEC_HOME/nodes/<node>/), beyond AF_UNIX's 108-byte path limit.
        parent = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            sock.bind(f"/proc/self/fd/{parent}/{path.name}")
        finally:
            os.close(parent)
        os.chown(path, uid, uid)
        os.chmod(path, 0o600)
        channel._sock = sock
        channel._loop = asyncio.get_running_loop()
        channel._loop.add_reader(sock.fileno(), channel._readable)
        channel._watching = True
        return channel

    def _readable(self) -> None:
        assert self._sock is not None and self._loop is not None
        now = self._loop.time()
        if now - self._slice_start >= SLICE_S:
            self._slice_start, self._slice_used = now, 0
        while self._slice_used < SLICE_BUDGET:
            try:
                data = self._sock.recv(MAX_DATAGRAM)
            except (BlockingIOError, InterruptedError):
                return
            self._slice_used += 1
            self.received(data)
        THROTTLED.inc()
        self._unwatch()
        self._resume = self._loop.call_at(self._slice_start + SLICE_S, self._rewatch)

    def _unwatch(self) -> None:
        if self._watching and self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._watching = False

    def _rewatch(self) -> None:
        self._resume = None
        if not self._watching and self._sock is not None and self._loop is not None:
            self._loop.add_reader(self._sock.fileno(), self._readable)
            self._watching = True

    def received(self, data: bytes) -> None:
        """Decode one datagram; malformed ones are logged, never trusted.

        A decision is one flat JSON object: a datagram with more than :data:`MAX_BRACKETS`
        brackets and braces is refused before parsing (``[[[[...`` made the parser recurse
        until RecursionError, ~0.3 ms and a traceback each), and no exception the sandbox can
        shape escapes.
        """
        try:
            if _brackets(data) > MAX_BRACKETS and _brackets(_STRINGS.sub(b"", data)) > MAX_BRACKETS:
                raise ValueError("not a flat decision object")  # (strings may hold any number)
            raw = json.loads(data)
            decision = SemanticDecision.model_validate({**raw, "sandbox_id": self.sandbox_id})
        except Exception as exc:  # (ValueError, ValidationError, TypeError, RecursionError...)
            MALFORMED.inc()
            if not self._warned:  # once per sandbox: a flood of garbage must not flood the log
                self._warned = True
                log.warning("sandbox %s sent a malformed decision: %.200s", self.sandbox_id, exc)
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
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        self._unwatch()
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
