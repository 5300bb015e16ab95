"""AgentState over the local store (plain Python, no node agent): restore after a crash,
sparse capture, tiers, pauses, automatic checkpoints."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dsec_sdk import AgentState, StateError
from dsec_sdk.state import LocalStore


@pytest.fixture(autouse=True)
def ring_mode() -> str:
    """The state plane does not use the ring: run each test once."""
    return "n/a"


@pytest.fixture(autouse=True)
def _local(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("DSEC_IPC_SOCKET", "DSEC_STATE", "DSEC_STATE_DIR", "DSEC_STATE_HANDOVER_FROM"):
        monkeypatch.delenv(var, raising=False)


CRASHING_AGENT = textwrap.dedent(
    """
    import sys
    from dsec_sdk import AgentState

    state = AgentState.open(sys.argv[1], auto=False)
    history = state.log("history")
    facts = state.kv("facts")
    weights = state.array("weights", 4096, "int64")
    i = len(history)
    while True:
        history.append({"role": "user", "i": i, "text": "x" * (i % 50)})
        facts[f"k{i % 7}"] = i
        weights.update([i % 4096], [i])
        state.checkpoint()
        print(i, flush=True)
        i += 1
    """
)


def test_every_acknowledged_item_survives_sigkill(tmp_path: Path) -> None:
    """An agent killed (SIGKILL) right after its Nth acknowledged checkpoint comes back with
    every item those checkpoints acknowledged."""
    script = tmp_path / "agent.py"
    script.write_text(CRASHING_AGENT)
    store = tmp_path / "state"
    acked = -1
    for _round in range(2):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(store)], stdout=subprocess.PIPE, text=True
        )
        assert proc.stdout is not None
        target = acked + 60
        while acked < target:
            line = proc.stdout.readline()
            assert line, f"the agent ended early: {proc.wait()}"
            acked = int(line)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc.stdout.close()

        state = AgentState.open(store, auto=False)
        history = state.log("history")
        weights = state.array("weights", 4096, "int64")
        facts = state.kv("facts")
        assert state.restored.source == "local"
        assert state.restored.seq >= acked + 1
        assert len(history) >= acked + 1
        assert [history[i]["i"] for i in range(acked + 1)] == list(range(acked + 1))
        assert all(weights[i] == i for i in range(acked + 1))
        assert facts[f"k{acked % 7}"] >= acked
        acked = len(history) - 1  # the next round goes on from what was restored
        state.close(checkpoint=False)


def test_restore_gives_back_every_container(tmp_path: Path) -> None:
    with AgentState.open(tmp_path) as state:
        assert state.restored.source == "empty" and state.restored.seq == 0
        log = state.log("history")
        kv = state.kv("facts")
        arr = state.array("adapter", (64, 32))
        vec = state.vectors("index", 8)
        blob = state.blob("base")
        ids = log.extend(["a", {"b": [1, 2]}, None])
        kv["x"] = {"deep": True}
        kv["gone"] = 1
        del kv["gone"]
        arr[3, 4] = 2.5
        vec.upsert(["p", "q"], np.eye(2, 8))
        blob.set(b"\x00" * 1000)
        info = state.checkpoint()
        assert info.seq == 1 and info.records >= 5 and info.bytes > 0
        assert info.tiers == ("hot", "warm", "cold")
    # close() took a last checkpoint (nothing new: nothing sent)

    state = AgentState.open(tmp_path)
    assert state.restored.source == "local" and state.restored.seq == 1
    assert [e.id for e in state.log("history").entries()] == ids
    assert list(state.log("history")) == ["a", {"b": [1, 2]}, None]
    assert dict(state.kv("facts")) == {"x": {"deep": True}}
    assert state.array("adapter", (64, 32))[3, 4] == 2.5
    assert state.vectors("index", 8).search(np.eye(1, 8)[0], k=1)[0][0] == "p"
    assert state.blob("base").get() == b"\x00" * 1000
    # appends after a restore get later ids (the restored log stays ordered)
    new_id = state.log("history").append("d")
    assert new_id > ids[-1]
    state.close()


def test_sparse_capture_matches_the_array_after_random_updates(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    state = AgentState.open(tmp_path / "s")
    arr = state.array("adapter", (256, 256), "float32")
    for _ in range(20):
        idx = rng.integers(0, arr.view().size, 655)  # ~1 % per step
        arr.update(idx, rng.random(len(idx), dtype=np.float32))
        arr[rng.integers(0, 256), 10:20] = rng.random(10)
        state.checkpoint()
    expected = arr.view().copy()
    state.close()
    restored = AgentState.open(tmp_path / "s").array("adapter", (256, 256), "float32")
    np.testing.assert_array_equal(restored.view(), expected)


def test_the_pause_is_measured_and_only_deltas_are_sent(tmp_path: Path) -> None:
    state = AgentState.open(tmp_path)
    arr = state.array("adapter", 1 << 20, "float32")  # 4 MiB
    arr.update(np.arange(0, 1 << 20, 100), 1.0)  # ~1 %
    info = state.checkpoint()
    assert info.pause_ms > 0 and info.durable_ms > 0
    assert info.bytes < (1 << 20) * 4 // 10  # sparse: indices + values of 1 %, not the array
    arr.view()  # reading does not mark anything
    assert state.checkpoint().records == 0
    state.close()


def test_view_is_read_only(tmp_path: Path) -> None:
    state = AgentState.open(tmp_path)
    arr = state.array("a", 4)
    with pytest.raises(ValueError, match="read-only"):
        arr.view()[0] = 1.0
    with pytest.raises(ValueError, match="read-only"):
        arr[0:2][0] = 1.0
    state.close()


def test_tiers_defaults_and_overrides(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, config={"tiers": [["notes", "warm"], ["cache", "hot"]]})
    state = AgentState(store, agent="a", group="g", tiers={"scratch": "cold"})
    assert state.log("history").tier == "hot"
    assert state.kv("memo").tier == "hot"
    assert state.array("w", 3).tier == "warm"
    assert state.vectors("v", 2).tier == "warm"
    assert state.blob("b").tier == "cold"
    assert state.log("pinned", tier="warm").tier == "warm"  # the declaration's own
    assert state.kv("scratch").tier == "cold"  # open(tiers=...)
    assert state.kv("notes", tier="cold").tier == "warm"  # the spec wins
    assert state.array("cache", 3).tier == "hot"
    with pytest.raises(ValueError, match="not a tier"):
        state.log("x", tier="lukewarm")

    state.log("history").append(1)
    state.array("w", 3)[0] = 1.0
    info = state.checkpoint(["hot"])
    assert info.records == 1 and info.tiers == ("hot",)
    assert state.checkpoint(["warm"]).records == 1
    state.close()


def test_declarations_must_match(tmp_path: Path) -> None:
    state = AgentState.open(tmp_path)
    log = state.log("history")
    assert state.log("history") is log
    with pytest.raises(StateError, match="already declared"):
        state.kv("history")
    state.array("w", (2, 2))[0, 0] = 1.0
    with pytest.raises(StateError, match="already declared"):
        state.array("w", (3, 3))
    with pytest.raises(ValueError, match="container name"):
        state.kv("bad name!")
    state.close()
    state = AgentState.open(tmp_path)
    with pytest.raises(StateError, match="restored value"):
        state.array("w", (4,))
    state.close()


def test_one_process_holds_a_local_state(tmp_path: Path) -> None:
    state = AgentState.open(tmp_path)
    script = f"from dsec_sdk import AgentState; AgentState.open({str(tmp_path)!r})"
    other = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert other.returncode != 0 and "held by another process" in other.stderr
    state.close()


def test_journal_compaction_keeps_everything(tmp_path: Path) -> None:
    store = LocalStore(tmp_path, compact_bytes=10_000)
    state = AgentState(store, agent="a", group="g")
    log = state.log("history")
    arr = state.array("w", 100, "int32")
    written = 0
    for i in range(200):
        log.append("m" * 100)
        arr.update([i % 100], [i])
        written += state.checkpoint().bytes
    state.close()
    assert (tmp_path / "snapshot.bin").exists()
    assert (tmp_path / "journal.bin").stat().st_size < written / 2
    again = AgentState.open(tmp_path)
    assert len(again.log("history")) == 200
    assert again.array("w", 100, "int32")[99] == 199
    again.close()


def test_a_torn_journal_tail_is_dropped(tmp_path: Path) -> None:
    state = AgentState.open(tmp_path)
    state.log("h").append("kept")
    state.checkpoint()
    state.close()
    with open(tmp_path / "journal.bin", "ab") as f:
        f.write(b"\x00\x00\x10\x00partial")  # a crash in the middle of an append
    state = AgentState.open(tmp_path)
    assert list(state.log("h")) == ["kept"]
    state.log("h").append("more")
    state.checkpoint()
    state.close()
    assert list(AgentState.open(tmp_path).log("h")) == ["kept", "more"]


def test_automatic_checkpoints_run_in_the_background(tmp_path: Path) -> None:
    state = AgentState.open(tmp_path, interval=0.05, warm_interval=0.1)
    log = state.log("history")
    arr = state.array("w", 10)
    log.append("hello")
    arr[0] = 1.0
    deadline = time.monotonic() + 30
    while state.last_checkpoint is None or "warm" not in state.last_checkpoint.tiers:
        assert time.monotonic() < deadline, "no automatic warm checkpoint"
        time.sleep(0.02)
    state.close(checkpoint=False)
    again = AgentState.open(tmp_path, auto=False)
    assert list(again.log("history")) == ["hello"]
    assert again.array("w", 10)[0] == 1.0
    again.close()


def test_records_of_undeclared_containers_wait_for_their_declaration(tmp_path: Path) -> None:
    with AgentState.open(tmp_path) as state:
        state.kv("later")["k"] = "v"
    state = AgentState.open(tmp_path)
    state.log("other")
    state.checkpoint()  # "later" not declared yet: its state is not lost
    state.close()
    state = AgentState.open(tmp_path)
    assert dict(state.kv("later")) == {"k": "v"}
    state.close()


def test_the_async_api(tmp_path: Path) -> None:
    async def main() -> None:
        async with await AgentState.aopen(tmp_path) as state:
            state.log("h").append("async")
            info = await state.acheckpoint()
            assert info.seq == 1
        again = await AgentState.aopen(tmp_path)
        assert list(again.log("h")) == ["async"]
        await again.aclose()

    asyncio.run(main())


def test_state_dir_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_STATE_DIR", str(tmp_path / "env"))
    with AgentState.open() as state:
        state.log("h").append(1)
    assert (tmp_path / "env" / "journal.bin").stat().st_size > 0
    assert os.environ["DSEC_STATE_DIR"]


def test_a_local_store_has_no_handover(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    state = AgentState.open(tmp_path)
    with pytest.raises(StateError, match="hand-over"):
        state.ready()
    state.close()


def test_checkpoints_while_another_thread_writes(tmp_path: Path) -> None:
    """Captures interleave with mutations from another thread: nothing is lost or torn."""
    import threading

    state = AgentState.open(tmp_path)
    log = state.log("history")
    arr = state.array("w", 5000, "int64")
    done = threading.Event()

    def writer() -> None:
        for i in range(3000):
            log.append(i)
            arr.update([i], [i])
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    while not done.is_set():
        state.checkpoint()
    thread.join()
    state.checkpoint()
    state.close()
    again = AgentState.open(tmp_path)
    assert list(again.log("history")) == list(range(3000))
    assert again.array("w", 5000, "int64").view()[:3000].tolist() == list(range(3000))
    again.close()


FILE_LIMIT_AGENT = textwrap.dedent(
    """
    import resource, signal, sys
    from dsec_sdk import AgentState, StateError

    state = AgentState.open(sys.argv[1], auto=False)
    log = state.log("h")
    log.append("first")
    state.checkpoint()
    # The file system refuses the next frame part-way: files may not grow past 1 KiB more
    # (the kernel writes what fits, then says EFBIG); the frame is larger than a buffer.
    import os
    limit = os.path.getsize(sys.argv[1] + "/journal.bin") + 1024
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
    log.append("second " + "x" * 20_000)
    try:
        state.checkpoint()
    except StateError as exc:
        print("refused", exc, flush=True)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    log.append("third")
    state.checkpoint()  # (sends the refused records again with it)
    state.close()
    print("done", flush=True)
    """
)


def test_a_failed_journal_write_leaves_nothing_behind_and_later_checkpoints_survive(
    tmp_path: Path,
) -> None:
    """A checkpoint the file system refused half-way is refused, and its half is cut off
    again: the checkpoints acknowledged after it are read back (not dropped behind a torn
    frame)."""
    done = subprocess.run(
        [sys.executable, "-c", FILE_LIMIT_AGENT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "refused cannot write the state journal" in done.stdout and "done" in done.stdout
    again = AgentState.open(tmp_path, auto=False)
    assert list(again.log("h")) == ["first", "second " + "x" * 20_000, "third"]
    again.close()


def test_a_compaction_that_fails_does_not_refuse_a_durable_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal write and its fsync succeeded: the checkpoint is acknowledged even when
    folding the journal into a snapshot fails (before, it was refused, sent again, and its
    records were in the journal twice)."""
    from dsec_sdk.state import store

    def no_room(self: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store.LocalStore, "_compact", no_room)
    state = AgentState(LocalStore(tmp_path, compact_bytes=1), agent="a", group="g")
    log = state.log("h")
    for i in range(3):
        log.append(i)
        state.checkpoint()
    state.close()
    monkeypatch.undo()
    again = AgentState.open(tmp_path, auto=False)
    assert list(again.log("h")) == [0, 1, 2]
    again.close()
