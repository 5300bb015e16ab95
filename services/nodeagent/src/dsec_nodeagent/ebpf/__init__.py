"""Egress policy in the kernel: BCC cgroup sock_addr hooks shared by every sandbox.

See `EgressController` for the lifecycle; `EgressPlan`/`EgressRule` for the input;
`VerdictEvent` for what comes out (the lead turns it into ``policy.violation``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from dsec_nodeagent.ebpf.kernel import EgressUnavailable
from dsec_nodeagent.ebpf.model import (
    EgressPlan,
    EgressRule,
    Hook,
    RateLimit,
    Verdict,
    VerdictEvent,
)

if TYPE_CHECKING:
    from dsec_nodeagent.ebpf.controller import (
        AttachedSandbox,
        CounterSample,
        EgressController,
        EventStream,
        ReconcileReport,
        cgroup_id_of,
    )

# The controller composes the DNS proxy, whose modules import this package's pure modules;
# loading it on first use keeps `import dsec_nodeagent.dns` free of an import cycle.
_CONTROLLER_NAMES = frozenset(
    {
        "AttachedSandbox",
        "CounterSample",
        "EgressController",
        "EventStream",
        "ReconcileReport",
        "cgroup_id_of",
    }
)


def __getattr__(name: str) -> Any:
    if name in _CONTROLLER_NAMES:
        return getattr(importlib.import_module("dsec_nodeagent.ebpf.controller"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AttachedSandbox",
    "CounterSample",
    "EgressController",
    "EgressPlan",
    "EgressRule",
    "EgressUnavailable",
    "EventStream",
    "Hook",
    "RateLimit",
    "ReconcileReport",
    "Verdict",
    "VerdictEvent",
    "cgroup_id_of",
]
