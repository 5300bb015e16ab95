"""Agent-to-agent tool calls: DSec shared memory beside NATS request-reply and HTTP keep-alive.

    uv run python bench/ipc.py [--quick] [--json]

One run, the same tool call over three transports, each side in its own process:

* ``dsec_shm``: ``DSecClient.call_tool`` -> memfd ring -> ``DSecClient.serve`` (broker-created
  channel, spin-then-block waiting, MessagePack frames), with the SDK's C hot path (each end's
  common case one C call: ``FastCaller``, ``FastServer``); the same call with
  ``DSEC_IPC_PURE_PYTHON=1`` (where the extension could not be built) is reported beside it as
  ``pure_python``;
* ``nats_request_reply``: nats-py ``request()`` against a real nats-server, a nats-py responder;
* ``http_keepalive``: stdlib ``http.client`` on one keep-alive connection to an aiohttp server.

Beside them, ``shm_floor``: the same channel and the same request/response bytes between two
processes, both ends spinning as DSec's do, with no codec, no dispatch and no client API (the
ring's C calls driven from a bare loop) — what a call costs before DSec adds anything, so the
remaining overhead (``dsec_shm`` minus the floor) is visible.

Every transport carries the same MessagePack body, encoded and decoded with the same codec
(msgspec): a ``web_search`` call of ~200 bytes with a ~200-byte answer, and a ``fetch`` call
answered with 64 KB. Latency = one call, client side.

Scaling (DSec only) runs 10, 50 and 100 pairs (2 processes each) on this machine's cores, two ways:

* ``turns``: the pairs take turns (a token passes from client to client); each turn is a burst of
  calls. All other agents are blocked in ``poll()`` on their eventfd, costing no CPU.
* ``duty_cycle``: every pair runs at once; each client makes a burst of calls, then "thinks"
  (sleeps ~1 s, as an agent waiting for its LLM), repeated. Pairs overlap at random.

``first_call``: a new client's first call to a peer (DSec: the broker connection's hello, the
connect, both ends mapping the channel, the call), beside HTTP's first call on a new TCP
connection to the same aiohttp server.

The first call of a burst finds its server asleep and pays an eventfd wake-up (~70 µs here); the
rest of the burst runs spinning. Both are in the percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import multiprocessing as mp
import os
import random
import socket
import tempfile
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import msgspec
from _common import emit, free_port, nats_server, percentile

# Imported here, before forking, so 200 agent processes do not each pay for the import.
from dsec_sdk import AgentNotFound, DSecClient
from dsec_sdk.ipc import ring

pack = msgspec.msgpack.Encoder().encode
unpack = msgspec.msgpack.Decoder().decode

GROUP = "bench"
QUERY = "site:kernel.org memfd_create sealing " + "q" * 130  # a ~200-byte request
ANSWER = {
    "results": [
        {"title": "memfd_create(2)", "url": "https://man7.org/" + "a" * 60, "snippet": "s" * 80}
    ]
}  # a ~200-byte response
BIG = 64 * 1024
BURST = 50
THINK_S = 1.0

ctx = mp.get_context("fork")


async def _connect(url: str) -> Any:
    """Through dsec_core.natsclient like every DSec client (credentials/TLS from DSEC_NATS_*)."""
    from dsec_core import natsclient
    from dsec_core.settings import Settings

    return await natsclient.connect(Settings(nats_url=url), "dsec-bench")


def web_search(query: str) -> dict[str, Any]:
    return ANSWER


_BLOB = os.urandom(BIG)


def fetch(size: int) -> bytes:
    return _BLOB[:size]


TOOLS: dict[str, Callable[..., Any]] = {"web_search": web_search, "fetch": fetch}
CALLS: dict[str, dict[str, Any]] = {"small": {"query": QUERY}, "64k": {"size": BIG}}
TOOL_OF = {"small": "web_search", "64k": "fetch"}


def stats(samples_ns: list[int]) -> dict[str, float]:
    us = [s / 1000 for s in samples_ns]
    return {
        "p50_us": round(percentile(us, 0.5), 2),
        "p99_us": round(percentile(us, 0.99), 2),
        "calls": len(us),
    }


# ---------------------------------------------------------------------------- the shm floor
# The same channel (memfd rings, C hot path) between two processes on two cores, both ends
# spinning as the real ones do (a sched_yield every 5 us of pure spinning), carrying the same
# 200-byte request and response bytes, with no codec, no dispatch and no client API: what is
# left of a call once everything DSec adds on top of the rings is gone.
FLOOR_REQUEST = pack(["web_search", {"query": QUERY}, 5000])
FLOOR_RESPONSE = pack(ANSWER)
FLOOR_FAR = 1 << 62


def _floor_ends(fds: Any, parent_pidfd: int) -> tuple[Any, Any]:
    from dsec_sdk.ipc.channel import CallerEnd, ServerEnd

    return (
        lambda server_wake: CallerEnd(
            channel_id=1,
            peer="floor-server",
            capacity=1 << 18,
            fds=[
                os.dup(fds.memfd),
                os.dup(fds.request_overflow),
                os.dup(fds.response_overflow),
                os.dup(fds.caller_wake),
                os.dup(server_wake),
                os.dup(parent_pidfd),
            ],
            max_payload=64 << 20,
            spin_ns=50_000,
        ),
        lambda server_wake: ServerEnd(
            channel_id=1,
            peer="floor-caller",
            capacity=1 << 18,
            fds=[
                os.dup(fds.memfd),
                os.dup(fds.request_overflow),
                os.dup(fds.response_overflow),
                os.dup(fds.caller_wake),
                os.dup(parent_pidfd),
            ],
            doorbell=os.dup(server_wake),
            max_payload=64 << 20,
        ),
    )


def _own_core(index: int) -> None:
    """The floor's two ends on two different cores (when there are two): a floor, not the
    luck of the scheduler's placement (DSec's ends move apart themselves, see CoreMover)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.sched_setaffinity(0, {cpus[index]})


