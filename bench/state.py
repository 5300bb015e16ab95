"""Agent state checkpoints: DSec delta checkpoints beside full pickle / np.savez checkpoints of the
same state and DSec without deltas, one run.

    uv run python bench/state.py [--quick] [--json] [--stack] [--dir DIR]

The state looks like a working agent's (generated, seeded, identical for every contender):

- ``history``: 50,000 chat messages, realistic dicts of ~300-1,000 bytes (role, content, token
  count, model, tool calls and their results);
- ``adapter``: a 64 MiB float32 array (4096 x 4096; a LoRA-sized adapter), 1 % of its elements
  changing per step;
- ``index``: a vector index of 100,000 vectors (dim 64, float32) with 100 upserts per step
  (80 updated, 20 new);
- ``scratch``: a small key/value map (the tool call stack and a cache), 3 keys set and one
  deleted per step.

A step is what the agent changes between two checkpoints (5 s of work at the spec's default
interval; simulated: the changes are applied as fast as they can be). Contenders:

- ``dsec``: ``dsec_sdk.state`` with delta checkpoints: every step ``state.checkpoint()`` (an
  explicit one: every tier, waits until durable). *pause* = the time the containers are locked
  while the deltas are captured (``CheckpointInfo.pause_ms``: the agent can't change its state,
  it can do anything else); *checkpoint call* = the whole ``checkpoint()`` call (the pause plus
  encoding, writing and the store's ack: an automatic checkpoint does this in the background).
- ``dsec_full``: the same SDK with every container marked changed before each checkpoint, so each
  one writes the full value of every container (the same machinery without deltas).
- ``pickle``: what a user writes without DSec: ``pickle.dump`` (protocol 5) of a dict holding
  the message list, the numpy arrays and the kv dict, to a file, ``fsync``, atomic rename. The
  agent is blocked for all of it (its state must not change while it is serialized): that is
  its pause. ``serialize_only_p50_ms``: ``pickle.dumps`` alone, the least it could block for
  with the write moved to a background thread.
- ``savez``: ``np.savez`` of the arrays + the history and kv as JSON, ``fsync``, rename.

After the steps, DSec's local store folds its journal into one snapshot (``warm_merge_s``: what
the node's keeper does every ``warm_interval``, off the agent's path; the local store would
otherwise do it inside a ``checkpoint()`` call once its journal passes 256 MiB, so the benchmark
runs it once, apart, and keeps it out of the checkpoint figures).

Recovery = opening the store and restoring every container (DSec: ``AgentState.open`` +
declaring the containers: the snapshot plus the checkpoints after it; pickle: ``pickle.load``;
savez: ``np.load`` + ``json.load``), then checked equal to the state before the "crash" (a digest
of every container, not timed). Every contender reads files this run just wrote (the page cache
is warm for all alike: a restart on the same node).

Hand-over interruption, twice:

- its in-process core with this state (``handover_in_process_ms``, the worst of N runs, and its
  p50): the new version is restored beforehand (untimed, as it is in the real flow while the
  old one still serves); then the old version makes one step of changes and, timed, takes its
  final checkpoint (pause, pack, durable write), the frame is forwarded and decoded, and the new
  version applies it. Not in it: the node's share (the cgroup freeze, the broker's switch).
- the real one through the node agent (``handover_node``, ``--node-runs``, root; 0 skips it):
  the embedded stack's servers (JetStream ``DSEC_STATE``, S3, OpenBao; not timed) and the node
  agent service in this process; a sandbox whose SDK agent counts in its state (a checkpoint
  before each count: a small state, so this is the node's share) and serves the count as a
  tool, and another sandbox of its task group calling that tool in a loop. Each run submits a
  new version with ``handover_from`` (what ``dsec sandbox upgrade`` submits) and reads
  ``state.handed_over``: ``interruption_ms`` is the node agent's own measure, from asking the
  old version for its final delta (it takes no call from then on) through the freeze and the
  broker's switch to the new version owning the state. Beside it, what the caller saw: the
  call its first answer by the new version came to (``caller_switch_call_ms``: the call that
  crossed the switch, re-sent to the new version if the old one had stopped taking calls; the
  tool says which sandbox answered), and its slowest call from the submission through that one
  (``caller_call_ms``: the new version's start shares the 2 cores), against its median call
  before (``caller_call_before_ms``). Every run checks that the count went on with nothing lost
  or repeated; the bench stops at the caller's first failed call.

The store: by default the SDK's local store (plain Python, a directory on this machine's disk;
``--dir /dev/shm`` puts every contender's files on tmpfs, as the keeper's hot journal is).
``--stack`` runs DSec through the node agent's state keeper on the embedded stack instead: the
servers start first (not timed), the keeper in a process of its own (as in the node agent), a
session per contender over a Unix socket (as the IPC broker hands one to a sandbox); it journals
to tmpfs and acks once the encrypted chunks are in JetStream; the hand-over's stream is taken
from each ack (what the keeper forwards to a new version once a checkpoint is durable).

With ``--json`` only the ratio line and the JSON line are printed; the last line is
``{"pause_p99_ms", "recovery_s", "handover_interruption_ms", "handover_node_interruption_ms",
"bytes_per_checkpoint", "full_checkpoint_bytes"}`` (DSec's figures; the node's: the worst of its
runs, null when not run; ``full_checkpoint_bytes``: the pickle peer's). ``--quick`` (fewer
steps, same state, 3 hand-overs through the node) takes about a minute on 2 cores.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import hashlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
from _common import emit, percentile, until

SEED = 2026
MESSAGES = 50_000
ADAPTER_SHAPE = (4096, 4096)  # 64 MiB of float32
ADAPTER_CHANGE = 0.01
VECTORS = 100_000
DIM = 64
UPSERTS = 100
NEW_PER_STEP = 20
MESSAGES_PER_STEP = 4  # user, assistant with a tool call, the tool's result, assistant
KV_KEYS = 200
INTERVAL_S = 5.0

TEXT = (
    "the agent searched for recent papers on retrieval augmented generation and found three "
    "relevant results about dense passage retrieval hybrid sparse indexes reranking with cross "
    "encoders latency budget of eighty milliseconds per query evaluation on natural questions "
    "exact match improved by four points when the context window was doubled tool call failed "
    "with a timeout so the planner retried with a narrower query the user asked to summarise the "
    "findings in a table with columns for method dataset score and cost per thousand tokens "
    "gradient accumulation learning rate warmup adapter rank sixteen alpha thirty two dropout"
)


# --------------------------------------------------------------------------------- workload
@dataclass
class Step:
    """What the agent changes between two checkpoints."""

    messages: list[dict[str, Any]]
    adapter_idx: np.ndarray  # flat int64, sorted, unique
    adapter_noise: np.ndarray  # float32, added to the current values
    upsert_ids: list[str]
    upsert_vecs: np.ndarray
    kv_set: dict[str, Any]
    kv_del: list[str]


class Workload:
    """The initial state and the steps, identical for every contender (seeded)."""

    def __init__(self, seed: int = SEED) -> None:
        self.seed = seed
        rng = np.random.default_rng(seed)
        words = np.array(TEXT.split())
        self.corpus = " ".join(words[rng.integers(0, len(words), 400_000)].tolist())
        self.messages = [self._message(rng, n) for n in range(MESSAGES)]
        self.adapter = rng.standard_normal(ADAPTER_SHAPE, dtype=np.float32) * np.float32(0.02)
        self.ids = [f"doc-{i:07d}" for i in range(VECTORS)]
        self.vecs = rng.standard_normal((VECTORS, DIM), dtype=np.float32)
        self.kv = {f"cache:query-{i}": self._tool_result(rng, i) for i in range(KV_KEYS)}

    def _text(self, rng: np.random.Generator, lo: int, hi: int) -> str:
        size = int(rng.integers(lo, hi))
        start = int(rng.integers(0, len(self.corpus) - size))
        return self.corpus[start : start + size]

    def _tool_result(self, rng: np.random.Generator, n: int) -> dict[str, Any]:
        return {"query": f"query {n}", "hits": [self._text(rng, 40, 120) for _ in range(3)]}

    def _message(self, rng: np.random.Generator, n: int) -> dict[str, Any]:
        role = ("user", "assistant", "tool", "assistant")[n % 4]
        msg: dict[str, Any] = {
            "id": f"msg-{n:08d}",
            "role": role,
            "content": self._text(rng, 180, 820),
            "created_at": 1_764_000_000.0 + n * 1.25,
            "tokens": int(rng.integers(40, 220)),
        }
        if role == "assistant":
            msg["model"] = "llama-3.1-8b-instruct+adapter"
            if n % 4 == 1:
                msg["tool_calls"] = [
                    {
                        "id": f"call-{n:08d}",
                        "name": "web_search",
                        "arguments": {"query": self._text(rng, 20, 60), "top_k": 5},
                    }
                ]
        elif role == "tool":
            msg["tool_call_id"] = f"call-{n - 1:08d}"
            msg["name"] = "web_search"
        return msg

    def step(self, i: int) -> Step:
        rng = np.random.default_rng([self.seed, i])
        first = MESSAGES + i * MESSAGES_PER_STEP
        size = ADAPTER_SHAPE[0] * ADAPTER_SHAPE[1]
        idx = np.unique(rng.integers(0, size, int(size * ADAPTER_CHANGE), dtype=np.int64))
        known = rng.choice(VECTORS, UPSERTS - NEW_PER_STEP, replace=False)
        new = [f"doc-{VECTORS + i * NEW_PER_STEP + j:07d}" for j in range(NEW_PER_STEP)]
        return Step(
            messages=[self._message(rng, first + k) for k in range(MESSAGES_PER_STEP)],
            adapter_idx=idx,
            adapter_noise=rng.standard_normal(len(idx), dtype=np.float32) * np.float32(1e-3),
            upsert_ids=[f"doc-{int(k):07d}" for k in known] + new,
            upsert_vecs=rng.standard_normal((UPSERTS, DIM), dtype=np.float32),
            kv_set={
                "stack": [{"tool": "web_search", "depth": d, "step": i} for d in range(3)],
                f"cache:step-{i}": self._tool_result(rng, i),
                "turn": i,
            },
            kv_del=[f"cache:query-{i}"] if i < KV_KEYS else [],
        )


def digest(
    history: list[Any], adapter: np.ndarray, index: dict[str, bytes], kv: dict[str, Any]
) -> str:
    """One hash of a whole state, to check a restore against the state before the crash."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(history, sort_keys=True).encode())
    h.update(np.ascontiguousarray(adapter, dtype=np.float32).tobytes())
    for key in sorted(index):
        h.update(key.encode())
        h.update(index[key])
    h.update(json.dumps(kv, sort_keys=True, default=str).encode())
    return h.hexdigest()


