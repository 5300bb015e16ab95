"""Shared helpers for the sandbox tests: a manager under a temporary home that leaves nothing
behind, and small builders for configs whose workload is a Python snippet."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from dsec_nodeagent.sandbox import SandboxConfig, SandboxExited, SandboxManager
from dsec_nodeagent.semantic.models import SemanticDecision

RUNTIME = Path(os.environ.get("DSEC_TEST_RUNTIME", "/work/main/.venv/bin/python"))
if not RUNTIME.exists():  # CI clones elsewhere: the workspace interpreter is this one
    import sys

    RUNTIME = Path(sys.executable)


class Recorder:
    """Collects what a manager reports, like the bus would."""

    def __init__(self) -> None:
        self.exits: list[SandboxExited] = []
        self.decisions: list[SemanticDecision] = []

    async def on_exit(self, result: SandboxExited) -> None:
        self.exits.append(result)

    async def on_decision(self, decision: SemanticDecision) -> None:
        self.decisions.append(decision)

    async def wait_decisions(self, count: int, timeout_s: float = 5.0) -> list[SemanticDecision]:
        deadline = time.monotonic() + timeout_s
        while len(self.decisions) < count and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.decisions


def leftover_cgroups(sandbox_ids: list[str]) -> list[str]:
    """cgroup directories of these sandboxes that still exist (v2 and v1)."""
    roots = [
        "/sys/fs/cgroup/unified",
        "/sys/fs/cgroup/memory",
        "/sys/fs/cgroup/cpu",
        "/sys/fs/cgroup/pids",
        "/sys/fs/cgroup",
    ]
    found = []
    for root in roots:
        for sid in sandbox_ids:
            path = Path(root) / "dsec" / sid
            if path.is_dir():
                found.append(str(path))
    return found


@asynccontextmanager
async def managed(
    home: Path, recorder: Recorder | None = None, **options: Any
) -> AsyncIterator[SandboxManager]:
    """A manager (``options``: more :class:`SandboxManager` arguments) whose sandboxes are all
    stopped and cleaned when the block ends (even on failure); asserts that no cgroup, state
    file or run directory remains."""
    rec = recorder or Recorder()
    manager = SandboxManager(home, on_exit=rec.on_exit, on_decision=rec.on_decision, **options)
    try:
        yield manager
    finally:
        for sid in manager.running():
            with contextlib.suppress(KeyError):  # it may end on its own meanwhile
                await manager.stop(sid, grace_s=0.5)
        await manager.shutdown()  # also closes its audit reader (restores audit's state)
        cleanup = SandboxManager(home)
        report = await cleanup.reconcile()
        for sid in report.adopted:
            await cleanup.stop(sid, grace_s=0.5)
        ids = (
            [p.name for p in (home / "sandboxes").glob("*")]
            if (home / "sandboxes").exists()
            else []
        )
        assert leftover_cgroups(ids) == []
        assert (
            list((home / "run" / "sandboxes").glob("*")) == []
            if (home / "run" / "sandboxes").exists()
            else True
        )


def snippet_config(sandbox_id: str, code: str, tmp: Path, **overrides: Any) -> SandboxConfig:
    """A sandbox running ``code`` from a code bundle at /workspace/code, writing /workspace/output
    and /tmp."""
    code_dir = tmp / f"{sandbox_id}-code"
    code_dir.mkdir(parents=True, exist_ok=True)
    (code_dir / "main.py").write_text(code)
    fields: dict[str, Any] = {
        "sandbox_id": sandbox_id,
        "argv": ["python", "/workspace/code/main.py"],
        "runtime": RUNTIME,
        "code_dir": code_dir,
        "write_allowed": ["/tmp", "/workspace/output"],
    }
    fields.update(overrides)
    return SandboxConfig(**fields)


async def run_to_end(manager: SandboxManager, config: SandboxConfig) -> SandboxExited:
    """Launch and wait for the exit (cleanup included)."""
    await manager.launch(config)
    return await asyncio.wait_for(manager.wait(config.sandbox_id), 60)


def read_json_output(result: SandboxExited) -> dict[str, Any]:
    """The last stdout line of a sandbox, as JSON (probe scripts print their findings)."""
    lines = Path(result.stdout_path).read_text().strip().splitlines()
    assert lines, f"no output; stderr: {Path(result.stderr_path).read_text()[-2000:]}"
    data: dict[str, Any] = json.loads(lines[-1])
    return data
