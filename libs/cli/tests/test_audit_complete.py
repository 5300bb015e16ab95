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
