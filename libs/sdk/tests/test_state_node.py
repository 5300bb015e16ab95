"""AgentState over the node store, against a fake keeper that speaks wire.py (and a fake
broker that hands out the state socket): hello, fetch, checkpoint/ack, refusals, and both
sides of a hand-over."""

from __future__ import annotations

import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from dsec_sdk import AgentState, StateError
from dsec_sdk.ipc import control
from dsec_sdk.state import NodeStore, codec


@pytest.fixture(autouse=True)
def ring_mode() -> str:
    """The state plane does not use the ring: run each test once."""
    return "n/a"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("DSEC_IPC_SOCKET", "DSEC_STATE", "DSEC_STATE_DIR", "DSEC_STATE_HANDOVER_FROM"):
        monkeypatch.delenv(var, raising=False)


Keeper = Any


@pytest.fixture
def pair(fake_keeper: type) -> Iterator[Callable[..., tuple[NodeStore, Keeper]]]:
    socks: list[socket.socket] = []

    def make(**kwargs: Any) -> tuple[NodeStore, Keeper]:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        socks.extend([a, b])
        keeper = fake_keeper(b, **kwargs)
        keeper.start()
        return NodeStore(a, timeout=10), keeper

    yield make
    for s in socks:
        s.close()


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + 10
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def uuid7_at(ms: int, counter: int) -> str:
    return str(uuid.UUID(int=(ms << 80) | (0x7 << 76) | (counter << 64) | (0b10 << 62)))


# ids an hour ahead of this clock (another node's): new ones must still sort after them
AHEAD = time.time_ns() // 1_000_000 + 3_600_000
SAVED = [
    {"c": "history", "k": "log", "t": "hot", "o": "append",
     "items": [[uuid7_at(AHEAD, 0), "h0", "first"]]},
    {"c": "history", "k": "log", "t": "hot", "o": "append",
     "items": [[uuid7_at(AHEAD, 1), "h1", "second"]]},
    *codec.full_records(
        "w", "array", "warm",
        {"dtype": "<f4", "shape": [4], "data": np.arange(4, dtype="<f4").tobytes()},
    ),
]  # fmt: skip


def test_open_restores_what_the_keeper_fetched(pair: Callable[..., Any]) -> None:
    store, keeper = pair(records=SAVED, seq=5, config={"tiers": [["history", "warm"]]})
    state = AgentState(store, agent="bot", group="team")
    hello = keeper.next_frame("hello")
    assert hello == {"op": "hello", "v": 1, "agent": "bot", "group": "team", "handover": False}
    assert state.restored.seq == 5 and state.restored.source == "local"
    assert state.restored.records == 3
    history = state.log("history")
    assert list(history) == ["first", "second"] and history.tier == "warm"
    assert state.array("w", 4).view().tolist() == [0, 1, 2, 3]

    history.append("third")
    info = state.checkpoint()
    assert info.seq == 6 and info.bytes == 100  # the ack's
    frame = keeper.next_frame("checkpoint")
    assert frame["seq"] == 6 and frame["final"] is False
    assert frame["tiers"] == ["hot", "warm", "cold"] and frame["pause_ms"] >= 0
    (record,) = frame["records"]
    assert record["c"] == "history" and record["o"] == "append" and record["t"] == "warm"
    assert [item[2] for item in record["items"]] == ["third"]
    assert record["items"][0][0] > uuid7_at(AHEAD, 1)  # ids keep growing after a restore
    state.close()
    assert keeper.next_frame("bye") == {"op": "bye"}


def test_a_refused_checkpoint_is_sent_again(pair: Callable[..., Any]) -> None:
    store, keeper = pair(refuse_checkpoints=True)
    state = AgentState(store, agent="bot", group="team")
    state.log("h").append("precious")
    with pytest.raises(StateError, match="refused checkpoint 1: disk"):
        state.checkpoint()
    keeper.refuse_checkpoints = False
    state.log("h").append("more")
    info = state.checkpoint()
    assert info.seq == 1  # the keeper took nothing under 1: the next checkpoint is 1 again
    items = [i[2] for r in keeper.checkpoints[-1]["records"] for i in r["items"]]
    assert items == ["precious", "more"]
    state.log("h").append("then")
    assert state.checkpoint().seq == 2  # and the ones after it follow
    state.close(checkpoint=False)


