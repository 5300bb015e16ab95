"""Migration path ``handover`` between two node agents on this machine (docs/migration.md "Path
``handover``"): a real sandbox whose SDK agent keeps a counter in its state plane (a log it
checkpoints before it prints each count, and a tool) is moved node-1 → node-2 while another
agent on node-1 calls its tool. The same sandbox starts on node-2 as a warm standby (its keeper
recovers the state from DSEC_STATE/S3), the agent on node-1 stops after its final checkpoint,
that delta crosses the node-to-node channel, node-2 switches and serves the tool's name; the
counter goes on from the last durable count (nothing acknowledged lost, nothing repeated), the
caller is answered from node-2 over the bridge, and the events tell the story. First, a target
that fails after the source stopped: the source thaws and serves on."""

from __future__ import annotations

import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from dsec_core import events
from dsec_core.layout import NodeLayout

from dsec_nodeagent.ipc.registry import AgentKey

sys.path.insert(0, str(Path(__file__).parent))
from test_migration_criu import QUIET, homes, two_nodes, until

pytestmark = [pytest.mark.integration, pytest.mark.kernel]

__all__ = ["homes"]  # the fixture, shared with the criu test

COUNTER = """
import threading, time
from dsec_sdk import DSecClient
from dsec_sdk.state import AgentState, StateError
state = AgentState.open()
ticks = state.log("ticks")
client = DSecClient()
client.attach_state(state)  # a standby's tool server registers, then the keeper hears ready
client.tool("count")(lambda: len(ticks))
threading.Thread(target=client.serve, daemon=True).start()
if state.handover:  # the warm standby on the target: restored, it waits for the switch
    state.wait_switched(120)
print("restored", len(ticks), list(ticks) == list(range(1, len(ticks) + 1)), flush=True)
while True:
    if state.handed_over.is_set():
        time.sleep(0.05)
        continue
    ticks.append(len(ticks) + 1)
    try:
        state.checkpoint()
    except StateError:
        time.sleep(0.05)
        continue
    print("count", len(ticks), flush=True)
    time.sleep(0.02)
"""


async def migrate(h: Any, sid: str) -> Any:
    """Start a migration node-1 → node-2 by path handover; its end (migrated or failed)."""
    mid = f"m-{uuid.uuid4().hex[:8]}"
    await h.upstream.scheduler.publish(
        events.UnitMigrationStarted(
            migration_id=mid, from_node="node-1", to_node="node-2", reason="operator",
            path="handover",
        ),
        aggregate_id=sid,
    )  # fmt: skip

    def ended() -> Any:
        ends = ("unit.migrated", "unit.migration_failed")
        return next(
            (
                a.envelope
                for a in h.recorded[sid].events
                if a.envelope.type in ends and a.envelope.payload.get("migration_id") == mid
            ),
            None,
        )

    return await until(ended, f"migration {mid} ended", 180)


CALLER = """
import time
from dsec_sdk import DSecClient
client = DSecClient(timeout=10)
while True:
    try:
        print("ok", client.call_tool(AGENT, "count"), flush=True)
    except Exception as exc:
        print("err", type(exc).__name__, flush=True)
        time.sleep(0.05)
    time.sleep(0.01)
"""


def lines(path: Path) -> list[list[str]]:
    """The words of each complete line of a log (one still being written, with no newline yet,
    is left for the next read: ``count 12`` read as ``count 1`` would look like a lost count)."""
    if not path.exists():
        return []
    text = path.read_text()
    return [line.split() for line in text[: text.rfind("\n") + 1].splitlines()]


def counts(path: Path) -> list[int]:
    return [int(w[1]) for w in lines(path) if w and w[0] == "count"]


