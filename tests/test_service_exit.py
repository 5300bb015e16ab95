"""A service asked to stop (SIGTERM: `dsec down`, a test's teardown) stops its work, drains its
connection and ends the process without the interpreter's teardown
(:func:`dsec_core.quickexit.leave`): its status and its last log line must be those of a clean
stop all the same."""

from __future__ import annotations

import pytest
from dsec_testing.stack import ServiceRunner

pytestmark = [pytest.mark.integration]


@pytest.mark.parametrize("name", ["policy", "scheduler"])
def test_a_stopped_service_ends_with_status_0_and_its_last_log_line(
    services: ServiceRunner, name: str
) -> None:
    services.start(name)
    proc = services.process(name).proc
    assert proc is not None and proc.popen is not None  # this process started it: its status
    services.stop(name)
    assert services.pid(name) is None
    assert proc.returncode() == 0
    last = services.log(name).rstrip().splitlines()[-1]
    assert f" {name} " in last and last.endswith(" stopped"), last