def floor_server(fds: Any, server_wake: int, parent_pidfd: int) -> None:
    _own_core(0)
    end = _floor_ends(fds, parent_pidfd)[1](server_wake)
    spin_read = end.requests.fast.spin_read
    write = end.responses.fast.try_write
    clock = time.perf_counter_ns
    response = FLOOR_RESPONSE
    while True:
        frame = spin_read(FLOOR_FAR, clock() + 5_000, len)
        if frame.__class__ is tuple:
            write(2, frame[1], response)
        else:
            os.sched_yield()


def floor_client(
    fds: Any, server_wake: int, parent_pidfd: int, calls: int, out: Connection
) -> None:
    _own_core(1)
    end = _floor_ends(fds, parent_pidfd)[0](server_wake)
    call = end.requests.fast.call
    write = end.requests.try_write
    responses = end.responses.fast
    clock = time.perf_counter_ns
    request = FLOOR_REQUEST
    samples = []
    for i in range(2000 + calls):
        start = clock()
        while True:
            outcome = call(responses, 1, i, request, len, FLOOR_FAR, 5_000, FLOOR_FAR)
            if outcome.__class__ is tuple:
                break
            if outcome == -1:  # the record would cross the ring's end: ring.py writes the WRAP
                if not write(1, i, request) and not end.send(1, i, request, FLOOR_FAR):
                    raise RuntimeError("the floor's ring stayed full")
            else:
                os.sched_yield()  # sent; spin again for the answer
            outcome = responses.spin_read(FLOOR_FAR, clock() + 5_000, len)
            if outcome.__class__ is tuple:
                break
        samples.append(clock() - start)
    out.send(samples[2000:])


def bench_floor(calls: int) -> dict[str, float] | None:
    """Round trips over the bare rings (see ``floor_server``); None without the C path."""
    from dsec_sdk.ipc.channel import create_channel, new_eventfd

    if not ring.accelerated():
        return None
    fds = create_channel()
    server_wake = new_eventfd()
    parent = os.pidfd_open(os.getpid())
    for fd in (*fds.all(), server_wake, parent):
        os.set_inheritable(fd, True)
    server = ctx.Process(target=floor_server, args=(fds, server_wake, parent), daemon=True)
    server.start()
    mine, theirs = ctx.Pipe(duplex=False)
    client = ctx.Process(
        target=floor_client, args=(fds, server_wake, parent, calls, theirs), daemon=True
    )
    client.start()
    try:
        return stats(mine.recv())
    finally:
        for proc in (client, server):
            proc.kill()
            proc.join()
        fds.close()
        os.close(server_wake)
        os.close(parent)


# ---------------------------------------------------------------------------- DSec shared memory
def run_broker(path: str, ready: Any) -> None:
    from dsec_nodeagent.ipc import Broker

    async def main() -> None:
        broker = Broker(path)
        await broker.start()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def shm_server(path: str, name: str) -> None:
    client = DSecClient(name, GROUP, socket_path=path)
    client.serve(TOOLS)


