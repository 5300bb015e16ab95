"""Every SDK test runs twice: with the ring's C hot path and with ring.py alone."""

from __future__ import annotations

import pytest
from dsec_sdk.ipc import ring as r


@pytest.fixture(autouse=True, params=["c", "python"])
def ring_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which implementation new rings use in this test (``DSEC_IPC_PURE_PYTHON``)."""
    mode: str = request.param
    monkeypatch.setenv("DSEC_IPC_PURE_PYTHON", "1" if mode == "python" else "0")
    assert r.accelerated() == (mode == "c"), (
        "the SDK's C extension (dsec_sdk.ipc._fastring) is not built: `./taskw setup` needs a C "
        "compiler (gcc) and the interpreter's headers"
    )
    return mode
