"""Red team: attacks on the state plane, the hand-over, restarts and their events.

The attacker runs arbitrary code in a sandbox (it speaks the keeper's wire itself, through the
socket the broker hands out) and may publish anything on the bus with a tenant user's
credentials. Each test is one attack and asserts what a user would observe when it fails: an
error frame with its code, the victim's state unchanged, a forged event ignored.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import socket
import struct
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import nats
import pytest
from dsec_core import events, natsperms
from dsec_core.natsperms import inbox_prefix
from dsec_core.settings import Settings
from dsec_core.spec.plan import StatePlan
from dsec_core.subjects import STATE_STREAM, STREAM, subject_for
from dsec_core.trust import Gate, KeyRing, scan_seq
from dsec_nodeagent.state.handover import HandOverHooks, hand_over
from dsec_nodeagent.state.keeper import SandboxState, StateKeeper, StateKey
from dsec_testing import trust

sys.path.insert(0, str(Path(__file__).parents[1] / "services" / "nodeagent" / "tests"))
from _state_testkit import FakeAgent, keeper_settings

pytestmark = pytest.mark.integration

NODE = "node-1"
GROUP = "g1"


class Agent(FakeAgent):
    """The attacker's end of a state socket (its task group: ``GROUP`` unless it says)."""

    async def hello(self, agent: str, group: str = GROUP, *, handover: bool = False) -> Any:
        return await super().hello(agent, group, handover=handover)


def kv(**items: Any) -> list[dict[str, Any]]:
    return [{"c": "memo", "k": "kv", "t": "hot", "o": "set", "items": items}]


@dataclass
class Node:
    keeper: StateKeeper
    tasks: list[asyncio.Task[None]]
    stopped: list[str]

    async def connect(self, sandbox_id: str) -> Agent:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self.tasks.append(asyncio.create_task(self.keeper.serve(ours, sandbox_id)))
        return await Agent(theirs).open()

    def register(
        self,
        tenant: str,
        agent: str,
        *,
        group: str = GROUP,
        handover_from: str | None = None,
    ) -> str:
        sid = f"sbx-{uuid.uuid4().hex[:10]}"
        self.keeper.register_sandbox(
            SandboxState(
                sid,
                tenant,
                group,
                agent,
                StatePlan(warm_interval_s=3600),
                handover_from=handover_from,
                cgroup_dir="/nonexistent-cgroup",
            )
        )
        return sid


class NoFreezer:
    async def freeze(self, cgroup_dir: str) -> None:
        raise AssertionError("an attack must never reach the freezer")

    async def thaw(self, cgroup_dir: str) -> None:
        return None


@dataclass
class World:
    settings: Settings
    js: Any
    gate: Gate
    pipe: trust.Pipeline
    home: Path
    tmp: Path

    @contextlib.asynccontextmanager
    async def node(self, name: str) -> AsyncIterator[Node]:
        async def publish(payload: events.Payload, aggregate_id: str) -> None:
            await self.pipe.nodeagent.publish(payload, aggregate_id=aggregate_id)

        keeper = StateKeeper(
            self.settings,
            publish,
            journal_dir=self.tmp / name / "shm",
            warm_dir=self.tmp / name / "disk",
            registered_only=True,
        )
        node = Node(keeper, [], [])

        async def stop_new(sandbox_id: str, why: str) -> None:
            node.stopped.append(sandbox_id)

        hooks = HandOverHooks(freezer=NoFreezer(), stop_new=stop_new, ready_timeout_s=5)
        keeper.handover = functools.partial(hand_over, hooks=hooks)
        await keeper.start()
        try:
            yield node
        finally:
            await keeper.stop()
            for task in node.tasks:
                task.cancel()
            await asyncio.gather(*node.tasks, return_exceptions=True)


@pytest.fixture
async def world(
    tmp_path: Path, nats_url: str, s3: Any, vault: Any, dsec_stack: Any
) -> AsyncIterator[World]:
    settings = keeper_settings(tmp_path / "home", nats_url, s3, vault, NODE)
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    pipe = await trust.pipeline(js, dsec_stack.home, node_id=NODE)
    root = trust.stack_root(dsec_stack.home)
    gate = Gate(KeyRing(nc, js, bytes(root.verify_key)), js, None)
    try:
        yield World(settings, js, gate, pipe, dsec_stack.home, tmp_path)
    finally:
        await nc.drain()


def tag() -> str:
    return uuid.uuid4().hex[:8]


async def victim(node: Node, tenant: str, agent: str) -> tuple[str, Agent]:
    """Tenant ``tenant``'s agent, holding its state with two checkpoints (secret=1, then 2)."""
    sid = node.register(tenant, agent)
    owner = await node.connect(sid)
    assert (await owner.hello(agent))["op"] == "welcome"
    await owner.fetch()
    assert (await owner.checkpoint(1, kv(secret=1)))["op"] == "ack"
    assert (await owner.checkpoint(2, kv(secret=2)))["op"] == "ack"
    return sid, owner


async def opened(node: Node, tenant: str, agent: str) -> tuple[str, Agent]:
    """A new sandbox of ``tenant`` running ``agent``, its state open (hello, fetch)."""
    sid = node.register(tenant, agent)
    owner = await node.connect(sid)
    assert (await owner.hello(agent))["op"] == "welcome"
    await owner.fetch()
    return sid, owner


async def still_owns(owner: Agent, seq: int) -> None:
    """The victim's session is intact: its next checkpoint is acknowledged in order."""
    ack = await owner.checkpoint(seq, kv(after=seq))
    assert ack["op"] == "ack" and ack["seq"] == seq, ack


# ---------------------------------------------------------------- 1. the keeper's sessions


