"""What the broker admits: per-sandbox and node-wide bounds on connections and channels (pure).

A hostile sandbox must not be able to spend the node agent's file descriptors, or the broker's
attention, so that another tenant's agent cannot connect. Each bound is decided here without
I/O; the broker counts and calls :class:`Admission`.

* every connection costs the node agent three fds at most (socket, pidfd, a server's doorbell),
  so the connections of all sandboxes together stay within ``fd_budget / FDS_PER_CONNECTION``;
* one sandbox holds at most ``connections_per_sandbox`` connections and at most
  ``pending_per_sandbox`` that have not said hello yet; after ``hello_timeout_s`` without a
  hello a connection is closed;
* node-wide at most ``pending_total`` connections wait for their hello; when that pool is full a
  newcomer from a sandbox with fewer waiting connections than the greediest one evicts the
  greediest one's oldest waiting connection, so a flood from one sandbox cannot lock others out;
* one agent (sandbox) holds at most ``channels_per_agent`` live channels as a caller, and has
  at most ``connects_per_sandbox`` connects under way at once (one to an agent of another node
  waits on NATS: each would otherwise hold a task and a lookup in the node agent);
* one sandbox holds at most ``state_per_sandbox`` state sockets (each is an fd pair: the agent's
  end and the keeper's).
"""

from __future__ import annotations

import logging
import resource
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

C = TypeVar("C")

FDS_PER_CONNECTION: Final = 3

# The fixed set of refusal reasons (a metric label: never anything a sandbox chooses).
REASONS: Final = (
    "fd_budget",  # the node-wide connection budget is spent
    "sandbox_connections",  # this sandbox holds its maximum of connections
    "pending_sandbox",  # this sandbox has its maximum of connections without hello
    "pending_total",  # the node-wide pool of connections without hello is full
    "pending_evicted",  # a waiting connection made room for another sandbox's
    "hello_timeout",  # no hello within hello_timeout_s
    "channels",  # this agent holds its maximum of live channels
    "connects",  # this sandbox has its maximum of connects under way
    "identity",  # the hello named an agent this process may not act as, or bad input
    "name_taken",  # another sandbox already serves that agent name
    "taken_over",  # a server replaced by an explicit takeover
    "state_sockets",  # this sandbox holds its maximum of state sockets
    "server_busy",  # the agent called has not read the channels offered to it yet
    "proxy_channels",  # this sandbox holds its share of the channels to other nodes
    "passed_fds",  # a connection sent fds (no agent does; refused by the kernel where it can)
)


class ServerBusy(Exception):
    """A server's control socket is full: no channel to it now (the caller may retry)."""


