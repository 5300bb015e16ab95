"""A stateful sandbox (spec ``state:``, ``restart: on-failure``) killed with SIGKILL comes back in
place: same sandbox id, a new process, ``sandbox.restarted`` (no second ``sandbox.ready``: it
stays running); after ``max_restarts`` its exit is final. A sandbox without ``state:`` just
exits, and a stopped stateful sandbox is not started again. The state keeper is told about each
attempt before it runs and let go of the sandbox once, at the final exit.

Each test runs the whole node agent in this process (real NATS, real sandboxes, eBPF) through
``_nodeagent_harness``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from dsec_core import events

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the harness
from _nodeagent_harness import NodeAgentHarness

from dsec_nodeagent import agent as agent_module
from dsec_nodeagent.state.keeper import SandboxState, StateKeeper

pytestmark = [pytest.mark.kernel, pytest.mark.integration]

QUIET = "{domain: allowed.test, ports: [443]}"
LONG = "import time\nprint('up', flush=True)\ntime.sleep(600)\n"


class RecordingKeeper(StateKeeper):
    """Records what the node agent tells the keeper."""

    def __init__(self) -> None:
        self.registered: list[SandboxState] = []
        self.forgotten: list[str] = []

    def register_sandbox(self, info: SandboxState) -> None:
        self.registered.append(info)

    def forget_sandbox(self, sandbox_id: str) -> None:
        self.forgotten.append(sandbox_id)


@pytest.fixture
def home() -> Iterator[Path]:
    """A short home: the sandboxes' socket paths must fit in AF_UNIX's 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="drs-", dir="/tmp"))
    yield path / "home"
    shutil.rmtree(path, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _until_gone(pid: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and Path(f"/proc/{pid}").exists():
        assert time.monotonic() < deadline, f"pid {pid} still runs"
        await asyncio.sleep(0.02)


async def _nth(
    h: NodeAgentHarness, sid: str, event_type: str, n: int, timeout_s: float = 60.0
) -> events.Payload:
    """The ``n``-th (1-based) ``event_type`` of ``sid`` (polling the recorder)."""
    deadline = time.monotonic() + timeout_s
    rec = h.recorded[sid]
    while len(rec.of(event_type)) < n:
        seen = [a.envelope.type for a in rec.events]
        assert time.monotonic() < deadline, f"no {event_type} #{n} for {sid}; saw {seen}"
        await asyncio.sleep(0.05)
    return rec.of(event_type)[n - 1].decoded()


def _types(h: NodeAgentHarness, sid: str) -> list[str]:
    return [a.envelope.type for a in h.recorded[sid].events if a.envelope.producer == "nodeagent"]


async def test_a_killed_stateful_sandbox_restarts_in_place_until_max_restarts(
    home: Path, nats_url: str
) -> None:
    async with NodeAgentHarness(home, nats_url) as h:
        keeper = RecordingKeeper()
        h.agent.state_keeper = keeper
        sid = await h.submit("keeper", LONG, QUIET, extra="state:\n  max_restarts: 2\n")
        ready = (await h.wait_for(sid, "sandbox.ready")).decoded()
        assert isinstance(ready, events.SandboxReady)
        pids = [ready.pid]
        first_run = h.agent.manager.get(sid)
        assert first_run is not None
        cgroup_ids = [first_run.ready.cgroup_id]
        # registered before its first instruction, with its cgroup (the hand-over's freezer)
        first = keeper.registered[0]
        assert (first.sandbox_id, first.agent, first.group, first.tenant) == (
            sid,
            "keeper",
            "keeper",
            "default",
        )
        assert first.plan is not None and first.plan.max_restarts == 2
        assert first.cgroup_dir == ready.cgroup

        for n in (1, 2):
            os.kill(pids[-1], signal.SIGKILL)
            restarted = await _nth(h, sid, "sandbox.restarted", n)
            assert isinstance(restarted, events.SandboxRestarted)
            assert (restarted.restarts, restarted.signal, restarted.reason) == (
                n,
                signal.SIGKILL,
                "error",
            )
            assert restarted.pid not in pids and _alive(restarted.pid)
            running = h.agent.manager.get(sid)
            assert running is not None and running.ready.pid == restarted.pid
            pids.append(restarted.pid)
            # the egress programs are on the new attempt's cgroup, once (none left on the old)
            attached = [a for a in h.controller.sandboxes() if a.sandbox_id == sid]
            assert [a.cgroup_id for a in attached] == [running.ready.cgroup_id]
            assert running.ready.cgroup_id not in cgroup_ids
            cgroup_ids.append(running.ready.cgroup_id)
            assert keeper.registered[-1].cgroup_dir == running.ready.cgroup_path
            state = await h.agent.lifecycle(sid)
            assert (state.state, state.restarts) == ("running", n)
            assert len(keeper.registered) == n + 1 and keeper.forgotten == []

        # the third death is one more than max_restarts: final
        os.kill(pids[-1], signal.SIGKILL)
        exited = (await h.wait_for(sid, "sandbox.exited")).decoded()
        assert isinstance(exited, events.SandboxExited)
        assert exited.reason == "error"
        assert exited.detail is not None and "restarted 2 times" in exited.detail
        assert _types(h, sid).count("sandbox.ready") == 1
        assert _types(h, sid).count("sandbox.restarted") == 2
        assert keeper.forgotten == [sid]
        assert h.agent.manager.get(sid) is None
        # nothing of it is left: no egress attachment, no cgroup, no proxy, no context
        assert [a for a in h.controller.sandboxes() if a.sandbox_id == sid] == []
        assert not Path(ready.cgroup).exists()
        assert sid not in h.agent._contexts and sid not in h.agent._keepalive
        state = await h.agent.lifecycle(sid)
        assert (state.state, state.restarts) == ("exited", 2)


async def test_a_killed_sandbox_without_state_just_exits(home: Path, nats_url: str) -> None:
    async with NodeAgentHarness(home, nats_url) as h:
        keeper = RecordingKeeper()
        h.agent.state_keeper = keeper
        sid = await h.submit("plain", LONG, QUIET)
        ready = (await h.wait_for(sid, "sandbox.ready")).decoded()
        assert isinstance(ready, events.SandboxReady)
        os.kill(ready.pid, signal.SIGKILL)
        exited = (await h.wait_for(sid, "sandbox.exited")).decoded()
        assert isinstance(exited, events.SandboxExited)
        assert exited.reason == "error" and "SIGKILL" in (exited.detail or "")
        assert "sandbox.restarted" not in _types(h, sid)
        assert (keeper.registered, keeper.forgotten) == ([], [])


async def test_a_stateful_sandbox_that_exits_cleanly_or_is_stopped_is_not_restarted(
    home: Path, nats_url: str
) -> None:
    async with NodeAgentHarness(home, nats_url) as h:
        keeper = RecordingKeeper()
        h.agent.state_keeper = keeper
        clean = await h.submit("clean", "print('done')", QUIET, extra="state: {}\n")
        stopped = await h.submit("stopped", LONG, QUIET, extra="state: {}\n")
        ready = (await h.wait_for(stopped, "sandbox.ready")).decoded()
        assert isinstance(ready, events.SandboxReady)
        await h.upstream.user.publish(
            events.SandboxStopRequested(requested_by="test", grace_s=1.0), aggregate_id=stopped
        )
        exited = (await h.wait_for(stopped, "sandbox.exited")).decoded()
        assert isinstance(exited, events.SandboxExited) and exited.reason == "stopped"
        await _until_gone(ready.pid)
        done = (await h.wait_for(clean, "sandbox.exited")).decoded()
        assert isinstance(done, events.SandboxExited)
        assert (done.reason, done.exit_code) == ("ok", 0)
        for sid in (clean, stopped):
            assert "sandbox.restarted" not in _types(h, sid)
            assert h.agent.manager.get(sid) is None
        assert sorted(keeper.forgotten) == sorted([clean, stopped])


async def test_a_stop_while_it_waits_to_restart_ends_it_as_stopped(
    home: Path, nats_url: str
) -> None:
    async with NodeAgentHarness(home, nats_url) as h:
        sid = await h.submit("down", "import sys\nsys.exit(3)\n", QUIET, extra="state: {}\n")
        # it dies at once, again and again: stop it between two attempts
        await _nth(h, sid, "sandbox.restarted", 1)
        await h.upstream.user.publish(
            events.SandboxStopRequested(requested_by="test", grace_s=1.0), aggregate_id=sid
        )
        exited = (await h.wait_for(sid, "sandbox.exited")).decoded()
        assert isinstance(exited, events.SandboxExited)
        assert exited.reason == "stopped"
        # the stop ended it, not running out of restarts (the default max_restarts is 5)
        assert "max_restarts" not in (exited.detail or ""), exited.detail
        assert _types(h, sid).count("sandbox.restarted") >= 1
        assert h.agent.manager.get(sid) is None


async def test_a_node_agent_stopping_while_one_waits_to_restart_publishes_its_exit(
    home: Path, nats_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(agent_module, "RESTART_BACKOFF_S", 60.0)  # it waits while we stop
    async with NodeAgentHarness(home, nats_url) as h:
        keeper = RecordingKeeper()
        h.agent.state_keeper = keeper
        sid = await h.submit("orphan", "import sys\nsys.exit(3)\n", QUIET, extra="state: {}\n")
        deadline = time.monotonic() + 60
        while sid not in h.agent._restarting:
            assert time.monotonic() < deadline, _types(h, sid)
            await asyncio.sleep(0.02)
        await h.stop_agent()
        exited = (await h.wait_for(sid, "sandbox.exited")).decoded()
        assert isinstance(exited, events.SandboxExited)
        assert (exited.reason, exited.exit_code) == ("error", 3)
        assert "not restarted: its node agent stopped" in (exited.detail or "")
        assert "sandbox.restarted" not in _types(h, sid)
        assert keeper.forgotten == [sid]


async def test_a_stateful_sandbox_readopted_by_a_new_node_agent_is_registered_again(
    home: Path, nats_url: str
) -> None:
    """It outlived its node agent: the next one registers it with its keeper (its agent
    reconnects), does not restart it (the config it ran with died with the old node agent),
    and forgets it at its exit."""
    async with NodeAgentHarness(home, nats_url) as first:
        sid = await first.submit("outlives", LONG, QUIET, extra="state: {}\n")
        ready = (await first.wait_for(sid, "sandbox.ready")).decoded()
        assert isinstance(ready, events.SandboxReady)
        await first.stop_agent()  # a node agent restart: the sandbox keeps running
        second = NodeAgentHarness(home, nats_url)
        keeper = RecordingKeeper()
        second.agent.state_keeper = keeper
        async with second:
            assert second.agent.manager.get(sid) is not None
            assert [(r.sandbox_id, r.agent, r.cgroup_dir) for r in keeper.registered] == [
                (sid, "outlives", ready.cgroup)
            ]
            os.kill(ready.pid, signal.SIGKILL)
            exited = (await second.wait_for(sid, "sandbox.exited")).decoded()
            assert isinstance(exited, events.SandboxExited) and exited.reason == "error"
            assert "sandbox.restarted" not in _types(second, sid)
            assert keeper.forgotten == [sid]