async def test_same_agent_name_in_another_tenant_sees_nothing_of_the_first(world: World) -> None:
    """Tenant B runs an agent of the same group and name: a different state, empty."""
    agent = f"a{tag()}"
    async with world.node("a") as node:
        _, owner = await victim(node, f"ta{tag()}", agent)
        await owner.close()
        # another node (no local journal): only the shared plane could leak it
    async with world.node("b") as node_b:
        intruder_sid = node_b.register(f"tb{tag()}", agent)
        intruder = await node_b.connect(intruder_sid)
        welcome = await intruder.hello(agent)
        assert welcome["op"] == "welcome" and welcome["seq"] == 0, welcome
        records, fetched = await intruder.fetch()
        assert records == [] and fetched["source"] == "empty", fetched
        await intruder.close()


async def test_an_unregistered_sandbox_and_a_foreign_agent_name_are_refused(
    world: World,
) -> None:
    tenant, agent = f"t{tag()}", f"a{tag()}"
    async with world.node("a") as node:
        _, owner = await victim(node, tenant, agent)
        stranger = await node.connect("sbx-not-registered")  # a sandbox without `state:`
        refused = await stranger.hello(agent)
        assert refused["op"] == "error" and refused["code"] == "unregistered", refused
        other = await node.connect(node.register(tenant, f"b{tag()}"))
        refused = await other.hello(agent)
        assert refused["op"] == "error" and refused["code"] == "wrong-agent", refused
        # a refused hello ends the session: no second try on the same socket
        assert other.reader is not None
        assert await asyncio.wait_for(other.reader.read(), 30) == b""
        await still_owns(owner, 3)
        for a in (owner, stranger, other):
            await a.close()


async def test_a_replayed_or_skipped_checkpoint_seq_is_refused_and_changes_nothing(
    world: World,
) -> None:
    tenant, agent = f"t{tag()}", f"a{tag()}"
    async with world.node("a") as node:
        sid, owner = await victim(node, tenant, agent)
        replay = await owner.checkpoint(1, kv(secret="rolled back"))
        assert replay["op"] == "error" and replay["code"] == "bad-seq", replay
        skip = await owner.checkpoint(9, kv(secret="skipped"))
        assert skip["op"] == "error" and skip["code"] == "bad-seq", skip
        await owner.close()
        key = StateKey(tenant, GROUP, agent)
        deadline = asyncio.get_running_loop().time() + 30
        while node.keeper.session_of(key) is not None:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.02)
        again = await node.connect(sid)
        assert (await again.hello(agent))["seq"] == 2
        records, _ = await again.fetch()
        values = [r["items"]["secret"] for r in records if r.get("items", {}).get("secret")]
        assert values[-1] == 2 and "rolled back" not in values and "skipped" not in values
        await again.close()


async def test_a_huge_frame_or_garbage_is_refused_and_the_keeper_serves_others(
    world: World,
) -> None:
    tenant, agent = f"t{tag()}", f"a{tag()}"
    async with world.node("a") as node:
        _, owner = await victim(node, tenant, agent)
        # an announced 4 GiB frame before hello: refused without reading (or allocating) it
        huge = await node.connect(node.register(tenant, f"h{tag()}"))
        await huge.raw(struct.pack(">I", 0xFFFFFFFF))
        frame = await huge.recv()
        assert frame["op"] == "error" and frame["code"] == "bad-request", frame
        # a session that said hello, then sends a frame that is not MessagePack
        junk_agent = f"j{tag()}"
        junk = await node.connect(node.register(tenant, junk_agent))
        assert (await junk.hello(junk_agent))["op"] == "welcome"
        await junk.raw(struct.pack(">I", 5) + b"\xc1\xc1\xc1\xc1\xc1")
        frame = await junk.recv()
        assert frame["op"] == "error" and frame["code"] == "bad-request", frame
        # a checkpoint whose records are not records
        bad_agent = f"r{tag()}"
        bad = await node.connect(node.register(tenant, bad_agent))
        assert (await bad.hello(bad_agent))["op"] == "welcome"
        await bad.send({"op": "checkpoint", "seq": 1, "records": "nope", "pause_ms": 0})
        frame = await bad.recv()
        assert frame["op"] == "error", frame
        # a silent connection (no hello) does not hold the keeper
        await node.connect(node.register(tenant, f"s{tag()}"))
        await still_owns(owner, 3)
        for a in (owner, huge, junk, bad):
            await a.close()


async def test_a_hello_is_small_and_read_only_for_a_sandbox_with_state(world: World) -> None:
    """A sandbox without `state:` sent a 32 MiB hello of empty maps: decoding it stalled the
    node agent's loop for ~6 s and took 2.4 GiB. It is refused before anything is read now,
    and a registered sandbox's hello over 64 KiB is refused unread."""
    tenant, agent = f"t{tag()}", f"a{tag()}"
    async with world.node("a") as node:
        _, owner = await victim(node, tenant, agent)
        stranger = await node.connect(f"sbx-{tag()}")  # never registered
        await stranger.raw(struct.pack(">I", 32 << 20) + b"\x80" * 4096)
        frame = await stranger.recv()
        assert (frame["op"], frame["code"]) == ("error", "unregistered"), frame
        big_agent = f"b{tag()}"
        big = await node.connect(node.register(tenant, big_agent))
        await big.raw(struct.pack(">I", (64 << 10) + 1) + b"\x80" * 4096)
        frame = await big.recv()
        assert (frame["op"], frame["code"]) == ("error", "bad-request"), frame
        assert "max 65536" in frame["message"]
        await still_owns(owner, 3)
        for a in (owner, stranger, big):
            await a.close()


