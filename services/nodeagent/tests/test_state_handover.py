"""The hand-over's sequence (dsec_nodeagent.state.handover) against fake keeper sessions: what
the new version receives, in which order, and that every failure leaves the old one serving
(thawed, its tool name given back) while the new one gets an error and is stopped.

The freezer runs on a real cgroup v2 (a process frozen and thawed by the kernel) where the host
lets us create one; elsewhere those tests are skipped and the rest use a recording freezer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dsec_core.events import StateHandedOver

from dsec_nodeagent.state.handover import (
    CgroupFreezer,
    HandOverError,
    HandOverHooks,
    frozen,
    hand_over,
)
from dsec_nodeagent.state.keeper import SandboxState, StateKeeper, StateKey, StateSession

KEY = StateKey("acme", "g1", "agent-b")


class FakeSession(StateSession):
    def __init__(self, sandbox_id: str, *, final: list[dict[str, Any]] | None = None) -> None:
        self.key = KEY
        self.sandbox_id = sandbox_id
        self.sent: list[dict[str, Any]] = []
        self.callbacks: list[Any] = []
        self.ready = asyncio.Event()
        self.final = final if final is not None else [{"c": "log", "o": "append", "n": "final"}]
        self.final_error: Exception | None = None
        self.final_requested = asyncio.Event()
        self.before_final: Any = None  # a coroutine function run inside request_final
        self.durable = 4  # the keeper's seq of this state (FakeKeeper.records_of's to start)

    async def send(self, frame: dict[str, Any]) -> None:
        self.sent.append(frame)

    async def abort_handover(self, message: str) -> None:
        await self.send({"op": "error", "code": "handover-aborted", "message": message})

    def _seq(self) -> int:
        return self.durable

    async def request_final(self, to_sandbox: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        self.sent.append({"op": "handover", "to": to_sandbox})
        self.final_requested.set()
        if self.before_final is not None:
            await self.before_final()
        if self.final_error is not None:
            raise self.final_error
        if self.before_final is None and self.final:  # durable, not reported: the next seq
            self.durable += 1
        return self.final

    def on_checkpoint(self, callback: Any) -> None:
        self.callbacks.append(callback)

    def off_checkpoint(self, callback: Any) -> None:
        if callback in self.callbacks:  # (as the keeper's: a callback never added is fine)
            self.callbacks.remove(callback)

    async def checkpoint(self, seq: int, records: list[dict[str, Any]]) -> None:
        self.durable = max(self.durable, seq)
        for callback in self.callbacks:
            await callback(seq, records)


class FakeKeeper(StateKeeper):
    def __init__(self, old: SandboxState, new: SandboxState) -> None:
        self.infos = {old.sandbox_id: old, new.sandbox_id: new}
        self.owner: dict[StateKey, str] = {KEY: old.sandbox_id}

    def sandbox_of(self, sandbox_id: str) -> SandboxState | None:
        return self.infos.get(sandbox_id)

    async def records_of(self, session: StateSession) -> tuple[list[dict[str, Any]], int]:
        assert session.sandbox_id == "old"
        return [{"c": "log", "o": "full", "n": i} for i in range(3)], 4

    def switch_owner(self, old: StateSession, new: StateSession) -> None:
        assert self.owner[KEY] == old.sandbox_id
        self.owner[KEY] = new.sandbox_id


class RecordingFreezer:
    def __init__(self, fail_freeze: bool = False) -> None:
        self.calls: list[tuple[str, str]] = []
        self.fail_freeze = fail_freeze

    async def freeze(self, cgroup_dir: str) -> None:
        self.calls.append(("freeze", cgroup_dir))
        if self.fail_freeze:
            raise HandOverError("freezer", "the kernel said no")

    async def thaw(self, cgroup_dir: str) -> None:
        self.calls.append(("thaw", cgroup_dir))


class Node:
    """The node agent's side: broker switch, stops, events, all recorded."""

    def __init__(self, freezer: Any, *, switch_fails: bool = False) -> None:
        self.log: list[tuple[Any, ...]] = []
        self.published: list[tuple[str, StateHandedOver]] = []
        self.switch_fails = switch_fails
        self.hooks = HandOverHooks(
            freezer=freezer,
            switch=self.switch,
            release=self.release,
            stop_old=self.stop_old,
            stop_new=self.stop_new,
            publish=self.publish,
            ready_timeout_s=5.0,
            final_timeout_s=5.0,
        )

    async def switch(self, frm: SandboxState, to: SandboxState) -> int:
        self.log.append(("switch", frm.sandbox_id, to.sandbox_id))
        if self.switch_fails and to.sandbox_id == "new":
            raise OSError("broker gone")
        return 2

    async def release(self, frm: SandboxState, to: SandboxState) -> int:
        self.log.append(("release", frm.sandbox_id, to.sandbox_id))
        return 1

    async def stop_old(self, sandbox_id: str) -> None:
        self.log.append(("stop_old", sandbox_id))

    async def stop_new(self, sandbox_id: str, why: str) -> None:
        self.log.append(("stop_new", sandbox_id, why))

    async def publish(self, sandbox_id: str, event: StateHandedOver) -> None:
        self.published.append((sandbox_id, event))