def test_checkpoints_on_their_way_when_one_is_refused_go_again_in_their_order(
    pair: Callable[..., Any],
) -> None:
    """Two checkpoints on their way (the automatic one and the agent's, say), the first
    refused: the second is refused in turn, and both go again, first, in the order they were
    made, under the refused seq — also while the second's refusal is still on its way and newer
    checkpoints are already sent."""
    store, keeper = pair()
    state = AgentState(store, agent="bot", group="team")
    history = state.log("h")
    seen: list[int] = []
    go = [threading.Event(), threading.Event()]

    def before_answer(frame: dict[str, Any]) -> None:
        n = len(seen)
        seen.append(frame["seq"])
        if n < 2:
            go[n].wait(10)
        keeper.refuse_checkpoints = n == 0  # the first one only ("disk full")

    keeper.before_answer = before_answer
    outcomes: dict[str, Any] = {}

    def checkpoint(name: str) -> threading.Thread:
        def run() -> None:
            try:
                outcomes[name] = state.checkpoint().seq
            except StateError as exc:
                outcomes[name] = str(exc)

        thread = threading.Thread(target=run)
        thread.start()
        return thread

    history.append("a")
    first = checkpoint("a")
    wait_for(lambda: len(seen) == 1, "the first on its way")
    history.append("b")
    second = checkpoint("b")
    wait_for(lambda: len(state._outstanding) == 2, "the second sent")
    go[0].set()  # the first is refused...
    first.join(10)
    assert "refused checkpoint 1: disk" in outcomes["a"]
    history.append("z")
    third = checkpoint("z")  # ...and newer ones go out before the second's refusal comes
    wait_for(lambda: len(state._outstanding) == 1, "the third sent")
    history.append("w")
    fourth = checkpoint("w")
    wait_for(lambda: len(state._outstanding) == 2, "the fourth sent")
    go[1].set()
    for thread in (second, third, fourth):
        thread.join(10)
    assert "refused checkpoint 2: bad-seq" in outcomes["b"]
    assert (outcomes["z"], outcomes["w"]) == (1, 2)
    taken = [[i[2] for r in c["records"] for i in r["items"]] for c in keeper.checkpoints]
    assert [c["seq"] for c in keeper.checkpoints] == [1, 2]
    assert taken == [["a", "b", "z"], ["w"]]
    history.append("then")
    assert state.checkpoint().seq == 3
    state.close(checkpoint=False)


def test_a_checkpoint_that_timed_out_and_was_refused_later_does_not_leave_the_seq_behind(
    pair: Callable[..., Any],
) -> None:
    """A checkpoint times out here (the keeper slow), goes again with the next one, and only
    then is refused there: the next checkpoint's refusal (``bad-seq``) says which seq the keeper
    takes, and the one after goes out under it with every record, in order."""
    store, keeper = pair()
    state = AgentState(store, agent="bot", group="team")
    history = state.log("h")
    slow = threading.Event()

    def before_answer(frame: dict[str, Any]) -> None:
        if frame["seq"] == 1 and not slow.is_set():
            slow.wait(10)  # (the first one only: answered after its waiter gave up)
            keeper.refuse_checkpoints = True
        else:
            keeper.refuse_checkpoints = False

    keeper.before_answer = before_answer
    history.append("a")
    with pytest.raises(StateError, match="not acknowledged"):
        state.checkpoint(timeout=0.2)
    history.append("b")
    slow.set()  # the first is refused now; the second (seq 2) comes after it
    with pytest.raises(StateError, match="refused checkpoint 2: bad-seq"):
        state.checkpoint()
    history.append("c")
    assert state.checkpoint().seq == 1
    assert [i[2] for r in keeper.checkpoints[-1]["records"] for i in r["items"]] == ["a", "b", "c"]
    state.close(checkpoint=False)


