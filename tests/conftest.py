"""Helpers for the cross-service tests: run the CLI in-process against the test stack."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pytest
from dsec_cli.main import app
from dsec_core.bus import EventPublisher
from dsec_core.signing import Signer
from nacl.signing import SigningKey
from typer.testing import CliRunner


@dataclass
class CliResult:
    """What a user sees from one ``dsec`` invocation."""

    exit_code: int
    output: str

    def last_json(self) -> Any:
        """The last line parsed as JSON (``--json`` commands end with one)."""
        lines = [line for line in self.output.strip().splitlines() if line.strip()]
        return json.loads(lines[-1])


CliFn = Callable[..., CliResult]


@pytest.fixture
def dsec_cli() -> CliFn:
    """Run ``dsec ARGS`` in-process with the given environment; returns exit code and output."""

    def invoke(*args: str, env: Mapping[str, str] | None = None) -> CliResult:
        def call() -> CliResult:
            runner = CliRunner()
            result = runner.invoke(app, list(args), env=dict(env or {}), catch_exceptions=False)
            return CliResult(result.exit_code, result.output)

        # A thread of its own: the CLI runs its own event loop (asyncio.run), which cannot nest
        # inside an async test's loop.
        with ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(call).result()

    return invoke


@pytest.fixture
def make_publisher() -> Callable[..., Any]:
    """An async factory of publishers with a fresh producer name and key, registered in the
    log (tests share one stream, and `audit verify` must hold for it)."""

    async def make(js: Any, prefix: str = "test") -> EventPublisher:
        publisher = EventPublisher(
            js, Signer(f"{prefix}-{uuid.uuid4().hex[:8]}", SigningKey.generate())
        )
        await publisher.register_key()
        return publisher

    return make
