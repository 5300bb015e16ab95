"""The shared-memory ring and channel layout, without a broker."""

from __future__ import annotations

import asyncio
import datetime
import fcntl
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from unittest.mock import ANY

import pytest
from dsec_sdk.errors import PayloadTooLarge, PeerGone, ProtocolError
from dsec_sdk.ipc import channel as ch
from dsec_sdk.ipc import codec
from dsec_sdk.ipc import ring as r
from dsec_sdk.ipc.server import Dispatcher, ServeCore, decode_request

CAPACITY = 4096


class Pair:
    """Both ends of one channel in this process (the peer pidfd is our own: never exits)."""

    def __init__(
        self, capacity: int = CAPACITY, max_payload: int = 1 << 20, channel_id: int = 1
    ) -> None:
        fds = ch.create_channel(capacity)
        self.doorbell = ch.new_eventfd()
        pidfd = os.pidfd_open(os.getpid())
        self.caller = ch.CallerEnd(
            channel_id=channel_id,
            peer="b",
            capacity=capacity,
            fds=[os.dup(fd) for fd in fds.all()] + [os.dup(self.doorbell), os.dup(pidfd)],
            max_payload=max_payload,
            spin_ns=1000,
        )
        self.server = ch.ServerEnd(
            channel_id=channel_id,
            peer="a",
            capacity=capacity,
            fds=[os.dup(fd) for fd in fds.all()] + [pidfd],
            doorbell=self.doorbell,
            max_payload=max_payload,
        )
        fds.close()

    def close(self) -> None:
        self.caller.close()
        self.server.close()
        os.close(self.doorbell)


@pytest.fixture
def pair() -> Iterator[Pair]:
    p = Pair()
    yield p
    p.close()


@pytest.mark.unit
def test_frames_of_every_size_come_out_in_order(pair: Pair) -> None:
    rng = random.Random(1)
    ring_w, ring_r = pair.caller.requests, pair.server.requests
    sent: list[bytes] = []
    received: list[bytes] = []
    for i in range(3000):
        body = rng.randbytes(rng.choice([0, 1, 15, 16, 17, 100, 1000, 2032, 2033, 9000]))
        while not ring_w.try_write(1, i, body):
            frame = ring_r.try_read(bytes)
            assert frame is not None, "ring reports full but holds nothing"
            assert frame[1] == len(received)
            received.append(frame[2])
        sent.append(body)
    while (frame := ring_r.try_read(bytes)) is not None:
        received.append(frame[2])
    assert received == sent


@pytest.mark.unit
def test_full_ring_pushes_back_until_read(pair: Pair) -> None:
    ring_w, ring_r = pair.caller.requests, pair.server.requests
    count = 0
    while ring_w.try_write(1, count, b"x" * 100):
        count += 1
    assert count == CAPACITY // 128  # 16-byte header + 100 bytes padded to 112
    assert not ring_w.writable(100)
    assert ring_r.try_read(bytes) == (1, 0, b"x" * 100)
    assert ring_w.try_write(1, count, b"y" * 100)


@pytest.mark.unit
def test_payload_larger_than_ring_goes_through_overflow_one_at_a_time(pair: Pair) -> None:
    ring_w, ring_r = pair.caller.requests, pair.server.requests
    big = os.urandom(50_000)
    assert ring_w.try_write(1, 1, big)
    assert not ring_w.try_write(1, 2, big)  # the overflow slot is busy until read
    assert ring_r.try_read(bytes) == (1, 1, big)
    assert ring_w.try_write(1, 2, big[::-1])
    assert ring_r.try_read(bytes) == (1, 2, big[::-1])
    with pytest.raises(PayloadTooLarge, match=r"message is 2000000 bytes; the limit is 1048576"):
        ring_w.try_write(1, 3, b"z" * 2_000_000)


@pytest.mark.unit
def test_garbage_in_shared_memory_is_a_protocol_error(pair: Pair) -> None:
    ring_w, ring_r = pair.caller.requests, pair.server.requests
    assert ring_w.try_write(1, 1, b"ok")
    # A hostile peer overwrites the record type.
    struct.pack_into("<IBBHQ", ring_r._data, 0, 2, 99, 1, 0, 1)
    with pytest.raises(ProtocolError, match="unknown record type 99"):
        ring_r.try_read(bytes)


@pytest.mark.unit
def test_a_body_nested_deeper_than_the_stack_is_malformed_not_a_crash(pair: Pair) -> None:
    """A peer's request of one-element arrays 5,000 deep made msgspec raise RecursionError,
    which no serving loop caught: the server agent stopped serving everyone."""
    deep = b"\x91" * 5000 + b"\x00"
    assert pair.caller.requests.try_write(1, 7, deep)
    kind, call_id, request = pair.server.requests.try_read(decode_request)
    assert (kind, call_id, request) == (1, 7, None)
    answer_kind, answer = Dispatcher({}, max_payload=1000).start(request)  # type: ignore[misc]
    assert answer_kind == codec.ERROR
    assert b"malformed request frame" in answer
    with pytest.raises(ProtocolError, match="undecodable frame body"):  # and as an answer
        codec.decode(memoryview(deep))


@pytest.mark.unit
def test_no_memory_of_a_channel_can_be_resized_by_a_peer() -> None:
    fds = ch.create_channel(CAPACITY, max_payload=1 << 20)
    try:
        for fd in (fds.memfd, fds.request_overflow, fds.response_overflow):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 0)  # would SIGBUS the other side's mapping
            with pytest.raises(PermissionError):
                os.ftruncate(fd, 1 << 48)  # would make the other side's mmap() fail
            with pytest.raises(PermissionError):  # F_SEAL_SEAL: no seal can be added later
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
        assert os.fstat(fds.request_overflow).st_size == 1 << 20
    finally:
        fds.close()


def _unsealed_overflow(fds: ch.ChannelFds, which: int) -> list[int]:
    """The channel's fds with overflow ``which`` replaced by an unsealed memfd of 2**48 bytes."""
    evil = os.memfd_create("evil", os.MFD_CLOEXEC)
    os.ftruncate(evil, 1 << 48)
    out = [os.dup(fd) for fd in fds.all()]
    os.close(out[which])
    out[which] = evil
    return out


