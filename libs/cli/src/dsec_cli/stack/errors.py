"""Errors of the embedded stack. Messages name the server/service, port or file involved and
never contain a secret."""

from __future__ import annotations


class StackError(Exception):
    """Base class of every stack error."""


class StackConfigError(StackError):
    """Bad input: a malformed external endpoint, an invalid service name, a broken template."""


class StackStateError(StackError):
    """``stack.json`` cannot be read."""


class BinaryMissingError(StackError):
    """A server's binary is not installed."""


class PortInUseError(StackError):
    """A port the stack needs is held by another process."""


class ServerStartError(StackError):
    """A server exited or did not become healthy before its deadline."""

    def __init__(self, name: str, reason: str, log_tail: str = "") -> None:
        self.name = name
        self.reason = reason
        self.log_tail = log_tail
        super().__init__(f"{name}: {reason}")


class ServiceFailed(StackError):
    """A DSec service exited or did not become healthy before its deadline."""

    def __init__(self, name: str, reason: str, log_tail: str = "") -> None:
        self.name = name
        self.reason = reason
        self.log_tail = log_tail
        super().__init__(f"{name}: {reason}")


class StartFailed(StackError):
    """Servers or services did not start; ``failures`` maps each name to (reason, log tail)."""

    def __init__(self, what: str, failures: dict[str, tuple[str, str]]) -> None:
        self.what = what
        self.failures = failures
        detail = "; ".join(f"{name}: {reason}" for name, (reason, _) in sorted(failures.items()))
        super().__init__(f"{what} failed to start: {detail}")


class StopError(StackError):
    """A process or listening port remained after ``dsec down``."""
