"""The state keeper (docs/state.md). Its interface is a CONTRACT: the signatures of
:class:`StateKeeper` and :class:`StateSession` are what the node agent, the broker and the
hand-over use (additions only).

One :class:`StateKeeper` per node agent. It serves each agent's state socket (handed to the
sandbox by the IPC broker), journals hot deltas in node-local shared memory (tmpfs), publishes
them durably (JetStream stream ``DSEC_STATE``, encrypted, chunked), merges warm state on the
node's disk (and copies it to the object store for recovery on another node), keeps cold state
in the object store content-addressed (BLAKE3), and publishes ``state.checkpointed`` and
``state.recovered``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import os
import shutil
import socket
import struct
import time
import weakref
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import blake3
import msgpack
import zstandard
from dsec_core import events, natsclient, objectstore, retention
from dsec_core.layout import NodeLayout
from dsec_core.settings import Settings
from dsec_core.spec.plan import StatePlan
from dsec_core.subjects import STATE_ROOT, STATE_STREAM
from dsec_sdk.ipc.control import check_name
from dsec_sdk.state import msgcount, wire
from nats.js.errors import NotFoundError
from prometheus_client import Counter, Gauge, Histogram

from dsec_nodeagent import leftovers, privdir
from dsec_nodeagent.state import merge
from dsec_nodeagent.state.budget import FrameBudget
from dsec_nodeagent.state.merge import split_large
from dsec_nodeagent.state.sealing import (
    NONCE,
    TAG,
    KeyUnavailable,
    SealError,
    TenantKeys,
    open_sealed,
    seal,
)

log = logging.getLogger(__name__)

CHECKPOINTS = Counter(
    "dsec_state_checkpoints_total", "Agents' state checkpoints made durable, by tier", ["tier"]
)
DURABLE = Histogram(
    "dsec_state_durable_seconds",
    "From a checkpoint's receipt to its ack (journaled and every chunk acked by JetStream)",
    buckets=(0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0),
)
RECOVERIES = Counter(
    "dsec_state_recoveries_total", "States given back to agents, by source", ["source"]
)
IN_FLIGHT = Gauge(
    "dsec_state_frame_bytes_in_flight",
    "Bytes of agents' state frames read and not yet served (bounded node-wide and per sandbox)",
)
REFUSED = Counter(
    "dsec_state_errors_total", "Error frames sent to agents, by code (a fixed set)", ["code"]
)

CHUNK: Final = 512 << 10
"""Largest JetStream message of a checkpoint (sealed)."""
CHUNK_PLAIN: Final = CHUNK - NONCE - TAG
JOURNAL_WARM_BYTES: Final = 64 << 20
"""A journal this large is merged into a warm snapshot at once."""
RECORDS_FRAME_BYTES: Final = 8 << 20
HELLO_TIMEOUT_S: Final = 10.0
REPORT_INTERVAL_S: Final = 1.0
"""An agent's hot and cold checkpoints are reported (``state.checkpointed``) at most once per
this interval: the first at once, those that follow within it in one event when it ends, naming
the newest seq and how many checkpoints it stands for. An agent checkpointing in a loop (one
every millisecond or two) cannot flood the event log its neighbours share. The clock is the
agent's (its name in its group and tenant), not the connection's: reconnecting does not start
it again. ``state.recovered`` (one per fetch) is held to the same rate: a fetch within the
interval of the last one reported is not reported (``dsec_state_recoveries_total`` counts
it)."""
REPORT_STOP_S: Final = 5.0
"""How long the keeper's stop waits for the reports held back to go out."""
REPORT_CLOCKS: Final = 65_536
"""Agents (and what of them) whose last report time the keeper remembers."""
SEQ_HEADER: Final = "Dsec-State-Seq"
CLOSE_TIMEOUT_S: Final = 5.0  # an ended session's last frames, to an agent that reads them
# Opening a state reads it whole on the loop every sandbox shares (the hello's sync, then the
# one fetch a session may make): an open that cost the node agent T seconds of CPU makes the
# next open of that state wait READ_SHARE x T (at most READ_WAIT_MAX_S, under the SDK's 60 s):
# an agent reconnecting and fetching in a loop takes at most a fifth of it (a 24 MiB state
# fetched in a loop held the loop 1.2-1.6 s a fetch).
READ_SHARE: Final = 4.0
READ_WAIT_MAX_S: Final = 30.0
# A frame is decoded on the loop every sandbox shares, at a cost in its number of MessagePack
# objects, not its bytes: counted first (off the loop when large), one of more than
# msgcount.MAX_FRAME_OBJECTS is refused unread (64 MiB of one-byte empty arrays was 64 million
# lists: ~4.6 GiB and ~20 s of the loop). A frame whose decoding held the loop T (from
# DECODE_PACED_FROM_S) makes that sandbox's next frame wait FRAME_SHARE x T: one sandbox
# decodes at most a third of the time.
FRAME_SHARE: Final = 2.0
DECODE_PACED_FROM_S: Final = 0.002
COUNT_OFF_LOOP_BYTES: Final = 64 << 10
# The bytes of frames in flight (read, not yet served) on the node, and of one sandbox (one
# largest frame): see budget.py. A frame's body must come within BODY_TIMEOUT_S of its length
# (a sandbox on the node writes 64 MiB in milliseconds), or the session ends.
FRAMES_IN_FLIGHT_BYTES: Final = 4 * wire.MAX_FRAME
BODY_TIMEOUT_S: Final = 10.0
# What a session's reader buffers ahead of the frame being read (asyncio's StreamReader pauses
# the socket at twice this; a read of a larger frame resumes it): it buffered up to 128 MiB a
# session, whatever the budget.
READ_AHEAD_BYTES: Final = 256 << 10
CHUNK_HEADER: Final = "Dsec-Chunk"
WARM_HEADER: Final = "Dsec-Warm"
DIGEST_HEADER: Final = "Dsec-Digest"
SANDBOX_HEADER: Final = "Dsec-Sandbox"
CARRY_MAX: Final = 768 << 10
"""Most bytes of later checkpoints a warm snapshot's rollup marker carries."""


@dataclass(frozen=True)
class StateKey:
    """Whose state: an agent of a task group of a tenant (the same for every version and every
    restart of that agent, on any node)."""

    tenant: str
    group: str
    agent: str

    @property
    def subject_tokens(self) -> str:
        """``<tenant>.<group>.<agent>`` (each a NATS-safe name)."""
        return f"{self.tenant}.{self.group}.{self.agent}"


@dataclass(frozen=True)
class SandboxState:
    """What the node agent tells the keeper about a sandbox it starts."""

    sandbox_id: str
    tenant: str
    group: str
    agent: str
    plan: StatePlan | None
    handover_from: str | None = None  # a hand-over: the running sandbox it takes over from
    cgroup_dir: str | None = None  # for the freezer (hand-over)


class StateError(Exception):
    """A refusal or failure told to the agent as an ``error`` frame (``code``: a short word)."""

    def __init__(
        self, code: str, message: str, seq: int | None = None, expected: int | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.seq = seq
        self.expected = expected  # (bad-seq: the seq the next checkpoint must have)


@dataclass
class _Entry:
    """One checkpoint of the journal."""

    seq: int
    records: list[dict[str, Any]]
    size: int


# array container -> (dtype, shape, bytes), as its checkpoints declared it
_Arrays = dict[str, tuple[str, tuple[int, ...], int]]


@dataclass(eq=False)
class _Agent:
    """Where one agent's state lives on this node and in the shared plane."""

    key: StateKey
    state_id: str
    journal_dir: Path
    warm_dir: Path
    subject: str
    prefix: str  # object store keys: <prefix>warm/<seq>, <prefix>cold/<blake3>
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    warming: asyncio.Lock = field(default_factory=asyncio.Lock)
    seq: int = 0  # last durable checkpoint
    synced: bool = False
    journal_bytes: int = 0
    warm_bytes: int | None = None  # size of the newest local warm snapshot (None: not read yet)
    writer: str | None = None  # the sandbox whose checkpoint is the newest, when known
    # Each array container's size as declared (shape x itemsize) by the checkpoints this node
    # took: what a merge allocates, whatever the records compress to.
    arrays: _Arrays = field(default_factory=dict)
    arrays_known: bool = False  # (False: the state held before, on this node, not counted yet)
    # Reading the whole state (a fetch, a hello's sync) runs on the loop every sandbox shares:
    # the next read of this state waits until then (see _paced).
    next_read: float = 0.0

    @property
    def journal(self) -> Path:
        return self.journal_dir / "journal.bin"

    def warm_path(self, seq: int) -> Path:
        return self.warm_dir / f"warm-{seq}.bin"

    def warm_seqs(self) -> list[int]:
        """Local warm snapshots, oldest first."""
        found = []
        for path in self.warm_dir.glob("warm-*.bin"):
            number = path.name.removeprefix("warm-").removesuffix(".bin")
            if number.isdigit():
                found.append(int(number))
        return sorted(found)

    def warm_aad(self, seq: int) -> bytes:
        return f"warm|{self.prefix}|{seq}".encode()

    def cold_aad(self, digest: str) -> bytes:
        return f"cold|{self.prefix}|{digest}".encode()


def _newest_warm_size(store: _Agent) -> int:
    seqs = store.warm_seqs()
    if not seqs:
        return 0
    try:
        return store.warm_path(seqs[-1]).stat().st_size
    except FileNotFoundError:
        return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.4g} {unit}"
        n /= 1024
    return f"{n:.4g} TiB"