@dataclass(frozen=True)
class BrokerLimits:
    """The broker's bounds (operator settings ``DSEC_IPC_*``; see the README)."""

    fd_budget: int = 4096
    connections_per_sandbox: int = 32
    pending_per_sandbox: int = 8
    pending_total: int = 64
    hello_timeout_s: float = 2.0
    channels_per_agent: int = 256
    state_per_sandbox: int = 4
    connects_per_sandbox: int = 16

    def __post_init__(self) -> None:
        for name in (
            "fd_budget",
            "connections_per_sandbox",
            "pending_per_sandbox",
            "pending_total",
            "channels_per_agent",
            "state_per_sandbox",
            "connects_per_sandbox",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"ipc limit {name}={getattr(self, name)} is invalid: use >= 1")
        if not self.hello_timeout_s > 0:
            raise ValueError(f"ipc hello_timeout_s={self.hello_timeout_s} is invalid: use > 0")

    def max_connections(self, nofile: int | None = None) -> int:
        """Connections of all sandboxes together: within the fd budget, and the budget itself at
        most half the process's ``RLIMIT_NOFILE``, so the other half stays for everything else
        the node agent opens (``accept()``, sandboxes, NATS, /healthz)."""
        if nofile is None:
            nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        budget = self.fd_budget
        if nofile != resource.RLIM_INFINITY:
            budget = min(budget, nofile // 2)
        return max(1, budget // FDS_PER_CONNECTION)


@dataclass
class Admission(Generic[C]):
    """Counts connections per sandbox; decides who may connect (no I/O).

    ``C`` is the broker's connection type (hashable by identity).
    """

    limits: BrokerLimits
    max_connections: int
    _owner: dict[C, str] = field(default_factory=dict)
    _per_sandbox: Counter[str] = field(default_factory=Counter)
    # Connections without hello, oldest first.
    _pending: OrderedDict[C, str] = field(default_factory=OrderedDict)
    _pending_per_sandbox: Counter[str] = field(default_factory=Counter)

    def admit(self, sandbox: str) -> tuple[str | None, C | None]:
        """May a new connection of ``sandbox`` be accepted?

        Returns ``(reason, None)`` when refused (a :data:`REASONS` entry); ``(None, victim)`` when
        admitted, where ``victim`` is a waiting connection to close first (or ``None``).
        """
        if len(self._owner) >= self.max_connections:
            return "fd_budget", None
        if self._per_sandbox[sandbox] >= self.limits.connections_per_sandbox:
            return "sandbox_connections", None
        waiting = self._pending_per_sandbox[sandbox]
        if waiting >= self.limits.pending_per_sandbox:
            return "pending_sandbox", None
        if len(self._pending) < self.limits.pending_total:
            return None, None
        greediest, most = self._pending_per_sandbox.most_common(1)[0]
        if most <= waiting + 1:  # evicting would not make the pool fairer
            return "pending_total", None
        victim = next(c for c, owner in self._pending.items() if owner == greediest)
        return None, victim

    def add(self, conn: C, sandbox: str) -> None:
        """Count an admitted connection (waiting for its hello)."""
        self._owner[conn] = sandbox
        self._per_sandbox[sandbox] += 1
        self._pending[conn] = sandbox
        self._pending_per_sandbox[sandbox] += 1

    def greeted(self, conn: C) -> None:
        """``conn`` said hello: it no longer waits."""
        sandbox = self._pending.pop(conn, None)
        if sandbox is not None:
            self._drop_count(self._pending_per_sandbox, sandbox)

    def remove(self, conn: C) -> None:
        """Forget a closed connection."""
        self.greeted(conn)
        sandbox = self._owner.pop(conn, None)
        if sandbox is not None:
            self._drop_count(self._per_sandbox, sandbox)

    def waiting(self, conn: C) -> bool:
        """Whether ``conn`` still waits for its hello."""
        return conn in self._pending

    @property
    def connections(self) -> int:
        """Connections counted now."""
        return len(self._owner)

    @property
    def pending(self) -> int:
        """Connections waiting for their hello now."""
        return len(self._pending)

    @staticmethod
    def _drop_count(counter: Counter[str], key: str) -> None:
        counter[key] -= 1
        if counter[key] <= 0:
            del counter[key]


class RefusalLog:
    """Logs refusals at most once per ``interval_s``: a summary by reason, never one per event
    (a flood must not become a flood of log lines)."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._counts: Counter[str] = Counter()
        self._sandboxes: Counter[str] = Counter()
        self._next = 0.0

    def refused(self, reason: str, sandbox: str, now: float | None = None) -> bool:
        """Count one refusal; log the summary if the interval passed (``True`` when logged)."""
        self._counts[reason] += 1
        self._sandboxes[sandbox] += 1
        now = time.monotonic() if now is None else now
        if now < self._next:
            return False
        self._next = now + self._interval_s
        reasons = ", ".join(f"{r}={n}" for r, n in sorted(self._counts.items()))
        top = ", ".join(f"{s}={n}" for s, n in self._sandboxes.most_common(3))
        self._log.warning("ipc: refused connections or requests (%s); most from %s", reasons, top)
        self._counts.clear()
        self._sandboxes.clear()
        return True
