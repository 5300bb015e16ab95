"""``--sandbox`` of ``dsec audit replay`` and ``dsec events tail``: an id that cannot be one NATS
subject token (a space, a dot, a trailing newline) is a clear error naming the option (exit 2),
before any connection; it was a traceback from nats-py (``BadSubjectError``)."""

from __future__ import annotations

import pytest
from dsec_cli.common import EXIT_BAD_INPUT
from dsec_cli.main import app
from typer.testing import CliRunner

pytestmark = pytest.mark.unit

runner = CliRunner()


@pytest.mark.parametrize("command", [["audit", "replay"], ["events", "tail"]])
@pytest.mark.parametrize("sandbox", ["sbx_1\n", "sbx 1", "sbx.1", "sbx_*"])
def test_a_sandbox_id_that_is_no_subject_token_is_refused_by_name(
    command: list[str], sandbox: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DSEC_NATS_URL", "nats://127.0.0.1:1")  # (never reached)
    result = runner.invoke(app, [*command, "--sandbox", sandbox])
    assert result.exit_code == EXIT_BAD_INPUT, result.output
    assert "--sandbox: aggregate id" in result.output
    assert "[A-Za-z0-9_-]+" in result.output
    assert "Traceback" not in result.output
