"""The sandbox: namespaces, cgroups, Landlock, seccomp, and its async lifecycle.

Imports are lazy (PEP 562): the pre-exec stage ``python -m dsec_nodeagent.sandbox.init`` imports
this package, and its start-up time counts toward ``sandbox.ready``.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "AgentIdentity",
    "ExitReason",
    "Limits",
    "Mount",
    "ReconcileReport",
    "SandboxConfig",
    "SandboxExited",
    "SandboxManager",
    "SandboxReady",
    "SandboxStartError",
]

_WHERE = {
    "AgentIdentity": "models",
    "ExitReason": "models",
    "Limits": "models",
    "Mount": "models",
    "SandboxConfig": "models",
    "SandboxExited": "models",
    "SandboxReady": "models",
    "SandboxStartError": "models",
    "ReconcileReport": "manager",
    "SandboxManager": "manager",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        module = importlib.import_module(f"{__name__}.{_WHERE[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
