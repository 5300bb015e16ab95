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
from dsec_core.identity import Role
from dsec_testing import trust
from dsec_testing.stack import StackFixture
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
def dsec_cli(dsec_stack: StackFixture) -> CliFn:
    """Run ``dsec ARGS`` in-process with the given environment; returns exit code and output.

    Unless the test sets them, the CLI trusts the test stack's operator root and signs as a
    user it certified (tenant ``default``), as a logged-in user would.
    """
    trust_env = dsec_stack.trust_env()

    def invoke(*args: str, env: Mapping[str, str] | None = None) -> CliResult:
        def call() -> CliResult:
            runner = CliRunner()
            full = {**trust_env, **(env or {})}
            result = runner.invoke(app, list(args), env=full, catch_exceptions=False)
            return CliResult(result.exit_code, result.output)

        # A thread of its own: the CLI runs its own event loop (asyncio.run), which cannot nest
        # inside an async test's loop.
        with ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(call).result()

    return invoke


@pytest.fixture
def make_publisher(dsec_stack: StackFixture) -> Callable[..., Any]:
    """An async factory of publishers certified by the test stack's root, with a fresh key,
    registered in the log (tests share one stream, and `audit verify` must hold for it).
    ``role`` is what the key may emit (a user by default; ``"policy"`` to validate specs)."""

    async def make(js: Any, prefix: str = "test", role: Role = "user") -> EventPublisher:
        subject = f"{prefix}-{uuid.uuid4().hex[:8]}" if role == "user" else role
        return await trust.publisher(js, dsec_stack.home, role, subject=subject)

    return make


@pytest.fixture(params=["in-process", "verifier-process"])
def verifier_kind(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """`dsec audit verify` verifies a long log in a forked process of its own (fed while it
    reads the stream): these logs are short, so the threshold is lowered to try both."""
    from dsec_core import audit_worker

    if request.param == "verifier-process":
        monkeypatch.setattr(audit_worker, "WORKER_MIN_EVENTS", 0)
    return str(request.param)
