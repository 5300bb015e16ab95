"""The broker's side of a live hand-over, with real agent processes and no state plane: a new
version registers the old one's name as a standby, the old one stops taking calls and is
frozen, the broker switches the name and tells the callers ``moved``, the old one is killed —
while a caller keeps calling. The caller sees no error and every call is answered exactly once
(a call the old one had not read is sent again to the new one).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from dsec_core import natsperms
from dsec_sdk import DSecClient
from dsec_testing.stack import StackFixture

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the test kit
from _ipc_testkit import BrokerThread, wait_until

from dsec_nodeagent.ipc.registry import AgentKey

pytestmark = pytest.mark.integration

AGENTS = Path(__file__).with_name("_handover_agents.py")
KEY = AgentKey("g1", "agent-b")


def _sandbox_of(pid: int, _uid: int) -> str | None:
    """Each test process says which "sandbox" it is in its environment."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for entry in environ:
        if entry.startswith(b"DSEC_TEST_SANDBOX="):
            return entry.split(b"=", 1)[1].decode()
    return None


@pytest.fixture
def work() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dsec-ho-"))  # short: a socket path has 107 bytes
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def broker(work: Path) -> Iterator[BrokerThread]:
    thread = BrokerThread(work / "ipc.sock", sandbox_of=_sandbox_of)
    yield thread
    thread.stop()


def _spawn(sandbox: str, *args: str, handover_from: str = "") -> subprocess.Popen[bytes]:
    env = {**os.environ, "DSEC_TEST_SANDBOX": sandbox, "DSEC_STATE_HANDOVER_FROM": handover_from}
    return subprocess.Popen([sys.executable, str(AGENTS), *args], env=env)


def _served(logfile: Path) -> list[int]:
    if not logfile.exists():
        return []
    return [int(line) for line in logfile.read_text().split()]


@pytest.mark.parametrize(
    ("mode", "server", "release"),
    [
        ("sync", "server", False),
        ("async", "server", False),
        ("sync", "aserver", False),
        ("sync", "server", True),
        ("sync", "aserver", True),
        ("threads", "server", True),
        ("threads", "server", False),
        ("async", "server", True),
        ("async", "aserver", True),
    ],
)
def test_callers_follow_a_switched_name_without_an_error(
    broker: BrokerThread, work: Path, mode: str, server: str, release: bool
) -> None:
    """``release``: the hand-over is final while the old process still exists (stopped, as a
    frozen one): a caller waiting on it moves to the new version at once, not when it dies."""
    sock = str(broker.socket_path)
    old_log, new_log = work / "old.log", work / "new.log"
    out, stop = work / "answers.json", work / "stop"
    procs = [_spawn("old", server, sock, "old", str(old_log))]
    try:
        wait_until(lambda: broker.broker.local_server(KEY), what="the old version to serve")
        caller = _spawn("caller", "caller", sock, mode, str(out), str(stop))
        procs.append(caller)
        wait_until(lambda: len(_served(old_log)) > 200, what="calls to the old version")

        # The new version: a standby for the old one's name while the hand-over is expected.
        broker.broker.expect_handover("new", "old")
        procs.append(_spawn("new", server, sock, "new", str(new_log), handover_from="old"))
        wait_until(
            lambda: broker.broker._registry._standby.get(KEY), what="the standby registration"
        )
        # registered as the standby: its client told the (stand-in) state it is ready
        wait_until(lambda: Path(str(new_log) + ".ready").exists(), what="ready")
        assert not Path(str(old_log) + ".ready").exists()
        assert broker.broker._registry.owner(KEY) == "old"  # still the old one's name

        # The old version finishes its call in progress and takes no more; then it is frozen.
        old = procs[0]
        old.send_signal(signal.SIGUSR1)
        wait_until(lambda: Path(str(old_log) + ".paused").exists(), what="the pause")
        old.send_signal(signal.SIGSTOP)

        told = broker.run(_switch(broker, "new"))
        assert told == 1  # the one caller holding a channel to the old server
        assert broker.broker._registry.owner(KEY) == "new"
        if release:
            named = broker.run(_release(broker, "old"))  # its channels to the old server
            assert named == 1 if mode == "sync" else named >= 1  # (threads may open two)
            wait_until(lambda: len(_served(new_log)) > 200, what="calls to the new version")
            assert old.poll() is None  # they moved while the old process still exists
        broker.broker.forget_handover("new")
        old.kill()
        old.wait(10)

        wait_until(lambda: len(_served(new_log)) > 200, what="calls to the new version")
        stop.touch()
        assert caller.wait(60) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)

    whos = _answered_once(out, old_log, new_log)
    if mode == "sync":  # one call at a time: every call before the switch went to the old one
        switch_at = whos.index("new")
        assert set(whos[:switch_at]) == {"old"} and set(whos[switch_at:]) == {"new"}


