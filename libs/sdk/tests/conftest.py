"""Every SDK test runs twice: with the ring's C hot path and with ring.py alone (the state
plane's tests override ``ring_mode`` to run once). Also the state tests' helpers: ``capture``
(what a checkpoint would send for a container) and ``FakeKeeper`` (the keeper's side of the
state socket, as wire.py says)."""

from __future__ import annotations

import queue
import socket
import threading
from collections.abc import Callable
from typing import Any

import msgpack
import pytest
from dsec_sdk.ipc import ring as r
from dsec_sdk.state import wire
from dsec_sdk.state.containers import Container


@pytest.fixture(autouse=True, params=["c", "python"])
def ring_mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Which implementation new rings use in this test (``DSEC_IPC_PURE_PYTHON``)."""
    mode: str = request.param
    monkeypatch.setenv("DSEC_IPC_PURE_PYTHON", "1" if mode == "python" else "0")
    assert r.accelerated() == (mode == "c"), (
        "the SDK's C extension (dsec_sdk.ipc._fastring) is not built: `./taskw setup` needs a C "
        "compiler (gcc) and the interpreter's headers"
    )
    return mode


def capture(container: Container) -> list[dict[str, Any]]:
    """What a checkpoint would send for this container, decoded."""
    with container._lock:
        thunks = container._capture()
    return [
        msgpack.unpackb(body, raw=False, strict_map_key=False)
        for thunk in thunks
        for body in thunk()
    ]


class FakeKeeper(threading.Thread):
    """The keeper's side of the state socket, as the contract (wire.py) says: answers hello,
    fetch (with ``records``), and acks checkpoints; every frame it gets goes to ``received``;
    the test sends unsolicited ones with :meth:`send`."""

    def __init__(
        self,
        sock: socket.socket,
        *,
        records: list[dict[str, Any]] | None = None,
        seq: int = 0,
        config: dict[str, Any] | None = None,
        refuse_checkpoints: bool = False,
        takes_over: bool = True,
    ) -> None:
        super().__init__(daemon=True)
        self.sock = sock
        self.records = records or []
        self.seq = seq
        self.config = config or {}
        self.refuse_checkpoints = refuse_checkpoints
        self.takes_over = takes_over  # False: a hand-over hello finds no old version
        self.received: queue.Queue[dict[str, Any]] = queue.Queue()
        self.checkpoints: list[dict[str, Any]] = []
        self.hold_final: threading.Event | None = None  # set: a final checkpoint's ack waits
        self.before_answer: Callable[[dict[str, Any]], None] | None = None  # per checkpoint
        self._lock = threading.Lock()

    def send(self, frame: dict[str, Any]) -> None:
        with self._lock:
            wire.send(self.sock, frame)

    def run(self) -> None:
        try:
            while True:
                frame = wire.recv(self.sock)
                if frame is None:
                    return
                self.received.put(frame)
                op = frame["op"]
                if op == "hello":
                    self.send(
                        {
                            "op": "welcome",
                            "state_id": "st-1",
                            "seq": self.seq,
                            "config": self.config,
                            "handover": frame["handover"] and self.takes_over,
                        }
                    )
                elif op == "fetch":
                    if self.records:
                        self.send({"op": "records", "records": self.records})
                    self.send(
                        {
                            "op": "fetched",
                            "seq": self.seq,
                            "deltas": len(self.records),
                            "source": "local" if self.records else "empty",
                            "ms": 1.0,
                        }
                    )
                elif op == "checkpoint":
                    if self.before_answer is not None:
                        self.before_answer(frame)
                    if self.refuse_checkpoints:
                        self.send(
                            {"op": "error", "code": "disk", "message": "full", "seq": frame["seq"]}
                        )
                        continue
                    if frame["seq"] != self.seq + 1:  # (as the node's keeper: in order, no gap)
                        message = f"checkpoint {frame['seq']} after {self.seq}"
                        refusal = {"op": "error", "code": "bad-seq", "message": message}
                        self.send({**refusal, "seq": frame["seq"], "expected": self.seq + 1})
                        continue
                    self.checkpoints.append(frame)
                    if frame.get("final") and self.hold_final is not None:
                        self.hold_final.wait(10)
                    self.seq = frame["seq"]
                    self.send({"op": "ack", "seq": frame["seq"], "bytes": 100})
                elif op == "bye":
                    return
        except OSError:
            return

    def next_frame(self, op: str, timeout: float = 10.0) -> dict[str, Any]:
        """The next received frame of ``op`` (skipping others)."""
        while True:
            frame = self.received.get(timeout=timeout)
            if frame["op"] == op:
                return frame


@pytest.fixture(scope="session")
def capture_records() -> Callable[[Container], list[dict[str, Any]]]:
    return capture


@pytest.fixture(scope="session")
def fake_keeper() -> type[FakeKeeper]:
    return FakeKeeper