# ------------------------------------------------------------------------ plain-Python peers
class PlainState:
    """The same state as a user keeps it without DSec: a list, arrays and dicts."""

    def __init__(self, w: Workload) -> None:
        self.history = list(w.messages)
        self.adapter = w.adapter.copy()
        self.row = {doc: n for n, doc in enumerate(w.ids)}
        self.ids = list(w.ids)
        self.vecs = np.empty((VECTORS * 2, DIM), dtype=np.float32)  # room to grow
        self.vecs[:VECTORS] = w.vecs
        self.kv = dict(w.kv)

    def apply(self, s: Step) -> None:
        self.history.extend(s.messages)
        flat = self.adapter.reshape(-1)
        flat[s.adapter_idx] += s.adapter_noise
        for doc, vec in zip(s.upsert_ids, s.upsert_vecs, strict=True):
            row = self.row.get(doc)
            if row is None:
                row = self.row[doc] = len(self.ids)
                self.ids.append(doc)
            self.vecs[row] = vec
        self.kv.update(s.kv_set)
        for key in s.kv_del:
            self.kv.pop(key, None)

    def as_dict(self) -> dict[str, Any]:
        return {
            "history": self.history,
            "adapter": self.adapter,
            "index_ids": self.ids,
            "index_vecs": self.vecs[: len(self.ids)],
            "kv": self.kv,
        }

    def digest(self) -> str:
        return plain_digest(self.as_dict())


