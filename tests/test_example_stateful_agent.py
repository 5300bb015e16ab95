"""The stateful example agent's logic over the SDK's local store (no stack): what its README's
"plain Python" section promises.

v1 chats, is SIGKILLed (no close, no final checkpoint) and a new process of it finds every
answered chat back; v2 opened on the same state says its history is complete; the caller's
verdict logic is exercised by the e2e demo scene (``examples/stateful-agent/demo.sh``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.unit]

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
