"""The source's failure paths of a migration (dsec_nodeagent.migration.node): whatever fails,
the unit keeps running on the source and ``unit.migration_failed`` says where and why."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from dsec_core import events

from dsec_nodeagent.migration import criu, node
from dsec_nodeagent.migration.node import Migrations

pytestmark = pytest.mark.unit

STARTED = events.UnitMigrationStarted(
    migration_id="m-1", from_node="node-1", to_node="node-2", reason="operator", path="criu"
)


class FakeChannel:
    """The sealed channel to the target, answering ``restore`` as told."""

    def __init__(self, restore: dict[str, Any]) -> None:
        self.restore = restore
        self.ops: list[str] = []
        self.sent = 0

    async def call(self, body: dict[str, Any], timeout: float = 0) -> dict[str, Any]:
        self.ops.append(body["op"])
        return self.restore if body["op"] == "restore" else {"ok": True}

    async def send_file(self, path: Path, name: str) -> None:
        self.ops.append(f"file {name}")

    async def send_dir(self, directory: Path, name: str) -> None:
        self.ops.append(f"dir {name}")


@pytest.fixture
def workload() -> Iterator[subprocess.Popen[bytes]]:
    """A process standing for the sandbox's tree (what its cgroup holds)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _migrations(tmp: Path, pid: int, checkpointable: bool = True) -> Migrations:
    sandbox = SimpleNamespace(
        state={"checkpointable": checkpointable, "init_pid": pid, "uid": 1, "ready": {}},
        cgroup=SimpleNamespace(pids=lambda: [pid], kill=lambda: os.kill(pid, signal.SIGKILL)),
    )
    manager = SimpleNamespace(
        get=lambda sid: sandbox, data_root=tmp / "sandboxes", run_dir=tmp / "run"
    )
    agent = SimpleNamespace(node_id="node-1", manager=manager, home=tmp, launched=lambda sid: None)
    return Migrations(SimpleNamespace(), agent)  # type: ignore[arg-type]


def _patch(monkeypatch: pytest.MonkeyPatch, channel: FakeChannel, precopy: Any) -> None:
    async def no_problem() -> None:
        return None

    async def opened(*_: Any) -> FakeChannel:
        return channel

    async def ran(argv: list[str], stage: str) -> None:
        Path(argv[argv.index("-cpf") + 1]).write_bytes(b"")

    monkeypatch.setattr(criu, "check", no_problem)
    monkeypatch.setattr(criu, "precopy", precopy)
    monkeypatch.setattr(criu, "external_mounts", lambda pid: {})
    monkeypatch.setattr(criu, "pipe_inodes", lambda pid: {1: "pipe:[1]", 2: "pipe:[2]"})
    monkeypatch.setattr(node._Channel, "open", opened)
    monkeypatch.setattr(node, "_run", ran)


async def test_a_failed_dump_leaves_it_running_and_says_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workload: subprocess.Popen[bytes]
) -> None:
    async def fails(*_: Any, **__: Any) -> criu.DumpResult:
        raise criu.CriuError("dump", "Error (criu/cr-dump.c:1): Can't infect")

    channel = FakeChannel({"ok": True})
    _patch(monkeypatch, channel, fails)
    out = await _migrations(tmp_path, workload.pid).move("sbx", STARTED)
    assert len(out) == 1 and isinstance(out[0], events.UnitMigrationFailed)
    assert (out[0].stage, out[0].still_running) == ("checkpoint", True)
    assert "Can't infect" in out[0].reason
    assert channel.ops[-1] == "abort"  # the target drops what it received
    assert _state(workload.pid) not in "Tt"


async def test_a_target_refusing_the_restore_resumes_the_frozen_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workload: subprocess.Popen[bytes]
) -> None:
    async def dumped(pid: int, root: Path, *_: Any, **__: Any) -> criu.DumpResult:
        os.kill(pid, signal.SIGSTOP)  # as `criu dump --leave-stopped` leaves it
        (root / "final").mkdir(parents=True)
        return criu.DumpResult([criu.Round("final", 5.0, 10, 20)])

    channel = FakeChannel({"ok": False, "stage": "restore", "reason": "criu restore: no root"})
    _patch(monkeypatch, channel, dumped)
    out = await _migrations(tmp_path, workload.pid).move("sbx", STARTED)
    assert isinstance(out[0], events.UnitMigrationFailed)
    assert (out[0].stage, out[0].still_running, out[0].reason) == (
        "restore",
        True,
        "criu restore: no root",
    )
    assert "commit" not in channel.ops and channel.ops[-1] == "abort"
    for _ in range(50):  # continued (SIGCONT), not left stopped
        if _state(workload.pid) != "T":
            break
        await asyncio.sleep(0.02)
    assert _state(workload.pid) not in "Tt"


async def test_a_sandbox_not_started_checkpointable_is_refused_at_once(
    tmp_path: Path, workload: subprocess.Popen[bytes]
) -> None:
    out = await _migrations(tmp_path, workload.pid, checkpointable=False).move("sbx", STARTED)
    assert isinstance(out[0], events.UnitMigrationFailed)
    assert out[0].still_running and "checkpointable" in out[0].reason