def plain_digest(d: dict[str, Any]) -> str:
    vecs = d["index_vecs"]
    index = {doc: vecs[n].tobytes() for n, doc in enumerate(d["index_ids"])}
    return digest(d["history"], d["adapter"], index, d["kv"])


def _durable_write(path: Path, write: Callable[[Any], None]) -> int:
    """Write through ``write(fh)`` to a temp file, fsync, rename over ``path``; its size."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with tmp.open("wb") as fh:
        write(fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path.stat().st_size


def pickle_save(d: dict[str, Any], path: Path) -> int:
    return _durable_write(path, lambda fh: pickle.dump(d, fh, protocol=5))


def pickle_dumps(d: dict[str, Any]) -> bytes:
    return pickle.dumps(d, protocol=5)


def pickle_load(path: Path) -> dict[str, Any]:
    with path.open("rb") as fh:
        loaded: dict[str, Any] = pickle.load(fh)
    return loaded


def savez_save(d: dict[str, Any], path: Path) -> int:
    arrays = _durable_write(
        path.with_suffix(".npz"),
        lambda fh: np.savez(fh, adapter=d["adapter"], index_vecs=d["index_vecs"]),
    )
    doc = {"history": d["history"], "index_ids": d["index_ids"], "kv": d["kv"]}
    text = _durable_write(path.with_suffix(".json"), lambda fh: fh.write(json.dumps(doc).encode()))
    return arrays + text


def savez_load(path: Path) -> dict[str, Any]:
    with np.load(path.with_suffix(".npz")) as npz:
        arrays = {k: npz[k] for k in npz.files}
    doc: dict[str, Any] = json.loads(path.with_suffix(".json").read_bytes())
    return {**doc, **arrays}


def bench_peer(
    name: str,
    w: Workload,
    steps: int,
    work: Path,
    save: Callable[[dict[str, Any], Path], int],
    load: Callable[[Path], dict[str, Any]],
    say: Callable[[str], None],
    serialize: Callable[[dict[str, Any]], Any] | None = None,
) -> dict[str, Any]:
    plain = PlainState(w)
    path = work / f"{name}.ckpt"
    pauses, sizes, in_memory = [], [], []
    for i in range(steps + 1):  # the first checkpoint of the initial state, then one per step
        if i:
            plain.apply(w.step(i - 1))
        start = time.perf_counter()
        sizes.append(save(plain.as_dict(), path))
        pauses.append((time.perf_counter() - start) * 1000)
        if serialize is not None:  # the least it must block for: writing in the background
            start = time.perf_counter()
            serialize(plain.as_dict())
            in_memory.append((time.perf_counter() - start) * 1000)
    want = plain.digest()
    del plain
    gc.collect()
    start = time.perf_counter()
    restored = load(path)
    recovery = time.perf_counter() - start
    ok = plain_digest(restored) == want
    del restored
    gc.collect()
    result = {
        "checkpoints": steps + 1,
        "bytes_per_checkpoint": int(np.mean(sizes[1:])),
        "pause_p50_ms": round(percentile(pauses[1:], 0.5), 2),
        "pause_p99_ms": round(percentile(pauses[1:], 0.99), 2),
        "recovery_s": round(recovery, 3),
        "restored_equal": ok,
    }
    if in_memory:
        result["serialize_only_p50_ms"] = round(percentile(in_memory[1:], 0.5), 2)
    say(f"{name:<10} {result}")
    if not ok:
        raise SystemExit(f"{name}: the restored state differs from the saved one")
    return result


# --------------------------------------------------------------------------------- DSec
Forward = Callable[[int, list[dict[str, Any]]], None]
"""Called with each checkpoint's seq and records once it is durable (the hand-over's stream)."""


class Stores(Protocol):
    """Where the DSec contenders keep their state (one directory/key per contender name)."""

    def open(self, name: str, forward: Forward | None = None) -> Any:
        """An ``AgentState`` of contender ``name``, restored from what it checkpointed."""
        ...

    def merge(self, state: Any) -> bool:
        """Fold the checkpoints so far into one snapshot (the warm merge); False: the store
        does it on its own, off the agent's path."""
        ...


