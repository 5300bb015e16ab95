"""Migration path ``criu`` between two node agents on this machine (docs/migration.md): a real
sandbox with touched memory and a counter it keeps printing is checkpointed by CRIU on node-1,
streamed (sealed) to node-2, restored there and continues — its counter goes on with nothing
lost or repeated, its logs and its stop follow it, and the events tell the story."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from dsec_core import events
from dsec_core.layout import NodeLayout

sys.path.insert(0, str(Path(__file__).parent))
from _nodeagent_harness import NodeAgentHarness

from dsec_nodeagent.sandbox import cgroups

pytestmark = [pytest.mark.integration, pytest.mark.kernel]

QUIET = "{cidr: 10.77.0.0/16, ports: [80]}"
COUNTER = """
import time
memory = bytearray(32 << 20)
for i in range(0, len(memory), 4096):
    memory[i] = 1
n = 0
while True:
    n += 1
    memory[(n * 4096) % len(memory)] = n & 255
    print("count", n, flush=True)
    time.sleep(0.02)
"""


@pytest.fixture
def homes() -> Iterator[tuple[Path, Path]]:
    """Two short homes (the sandboxes' socket paths must fit in AF_UNIX's 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="mig-", dir="/tmp"))
    yield path / "n1", path / "n2"
    shutil.rmtree(path, ignore_errors=True)


@contextlib.asynccontextmanager
async def two_nodes(homes: tuple[Path, Path], nats_url: str, **extra: Any) -> AsyncIterator[Any]:
    """node-1 and node-2, each with its own home, certified by one operator root (``extra``:
    more settings of both, e.g. the stack's S3 and OpenBao for the state plane)."""
    first, second = homes
    common = {"migration_checkpointable": True, **extra}
    async with NodeAgentHarness(first, nats_url, node_id="node-1", **common) as h1:
        (second / "trust").mkdir(parents=True)
        for name in ("root.key", "root.pub"):
            shutil.copy2(first / "trust" / name, second / "trust" / name)
        settings = {"node_id": "node-2", "sandbox_uid_base": 260000, **common}
        try:
            async with NodeAgentHarness(second, nats_url, **settings) as h2:
                yield h1, h2
        finally:  # node-2's parent cgroups go, as at `dsec down` (node-1 is the session's)
            cgroups.remove_node_group(cgroups.detect(), "node-2")


def counts(path: Path) -> list[int]:
    if not path.exists():
        return []
    return [
        int(line.split()[1]) for line in path.read_text().splitlines() if line.startswith("count ")
    ]


async def until(check: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} within {timeout} s")
        await asyncio.sleep(0.1)


async def move_to_node_2(h1: Any, sid: str, mid: str) -> None:
    """What the scheduler publishes to move ``sid`` from node-1 to node-2 by CRIU."""
    started = events.UnitMigrationStarted(
        migration_id=mid, from_node="node-1", to_node="node-2", reason="operator", path="criu"
    )
    await h1.upstream.scheduler.publish(started, aggregate_id=sid)