@pytest.mark.unit
@pytest.mark.parametrize("which", [0, 1, 2])
def test_an_end_refuses_a_memfd_without_the_seals(which: int) -> None:
    fds = ch.create_channel(CAPACITY)
    doorbell = ch.new_eventfd()
    try:
        given = [*_unsealed_overflow(fds, which), os.pidfd_open(os.getpid())]
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(ProtocolError, match="is not sealed against resizing"):
            ch.ServerEnd(
                channel_id=1,
                peer="evil",
                capacity=CAPACITY,
                fds=given,
                doorbell=doorbell,
                max_payload=1 << 20,
            )
        # The refused end closed every fd it was given (the doorbell is not its own).
        assert len(os.listdir("/proc/self/fd")) == before - 5
    finally:
        fds.close()
        os.close(doorbell)


GROW_ATTACK = r"""
import os, sys
from dsec_sdk.errors import ProtocolError
from dsec_sdk.ipc import channel as ch, ring as r
fds = ch.create_channel(4096, max_payload=1 << 20)
doorbell = ch.new_eventfd()
pidfd = os.pidfd_open(os.getpid())
server = ch.ServerEnd(channel_id=1, peer="evil", capacity=4096,
                      fds=[os.dup(fd) for fd in fds.all()] + [pidfd], doorbell=doorbell,
                      max_payload=1 << 20)
# The attack: grow the overflow memfd to 2**48, then announce a large record.
try:
    os.ftruncate(fds.request_overflow, 1 << 48)
    print("grown")
except PermissionError:
    print("sealed")
ring = server.requests
for n in (1 << 20, (1 << 20) + 1, 2**32 - 1):
    ring.hdr[r.LARGE_WRITTEN] = ring.hdr[r.LARGE_CONSUMED] + 1
    r.RECORD.pack_into(ring._data, ring.hdr[r.HEAD] & 4095, n, r.REC_LARGE, 1, 0, 7)
    ring.hdr[r.HEAD] = ring.hdr[r.HEAD] + 16
    try:
        frame = ring.try_read(bytes)
        print("frame", n, len(frame[2]))
    except ProtocolError as exc:
        print("protocol_error", n, exc)
"""