async def test_a_frame_of_too_many_objects_is_refused_unread_and_decoding_is_paced(
    world: World,
) -> None:
    """A sandbox's checkpoint frame of 16 million one-byte empty arrays (16 MiB, under the
    64 MiB frame bound) was decoded on the loop every sandbox on the node shares: 16 million
    lists, ~1.2 GiB and seconds of that loop (64 MiB: ~4.6 GiB, ~20 s). Now a frame's objects
    are counted first, off the loop, and one of more than a frame may hold is refused unread.
    A frame within the bound whose decoding held the loop makes that sandbox's next frame
    wait."""
    from dsec_sdk.state import msgcount

    tenant, agent = f"t{tag()}", f"a{tag()}"
    async with world.node("a") as node:
        _, other = await victim(node, tenant, f"v{tag()}")
        sid, owner = await opened(node, tenant, agent)
        n = 16 << 20
        body = b"\x83\xa2op\xaacheckpoint\xa3seq\x01\xa3pad\xdd" + struct.pack(">I", n)
        body += b"\x90" * n
        await owner.raw(struct.pack(">I", len(body)) + body)
        frame = await owner.recv()
        assert (frame["op"], frame["code"]) == ("error", "bad-request"), frame
        assert f"more than {msgcount.MAX_FRAME_OBJECTS:,} MessagePack objects" in frame["message"]
        assert "refused unread" in frame["message"]
        await still_owns(other, 3)  # the neighbour's session went on
        again = await node.connect(sid)  # the state took nothing of it
        assert (await again.hello(agent))["op"] == "welcome"
        _, fetched = await again.fetch()
        assert fetched["seq"] == 0, fetched
        padded = {"op": "checkpoint", "seq": 1, "records": kv(x=1), "pause_ms": 0.0}
        await again.send({**padded, "pad": [[]] * 900_000})  # within the bound: decoded
        ack = await again.recv()
        assert (ack["op"], ack["seq"]) == ("ack", 1), ack
        assert node.keeper.frame_due[sid] > time.monotonic()  # its next frame waits
        await still_owns(again, 2)
        for a in (other, owner, again):
            await a.close()


async def test_a_frame_whose_map_keys_are_not_strings_is_refused_unread(world: World) -> None:
    """A map keyed by MessagePack timestamps decodes to msgpack.Timestamp keys, whose hash is
    a tuple's (not salted, and invertible): keys made to collide cost the square of their number
    to put in the dict, on the loop every sandbox shares (a 200 KB frame: seconds). A frame's
    map keys must be strings now, checked before it is decoded."""
    tenant, agent = f"t{tag()}", f"a{tag()}"
    async with world.node("a") as node:
        sid, owner = await opened(node, tenant, agent)
        stamps = b"".join(b"\xd6\xff" + struct.pack(">I", i) + b"\xc0" for i in range(2000))
        value = b"\xde" + struct.pack(">H", 2000) + stamps  # {Timestamp(i): None, ...}
        record = b"\x85\xa1c\xa4memo\xa1k\xa2kv\xa1t\xa3hot\xa1o\xa3set\xa5items\x81\xa1x" + value
        body = b"\x84\xa2op\xaacheckpoint\xa3seq\x01\xa8pause_ms\x00\xa7records\x91" + record
        await owner.raw(struct.pack(">I", len(body)) + body)
        frame = await owner.recv()
        assert (frame["op"], frame["code"]) == ("error", "bad-request"), frame
        assert "refused unread: a map key that is not a string" in frame["message"]
        again = await node.connect(sid)
        assert (await again.hello(agent))["op"] == "welcome"
        assert (await again.fetch())[1]["seq"] == 0  # nothing of it was taken
        # timestamps as vectors ids (a list, not a map) met a dict in the warm merge; int ids
        upsert = {"c": "v", "k": "vectors", "t": "warm", "o": "upsert", "dim": 1, "dtype": "<f4"}
        stamped = {
            **upsert,
            "ids": [msgpack.Timestamp(i, 0) for i in range(50)],
            "vec": b"\0" * 200,
        }
        await again.send({"op": "checkpoint", "seq": 1, "records": [stamped], "pause_ms": 0.0})
        frame = await again.recv()
        assert "refused unread: an extension type" in frame["message"], frame
        again = await node.connect(sid)
        assert (await again.hello(agent))["op"] == "welcome"
        await again.fetch()
        ack = await again.checkpoint(1, [{**upsert, "ids": list(range(50)), "vec": b"\0" * 200}])
        assert (ack["op"], ack["code"]) == ("error", "bad-record"), ack
        assert "ids must be a list of strings" in ack["message"]
        # and the hello, read before anything else: the same rules
        late = await node.connect(sid)
        hello = b"\x85\xa2op\xa5hello\xa1v\x01\xa5agent" + msgpack.packb(agent)
        hello += b"\xa5group" + msgpack.packb(GROUP) + b"\xa3pad" + value
        await late.raw(struct.pack(">I", len(hello)) + hello)
        frame = await late.recv()
        assert (frame["op"], frame["code"]) == ("error", "bad-request"), frame
        assert "refused unread: a map key that is not a string" in frame["message"]
        for a in (owner, again, late):
            await a.close()


