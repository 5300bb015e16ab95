"""Typed errors of the communication plane.

Every failure of a tool call surfaces as a subclass of :class:`IpcError`, so agent code can catch
the whole family or exactly the case it handles (retry a timeout, fall back when a peer is gone).
"""

from __future__ import annotations


def _still_busy(text: str, seconds: float) -> str:
    """A busy answer's text as said after the client retried it for ``seconds`` (without the
    answer's closing "; retry ...")."""
    head, sep, _ = text.rpartition("; retry")
    return f"{head if sep else text}; still busy after {seconds:.1f} s of retries"


class IpcError(Exception):
    """Base class of every communication-plane error."""


class BrokerUnavailable(IpcError):
    """The node agent's IPC broker cannot be reached on its Unix socket."""


class BrokerRefused(BrokerUnavailable):
    """The broker refused one request; the connection stays usable. ``code`` says why:
    ``busy`` (the agent called, or this sandbox's connects, are at a bound: the client retries
    for a while before raising it), ``too_many_channels``, ``bad_request``..."""

    def __init__(self, code: str, text: str) -> None:
        self.code = code
        super().__init__(text)

    def retried(self, seconds: float) -> BrokerRefused:
        """This refusal as raised after the client retried it for ``seconds``."""
        return BrokerRefused(self.code, _still_busy(str(self), seconds))


class AgentNotFound(IpcError):
    """No agent of that name serves tools in this task group (on this node or any other)."""

    def __init__(self, agent: str, group: str, detail: str = "") -> None:
        self.agent = agent
        self.group = group
        self.detail = detail
        suffix = f": {detail}" if detail else ""
        super().__init__(f"no agent named {agent!r} serves tools in task group {group!r}{suffix}")


class PeerGone(IpcError):
    """The peer died or closed the channel; the call's outcome is unknown.

    A new call to the same agent reconnects through the broker (the agent may have restarted).
    """

    def __init__(self, agent: str, reason: str, *, untaken: bool = False) -> None:
        self.agent = agent
        self.reason = reason
        # The call's request was never read by the peer (still in the ring, or never written):
        # safe to send again (to the new server of a name moved by a hand-over).
        self.untaken = untaken
        super().__init__(f"agent {agent!r} is gone: {reason}")


class CallTimeout(IpcError, TimeoutError):
    """The peer did not answer within the call's timeout."""

    def __init__(self, agent: str, tool: str, timeout: float) -> None:
        self.agent = agent
        self.tool = tool
        self.timeout = timeout
        try:  # (a Fraction, a Decimal, an int past a float's range: the call's own value)
            shown = f"{float(timeout):g}"
        except (TypeError, ValueError, OverflowError):
            shown = str(timeout)
        super().__init__(f"call {agent}.{tool} timed out after {shown} s")


class ReentrantCall(IpcError, RuntimeError):
    """A call on a channel made while the same thread's call on it is in flight or waiting
    for the channel: from a signal handler that interrupted that call. It could only wait for
    the outer call, which cannot go on until the handler returns: refused at once instead."""

    def __init__(self, agent: str, tool: str) -> None:
        self.agent = agent
        self.tool = tool
        super().__init__(
            f"call {agent}.{tool} made while this thread's call to {agent!r} is in flight or "
            "waiting for the channel (from a signal handler that interrupted it): it could "
            "not go on before this one returns, so this one is refused; call from another "
            "thread or after that call returns"
        )


class PayloadTooLarge(IpcError, ValueError):
    """A request or response is larger than the transport accepts."""

    def __init__(self, what: str, size: int, limit: int, *, text: str | None = None) -> None:
        self.size = size
        self.limit = limit
        super().__init__(text or f"{what} is {size} bytes; the limit is {limit} bytes")


class ProtocolError(IpcError):
    """The shared memory or a control message holds something no DSec peer writes."""


class RemoteError(IpcError):
    """The remote tool raised, or could not be called as asked.

    Attributes:
        agent: The agent that served the call.
        tool: The tool that was called.
        code: ``remote`` (the tool raised), ``unknown_tool``, ``bad_arguments`` or ``bad_result``.
        error_type: The remote exception's class name.
        remote_message: The remote exception's message.
        traceback_summary: The last frames of the remote traceback, already formatted.
    """

    def __init__(
        self,
        agent: str,
        tool: str,
        code: str,
        error_type: str,
        remote_message: str,
        traceback_summary: str,
    ) -> None:
        self.agent = agent
        self.tool = tool
        self.code = code
        self.error_type = error_type
        self.remote_message = remote_message
        self.traceback_summary = traceback_summary
        text = f"{agent}.{tool} failed: {error_type}: {remote_message}"
        if traceback_summary:
            text += f"\nremote traceback (most recent call last):\n{traceback_summary}"
        super().__init__(text)


class AgentBusy(RemoteError):
    """The agent called, on another node, could not take the call yet, and the tool did not
    run: the bridge there found the agent's control socket full (it has not read the channels
    offered to it), or this sandbox has the most calls to other nodes in flight that it may
    (``code`` ``busy``). The client retries for a while (its timeout, 10 s at most) before
    raising it."""

    def retried(self, seconds: float) -> AgentBusy:
        """This answer as raised after the client retried it for ``seconds``."""
        message = _still_busy(self.remote_message, seconds)
        return AgentBusy(
            self.agent, self.tool, self.code, self.error_type, message, self.traceback_summary
        )


class ToolNotFound(RemoteError):
    """The peer serves no tool of that name."""


class BadArguments(RemoteError):
    """The tool's signature does not accept the arguments given."""


__all__ = [
    "AgentBusy",
    "AgentNotFound",
    "BadArguments",
    "BrokerRefused",
    "BrokerUnavailable",
    "CallTimeout",
    "IpcError",
    "PayloadTooLarge",
    "PeerGone",
    "ProtocolError",
    "ReentrantCall",
    "RemoteError",
    "ToolNotFound",
]