def _shm_client(path: str, me: str, peer: str) -> DSecClient:
    client = DSecClient(me, GROUP, socket_path=path)
    deadline = time.monotonic() + 60
    while True:
        try:
            client.call_tool(peer, "web_search", query="warm-up")
            return client
        except AgentNotFound:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def shm_latency(path: str, peer: str, kind: str, calls: int, out: Connection) -> None:
    client = _shm_client(path, f"c-{peer}", peer)
    tool, args = TOOL_OF[kind], CALLS[kind]
    call = client.call_tool
    clock = time.perf_counter_ns
    for _ in range(min(2000, calls)):
        call(peer, tool, **args)
    samples = []
    # Called as a user writes it (the README's ``call_tool("b", "web_search", query=...)``):
    # keywords, not a ``**`` mapping unpacked at each call (that costs ~0.1 µs more).
    if kind == "small":
        for _ in range(calls):
            start = clock()
            call(peer, "web_search", query=QUERY)
            samples.append(clock() - start)
    else:
        for _ in range(calls):
            start = clock()
            call(peer, "fetch", size=BIG)
            samples.append(clock() - start)
    out.send(samples)


def shm_first_calls(path: str, peer: str, n: int, out: Connection) -> None:
    """``n`` times: a new client's first call to ``peer`` (the broker connection's hello, the
    channel's connect, both ends mapping it, the call), then the client closed."""
    _shm_client(path, "c-first-warm", peer).close()  # (the server is up and warm)
    clock = time.perf_counter_ns
    samples = []
    for i in range(n):
        client = DSecClient(f"c-first-{i}", GROUP, socket_path=path)
        start = clock()
        client.call_tool(peer, "web_search", query=QUERY)
        samples.append(clock() - start)
        client.close()
    out.send(samples)


def shm_turns(
    path: str, index: int, pairs: int, rounds: int, tokens: list[int], done: int, out: Connection
) -> None:
    peer = f"s{index}"
    client = _shm_client(path, f"c{index}", peer)
    call = client.call_tool
    clock = time.perf_counter_ns
    out.send("ready")
    samples = []
    for turn in range(rounds):
        os.eventfd_read(tokens[index])
        for _ in range(BURST):
            start = clock()
            call(peer, "web_search", query=QUERY)
            samples.append(clock() - start)
        last = index == pairs - 1 and turn == rounds - 1
        os.eventfd_write(done if last else tokens[(index + 1) % pairs], 1)
    out.send(samples)


def shm_duty(path: str, index: int, bursts: int, go: Any, out: Connection) -> None:
    peer = f"s{index}"
    client = _shm_client(path, f"c{index}", peer)
    call = client.call_tool
    clock = time.perf_counter_ns
    rng = random.Random(index)
    out.send("ready")
    go.wait()
    time.sleep(rng.uniform(0, THINK_S))
    samples = []
    for _ in range(bursts):
        for _ in range(BURST):
            start = clock()
            call(peer, "web_search", query=QUERY)
            samples.append(clock() - start)
        time.sleep(rng.uniform(0.5, 1.5) * THINK_S)
    out.send(samples)