async def test_a_sandbox_that_does_not_run_here_is_reported_not_running(tmp_path: Path) -> None:
    m = _migrations(tmp_path, 1)
    m.agent.manager.get = lambda sid: None  # type: ignore[attr-defined]
    out = await m.move("gone", STARTED)
    assert isinstance(out[0], events.UnitMigrationFailed) and not out[0].still_running


async def test_a_target_refusing_the_offer_leaves_it_running_untouched(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workload: subprocess.Popen[bytes]
) -> None:
    async def never(*_: Any, **__: Any) -> criu.DumpResult:
        raise AssertionError("nothing is dumped for a target that refused")

    _patch(monkeypatch, FakeChannel({"ok": True}), never)

    async def refused(*_: Any) -> Any:
        raise node.MigrationError("transfer", "the target node-2 refused: no such migration")

    monkeypatch.setattr(node._Channel, "open", refused)
    out = await _migrations(tmp_path, workload.pid).move("sbx", STARTED)
    assert isinstance(out[0], events.UnitMigrationFailed)
    assert (out[0].stage, out[0].still_running) == ("transfer", True)
    assert "refused" in out[0].reason and _state(workload.pid) not in "Tt"


async def test_a_second_migration_of_a_sandbox_on_the_move_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, workload: subprocess.Popen[bytes]
) -> None:
    going = asyncio.Event()
    release = asyncio.Event()

    async def slow(*_: Any, **__: Any) -> criu.DumpResult:
        going.set()
        await release.wait()
        raise criu.CriuError("dump", "stopped here")

    _patch(monkeypatch, FakeChannel({"ok": True}), slow)
    m = _migrations(tmp_path, workload.pid)
    envelope = SimpleNamespace(aggregate_id="sbx")
    first = asyncio.create_task(m.on_started(envelope, STARTED))  # type: ignore[arg-type]
    await asyncio.wait_for(going.wait(), 10)
    second = STARTED.model_copy(update={"migration_id": "m-2"})
    out = await m.on_started(envelope, second)  # type: ignore[arg-type]
    assert isinstance(out[0], events.UnitMigrationFailed) and out[0].migration_id == "m-2"
    assert "already" in out[0].reason and out[0].still_running
    release.set()
    assert (await first)[0].migration_id == "m-1"


# --------------------------------------------------------------------------- the target's hello


def _target(tmp_path: Path, exiting: set[str]) -> tuple[Migrations, Any]:
    """The target node ``node-2`` of migrations from ``node-1`` (its certificate known)."""
    from nacl.signing import SigningKey

    source = SigningKey.generate()
    cert = SimpleNamespace(
        public_key=bytes(source.verify_key).hex(), role="nodeagent", node_id="node-1"
    )

    async def certificate(key_id: str) -> Any:
        return cert

    signer = SimpleNamespace(key_id="node-2-key", endorse=lambda data: "00" * 64)
    service = SimpleNamespace(
        gate=SimpleNamespace(keys=SimpleNamespace(certificate=certificate)),
        publisher=SimpleNamespace(signer=signer),
    )
    manager = SimpleNamespace(
        busy=lambda sid: False, data_root=tmp_path / "sandboxes", run_dir=tmp_path / "run"
    )
    agent = SimpleNamespace(node_id="node-2", manager=manager, exiting=lambda sid: sid in exiting)
    return Migrations(service, agent), source  # type: ignore[arg-type]


def _offer(source: Any, mid: str, sid: str) -> dict[str, Any]:
    from dsec_core import canonical
    from nacl.public import PrivateKey

    fields = {
        "k": "offer", "mid": mid, "sid": sid, "key_id": "node-1-key",
        "key": bytes(PrivateKey.generate().public_key),
    }  # fmt: skip
    signed = source.sign(node._offer_bytes(fields)).signature
    return canonical.unpack(canonical.canonical_bytes({**fields, "sig": signed}))


async def test_a_target_holds_one_migration_of_a_sandbox_and_gives_up_one_left_idle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second migration of a sandbox with one open here is refused (the two would share its
    run directory, cgroup and egress); one left idle (its source crashed, or never got the
    hello) is given up after SESSION_IDLE_S instead of refusing every later one for good."""
    target, source = _target(tmp_path, set())
    for mid in ("m-1", "m-2", "m-3"):
        target._expected[mid] = ("sbx", STARTED.model_copy(update={"migration_id": mid}))
    await target._hello(_offer(source, "m-1", "sbx"))
    with pytest.raises(ValueError, match="already under way"):
        await target._hello(_offer(source, "m-2", "sbx"))
    first = target._sessions["m-1"]
    first.busy = 1  # a frame being answered: not idle, however long ago the last came
    first.last_seen -= node.SESSION_IDLE_S + 1
    with pytest.raises(ValueError, match="already under way"):
        await target._hello(_offer(source, "m-2", "sbx"))
    first.busy = 0
    await target._hello(_offer(source, "m-3", "sbx"))
    assert list(target._sessions) == ["m-3"] and not first.work.exists()
    for session in list(target._sessions.values()):
        await target._discard(session)


async def test_a_target_refuses_a_migration_while_an_earlier_copy_still_ends_there(
    tmp_path: Path,
) -> None:
    target, source = _target(tmp_path, {"sbx"})
    target._expected["m-1"] = ("sbx", STARTED)
    with pytest.raises(ValueError, match="still ending"):
        await target._hello(_offer(source, "m-1", "sbx"))
    assert target._sessions == {}