def infos(cgroup_dir: str, *, handover_from: str | None = "old") -> tuple[SandboxState, ...]:
    old = SandboxState("old", "acme", "g1", "agent-b", None, cgroup_dir=cgroup_dir)
    new = SandboxState("new", "acme", "g1", "agent-b", None, handover_from=handover_from)
    return old, new


async def _drive(
    old: FakeSession, new: FakeSession, keeper: StateKeeper, hooks: HandOverHooks
) -> Any:
    """Run a hand-over while OLD checkpoints twice before NEW is ready."""
    task = asyncio.ensure_future(hand_over(keeper, old, new, hooks=hooks))
    await _until(lambda: any(f["op"] == "fetched" for f in new.sent))
    await old.checkpoint(3, [{"c": "log", "o": "append", "n": "stale"}])  # already streamed
    await old.checkpoint(5, [{"c": "log", "o": "append", "n": 5}])
    await old.checkpoint(6, [{"c": "kv", "o": "set", "n": 6}])
    await _until(lambda: sum(f["op"] == "deltas" for f in new.sent) == 2)
    new.ready.set()
    return await asyncio.wait_for(task, 10)


async def _until(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.005)


@pytest.mark.unit
async def test_the_new_version_gets_the_state_every_delta_then_the_final_and_the_switch() -> None:
    old_info, new_info = infos("/cg/old")
    keeper = FakeKeeper(old_info, new_info)
    freezer = RecordingFreezer()
    node = Node(freezer)
    old, new = FakeSession("old"), FakeSession("new")

    result = await _drive(old, new, keeper, node.hooks)

    assert result is not None
    assert [f["op"] for f in new.sent] == [
        "records",
        "fetched",
        "deltas",
        "deltas",
        "deltas",
        "switched",
    ]
    assert new.sent[0]["records"] == [{"c": "log", "o": "full", "n": i} for i in range(3)]
    assert new.sent[1]["seq"] == 4 and new.sent[1]["deltas"] == 3
    assert [f["seq"] for f in new.sent if f["op"] == "deltas"] == [5, 6, 7]
    assert new.sent[4]["records"] == old.final
    assert new.sent[-1]["seq"] == 7
    assert keeper.owner[KEY] == "new"
    assert new.sent[-1]["interruption_ms"] == result.interruption_ms >= 0
    assert old.sent == [{"op": "handover", "to": "new"}]
    assert freezer.calls == [("freeze", "/cg/old")]  # frozen, never thawed: it is stopped
    # OLD's callers are told which channels moved once nothing can undo it, before OLD dies
    assert node.log == [("switch", "old", "new"), ("release", "old", "new"), ("stop_old", "old")]
    [(sandbox, event)] = node.published
    assert sandbox == "new"
    assert (event.from_sandbox, event.agent, event.group, event.seq) == ("old", "agent-b", "g1", 7)
    assert event.deltas_streamed == 3 + 1 + 1 + 1
    assert result.callers_moved == 2


@pytest.mark.unit
async def test_a_final_checkpoint_also_reported_as_a_checkpoint_is_forwarded_once() -> None:
    old_info, new_info = infos("/cg/old")
    keeper = FakeKeeper(old_info, new_info)
    node = Node(RecordingFreezer())
    old, new = FakeSession("old"), FakeSession("new")

    async def durable_final() -> None:  # the keeper reports the final checkpoint like any other
        await old.checkpoint(9, old.final)

    old.before_final = durable_final
    await _drive(old, new, keeper, node.hooks)

    deltas = [f for f in new.sent if f["op"] == "deltas"]
    assert [f["seq"] for f in deltas] == [5, 6, 9]
    assert sum(f["records"] == old.final for f in deltas) == 1


