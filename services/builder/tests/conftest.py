"""Fixtures of the builder's tests: a local package index serving real wheels."""

from __future__ import annotations

import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

# --import-mode=importlib puts no test directory on sys.path; the tests import the kit by name.
sys.path.insert(0, str(Path(__file__).parent))
from _dsec_builder_testkit import WheelIndex


@pytest.fixture
async def index(tmp_path: Path) -> AsyncIterator[WheelIndex]:
    root = tmp_path / "index"
    root.mkdir()
    wheels = WheelIndex(root)
    app = web.Application()
    app.router.add_get("/files/{filename}", wheels.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    wheels.url = f"http://127.0.0.1:{port}/files"
    yield wheels
    await runner.cleanup()


@pytest.fixture
def cache_prefix() -> str:
    """An S3 key prefix of this test's own, so tests sharing the session's bucket never meet."""
    return f"test-{uuid.uuid4().hex[:12]}/wheels/sha256/"
