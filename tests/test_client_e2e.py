"""The Python client through every service as its own process: exec with input and an exit
code, a snapshot, a rollback, their refusals as typed errors, logs followed to the end, stop."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import pytest
from dsec_client import DSec, RequestFailed, SandboxExited

pytestmark = [pytest.mark.e2e, pytest.mark.kernel, pytest.mark.slow]

SPEC = """\
version: "1.2"
name: client-e2e
base: dsec/python311:latest
entrypoint: [python, -u, agent.py]
workdir: /workspace
resources: {cpu: 1, memory: 128MiB, pids: 32}
timeout: 5m
"""

AGENT = """\
import time
print("agent up")
time.sleep(300)
"""


async def test_exec_snapshot_rollback_logs_and_stop(
    services: Any, stack_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name, value in stack_env.items():
        monkeypatch.setenv(name, value)
    services.start("policy", "builder", "nodeagent", "snapshot")
    (tmp_path / "agent.py").write_text(AGENT)
    async with DSec() as d:
        sb = await d.submit(SPEC, code=tmp_path)
        ready = await sb.wait("ready", timeout=300, stall=120)
        assert ready.type == "sandbox.ready" and sb.state == "running"

        upper = await sb.exec(
            ["python", "-c", "import sys; print(sys.stdin.read().upper())"], input=b"abc"
        )
        assert upper.ok and upper.stdout == "ABC\n"
        failing = await sb.exec(["python", "-c", "import sys; print('e', file=sys.stderr); 1/0"])
        assert failing.exit_code == 1 and "ZeroDivisionError" in failing.stderr

        name = f"client-{uuid.uuid4().hex[:8]}"
        taken = await sb.snapshot(name)
        assert taken.type == "snapshot.taken" and taken.data["files"] == 1
        assert taken.verified and taken.producer == "nodeagent"
        with pytest.raises(RequestFailed) as again:  # names are unique in the store
            await sb.snapshot(name)
        assert again.value.event is not None and again.value.event.type == "snapshot.failed"
        restored = await sb.rollback(name)
        assert restored.type == "snapshot.restored" and restored.data["files_written"] == 0
        with pytest.raises(RequestFailed, match=r"rollback of .* to no-such-snapshot failed"):
            await sb.rollback("no-such-snapshot")

        followed = asyncio.create_task(sb.logs(follow=True))
        code = await sb.stop(grace=1)
        assert code is not None and code != 0
        assert "agent up" in await asyncio.wait_for(followed, 60)
        with pytest.raises(SandboxExited) as exited:  # it ended first: attached, replayed
            await d.sandbox(sb.id).wait("sandbox.failed", timeout=60)
        assert exited.value.exit_code == code and exited.value.state == "exited"