@pytest.mark.parametrize(
    ("mode", "release"), [("sync", True), ("async", True), ("threads", True), ("sync", False)]
)
def test_callers_on_another_node_follow_a_switched_name(
    dsec_stack: StackFixture, work: Path, mode: str, release: bool
) -> None:
    """The caller on node 1, the agent's versions on node 2: its calls cross through both
    brokers' bridge, whose channel to the old version moves at ``release`` (the old process
    still there, stopped) as a local caller's does, or, without it, when the old one dies."""
    auth = {
        "nkeys_seed": str(dsec_stack.nats_seed("nodeagent")),
        "inbox_prefix": natsperms.inbox_prefix("nodeagent"),
    }
    url = dsec_stack.nats_plain_url
    here = BrokerThread(work / "n1.sock", node_id="n1", nats_url=url, nats_options=auth)
    there = BrokerThread(
        work / "n2.sock", node_id="n2", nats_url=url, nats_options=auth, sandbox_of=_sandbox_of
    )
    sock = str(there.socket_path)
    old_log, new_log = work / "old.log", work / "new.log"
    out, stop = work / "answers.json", work / "stop"
    procs = [_spawn("old", "server", sock, "old", str(old_log))]
    try:
        wait_until(lambda: there.broker.local_server(KEY), what="the old version to serve")
        procs.append(_spawn("caller", "caller", str(here.socket_path), mode, str(out), str(stop)))
        wait_until(lambda: len(_served(old_log)) > 100, what="calls to the old version")
        assert here.broker.local_server(KEY) is None  # (they do cross nodes)

        there.broker.expect_handover("new", "old")
        procs.append(_spawn("new", "server", sock, "new", str(new_log), handover_from="old"))
        wait_until(lambda: Path(str(new_log) + ".ready").exists(), what="ready")
        old = procs[0]
        old.send_signal(signal.SIGUSR1)
        wait_until(lambda: Path(str(old_log) + ".paused").exists(), what="the pause")
        old.send_signal(signal.SIGSTOP)

        there.run(_switch(there, "new"))
        if release:
            assert there.run(_release(there, "old")) == 1  # the bridge's channel
            wait_until(lambda: len(_served(new_log)) > 100, what="calls to the new version")
            assert old.poll() is None  # they moved while the old process still exists
        there.broker.forget_handover("new")
        old.kill()
        old.wait(10)

        wait_until(lambda: len(_served(new_log)) > 100, what="calls to the new version")
        stop.touch()
        assert procs[1].wait(60) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        here.stop()
        there.stop()

    _answered_once(out, old_log, new_log)


def _answered_once(out: Path, old_log: Path, new_log: Path) -> list[str]:
    """The caller saw no error, every call was answered once and served once, by one version
    or the other, and both served; who answered each call, in call order."""
    result = json.loads(out.read_text())
    assert result["errors"] == []
    seqs = sorted(seq for seq, _ in result["answers"])
    assert seqs == list(range(len(seqs)))  # every call answered, once
    served = _served(old_log) + _served(new_log)
    assert sorted(served) == seqs  # and served exactly once, by one version or the other
    whos = [who for _, who in sorted(result["answers"])]
    assert "old" in whos and "new" in whos
    return whos


async def _switch(broker: BrokerThread, to: str) -> int:
    return broker.broker.switch(KEY, to)


async def _release(broker: BrokerThread, frm: str) -> int:
    return broker.broker.release(KEY, frm)


def test_a_second_server_without_an_expected_hand_over_is_still_refused(
    broker: BrokerThread, work: Path
) -> None:
    sock = str(broker.socket_path)
    old = _spawn("old", "server", sock, "old", str(work / "old.log"))
    try:
        wait_until(lambda: broker.broker.local_server(KEY), what="the old version to serve")
        intruder = _spawn("other", "server", sock, "other", str(work / "other.log"))
        assert intruder.wait(30) != 0  # BrokerUnavailable: the name is taken
        assert broker.broker._registry._standby == {}
        with DSecClient("agent-a", "g1", socket_path=sock, timeout=10) as client:
            assert client.call_tool("agent-b", "record", seq=7) == {"seq": 7, "who": "old"}
        assert broker.broker.switch(KEY, "other") == 0  # nothing to switch to
    finally:
        old.kill()
        old.wait(10)
