"""The stateful example agent (examples/stateful-agent) without a stack: its state in the SDK's
local store, its tool calls through a real IPC broker (the node agent's, on a loop thread).

- What its README's "plain Python" section promises: v1 chats, is SIGKILLed (no close, no final
  checkpoint) and a new process of it finds every answered chat back; v2 opened on the same state
  says its history is complete.
- The caller against the agent over the broker: the agent is SIGKILLed and started again (what
  the node agent's restart does), then replaced by v2 the same way; the caller reports every
  acknowledged chat back after each, v2's history complete, and ends with exit 0 after its
  chats with v2. (The live hand-over needs the node agent: the demo scene,
  ``examples/stateful-agent/demo.sh``.)
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "stateful-agent"


def run_agent(code_dir: Path, state_dir: Path, script: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DSEC_STATE_DIR": str(state_dir)}
    env.pop("DSEC_IPC_SOCKET", None)
    return subprocess.run(
        [sys.executable, "-c", script],
        cwd=code_dir,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


CHATS = """
import json, os, signal, agent
answers = [agent.chat(f"hello number {i}", id=f"m-{i:03d}") for i in range(25)]
print(json.dumps(answers[-1]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # a crash: no close(), no final checkpoint
"""

CHECK = """
import json, agent
ids = [f"m-{i:03d}" for i in range(25)]
print(json.dumps({**agent.missing(ids), "restored": agent.state.restored.seq,
                  **({"complete": agent.complete()} if hasattr(agent, "complete") else {})}))
"""


@pytest.mark.unit
def test_answered_chats_survive_sigkill_and_v2_has_the_whole_history(tmp_path: Path) -> None:
    state = tmp_path / "state"
    crashed = run_agent(EXAMPLE, state, CHATS)
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    last = json.loads(crashed.stdout.strip().splitlines()[-1])
    assert last == {"turns": 50, "version": "v1"}

    v1 = run_agent(EXAMPLE, state, CHECK)
    assert v1.returncode == 0, v1.stderr
    back = json.loads(v1.stdout.strip().splitlines()[-1])
    assert back["missing"] == [] and back["turns"] == 50 and back["restored"] >= 25

    v2 = run_agent(EXAMPLE / "v2", state, CHECK)
    assert v2.returncode == 0, v2.stderr
    took_over = json.loads(v2.stdout.strip().splitlines()[-1])
    assert took_over["missing"] == [] and took_over["turns"] == 50
    assert took_over["complete"] is True


@pytest.mark.unit
def test_v2_answers_as_v2_and_keeps_counting(tmp_path: Path) -> None:
    state = tmp_path / "state"
    first = run_agent(EXAMPLE, state, CHATS)
    assert first.returncode == -signal.SIGKILL, first.stderr
    script = "import json, agent; print(json.dumps(agent.chat('after the upgrade', id='m-x')))"
    v2 = run_agent(EXAMPLE / "v2", state, script)
    assert v2.returncode == 0, v2.stderr
    assert json.loads(v2.stdout.strip().splitlines()[-1]) == {
        "turns": 52,
        "version": "v2",
        "complete": True,
    }


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Path]:
    """The node agent's IPC broker on its own loop thread; its socket."""
    from dsec_nodeagent.ipc import Broker

    socket_path = tmp_path / "ipc.sock"
    server = Broker(socket_path)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    try:
        yield socket_path
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


class Caller:
    """The example's caller as a process; its JSON lines as they come."""

    def __init__(self, env: dict[str, str]) -> None:
        self.lines: list[dict[str, Any]] = []
        self.proc = subprocess.Popen(
            [sys.executable, "caller.py"],
            cwd=EXAMPLE / "caller",
            env={**env, "DSEC_AGENT_NAME": "chat-caller", "CALLER_MAX_SECONDS": "120"},
            stdout=subprocess.PIPE,
            text=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                self.lines.append(json.loads(line))

    def wait_for(self, event: str, count: int = 1, timeout: float = 60.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            found = [e for e in list(self.lines) if e["event"] == event]
            if len(found) >= count:
                return found[count - 1]
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"the caller did not report {event!r} x{count}: {self.lines}")
            time.sleep(0.02)


@pytest.mark.integration
@pytest.mark.slow
def test_the_caller_loses_nothing_across_crashes_and_a_new_version(
    tmp_path: Path, broker: Path
) -> None:
    env = {
        **os.environ,
        "DSEC_IPC_SOCKET": str(broker),
        "DSEC_STATE": "local",  # the state in a directory; the calls through the broker
        "DSEC_STATE_DIR": str(tmp_path / "state"),
        "DSEC_TASK_GROUP": "stateful-demo",
    }

    def start(code_dir: Path) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [sys.executable, "agent.py"],
            cwd=code_dir,
            env={**env, "DSEC_AGENT_NAME": "stateful-agent"},
            stdout=subprocess.DEVNULL,
        )

    agent = start(EXAMPLE)
    caller = Caller(env)
    try:
        caller.wait_for("progress")  # 100 chats acknowledged
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        agent = start(EXAMPLE)  # what the node agent's restart does
        back = caller.wait_for("back")
        assert back["missing"] == 0 and back["version"] == "v1"
        assert back["turns"] >= 2 * back["acknowledged"]  # a resent chat may count twice

        progress = len([e for e in caller.lines if e["event"] == "progress"])
        caller.wait_for("progress", progress + 1)
        agent.send_signal(signal.SIGKILL)
        agent.wait(10)
        agent = start(EXAMPLE / "v2")
        moved = caller.wait_for("version")
        assert moved["version"] == "v2" and moved["previous"] == "v1"
        assert moved["missing"] == 0 and moved["complete"] is True

        summary = caller.wait_for("summary")
        assert caller.proc.wait(30) == 0
        assert summary["lost"] == 0 and summary["regressions"] == 0
        assert summary["version"] == "v2" and summary["acknowledged"] >= 300
        assert agent.wait(30) == 0  # the caller's shutdown: a clean exit
    finally:
        for proc in (agent, caller.proc):
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
