"""`dsec events tail` / `dsec submit` show a restart in place as one line a user can read."""

from __future__ import annotations

import pytest
from dsec_cli.render import event_line
from dsec_core.envelope import decode
from dsec_core.events import SandboxRestarted
from dsec_core.signing import Signer
from nacl.signing import SigningKey

pytestmark = pytest.mark.unit


def _line(payload: SandboxRestarted) -> str:
    signer = Signer("nodeagent", SigningKey(bytes(32)), tenant="default")
    return event_line(7, decode(signer.seal(payload, aggregate_id="sbx_1").wire))


def test_a_restart_says_how_it_died_and_the_new_pid() -> None:
    killed = _line(SandboxRestarted(restarts=2, exit_code=None, signal=9, reason="error", pid=41))
    assert "sandbox.restarted" in killed
    assert "restart 2 after it died (killed by signal 9, error); pid 41" in killed
    failed = _line(SandboxRestarted(restarts=1, exit_code=3, signal=None, reason="error", pid=5))
    assert "restart 1 after it died (exit 3, error); pid 5" in failed