async def test_a_stateful_agent_migrates_by_handover_and_its_state_goes_on(
    homes: tuple[Path, Path], nats_url: str, s3: Any, vault: Any
) -> None:
    stack = {**s3.settings(), **vault.settings()}
    async with two_nodes(homes, nats_url, **stack) as (h1, h2):
        name = f"hand-{uuid.uuid4().hex[:6]}"  # its own state (the stream is shared)
        sid = await h1.submit(name, COUNTER, QUIET, extra="state: {}\n")
        await h1.wait_for(sid, "sandbox.ready")
        source_log = NodeLayout.of(homes[0]).sandbox(sid).logs / "stdout.log"
        target_log = NodeLayout.of(homes[1]).sandbox(sid).logs / "stdout.log"
        await until(lambda: len(counts(source_log)) >= 10, "counting on node-1", 90)
        # another agent of its task group on node-1 calls its tool throughout
        caller = await h1.submit(
            f"{name}-c", CALLER.replace("AGENT", repr(name)), QUIET, extra=f"task_group: {name}\n"
        )
        await h1.wait_for(caller, "sandbox.ready")
        caller_log = NodeLayout.of(homes[0]).sandbox(caller).logs / "stdout.log"
        await until(lambda: sum(w[0] == "ok" for w in lines(caller_log)) >= 5, "answered", 60)
        # A target that fails after the source stopped and froze (it cannot keep the final
        # delta it got): the source is thawed and serves on, the standby goes.
        keeper = h2.agent.state_keeper
        assert keeper is not None
        apply = keeper.apply

        async def cannot(*_: Any) -> Any:
            raise RuntimeError("no room here")

        keeper.apply = cannot  # type: ignore[method-assign]
        refused = await migrate(h1, sid)
        assert refused.type == "unit.migration_failed", refused.payload
        assert refused.payload["still_running"] and refused.payload["stage"] == "restore"
        assert "no room here" in refused.payload["reason"]
        assert h1.agent.manager.get(sid) is not None and h2.agent.manager.get(sid) is None
        before = len(counts(source_log))
        await until(lambda: len(counts(source_log)) >= before + 5, "counting on after it", 60)
        keeper.apply = apply  # type: ignore[method-assign]

        rec = h1.recorded[sid]
        ended = await migrate(h1, sid)
        assert ended.type == "unit.migrated", ended.payload
        migrated = events.UnitMigrated.model_validate(ended.payload)
        assert (migrated.from_node, migrated.to_node) == ("node-1", "node-2")
        assert migrated.path == "handover" and migrated.interruption_ms > 0
        assert migrated.bytes_moved > 0  # the final delta, over the node-to-node channel
        assert {"launch", "recover", "final", "switch", "release"} <= set(migrated.stages_ms)
        # it runs on node-2 now, and only there
        assert h2.agent.manager.get(sid) is not None
        await until(lambda: h1.agent.manager.get(sid) is None, "released on node-1")
        # each printed only once durable; one taken into the aborted attempt's final
        # checkpoint was never printed (its checkpoint call was refused), none repeated
        acknowledged = counts(source_log)
        assert acknowledged == sorted(set(acknowledged)) and acknowledged[0] == 1
        restored = await until(
            lambda: next((w for w in lines(target_log) if w and w[0] == "restored"), None),
            "restored on node-2",
        )
        n = int(restored[1])
        # the state came back whole and holds every count node-1 acknowledged (the final
        # checkpoint may hold one count more, taken but not yet printed)
        assert restored[2] == "True" and acknowledged[-1] <= n <= acknowledged[-1] + 1
        await until(lambda: len(counts(target_log)) >= 10, "counting on node-2", 90)
        went_on = counts(target_log)
        assert went_on == list(range(n + 1, n + 1 + len(went_on))), "a count lost or repeated"
        # the caller on node-1 reaches it on node-2 (the cross-node bridge): answers with the
        # counts node-2 keeps; what it saw meanwhile were errors it retried
        seen = len(lines(caller_log))
        await until(
            lambda: sum(w[0] == "ok" and int(w[1]) > n for w in lines(caller_log)[seen:]) >= 5,
            "answered from node-2",
            60,
        )
        errors = {w[1] for w in lines(caller_log) if w[0] == "err"}
        assert errors <= {"PeerGone", "AgentNotFound", "CallTimeout"}, errors
        state = await h2.agent.lifecycle(sid)
        assert state.state == "running" and state.owned_by("node-2")
        # its tool's name is served from node-2 (the standby promoted), and only from there
        key = AgentKey(name, name, "default")
        b1, b2 = h1.wired.migrations.broker(), h2.wired.migrations.broker()
        assert b2._registry.owner(key) == sid and b1._registry.owner(key) is None
        assert b2._remote is not None and key in b2._remote._subs  # the bridge answers for it
        assert b1._remote is not None and key not in b1._remote._subs
        assert not rec.of("sandbox.exited")  # the sandbox lives on: no end was published
        await h2.upstream.user.publish(
            events.SandboxStopRequested(requested_by="test"), aggregate_id=sid
        )
        exited = await h2.wait_for(sid, "sandbox.exited", 60)
        await h1.wait_for(sid, "sandbox.exited", 60)  # the story below is node-1's recorder
        key = await h2.service.gate.keys.certificate(exited.key_id)  # type: ignore[union-attr]
        assert not isinstance(key, str) and key.node_id == "node-2"
        story = [
            a.envelope.type
            for a in rec.events
            if a.envelope.type
            in ("sandbox.ready", "unit.migration_started", "unit.migration_failed",
                "unit.migrated", "sandbox.exited")
        ]  # fmt: skip
        assert story == ["sandbox.ready", "unit.migration_started", "unit.migration_failed",
                         "unit.migration_started", "unit.migrated", "sandbox.exited"]  # fmt: skip