class ShmBench:
    """A broker process plus helpers to start server and client processes."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="dsec-bench-ipc-")
        self.path = str(Path(self.dir) / "ipc.sock")
        ready = ctx.Event()
        self.broker = ctx.Process(target=run_broker, args=(self.path, ready), daemon=True)
        self.broker.start()
        if not ready.wait(30):
            raise RuntimeError("broker did not start")
        self.procs: list[Any] = []

    def server(self, name: str) -> None:
        proc = ctx.Process(target=shm_server, args=(self.path, name), daemon=True)
        proc.start()
        self.procs.append(proc)

    def spawn(self, target: Callable[..., None], *args: Any) -> Connection:
        mine, theirs = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(*args, theirs), daemon=True)
        proc.start()
        self.procs.append(proc)
        return mine

    def stop_agents(self) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.join()
        self.procs.clear()

    def close(self) -> None:
        self.stop_agents()
        self.broker.kill()
        self.broker.join()
        for leftover in Path(self.dir).glob("*"):
            leftover.unlink()
        os.rmdir(self.dir)


def bench_shm(shm: ShmBench, kind: str, calls: int) -> dict[str, float]:
    shm.server("one")
    result = shm.spawn(shm_latency, shm.path, "one", kind, calls).recv()
    shm.stop_agents()
    return stats(result)


def bench_first_calls(shm: ShmBench, n: int) -> dict[str, float]:
    shm.server("first")
    result = shm.spawn(shm_first_calls, shm.path, "first", n).recv()
    shm.stop_agents()
    return stats(result)


def bench_turns(shm: ShmBench, pairs: int, rounds: int) -> dict[str, float]:
    tokens = [os.eventfd(0) for _ in range(pairs)]
    done = os.eventfd(0)
    try:
        for i in range(pairs):
            shm.server(f"s{i}")
        conns = [
            shm.spawn(shm_turns, shm.path, i, pairs, rounds, tokens, done) for i in range(pairs)
        ]
        for conn in conns:
            conn.recv()
        os.eventfd_write(tokens[0], 1)
        os.eventfd_read(done)
        samples = [s for conn in conns for s in conn.recv()]
    finally:
        shm.stop_agents()
        for fd in (*tokens, done):
            os.close(fd)
    return stats(samples)


def bench_duty(shm: ShmBench, pairs: int, bursts: int) -> dict[str, float]:
    try:
        for i in range(pairs):
            shm.server(f"s{i}")
        go = ctx.Event()
        conns = [shm.spawn(shm_duty, shm.path, i, bursts, go) for i in range(pairs)]
        for conn in conns:
            conn.recv()
        time.sleep(0.2)  # let the servers finish their spin and go to sleep, as idle agents do
        go.set()
        samples = [s for conn in conns for s in conn.recv()]
    finally:
        shm.stop_agents()
    return stats(samples)


# ---------------------------------------------------------------------------- NATS
def nats_responder(url: str, ready: Any) -> None:

    async def main() -> None:
        nc = await _connect(url)

        async def on_call(msg: Any) -> None:
            tool, args, _ = unpack(msg.data)
            await msg.respond(pack(TOOLS[tool](**args)))

        await nc.subscribe("bench.tools", cb=on_call)
        await nc.flush()
        ready.set()
        await asyncio.Event().wait()

    asyncio.run(main())


def nats_latency(url: str, kind: str, calls: int, out: Connection) -> None:

    async def main() -> list[int]:
        nc = await _connect(url)
        body = pack([TOOL_OF[kind], CALLS[kind], 5000])
        clock = time.perf_counter_ns
        for _ in range(min(500, calls)):
            await nc.request("bench.tools", body, timeout=5)
        samples = []
        for _ in range(calls):
            start = clock()
            msg = await nc.request("bench.tools", body, timeout=5)
            unpack(msg.data)
            samples.append(clock() - start)
        await nc.close()
        return samples

    out.send(asyncio.run(main()))


def bench_nats(calls: dict[str, int]) -> dict[str, dict[str, float]]:
    results = {}
    with nats_server() as url:
        ready = ctx.Event()
        responder = ctx.Process(target=nats_responder, args=(url, ready), daemon=True)
        responder.start()
        try:
            if not ready.wait(30):
                raise RuntimeError("NATS responder did not start")
            for kind, n in calls.items():
                mine, theirs = ctx.Pipe(duplex=False)
                proc = ctx.Process(target=nats_latency, args=(url, kind, n, theirs))
                proc.start()
                results[kind] = stats(mine.recv())
                proc.join()
        finally:
            responder.kill()
            responder.join()
    return results


# ---------------------------------------------------------------------------- HTTP keep-alive
def http_server(port: int) -> None:
    from aiohttp import web

    async def call(request: web.Request) -> web.Response:
        tool, args, _ = unpack(await request.read())
        return web.Response(body=pack(TOOLS[tool](**args)), content_type="application/msgpack")

    app = web.Application()
    app.router.add_post("/call", call)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None, handle_signals=False)


def _http_connected(port: int) -> http.client.HTTPConnection:
    """A connection to the server on ``port``, once it listens."""
    deadline = time.monotonic() + 30
    while True:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port)
            conn.connect()
            return conn
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def http_latency(port: int, kind: str, calls: int, out: Connection) -> None:
    conn = _http_connected(port)
    assert conn.sock is not None
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = pack([TOOL_OF[kind], CALLS[kind], 5000])
    headers = {"Content-Type": "application/msgpack"}
    clock = time.perf_counter_ns

    def one() -> None:
        conn.request("POST", "/call", body, headers)
        response = conn.getresponse()
        unpack(response.read())

    for _ in range(min(500, calls)):
        one()
    samples = []
    for _ in range(calls):
        start = clock()
        one()
        samples.append(clock() - start)
    conn.close()
    out.send(samples)


def http_first_calls(port: int, n: int, out: Connection) -> None:
    """``n`` times: a new connection's first call (TCP connect, the request, the answer)."""
    body = pack([TOOL_OF["small"], CALLS["small"], 5000])
    headers = {"Content-Type": "application/msgpack"}
    warm = _http_connected(port)  # (the server is up and has answered once)
    warm.request("POST", "/call", body, headers)
    unpack(warm.getresponse().read())
    warm.close()
    clock = time.perf_counter_ns
    samples = []
    for _ in range(n):
        start = clock()
        conn = http.client.HTTPConnection("127.0.0.1", port)
        conn.request("POST", "/call", body, headers)
        unpack(conn.getresponse().read())
        samples.append(clock() - start)
        conn.close()
    out.send(samples)