@pytest.mark.integration
def test_growing_the_overflow_memfd_is_refused_and_a_huge_record_is_a_protocol_error(
    ring_mode: str,
) -> None:
    """The brief's attack: ftruncate(2**48) fails (sealed); a record larger than the sealed
    size is a ProtocolError for that channel, never an mmap() ENOMEM that ends serve()."""
    result = subprocess.run(
        [sys.executable, "-c", GROW_ATTACK], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[0] == "sealed"
    assert lines[1] == f"frame {1 << 20} {1 << 20}"  # the sealed size is what is mapped
    assert lines[2].startswith(f"protocol_error {(1 << 20) + 1} overflow payload of")
    assert lines[3].startswith(f"protocol_error {2**32 - 1} overflow payload of")


@pytest.mark.unit
def test_a_tail_moved_off_record_alignment_is_a_protocol_error(pair: Pair) -> None:
    ring_w, ring_r = pair.caller.requests, pair.server.requests
    assert ring_w.try_write(1, 1, b"ok")
    for tail in (CAPACITY - 8, CAPACITY - 1, 3):  # the record header would leave the ring
        ring_r.hdr[r.TAIL] = tail
        ring_r.hdr[r.HEAD] = tail + 32
        with pytest.raises(ProtocolError, match="not 16-byte aligned"):
            ring_r.try_read(bytes)


@pytest.mark.unit
def test_a_server_drops_only_the_channel_whose_ring_was_corrupted() -> None:
    good, bad = Pair(), Pair()
    core = ServeCore()
    try:
        core.add(good.server)
        core.add(bad.server)
        bad.server.responses.hdr[r.HEAD] = 5  # a hostile caller moves the server's head
        bad.server.respond(1, 1, b"x" * 3000)  # needs a wrap: refused, channel marked broken
        assert bad.server.broken is not None and "not record-aligned" in bad.server.broken
        assert core.reap(check_pids=False) == [bad.server]
        assert core.channels == [good.server]
        assert good.caller.requests.try_write(1, 9, b"ping")
        assert [(call_id, body) for _, call_id, body in core.next_requests(bytes)] == [(9, b"ping")]
    finally:
        core.close()
        good.caller.close()
        bad.caller.close()
        os.close(good.doorbell)
        os.close(bad.doorbell)


@pytest.mark.unit
def test_capacity_must_be_a_power_of_two() -> None:
    with pytest.raises(ValueError, match="ring capacity 5000 is invalid: use a power of two"):
        ch.create_channel(5000)


@pytest.mark.unit
def test_closed_channel_wakes_the_waiter_with_peer_gone(pair: Pair) -> None:
    pair.server.close()
    with pytest.raises(PeerGone, match="agent 'b' is gone: it closed the channel"):
        pair.caller.wait_response(time.perf_counter_ns() + 5_000_000_000)


@pytest.mark.unit
def test_sleeping_reader_is_woken_by_the_writer(pair: Pair) -> None:
    import threading

    # The consumer spins 1 µs, then announces it sleeps; the writer must ring its eventfd.
    def write_later() -> None:
        time.sleep(0.05)
        pair.server.respond(2, 1, b"late")

    writer = threading.Thread(target=write_later)
    writer.start()
    assert pair.caller.wait_response(time.perf_counter_ns() + 10_000_000_000)
    assert pair.caller.responses.try_read(bytes) == (2, 1, b"late")
    writer.join()


PRODUCER = r"""
import os, random, sys
from dsec_sdk.ipc import channel as ch
fds = [int(x) for x in sys.argv[1:7]]
end = ch.CallerEnd(channel_id=1, peer="consumer", capacity=4096, fds=fds,
                   max_payload=1 << 20, spin_ns=20_000)
rng = random.Random(7)
for i in range(int(sys.argv[7])):
    body = rng.randbytes(rng.choice([0, 3, 16, 500, 2000, 2032, 7000, 20000]))
    assert end.send(1, i, body, 1 << 62)
assert end.requests.accelerated == (os.environ["DSEC_IPC_PURE_PYTHON"] == "0")
"""


@pytest.mark.integration
@pytest.mark.parametrize("producer_mode", ["c", "python"])
def test_spsc_across_processes_no_loss_duplicate_or_reorder(
    ring_mode: str, producer_mode: str
) -> None:
    """A producer process and this consumer run truly in parallel, with backpressure.

    The producer runs either implementation, whatever this consumer runs: the layout in shared
    memory is the protocol, and the C and Python ends must interoperate.
    """
    fds = ch.create_channel(CAPACITY)
    doorbell = ch.new_eventfd()
    child_fds = [*fds.all(), doorbell, os.pidfd_open(os.getpid())]
    count = 3000
    env = {**os.environ, "DSEC_IPC_PURE_PYTHON": "1" if producer_mode == "python" else "0"}
    proc = subprocess.Popen(
        [sys.executable, "-c", PRODUCER, *map(str, child_fds), str(count)],
        pass_fds=child_fds,
        env=env,
    )
    server = ch.ServerEnd(
        channel_id=1,
        peer="producer",
        capacity=CAPACITY,
        fds=[*(os.dup(fd) for fd in fds.all()), os.pidfd_open(proc.pid)],
        doorbell=doorbell,
        max_payload=1 << 20,
    )
    fds.close()
    os.close(child_fds[-1])
    sleeper = ch.Sleeper(doorbell)
    rng = random.Random(7)
    try:
        for expected in range(count):
            size = rng.choice([0, 3, 16, 500, 2000, 2032, 7000, 20000])
            body = rng.randbytes(size)
            while (frame := server.requests.try_read(bytes)) is None:
                server.requests.hdr[r.CONSUMER_WAITING] = 1
                r.fence()
                if not server.requests.readable():
                    assert not ch.pidfd_exited(server.peer_pidfd), "producer died"
                    sleeper.sleep(100_000_000)
                server.requests.hdr[r.CONSUMER_WAITING] = 0
            assert frame == (1, expected, body)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        server.close()
        os.close(doorbell)


@pytest.mark.unit
def test_server_drops_a_channel_its_caller_closed() -> None:
    from dsec_sdk.ipc.server import ServeCore

    pair = Pair()
    core = ServeCore()
    core.add(pair.server)
    assert core.reap(check_pids=False) == []
    pair.caller.close()
    assert core.reap(check_pids=False) == [pair.server]
    assert core.channels == []
    assert pair.server.is_closed
    os.close(pair.doorbell)


# ---------------------------------------------------------------------------- the C hot path
@pytest.mark.unit
def test_a_decoder_that_keeps_the_body_view_cannot_read_a_reused_slot(pair: Pair) -> None:
    kept: list[memoryview] = []
    assert pair.caller.requests.try_write(1, 1, b"secret-1")
    frame = pair.server.requests.try_read(lambda view: kept.append(view) or bytes(view))
    assert frame == (1, 1, b"secret-1")
    assert pair.caller.requests.try_write(1, 2, b"secret-2")
    with pytest.raises(ValueError, match="released"):
        bytes(kept[0])


@pytest.mark.unit
def test_a_failing_decoder_still_consumes_its_record(pair: Pair) -> None:
    def boom(view: memoryview) -> bytes:
        raise RuntimeError("bad body")

    assert pair.caller.requests.try_write(1, 1, b"one")
    assert pair.caller.requests.try_write(1, 2, b"two")
    with pytest.raises(RuntimeError, match="bad body"):
        pair.server.requests.try_read(boom)
    assert pair.server.requests.try_read(bytes) == (1, 2, b"two")
    assert not pair.server.requests.readable()


@pytest.mark.unit
def test_fast_call_sends_spins_and_reads_or_says_why_not(pair: Pair, ring_mode: str) -> None:
    requests, responses = pair.caller.requests, pair.server.responses
    fast_call = requests.fast_call
    if ring_mode == "python":
        assert fast_call is None  # the client then writes, waits and reads: tested above
        return
    assert fast_call is not None
    no_deadline = 1 << 62
    # Nobody answers: the request goes out, the spin budget runs out (0).
    assert (
        fast_call(pair.caller.responses.fast, 1, 7, b"ping", bytes, 2_000, 10**9, no_deadline) == 0
    )
    assert pair.server.requests.try_read(bytes) == (1, 7, b"ping")
    # An answer already waiting is read at once.
    assert responses.try_write(2, 7, b"pong")
    assert fast_call(pair.caller.responses.fast, 1, 8, b"ping", bytes, 0, 0, no_deadline) == (
        2,
        7,
        b"pong",
    )
    # Too large to go inline: nothing is sent (-1), the general path decides.
    head = requests.hdr[r.HEAD]
    assert fast_call(pair.caller.responses.fast, 1, 9, b"x" * CAPACITY, bytes, 0, 0, 0) == -1
    assert requests.hdr[r.HEAD] == head


@pytest.mark.unit
def test_a_released_ring_refuses_work_instead_of_touching_unmapped_memory(pair: Pair) -> None:
    write = pair.caller.requests.try_write
    pair.caller.close()
    with pytest.raises(ValueError, match="released"):
        write(1, 1, b"late")


HOSTILE = r"""
import os, random, struct, sys
from dsec_sdk.errors import ProtocolError
from dsec_sdk.ipc import channel as ch
from dsec_sdk.ipc import ring as r
fds = ch.create_channel(4096)
doorbell = ch.new_eventfd()
pidfd = os.pidfd_open(os.getpid())
server = ch.ServerEnd(channel_id=1, peer="evil", capacity=4096,
                      fds=[os.dup(fd) for fd in fds.all()] + [pidfd], doorbell=doorbell,
                      max_payload=1 << 16)
ring = server.requests
assert ring.accelerated == (os.environ["DSEC_IPC_PURE_PYTHON"] == "0")
rng = random.Random(int(sys.argv[1]))
outcomes = {"frame": 0, "protocol_error": 0}
for _ in range(20000):
    # A hostile peer scribbles over the records and moves HEAD anywhere.
    for _ in range(rng.randint(1, 8)):
        at = rng.randrange(4096 - 16)
        ring._data[at : at + 16] = rng.randbytes(16)
    if rng.random() < 0.3:
        struct.pack_into("<IBBHQ", ring._data, ring.hdr[r.TAIL] & 4095,
                         rng.choice([0, 1, 100, 2032, 2033, 4096, 1 << 20, 2**32 - 1]),
                         rng.choice([1, 2, 3, 0, 255]), 1, 0, 1)
    if rng.random() < 0.05:  # counters at the end of their 64 bits: they wrap, as in C
        ring.hdr[r.TAIL] = 2**64 - rng.choice([16, 32, 4096])
        ring.hdr[r.LARGE_CONSUMED] = 2**64 - 1
    ring.hdr[r.HEAD] = (ring.hdr[r.TAIL] + rng.choice([16, 32, 4096, 2**40])) % 2**64
    try:
        frame = ring.try_read(bytes)
    except ProtocolError:
        outcomes["protocol_error"] += 1
    else:
        # Inline: at most the ring; overflow: at most what this end mapped (its max_payload).
        assert frame is not None and len(frame[2]) <= (1 << 16)
        outcomes["frame"] += 1
# A hostile consumer moves TAIL anywhere: the writer stays inside its ring, whatever it is told.
caller = ch.CallerEnd(channel_id=1, peer="evil", capacity=4096,
                      fds=[os.dup(fd) for fd in fds.all()] + [os.dup(doorbell),
                                                               os.pidfd_open(os.getpid())],
                      max_payload=1 << 16, spin_ns=0)
out = caller.requests
for _ in range(20000):
    if rng.random() < 0.05:
        out.hdr[r.HEAD] = 2**64 - rng.choice([16, 32, 4096])
        out.hdr[r.LARGE_WRITTEN] = out.hdr[r.LARGE_CONSUMED] = 2**64 - 1
    out.hdr[r.TAIL] = rng.choice([0, out.hdr[r.HEAD], (out.hdr[r.HEAD] + 2**40) % 2**64, 2**63,
                                   rng.randrange(2**64)])
    # True or False ("no space" is a fine answer to a lie); anything else fails the test.
    body = rng.randbytes(rng.choice([0, 15, 2000, 2033, 5000]))
    assert out.try_write(1, 1, body) in (True, False)
print(outcomes["frame"] > 0 and outcomes["protocol_error"] > 0)
"""


@pytest.mark.integration
def test_a_hostile_peer_scribbling_on_shared_memory_gets_errors_never_a_crash(
    ring_mode: str,
) -> None:
    """Garbage records and a wild HEAD: frames or ProtocolError, never a read out of bounds.

    In a child process, so a crash would show as a signal rather than take pytest down.
    """
    result = subprocess.run(
        [sys.executable, "-c", HOSTILE, "11"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "True", result.stdout


# ---------------------------------------------------------------------------- core placement
class AffinityLog:
    """Records sched_setaffinity calls (and makes them): what a move asked the kernel for.

    Where the kernel runs a thread afterwards is its business (on a loaded machine it may move
    it again at any time), so the tests check the request: "only CPUs other than the peer's",
    then "the mask as it was"."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cpu: int) -> None:
        self.calls: list[set[int]] = []
        real = os.sched_setaffinity

        def record(pid: int, mask: Iterable[int]) -> None:
            self.calls.append(set(mask))
            real(pid, mask)

        monkeypatch.setattr(ch.os, "sched_setaffinity", record)
        monkeypatch.setattr(ch, "current_cpu", lambda: cpu)  # "this thread runs on `cpu`"


@pytest.mark.unit
def test_moving_off_a_shared_core_is_a_migration_not_pinning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    allowed = os.sched_getaffinity(0)
    assert len(allowed) >= 2, "this test needs 2 CPUs (the project's machines have them)"
    here = min(allowed)
    log = AffinityLog(monkeypatch, here)
    assert not ch.move_off_core(-1)  # the peer's core is unknown: stay
    assert not ch.move_off_core(max(allowed) + 1)  # the peer is elsewhere: stay
    assert log.calls == []
    assert ch.move_off_core(here)
    target, restored = log.calls
    assert here not in target and target <= allowed and len(target) == 1
    assert restored == allowed == os.sched_getaffinity(0)  # moved once, not pinned
    monkeypatch.setattr(ch.os, "sched_getaffinity", lambda pid: {here})
    assert not ch.move_off_core(here)  # nowhere else to go
    assert len(log.calls) == 2


@pytest.mark.unit
def test_an_end_woken_next_to_its_peer_moves_to_another_core(
    pair: Pair, ring_mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wake-up lands next to the waker (wake-affine placement); two agents on one core pay a
    context switch per call (~11 µs instead of ~3 µs), so a woken end leaves its peer's core."""
    allowed = os.sched_getaffinity(0)
    caller, server = pair.caller, pair.server
    assert caller.requests.try_write(1, 1, b"wake up")
    core = ServeCore()
    core.add(server)
    if ring_mode == "python":  # ring.py records no core: nothing to go by, nobody moves
        assert caller.requests.hdr[r.PRODUCER_CPU] == 0
        log = AffinityLog(monkeypatch, 0)
        assert not core.leave_callers_core()
        assert log.calls == []
        return
    # The server side: a caller's request woke it; the caller wrote it on the core recorded.
    callers_cpu = int(caller.requests.hdr[r.PRODUCER_CPU]) - 1
    assert callers_cpu in allowed
    log = AffinityLog(monkeypatch, callers_cpu)  # ...and the server woke up there too
    assert core.leave_callers_core() and core.moves == 1
    assert callers_cpu not in log.calls[0] and log.calls[1] == allowed
    # The caller side: woken (here by its deadline) while its server reads on its core.
    assert server.requests.try_read(bytes) == (1, 1, b"wake up")
    servers_cpu = int(caller.requests.hdr[r.CONSUMER_CPU]) - 1
    assert servers_cpu in allowed
    log = AffinityLog(monkeypatch, servers_cpu)
    assert not caller.wait_response(time.perf_counter_ns() + 2_000_000)  # sleeps, times out
    assert caller.moves == 1
    assert servers_cpu not in log.calls[0] and log.calls[1] == allowed
    assert os.sched_getaffinity(0) == allowed


@pytest.mark.unit
def test_a_spin_cut_short_by_another_task_does_not_shrink_the_budget() -> None:
    spin = ch.Spin(100_000)
    long_ago = time.perf_counter_ns() - 1_000_000  # the yield "took" 1 ms: someone else ran
    for _ in range(3 * ch.Spin.MISSES_BEFORE_SHRINK):
        spin.yield_cpu(long_ago)
        spin.miss()
    assert spin.budget_ns == 100_000  # the peer is not slow; the core was busy
    for _ in range(ch.Spin.MISSES_BEFORE_SHRINK):
        spin.miss()
    assert spin.budget_ns == 50_000  # a run of plain misses: the peer is slow


@pytest.mark.unit
def test_an_async_caller_woken_next_to_its_server_moves_too(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    import asyncio

    from dsec_sdk.ipc.aio import AsyncCaller

    allowed = os.sched_getaffinity(0)
    servers_cpu = min(allowed)
    pair.caller.requests.hdr[r.CONSUMER_CPU] = servers_cpu + 1  # as the server's C path writes
    log = AffinityLog(monkeypatch, servers_cpu)

    async def woken() -> None:
        caller = AsyncCaller(pair.caller, bytes)
        try:
            assert pair.server.responses.try_write(2, 1, b"late answer")
            os.eventfd_write(pair.caller.wake_fd, 1)  # what the server's write does when we sleep
            for _ in range(100):
                await asyncio.sleep(0)
                if log.calls:
                    break
        finally:
            caller.loop.remove_reader(pair.caller.wake_fd)
            caller.loop.remove_reader(pair.caller.peer_pidfd)

    asyncio.run(woken())
    assert pair.caller.moves == 1
    assert servers_cpu not in log.calls[0] and log.calls[1] == allowed


@pytest.mark.unit
@pytest.mark.parametrize("value", ["false", "OFF", "0", ""])
def test_pure_python_switch_reads_no_as_no(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("DSEC_IPC_PURE_PYTHON", value)
    assert r.accelerated()  # "false" must not turn the C path off


@pytest.mark.unit
def test_pure_python_switch_refuses_a_value_it_cannot_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DSEC_IPC_PURE_PYTHON", "maybe")
    fds = ch.create_channel(CAPACITY)
    handed = [os.dup(fd) for fd in fds.all()] + [ch.new_eventfd(), os.pidfd_open(os.getpid())]
    fds.close()
    with pytest.raises(ValueError, match=r"DSEC_IPC_PURE_PYTHON='maybe' is invalid: use 1/true"):
        ch.CallerEnd(
            channel_id=1, peer="b", capacity=CAPACITY, fds=handed, max_payload=1 << 20, spin_ns=0
        )
    for fd in handed:  # the refused end closed every fd it was handed: nothing leaks
        with pytest.raises(OSError):
            os.fstat(fd)


@pytest.mark.unit
def test_the_c_methods_name_their_arguments(pair: Pair, ring_mode: str) -> None:
    if ring_mode == "python":
        return  # ring.py's methods are Python functions: Python names their arguments
    with pytest.raises(TypeError, match=r"try_write\(kind, call_id, body\) takes 3 arguments"):
        pair.caller.requests.try_write(1, 2)


# ------------------------------------------------------------------ a whole call's common case in C
# FastCaller and FastServer (client.py's and runner.py's hot paths): each either finishes the
# common case or stops where the Python path goes on, handing over what it needs.
C_ONLY = pytest.mark.parametrize("ring_mode", ["c"], indirect=True)
FAR = 1 << 62
ANSWER = {"results": [{"title": "memfd_create(2)", "url": "https://man7.org/"}]}
_pack = codec.new_packer().encode


def _fast_caller(pair: Pair) -> tuple[Any, threading.Lock]:
    lock = threading.Lock()
    spin = pair.caller.spin
    caller = pair.caller.requests.fast_caller(
        pair.caller.responses, _pack, codec.unpack, lock, spin, spin.max_ns, ch.PURE_SPIN_NS
    )
    assert caller is not None
    return caller, lock


@pytest.mark.unit
@C_ONLY
def test_the_c_caller_returns_the_answer_and_frees_the_lock(pair: Pair) -> None:
    caller, lock = _fast_caller(pair)
    for timeout, timeout_ms in ((2.0, 2000), (None, 0), (3, 3000), (0.0001, 1)):
        call_id = caller.next_id
        assert pair.server.responses.try_write(codec.RESULT, call_id, _pack(ANSWER))
        assert caller.call("search", {"q": "x"}, timeout) == ANSWER
        assert caller.next_id == call_id + 1
        assert not lock.locked()
        frame = pair.server.requests.try_read(codec.unpack)
        assert frame == (codec.REQUEST, call_id, ["search", {"q": "x"}, timeout_ms])


@pytest.mark.unit
@C_ONLY
def test_the_c_caller_hands_every_other_case_to_python(pair: Pair) -> None:
    caller, lock = _fast_caller(pair)
    requests = pair.server.requests
    # Another thread's call holds the lock: nothing is sent, nothing taken.
    with lock:
        assert caller.call("t", {}, 1.0) == (0,)
    # Timeouts only Python converts (it raises for them as it always did): the same.
    for timeout in (float("nan"), float("inf"), 1e12, "soon", 2**70):
        assert caller.call("t", {}, timeout) == (0,)
    # Arguments MessagePack cannot carry; a request over the channel's limit.
    assert caller.call("t", {"x": object()}, 1.0) == (2,)
    too_large = caller.call("t", {"x": "a" * (1 << 20)}, 1.0)
    assert too_large[0] == 3 and too_large[1] > 1 << 20
    assert not requests.readable() and not lock.locked()
    assert caller.next_id == 1  # no id was spent on what was never sent
    # Sent, and no answer while spinning: the lock stays held for the Python path that waits.
    status = caller.call("t", {"k": 1}, 1.0)
    assert status[0] == 1 and status[1] in (0, 2) and lock.locked()
    _, _, call_id, body, deadline = status
    assert codec.unpack(body) == ["t", {"k": 1}, 1000]
    assert time.perf_counter_ns() < deadline < time.perf_counter_ns() + 1_100_000_000
    assert requests.try_read(codec.unpack) == (codec.REQUEST, call_id, ["t", {"k": 1}, 1000])
    lock.release()
    # An error frame, or the late answer to an earlier id: held, with the frame as read.
    for kind, answer_id in ((codec.ERROR, caller.next_id), (codec.RESULT, caller.next_id - 1)):
        assert pair.server.responses.try_write(kind, answer_id, _pack(["remote", "E", "m", ""]))
        status = caller.call("t", {}, 1.0)
        assert status[0] == 1 and status[1] == (kind, answer_id, ["remote", "E", "m", ""])
        assert lock.locked()
        lock.release()
        requests.try_read(len)
    # An answer that does not decode: the exception, the lock freed.
    assert pair.server.responses.try_write(codec.RESULT, caller.next_id, b"\xc1")
    status = caller.call("t", {}, 1.0)
    assert status[0] == 5 and isinstance(status[1], ValueError) and not lock.locked()
    requests.try_read(len)
    # The channel closed: said so, nothing touched; what could never be sent is said first,
    # as the Python path does.
    pair.caller.close()
    assert caller.call("t", {}, 1.0) == (4,)
    assert caller.call("t", {"x": object()}, 1.0) == (2,)
    assert caller.call("t", {"x": "a" * (1 << 20)}, 1.0)[0] == 3
    assert not lock.locked()


@pytest.mark.unit
@C_ONLY
def test_the_lock_a_held_call_keeps_is_released_only_by_the_thread_that_holds_it(
    pair: Pair,
) -> None:
    caller, lock = _fast_caller(pair)
    assert caller.release_held() is False  # nothing held: a no-op, every way out may run it
    status = caller.call("t", {}, 0.001)  # no server: the spin runs out, the lock stays held
    assert status[0] == 1 and lock.locked()
    other: list[bool] = []
    thread = threading.Thread(target=lambda: other.append(caller.release_held()))
    thread.start()
    thread.join()
    assert other == [False] and lock.locked()  # not another thread's to release
    assert caller.release_held() is True and not lock.locked()
    assert caller.release_held() is False  # once
    with lock:  # and never a lock some Python-path call holds
        assert caller.release_held() is False
        assert lock.locked()


def _fast_server(pair: Pair, tools: dict[str, Any]) -> tuple[Dispatcher, Any]:
    dispatcher = Dispatcher(tools, 1 << 16)
    fast = pair.server.requests.fast_server(
        pair.server.responses,
        decode_request,
        dispatcher.tools,
        dispatcher.async_tools,
        dispatcher.packer.encode,
        dispatcher.max_payload,
    )
    assert fast is not None
    return dispatcher, fast


def _echo(text: str) -> str:
    return text.upper()


def _blocking_server(tools: dict[str, Any]) -> tuple[Any, Callable[[], None]]:
    """A BlockingServer on a stand-in broker link (a socket pair, an eventfd doorbell), and
    what frees it (a run() that was stopped closed the server itself as it ended)."""
    from types import SimpleNamespace

    from dsec_sdk.ipc.runner import BlockingServer

    sock_a, sock_b = socket.socketpair()
    link = SimpleNamespace(
        welcome_fds=[ch.new_eventfd()],
        welcome={"max_payload": 1 << 16},
        sock=sock_a,
        path="test",
        close=lambda: None,
    )
    server = BlockingServer(link, Dispatcher(tools, 1 << 16), 1000)  # type: ignore[arg-type]

    def close() -> None:
        if not server._stopped.is_set():
            server.close()
        sock_a.close()
        sock_b.close()

    return server, close


@pytest.mark.unit
@C_ONLY
def test_the_c_server_answers_a_plain_call(pair: Pair) -> None:
    _, fast = _fast_server(pair, {"echo": _echo})
    assert pair.caller.requests.try_write(codec.REQUEST, 7, _pack(["echo", {"text": "hi"}, 0]))
    assert fast.serve(FAR, FAR) == 1
    assert pair.caller.responses.try_read(codec.unpack) == (codec.RESULT, 7, "HI")
    assert fast.serve(time.perf_counter_ns() + 2000, FAR) == 0  # nothing more came
    assert fast.serve(FAR, time.perf_counter_ns() + 2000) == 2  # time to yield the core


@pytest.mark.unit
@C_ONLY
def test_the_c_server_stops_where_python_goes_on_and_python_answers_the_same(pair: Pair) -> None:
    def fail() -> None:
        raise ValueError("no luck")

    async def later() -> int:
        return 1

    def interrupted() -> None:
        raise KeyboardInterrupt

    tools = {
        "echo": _echo,
        "fail": fail,
        "later": later,
        "odd": lambda: object(),
        "big": lambda: "x" * (1 << 17),
        "interrupted": interrupted,
    }
    dispatcher, fast = _fast_server(pair, tools)

    def serve(body: bytes) -> Any:
        assert pair.caller.requests.try_write(codec.REQUEST, 7, body)
        return fast.serve(FAR, FAR)

    # Not a plain call: the request as decoded, for the dispatcher (None: undecodable).
    for request in (
        ["nope", {}, 0],  # no such tool: the dispatcher names the ones there are
        ["later", {}, 0],  # async
        ["echo", {"text": "a"}, 0, "00-" + "1" * 32 + "-" + "2" * 16 + "-01"],  # traced
        ["echo", ["a"], 0],
        [["echo"], {}, 0],
        "echo",
    ):
        assert serve(_pack(request)) == (0, 7, request)
    assert serve(b"\xc1") == (0, 7, None)
    assert dispatcher.start(None)[0] == codec.ERROR
    # The tool raised: the exception; raised by the call itself (the signature) it has no
    # traceback, and the dispatcher answers exactly as its Python path does.
    for request, at_call in (
        (["fail", {}, 0], False),
        (["echo", {"nope": 1}, 0], True),
        (["echo", {1: 2}, 0], True),
        (["echo", {}, 0], True),
    ):
        stage, call_id, exc = serve(_pack(request))
        assert (stage, call_id) == (1, 7)
        assert (exc.__traceback__ is None) == at_call
        kind, body = dispatcher.raised(exc, at_call=at_call)
        python_kind, python_body = dispatcher.start(request)
        # code, type, message: the same (the traceback summary lacks the dispatcher's frame)
        assert (kind, codec.unpack(body)[:3]) == (python_kind, codec.unpack(python_body)[:3])
        assert ("no luck" in codec.unpack(body)[2]) == (not at_call)
    # A result that does not encode, or is over the limit: the result, for finish() to say so.
    for request in (["odd", {}, 0], ["big", {}, 0]):
        stage, call_id, result = serve(_pack(request))
        assert (stage, call_id) == (2, 7)
        assert dispatcher.finish(result) == dispatcher.start(request)
    assert not pair.caller.responses.readable()
    # The caller's ring has no room: the encoded answer, for the backlog.
    while pair.server.responses.try_write(codec.RESULT, 1, b""):
        pass
    assert serve(_pack(["echo", {"text": "b"}, 0])) == (3, 7, _pack("B"))
    # What a tool must not swallow is not swallowed.
    with pytest.raises(KeyboardInterrupt):
        serve(_pack(["interrupted", {}, 0]))


@pytest.mark.unit
@C_ONLY
def test_a_tool_that_closes_its_own_channel_gets_no_write_into_unmapped_memory(
    pair: Pair,
) -> None:
    def hang_up() -> str:
        pair.server.close()  # a stop or a hand-over, from inside the tool
        return "bye"

    _, fast = _fast_server(pair, {"hang_up": hang_up})
    assert pair.caller.requests.try_write(codec.REQUEST, 7, _pack(["hang_up", {}, 0]))
    # The encoded answer comes back unwritten; the serving loop sees the end closed.
    assert fast.serve(FAR, FAR) == (3, 7, _pack("bye"))
    assert pair.server.is_closed


@pytest.mark.unit
def test_a_hostile_caller_that_breaks_the_answer_ring_mid_call_loses_only_its_channel(
    ring_mode: str,
) -> None:
    good, bad = Pair(), Pair()

    def tool(n: int) -> str:
        if n == 1:  # meanwhile the hostile caller moves the server's head off alignment,
            bad.server.responses.hdr[r.HEAD] = CAPACITY - 11  # where the answer needs a wrap
        return "x" * 100

    server, close_server = _blocking_server({"tool": tool})
    try:
        server.core.add(good.server)
        server.core.add(bad.server)
        far = time.perf_counter_ns() + 1_000_000_000

        def serve_one(end: ch.ServerEnd) -> None:
            # What the serving loop runs for a lone caller: C rings spin and serve in one call.
            if ring_mode == "c":
                server._spin_serve_one(end, time.perf_counter_ns() + 2_000_000, far)
            else:
                assert server._serve_one(end)

        assert bad.caller.requests.try_write(codec.REQUEST, 3, _pack(["tool", {"n": 1}, 0]))
        serve_one(bad.server)  # returns: no exception out of the serving loop
        assert bad.server.broken is not None and "not record-aligned" in bad.server.broken
        assert server.core.reap(check_pids=False) == [bad.server]
        assert good.caller.requests.try_write(codec.REQUEST, 4, _pack(["tool", {"n": 2}, 0]))
        serve_one(good.server)
        assert good.caller.responses.try_read(codec.unpack) == (codec.RESULT, 4, "x" * 100)
    finally:
        close_server()
        for p in (good, bad):
            p.caller.close()
            os.close(p.doorbell)


GC_UNCLOSED = """
import gc, os
from dsec_sdk.ipc import channel as ch
for _ in range(50):
    fds = ch.create_channel(4096)
    end = ch.CallerEnd(channel_id=1, peer="b", capacity=4096,
                       fds=[os.dup(fd) for fd in fds.all()]
                       + [ch.new_eventfd(), os.pidfd_open(os.getpid())],
                       max_payload=1 << 20, spin_ns=1000)
    fds.close()
    assert end.requests.try_write(1, 1, b"x" * 100)
    end.me = end  # a cycle: only the collector frees it
    del end
    gc.collect()
print("collected")
"""


@pytest.mark.integration
def test_an_end_nobody_closed_is_freed_by_the_collector_without_a_crash(ring_mode: str) -> None:
    """In a child process: a crash would show as a signal."""
    result = subprocess.run(
        [sys.executable, "-c", GC_UNCLOSED], capture_output=True, text=True, timeout=120
    )
    assert (result.returncode, result.stdout.strip()) == (0, "collected"), result.stderr[-3000:]


@pytest.mark.unit
def test_a_tool_that_closes_its_own_channel_ends_only_that_channel(ring_mode: str) -> None:
    good, gone = Pair(), Pair()

    def hang_up() -> str:
        gone.server.close()  # a stop or a hand-over, from inside the tool
        return "bye"

    server, close_server = _blocking_server({"hang_up": hang_up})
    try:
        server.core.add(gone.server)
        assert gone.caller.requests.try_write(codec.REQUEST, 3, _pack(["hang_up", {}, 0]))
        far = time.perf_counter_ns() + 1_000_000_000
        if ring_mode == "c":
            server._spin_serve_one(gone.server, time.perf_counter_ns() + 2_000_000, far)
        else:
            assert server._serve_one(gone.server)
        assert server.core.channels == []  # no exception, and no longer served
        server.core.add(good.server)
        assert good.caller.requests.try_write(codec.REQUEST, 4, _pack(["nope", {}, 0]))
        assert server._serve_burst()
        assert good.caller.responses.try_read(codec.unpack)[0] == codec.ERROR
    finally:
        close_server()
        for p in (good, gone):
            p.caller.close()
            os.close(p.doorbell)


@pytest.mark.unit
def test_a_caller_whose_ring_never_empties_cannot_keep_the_server_from_its_control_socket(
    ring_mode: str,
) -> None:
    """A hostile caller fills its ring once and moves HEAD far ahead (no CPU of its own): the
    server still reads its control socket (new callers, reaping) and still stops when asked."""
    flood = Pair()
    server, close_server = _blocking_server({"t": lambda: 1})
    body = _pack(["no_such_tool", {}, 0])
    requests = flood.caller.requests
    for pos in range(0, CAPACITY, 32):
        struct.pack_into("<IBBHQ", requests._data, pos, len(body), 1, codec.REQUEST, 0, 1)
        requests._data[pos + 16 : pos + 16 + len(body)] = body
    flood.caller.responses.hdr[r.TAIL] = 2**63  # the server always finds room for answers
    requests.hdr[r.HEAD] = 2**40  # ~10^10 requests "pending"
    polled = threading.Event()
    real_poll = server._poll_control

    def poll() -> bool:
        if server.core.channels:  # a poll while the flood is being served
            polled.set()
        return bool(real_poll())

    server._poll_control = poll  # type: ignore[method-assign]
    server.core.add(flood.server)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert polled.wait(10), "the control socket was never read again"
    finally:
        server.stop()
        thread.join(10)
        alive = thread.is_alive()
        flood.caller.close()
        os.close(flood.doorbell)
        close_server()
    assert not alive, "stop() was not heard"


class _FailingZone(datetime.tzinfo):
    """A time zone whose own code raises ``error`` while a datetime is encoded."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def utcoffset(self, dt: datetime.datetime | None) -> datetime.timedelta:
        raise self.error


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


class _SlyText(str):
    def __getitem__(self, key: object) -> str:
        raise RuntimeError("no slicing")


class _SlyStr(Exception):
    def __str__(self) -> str:
        return _SlyText("sly")


class _SlyBinding(TypeError):
    @property
    def dsec_binding(self) -> bool:
        raise RuntimeError("no binding for you")


class _Nameless(type):
    @property
    def __name__(cls) -> str:  # type: ignore[override]
        raise RuntimeError("no name")


class _NamelessError(Exception, metaclass=_Nameless):
    pass


async def _cancels_its_own_helper() -> None:
    helper = asyncio.ensure_future(asyncio.sleep(10))
    helper.cancel()
    await helper


def _raise(exc: Exception) -> None:
    raise exc


def _when(error: Exception) -> datetime.datetime:
    """A result whose encoding raises ``error`` from the result's own code."""
    return datetime.datetime(2026, 1, 1, tzinfo=_FailingZone(error))


@pytest.mark.unit
def test_a_tool_whose_error_or_result_cannot_be_told_gets_an_error_answer_and_serving_goes_on(
    ring_mode: str,
) -> None:
    """A tool's result whose encoding runs its own failing code, an exception whose ``__str__``
    raises, a message UTF-8 cannot carry: each is the tool's error, answered as one; none may
    escape the serving loop (which would end every caller's channel with it)."""
    p = Pair()
    tools = {
        "zone": lambda: _when(LookupError("no such zone")),
        "mute": lambda: _raise(_Unprintable()),
        "surrogate": lambda: _raise(ValueError("bad \ud800 text")),
        "surrogate_result": lambda: "bad \udfff text",
        "sly_str": lambda: _raise(_SlyStr()),
        "sly_binding": lambda: _raise(_SlyBinding()),
        "nameless": lambda: _raise(_NamelessError()),
        "nameless_result": lambda: _when(_NamelessError()),
        "cancelled": _cancels_its_own_helper,
        "echo": _echo,
    }
    server, close_server = _blocking_server(tools)
    try:
        server.core.add(p.server)
        far = time.perf_counter_ns() + 1_000_000_000

        def call(call_id: int, tool: str, arguments: dict[str, Any]) -> Any:
            assert p.caller.requests.try_write(codec.REQUEST, call_id, _pack([tool, arguments, 0]))
            if ring_mode == "c":
                server._spin_serve_one(p.server, time.perf_counter_ns() + 2_000_000, far)
            else:
                assert server._serve_one(p.server)
            frame = p.caller.responses.try_read(codec.unpack)
            assert frame is not None and frame[1] == call_id
            return frame[0], frame[2]

        kind, body = call(1, "zone", {})
        assert kind == codec.ERROR and body[:2] == ["bad_result", "LookupError"]
        assert "cannot be sent as MessagePack: no such zone" in body[2]
        kind, body = call(2, "mute", {})
        assert kind == codec.ERROR and body[:2] == ["remote", "_Unprintable"]
        assert "str() raised RuntimeError" in body[2]
        kind, body = call(3, "surrogate", {})
        assert kind == codec.ERROR and body[:3] == ["remote", "ValueError", "bad \\ud800 text"]
        kind, body = call(4, "surrogate_result", {})
        assert kind == codec.ERROR and body[:2] == ["bad_result", "UnicodeEncodeError"]
        # Hostile exception code: a str subclass that cannot be sliced, a property that
        # raises, a type whose name raises; and an async tool's own CancelledError (a helper
        # task it cancelled and then awaited).
        assert call(6, "sly_str", {}) == (codec.ERROR, ["remote", "_SlyStr", "sly", ANY])
        kind, body = call(7, "sly_binding", {})
        assert kind == codec.ERROR and body[0] == "remote"
        kind, body = call(8, "nameless", {})
        assert kind == codec.ERROR and body[:2] == ["remote", "<unnamed type>"]
        kind, body = call(9, "nameless_result", {})
        assert kind == codec.ERROR and body[:2] == ["bad_result", "<unnamed type>"]
        kind, body = call(10, "cancelled", {})
        assert kind == codec.ERROR and body[:2] == ["remote", "CancelledError"]
        assert call(11, "echo", {"text": "still here"}) == (codec.RESULT, "STILL HERE")
        assert server.core.channels == [p.server]
    finally:
        close_server()
        p.caller.close()
        os.close(p.doorbell)
