"""`dsec events tail` / `dsec submit` show where a sandbox started, how fast, and what the node
warned about (``sandbox.ready`` 1.2's ``warnings``), escaped."""

from __future__ import annotations

import pytest
from dsec_cli.render import event_line
from dsec_core.envelope import decode
from dsec_core.events import SandboxReady
from dsec_core.signing import Signer
from nacl.signing import SigningKey

pytestmark = pytest.mark.unit


def _line(payload: SandboxReady) -> str:
    signer = Signer("nodeagent", SigningKey(bytes(32)), tenant="default")
    return event_line(3, decode(signer.seal(payload, aggregate_id="sbx_1").wire))


def test_a_ready_line_names_the_node_the_time_and_each_warning() -> None:
    plain = _line(
        SandboxReady(node_id="node-2", pid=41, cgroup="/x", start_latency_ms={"total": 6.4})
    )
    assert "node_id=node-2 pid 41, ready in 6.4 ms" in plain and "warning" not in plain
    warned = _line(
        SandboxReady(
            node_id="node-2",
            pid=41,
            cgroup="/x",
            warnings=[
                "read_allowed /data exists neither in a mount nor on the host",
                "[bold]mount /m[/bold] is not under read_allowed",
            ],
        )
    )
    assert "warning: read_allowed /data exists neither in a mount nor on the host" in warned
    assert "; warning: \\[bold]mount /m\\[/bold] is not under read_allowed" in warned  # escaped