def carry_aad(subject: str, warm_seq: int) -> bytes:
    """Associated data of the checkpoints a rollup marker carries (those after its snapshot)."""
    return f"carry|{subject}|{warm_seq}".encode()


def chunk_aad(subject: str, seq: int, i: int, n: int) -> bytes:
    """Associated data of chunk ``i`` of ``n`` of checkpoint ``seq`` on ``subject``."""
    return f"{subject}|{seq}|{i}|{n}".encode()


def _digest(body: bytes) -> str:
    """A checkpoint body's BLAKE3, shortened (tells attempts of one seq apart)."""
    return blake3.blake3(body).hexdigest()[:32]


def _state_id(key: StateKey) -> str:
    return blake3.blake3(f"{key.tenant}/{key.group}/{key.agent}".encode()).hexdigest()[:16]


def _read_journal(path: Path) -> list[_Entry]:
    """The journal's checkpoints in order (a frame torn by a crash ends it)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    out: list[_Entry] = []
    pos = 0
    while pos + 4 <= len(data):
        (size,) = struct.unpack_from(">I", data, pos)
        if pos + 4 + size > len(data):
            break
        body = data[pos + 4 : pos + 4 + size]
        item = msgpack.unpackb(body, raw=False, strict_map_key=False)
        out.append(_Entry(int(item["seq"]), list(item["records"]), size))
        pos += 4 + size
    return out


def _journal_frame(seq: int, records: list[dict[str, Any]]) -> bytes:
    body: bytes = msgpack.packb({"seq": seq, "records": records}, use_bin_type=True)
    return struct.pack(">I", len(body)) + body


def _plan_config(plan: StatePlan) -> dict[str, Any]:
    config = plan.model_dump(mode="json")
    config["tiers"] = {name: tier for name, tier in plan.tiers}
    return config


@dataclass
class _Tally:
    """Checkpoints of one tier not reported yet: one ``state.checkpointed`` will stand for them."""

    seq: int = 0
    checkpoints: int = 0
    bytes: int = 0
    records: int = 0
    pause_ms: float = 0.0  # the longest
    durable_ms: float = 0.0  # the longest

    def add(self, seq: int, size: int, records: int, pause_ms: float, durable_ms: float) -> None:
        self.seq = max(self.seq, seq)
        self.checkpoints += 1
        self.bytes += size
        self.records += records
        self.pause_ms = max(self.pause_ms, pause_ms)
        self.durable_ms = max(self.durable_ms, durable_ms)


async def _paced(store: _Agent) -> None:
    """Wait until ``store``'s state may be opened again (a sleep: no loop time)."""
    wait = store.next_read - time.monotonic()
    if wait > 0:
        await asyncio.sleep(min(wait, READ_WAIT_MAX_S))


def _spent(store: _Agent, held_s: float) -> None:
    """Opening ``store``'s state held the loop ``held_s``: pace the next open."""
    store.next_read = time.monotonic() + min(READ_SHARE * max(held_s, 0.0), READ_WAIT_MAX_S)


def _declared_arrays(
    held: _Arrays, records: list[dict[str, Any]], *, lenient: bool = False
) -> _Arrays:
    """``held`` after ``records``: each array container's dtype, shape and bytes. A ``full``
    record, or the first of a container, sets them; a ``sparse`` or ``slice`` record must name
    the same (the merge writes it into the array it holds: a small shape declared there hid a
    large one set before). ``lenient``: records kept before these checks (the state held on
    the node): one that names no size is skipped, and the largest size declared counts."""
    arrays = dict(held)
    for record in records:
        name = str(record.get("c"))
        if record.get("k") == "array":
            try:
                declared = (str(record["dtype"]), tuple(int(x) for x in record["shape"]))
                size = math.prod(declared[1]) * merge.itemsize(declared[0])
            except (merge.RecordError, KeyError, TypeError, ValueError):
                if lenient:
                    continue
                raise
            known = arrays.get(name)
            if record.get("o") != "full" and known is not None and known[:2] != declared:
                if not lenient:
                    raise merge.RecordError(
                        f"array {name!r}: a {record.get('o')} record of {declared[0]} "
                        f"{list(declared[1])} for an array of {known[0]} {list(known[1])}"
                    )
                size = max(size, known[2])
            arrays[name] = (*declared, size)
        elif record.get("o") == "full" or record.get("k") == "ref":
            arrays.pop(name, None)  # (the container holds something else now)
    return arrays


async def _one_at_a_time(handover: Awaitable[None], old: StateSession) -> None:
    """Run a hand-over of ``old``'s state; another may start once it ended, however."""
    try:
        await handover
    finally:
        old.handing_over = False