class DSecAgent:
    """The state in ``dsec_sdk.state`` containers."""

    def __init__(self, state: Any) -> None:
        self.state = state
        self.history = state.log("history")
        self.kv = state.kv("scratch")
        self.adapter = state.array("adapter", ADAPTER_SHAPE, "float32")
        self.index = state.vectors("index", DIM, "float32")

    def load(self, w: Workload) -> None:
        """Fill an empty state with the initial values."""
        self.history.extend(w.messages)
        self.adapter[...] = w.adapter
        self.index.upsert(w.ids, w.vecs)
        for key, value in w.kv.items():
            self.kv[key] = value

    def apply(self, s: Step) -> None:
        self.history.extend(s.messages)
        current = self.adapter.view().reshape(-1)[s.adapter_idx]
        self.adapter.update(s.adapter_idx, current + s.adapter_noise)
        self.index.upsert(s.upsert_ids, s.upsert_vecs)
        for key, value in s.kv_set.items():
            self.kv[key] = value
        for key in s.kv_del:
            del self.kv[key]

    def mark_all_changed(self) -> None:
        """The ``dsec_full`` knob (this benchmark's, through the containers' private change
        notes): the next checkpoint writes every container whole: the log's every item, every
        key, the whole array, every vector."""
        self.history._sent = 0
        self.kv._set = set(self.kv._data)
        self.adapter.mark_dirty()
        self.index._all = True

    def digest(self) -> str:
        return digest(
            list(self.history),
            self.adapter.view(),
            self.index.value()["rows"],
            dict(self.kv.items()),
        )


def bench_dsec(
    name: str,
    w: Workload,
    steps: int,
    stores: Stores,
    say: Callable[[str], None],
    *,
    full: bool = False,
    handovers: int = 0,
) -> dict[str, Any]:
    forwarded: list[Forward] = []  # the hand-over's receiver, once there is one
    agent = DSecAgent(stores.open(name, lambda seq, rec: [f(seq, rec) for f in forwarded]))
    start = time.perf_counter()
    agent.load(w)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    first = agent.state.checkpoint()
    first_s = time.perf_counter() - start
    pauses, calls, durables, sizes, records = [], [], [], [], []
    for i in range(steps):
        agent.apply(w.step(i))
        if full:
            agent.mark_all_changed()
        start = time.perf_counter()
        info = agent.state.checkpoint()
        calls.append((time.perf_counter() - start) * 1000)
        pauses.append(info.pause_ms)
        durables.append(info.durable_ms)
        sizes.append(info.bytes)
        records.append(info.records)
    result: dict[str, Any] = {
        "checkpoints": steps,
        "bytes_per_checkpoint": int(np.mean(sizes)),
        "records_per_checkpoint": round(float(np.mean(records)), 1),
        "pause_p50_ms": round(percentile(pauses, 0.5), 3),
        "pause_p99_ms": round(percentile(pauses, 0.99), 3),
        "pause_max_ms": round(max(pauses), 3),
        "checkpoint_call_p50_ms": round(percentile(calls, 0.5), 2),
        "checkpoint_call_p99_ms": round(percentile(calls, 0.99), 2),
        "durable_p50_ms": round(percentile(durables, 0.5), 2),
        "first_checkpoint_bytes": first.bytes,
        "first_checkpoint_s": round(first_s, 3),
        "initial_fill_s": round(load_s, 3),
    }
    start = time.perf_counter()
    if stores.merge(agent.state):
        result["warm_merge_s"] = round(time.perf_counter() - start, 3)
    if handovers:
        result.update(bench_handover(agent, w, steps, handovers, forwarded))
    want = agent.digest()
    agent.state.close()  # as a crash would leave it: nothing was left unacknowledged
    del agent
    gc.collect()
    start = time.perf_counter()
    back = DSecAgent(stores.open(name))  # open + restore + declare every container
    result["recovery_s"] = round(time.perf_counter() - start, 3)
    info = back.state.restored
    result["recovery_checkpoints_applied"] = info.deltas
    result["recovery_source"] = info.source
    result["restored_equal"] = back.digest() == want
    back.state.close(checkpoint=False)
    del back
    gc.collect()
    say(f"{name:<10} {result}")
    if not result["restored_equal"]:
        raise SystemExit(f"{name}: the restored state differs from the checkpointed one")
    return result


