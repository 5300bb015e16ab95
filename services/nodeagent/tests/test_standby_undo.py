"""What a migration's standby start on the target leaves when it does not become the sandbox
(dsec_nodeagent.agent.NodeAgent.launch_migrated / release_migrated): its egress programs and
rules, attached by the launch's hook before the launch failed or was cancelled, are detached;
a copy of the same id that runs here keeps its own; a released copy's state registration goes
at its exit."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from dsec_core.settings import Settings
from dsec_core.spec import EnforcementPlan, compile_plan, load_spec

from dsec_nodeagent.agent import Launched, NodeAgent, StartBusy, StartRefused, _Exits
from dsec_nodeagent.sandbox.models import ExitReason, SandboxExited, SandboxStartError
from dsec_nodeagent.state.keeper import SandboxState, StateKeeper

pytestmark = pytest.mark.unit

SPEC = 'version: "1.2"\nname: agent-b\nbase: python:3.11\nentrypoint: [python, a.py]\n'


def _plan(extra: str = "") -> EnforcementPlan:
    loaded = load_spec(SPEC + extra, "dsec.yaml")
    assert loaded.spec is not None, loaded.errors
    return compile_plan(loaded.spec)


class Egress:
    """The node's egress (app.py passes ``egress.attach`` / ``egress.detach``): which sandboxes
    have programs on a cgroup now."""

    def __init__(self) -> None:
        self.attached: dict[str, Path] = {}
        self.entered = asyncio.Event()
        self.hold: asyncio.Event | None = None

    async def attach(self, sid: str, cgroup: Path, *_: object) -> None:
        self.attached[sid] = cgroup
        self.entered.set()
        if self.hold is not None:
            await self.hold.wait()

    async def detach(self, sid: str) -> None:
        await asyncio.sleep(0)  # a real detach awaits the controller
        self.attached.pop(sid, None)


class Registrations(StateKeeper):
    def __init__(self) -> None:
        self._sandboxes: dict[str, SandboxState] = {}


def _agent(tmp: Path, egress: Egress) -> NodeAgent:
    agent = NodeAgent(
        Settings(home=tmp),
        None,  # type: ignore[arg-type]
        lambda: None,  # type: ignore[arg-type,return-value]
        before_start=egress.attach,
        on_stopped=egress.detach,
    )
    agent.state_keeper = Registrations()
    return agent


def _launching(agent: NodeAgent, plan: EnforcementPlan, fail: BaseException | None) -> None:
    """``_launch`` as far as the manager's hook on the new cgroup: the hook runs (egress on,
    rules kept, state registered), then the launch fails with ``fail`` (None: it waits)."""

    async def launch(
        sid: str, staging: Any, built: Any, *, standby: bool = False, hooked: Any = None
    ) -> list[Any]:
        assert standby
        agent._rules[sid] = object()  # type: ignore[assignment]
        await agent._attach(plan, plan, sid, hooked)(sid, Path("/sys/fs/cgroup/dsec") / sid, 7)
        if fail is not None:
            raise fail
        await asyncio.Event().wait()
        return []

    agent._launch = launch  # type: ignore[method-assign]


async def test_a_standby_whose_launch_failed_leaves_no_egress(tmp_path: Path) -> None:
    egress = Egress()
    agent = _agent(tmp_path, egress)
    _launching(agent, _plan(), SandboxStartError("sbx", "spawn", "init died"))
    with pytest.raises(SandboxStartError):
        await agent.launch_migrated("sbx", None, None)  # type: ignore[arg-type]
    assert egress.attached == {}
    assert "sbx" not in agent._rules


async def test_a_standby_cancelled_while_its_egress_attaches_leaves_none(tmp_path: Path) -> None:
    egress = Egress()
    egress.hold = asyncio.Event()
    agent = _agent(tmp_path, egress)
    _launching(agent, _plan(), None)
    task = asyncio.create_task(agent.launch_migrated("sbx", None, None))  # type: ignore[arg-type]
    await asyncio.wait_for(egress.entered.wait(), 5)
    task.cancel()
    egress.hold.set()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert egress.attached == {}
    assert "sbx" not in agent._rules


async def test_a_failed_standby_leaves_a_running_copy_of_the_id_its_egress(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    egress = Egress()
    agent = _agent(tmp_path, egress)
    egress.attached["sbx"] = Path("/sys/fs/cgroup/dsec/sbx")  # a copy of it runs here

    async def refused(sid: str, *_: Any, **__: Any) -> list[Any]:
        raise SandboxStartError(sid, "plan", "its run directory exists")  # before the hook

    agent._launch = refused  # type: ignore[method-assign]
    with pytest.raises(SandboxStartError):
        await agent.launch_migrated("sbx", None, None)  # type: ignore[arg-type]
    assert egress.attached == {"sbx": Path("/sys/fs/cgroup/dsec/sbx")}

    # a standby of an id that runs or starts here touches nothing of it
    monkeypatch.setattr(agent.manager, "busy", lambda sid: sid == "sbx")
    del agent._launch
    with pytest.raises(StartRefused, match="already runs or starts"):
        await agent.launch_migrated("sbx", None, None)  # type: ignore[arg-type]
    assert egress.attached == {"sbx": Path("/sys/fs/cgroup/dsec/sbx")}


async def test_a_start_of_an_id_waits_for_the_exit_of_its_earlier_copy(tmp_path: Path) -> None:
    """Its GPU slice, egress and context are released by the exit handler, by the id: a start
    beside it had its own released instead."""
    agent = _agent(tmp_path, Egress())
    exiting = asyncio.Event()
    agent._exiting["sbx"] = _Exits(count=1, done=exiting)
    assert agent.exiting("sbx")
    entered = asyncio.Event()

    async def start() -> None:
        async with agent._one_start_after_exit("sbx"):
            entered.set()

    task = asyncio.create_task(start())
    await asyncio.sleep(0.05)
    assert not entered.is_set()
    del agent._exiting["sbx"]
    exiting.set()
    await asyncio.wait_for(task, 5)
    assert entered.is_set()


async def test_a_start_behind_an_exit_that_hangs_is_given_back_to_be_retried(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsec_nodeagent import agent as agent_module

    monkeypatch.setattr(agent_module, "EXIT_WAIT_S", 0.05)
    agent = _agent(tmp_path, Egress())
    agent._exiting["sbx"] = _Exits(count=1)  # (its event never published)
    with pytest.raises(StartBusy, match="still being handled"):
        async with agent._one_start_after_exit("sbx"):
            raise AssertionError("not reached")
    assert agent._starting == {}


async def test_a_released_copy_lets_its_state_go_at_its_exit(tmp_path: Path) -> None:
    egress = Egress()
    agent = _agent(tmp_path, egress)
    plan = _plan("state: {restart: never}\n")
    await agent._attach(plan, plan)("sbx", tmp_path / "cg", 7)
    keeper = agent.state_keeper
    assert keeper is not None and keeper.sandbox_of("sbx") is not None
    agent._launched["sbx"] = Launched(
        SimpleNamespace(env={}),  # type: ignore[arg-type]
        plan,
        plan,
        time.time(),
    )
    agent.release_migrated("sbx")  # it runs on the other node now
    agent.outlet = SimpleNamespace(gate=SimpleNamespace(forget=lambda sid: None))  # type: ignore[assignment]
    now = time.time()
    await agent._exited(
        SandboxExited(
            sandbox_id="sbx",
            exit_code=None,
            signal=9,
            reason=ExitReason.STOPPED,
            detail="stopped",
            started_at=now - 1,
            ended_at=now,
            stdout_path="",
            stderr_path="",
        )
    )
    assert keeper.sandbox_of("sbx") is None
    assert egress.attached == {}


async def test_a_scheduled_start_of_an_id_held_here_is_retried_touching_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Held by another copy (a migration's restore of it, a start's leftovers): before, the
    start went on, was refused by the manager, and its clean-up dropped the other copy's
    placement attempt, rules and egress, and published ``sandbox.failed`` for it."""
    egress = Egress()
    agent = _agent(tmp_path, egress)
    egress.attached["sbx"] = Path("/sys/fs/cgroup/dsec/sbx")
    agent._attempts["sbx"] = 3
    agent._rules["sbx"] = object()  # type: ignore[assignment]
    monkeypatch.setattr(agent.manager, "busy", lambda sid: sid == "sbx")
    with pytest.raises(StartBusy, match="another copy"):
        await agent._start("sbx", None, SimpleNamespace(attempt=4))  # type: ignore[arg-type]
    assert agent._attempts == {"sbx": 3} and "sbx" in agent._rules
    assert egress.attached == {"sbx": Path("/sys/fs/cgroup/dsec/sbx")}
    assert agent._ended_here == {}
