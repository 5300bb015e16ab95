"""DSec's Python client: submit a spec, follow its verified events, read its logs, run commands
in it, snapshot, roll back and stop it — as this machine's user, like ``dsec``::

    async with DSec() as d:
        sb = await d.submit("dsec.yaml", code=".")
        await sb.wait("ready")
        print((await sb.exec(["python", "-V"])).stdout)
        await sb.stop()

:class:`DSecSync` is the same, blocking. Every error is a :class:`DSecError`. See
``docs/client.md``.
"""

from dsec_client.client import WAIT_FOR, DSec, ExecResult, Sandbox
from dsec_client.errors import (
    ConfigError,
    DepsConflict,
    DSecError,
    InvalidInput,
    NotFound,
    Refused,
    RequestFailed,
    SandboxEnded,
    SandboxExited,
    SandboxFailed,
    SpecRejected,
    Stalled,
    Timeout,
    Unreachable,
)
from dsec_client.events import Event
from dsec_client.sync import DSecSync, SandboxSync

__all__ = [
    "WAIT_FOR",
    "ConfigError",
    "DSec",
    "DSecError",
    "DSecSync",
    "DepsConflict",
    "Event",
    "ExecResult",
    "InvalidInput",
    "NotFound",
    "Refused",
    "RequestFailed",
    "Sandbox",
    "SandboxEnded",
    "SandboxExited",
    "SandboxFailed",
    "SandboxSync",
    "SpecRejected",
    "Stalled",
    "Timeout",
    "Unreachable",
]