def bench_handover(
    old: DSecAgent, w: Workload, first_step: int, times: int, forwarded: list[Forward]
) -> dict[str, Any]:
    """The in-process core of a live hand-over, ``times`` times in a row.

    The new version is restored beforehand (untimed: in the real flow it restores while the old
    one still serves, and then receives each of its checkpoints as they become durable). Then,
    each time, the old version makes one step of changes and, timed: its final checkpoint
    (capture = pause, pack, durable write), the frame forwarded and decoded, and the new version
    applying it (under its own lock) -> it could serve. Not in it: the cgroup freeze and the
    broker's switch of the tool name (the node's share: :func:`bench_node_handover`).
    """
    from dsec_sdk.state import AgentState, codec

    records = [r for c in old.state.containers().values() for r in codec.full_records(c)]
    peer = _PeerStore(records)
    new = DSecAgent(AgentState(peer, agent="bench", group="handover", handover=True, auto=False))
    applied: list[float] = []
    done = threading.Event()

    def receive(seq: int, records: list[dict[str, Any]]) -> None:
        peer.deliver({"op": "deltas", "seq": seq, "records": records})
        applied.append(time.perf_counter())
        done.set()

    forwarded.append(receive)
    interruptions: list[float] = []
    for i in range(times):
        old.apply(w.step(first_step + i))
        applied.clear()
        done.clear()
        start = time.perf_counter()
        last = old.state.checkpoint().seq
        while not (done.wait(30) and peer.seq >= last):  # every frame of it applied
            done.clear()
        interruptions.append((applied[-1] - start) * 1000)
    forwarded.clear()
    equal = new.digest() == old.digest()
    peer.deliver({"op": "switched", "interruption_ms": max(interruptions), "seq": 0})
    new.state.close(checkpoint=False)
    if not equal:
        raise SystemExit("hand-over: the new version's state differs from the old one's")
    return {
        "handover_in_process_ms": round(max(interruptions), 2),
        "handover_in_process_p50_ms": round(percentile(interruptions, 0.5), 2),
        "handover_in_process_runs": times,
    }