async def test_a_frame_sent_slowly_cannot_hold_the_nodes_memory(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sandbox announced a large frame and sent its body a byte at a time: the keeper kept
    what came for as long as it chose, and every sandbox of the node could do the same at once
    (each session's reader also buffered up to 128 MiB ahead). Now a frame's bytes come from
    the node's budget of frames in flight (here 16 MiB; 256 MiB by default, one largest frame a
    sandbox) before its body is read, and the body must come within the deadline (here 1 s;
    10 s by default): the neighbour's checkpoint waits its turn, then goes through."""
    from dsec_nodeagent.state import keeper as keeper_module
    from dsec_nodeagent.state.budget import FrameBudget

    monkeypatch.setattr(keeper_module, "BODY_TIMEOUT_S", 1.0)
    tenant = f"t{tag()}"
    async with world.node("a") as node:
        node.keeper.frames = FrameBudget(16 << 20, per_sandbox=16 << 20, per_tenant=16 << 20)
        _, slow = await opened(node, tenant, f"s{tag()}")
        _, other = await opened(node, tenant, f"o{tag()}")
        await slow.raw(struct.pack(">I", 12 << 20) + b"\x00" * 1024)  # announced, barely sent
        for _ in range(500):
            if node.keeper.frames.used:
                break
            await asyncio.sleep(0.01)
        assert node.keeper.frames.used == 12 << 20
        started = time.monotonic()
        checkpoint = asyncio.create_task(other.checkpoint(1, kv(blob=b"x" * (8 << 20))))
        frame = await slow.recv()
        assert (frame["op"], frame["code"]) == ("error", "bad-request"), frame
        assert "12,582,912 bytes did not come within 1 s" in frame["message"]
        ack = await checkpoint
        assert (ack["op"], ack["seq"]) == ("ack", 1), ack
        assert time.monotonic() - started >= 0.5  # it waited for the slow one's deadline
        for _ in range(500):  # (given back once the checkpoint is served: just after its ack)
            if not node.keeper.frames.used:
                break
            await asyncio.sleep(0.01)
        assert node.keeper.frames.used == 0
        for a in (slow, other):
            await a.close()


async def test_odd_frames_and_fields_are_refused_and_never_lock_the_state(world: World) -> None:
    """`seq: true` was acked as checkpoint 1 (True is an int to Python) and wrote a seq header
    no later hello could read: the agent was locked out of its state for good. A map key that
    is a list made the keeper's session end with a traceback and no answer."""
    tenant, agent = f"t{tag()}", f"a{tag()}"
    async with world.node("a") as node:
        sid, owner = await opened(node, tenant, agent)
        await owner.send({"op": "checkpoint", "seq": True, "records": kv(x=1), "pause_ms": 0})
        frame = await owner.recv()
        assert (frame["op"], frame["code"]) == ("error", "bad-request"), frame
        assert (await owner.checkpoint(1, kv(x=1)))["op"] == "ack"
        await owner.close()
        again = await node.connect(sid)  # the agent restarts: its state opens
        assert (await again.hello(agent))["op"] == "welcome"
        _, fetched = await again.fetch()
        assert fetched["op"] == "fetched" and fetched["seq"] == 1
        odd = await node.connect(node.register(tenant, f"o{tag()}"))
        body = b"\x82\xa2op\xa5hello\x81\x90\x00\xc0"  # {"op": "hello", {[]: 0}: nil}
        await odd.raw(struct.pack(">I", len(body)) + body)
        frame = await odd.recv()
        assert (frame["op"], frame["code"]) == ("error", "bad-request"), frame
        await asyncio.gather(node.tasks[-1], return_exceptions=True)
        assert node.tasks[-1].exception() is None  # ended with its answer, no traceback
        for a in (again, odd):
            await a.close()


async def test_reading_a_state_whole_is_paced_per_agent(world: World) -> None:
    """Fetching in a loop re-read the agent's whole journal on the loop each time (24 MiB of
    small values: 1.2-1.6 s a fetch, for every sandbox of the node). A session fetches once
    (as the SDK does, at open); opening the state again waits READ_SHARE times what the last
    open held the loop (a sleep), so a reconnect loop takes at most a fifth of it."""
    tenant, agent = f"t{tag()}", f"a{tag()}"
    async with world.node("a") as node:
        sid, owner = await opened(node, tenant, agent)
        values = {f"k{i}": i for i in range(20_000)}
        assert (await owner.checkpoint(1, kv(**values)))["op"] == "ack"
        await owner.send({"op": "fetch"})
        frame = await owner.recv()
        assert (frame["op"], frame["code"]) == ("error", "bad-request"), frame
        assert "one fetch a session" in frame["message"]
        await owner.close()
        store = node.keeper._agents[StateKey(tenant, GROUP, agent)]
        for _ in range(3):  # reconnecting: each open waits for the last one's pace
            opened_at = asyncio.get_running_loop().time()
            paced_until = store.next_read
            again = await node.connect(sid)
            assert (await again.hello(agent))["op"] == "welcome"
            assert asyncio.get_running_loop().time() >= paced_until
            records, fetched = await again.fetch()
            assert fetched["seq"] == 1 and records
            assert store.next_read > opened_at  # this open paces the next
            await again.close()


def _sparse(name: str, length: int) -> dict[str, Any]:
    return {
        "c": name,
        "k": "array",
        "t": "warm",
        "o": "sparse",
        "dtype": "<f4",
        "shape": [length],
        "idx": struct.pack("<q", 0),
        "val": struct.pack("<f", 1.0),
    }


async def test_arrays_count_at_their_merged_size_not_their_compressed_one(world: World) -> None:
    """Four 305-byte sparse records of 64M floats each: acked, the warm merge allocated 3 GiB
    and the quota counted the 33 KB snapshot. An array counts at its declared size now: one
    over the agent's limit is refused, and arrays that would pass it together are too."""
    tenant, agent = f"t{tag()}", f"a{tag()}"
    async with world.node("a") as node:
        _, owner = await opened(node, tenant, agent)
        limit = StatePlan().max_bytes
        frame = await owner.checkpoint(1, [_sparse("huge", limit // 4 + 1)])
        assert (frame["op"], frame["code"]) == ("error", "bad-record"), frame
        assert "over this agent's state limit" in frame["message"]
        third = limit // 4 // 3  # three arrays of a third of the limit each: fine
        for seq, name in enumerate(("a", "b", "c"), 1):
            assert (await owner.checkpoint(seq, [_sparse(name, third)]))["op"] == "ack"
        frame = await owner.checkpoint(4, [_sparse("d", third)])
        assert (frame["op"], frame["code"]) == ("error", "quota"), frame
        assert "once merged" in frame["message"]
        odd = {**_sparse("e", 4), "dtype": "O"}
        frame = await owner.checkpoint(4, [odd])
        assert (frame["op"], frame["code"]) == ("error", "bad-record"), frame
        await owner.close()


async def test_a_small_shape_cannot_hide_a_large_array(world: World) -> None:
    """A review of the array accounting: a data-less `full` record of a large array, then a
    `sparse` record of the same container declaring `shape: [1]`, counted 4 bytes while the
    merge wrote into (and allocated) the large one. A sparse or slice record must name the
    array's own dtype and shape now, in one checkpoint or across two. A dtype the SDK takes
    (complex256) is taken."""
    tenant, agent = f"t{tag()}", f"a{tag()}"
    async with world.node("a") as node:
        _, owner = await opened(node, tenant, agent)
        big = {"c": "x", "k": "array", "t": "warm", "o": "full", "dtype": "<f4", "shape": [1000]}
        frame = await owner.checkpoint(1, [big, _sparse("x", 1)])
        assert (frame["op"], frame["code"]) == ("error", "bad-record"), frame
        assert "a sparse record of <f4 [1] for an array of <f4 [1000]" in frame["message"]
        assert (await owner.checkpoint(1, [big]))["op"] == "ack"
        frame = await owner.checkpoint(2, [_sparse("x", 1)])
        assert (frame["op"], frame["code"]) == ("error", "bad-record"), frame
        assert (await owner.checkpoint(2, [_sparse("x", 1000)]))["op"] == "ack"
        wide = {**big, "c": "z", "dtype": "<c32", "shape": [2], "data": bytes(64)}
        assert (await owner.checkpoint(3, [wide]))["op"] == "ack"
        await owner.close()


async def test_arrays_held_before_a_node_agent_restart_still_count(world: World) -> None:
    """The declared sizes lived in the node agent's memory only: after a restart, an agent
    that checkpointed without fetching first could add another `state.max_size` of arrays.
    What the state holds is read (once) before the first array checkpoint counts."""
    tenant, agent = f"t{tag()}", f"a{tag()}"
    three_quarters = StatePlan().max_bytes // 4 * 3 // 4  # elements of <f4
    x = {"c": "x", "k": "array", "t": "warm", "o": "full", "dtype": "<f4"}
    async with world.node("a") as node:
        _, owner = await opened(node, tenant, agent)
        assert (await owner.checkpoint(1, [{**x, "shape": [three_quarters]}]))["op"] == "ack"
        await owner.close()
    async with world.node("a") as node:  # the node agent restarted: same journal, new memory
        sid = node.register(tenant, agent)
        raw = await node.connect(sid)
        assert (await raw.hello(agent))["op"] == "welcome"  # (no fetch)
        frame = await raw.checkpoint(2, [{**x, "c": "y", "shape": [three_quarters]}])
        assert (frame["op"], frame["code"]) == ("error", "quota"), frame
        assert (await raw.checkpoint(2, [{**x, "c": "y", "shape": [1000]}]))["op"] == "ack"
        await raw.close()


async def test_an_open_is_paced_by_the_cpu_it_cost_not_by_waiting_on_the_network(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A review of the pacing: it counted wall time, so an open that waited 2 s on JetStream
    (a slow recovery) made the agent's restart wait 8 s. It counts the node agent's CPU now."""
    from dsec_nodeagent.state import keeper as keeper_mod

    real = keeper_mod.StateKeeper._remote_tail

    async def slow(self: Any, store: Any) -> int:
        await asyncio.sleep(2.0)  # the network, the loop idle
        return int(await real(self, store))

    monkeypatch.setattr(keeper_mod.StateKeeper, "_remote_tail", slow)
    tenant, agent = f"t{tag()}", f"a{tag()}"
    async with world.node("a") as node:
        _, owner = await opened(node, tenant, agent)
        store = node.keeper._agents[StateKey(tenant, GROUP, agent)]
        assert store.next_read - asyncio.get_running_loop().time() < 1.0
        await owner.close()


async def test_the_warm_merge_keeps_a_log_as_the_agents_own_restore_does(world: World) -> None:
    """The warm merge kept a log item only if its id sorted after the last as a string, where
    the SDK inserts it in place: the same acked checkpoints restored to different logs before
    and after a merge. Items whose id is not a string are refused now."""
    from dsec_sdk.state import codec

    def append(*ids: Any) -> list[dict[str, Any]]:
        items = [[i, "00", f"msg {i}"] for i in ids]
        return [{"c": "hist", "k": "log", "t": "hot", "o": "append", "items": items}]

    tenant, agent = f"t{tag()}", f"a{tag()}"
    async with world.node("a") as node:
        sid, owner = await opened(node, tenant, agent)
        assert (await owner.checkpoint(1, append("0190-b")))["op"] == "ack"
        assert (await owner.checkpoint(2, append("0190-a", "0190-b")))["op"] == "ack"
        frame = await owner.checkpoint(3, append(9, 10))
        assert (frame["op"], frame["code"]) == ("error", "bad-record"), frame
        session = node.keeper.session_of(StateKey(tenant, GROUP, agent))
        assert session is not None
        await session.warm()
        await owner.close()
        again = await node.connect(sid)  # the agent restarts: restored from the merged state
        assert (await again.hello(agent))["op"] == "welcome"
        after, _ = await again.fetch()
        assert [item[0] for item in codec.fold(after)["hist"].value] == ["0190-a", "0190-b"]
        await again.close()


# ---------------------------------------------------------------- 2. the hand-over


async def test_a_sandbox_not_started_for_a_handover_cannot_take_the_state(world: World) -> None:
    """Same tenant, group and agent, but no handover_from: its hello{handover} is refused,
    it gets nothing of the state, and the owner keeps it."""
    tenant, agent = f"t{tag()}", f"a{tag()}"
    async with world.node("a") as node:
        old, owner = await victim(node, tenant, agent)
        thief_sid = node.register(tenant, agent)  # no handover_from
        thief = await node.connect(thief_sid)
        welcome = await thief.hello(agent, handover=True)
        got = [welcome]
        while got[-1]["op"] != "error":
            got.append(await thief.recv())
        assert got[-1]["code"] == "handover-refused", got
        assert not [f for f in got if f["op"] in ("records", "deltas", "switched")], got
        assert node.stopped == [thief_sid]
        assert node.keeper.session_of(StateKey(tenant, GROUP, agent)) is not None
        await still_owns(owner, 3)
        # the same thief pointing at the right sandbox but as another agent: wrong-agent
        other = node.register(tenant, f"b{tag()}", handover_from=old)
        sneaky = await node.connect(other)
        refused = await sneaky.hello(agent, handover=True)
        assert refused["op"] == "error" and refused["code"] == "wrong-agent", refused
        await still_owns(owner, 4)
        for a in (owner, thief, sneaky):
            await a.close()


async def test_another_tenant_cannot_hand_over_a_sandbox(world: World) -> None:
    """Tenant B's sandbox started with handover_from = tenant A's sandbox (same agent and
    group): the hand-over keys on B's tenant, so there is nothing to take over."""
    agent = f"a{tag()}"
    async with world.node("a") as node:
        old, owner = await victim(node, f"ta{tag()}", agent)
        thief = await node.connect(node.register(f"tb{tag()}", agent, handover_from=old))
        refused = await thief.hello(agent, handover=True)
        assert refused["op"] == "error" and refused["code"] == "no-handover", refused
        await still_owns(owner, 3)
        await owner.close()
        await thief.close()


async def test_a_second_hand_over_of_one_state_is_refused_while_one_runs(world: World) -> None:
    """The new version said hello{handover} on two sockets: two hand-overs asked the old one
    for its final checkpoint, one switched the state to the new version and the other failed
    and stopped it (both versions dead). The second is refused now."""
    tenant, agent = f"t{tag()}", f"a{tag()}"
    async with world.node("a") as node:
        old, owner = await victim(node, tenant, agent)
        new_sid = node.register(tenant, agent, handover_from=old)
        first = await node.connect(new_sid)
        assert (await first.hello(agent, handover=True))["op"] == "welcome"
        second = await node.connect(new_sid)
        refused = await second.hello(agent, handover=True)
        assert (refused["op"], refused["code"]) == ("error", "state-held"), refused
        assert "being handed over" in refused["message"]
        for a in (owner, first, second):
            await a.close()


async def test_a_new_version_that_never_reads_fails_its_hand_over_in_time(world: World) -> None:
    """The new version said hello{handover} and never read again: the deltas forwarded to it
    blocked, the ready timeout was never looked at, and the old version's checkpoints queued
    for it without end. One deadline covers it all now: the hand-over fails (the new version
    is stopped) and the old one checkpoints on."""
    tenant, agent = f"t{tag()}", f"a{tag()}"
    loop = asyncio.get_running_loop()
    async with world.node("a") as node:
        old, owner = await victim(node, tenant, agent)
        new_sid = node.register(tenant, agent, handover_from=old)
        new = await node.connect(new_sid)
        assert (await new.hello(agent, handover=True))["op"] == "welcome"
        seq, give_up = 3, loop.time() + 30  # (the world's ready timeout is 5 s)
        while new_sid not in node.stopped:
            assert loop.time() < give_up, "the hand-over never ended"
            ack = await owner.checkpoint(seq, kv(big="x" * (256 << 10), n=seq))
            assert ack["op"] == "ack", ack
            seq += 1
        await still_owns(owner, seq)
        for a in (owner, new):
            await a.close()


# ---------------------------------------------------------------- the bus


def test_a_tenant_user_may_not_read_or_write_the_state_stream() -> None:
    """The user's NATS permissions (and the deployed config) give no access to DSEC_STATE:
    no subscription to dsec_state.>, no publish there, no message get, no consumer on it."""
    perms = natsperms.permissions(natsperms.USER)
    allowed_pub = perms["publish"]["allow"]
    allowed_sub = perms["subscribe"]["allow"]
    assert not [s for s in allowed_sub if s.startswith("dsec_state") or s == ">"]
    assert not [s for s in allowed_pub if "dsec_state" in s or STATE_STREAM in s or s == ">"]
    assert not [s for s in allowed_pub if s.startswith("$JS.API.CONSUMER.CREATE.>")]
    for role in (*natsperms.SERVICES, natsperms.FLEETSIM):
        if role == "nodeagent":
            continue
        perms = natsperms.permissions(role)
        assert not [p for p in perms["publish"]["allow"] if "dsec_state" in p or STATE_STREAM in p]
    assert (
        natsperms.render_deploy_config()
        == (Path(__file__).parents[1] / "deploy" / "nats" / "nats-server.conf").read_text()
    )


async def test_a_forged_sandbox_restarted_is_refused_by_the_gate(world: World) -> None:
    """sandbox.restarted is the node agent's: a tenant user's key, or the node agent of
    another node than the sandbox's, cannot make one the read model believes."""
    sid = f"sbx-{tag()}"
    await world.pipe.scheduler.publish(events.SandboxScheduled(node_id=NODE), aggregate_id=sid)
    forged = events.SandboxRestarted(restarts=99, exit_code=1, signal=None, reason="x", pid=1)
    await world.pipe.user.publish(forged, aggregate_id=sid)
    elsewhere = await trust.publisher(world.js, world.home, "nodeagent", node_id="node-evil")
    await elsewhere.publish(forged, aggregate_id=sid)
    await world.pipe.nodeagent.publish(
        events.SandboxRestarted(restarts=1, exit_code=1, signal=None, reason="real", pid=2),
        aggregate_id=sid,
    )
    accepted = []
    async for seq, data in scan_seq(world.js, subject_for("sandbox.restarted", sid), 100):
        envelope = await world.gate.authentic(data, stream_seq=seq)
        if envelope is not None:
            accepted.append(envelope.payload["restarts"])
    assert accepted == [1]


# ---------------------------------------------------------------- 4. the Python client

SPEC = """\
version: "1.2"
name: attack-client
base: dsec/python311:latest
entrypoint: [python, -u, agent.py]
resources: {cpu: 1, memory: 128MiB, pids: 32}
timeout: 5m
"""


async def test_the_client_never_waits_on_a_forged_ready(
    world: World, stack_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`wait("ready")` is not satisfied by a sandbox.ready a tenant user signed, nor by one
    the node agent of another node signed; the real one (its node's agent) satisfies it."""
    from dsec_client import DSec, Timeout

    for name, value in stack_env.items():
        monkeypatch.setenv(name, value)
    sid = f"sbx_{tag()}"
    await world.pipe.built(SPEC, sid)
    await world.pipe.scheduler.publish(events.SandboxScheduled(node_id=NODE), aggregate_id=sid)
    elsewhere = await trust.publisher(world.js, world.home, "nodeagent", node_id="node-evil")
    for forger, node_id in ((world.pipe.user, NODE), (elsewhere, "node-evil")):
        forged = events.SandboxReady(node_id=node_id, pid=666, cgroup="/evil")
        await forger.publish(forged, aggregate_id=sid)
    warnings: list[str] = []
    async with DSec(verify=True, on_warning=warnings.append) as d:
        sandbox = d.sandbox(sid)
        with pytest.raises(Timeout):
            await sandbox.wait("ready", timeout=3)
        assert sandbox.state != "running"
        assert any("unauthentic sandbox.ready" in w for w in warnings), warnings
        real = events.SandboxReady(node_id=NODE, pid=42, cgroup="/sys/fs/cgroup/x")
        await world.pipe.nodeagent.publish(real, aggregate_id=sid)
        ready = await d.sandbox(sid).wait("ready", timeout=60)
        assert ready.data["pid"] == 42 and ready.producer == "nodeagent" and ready.verified


# ---------------------------------------------------------------- 5. the event archive

ARCHIVE_BUCKET = "attack-archive"


@pytest.fixture
def private_stack(tmp_path: Path) -> Iterator[Any]:
    """A stack of its own: the test deletes the stream and rewrites the archive."""
    from dsec_testing.stack import StackFixture

    fixture = StackFixture(tmp_path / "private")
    try:
        yield fixture
    finally:
        fixture.discard()


@pytest.mark.parametrize("attack", ["drop-and-renumber", "drop-tail"])
async def test_an_event_cut_out_of_the_archive_is_found(
    private_stack: Any, dsec_cli: Any, tmp_path: Path, attack: str
) -> None:
    """Whoever may rewrite the archive's objects (segments and manifest) cuts a node agent's
    event out, renumbers what follows (or cuts the tail) so sequences and hashes agree, and the
    stream itself is gone: `audit verify --archive` still fails."""
    from dsec_core import eventarchive, objectstore
    from dsec_core.bus import ensure_stream
    from dsec_core.events import SandboxExited, SpecSubmitted

    s3 = private_stack.s3
    env = {
        "DSEC_NATS_URL": private_stack.nats_url,
        # The operator's machine: `events archive` signs the manifest with the operator key.
        "DSEC_HOME": str(trust.operator_cli_home(private_stack.home, tmp_path / "cli")),
        "DSEC_TRUST_ROOT": bytes(trust.stack_root(private_stack.home).verify_key).hex(),
        "DSEC_S3_ENDPOINT": s3.endpoint,
        "DSEC_S3_ACCESS_KEY": s3.access_key,
        "DSEC_S3_SECRET_KEY": s3.secret_key,
        "DSEC_S3_BUCKET": ARCHIVE_BUCKET,
    }
    nc = await nats.connect(private_stack.nats_url)
    js = nc.jetstream()
    try:
        await ensure_stream(js)
        user = await trust.publisher(js, private_stack.home, "user", subject="user-alpha")
        agent = await trust.publisher(js, private_stack.home, "nodeagent", node_id="n1")
        for i in range(4):  # seq 1, 2 keys; then submitted/exited pairs: exits at 4, 6, 8, 10
            await user.publish(SpecSubmitted(spec_yaml=f"v{i}"), aggregate_id=f"sbx_a{i}")
            exited = SandboxExited(exit_code=0, reason="ok", duration_s=i)
            await agent.publish(exited, aggregate_id=f"sbx_ax{i}")
        archived = dsec_cli("events", "archive", "--segment-events", "5", "--json", env=env)
        assert archived.exit_code == 0, archived.output
        assert dsec_cli("audit", "verify", "--archive", "--json", env=env).exit_code == 0
        await js.delete_stream(STREAM)  # the live log is lost: only the archive tells
        await ensure_stream(js)
    finally:
        await nc.close()

    store = s3.client()
    anchor = bytes(trust.stack_root(private_stack.home).verify_key)
    manifest = await eventarchive.read_manifest(store, ARCHIVE_BUCKET, anchor)
    assert manifest is not None and manifest.last_seq == 10
    last = manifest.segments[-1]
    blob = store.get_object(ARCHIVE_BUCKET, last.key).read()
    records = eventarchive.unpack_segment(blob)
    if attack == "drop-and-renumber":  # the exit at seq 8 never happened
        kept = [r for r in records if r.seq != 8]
        kept = [
            eventarchive.Record(last.first_seq + i, r.subject, r.stored_us, r.data)
            for i, r in enumerate(kept)
        ]
    else:  # the last exit (seq 10) never happened
        kept = records[:-1]
    segment, data = eventarchive.make_segment(kept)
    await objectstore.put_bytes(store, ARCHIVE_BUCKET, segment.key, data)
    forged = eventarchive.Manifest(
        segments=[*manifest.segments[:-1], segment],
        last_hash=eventarchive.message_hash(kept[-1].data),
        prev=manifest.prev,
        cert=manifest.cert,  # the operator's certificate and signature, kept: they no longer fit
        sig=manifest.sig,
    )
    await objectstore.put_bytes(store, ARCHIVE_BUCKET, eventarchive.MANIFEST_KEY, forged.to_bytes())
    for args in (("events", "archived", "--json"), ("audit", "verify", "--archive", "--json")):
        refused = dsec_cli(*args, env=env)
        assert refused.exit_code == 1, refused.output
        assert "signature does not match" in " ".join(refused.output.split())
    unsigned = dataclasses.replace(forged, cert=None, sig=None)
    await objectstore.put_bytes(
        store, ARCHIVE_BUCKET, eventarchive.MANIFEST_KEY, unsigned.to_bytes()
    )
    verified = dsec_cli("audit", "verify", "--archive", "--json", env=env)
    assert verified.exit_code == 1, verified.output
    assert "manifest.json is not signed" in " ".join(verified.output.split())


# ---------------------------------------------------------------- the bus, for real


@contextlib.asynccontextmanager
async def connected_as(dsec_stack: Any, identity: str) -> AsyncIterator[tuple[Any, list[str]]]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc).lower())

    nc = await nats.connect(
        dsec_stack.nats_plain_url,
        nkeys_seed=str(dsec_stack.nats_seed(identity)),
        inbox_prefix=inbox_prefix(identity),
        error_cb=on_error,
        max_reconnect_attempts=0,
    )
    try:
        yield nc, errors
    finally:
        await nc.close()


async def violation(errors: list[str], text: str) -> None:
    deadline = asyncio.get_running_loop().time() + 10
    while not any(text.lower() in e and "permissions violation" in e for e in errors):
        assert asyncio.get_running_loop().time() < deadline, (text, errors)
        await asyncio.sleep(0.02)


async def test_a_tenant_user_connection_cannot_touch_dsec_state(
    dsec_stack: Any, world: World
) -> None:
    """A tenant user's real NATS connection: subscribing to dsec_state.>, publishing a chunk
    there and getting a message of the stream are all refused by the server."""
    subject = f"dsec_state.t{tag()}.{GROUP}.a{tag()}"
    await world.js.publish(subject, b"sealed chunk")  # as the test's operator connection
    async with connected_as(dsec_stack, "user-default") as (nc, errors):
        await nc.subscribe("dsec_state.>")
        await violation(errors, 'subscription to "dsec_state.>"')
        await nc.publish(subject, b"forged chunk")
        await violation(errors, f'publish to "{subject}"')
        with pytest.raises(nats.errors.TimeoutError):
            await nc.jetstream(timeout=1.0).get_msg(STATE_STREAM, subject=subject)
        await violation(errors, f"$JS.API.STREAM.MSG.GET.{STATE_STREAM}")
    info = await world.js.stream_info(STATE_STREAM, subjects_filter=subject)
    assert info.state.subjects == {subject: 1}  # the forged chunk never reached the stream


async def test_a_tenant_user_cannot_overhear_the_node_agents_state_reads(
    dsec_stack: Any, world: World
) -> None:
    """Replies go to per-identity inboxes (``_INBOX.<identity>``): a tenant user's connection
    may not subscribe to the shared ``_INBOX.>``, and its own inbox never hears the node
    agent's DSEC_STATE reads (nor anyone else's replies)."""
    subject = f"dsec_state.t{tag()}.{GROUP}.a{tag()}"
    await world.js.publish(subject, b"another tenant's sealed chunk")
    async with connected_as(dsec_stack, "user-default") as (spy, spy_errors):
        heard: list[Any] = []

        async def listen(msg: Any) -> None:
            heard.append(msg)

        await spy.subscribe("_INBOX.>", cb=listen)
        await violation(spy_errors, 'subscription to "_INBOX.>"')
        await spy.subscribe("_INBOX.*.>", cb=listen)
        await violation(spy_errors, 'subscription to "_INBOX.*.>"')
        await spy.subscribe("_INBOX.nodeagent.>", cb=listen)
        await violation(spy_errors, 'subscription to "_INBOX.nodeagent.>"')
        refused = len(spy_errors)
        await spy.subscribe(f"{inbox_prefix('user-default')}.>", cb=listen)  # its own: allowed
        await spy.flush()
        async with connected_as(dsec_stack, "nodeagent") as (agent, agent_errors):
            msg = await agent.jetstream().get_msg(STATE_STREAM, subject=subject)
            assert msg.data == b"another tenant's sealed chunk"
            assert agent_errors == []
        await spy.flush()
        assert len(spy_errors) == refused, spy_errors  # its own inbox was not refused
        # the stream's answer (JSON: the message's subject, headers and base64 payload)
        assert not [m for m in heard if subject.encode() in m.data], "overheard"


async def test_a_forged_cold_ref_never_reads_another_agents_blob(world: World) -> None:
    """Agent B of the same tenant checkpoints ``ref`` records naming agent A's cold blob (its
    hash, then a path that climbs into A's prefix): B's fetch never returns A's bytes."""
    import blake3

    tenant = f"t{tag()}"
    secret = b"A's private weights " + tag().encode()
    digest = blake3.blake3(secret).hexdigest()
    async with world.node("a") as node:
        a_agent, b_agent = f"a{tag()}", f"b{tag()}"
        a = await node.connect(node.register(tenant, a_agent))
        assert (await a.hello(a_agent))["op"] == "welcome"
        await a.fetch()
        blob = {"c": "w", "k": "blob", "t": "cold", "o": "full", "data": secret, "hash": digest}
        assert (await a.checkpoint(1, [blob]))["op"] == "ack"
        b = await node.connect(node.register(tenant, b_agent))
        assert (await b.hello(b_agent))["op"] == "welcome"
        await b.fetch()
        climbs = f"../../{a_agent}/cold/{digest}"
        for seq, target in enumerate((digest, climbs), start=1):
            ref = {"c": "w", "k": "ref", "t": "cold", "o": "cold", "hash": target, "size": 1}
            await b.checkpoint(seq, [ref])  # acked or refused: either way, never served
        await b.send({"op": "fetch"})
        served: list[Any] = []
        while True:
            frame = await b.recv()
            served.append(frame)
            if frame["op"] != "records":
                break
        assert secret not in repr(served).encode() and repr(secret) not in repr(served)
        assert served[-1]["op"] == "error", served[-1]
        for agent in (a, b):
            await agent.close()