def test_a_keeper_that_goes_away_fails_checkpoints(pair: Callable[..., Any]) -> None:
    store, keeper = pair()
    state = AgentState(store, agent="bot", group="team")
    keeper.sock.shutdown(socket.SHUT_RDWR)
    wait_for(lambda: state.last_error is not None, "the closed connection")
    state.log("h").append(1)
    with pytest.raises(StateError, match="closed"):
        state.checkpoint()
    state.close(checkpoint=False)


def test_a_refused_hello_is_a_state_error() -> None:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def refuse() -> None:
        from dsec_sdk.state import wire

        wire.recv(b)
        wire.send(b, {"op": "error", "code": "state-held", "message": "owned", "seq": None})

    threading.Thread(target=refuse, daemon=True).start()
    with pytest.raises(StateError, match="state-held"):
        AgentState(NodeStore(a, timeout=10), agent="bot", group="team")
    b.close()


def test_the_old_version_hands_over_with_a_final_checkpoint(pair: Callable[..., Any]) -> None:
    store, keeper = pair()
    state = AgentState(store, agent="bot", group="team")
    history = state.log("history")
    history.append("before")
    state.checkpoint()
    stopped = threading.Event()
    state.on_handover(stopped.set)
    history.append("last words")
    keeper.send({"op": "handover", "to": "sb-new"})
    final = keeper.next_frame("checkpoint")
    final = keeper.next_frame("checkpoint") if final["seq"] == 1 else final
    assert stopped.is_set()  # callbacks ran before the final capture
    assert final["final"] is True and final["tiers"] == ["hot", "warm", "cold"]
    assert [i[2] for r in final["records"] for i in r["items"]] == ["last words"]
    wait_for(state.handed_over.is_set, "handed_over")
    assert state.handover_to == "sb-new"
    with pytest.raises(StateError, match="handed its state over"):
        state.checkpoint()
    state.close()  # no checkpoint after the hand-over


def test_nothing_is_checkpointed_after_the_final_one_unless_the_hand_over_fails(
    pair: Callable[..., Any],
) -> None:
    """The state goes to the new version as of the old one's final checkpoint: from the moment
    it is sent, the old version's own checkpoints (another thread's, the automatic ones) are
    refused here, not sent after it; a failed hand-over lets them go on, in seq order."""
    store, keeper = pair()
    keeper.hold_final = threading.Event()
    state = AgentState(store, agent="bot", group="team")
    history = state.log("history")
    history.append("before")
    assert state.checkpoint().seq == 1
    keeper.send({"op": "handover", "to": "sb-new"})
    final = keeper.next_frame("checkpoint")
    final = keeper.next_frame("checkpoint") if final["seq"] == 1 else final
    assert final["final"] is True and final["seq"] == 2
    history.append("after the final")  # (its ack is held: the final is on its way)
    with pytest.raises(StateError, match="handing its state over"):
        state.checkpoint()
    keeper.hold_final.set()
    wait_for(state.handed_over.is_set, "handed_over")
    keeper.send({"op": "error", "code": "handover-aborted", "message": "gone", "seq": None})
    wait_for(lambda: not state.handed_over.is_set(), "the abort")
    info = state.checkpoint()
    assert info.seq == 3
    assert [i[2] for r in keeper.checkpoints[-1]["records"] for i in r["items"]] == [
        "after the final"
    ]
    state.close(checkpoint=False)


def _handing_over(before: set[threading.Thread]) -> bool:
    """Whether a hand-over thread started since ``before`` still runs."""
    return any(t.name == "dsec-state-handover" and t not in before for t in threading.enumerate())