class _PeerStore:
    """The new version's side of an in-process hand-over: restores ``records`` (the old
    version's state as the keeper would stream it) and delivers forwarded frames."""

    source = "local"

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self._records = records
        self._on_frame: Callable[[dict[str, Any]], None] | None = None
        self.seq = 0  # the last forwarded checkpoint applied

    def hello(self, agent: str, group: str, handover: bool) -> dict[str, Any]:
        return {"op": "welcome", "state_id": "bench", "seq": 0, "config": {}, "handover": True}

    def fetch(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        records, self._records = self._records, []
        return records, {"op": "fetched", "seq": 0, "deltas": 0, "source": "local", "ms": 0.0}

    def checkpoint(self, seq: int, frame: bytes) -> Any:
        raise AssertionError("the new version does not checkpoint in this benchmark")

    def start(self, on_frame: Callable[[dict[str, Any]], None]) -> None:
        self._on_frame = on_frame

    def deliver(self, frame: dict[str, Any]) -> None:
        assert self._on_frame is not None
        self._on_frame(frame)
        self.seq = max(self.seq, int(frame.get("seq") or 0))

    def send(self, frame: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------- stores
class LocalStores:
    """The SDK's local store: a directory per contender under ``work``."""

    def __init__(self, work: Path) -> None:
        self.work = work

    def open(self, name: str, forward: Forward | None = None) -> Any:
        from dsec_sdk.state import AgentState, LocalStore, wire

        class Forwarding(LocalStore):
            def checkpoint(self, seq: int, frame: bytes) -> Any:
                ack = super().checkpoint(seq, frame)
                if forward is not None:
                    body = wire.decode(frame[4:])
                    forward(body["seq"], body["records"])
                return ack

        # No fold inside a checkpoint() call: merge() runs it once, timed apart.
        store = Forwarding(self.work / "dsec" / name, compact_bytes=1 << 62)
        return AgentState(store, agent="bench", group=name, auto=False)

    def merge(self, state: Any) -> bool:
        state._store._compact()
        return True


class KeeperStores:
    """The node agent's state keeper (``dsec_nodeagent.state.keeper``) on the embedded stack, in
    a process of its own (as in the node agent: it does not share the agent's interpreter). Each
    contender has a Unix socket there; a connection is a keeper session, as the IPC broker's
    ``state`` op hands one to a sandbox. The keeper journals to tmpfs, publishes encrypted chunks
    to JetStream and acks; the hand-over's stream is taken from each ack (what the keeper forwards
    to a new version once a checkpoint is durable)."""

    def __init__(self, sockets: Path) -> None:
        self.sockets = sockets

    def open(self, name: str, forward: Forward | None = None) -> Any:
        from dsec_sdk.state import AgentState, NodeStore, wire

        class Forwarding(NodeStore):
            def checkpoint(self, seq: int, frame: bytes) -> Any:
                ack = super().checkpoint(seq, frame)
                if forward is not None:
                    body = wire.decode(frame[4:])
                    ack.add_done_callback(
                        lambda f: f.exception() or forward(body["seq"], body["records"])
                    )
                return ack

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(self.sockets / f"{name}.sock"))
        return AgentState(Forwarding(sock), agent=name, group="bench", auto=False)

    def merge(self, state: Any) -> bool:
        return False  # the keeper merges warm snapshots on its own, off the agent's path


CONTENDERS = ("dsec", "dsec_full")


@contextmanager
def local_stores(work: Path) -> Iterator[Stores]:
    yield LocalStores(work)


@contextmanager
def stack_stores(work: Path) -> Iterator[Stores]:
    """The embedded stack's NATS (JetStream ``DSEC_STATE``), S3 and OpenBao, and a state keeper
    process (:func:`serve_keeper`); its hot journal on tmpfs (``/dev/shm``) when there is one."""
    from dsec_testing.stack import StackFixture

    stack = StackFixture(work / "stack")
    sockets = work / "keeper"
    sockets.mkdir()
    shm = Path("/dev/shm")
    journal = (shm if shm.is_dir() else work) / f"dsec-bench-state-{os.getpid()}"
    proc = None
    try:
        s3, vault = stack.s3, stack.vault
        env = {
            **os.environ,
            "DSEC_HOME": str(work / "home"),
            "DSEC_NATS_URL": stack.nats_url,
            "DSEC_S3_ENDPOINT": s3.endpoint,
            "DSEC_S3_ACCESS_KEY": s3.access_key,
            "DSEC_S3_SECRET_KEY": s3.secret_key,
            "DSEC_S3_BUCKET": s3.bucket,
            "DSEC_VAULT_ADDR": vault.addr,
            "DSEC_VAULT_TOKEN": vault.token,
            "DSEC_NODE_ID": "bench",
        }
        args = [str(sockets), str(journal), str(work / "warm"), *CONTENDERS]
        proc = subprocess.Popen([sys.executable, __file__, "--serve-keeper", *args], env=env)
        deadline = time.monotonic() + 60
        while not (sockets / "ready").exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("--stack: the state keeper did not start")
            time.sleep(0.05)
        yield KeeperStores(sockets)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(journal, ignore_errors=True)
        stack.close()


def serve_keeper(sockets: str, journal: str, warm: str, *names: str) -> None:
    """The ``--stack`` keeper process: a ``StateKeeper`` (settings from ``DSEC_*``) serving one
    Unix socket per contender, each connection a session of sandbox ``sbx-bench-<name>``."""
    from dsec_core.settings import Settings
    from dsec_core.spec.plan import StatePlan
    from dsec_nodeagent.state.keeper import SandboxState, StateKeeper

    async def main() -> None:
        keeper = StateKeeper(Settings(), None, journal_dir=Path(journal), warm_dir=Path(warm))
        await keeper.start()
        plan = StatePlan(checkpoint_interval_s=None, warm_interval_s=3600)
        loop = asyncio.get_running_loop()
        sessions: set[asyncio.Task[None]] = set()

        async def accept(listener: socket.socket, sandbox: str) -> None:
            while True:
                conn, _ = await loop.sock_accept(listener)
                task = asyncio.create_task(keeper.serve(conn, sandbox))
                sessions.add(task)
                task.add_done_callback(sessions.discard)

        accepting = []
        for name in names:
            sandbox = f"sbx-bench-{name}"
            keeper.register_sandbox(SandboxState(sandbox, "bench", "bench", name, plan))
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(Path(sockets) / f"{name}.sock"))
            listener.listen()
            listener.setblocking(False)
            accepting.append(asyncio.create_task(accept(listener, sandbox)))
        (Path(sockets) / "ready").touch()
        stop = asyncio.Event()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        for task in accepting:
            task.cancel()
        await keeper.stop()

    asyncio.run(main())


# ------------------------------------------------------------ the hand-over through the node
NODE_TESTS = Path(__file__).resolve().parents[1] / "services/nodeagent/tests"


def _crossed(caller_log: Path, seen: int, new: str, lines: Callable[[Path], list[list[str]]]
             ) -> list[list[str]] | None:  # fmt: skip
    """The caller's lines from ``seen`` on through its first answer by the sandbox ``new`` (the
    call that crossed the switch); None before that answer."""
    window = lines(caller_log)[seen:]
    for i, words in enumerate(window):
        if words[:1] == ["ok"] and len(words) >= 4 and words[3] == new:
            return window[: i + 1]
    return None


