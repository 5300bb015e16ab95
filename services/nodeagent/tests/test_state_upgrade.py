"""A live hand-over on one node, as ``dsec sandbox upgrade`` asks for it (docs/state.md
"Hand-over"): a new version of a stateful SDK agent is submitted with ``handover_from`` while
another agent of its task group calls its tool in a loop. The node agent starts the new
version beside the old one; its keeper streams the old one's state to it, the old one stops
after its final checkpoint and is frozen, the broker switches the tool's name, and the old
sandbox exits (``handed_over``). What a user sees: ``state.handed_over`` on the new sandbox
(with the interruption the node measured), the old one's ``sandbox.exited{handed_over}``, the
counter going on from the last durable count in the new version (nothing acknowledged lost,
nothing repeated), and the caller answered throughout, by the new version after the switch,
with no failed call."""

from __future__ import annotations

import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dsec_core import events
from dsec_core.layout import NodeLayout

from dsec_nodeagent.ipc.registry import AgentKey

sys.path.insert(0, str(Path(__file__).parent))
from _nodeagent_harness import NodeAgentHarness
from test_migration_criu import QUIET, until
from test_migration_handover import COUNTER, counts, lines

pytestmark = [pytest.mark.integration, pytest.mark.kernel]

COUNTING = COUNTER.replace(
    'client.tool("count")(lambda: len(ticks))',
    # (who answered: the sandbox's id; each sandbox has a pid namespace of its own)
    'client.tool("count")(lambda: [len(ticks), __import__("os").environ["DSEC_SANDBOX_ID"]])',
)
assert COUNTING != COUNTER
"""The counting agent of the migration test, its tool saying which sandbox answered."""

CALLER = """
import time
from dsec_sdk import DSecClient
client = DSecClient(timeout=10)
while True:
    t = time.perf_counter()
    try:
        n, by = client.call_tool(AGENT, "count")
        print("ok", n, round((time.perf_counter() - t) * 1000, 3), by, flush=True)
    except Exception as exc:
        print("err", type(exc).__name__, flush=True)
        time.sleep(0.05)
    time.sleep(0.01)
"""


@pytest.fixture
def home() -> Iterator[Path]:
    """A short home (the sandboxes' socket paths must fit in AF_UNIX's 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="upg-", dir="/tmp"))
    yield path / "n"
    shutil.rmtree(path, ignore_errors=True)


def answers(path: Path) -> list[tuple[int, float, str]]:
    """The caller's answered calls: (the count it was told, the call's milliseconds, the
    sandbox that answered)."""
    return [(int(w[1]), float(w[2]), w[3]) for w in lines(path) if w and w[0] == "ok"]


async def test_a_new_version_takes_over_the_state_and_the_tool_name_on_the_same_node(
    home: Path, nats_url: str, s3: Any, vault: Any
) -> None:
    stack = {**s3.settings(), **vault.settings()}
    async with NodeAgentHarness(home, nats_url, **stack) as h:
        name = f"upg-{uuid.uuid4().hex[:6]}"  # its own state (the stream is shared)
        old = await h.submit(name, COUNTING, QUIET, extra="state: {}\n")
        await h.wait_for(old, "sandbox.ready")
        layout = NodeLayout.of(home)
        old_log = layout.sandbox(old).logs / "stdout.log"
        await until(lambda: len(counts(old_log)) >= 10, "counting in v1", 90)
        caller = await h.submit(
            f"{name}-c", CALLER.replace("AGENT", repr(name)), QUIET, extra=f"task_group: {name}\n"
        )
        await h.wait_for(caller, "sandbox.ready")
        caller_log = layout.sandbox(caller).logs / "stdout.log"
        await until(lambda: len(answers(caller_log)) >= 5, "the caller answered", 60)

        new = await h.submit(name, COUNTING, QUIET, extra="state: {}\n", handover_from=old)
        handed = (await h.wait_for(new, "state.handed_over", 120)).decoded()
        assert handed.from_sandbox == old and handed.agent == name
        assert handed.interruption_ms > 0 and handed.deltas_streamed > 0
        exited = (await h.wait_for(old, "sandbox.exited", 60)).decoded()
        assert exited.reason == "handed_over"
        assert h.agent.manager.get(old) is None and h.agent.manager.get(new) is not None

        # The state came back whole in the new version and the count goes on from the last
        # durable one (the final checkpoint may hold one count more, taken but not printed).
        acknowledged = counts(old_log)
        assert acknowledged == list(range(1, len(acknowledged) + 1))
        new_log = layout.sandbox(new).logs / "stdout.log"
        restored = await until(
            lambda: next((w for w in lines(new_log) if w and w[0] == "restored"), None),
            "restored in v2",
        )
        n = int(restored[1])
        assert restored[2] == "True" and acknowledged[-1] <= n <= acknowledged[-1] + 1
        await until(lambda: len(counts(new_log)) >= 10, "counting in v2", 90)
        went_on = counts(new_log)
        assert went_on == list(range(n + 1, n + 1 + len(went_on))), "a count lost or repeated"

        # The caller never failed a call: answered by the old version, then (from the call that
        # crossed the switch on) by the new one only, told counts that never went back.
        await until(lambda: any(by == new for _, _, by in answers(caller_log)), "answered by v2")
        assert not [w for w in lines(caller_log) if w and w[0] != "ok"]
        told = answers(caller_log)
        by_whom = [by for _, _, by in told]
        switched = by_whom.index(new)
        assert set(by_whom[:switched]) == {old} and set(by_whom[switched:]) == {new}
        assert [c for c, _, _ in told] == sorted(c for c, _, _ in told), "a count went back"
        key = AgentKey(name, name, "default")
        assert h.wired.migrations.broker()._registry.owner(key) == new

        await h.upstream.user.publish(
            events.SandboxStopRequested(requested_by="test"), aggregate_id=new
        )
        await h.wait_for(new, "sandbox.exited", 60)