def test_an_abort_while_the_hand_over_callbacks_run_sends_no_final_and_serves_on(
    pair: Callable[..., Any],
) -> None:
    """The keeper gives up (``handover-aborted``) while this version still finishes its call in
    progress (its hand-over callback): no final checkpoint goes out, it never counts as handed
    over, and it checkpoints on, automatic checkpoints included."""
    before = set(threading.enumerate())
    store, keeper = pair()
    state = AgentState(store, agent="bot", group="team", interval=0.05)
    entered, release = threading.Event(), threading.Event()
    state.on_handover(lambda: (entered.set(), release.wait(10)))
    keeper.send({"op": "handover", "to": "sb-new"})
    wait_for(entered.is_set, "the call in progress")
    keeper.send({"op": "error", "code": "handover-aborted", "message": "too slow", "seq": None})
    wait_for(lambda: (state.last_error or "").startswith("handover-aborted"), "the abort")
    release.set()
    wait_for(lambda: not _handing_over(before), "the hand-over thread's end")
    assert not state.handed_over.is_set()
    assert not [c for c in keeper.checkpoints if c["final"]]
    state.log("h").append("after")
    wait_for(lambda: keeper.checkpoints, "an automatic checkpoint")  # (not stopped)
    assert state.checkpoint().seq == keeper.seq
    state.close(checkpoint=False)


def test_an_abort_while_the_final_checkpoints_ack_is_on_its_way_leaves_it_serving(
    pair: Callable[..., Any],
) -> None:
    """The hand-over fails (``handover-aborted``) before the final checkpoint's ack arrives:
    this version still owns its state when the ack comes, and checkpoints on."""
    before = set(threading.enumerate())
    store, keeper = pair()
    keeper.hold_final = threading.Event()
    state = AgentState(store, agent="bot", group="team")
    state.log("history").append("before")
    keeper.send({"op": "handover", "to": "sb-new"})
    assert keeper.next_frame("checkpoint")["final"] is True
    keeper.send({"op": "error", "code": "handover-aborted", "message": "gone", "seq": None})
    wait_for(lambda: (state.last_error or "").startswith("handover-aborted"), "the abort")
    keeper.hold_final.set()  # the final's ack, after the abort
    wait_for(lambda: not _handing_over(before), "the hand-over thread's end (after the ack)")
    assert keeper.seq == 1 and not state.handed_over.is_set()
    state.log("history").append("after")
    assert state.checkpoint().seq == 2
    state.close(checkpoint=False)


def test_the_new_version_follows_deltas_then_owns_the_state(pair: Callable[..., Any]) -> None:
    store, keeper = pair(records=SAVED, seq=5)
    state = AgentState(store, agent="bot", group="team", handover=True, interval=0.05)
    assert keeper.next_frame("hello")["handover"] is True
    history = state.log("history")
    arr = state.array("w", 4)
    keeper.send(
        {
            "op": "deltas",
            "seq": 7,
            "records": [
                {"c": "history", "k": "log", "t": "hot", "o": "append",
                 "items": [[uuid7_at(AHEAD, 2), "h2", "from old"]]},
                {"c": "w", "k": "array", "t": "warm", "o": "sparse", "dtype": "<f4",
                 "shape": [4], "idx": np.array([0], "<i8").tobytes(),
                 "val": np.array([9], "<f4").tobytes()},
                {"c": "memo", "k": "kv", "t": "hot", "o": "set", "items": {"a": 1}},
            ],
        }
    )  # fmt: skip
    keeper.seq = 7  # (the keeper's: the old version's checkpoint it forwarded)
    wait_for(lambda: len(history) == 3, "the deltas")
    assert arr[0] == 9.0
    with pytest.raises(StateError, match="only once switched"):
        state.checkpoint()
    state.ready()
    assert keeper.next_frame("ready") == {"op": "ready"}
    keeper.send({"op": "switched", "interruption_ms": 3.5})
    info = state.wait_switched(timeout=10)
    assert info.interruption_ms == 3.5
    assert dict(state.kv("memo")) == {"a": 1}  # a delta for a container declared later
    history.append("new version")
    assert state.checkpoint().seq == 8
    state.close()