class StateSession:
    """One agent connection (an open state socket)."""

    key: StateKey
    sandbox_id: str
    ready: asyncio.Event
    """Hand-over, on the NEW version's session: set when the agent sends ``ready`` (added for
    the hand-over)."""

    def __init__(self, keeper: StateKeeper, writer: asyncio.StreamWriter, sandbox_id: str) -> None:
        self.keeper = keeper
        self.sandbox_id = sandbox_id
        self.plan = StatePlan()
        self._writer = writer
        self._send_lock = asyncio.Lock()
        self._callbacks: list[Callable[[int, list[dict[str, Any]]], Awaitable[None]]] = []
        self._final: asyncio.Future[list[dict[str, Any]]] | None = None
        self._final_taken = False
        self.handing_over = False  # a hand-over of this session's state runs (one at a time)
        self._fetched = False
        """A hand-over's final checkpoint of this session is durable: the state it hands over
        ends there, and no later checkpoint of it is taken (until :meth:`abort_handover`)."""
        self._agent: _Agent | None = None
        self._source = "empty"
        self._sync_ms = 0.0
        self._sync_cpu = 0.0  # the node agent's CPU time the hello's sync took
        self._timers: asyncio.Task[None] | None = None
        self.ready = asyncio.Event()
        """Set when a hand-over's new version sends ``ready``."""

    async def send(self, frame: dict[str, Any]) -> None:
        """Send one frame to the agent."""
        data = wire.encode(frame)
        async with self._send_lock:
            self._writer.write(data)
            await self._writer.drain()

    async def request_final(self, to_sandbox: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
        """Hand-over, on the OLD version's session: send ``{"op": "handover", "to": ...}``,
        wait for its ``final`` checkpoint, make it durable like any other, ack it, and return
        its records."""
        if self._final is not None:
            raise StateError("state-held", "a hand-over already waits for the final checkpoint")
        self._final = asyncio.get_running_loop().create_future()
        await self.send({"op": "handover", "to": to_sandbox})
        try:
            return await asyncio.wait_for(self._final, timeout_s)
        finally:
            self._final = None

    async def abort_handover(self, message: str) -> None:
        """Hand-over, on the OLD version's session, after :meth:`request_final`: the hand-over
        failed; OLD owns its state again and checkpoints on (told ``handover-aborted``)."""
        self._final_taken = False
        await self.send(
            {"op": "error", "code": "handover-aborted", "message": message, "seq": None}
        )

    def off_checkpoint(
        self, callback: Callable[[int, list[dict[str, Any]]], Awaitable[None]]
    ) -> None:
        """Stop calling ``callback`` (a migration that ended)."""
        with contextlib.suppress(ValueError):
            self._callbacks.remove(callback)

    def on_checkpoint(
        self, callback: Callable[[int, list[dict[str, Any]]], Awaitable[None]]
    ) -> None:
        """Call ``callback(seq, records)`` after each checkpoint of this session is durable
        (the hand-over forwards them to the new version)."""
        self._callbacks.append(callback)

    # ------------------------------------------------------------------ the conversation

    async def run(self, reader: asyncio.StreamReader) -> None:
        if self.keeper.registered_only and self.keeper.sandbox_of(self.sandbox_id) is None:
            # (before its hello is even read: decoding costs the loop every sandbox shares)
            text = f"sandbox {self.sandbox_id} has no state plane (no `state:`)"
            await self._error(StateError("unregistered", text))
            return
        try:
            hello = await asyncio.wait_for(
                wire.read_frame(reader, max_size=wire.MAX_HELLO, strict=True), HELLO_TIMEOUT_S
            )
        except (TimeoutError, wire.WireError) as exc:
            await self._error(StateError("bad-request", f"no valid hello: {exc}"))
            return
        if hello is None:
            return
        try:
            await self._hello(hello)
        except StateError as exc:
            await self._error(exc)
            return
        keeper = self.keeper
        while True:
            wait = keeper.frame_due.get(self.sandbox_id, 0.0) - time.monotonic()
            if wait > 0:  # (this sandbox's decoding is paced: see FRAME_SHARE)
                await asyncio.sleep(wait)
            try:
                size = await wire.read_size(reader)
            except wire.WireError as exc:
                await self._error(StateError("bad-request", str(exc)))
                return
            if size is None:
                return
            # (the frame's bytes are the node's, from its read until it is served: budget.py)
            async with keeper.frames.hold(self.sandbox_id, self.key.tenant, size):
                try:
                    frame = await self._read(reader, size)
                except wire.WireError as exc:
                    await self._error(StateError("bad-request", str(exc)))
                    return
                if frame["op"] == "bye":
                    return
                try:
                    await self._frame(frame)
                except StateError as exc:
                    await self._error(exc)

    async def _read(self, reader: asyncio.StreamReader, size: int) -> dict[str, Any]:
        """A frame's body of ``size`` bytes, within BODY_TIMEOUT_S, counted before it is
        decoded (see FRAME_SHARE)."""
        keeper = self.keeper
        try:
            body = await asyncio.wait_for(wire.read_exactly(reader, size), BODY_TIMEOUT_S)
        except TimeoutError:
            raise wire.WireError(
                f"a frame's {size:,} bytes did not come within {BODY_TIMEOUT_S:g} s"
            ) from None
        limit = msgcount.MAX_FRAME_OBJECTS
        # (map keys are strings: an int's or a timestamp's hash is not salted, and a map of
        # keys made to collide cost the square of its size to build, on the loop)
        count = functools.partial(msgcount.count, body, limit, strict=True)
        counting = time.perf_counter()
        try:
            if len(body) < COUNT_OFF_LOOP_BYTES:
                objects = count()
            else:  # (the C count lets the GIL go: the loop runs meanwhile)
                objects = await asyncio.to_thread(count)
        except ValueError as exc:
            raise wire.WireError(f"refused unread: {exc}") from None
        finally:
            # (the Python twin, where the C count was not built, holds the GIL as it counts:
            # that time is the loop's too, refused frames' included)
            counted = time.perf_counter() - counting
            if not msgcount.ACCELERATED and counted >= DECODE_PACED_FROM_S:
                keeper.pace_frames(self.sandbox_id, counted)
        if objects > limit:
            raise wire.WireError(
                f"a frame of more than {limit:,} MessagePack objects (each number, string, "
                "list, map and key is one), the most one frame may hold: refused unread"
            )
        started = time.thread_time()
        frame = wire.decode(body)  # (its keys and types were checked by the count above)
        held = time.thread_time() - started
        if held >= DECODE_PACED_FROM_S:
            keeper.pace_frames(self.sandbox_id, held)
        return frame

    async def _hello(self, hello: dict[str, Any]) -> None:
        keeper = self.keeper
        if hello.get("op") != "hello":
            raise StateError("bad-request", "the first frame must be hello")
        if hello.get("v") != wire.VERSION:
            raise StateError("bad-request", f"wire version {hello.get('v')!r} (this keeper: 1)")
        try:
            agent = check_name("agent name", hello.get("agent"))  # type: ignore[arg-type]
            group = check_name("task group", hello.get("group"))  # type: ignore[arg-type]
        except ValueError as exc:
            raise StateError("bad-request", str(exc)) from None
        info = keeper.sandbox_of(self.sandbox_id)
        tenant = "default"
        if info is not None:
            if (info.agent, info.group) != (agent, group):
                raise StateError(
                    "wrong-agent",
                    f"sandbox {self.sandbox_id} runs agent {info.agent!r} of group "
                    f"{info.group!r}; it may not open the state of {agent!r} of {group!r}",
                )
            tenant = info.tenant
            self.plan = info.plan or StatePlan()
        elif keeper.registered_only:
            raise StateError(
                "unregistered", f"sandbox {self.sandbox_id} has no state plane (no `state:`)"
            )
        self.key = StateKey(tenant, group, agent)
        incoming = keeper.incoming.get(self.sandbox_id)
        if hello.get("handover") is True and incoming is not None:
            if keeper.session_of(self.key) is not None:
                raise StateError("state-held", f"the state of {agent!r} is open on this node")
            store = keeper._agent(self.key)
            async with store.lock:
                await keeper._sync(store)  # recovered as after a node loss
            await self.send(
                {
                    "op": "welcome",
                    "state_id": store.state_id,
                    "seq": store.seq,
                    "config": _plan_config(self.plan),
                    "handover": True,
                }
            )
            keeper._spawn(incoming(self))
            return
        if hello.get("handover") is True:
            if keeper.handover is None:
                raise StateError("no-handover", "this node agent does not hand state over")
            old = keeper.session_of(self.key)
            if old is None:
                raise StateError("no-handover", f"no running session owns {self.key}")
            if old.handing_over:
                # (a second one asked the old version for its final checkpoint again: both
                # hand-overs ended, one switched and one failed, the new version stopped)
                raise StateError("state-held", f"the state of {agent!r} is being handed over")
            old.handing_over = True
            try:
                await self.send(
                    {
                        "op": "welcome",
                        "state_id": _state_id(self.key),
                        "seq": old._seq(),
                        "config": _plan_config(self.plan),
                        "handover": True,
                    }
                )
            except BaseException:
                old.handing_over = False
                raise
            keeper._spawn(_one_at_a_time(keeper.handover(keeper, old, self), old))
            return
        # (paced before it takes the state: no hand-over finds it owned and not yet synced)
        await _paced(keeper._agent(self.key))
        holder = keeper.session_of(self.key)
        if holder is not None and holder is not self and holder.sandbox_id == self.sandbox_id:
            # the same sandbox again: its agent restarted before its old socket was seen closed
            log.info(
                "state of %s: sandbox %s reconnected; closing its old session",
                self.key,
                self.sandbox_id,
            )
            holder.abort()
        elif holder is not None and holder is not self:
            raise StateError(
                "state-held",
                f"the state of {agent!r} ({group}, {tenant}) is open in sandbox "
                f"{holder.sandbox_id}",
            )
        keeper._owners[self.key] = self
        store = keeper._agent(self.key)
        self._agent = store
        started, cpu = time.monotonic(), time.process_time()
        async with store.lock:
            self._source = await keeper._sync(store)
        self._sync_ms = (time.monotonic() - started) * 1000
        self._sync_cpu = time.process_time() - cpu
        _spent(store, self._sync_cpu)
        await self.send(
            {
                "op": "welcome",
                "state_id": store.state_id,
                "seq": store.seq,
                "config": _plan_config(self.plan),
                "handover": False,
            }
        )
        self.start_timers()

    def start_timers(self) -> None:
        """The periodic warm merge and cold check of the state this session owns."""
        if self._timers is None or self._timers.done():
            self._timers = asyncio.get_running_loop().create_task(self._tick())

    def _seq(self) -> int:
        return self._agent.seq if self._agent is not None else 0

    async def _frame(self, frame: dict[str, Any]) -> None:
        op = frame["op"]
        if self._agent is None:
            if op == "ready":
                self.ready.set()
                return
            if op == "fetch":
                return  # a hand-over answers the new version's fetch with the old one's state
            raise StateError("bad-request", f"{op!r} on a hand-over session before it switched")
        if op == "fetch":
            await self._fetch()
        elif op == "checkpoint":
            try:
                await self._checkpoint(frame)
            except StateError as exc:
                # (every refusal of a checkpoint names its seq: an agent waits for that answer)
                if exc.seq is None and isinstance(frame.get("seq"), int):
                    exc.seq = frame["seq"]
                raise
        elif op == "ready":
            self.ready.set()
        else:
            raise StateError("bad-request", f"unknown op {op!r}")

    async def _error(self, exc: StateError) -> None:
        REFUSED.labels(exc.code).inc()
        with contextlib.suppress(OSError, ConnectionError):
            # (a message echoes what the agent sent, so it is cut: never too large to send)
            message = exc.message if len(exc.message) <= 4096 else exc.message[:4096] + "..."
            frame = {"op": "error", "code": exc.code, "message": message, "seq": exc.seq}
            if exc.expected is not None:
                frame["expected"] = exc.expected
            await self.send(frame)

    async def _fetch(self) -> None:
        assert self._agent is not None
        keeper, store = self.keeper, self._agent
        if self._fetched:
            raise StateError(
                "bad-request", "one fetch a session (the SDK's, at open): open the state again"
            )
        self._fetched = True
        started, cpu = time.monotonic(), time.process_time()
        async with store.lock:
            records, deltas, size = await keeper._materialize(store)
            seq = store.seq
            if not store.arrays_known:  # (what it holds already counts: read here anyway)
                store.arrays = _declared_arrays({}, records, lenient=True)
                store.arrays_known = True
        batch: list[dict[str, Any]] = []
        batch_bytes = 0
        for record in records:
            for part in split_large(record):
                part_bytes = len(msgpack.packb(part, use_bin_type=True))
                if batch and batch_bytes + part_bytes > RECORDS_FRAME_BYTES:
                    await self.send({"op": "records", "records": batch})
                    batch, batch_bytes = [], 0
                batch.append(part)
                batch_bytes += part_bytes
        if batch:
            await self.send({"op": "records", "records": batch})
        # The node agent's CPU time, not the wall's: what waited on JetStream, S3 or the agent
        # reading cost the others nothing (a slow remote recovery paced a restart for seconds).
        _spent(store, self._sync_cpu + time.process_time() - cpu)
        ms = self._sync_ms + (time.monotonic() - started) * 1000
        source = self._source if records else "empty"
        await self.send({"op": "fetched", "seq": seq, "deltas": deltas, "source": source, "ms": ms})
        if records:
            RECOVERIES.labels("remote" if source == "remote" else "local").inc()
            if time.monotonic() - keeper.last_reported(self.key, "recovered") < REPORT_INTERVAL_S:
                return  # an agent fetching in a loop: reported once per interval (see above)
            keeper.reported(self.key, "recovered")
            await keeper._event(
                events.StateRecovered(
                    agent=self.key.agent,
                    group=self.key.group,
                    seq=seq,
                    source="remote" if source == "remote" else "local",
                    duration_ms=round(ms, 3),
                    deltas_applied=deltas,
                    bytes=size,
                    from_sandbox=(
                        store.writer
                        if store.writer is not None and store.writer != self.sandbox_id
                        else None
                    ),
                ),
                self.sandbox_id,
            )

    async def _within_quota(self, store: _Agent, seq: int) -> None:
        """Refuse a checkpoint while the agent's state on this node (its newest warm snapshot
        and the journal after it) is at its ``max_bytes``: one agent cannot fill the node's
        tmpfs and disk for the others (a checkpoint passes it by at most one frame)."""
        if store.warm_bytes is None:
            store.warm_bytes = await asyncio.to_thread(_newest_warm_size, store)
        used = store.warm_bytes + store.journal_bytes
        if used >= self.plan.max_bytes:
            if not store.warming.locked():
                self.keeper._spawn(self.warm())  # a merge may fold the journal back under it
            raise StateError(
                "quota",
                f"the state of {store.key.agent} holds {_human(used)} on this node, its limit is "
                f"{_human(self.plan.max_bytes)} (spec `state.max_size`): checkpoint {seq} refused; "
                "keep less state or raise the limit",
                seq,
            )

    async def _checkpoint(self, frame: dict[str, Any]) -> None:
        assert self._agent is not None
        store, keeper = self._agent, self.keeper
        seq = frame.get("seq")
        raw = frame.get("records")
        # (type, not isinstance: `true` is an int to Python, and a checkpoint acked as seq True
        # wrote a header no hello could read again, locking the agent out of its state)
        if type(seq) is not int or not isinstance(raw, list):
            raise StateError("bad-request", "a checkpoint needs an int 'seq' and a 'records' list")
        received = time.monotonic()
        async with store.lock:
            if self._final_taken:
                # (an agent that goes on checkpointing after its final one, a bug or on
                # purpose: what it adds would never reach the new version, and the seq it takes
                # would put the new version's first checkpoint out of step)
                raise StateError(
                    "handed-over",
                    f"checkpoint {seq} after this version's final hand-over checkpoint "
                    f"{store.seq}: its state goes to the new version as it was then",
                    seq,
                )
            if seq != store.seq + 1:
                raise StateError(
                    "bad-seq",
                    f"checkpoint {seq} after {store.seq}: expected {store.seq + 1}",
                    seq,
                    expected=store.seq + 1,
                )
            await self._within_quota(store, seq)
            try:
                records = [merge.check_bounded(r, self.plan.max_bytes) for r in raw]
                if not store.arrays_known and any(r["k"] == "array" for r in records):
                    # (after a restart of the node agent or a recovery from another node, the
                    # arrays the state already holds count too: read once)
                    _, warm, entries, _ = await keeper._local_state(store)
                    held = [*warm, *(r for e in entries for r in e.records)]
                    store.arrays = _declared_arrays({}, held, lenient=True)
                    store.arrays_known = True
                arrays = _declared_arrays(store.arrays, records)
                merged_bytes = sum(size for _, _, size in arrays.values())
                if merged_bytes > self.plan.max_bytes:
                    raise StateError(
                        "quota",
                        f"the arrays of {store.key.agent} would hold "
                        f"{_human(merged_bytes)} once merged, its limit is "
                        f"{_human(self.plan.max_bytes)} (spec `state.max_size`): checkpoint "
                        f"{seq} refused",
                        seq,
                    )
                records, cold_bytes = await keeper._cold(store, records)
            except merge.RecordError as exc:
                raise StateError("bad-record", str(exc), seq) from None
            size = await keeper._durable(store, seq, records, self.sandbox_id)
            store.seq = seq
            store.arrays = arrays
            # A hand-over's final checkpoint: one the keeper asked for and still waits for,
            # decided once, as it becomes durable (a request that timed out meanwhile, and was
            # aborted, takes none). It is reported at once; the flag alone, which any agent may
            # set, is not: it would undo the rate.
            waiting = self._final
            final = frame.get("final") is True and waiting is not None and not waiting.done()
            if final:
                self._final_taken = True
        durable_ms = (time.monotonic() - received) * 1000
        await self.send({"op": "ack", "seq": seq, "bytes": size})
        DURABLE.observe(durable_ms / 1000)
        CHECKPOINTS.labels("hot").inc()
        if cold_bytes:
            CHECKPOINTS.labels("cold").inc()
        pause = frame.get("pause_ms")
        pause_ms = (
            float(pause) if isinstance(pause, int | float) and type(pause) is not bool else 0.0
        )
        if not math.isfinite(pause_ms):  # (an agent's inf or nan would reach the event)
            pause_ms = 0.0
        durable = round(durable_ms, 3)
        hot = ("hot", seq, size, len(records), pause_ms, durable)
        await keeper.report(self.key, self.sandbox_id, *hot, now=final)
        if cold_bytes:
            refs = sum(1 for r in records if r["k"] == "ref")
            cold = ("cold", seq, cold_bytes, refs, 0.0, durable)
            await keeper.report(self.key, self.sandbox_id, *cold, now=final)
        for callback in self._callbacks:  # (before the final's result: it is in their queue)
            await callback(seq, records)
        if final and waiting is not None and not waiting.done():
            waiting.set_result(records)
        if store.journal_bytes > JOURNAL_WARM_BYTES and not store.warming.locked():
            keeper._spawn(self.warm())  # checkpoints go on meanwhile

    async def warm(self) -> None:
        """Merge now (the timer's and the journal size's trigger; one at a time)."""
        store = self._agent
        if store is None:
            return
        async with store.warming:
            await self.keeper._warm(store, self.sandbox_id)

    async def _tick(self) -> None:
        plan = self.plan
        next_warm = time.monotonic() + plan.warm_interval_s
        next_cold = time.monotonic() + plan.cold_interval_s
        while True:
            await asyncio.sleep(max(0.0, min(next_warm, next_cold) - time.monotonic()))
            now = time.monotonic()
            try:
                if now >= next_warm:
                    next_warm = now + plan.warm_interval_s
                    await self.warm()
                if now >= next_cold and self._agent is not None:
                    next_cold = now + plan.cold_interval_s
                    await self.keeper.verify_cold(self._agent)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("state of %s: periodic merge or check failed", self.key)

    def abort(self) -> None:
        """Drop the connection (a newer session of the same sandbox replaces it)."""
        self.close()
        self._writer.transport.abort()

    def close(self) -> None:
        if self._timers is not None:
            self._timers.cancel()
        if self._final is not None and not self._final.done():
            self._final.set_exception(ConnectionError("the old version's session ended"))


HandOver = Callable[["StateKeeper", StateSession, StateSession], Awaitable[None]]
"""Runs a hand-over from the old session to the new one (``dsec_nodeagent.state.handover``)."""

Publish = Callable[[events.Payload, str], Awaitable[None]]
"""Publishes an event about a sandbox (``payload, aggregate_id``): the node agent's outlet."""


class StateKeeper:
    """Serves the agents of this node.

    Args:
        settings: the node's settings: NATS (``DSEC_STATE``), the object store and bucket,
            OpenBao (tenants' state keys), ``home`` (warm snapshots), the node's journal dir.
        publish: how ``state.*`` events reach the bus (the node agent's lifecycle outlet);
            ``None``: not published.
        keys: the tenants' state keys (default: OpenBao from the settings).
        journal_dir / warm_dir: override where hot journals and warm snapshots live.
        registered_only: refuse sandboxes the node agent did not register (``unregistered``);
            off (a development broker, tests): an unregistered connection acts for tenant
            ``default`` with the agent and group its hello names.
    """

    handover: HandOver | None = None
    """Set by the node agent: how a ``hello`` with ``handover: true`` is served; None: such a
    hello is refused (``error`` code ``no-handover``)."""

    def __init__(
        self,
        settings: Settings,
        publish: Publish | None = None,
        *,
        keys: TenantKeys | None = None,
        journal_dir: Path | None = None,
        warm_dir: Path | None = None,
        registered_only: bool = False,
    ) -> None:
        self.settings = settings
        self.registered_only = registered_only
        self._publish = publish
        self._keys = keys
        self.journal_dir = journal_dir or settings.state_journal_dir()
        self.warm_dir = warm_dir or NodeLayout.of(settings.home).state
        self.bucket = settings.s3_bucket
        self._sandboxes: dict[str, SandboxState] = {}
        self._owners: dict[StateKey, StateSession] = {}
        self._agents: dict[StateKey, _Agent] = {}
        self._sessions: set[StateSession] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._reports: set[asyncio.Task[None]] = set()  # held-back reports under way
        # (agent, tier, sandbox) -> its checkpoints not reported yet, and the timer of the next
        self._pending: dict[tuple[StateKey, str, str], _Tally] = {}
        self._report_timer: asyncio.TimerHandle | None = None
        # (agent, what) -> when it was last reported: per agent, not per connection, so an
        # agent that reconnects in a loop is held to the same rate (bounded; oldest go first)
        self._reported_at: OrderedDict[tuple[StateKey, str], float] = OrderedDict()
        self._nc: Any = None
        self._js: Any = None
        self._store: Any = None
        self.frames = FrameBudget(FRAMES_IN_FLIGHT_BYTES, wire.MAX_FRAME)
        if not msgcount.ACCELERATED:
            log.warning(
                "state keeper: the SDK's C object count (dsec_sdk.state._msgcount) is not "
                "built (no C compiler at install): agents' frames are counted in Python, ~100x "
                "slower, holding the loop while they are"
            )
        frames = weakref.ref(self.frames)  # (the gauge does not keep a stopped keeper)
        IN_FLIGHT.set_function(lambda: budget.used if (budget := frames()) is not None else 0)
        # sandbox -> when it may send its next frame (see FRAME_SHARE; bounded, stale ones go)
        self.frame_due: dict[str, float] = {}
        self.incoming: dict[str, Callable[[StateSession], Awaitable[None]]] = {}
        """Migration path ``handover`` (docs/migration.md): sandboxes started here as the warm
        standby of their copy on another node; a ``hello{handover: true}`` of one is served by
        its callable (the state is recovered from DSEC_STATE/S3, not streamed by a local
        session)."""

    # ------------------------------------------------------------------ the node agent's side

    def pace_frames(self, sandbox_id: str, held_s: float) -> None:
        """Decoding a frame of ``sandbox_id`` held the loop ``held_s``: its next frame waits."""
        now = time.monotonic()
        if len(self.frame_due) >= 4096:
            self.frame_due = {s: due for s, due in self.frame_due.items() if due > now}
        self.frame_due[sandbox_id] = now + min(FRAME_SHARE * held_s, READ_WAIT_MAX_S)

    def register_sandbox(self, info: SandboxState) -> None:
        """Called by the node agent before it launches a sandbox whose plan has ``state``
        (and for a hand-over's new sandbox)."""
        self._sandboxes[info.sandbox_id] = info

    def forget_sandbox(self, sandbox_id: str) -> None:
        """Called when the sandbox ended for good (not between restarts)."""
        self._sandboxes.pop(sandbox_id, None)

    def session_of(self, key: StateKey) -> StateSession | None:
        """The live session that owns ``key``'s state (at most one), if any."""
        return self._owners.get(key)

    def sandbox_of(self, sandbox_id: str) -> SandboxState | None:
        """What was registered for a sandbox."""
        return self._sandboxes.get(sandbox_id)

    async def records_of(self, session: StateSession) -> tuple[list[dict[str, Any]], int]:
        """Hand-over: ``session``'s state as a fetch sends it (warm records, then every
        checkpoint after; cold refs resolved; an array too large for one frame in slices) and
        its last durable seq."""
        store = session._agent
        if store is None:
            raise StateError("no-handover", "that session owns no state")
        async with store.lock:
            records, _, _ = await self._materialize(store)
            # as a fetch sends them: an array too large for one frame goes in slices
            return [part for record in records for part in split_large(record)], store.seq

    async def catch_up(
        self, session: StateSession, after: int
    ) -> list[tuple[int, list[dict[str, Any]]]]:
        """Migration path ``handover``, the target: the checkpoints of ``session``'s agent
        made durable in DSEC_STATE after ``after`` (by its copy on the source node), appended
        to this node's journal; returns them as ``(seq, records)``."""
        store = self._agent(session.key)
        async with store.lock:
            key = await self._key(store.key.tenant)
            entries = [e for e in await self._read_stream(store, key, after=after) if e.seq > after]

            def append() -> None:
                store.journal_dir.mkdir(parents=True, exist_ok=True)
                with store.journal.open("ab") as fh:
                    for entry in entries:
                        fh.write(_journal_frame(entry.seq, entry.records))

            await asyncio.to_thread(append)
            if entries:
                store.seq = max(store.seq, entries[-1].seq)
        return [(e.seq, e.records) for e in entries]

    async def apply(
        self, session: StateSession, deltas: list[tuple[int, list[dict[str, Any]]]]
    ) -> None:
        """Migration path ``handover``, the target: checkpoints the source's keeper made
        durable, received over the node-to-node channel, appended to this node's journal."""
        store = self._agent(session.key)
        async with store.lock:

            def append() -> None:
                store.journal_dir.mkdir(parents=True, exist_ok=True)
                with store.journal.open("ab") as fh:
                    for seq, records in deltas:
                        fh.write(_journal_frame(seq, records))

            await asyncio.to_thread(append)
            if deltas:
                store.seq = max(store.seq, deltas[-1][0])

    def take_owner(self, session: StateSession) -> None:
        """Migration path ``handover``, the target: ``session`` owns its key's state from now
        on (its checkpoints continue the recovered seq)."""
        store = self._agent(session.key)
        session._agent = store
        self._owners[store.key] = session
        session.start_timers()

    async def records_for(self, session: StateSession) -> tuple[list[dict[str, Any]], int]:
        """Migration path ``handover``: the recovered state of ``session``'s key as a fetch
        sends it, and its seq."""
        store = self._agent(session.key)
        async with store.lock:
            records, _, _ = await self._materialize(store)
            return [part for record in records for part in split_large(record)], store.seq

    def switch_owner(self, old: StateSession, new: StateSession) -> None:
        """Hand-over: ``new`` owns ``old``'s state from now on (its checkpoints continue
        ``old``'s seq; ``old`` may not checkpoint any more)."""
        store = old._agent
        if store is None:
            raise StateError("no-handover", "that session owns no state")
        new.key, new.plan, new._agent = old.key, old.plan, store
        old._agent = None
        self._owners[store.key] = new
        old.close()
        new.start_timers()

    async def serve(self, sock: socket.socket, sandbox_id: str) -> None:
        """Serve one agent connection (the broker hands over its end of the socketpair,
        with the sandbox the connecting process belongs to) until it closes."""
        sock.setblocking(False)
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=READ_AHEAD_BYTES)
        session = StateSession(self, writer, sandbox_id)
        self._sessions.add(session)
        try:
            await session.run(reader)
        except (ConnectionError, OSError) as exc:
            log.info("state session of sandbox %s ended: %s", sandbox_id, exc)
        except Exception as exc:  # a shape the checks missed: this session ends, said once
            log.warning(
                "state session of sandbox %s failed: %s: %.200s",
                sandbox_id,
                type(exc).__name__,
                exc,
            )
            await session._error(StateError("bad-request", "the keeper could not serve that"))
        finally:
            session.close()
            self._sessions.discard(session)
            key = getattr(session, "key", None)
            if key is not None and self._owners.get(key) is session:
                del self._owners[key]
            writer.close()
            try:  # (what is still buffered for an agent that reads nothing is dropped)
                await asyncio.wait_for(writer.wait_closed(), CLOSE_TIMEOUT_S)
            except Exception:
                writer.transport.abort()

    async def start(self) -> None:
        """Connect to NATS and the object store; read the OpenBao address."""
        settings = self.settings
        await asyncio.to_thread(self._private_dirs)
        self._nc = await natsclient.connect(
            settings,
            f"nodeagent-state-{settings.node_id}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
            connect_timeout=5,
            allow_reconnect=True,
        )
        self._js = self._nc.jetstream(timeout=10)
        try:
            await self._js.stream_info(STATE_STREAM)
        except Exception as exc:  # stateless sandboxes still run; stateful ones get errors
            log.error(
                "stream %s is not there (%s): agents' checkpoints will be refused until the "
                "operator creates it (`dsec nats stream`)",
                STATE_STREAM,
                type(exc).__name__,
            )
        if settings.endpoint("s3_endpoint"):
            self._store = objectstore.client(settings)
            await asyncio.to_thread(objectstore.ensure_bucket, self._store, self.bucket)
        if self._keys is None:
            addr, token = settings.endpoint("vault_addr"), settings.endpoint("vault_token")
            if addr and token:
                self._keys = TenantKeys(str(addr), str(token))

    def _private_dirs(self) -> None:
        """The journal (plain, on tmpfs) and the warm snapshots: the node agent's alone.

        ``/dev/shm`` is writable by every user of the node: a ``dsec-<node>-<hash>`` directory
        someone else made there first (or a link) would let them read or swap the journals.
        Running as root, the node agent removes such an entry (without following it) and makes
        its own, a few times if someone races it; otherwise, or if the race goes on, it refuses
        to start on it."""
        root = self.journal_dir.parent
        if root.name.startswith("dsec-"):  # /dev/shm/dsec-<node>-<hash>
            try:
                privdir.own_directory(root)
            except privdir.UnsafeDirectory as exc:
                raise StateError("unsafe-journal-dir", str(exc)) from None
            leftovers.claim(root, self.settings.home)
        for path in (self.journal_dir, self.warm_dir):
            path.mkdir(parents=True, exist_ok=True, mode=0o700)
            os.chmod(path, 0o700)

    async def stop(self) -> None:
        for session in list(self._sessions):
            session.close()
        if self._report_timer is not None:
            self._report_timer.cancel()
            self._report_timer = None
        for entry in list(self._pending):  # what a report interval held back goes out now
            self._report_later(self._send_pending(entry))
        if self._reports:
            await asyncio.wait(list(self._reports), timeout=REPORT_STOP_S)
        for task in list(self._tasks | self._reports):
            task.cancel()
        if self._tasks or self._reports:
            await asyncio.gather(*self._tasks, *self._reports, return_exceptions=True)
        if self._nc is not None:
            with contextlib.suppress(Exception):
                await self._nc.close()
            self._nc = self._js = None
        await asyncio.to_thread(self._tidy_journal)

    def _tidy_journal(self) -> None:
        """Leave nothing in node memory (``/dev/shm``) that a later start would not read:
        at ``dsec down`` with no sandbox left, the whole journal (its entries are copies of the
        state stream's); otherwise the directories no journal file is in (a node that never
        ran a stateful agent leaves none)."""
        root = self.journal_dir.parent if self.journal_dir.parent.name.startswith("dsec-") else None
        down = retention.down_marker(self.settings.home).exists() and not self._sandboxes
        if down:
            shutil.rmtree(self.journal_dir, ignore_errors=True)
        elif self.journal_dir.is_dir():
            for path, _dirs, files in os.walk(self.journal_dir, topdown=False):
                if not files:
                    with contextlib.suppress(OSError):  # only when empty
                        os.rmdir(path)
        if root is not None:
            leftovers.release(root)

    # ------------------------------------------------------------------ storage

    def _spawn(self, coro: Awaitable[None], into: set[asyncio.Task[None]] | None = None) -> None:
        """Run ``coro`` in a task kept in ``into`` (default: the tasks :meth:`stop` cancels)."""
        tasks = self._tasks if into is None else into

        async def run() -> None:
            await coro

        task = asyncio.get_running_loop().create_task(run())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def report(
        self,
        key: StateKey,
        sandbox_id: str,
        tier: str,
        seq: int,
        size: int,
        records: int,
        pause_ms: float,
        durable_ms: float,
        *,
        now: bool = False,
    ) -> None:
        """Report a checkpoint (``state.checkpointed``): at once when ``now`` or when the
        agent's last report of ``tier`` is :data:`REPORT_INTERVAL_S` old, else with the others
        of that interval when it ends (see :data:`REPORT_INTERVAL_S`)."""
        entry = (key, tier, sandbox_id)
        self._pending.setdefault(entry, _Tally()).add(seq, size, records, pause_ms, durable_ms)
        if now or time.monotonic() >= self.last_reported(key, tier) + REPORT_INTERVAL_S:
            await self._send_report(entry, self._pending.pop(entry))
        else:
            self._arm_reports()

    def _arm_reports(self) -> None:
        if self._report_timer is not None or not self._pending:
            return
        due = min(self.last_reported(k, t) for k, t, _ in self._pending) + REPORT_INTERVAL_S
        loop = asyncio.get_running_loop()
        self._report_timer = loop.call_later(max(0.0, due - time.monotonic()), self._reports_due)

    def _reports_due(self) -> None:
        self._report_timer = None
        now = time.monotonic()
        for entry in list(self._pending):
            key, tier, _ = entry
            if now >= self.last_reported(key, tier) + REPORT_INTERVAL_S:
                self.reported(key, tier)  # (due: not armed again for it meanwhile)
                self._report_later(self._send_pending(entry))
        self._arm_reports()

    async def _send_pending(self, entry: tuple[StateKey, str, str]) -> None:
        """Report what is held back for ``entry`` when this task runs, not when it was
        scheduled: a report sent at once in between (``now``) took it along, with the higher
        seq, so no report of a lower seq follows it."""
        tally = self._pending.pop(entry, None)
        if tally is not None:
            await self._send_report(entry, tally)

    async def _send_report(self, entry: tuple[StateKey, str, str], tally: _Tally) -> None:
        key, tier, sandbox_id = entry
        self.reported(key, tier)
        await self._event(
            events.StateCheckpointed(
                agent=key.agent,
                group=key.group,
                tier=tier,
                seq=tally.seq,
                bytes=tally.bytes,
                records=tally.records,
                pause_ms=tally.pause_ms,
                durable_ms=tally.durable_ms,
                checkpoints=tally.checkpoints,
            ),
            sandbox_id,
        )

    def _report_later(self, coro: Awaitable[None]) -> None:
        """Run a held-back report; :meth:`stop` waits for it (up to ``REPORT_STOP_S``)."""
        self._spawn(coro, self._reports)

    def last_reported(self, key: StateKey, what: str) -> float:
        """When ``what`` (a tier, ``recovered``) of agent ``key`` was last reported (monotonic;
        -inf: never)."""
        return self._reported_at.get((key, what), -math.inf)

    def reported(self, key: StateKey, what: str) -> None:
        """Note that ``what`` of agent ``key`` was reported now."""
        self._reported_at.pop((key, what), None)
        self._reported_at[(key, what)] = time.monotonic()
        while len(self._reported_at) > REPORT_CLOCKS:
            self._reported_at.popitem(last=False)

    def _agent(self, key: StateKey) -> _Agent:
        found = self._agents.get(key)
        if found is None:
            tail = Path(key.tenant) / key.group / key.agent
            found = _Agent(
                key=key,
                state_id=_state_id(key),
                journal_dir=self.journal_dir / tail,
                warm_dir=self.warm_dir / tail,
                subject=f"{STATE_ROOT}.{key.subject_tokens}",
                prefix=f"state/{key.tenant}/{key.group}/{key.agent}/",
            )
            self._agents[key] = found
        return found

    async def _key(self, tenant: str) -> bytes:
        if self._keys is None:
            raise StateError(
                "unavailable", "no OpenBao configured (DSEC_VAULT_ADDR): state cannot be encrypted"
            )
        try:
            return await self._keys.get(tenant)
        except KeyUnavailable as exc:
            raise StateError("unavailable", str(exc)) from None

    def _need_store(self) -> Any:
        if self._store is None:
            raise StateError("unavailable", "no object store configured (DSEC_S3_ENDPOINT)")
        return self._store

    def _need_js(self) -> Any:
        if self._js is None:
            raise StateError("unavailable", "the state keeper is not connected to NATS")
        return self._js

    async def _event(self, payload: events.Payload, sandbox_id: str) -> None:
        if self._publish is None:
            return
        try:
            await self._publish(payload, sandbox_id)
        except Exception:
            log.exception("could not publish %s for %s", payload.TYPE, sandbox_id)

    async def _remote_tail(self, store: _Agent) -> int:
        """The newest seq JetStream holds for the agent (0: none)."""
        try:
            msg = await self._need_js().get_msg(STATE_STREAM, subject=store.subject)
        except NotFoundError:
            return 0
        headers = msg.headers or {}
        if SANDBOX_HEADER in headers:
            store.writer = str(headers[SANDBOX_HEADER])
        try:
            return int(headers.get(SEQ_HEADER, 0))
        except ValueError:
            raise StateError(
                "corrupt", f"the newest checkpoint of {store.key.agent} has no readable seq"
            ) from None

    def _local_tail(self, store: _Agent) -> int:
        entries = _read_journal(store.journal)
        warm = store.warm_seqs()
        return max([e.seq for e in entries] + warm + [0])

    async def _sync(self, store: _Agent) -> str:
        """Make the node's copy (journal + warm) the newest; ``local``, ``remote`` or
        ``empty``: where the state came from."""
        local = await asyncio.to_thread(self._local_tail, store)
        remote = await self._remote_tail(store)
        if local >= remote:
            store.seq = local
            store.synced = True
            return "local" if local else "empty"
        await self._pull(store)
        store.arrays, store.arrays_known = {}, False  # (the node's copy is another now)
        # what JetStream holds last may be an attempt that failed (never acked): the state
        # is what was pulled
        store.seq = await asyncio.to_thread(self._local_tail, store)
        store.synced = True
        return "remote"

    async def _pull(self, store: _Agent) -> None:
        """Another node wrote it (or this node lost its copy): fetch the newest warm snapshot
        from the object store and the deltas after it from JetStream; verify everything before
        replacing the node's copy."""
        key = await self._key(store.key.tenant)
        s3 = self._need_store()
        names = await asyncio.to_thread(
            lambda: [
                o.object_name for o in s3.list_objects(self.bucket, prefix=f"{store.prefix}warm/")
            ]
        )
        seqs = sorted(int(n.rsplit("/", 1)[1]) for n in names if n.rsplit("/", 1)[1].isdigit())
        warm_seq, warm_blob = 0, b""
        if seqs:
            warm_seq = seqs[-1]
            warm_blob = await objectstore.get_bytes(
                s3, self.bucket, f"{store.prefix}warm/{warm_seq}"
            )
            _open_warm(key, store, warm_seq, warm_blob)  # verified before anything is replaced
        entries = await self._read_stream(store, key, after=warm_seq)

        def replace() -> None:
            shutil.rmtree(store.journal_dir, ignore_errors=True)
            shutil.rmtree(store.warm_dir, ignore_errors=True)
            store.journal_dir.mkdir(parents=True, exist_ok=True)
            store.warm_dir.mkdir(parents=True, exist_ok=True)
            if warm_seq:
                _write_atomic(store.warm_path(warm_seq), warm_blob)
            with store.journal.open("wb") as fh:
                for entry in entries:
                    fh.write(_journal_frame(entry.seq, entry.records))

        await asyncio.to_thread(replace)

    async def _read_stream(self, store: _Agent, key: bytes, *, after: int) -> list[_Entry]:
        """The checkpoints after ``after`` in JetStream, decrypted and reassembled.

        A checkpoint's chunks carry the BLAKE3 of its body (``Dsec-Digest``, also in their
        ``Nats-Msg-Id``), so a retried checkpoint never mixes with what an attempt JetStream
        failed left behind. A set with chunks missing was never acknowledged (the keeper acks
        after every chunk's ack) and is skipped; a complete set that does not authenticate is
        an error (``corrupt``), and so is a gap in the checkpoints."""
        js = self._need_js()
        # seq -> digest -> chunk -> (n, data, stream seq)
        sets: dict[int, dict[str, dict[int, tuple[int, bytes, int]]]] = {}
        carried: list[_Entry] = []
        cursor = 1
        while True:
            try:
                msg = await js.get_msg(STATE_STREAM, seq=cursor, subject=store.subject, next=True)
            except NotFoundError:
                break
            cursor = msg.seq + 1
            headers = msg.headers or {}
            if WARM_HEADER in headers:
                carried.extend(
                    self._carried(store, key, msg, int(headers[WARM_HEADER]), after=after)
                )
                continue
            seq = int(headers.get(SEQ_HEADER, 0))
            if seq <= after:
                continue
            ci, _, cn = str(headers.get(CHUNK_HEADER, "")).partition("/")
            if not (ci.isdigit() and cn.isdigit() and int(ci) < int(cn)):
                raise StateError(
                    "corrupt", f"JetStream message {msg.seq} of {store.subject}: no chunk header"
                )
            digest = str(headers.get(DIGEST_HEADER, ""))
            group = sets.setdefault(seq, {}).setdefault(digest, {})
            group[int(ci)] = (int(cn), msg.data or b"", msg.seq)
        entries: list[_Entry] = list(carried)
        for seq in sorted(sets):
            if entries and seq <= entries[-1].seq:
                continue  # also carried by a marker
            complete = [
                (max(p[2] for p in parts.values()), digest, parts)
                for digest, parts in sets[seq].items()
                if sorted(parts) == list(range(next(iter(parts.values()))[0]))
                and len({p[0] for p in parts.values()}) == 1
            ]
            if not complete:
                continue  # an attempt that failed: never acknowledged
            _, digest, parts = max(complete, key=lambda c: c[0])  # the latest attempt
            n = len(parts)
            plain = bytearray()
            for i in range(n):
                _, data, stream_seq = parts[i]
                try:
                    plain += open_sealed(
                        key,
                        data,
                        chunk_aad(store.subject, seq, i, n),
                        f"JetStream message {stream_seq} (checkpoint {seq}, chunk {i + 1}/{n}) "
                        f"of {store.subject}",
                    )
                except SealError as exc:
                    raise StateError("corrupt", str(exc)) from None
            if _digest(bytes(plain)) != digest:
                raise StateError(
                    "corrupt", f"checkpoint {seq} of {store.subject}: its chunks do not add up"
                )
            expected = entries[-1].seq + 1 if entries else after + 1
            if seq != expected:
                raise StateError(
                    "corrupt",
                    f"{store.subject}: checkpoint {expected} is missing from JetStream "
                    f"(found {seq} next)",
                )
            item = msgpack.unpackb(bytes(plain), raw=False, strict_map_key=False)
            entries.append(_Entry(seq, list(item["records"]), len(plain)))
        return entries

    def _carried(
        self, store: _Agent, key: bytes, msg: Any, warm_seq: int, *, after: int
    ) -> list[_Entry]:
        """The checkpoints after ``after`` a rollup marker carries."""
        if not msg.data:
            return []
        try:
            body = open_sealed(
                key,
                msg.data,
                carry_aad(store.subject, warm_seq),
                f"JetStream message {msg.seq} (warm snapshot {warm_seq}'s marker) of "
                f"{store.subject}",
            )
        except SealError as exc:
            raise StateError("corrupt", str(exc)) from None
        return [
            _Entry(int(item["seq"]), list(item["records"]), 0)
            for item in msgpack.unpackb(body, raw=False, strict_map_key=False)
            if int(item["seq"]) > after
        ]

    async def _durable(
        self, store: _Agent, seq: int, records: list[dict[str, Any]], sandbox_id: str
    ) -> int:
        """Journal one checkpoint on tmpfs and publish it to JetStream, every chunk acked;
        the journal is cut back when JetStream refuses. Returns its bytes."""
        key = await self._key(store.key.tenant)
        js = self._need_js()
        frame = _journal_frame(seq, records)
        body = frame[4:]

        def append() -> int:
            store.journal_dir.mkdir(parents=True, exist_ok=True)
            with store.journal.open("ab") as fh:
                offset = fh.tell()
                fh.write(frame)
            return offset

        offset = await asyncio.to_thread(append)
        pieces = [body[i : i + CHUNK_PLAIN] for i in range(0, len(body), CHUNK_PLAIN)] or [b""]
        n = len(pieces)
        digest = _digest(body)
        try:
            await asyncio.gather(
                *(
                    js.publish(
                        store.subject,
                        seal(key, piece, chunk_aad(store.subject, seq, i, n)),
                        headers={
                            "Nats-Msg-Id": f"{store.state_id}.{seq}.{i}.{digest}",
                            SEQ_HEADER: str(seq),
                            CHUNK_HEADER: f"{i}/{n}",
                            DIGEST_HEADER: digest,
                            SANDBOX_HEADER: sandbox_id,
                        },
                    )
                    for i, piece in enumerate(pieces)
                )
            )
        except Exception as exc:
            await asyncio.to_thread(os.truncate, store.journal, offset)
            raise StateError(
                "not-durable", f"JetStream did not take checkpoint {seq}: {exc}", seq
            ) from None
        store.journal_bytes = offset + len(frame)
        store.writer = sandbox_id
        return len(body)

    async def _cold(
        self, store: _Agent, records: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], int]:
        """Cold blobs go to the object store (content-addressed, only when new) and are
        replaced by ``ref`` records. Returns the records and the bytes uploaded."""
        out, uploaded = [], 0
        for record in records:
            # parts of a large cold blob stay deltas; the warm merge stores the whole blob
            if record["k"] != "blob" or record["t"] != "cold" or record["o"] != "full":
                out.append(record)
                continue
            data, digest = record.get("data"), record.get("hash")
            if not isinstance(data, bytes) or not isinstance(digest, str):
                raise merge.RecordError(f"blob {record['c']!r}: 'data' bytes and 'hash' needed")
            if blake3.blake3(data).hexdigest() != digest:
                raise merge.RecordError(f"blob {record['c']!r}: its data does not hash to 'hash'")
            s3 = self._need_store()
            name = f"{store.prefix}cold/{digest}"
            exists = await asyncio.to_thread(objectstore.stat_object, s3, self.bucket, name)
            if exists is None:
                key = await self._key(store.key.tenant)
                sealed = seal(key, data, store.cold_aad(digest))
                await objectstore.put_bytes(s3, self.bucket, name, sealed)
                uploaded += len(data)
            out.append(
                {
                    "c": record["c"],
                    "k": "ref",
                    "t": "cold",
                    "o": "cold",
                    "hash": digest,
                    "size": len(data),
                }
            )
        return out, uploaded

    async def _cold_value(self, store: _Agent, ref: dict[str, Any]) -> dict[str, Any]:
        """A ``ref`` record as the blob it names (BLAKE3 checked)."""
        digest = str(ref.get("hash"))
        key = await self._key(store.key.tenant)
        name = f"{store.prefix}cold/{digest}"
        try:
            sealed = await objectstore.get_bytes(self._need_store(), self.bucket, name)
        except objectstore.ObjectMissing:
            raise StateError("corrupt", f"cold object {name} is missing") from None
        try:
            data = open_sealed(key, sealed, store.cold_aad(digest), f"cold object {name}")
        except SealError as exc:
            raise StateError("corrupt", str(exc)) from None
        if blake3.blake3(data).hexdigest() != digest:
            raise StateError("corrupt", f"cold object {name} does not hash to its name")
        return {"c": ref["c"], "k": "blob", "t": "cold", "o": "full", "data": data, "hash": digest}

    async def verify_cold(self, store: _Agent) -> list[str]:
        """Re-verify every cold object of an agent; returns (and logs) the broken ones."""
        s3 = self._need_store()
        names = await asyncio.to_thread(
            lambda: [
                o.object_name for o in s3.list_objects(self.bucket, prefix=f"{store.prefix}cold/")
            ]
        )
        broken = []
        for name in names:
            digest = name.rsplit("/", 1)[1]
            try:
                await self._cold_value(store, {"c": "-", "hash": digest})
            except StateError as exc:
                log.error("state of %s: %s", store.key, exc.message)
                broken.append(name)
        return broken

    async def _local_state(
        self, store: _Agent
    ) -> tuple[int, list[dict[str, Any]], list[_Entry], int]:
        """``(warm seq, warm records, journal entries after it, bytes read)``."""
        key = await self._key(store.key.tenant)

        def read() -> tuple[int, list[dict[str, Any]], list[_Entry], int]:
            seqs = store.warm_seqs()
            warm_seq, warm_records, size = 0, [], 0
            if seqs:
                warm_seq = seqs[-1]
                blob = store.warm_path(warm_seq).read_bytes()
                size += len(blob)
                warm_records = _open_warm(key, store, warm_seq, blob)
            entries = [e for e in _read_journal(store.journal) if e.seq > warm_seq]
            size += sum(e.size for e in entries)
            return warm_seq, warm_records, entries, size

        try:
            return await asyncio.to_thread(read)
        except SealError as exc:
            raise StateError("corrupt", str(exc)) from None

    async def _materialize(self, store: _Agent) -> tuple[list[dict[str, Any]], int, int]:
        """What a fetch sends: the warm snapshot's records then every checkpoint after it,
        cold refs resolved. Returns ``(records, deltas, bytes)``."""
        _, warm_records, entries, size = await self._local_state(store)
        records = list(warm_records)
        for entry in entries:
            records.extend(entry.records)
        resolved = []
        for record in records:
            if record.get("k") == "ref":
                record = await self._cold_value(store, record)
            resolved.append(record)
        return resolved, len(entries), size

    async def _warm(self, store: _Agent, sandbox_id: str) -> None:
        """Merge the journal into a full snapshot on disk and in the object store, replace the
        agent's JetStream deltas by a rollup marker, cut the journal; keep
        ``warm_snapshots_kept``.

        The agent's checkpoints wait only for the two short steps under ``store.lock`` (read
        the journal; publish the marker and cut the journal), not for the merge and upload:
        checkpoints that arrived meanwhile are carried, sealed, in the marker itself, so the
        rollup that drops the deltas up to the snapshot never drops a later one (when they
        are too many to carry, the rollup waits for the next merge)."""
        started = time.monotonic()
        async with store.lock:
            _, warm_records, entries, _ = await self._local_state(store)
        if not entries:
            return
        seq = entries[-1].seq
        key = await self._key(store.key.tenant)
        session = self._owners.get(store.key)
        kept = session.plan.warm_snapshots_kept if session is not None else 3
        try:
            merged = await asyncio.to_thread(
                merge.merge, [*warm_records, *(r for e in entries for r in e.records)]
            )
            merged, _ = await self._cold(store, merged)  # whole blobs assembled from parts
        except merge.RecordError as exc:
            log.error("state of %s: cannot merge: %s", store.key, exc)
            return

        def build() -> tuple[bytes, int]:
            body = msgpack.packb({"seq": seq, "records": merged}, use_bin_type=True)
            packed = zstandard.ZstdCompressor(level=3).compress(body)
            sealed = seal(key, packed, store.warm_aad(seq))
            store.warm_dir.mkdir(parents=True, exist_ok=True)
            _write_atomic(store.warm_path(seq), sealed)
            store.warm_bytes = len(sealed)
            return sealed, len(merged)

        sealed, count = await asyncio.to_thread(build)
        s3 = self._need_store()
        await objectstore.put_bytes(s3, self.bucket, f"{store.prefix}warm/{seq}", sealed)
        async with store.lock:
            later = [
                e for e in await asyncio.to_thread(_read_journal, store.journal) if e.seq > seq
            ]
            carry = b""
            if later:
                body = msgpack.packb(
                    [{"seq": e.seq, "records": e.records} for e in later], use_bin_type=True
                )
                carry = seal(key, body, carry_aad(store.subject, seq))
            if len(carry) <= CARRY_MAX:
                await self._need_js().publish(
                    store.subject,
                    carry,
                    headers={
                        "Nats-Msg-Id": f"{store.state_id}.{seq}.warm.{store.seq}",
                        "Nats-Rollup": "sub",
                        SEQ_HEADER: str(store.seq),
                        WARM_HEADER: str(seq),
                        **({SANDBOX_HEADER: store.writer} if store.writer else {}),
                    },
                )

            def cut() -> int:
                tmp = store.journal.with_name(".journal.tmp")
                with tmp.open("wb") as fh:
                    for entry in later:
                        fh.write(_journal_frame(entry.seq, entry.records))
                os.replace(tmp, store.journal)
                return store.journal.stat().st_size

            store.journal_bytes = await asyncio.to_thread(cut)

        def prune() -> None:
            seqs = store.warm_seqs()
            for old in seqs[: max(0, len(seqs) - kept)]:
                with contextlib.suppress(FileNotFoundError):
                    store.warm_path(old).unlink()

        await asyncio.to_thread(prune)
        CHECKPOINTS.labels("warm").inc()
        names = await asyncio.to_thread(
            lambda: [
                o.object_name for o in s3.list_objects(self.bucket, prefix=f"{store.prefix}warm/")
            ]
        )
        remote = sorted(int(n.rsplit("/", 1)[1]) for n in names if n.rsplit("/", 1)[1].isdigit())
        for old in remote[: max(0, len(remote) - kept)]:
            await asyncio.to_thread(s3.remove_object, self.bucket, f"{store.prefix}warm/{old}")
        await self._event(
            events.StateCheckpointed(
                agent=store.key.agent,
                group=store.key.group,
                tier="warm",
                seq=seq,
                bytes=len(sealed),
                records=count,
                pause_ms=0.0,
                durable_ms=round((time.monotonic() - started) * 1000, 3),
            ),
            sandbox_id,
        )


def _open_warm(key: bytes, store: _Agent, seq: int, blob: bytes) -> list[dict[str, Any]]:
    packed = open_sealed(key, blob, store.warm_aad(seq), f"warm snapshot {seq} of {store.prefix}")
    body = zstandard.ZstdDecompressor().decompress(packed, max_output_size=1 << 34)
    item = msgpack.unpackb(body, raw=False, strict_map_key=False)
    return list(item["records"])


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
