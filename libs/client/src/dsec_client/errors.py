"""Typed errors: every failure of the client is a :class:`DSecError`.

Each class carries ``EXIT``, the exit status ``dsec`` uses for it (README, "Exit codes"): 1 a
failure, 2 bad input, 3 unreachable, 4 timed out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dsec_client.events import Event


class DSecError(Exception):
    """Base of every error the client raises."""

    EXIT = 1


class ConfigError(DSecError):
    """A setting, credential file or identity is missing or unusable (``dsec login``)."""

    EXIT = 2


class InvalidInput(DSecError):
    """A spec, code directory, sandbox id or request the client cannot send as given."""

    EXIT = 2


class NotFound(DSecError):
    """No such sandbox in the event log."""

    EXIT = 2


class Unreachable(DSecError):
    """NATS, the object store or a node agent did not answer."""

    EXIT = 3


class Timeout(DSecError):
    """What was waited for did not happen in time.

    Attributes:
        last_event: the type of the last event seen before giving up (``None``: none).
    """

    EXIT = 4

    def __init__(self, message: str, last_event: str | None = None) -> None:
        super().__init__(message)
        self.last_event = last_event


class Stalled(Timeout):
    """No event arrived for the ``stall`` period (is the service that handles it running?)."""


class SandboxEnded(DSecError):
    """The sandbox reached a terminal state before what :meth:`Sandbox.wait` waited for.

    Attributes:
        sandbox_id: the sandbox.
        state: its terminal state (``rejected``, ``conflict``, ``failed`` or ``exited``).
        reason: why, as its terminal event says.
        event: that terminal event.
    """

    def __init__(self, sandbox_id: str, state: str, reason: str | None, event: Event) -> None:
        detail = f": {reason}" if reason else ""
        super().__init__(f"sandbox {sandbox_id} {state}{detail}")
        self.sandbox_id, self.state, self.reason, self.event = sandbox_id, state, reason, event


class SpecRejected(SandboxEnded):
    """The policy service rejected the spec; ``errors`` are its located errors."""

    @property
    def errors(self) -> list[dict[str, object]]:
        """Each error: ``file``, ``line``, ``column``, ``message`` (and more)."""
        return list(self.event.data.get("errors", []))


class DepsConflict(SandboxEnded):
    """The dependencies do not resolve; the event carries an explanation and alternatives."""


class SandboxFailed(SandboxEnded):
    """The sandbox failed (build, start, placement, lost node)."""


class SandboxExited(SandboxEnded):
    """The sandbox exited before the awaited state; ``exit_code`` is its exit status."""

    @property
    def exit_code(self) -> int | None:
        code = self.event.data.get("exit_code")
        return code if isinstance(code, int) else None


class RequestFailed(DSecError):
    """A service or node agent answered a request with a failure (``snapshot.failed``, a
    remote refusal, a broken stream).

    Attributes:
        reason: the reason it gave.
        event: the answering event, when the answer was an event.
    """

    def __init__(self, message: str, reason: str = "", event: Event | None = None) -> None:
        super().__init__(message)
        self.reason, self.event = reason, event


class Refused(RequestFailed):
    """A node agent refused a logs/exec request (``reason``: ``unauthorized``, ``not-running``,
    ``cross-tenant``, ...)."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message, reason)
        if reason in ("not-found", "not-running", "not-allowed"):
            self.EXIT = 2


__all__ = [
    "ConfigError",
    "DSecError",
    "DepsConflict",
    "InvalidInput",
    "NotFound",
    "Refused",
    "RequestFailed",
    "SandboxEnded",
    "SandboxExited",
    "SandboxFailed",
    "SpecRejected",
    "Stalled",
    "Timeout",
    "Unreachable",
]