@pytest.mark.unit
async def test_an_empty_final_checkpoint_still_moves_the_seq_new_continues_from() -> None:
    old_info, new_info = infos("/cg/old")
    keeper = FakeKeeper(old_info, new_info)
    node = Node(RecordingFreezer())
    old, new = FakeSession("old", final=[]), FakeSession("new")

    async def durable_final() -> None:
        await old.checkpoint(7, old.final)

    old.before_final = durable_final
    result = await _drive(old, new, keeper, node.hooks)

    assert result is not None
    assert [f["seq"] for f in new.sent if f["op"] == "deltas"] == [5, 6]  # nothing to apply
    assert new.sent[-1]["op"] == "switched" and new.sent[-1]["seq"] == 7


@pytest.mark.unit
async def test_a_durable_checkpoint_the_new_version_never_got_fails_the_hand_over() -> None:
    """NEW would go on from a seq whose records it never received: the hand-over fails before
    the switch (OLD thawed, told, serving; NEW told and stopped), never a NEW out of step."""
    old_info, new_info = infos("/cg/old")
    keeper = FakeKeeper(old_info, new_info)
    freezer = RecordingFreezer()
    node = Node(freezer)
    old, new = FakeSession("old"), FakeSession("new")

    async def unreported() -> None:  # one more made durable, never reported; then the final
        old.durable += 2

    old.before_final = unreported
    assert await _drive(old, new, keeper, node.hooks) is None
    assert freezer.calls == [("freeze", "/cg/old"), ("thaw", "/cg/old")]
    assert not [c for c in node.log if c[0] == "switch"] and keeper.owner[KEY] == "old"
    assert old.sent[-1]["code"] == "handover-aborted"
    assert new.sent[-1]["op"] == "error" and "durable up to checkpoint" in new.sent[-1]["message"]
    assert node.log[-1][:2] == ("stop_new", "new") and not node.published
    assert not old.callbacks  # OLD's later checkpoints go to no hand-over


@pytest.mark.unit
async def test_new_never_ready_leaves_old_untouched_and_new_stopped() -> None:
    old_info, new_info = infos("/cg/old")
    keeper = FakeKeeper(old_info, new_info)
    freezer = RecordingFreezer()
    node = Node(freezer)
    node.hooks.ready_timeout_s = 0.2
    old, new = FakeSession("old"), FakeSession("new")

    assert await hand_over(keeper, old, new, hooks=node.hooks) is None
    assert keeper.owner[KEY] == "old"  # the state stays the old version's

    assert old.sent == []  # never asked for a final checkpoint: it kept serving throughout
    assert freezer.calls == []
    assert new.sent[-1]["op"] == "error"
    assert node.log[-1][:2] == ("stop_new", "new")
    assert node.published == []


@pytest.mark.unit
async def test_a_failed_freeze_resumes_old_and_stops_new() -> None:
    old_info, new_info = infos("/cg/old")
    keeper = FakeKeeper(old_info, new_info)
    freezer = RecordingFreezer(fail_freeze=True)
    node = Node(freezer)
    old, new = FakeSession("old"), FakeSession("new")

    assert await _drive(old, new, keeper, node.hooks) is None
    assert keeper.owner[KEY] == "old"  # the state stays the old version's

    assert old.sent[-1]["code"] == "handover-aborted"  # it takes calls again
    assert new.sent[-1] == {
        "op": "error",
        "code": "freezer",
        "message": "the kernel said no",
        "seq": None,
    }
    assert ("stop_old", "old") not in node.log
    assert node.log[-1][:2] == ("stop_new", "new")


@pytest.mark.unit
async def test_a_failed_switch_gives_the_name_back_and_thaws_old() -> None:
    old_info, new_info = infos("/cg/old")
    keeper = FakeKeeper(old_info, new_info)
    freezer = RecordingFreezer()
    node = Node(freezer, switch_fails=True)
    old, new = FakeSession("old"), FakeSession("new")

    assert await _drive(old, new, keeper, node.hooks) is None
    assert keeper.owner[KEY] == "old"  # the state stays the old version's

    assert freezer.calls == [("freeze", "/cg/old"), ("thaw", "/cg/old")]
    assert node.log[:2] == [("switch", "old", "new"), ("switch", "new", "old")]
    assert ("stop_old", "old") not in node.log
    assert new.sent[-1]["op"] == "error"
    assert node.published == []