def bench_http(calls: dict[str, int], first: int = 0) -> dict[str, dict[str, float]]:
    """Keep-alive latency per kind; with ``first``, also that many new connections' first
    calls (``results["first"]``), after the latency runs (the server is up and warm)."""
    port = free_port()
    server = ctx.Process(target=http_server, args=(port,), daemon=True)
    server.start()
    results = {}
    try:
        for kind, n in calls.items():
            mine, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=http_latency, args=(port, kind, n, theirs))
            proc.start()
            results[kind] = stats(mine.recv())
            proc.join()
        if first:
            mine, theirs = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=http_first_calls, args=(port, first, theirs))
            proc.start()
            results["first"] = stats(mine.recv())
            proc.join()
    finally:
        server.kill()
        server.join()
    return results


# ---------------------------------------------------------------------------- main
PAIRS = (10, 50, 100)
FIRST_CALLS = 300  # new clients' first calls (dsec_shm, http)
DEV_SECTIONS = frozenset({"floor", "one", "first", "turns", "duty"})  # --only (development)


def dev_run(only: set[str], small: int, rounds: int, bursts: int) -> None:
    """Run some sections and print them (no result file): for development."""
    shm = ShmBench()
    try:
        if "floor" in only:
            print("shm floor 200 B", bench_floor(small), flush=True)
        if "one" in only:
            print("dsec_shm 200 B", bench_shm(shm, "small", small), flush=True)
            print("dsec_shm 64 KB", bench_shm(shm, "64k", small // 5), flush=True)
        if "first" in only:
            print("dsec_shm first call", bench_first_calls(shm, FIRST_CALLS), flush=True)
            print("http first call", bench_http({}, FIRST_CALLS)["first"], flush=True)
        for pairs in PAIRS if "turns" in only else ():
            print(f"turns {pairs}", bench_turns(shm, pairs, rounds), flush=True)
        for pairs in PAIRS if "duty" in only else ():
            print(f"duty {pairs}", bench_duty(shm, pairs, bursts), flush=True)
    finally:
        shm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (for development)")
    parser.add_argument("--json", action="store_true", help="print only the ratio and JSON lines")
    parser.add_argument("--only", default="", help=argparse.SUPPRESS)  # dev: e.g. "duty"
    args = parser.parse_args()
    quiet = args.json

    def say(text: str) -> None:
        if not quiet:
            print(text, flush=True)

    small, big = (5_000, 1_000) if args.quick else (50_000, 5_000)
    peer_small, peer_big = (2_000, 500) if args.quick else (10_000, 2_000)
    rounds, bursts = (2, 2) if args.quick else (6, 5)
    load_before = os.getloadavg()[0]

    only = set(filter(None, args.only.split(",")))
    unknown = only - DEV_SECTIONS
    if unknown:
        parser.error(f"--only: unknown {sorted(unknown)}; use any of {sorted(DEV_SECTIONS)}")
    if only:
        dev_run(only, small, rounds, bursts)
        return
    shm = ShmBench()
    try:
        results: dict[str, dict[str, Any]] = {}
        if not ring.accelerated():
            say("warning: the SDK's C extension is not built; dsec_shm runs ring.py alone")
        accelerated = ring.accelerated()
        floor = bench_floor(small)
        say(f"shm floor           200 B: {floor}")
        dsec = {"small": bench_shm(shm, "small", small), "64k": bench_shm(shm, "64k", big)}
        os.environ["DSEC_IPC_PURE_PYTHON"] = "1"  # read when the forked agents open channels
        try:
            pure = bench_shm(shm, "small", small // 2)
        finally:
            os.environ.pop("DSEC_IPC_PURE_PYTHON")
        results["dsec_shm"] = {
            **dsec["small"],
            "64k": dsec["64k"],
            "accelerated": accelerated,
            "pure_python": pure,
        }
        results["shm_floor"] = {
            **(floor or {}),
            "what": "the same rings and bytes, both ends spinning, no codec, no dispatch, "
            "no client API (needs the C path)",
        }
        say(f"dsec_shm            200 B: {dsec['small']}   64 KB: {dsec['64k']}")
        say(f"dsec_shm (ring.py)  200 B: {pure}")
        nats_r = bench_nats({"small": peer_small, "64k": peer_big})
        results["nats_request_reply"] = {**nats_r["small"], "64k": nats_r["64k"]}
        say(f"nats_request_reply  200 B: {nats_r['small']}   64 KB: {nats_r['64k']}")
        first_calls = FIRST_CALLS // 5 if args.quick else FIRST_CALLS
        http_r = bench_http({"small": peer_small, "64k": peer_big}, first_calls)
        results["http_keepalive"] = {**http_r["small"], "64k": http_r["64k"]}
        say(f"http_keepalive      200 B: {http_r['small']}   64 KB: {http_r['64k']}")
        dsec_first = bench_first_calls(shm, first_calls)
        results["first_call"] = {
            "dsec_shm": dsec_first,
            "http_new_connection": http_r["first"],
            "what": "a new client's first call, 200 B: DSec's broker hello, connect, both ends "
            "mapping the channel and the call; HTTP's TCP connect, request and answer",
        }
        say(f"first call (new client) dsec_shm: {dsec_first}   HTTP: {http_r['first']}")

        scaling: dict[str, Any] = {"turns": {}, "duty_cycle": {}}
        for pairs in PAIRS:
            scaling["turns"][str(pairs)] = bench_turns(shm, pairs, rounds)
            say(f"turns       {pairs:3d} pairs: {scaling['turns'][str(pairs)]}")
        for pairs in PAIRS:
            scaling["duty_cycle"][str(pairs)] = bench_duty(shm, pairs, bursts)
            say(f"duty_cycle  {pairs:3d} pairs: {scaling['duty_cycle'][str(pairs)]}")
    finally:
        shm.close()

    for mode in ("turns", "duty_cycle"):
        table = scaling[mode]
        table["p50_100_over_10"] = round(table["100"]["p50_us"] / table["10"]["p50_us"], 2)
    scaling["method"] = (
        f"turns: pairs take turns, {BURST} calls per turn, {rounds} rounds; duty_cycle: all pairs "
        f"at once, bursts of {BURST} calls then ~{THINK_S * 1000:.0f} ms think time, {bursts} "
        "bursts each; every agent spins briefly (<=50 us caller, <=100 us server) then blocks"
    )
    d50 = results["dsec_shm"]["p50_us"]
    n50 = results["nats_request_reply"]["p50_us"]
    h50 = results["http_keepalive"]["p50_us"]
    f50 = results["shm_floor"].get("p50_us")
    first = results["first_call"]
    results["dsec_shm"]["target"] = "p50 <= 2.4 us, p99 <= 10 us, >= 40x NATS"
    results["dsec_shm"]["over_nats"] = round(n50 / d50, 1)
    floor_text = f", shm floor {f50:.2f} us" if f50 else ""
    ratio = (
        f"ipc: dsec_shm p50 {d50:.2f} us (p99 {results['dsec_shm']['p99_us']:.1f}{floor_text}) is "
        f"{n50 / d50:.0f}x faster than NATS request-reply ({n50:.0f} us) and {h50 / d50:.0f}x "
        f"faster than HTTP keep-alive ({h50:.0f} us); 100 vs 10 pairs p50: "
        f"{scaling['turns']['p50_100_over_10']}x (turns), "
        f"{scaling['duty_cycle']['p50_100_over_10']}x (duty cycle); a new client's first call "
        f"p50 {first['dsec_shm']['p50_us']:.0f} us (HTTP, a new connection: "
        f"{first['http_new_connection']['p50_us']:.0f} us)"
    )
    emit(
        "ipc",
        results,
        ratio,
        scaling=scaling,
        load_average={"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        quick=args.quick,
    )


if __name__ == "__main__":
    main()
