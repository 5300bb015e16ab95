"""A new caller's first ``connect`` goes right behind its hello (``BrokerLink(connect_to=...)``):
the broker reads it once the hello is done, and the client saves one round trip to the broker on
its first call to a peer. The real broker's side: every client test (``DSecClient`` opens its
connection this way)."""

from __future__ import annotations

import os
import select
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from dsec_sdk.errors import BrokerUnavailable, ProtocolError
from dsec_sdk.ipc import control
from dsec_sdk.ipc import link as lk

pytestmark = pytest.mark.unit


class Broker:
    """Accepts one connection and records what arrived before it answered the hello."""

    def __init__(self, path: Path, *, refuse: bool = False) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(str(path))
        self.listener.listen(1)
        self.refuse = refuse
        self.before_welcome: list[dict[str, Any]] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self.listener.accept()
        with conn:
            hello = control.recv(conn)
            assert hello is not None and hello[0]["op"] == "hello"
            # What the client sent without waiting for the welcome (nothing else is sent).
            conn.settimeout(5)
            connect = control.recv(conn)
            assert connect is not None
            self.before_welcome.append(connect[0])
            if self.refuse:
                control.send(conn, {"op": "error", "code": "refused", "message": "full; retry"})
                return
            fds = [os.eventfd(0) for _ in range(control.CALLER_FDS)]
            reply = {"op": "channel", "ref": connect[0]["ref"], "channel": 9, "peer": "b"}
            try:  # (a client that gave up may have closed already)
                control.send(conn, {"op": "welcome", "node": "n1", "ring_capacity": 4096})
                control.send(conn, reply, fds)
                extra = control.recv(conn)  # (until the client closes: nothing may arrive)
            except OSError:
                extra = None
            finally:
                control.close_fds(fds)
            if extra is not None:
                self.before_welcome.append({"unexpected": extra[0]})

    def join(self) -> None:
        self._thread.join(10)
        self.listener.close()


@pytest.fixture
def home() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="dsec-lk-"))
    yield path
    for leftover in path.iterdir():
        leftover.unlink()
    path.rmdir()


def test_the_first_connect_is_sent_before_the_welcome_and_answered_once(home: Path) -> None:
    broker = Broker(home / "ipc.sock")
    link = lk.BrokerLink(home / "ipc.sock", "a", "g1", "caller", connect_to="b")
    message, fds = link.connect("b")  # (only reads: its connect went with the hello)
    control.close_fds(fds)
    link.close()
    broker.join()
    assert broker.before_welcome == [{"op": "connect", "ref": 1, "peer": "b"}]
    assert message["channel"] == 9 and len(fds) == control.CALLER_FDS


def test_a_notice_reader_before_the_first_connect_leaves_its_answer_alone(home: Path) -> None:
    """Another thread looking for notices (``take_moved``) between the hello and the first
    connect's read must not consume that answer (found by a review, 2026-12-06: it was read
    as a notice and dropped, and the call waited 10 s for nothing)."""
    broker = Broker(home / "ipc.sock")
    link = lk.BrokerLink(home / "ipc.sock", "a", "g1", "caller", connect_to="b")
    deadline = time.monotonic() + 10
    while not _readable(link.sock):  # (the answer is queued)
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert not link.take_moved("b")
    message, fds = link.connect("b")
    control.close_fds(fds)
    link.close()
    broker.join()
    assert message["channel"] == 9


def _readable(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def test_another_peer_first_is_refused_and_a_refused_hello_still_says_why(home: Path) -> None:
    broker = Broker(home / "ipc.sock")
    link = lk.BrokerLink(home / "ipc.sock", "a", "g1", "caller", connect_to="b")
    with pytest.raises(ProtocolError, match="first connect, to 'b', is still unanswered"):
        link.connect("c")
    link.close()
    broker.join()
    (home / "ipc.sock").unlink()

    refusing = Broker(home / "ipc.sock", refuse=True)
    with pytest.raises(BrokerUnavailable, match="full; retry"):
        lk.BrokerLink(home / "ipc.sock", "a", "g1", "caller", connect_to="b")
    refusing.join()