@pytest.mark.unit
async def test_a_hand_over_undone_after_the_switch_never_releases_old_callers() -> None:
    """NEW's connection fails as it is told ``switched``: the switch is undone and OLD thawed,
    so OLD may still read a call waiting in its ring; no caller may be told to send it again."""
    old_info, new_info = infos("/cg/old")
    keeper = FakeKeeper(old_info, new_info)
    freezer = RecordingFreezer()
    node = Node(freezer)
    old, new = FakeSession("old"), FakeSession("new")
    sent = new.send

    async def send(frame: dict[str, Any]) -> None:
        if frame["op"] == "switched":
            raise ConnectionError("the new version's connection closed")
        await sent(frame)

    new.send = send  # type: ignore[method-assign]
    assert await _drive(old, new, keeper, node.hooks) is None
    assert node.log[:2] == [("switch", "old", "new"), ("switch", "new", "old")]
    assert not [c for c in node.log if c[0] in ("release", "stop_old")]
    assert freezer.calls == [("freeze", "/cg/old"), ("thaw", "/cg/old")]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("old_tenant", "handover_from", "words"),
    [("umbrella", "old", "another agent"), ("acme", "someone-else", "not started to take over")],
)
async def test_a_hand_over_between_strangers_is_refused(
    old_tenant: str, handover_from: str, words: str
) -> None:
    old_info = SandboxState("old", old_tenant, "g1", "agent-b", None, cgroup_dir="/cg/old")
    new_info = SandboxState("new", "acme", "g1", "agent-b", None, handover_from=handover_from)
    node = Node(RecordingFreezer())
    old, new = FakeSession("old"), FakeSession("new")

    assert await hand_over(FakeKeeper(old_info, new_info), old, new, hooks=node.hooks) is None

    assert new.sent[-1]["code"] == "handover-refused"
    assert words in new.sent[-1]["message"]
    assert old.sent == [] and old.callbacks == []


# ---------------------------------------------------------------------- the real freezer
_UNIFIED = Path("/sys/fs/cgroup/unified")
_ROOT = _UNIFIED if (_UNIFIED / "cgroup.procs").exists() else Path("/sys/fs/cgroup")


@pytest.fixture
def cgroup() -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    """A fresh cgroup v2 holding one sleeping process."""
    if os.geteuid() != 0 or not os.access(_ROOT, os.W_OK):
        pytest.skip("needs root and a writable cgroup v2 tree")
    directory = _ROOT / f"dsec-test-handover-{uuid.uuid4().hex[:8]}"
    try:
        directory.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup: {exc}")
    if not (directory / "cgroup.freeze").exists():
        directory.rmdir()
        pytest.skip("this kernel has no cgroup v2 freezer")
    proc = subprocess.Popen(["sleep", "300"])
    try:
        (directory / "cgroup.procs").write_text(str(proc.pid))
        yield directory, proc
    finally:
        with contextlib.suppress(OSError):
            (directory / "cgroup.freeze").write_text("0")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for _ in range(100):
            try:
                directory.rmdir()
                break
            except OSError:
                subprocess.run(["sleep", "0.01"], check=False)


