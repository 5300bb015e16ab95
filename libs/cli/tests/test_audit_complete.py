"""`dsec audit verify` never calls a log intact that it did not read to the end."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from dsec_cli.commands import audit
from dsec_core import bus
from dsec_core.audit import VerifyReport


class _Verifier:
    def __init__(self) -> None:
        self.report = VerifyReport()

    async def feed(self, msgs: list[tuple[int, bytes]]) -> bool:
        for seq, _ in msgs:
            self.report.first_seq = self.report.first_seq or seq
            self.report.last_seq = seq
            self.report.events += 1
        return False

    async def finish(self) -> VerifyReport:
        return self.report


@pytest.mark.parametrize("read_to", [0, 6, 10])
def test_a_replay_that_ends_early_is_reported_incomplete(
    monkeypatch: pytest.MonkeyPatch, read_to: int
) -> None:
    async def partial(js: Any, **_: Any) -> AsyncIterator[list[tuple[int, bytes]]]:
        if read_to:  # messages lost on the way: the replay ends before the stream does
            yield [(seq, b"e") for seq in range(1, read_to + 1)]

    monkeypatch.setattr(bus, "replay_batches", partial)
    report = asyncio.run(audit._feed(None, _Verifier(), 1, None, 10))  # type: ignore[arg-type]
    if read_to == 10:
        assert report.finding is None and report.ok
    else:
        assert report.finding is not None and not report.ok
        assert report.finding.stream_seq == read_to + 1
        assert report.finding.reason.startswith("incomplete: the stream held events up to seq 10")


def test_a_bad_pure_python_setting_is_bad_input_said_before_anything_runs(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``DSEC_AUDIT_PURE_PYTHON=maybe``: exit 2 naming the variable and what is valid, before
    the verifier is forked or the bus reached (it was the forked verifier's error, exit 1)."""
    import json
    import os

    from dsec_cli.main import app
    from typer.testing import CliRunner

    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("DSEC_")}
    env.update({"DSEC_HOME": str(tmp_path), "DSEC_AUDIT_PURE_PYTHON": "maybe"})
    forked = []

    def fork() -> int:  # (recorded, then refused: the verifier would run in this process)
        forked.append(1)
        raise OSError("no fork in this test")

    monkeypatch.setattr(os, "fork", fork)
    result = CliRunner().invoke(app, ["audit", "verify", "--json"], env=env)
    assert result.exit_code == 2, result.output
    error = json.loads(result.stdout)["error"]
    assert error["code"] == "bad_input"
    assert "DSEC_AUDIT_PURE_PYTHON='maybe' is invalid: use 1/true/yes/on" in error["message"]
    assert not forked
