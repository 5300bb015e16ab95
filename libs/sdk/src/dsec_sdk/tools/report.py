"""Reports of tool calls to the node agent, over the broker connection the SDK already has.

A sandbox has no identity on the bus: the node agent publishes ``tool.degraded`` /
``tool.recovered`` and exports the ``dsec_tool_*`` metrics from these reports, attributing them
to the sandbox the connection comes from (its cgroup), never to what the report claims.

One report is one control message (see :mod:`dsec_sdk.ipc.control`)::

    {"op": "tools", "calls": [[tool, side, outcome, class, ms, attempts, status, via, trace_id],
                              ...], "dropped": int}

``side``: ``call`` (made through the pipeline or ``call_tool``) or ``serve`` (a tool this agent
served); ``outcome``: ``ok``, ``error`` or ``rejected`` (an open breaker); ``class``: a failure
class or ``""``; ``status``: the HTTP status or 0; ``via``: the tool this one stood in for as a
fallback, or ``""``. No arguments, results or messages ever leave the sandbox this way.

Calls are sent in batches (at most :data:`MAX_BATCH`, every :data:`FLUSH_S`, and at once after
a failure); at most :data:`MAX_PENDING` wait, past that the oldest are dropped and counted. Where
no broker answers (outside a sandbox) reporting turns itself off.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import threading
from collections import deque
from pathlib import Path
from typing import Any, Final

MAX_BATCH: Final = 256
MAX_PENDING: Final = 4096
FLUSH_S: Final = 0.5

Record = tuple[str, str, str, str, float, int, int, str, str]


class Reporter:
    """Collects call records; :class:`BrokerReporter` sends them, this one only keeps them."""

    def __init__(self) -> None:
        self.sent: deque[Record] = deque(maxlen=MAX_PENDING)  # the newest, for inspection

    def record(self, record: Record) -> None:
        self.sent.append(record)

    def flush(self) -> None:
        """Send what waits (no-op here)."""

    def close(self) -> None:
        """Flush and stop."""


class BrokerReporter(Reporter):
    """Sends records to the node agent's broker from a background thread.

    Args:
        socket_path: the broker's socket (default: the SDK's).
        agent: this agent's name (the broker checks it against the sandbox's identity).
        group: its task group.
    """

    def __init__(
        self, socket_path: Path | None = None, agent: str | None = None, group: str | None = None
    ) -> None:
        super().__init__()
        self._socket_path = socket_path
        self._agent = agent
        self._group = group
        self._pending: deque[Record] = deque(maxlen=MAX_PENDING)
        self._dropped = 0
        self._lock = threading.Lock()  # starting the thread
        self._flush_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._off = False
        self._link: Any = None
        self._thread: threading.Thread | None = None

    def record(self, record: Record) -> None:
        if self._off:
            return
        pending = self._pending
        if len(pending) == MAX_PENDING:
            self._dropped += 1  # the deque drops the oldest itself
        pending.append(record)  # deque.append is atomic: no lock on the hot path
        if self._thread is None:
            self._start()
        if record[2] != "ok" or len(pending) >= MAX_BATCH:
            self._wake.set()

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="dsec-tool-reports", daemon=True
                )
                self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait(FLUSH_S)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        # One flusher at a time, taking and sending under the same lock: batches reach the node
        # agent in the order the calls happened (it counts failures in a row).
        with self._flush_lock:
            while not self._off:
                batch: list[Record] = []
                try:
                    while len(batch) < MAX_BATCH:
                        batch.append(self._pending.popleft())  # atomic, beside append()
                except IndexError:
                    pass
                if not batch:
                    return
                dropped, self._dropped = self._dropped, 0
                self._send({"op": "tools", "calls": [list(r) for r in batch], "dropped": dropped})

    def _send(self, message: dict[str, Any]) -> None:
        from dsec_sdk.errors import BrokerUnavailable
        from dsec_sdk.ipc import control

        if self._link is None:
            try:
                self._link = self._connect()
            except (BrokerUnavailable, OSError, ValueError):
                self._off = True  # no node agent here: reporting is off for this process
                return
        try:
            control.send(self._link.sock, message)
        except OSError:
            with contextlib.suppress(OSError):
                self._link.close()
            self._link = None  # a restarted broker: connect again with the next batch

    def _connect(self) -> Any:
        from dsec_sdk.client import DEFAULT_GROUP, default_socket_path
        from dsec_sdk.ipc.link import BrokerLink

        agent = self._agent or os.environ.get("DSEC_AGENT_NAME") or f"agent-{os.getpid()}"
        group = self._group or os.environ.get("DSEC_TASK_GROUP") or DEFAULT_GROUP
        return BrokerLink(self._socket_path or default_socket_path(), agent, group, "caller")

    def close(self) -> None:
        self.flush()
        self._closed = True
        self._wake.set()
        if self._link is not None:
            with contextlib.suppress(OSError):
                self._link.close()
            self._link = None


_default: Reporter | None = None
_default_lock = threading.Lock()
_shared: dict[tuple[str, str, str], BrokerReporter] = {}


def shared_reporter(socket_path: Path, agent: str, group: str) -> BrokerReporter:
    """One reporter (one broker connection) per broker, agent and group in this process, sent
    out before the process ends."""
    key = (str(socket_path), agent, group)
    with _default_lock:
        found = _shared.get(key)
        if found is None:
            found = BrokerReporter(socket_path, agent, group)
            _shared[key] = found
            atexit.register(found.close)
        return found


def default_reporter() -> Reporter:
    """The process's reporter: to the broker inside a sandbox (``DSEC_IPC_SOCKET`` set), else
    one that only keeps records."""
    global _default
    with _default_lock:
        if _default is None:
            if os.environ.get("DSEC_IPC_SOCKET"):
                _default = BrokerReporter()
                atexit.register(_default.close)  # the last batch, before the process ends
            else:
                _default = Reporter()
        return _default