def _state(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("State:"):
            return line.split()[1]
    return "?"


@pytest.mark.kernel
async def test_the_cgroup_freezer_stops_and_resumes_every_process(
    cgroup: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    directory, _ = cgroup
    freezer = CgroupFreezer()
    await freezer.freeze(str(directory))
    assert frozen(directory)
    await freezer.thaw(str(directory))
    assert not frozen(directory)


@pytest.mark.kernel
async def test_a_hand_over_failing_after_the_freeze_leaves_old_running(
    cgroup: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    directory, proc = cgroup
    old_info, new_info = infos(str(directory))
    node = Node(CgroupFreezer(), switch_fails=True)
    old, new = FakeSession("old"), FakeSession("new")

    assert await _drive(old, new, FakeKeeper(old_info, new_info), node.hooks) is None

    assert not frozen(directory)
    assert proc.poll() is None and _state(proc.pid) in ("S", "R")


@pytest.mark.kernel
async def test_a_completed_hand_over_leaves_old_frozen_until_it_is_stopped(
    cgroup: tuple[Path, subprocess.Popen[bytes]],
) -> None:
    directory, _ = cgroup
    old_info, new_info = infos(str(directory))
    node = Node(CgroupFreezer())
    old, new = FakeSession("old"), FakeSession("new")

    result = await _drive(old, new, FakeKeeper(old_info, new_info), node.hooks)

    assert result is not None
    assert frozen(directory)
    assert node.log[-1] == ("stop_old", "old")


# ---------------------------------------------------------------------- the node agent's hooks
class _Manager:
    def __init__(self) -> None:
        self.stopped: list[tuple[str, Any, float]] = []

    def get(self, sandbox_id: str) -> Any:
        class Ready:
            cgroup_path = f"/cg/{sandbox_id}"

        class Running:
            ready = Ready()

        return Running() if sandbox_id == "old" else None

    async def stop(self, sandbox_id: str, *, reason: Any, grace_s: float) -> None:
        self.stopped.append((sandbox_id, reason, grace_s))


class _Outlet:
    def __init__(self) -> None:
        self.published: list[tuple[Any, str]] = []

    async def lifecycle(self, payload: Any, aggregate_id: str, event_id: str | None) -> None:
        self.published.append((payload, aggregate_id))


class _Broker:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def switch(self, key: Any, to: str) -> int:
        self.calls.append(("switch", key, to))
        return 3

    def forget_handover(self, sandbox_id: str) -> None:
        self.calls.append(("forget", sandbox_id))


@pytest.mark.unit
async def test_the_node_agent_hooks_switch_the_broker_stop_old_as_handed_over_and_publish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dsec_nodeagent.ipc.registry import AgentKey
    from dsec_nodeagent.sandbox.models import ExitReason
    from dsec_nodeagent.state.wiring import install

    class Agent:
        manager = _Manager()
        outlet = _Outlet()

    broker = _Broker()
    old_info = SandboxState("old", "acme", "g1", "agent-b", None)  # no cgroup registered
    new_info = SandboxState("new", "acme", "g1", "agent-b", None, handover_from="old")
    keeper = FakeKeeper(old_info, new_info)
    install(keeper, Agent(), lambda: broker)  # type: ignore[arg-type]
    assert keeper.handover is not None
    old, new = FakeSession("old"), FakeSession("new")

    async def ready_soon() -> None:
        await _until(lambda: any(f["op"] == "fetched" for f in new.sent))
        new.ready.set()

    freezer_calls: list[str] = []

    async def fake_freeze(cgroup_dir: str) -> None:
        freezer_calls.append(cgroup_dir)

    async def freeze(self: CgroupFreezer, cgroup_dir: str) -> None:
        await fake_freeze(cgroup_dir)

    monkeypatch.setattr(CgroupFreezer, "freeze", freeze)
    await asyncio.gather(keeper.handover(keeper, old, new), ready_soon())

    assert freezer_calls == ["/cg/old"]  # the running sandbox's cgroup, from the manager
    assert broker.calls == [("switch", AgentKey("g1", "agent-b", "acme"), "new"), ("forget", "new")]
    assert Agent.manager.stopped == [("old", ExitReason.HANDED_OVER, 0.0)]
    [(event, sandbox)] = Agent.outlet.published
    assert sandbox == "new" and isinstance(event, StateHandedOver)
    assert event.from_sandbox == "old"


@pytest.mark.unit
async def test_the_new_sandbox_is_registered_with_the_keeper_with_its_cgroup(
    tmp_path: Path,
) -> None:
    from dsec_core.settings import Settings
    from dsec_core.spec import compile_plan, load_spec

    from dsec_nodeagent.agent import NodeAgent

    spec = 'version: "1.2"\nname: agent-b\nbase: python:3.11\nentrypoint: [python, a.py]\n'
    loaded = load_spec(spec + "state: {restart: never}\n", "dsec.yaml")
    assert loaded.spec is not None, loaded.errors
    plan = compile_plan(loaded.spec)
    stateless = load_spec(spec, "dsec.yaml").spec
    assert stateless is not None
    plain_plan = compile_plan(stateless)

    class Registrations(StateKeeper):
        def __init__(self) -> None:
            self.registered: list[SandboxState] = []

        def register_sandbox(self, info: SandboxState) -> None:
            self.registered.append(info)

    agent = NodeAgent(Settings(home=tmp_path), None, lambda: None)  # type: ignore[arg-type,return-value]
    keeper = Registrations()
    agent.state_keeper = keeper
    await agent._attach(plan, plan, "sbx_old")("sbx_new", tmp_path / "cg", 7)
    # a sandbox without a `state:` section has nothing for the keeper
    await agent._attach(plain_plan, plain_plan)("sbx_plain", tmp_path / "cg2", 8)

    [info] = keeper.registered
    assert (info.sandbox_id, info.handover_from, info.cgroup_dir) == (
        "sbx_new",
        "sbx_old",
        str(tmp_path / "cg"),
    )
    assert (info.tenant, info.agent) == (plan.tenant, "agent-b")