async def test_a_sandbox_migrates_by_criu_and_its_counter_goes_on(
    homes: tuple[Path, Path], nats_url: str
) -> None:
    async with two_nodes(homes, nats_url) as (h1, h2):
        sid = await h1.submit("criu-move", COUNTER, QUIET)
        await h1.wait_for(sid, "sandbox.ready")
        source_log = NodeLayout.of(homes[0]).sandbox(sid).logs / "stdout.log"
        target_log = NodeLayout.of(homes[1]).sandbox(sid).logs / "stdout.log"
        await until(lambda: len(counts(source_log)) >= 20, "counting on node-1")
        mid = f"m-{uuid.uuid4().hex[:8]}"
        await move_to_node_2(h1, sid, mid)
        rec = h1.recorded[sid]
        await until(
            lambda: rec.of("unit.migrated") or rec.of("unit.migration_failed"),
            "migrated or failed",
            120,
        )
        failed = rec.of("unit.migration_failed")
        assert not failed, failed[0].payload
        migrated = events.UnitMigrated.model_validate(rec.of("unit.migrated")[0].payload)
        assert (migrated.migration_id, migrated.from_node, migrated.to_node) == (
            mid,
            "node-1",
            "node-2",
        )
        assert migrated.path == "criu" and migrated.bytes_moved > 32 << 20
        assert {"dump", "transfer", "restore"} <= set(migrated.stages_ms)
        # it runs on node-2 now, and only there
        assert h2.agent.manager.get(sid) is not None
        await until(lambda: h1.agent.manager.get(sid) is None, "released on node-1")
        moved_at = len(counts(target_log))
        await until(lambda: len(counts(target_log)) >= moved_at + 20, "counting on node-2")
        seen = counts(target_log)  # the source's lines came along, the target's follow them
        assert seen == list(range(1, len(seen) + 1)), "a count lost or repeated"
        # the log (node-2's trust gate) places it on node-2: it speaks for it from now on
        state = await h2.agent.lifecycle(sid)
        assert state.state == "running" and state.owned_by("node-2")
        assert not rec.of("sandbox.exited")  # the sandbox lives on: no end was published
        # a command runs in it on node-2 (`dsec sandbox exec`), in its restored namespaces
        said = homes[1] / "exec.out"
        with said.open("wb") as out:
            code = await h2.agent.manager.exec(
                sid, ["python", "-c", "print(open('/proc/1/cmdline').read().count('-c'))"],
                stdout=out.fileno(),
            )  # fmt: skip
        assert (code, said.read_text().strip()) == (0, "1")  # pid 1: the restored reaper
        await h2.upstream.user.publish(
            events.SandboxStopRequested(requested_by="test"), aggregate_id=sid
        )
        exited = await h2.wait_for(sid, "sandbox.exited", 60)
        await h1.wait_for(sid, "sandbox.exited", 60)  # the story below is node-1's recorder
        assert exited.payload["reason"] == "stopped"
        key = await h2.service.gate.keys.certificate(exited.key_id)  # type: ignore[union-attr]
        assert not isinstance(key, str) and key.node_id == "node-2"
        types = [a.envelope.type for a in rec.events]
        story = [t for t in types if t in ("sandbox.ready", "unit.migration_started",
                                           "unit.migrated", "sandbox.exited")]  # fmt: skip
        assert story == ["sandbox.ready", "unit.migration_started", "unit.migrated",
                         "sandbox.exited"]  # fmt: skip


async def test_a_sandbox_whose_uid_a_sandbox_of_the_target_has_is_not_restored_there(
    homes: tuple[Path, Path], nats_url: str
) -> None:
    """A sandbox keeps its uid when it moves (its files and restored processes have it). The
    target may give that uid to one of its own sandboxes (machines allocate apart): then the
    move fails at the restore, before anything of it ran there, and it goes on at the source."""
    async with two_nodes(homes, nats_url) as (h1, h2):
        sid = await h1.submit("criu-uid", COUNTER, QUIET)
        await h1.wait_for(sid, "sandbox.ready")
        source = h1.agent.manager.get(sid)
        assert source is not None
        # node-2 has a sandbox under that uid (as its state file says: one being started)
        h2.agent.manager.states.write(
            "occupant", {"sandbox_id": "occupant", "uid": source.ready.uid}
        )
        try:
            await move_to_node_2(h1, sid, f"m-{uuid.uuid4().hex[:8]}")
            rec = h1.recorded[sid]
            failed = await until(lambda: rec.of("unit.migration_failed"), "refused", 120)
            payload = events.UnitMigrationFailed.model_validate(failed[0].payload)
            assert payload.stage == "restore" and f"uid {source.ready.uid}" in payload.reason
            assert payload.still_running
            assert h2.agent.manager.get(sid) is None
            assert not (NodeLayout.of(homes[1]).sandbox(sid).logs / "stdout.log").exists()
            source_log = NodeLayout.of(homes[0]).sandbox(sid).logs / "stdout.log"
            before = len(counts(source_log))
            await until(lambda: len(counts(source_log)) >= before + 10, "counting on node-1")
            assert h1.agent.manager.get(sid) is not None
        finally:
            h2.agent.manager.states.remove("occupant")