async def bench_node_handover(runs: int, say: Callable[[str], None]) -> dict[str, Any]:
    """``runs`` live hand-overs through the node agent on the embedded stack, one after the
    other (each new version replaces the one before), while a caller calls the tool throughout
    (see the module's docstring)."""
    sys.path.insert(0, str(NODE_TESTS))
    import uuid

    from _nodeagent_harness import NodeAgentHarness
    from dsec_core import events
    from dsec_core.layout import NodeLayout
    from dsec_testing.stack import StackFixture
    from test_migration_criu import QUIET
    from test_migration_handover import counts, lines
    from test_state_upgrade import CALLER, COUNTING, answers

    lifetime = "30m"  # the spec's timeout: the caller lives through every run
    base = Path(tempfile.mkdtemp(prefix="sho-", dir="/tmp"))  # (short: AF_UNIX paths)
    done: list[dict[str, Any]] = []
    before: list[float] = []
    stack = None
    try:
        stack = StackFixture(base / "stack")
        extra = {**stack.s3.settings(), **stack.vault.settings()}
        home = base / "n"
        async with NodeAgentHarness(home, stack.nats_url, **extra) as h:
            layout = NodeLayout.of(home)
            name = f"upg-{uuid.uuid4().hex[:6]}"
            sid = await h.submit(name, COUNTING, QUIET, extra="state: {}\n", timeout=lifetime)
            await h.wait_for(sid, "sandbox.ready", 120)
            log = layout.sandbox(sid).logs / "stdout.log"
            await until(lambda: len(counts(log)) >= 10, "counting", 120)
            caller = await h.submit(
                f"{name}-c", CALLER.replace("AGENT", repr(name)), QUIET,
                extra=f"task_group: {name}\n", timeout=lifetime,
            )  # fmt: skip
            await h.wait_for(caller, "sandbox.ready", 120)
            caller_log = layout.sandbox(caller).logs / "stdout.log"

            def check_caller() -> None:
                """Stop the bench at the caller's first failed call (anywhere in its log) or
                its end."""
                ended = h.recorded[caller].of("sandbox.exited")
                if ended:
                    raise SystemExit(f"state bench: the caller ended: {ended[0].payload}")
                failed = [w for w in lines(caller_log) if w[:1] != ["ok"]]
                if failed:
                    raise SystemExit(f"state bench: a call failed: {failed[:3]}")

            await until(lambda: len(answers(caller_log)) >= 50, "the caller answered", 60)
            before = [ms for _, ms, _ in answers(caller_log)]
            for _ in range(runs):
                seen = len(lines(caller_log))
                new = await h.submit(
                    name, COUNTING, QUIET, extra="state: {}\n", handover_from=sid,
                    timeout=lifetime,
                )  # fmt: skip
                handed = (await h.wait_for(new, "state.handed_over", 120)).decoded()
                exited = (await h.wait_for(sid, "sandbox.exited", 60)).decoded()
                new_log = layout.sandbox(new).logs / "stdout.log"
                restored = await until(
                    lambda: next((w for w in lines(new_log) if w[:1] == ["restored"]), None),  # noqa: B023
                    "restored in the new version", 60,
                )  # fmt: skip
                n = int(restored[1])
                await until(lambda: len(counts(new_log)) >= 5, "counting on", 60)  # noqa: B023
                window = await until(
                    lambda: check_caller() or _crossed(caller_log, seen, new, lines),  # noqa: B023
                    "the caller answered by the new version", 60,
                )  # fmt: skip
                acked, went_on = counts(log), counts(new_log)
                intact = (
                    restored[2] == "True"
                    and acked[-1] <= n <= acked[-1] + 1
                    and went_on == list(range(n + 1, n + 1 + len(went_on)))
                )
                check_caller()
                result = {
                    "interruption_ms": handed.interruption_ms,
                    "deltas_streamed": handed.deltas_streamed,
                    "caller_call_ms": max(float(w[2]) for w in window if w[0] == "ok"),
                    "caller_switch_call_ms": float(window[-1][2]),
                    "caller_calls": len(window),
                    "old_exit": str(exited.reason),
                    "state_intact": intact,
                }
                say(f"  hand-over through the node agent: {json.dumps(result)}")
                if not intact or result["old_exit"] != "handed_over":
                    raise SystemExit(
                        f"state bench: the hand-over went wrong: {result}; the old version's "
                        f"last counts {acked[-3:]}, the new one restored {restored[1:]} and "
                        f"counted {went_on[:5]}"
                    )
                done.append(result)
                sid, log = new, new_log
            for each in (sid, caller):
                await h.upstream.user.publish(
                    events.SandboxStopRequested(requested_by="bench"), aggregate_id=each
                )
                await h.wait_for(each, "sandbox.exited", 60)
    finally:
        if stack is not None:
            stack.close()
        shutil.rmtree(base, ignore_errors=True)
    gaps = [r["interruption_ms"] for r in done]
    calls = [r["caller_call_ms"] for r in done]
    switch_calls = [r["caller_switch_call_ms"] for r in done]
    return {
        "runs": runs,
        "interruption_ms_p50": round(percentile(gaps, 0.5), 2),
        "interruption_ms_max": round(max(gaps), 2),
        "caller_switch_call_ms_p50": round(percentile(switch_calls, 0.5), 2),
        "caller_switch_call_ms_max": round(max(switch_calls), 2),
        "caller_call_ms_p50": round(percentile(calls, 0.5), 2),
        "caller_call_ms_max": round(max(calls), 2),
        "caller_call_before_ms": round(percentile(before, 0.5), 3),
        "runs_detail": done,
    }


