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
  its pause.
- ``savez``: ``np.savez`` of the arrays + the history and kv as JSON, ``fsync``, rename.

Recovery = opening the store and restoring every container (DSec: ``AgentState.open`` + declaring
the containers; pickle: ``pickle.load``; savez: ``np.load`` + ``json.load``), checked equal to the
state before the "crash" (a digest of every container).

Hand-over interruption: the node-side hand-over (freeze the old sandbox, forward its final delta,
switch the tool name) needs the node agent; this benchmark measures its in-process core, labelled
as such: the old version's final checkpoint (pause + durable) plus the new version, already
restored, applying that final delta. The node's own share (cgroup freeze, broker switch) is left
as ``null`` (``handover_node_ms``) until ``--stack`` measures it.

The store: by default the SDK's local store (plain Python, a directory on this machine's disk).
``--stack`` runs DSec through the node agent's state keeper on the embedded stack instead
(JetStream + object store, encrypted).

With ``--json`` only the ratio line and the JSON line are printed; the last line is
``{"pause_p99_ms", "recovery_s", "handover_interruption_ms", "bytes_per_checkpoint",
"full_checkpoint_bytes"}`` (DSec's figures; ``full_checkpoint_bytes``: the pickle peer's).
``--quick`` (fewer steps, same state) takes < 60 s on 2 cores.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import pickle
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _common import emit, percentile

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
) -> dict[str, Any]:
    plain = PlainState(w)
    path = work / f"{name}.ckpt"
    pauses, sizes = [], []
    for i in range(steps + 1):  # the first checkpoint of the initial state, then one per step
        if i:
            plain.apply(w.step(i - 1))
        start = time.perf_counter()
        sizes.append(save(plain.as_dict(), path))
        pauses.append((time.perf_counter() - start) * 1000)
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
    say(f"{name:<10} {result}")
    if not ok:
        raise SystemExit(f"{name}: the restored state differs from the saved one")
    return result


# --------------------------------------------------------------------------------- DSec
class DSecAgent:
    """The state in ``dsec_sdk.state`` containers."""

    def __init__(self, opener: Callable[[], Any]) -> None:
        self.state = opener()
        self.history = self.state.log("history")
        self.kv = self.state.kv("scratch")
        self.adapter = self.state.array("adapter", ADAPTER_SHAPE, "float32")
        self.index = self.state.vectors("index", DIM, "float32")

    def load(self, w: Workload) -> None:
        """Fill an empty state with the initial values."""
        for msg in w.messages:
            self.history.append(msg)
        self.adapter[...] = w.adapter
        self.index.upsert(w.ids, w.vecs)
        for key, value in w.kv.items():
            self.kv[key] = value

    def apply(self, s: Step) -> None:
        for msg in s.messages:
            self.history.append(msg)
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
        self.kv._del = set()
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
    opener: Callable[[], Any],
    say: Callable[[str], None],
    *,
    full: bool = False,
    handover: bool = False,
) -> dict[str, Any]:
    agent = DSecAgent(opener)
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
    if handover:
        result.update(bench_handover(agent, w, steps, opener))
    want = agent.digest()
    agent.state.close()
    del agent
    gc.collect()
    start = time.perf_counter()
    back = DSecAgent(opener)  # open + restore + declare every container
    restored_equal = back.digest() == want
    result["recovery_s"] = round(time.perf_counter() - start, 3)
    info = back.state.restored
    result["recovery_deltas"] = getattr(info, "deltas", None)
    result["recovery_source"] = getattr(info, "source", None)
    result["restored_equal"] = restored_equal
    back.state.close()
    say(f"{name:<10} {result}")
    if not restored_equal:
        raise SystemExit(f"{name}: the restored state differs from the checkpointed one")
    return result


def bench_handover(agent: DSecAgent, w: Workload, steps: int, opener: Callable[[], Any]) -> dict:
    """In-process core of a hand-over (see the module's docstring)."""
    # TODO(handover): replace with the SDK's hand-over API once it lands.
    return {"handover_in_process_ms": None, "handover_node_ms": None}


# ---------------------------------------------------------------------------- stores
@contextmanager
def local_store(work: Path) -> Iterator[Callable[[str], Callable[[], Any]]]:
    """``opener(name)`` -> a function opening that agent's state in the SDK's local store."""
    from dsec_sdk.state import AgentState

    def opener(name: str) -> Callable[[], Any]:
        return lambda: AgentState.open(path=work / "dsec" / name)

    yield opener


@contextmanager
def stack_store(work: Path) -> Iterator[Callable[[str], Callable[[], Any]]]:
    """The node agent's state keeper on the embedded stack (JetStream + object store)."""
    # TODO(lead): start the embedded stack (dsec_testing.stack.StackFixture), a StateKeeper on
    # it, and open AgentState through the keeper's socket (the broker's `state` op hands the
    # agent one end of a socketpair: here keeper.serve(theirs, sandbox_id) on a loop thread).
    raise SystemExit("--stack: the node agent's state keeper path is not wired in yet")
    yield  # pragma: no cover


# ------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, same state (< 60 s)")
    parser.add_argument("--json", action="store_true", help="print only the ratio and JSON lines")
    parser.add_argument("--stack", action="store_true", help="DSec through the node's keeper")
    parser.add_argument("--dir", type=Path, default=None, help="where the stores go (a temp dir)")
    args = parser.parse_args()
    steps, full_steps = (12, 3) if args.quick else (60, 10)

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
        store = stack_store if args.stack else local_store
        with store(work) as opener:
            results["dsec"] = bench_dsec("dsec", w, steps, opener("delta"), say, handover=True)
            results["dsec_full"] = bench_dsec(
                "dsec_full", w, full_steps, opener("full"), say, full=True
            )
        results["pickle"] = bench_peer("pickle", w, full_steps, work, pickle_save, pickle_load, say)
        results["savez"] = bench_peer("savez", w, full_steps, work, savez_save, savez_load, say)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    d, p = results["dsec"], results["pickle"]
    summary = {
        "pause_p99_ms": d["pause_p99_ms"],
        "recovery_s": d["recovery_s"],
        "handover_interruption_ms": d.get("handover_in_process_ms"),
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
        f"{d['recovery_s']:.2f} s (target <= 12) vs pickle {p['recovery_s']:.2f} s; hand-over "
        + ("n/a" if handover is None else f"{handover:.1f} ms in-process (target <= 12)")
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