def fake_broker(path: Path, fake_keeper: type, *, refuse: bool = False) -> list[Any]:
    """A broker that says welcome and answers the ``state`` op with one end of a socketpair
    served by a fake keeper."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(1)
    seen: list[Any] = []

    def serve() -> None:
        conn, _ = listener.accept()
        hello, _ = control.recv(conn) or ({}, [])
        seen.append(hello)
        control.send(conn, {"op": "welcome", "node": "n1", "ring_capacity": 1, "max_payload": 1})
        ask, _ = control.recv(conn) or ({}, [])
        seen.append(ask)
        if refuse:
            control.send(conn, {"op": "error", "ref": ask["ref"], "code": "no", "message": "no"})
            return
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        keeper = fake_keeper(mine, config={"checkpoint_interval_s": 60})
        keeper.start()
        seen.append(keeper)
        control.send(conn, {"op": "state", "ref": ask["ref"]}, [theirs.fileno()])
        theirs.close()
        conn.recv(1)  # until the agent closes its broker connection
        listener.close()

    threading.Thread(target=serve, daemon=True).start()
    return seen


def test_open_inside_a_sandbox_asks_the_broker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_keeper: type
) -> None:
    sock = tmp_path / "ipc.sock"
    seen = fake_broker(sock, fake_keeper)
    monkeypatch.setenv("DSEC_IPC_SOCKET", str(sock))
    monkeypatch.setenv("DSEC_AGENT_NAME", "bot")
    monkeypatch.setenv("DSEC_TASK_GROUP", "team")
    monkeypatch.setenv("DSEC_STATE_HANDOVER_FROM", "sb-old")
    state = AgentState.open()
    assert seen[0]["op"] == "hello" and seen[0]["agent"] == "bot"
    assert seen[1] == {"op": "state", "ref": 1}
    keeper = seen[2]
    assert keeper.next_frame("hello")["handover"] is True
    assert state.interval == 60  # the spec's interval, from the keeper
    state.ready()
    keeper.next_frame("ready")
    keeper.send({"op": "switched", "interruption_ms": 1.0})
    state.wait_switched(timeout=10)
    state.log("h").append("x")
    assert state.checkpoint().seq == 1
    state.close()


def test_a_broker_that_refuses_the_state_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fake_keeper: type
) -> None:
    sock = tmp_path / "ipc.sock"
    fake_broker(sock, fake_keeper, refuse=True)
    monkeypatch.setenv("DSEC_STATE", "node")
    with pytest.raises(StateError, match="refused the state socket"):
        AgentState.open(socket_path=sock, agent="bot", group="team")


def test_a_handover_with_nothing_to_take_over_owns_the_state(pair: Callable[..., Any]) -> None:
    store, keeper = pair(takes_over=False)
    state = AgentState(store, agent="bot", group="team", handover=True)
    state.log("h").append(1)
    assert state.checkpoint().seq == 1
    assert keeper.checkpoints[0]["records"][0]["items"][0][2] == 1
    state.close()


def test_a_checkpoint_larger_than_a_frame_takes_several(
    pair: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from dsec_sdk.state import agent

    monkeypatch.setattr(codec, "MAX_RECORD_BYTES", 1000)
    monkeypatch.setattr(agent, "FRAME_BYTES", 2500)
    store, keeper = pair()
    state = AgentState(store, agent="bot", group="team")
    blob = state.blob("base")
    blob.set(bytes(range(256)) * 40)  # 10 KiB: 11 parts, 5 frames
    info = state.checkpoint()
    assert info.frames > 1 and info.seq == info.frames
    assert [f["seq"] for f in keeper.checkpoints] == list(range(1, info.frames + 1))
    records = [r for f in keeper.checkpoints for r in f["records"]]
    assert codec.fold(records)["base"].value["data"] == bytes(range(256)) * 40
    state.close()