# ------------------------------------------------------------------------------- main
def main() -> None:
    if sys.argv[1:2] == ["--serve-keeper"]:
        serve_keeper(*sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, same state (< 60 s)")
    parser.add_argument("--json", action="store_true", help="print only the ratio and JSON lines")
    parser.add_argument("--stack", action="store_true", help="DSec through the node's keeper")
    parser.add_argument("--dir", type=Path, default=None, help="where the stores go (a temp dir)")
    parser.add_argument(
        "--node-runs", type=int, default=None,
        help="live hand-overs through the node agent on the embedded stack (root; default 3 "
        "with --quick, else 5; 0: skip)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.node_runs is not None and args.node_runs < 0:
        parser.error(f"argument --node-runs: {args.node_runs} is not a count: give 0 or more")
    if args.node_runs and os.geteuid() != 0:
        parser.error("--node-runs: the hand-overs through the node agent need root (sandboxes, "
                     "cgroups): run it with sudo, or give --node-runs 0")  # fmt: skip
    node_runs = args.node_runs if args.node_runs is not None else (3 if args.quick else 5)
    steps, full_steps, handovers = (12, 3, 3) if args.quick else (60, 10, 10)

    def say(text: str) -> None:
        if not args.json:
            print(text, flush=True)

    started = time.perf_counter()
    w = Workload()
    say(f"state generated in {time.perf_counter() - started:.1f} s")
    base = args.dir or Path(tempfile.gettempdir())
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="dsec-bench-state-", dir=base))
    results: dict[str, Any] = {}
    try:
        store = stack_stores if args.stack else local_stores
        with store(work) as stores:
            results["dsec"] = bench_dsec("dsec", w, steps, stores, say, handovers=handovers)
            results["dsec_full"] = bench_dsec("dsec_full", w, full_steps, stores, say, full=True)
        results["pickle"] = bench_peer(
            "pickle", w, full_steps, work, pickle_save, pickle_load, say, pickle_dumps
        )
        results["savez"] = bench_peer("savez", w, full_steps, work, savez_save, savez_load, say)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    node: dict[str, Any] | None = None
    if node_runs and os.geteuid() != 0:
        say(
            "hand-over through the node agent: skipped (needs root: sandboxes, cgroups; run with "
            "sudo)"
        )
    elif node_runs:
        node = results["handover_node"] = asyncio.run(bench_node_handover(node_runs, say))

    d, p = results["dsec"], results["pickle"]
    summary = {
        "pause_p99_ms": d["pause_p99_ms"],
        "recovery_s": d["recovery_s"],
        "handover_interruption_ms": d.get("handover_in_process_ms"),
        "handover_node_interruption_ms": node["interruption_ms_max"] if node else None,
        "bytes_per_checkpoint": d["bytes_per_checkpoint"],
        "full_checkpoint_bytes": p["bytes_per_checkpoint"],
    }
    handover = summary["handover_interruption_ms"]
    ratio = (
        f"state ({MESSAGES // 1000}k messages, 64 MiB adapter 1 %/step, {VECTORS // 1000}k "
        f"vectors): DSec pause p99 {d['pause_p99_ms']:.2f} ms (target <= 8) vs pickle "
        f"{p['pause_p99_ms']:.0f} ms; {d['bytes_per_checkpoint'] / 2**20:.2f} MiB/checkpoint vs "
        f"{p['bytes_per_checkpoint'] / 2**20:.0f} MiB "
        f"({p['bytes_per_checkpoint'] / max(1, d['bytes_per_checkpoint']):.0f}x less); recovery "
        f"{d['recovery_s']:.2f} s (target <= 12) vs pickle {p['recovery_s']:.2f} s; without "
        f"deltas {results['dsec_full']['pause_p99_ms']:.0f} ms / "
        f"{results['dsec_full']['bytes_per_checkpoint'] / 2**20:.0f} MiB; hand-over "
        + (
            "n/a"
            if handover is None
            else f"{handover:.1f} ms (in-process core, worst of {handovers}; p50 "
            f"{d['handover_in_process_p50_ms']:.1f}; target <= 12)"
        )
        + (
            "; through the node agent: not run"
            if node is None
            else f"; through the node agent (small state): interruption p50 "
            f"{node['interruption_ms_p50']:.1f} ms, worst {node['interruption_ms_max']:.1f} of "
            f"{node['runs']}; the caller's first answer by the new version p50 "
            f"{node['caller_switch_call_ms_p50']:.1f} ms (worst "
            f"{node['caller_switch_call_ms_max']:.1f}), its slowest call while the new "
            f"version started and took over p50 {node['caller_call_ms_p50']:.1f} ms (its median "
            f"call before {node['caller_call_before_ms']:.2f} ms), no call failed"
        )
    )
    emit(
        "state",
        results,
        ratio,
        summary=summary,
        store="stack" if args.stack else "local",
        steps={"dsec": steps, "full": full_steps, "interval_s": INTERVAL_S},
        quick=args.quick,
        argv=sys.argv[1:],
        wall_s=round(time.perf_counter() - started, 1),
    )


if __name__ == "__main__":
    main()
