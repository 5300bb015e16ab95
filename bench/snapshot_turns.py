"""A neighbour's snapshot behind a tenant's burst of large ones, on one node: the node taking
one snapshot at a time (as before 2026-12-07) beside one at a time per tree (now).

    uv run python bench/snapshot_turns.py [--rounds 3] [--big-mb 20] [--json]

A node agent's snapshot requests are taken by 4 workers, one tenant at most 3 of them
(``DSEC_TENANT_QUEUE``; docs/architecture.md). Each worker's create is
``SnapshotRequests.create``; this script calls it from 4 threads as those workers do, into
SeaweedFS (S3 on loopback, started like `dsec up` does), with a cold store (an empty prefix, no
stat cache) for each measurement:

- tenant A asks for 3 snapshots of 3 sandboxes' trees (``--big-mb`` each: 1 MB random files
  and 200 small source files);
- 50 ms later tenant B asks for one of its small tree (50 source files, ~150 KB);
- B's latency (from its request to its snapshot stored) and the time A's three took are
  measured, and B's alone on an idle node as the floor.

The two modes alternate (which goes first alternates by round); the figures are medians over
the rounds. "one at a time" is the code before: one lock for all of the node's creates; "per
tree" is the code now (``dsec_snapstore.requests.TreeLocks``). Neither changes what a snapshot
holds or how it is stored. Generating the trees and starting SeaweedFS is not timed.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import at_least_one, emit_or_json
from dsec_core.settings import Settings
from dsec_snapstore import SnapshotInputs, SnapshotStore
from dsec_snapstore.adapters.objectstore import S3ObjectStore
from dsec_snapstore.requests import SnapshotRequests
from dsec_testing.stack import StackFixture
from nacl.signing import SigningKey

WORKERS = 4  # the node agent's snapshot workers (dsec_nodeagent.snapshots.SNAPSHOT_WORKERS)
BURST = 3  # one tenant's most at once on a node (DSEC_TENANT_QUEUE's default share)
MB = 1 << 20


def tree(root: Path, binaries: int, texts: int, seed: int) -> Path:
    """``binaries`` random 1 MB files and ``texts`` source-like files of ~3 KB, written an hour
    "ago" (as code usually is)."""
    rng = random.Random(seed)
    for i in range(texts):
        path = root / f"pkg{i // 50:02d}" / f"mod{i % 50:02d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(f"VALUE_{i}_{n} = {rng.random()!r}\n" for n in range(100)))
    for i in range(binaries):
        path = root / "data" / f"blob{i:03d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(MB))
    hour_ago = time.time() - 3600
    for path in root.rglob("*"):
        os.utime(path, (hour_ago, hour_ago))
    return root


def _no_bus() -> Any:
    raise AssertionError("the bus is not used here")


class OneAtATime(SnapshotRequests):
    """The code before: one lock for every create of the node."""

    _node_lock = threading.Lock()

    def create(self, name: str, inputs: SnapshotInputs, code: Any) -> Any:
        with self._node_lock:
            return super().create(name, inputs, code)


def requests_of(kind: type[SnapshotRequests], store: SnapshotStore, home: Path) -> SnapshotRequests:
    requests = kind(Settings(home=home), _no_bus, _no_bus, node_id="bench")
    requests._store = store  # (the store opened here, not from the settings)
    return requests


def measure(
    kind: type[SnapshotRequests], s3: Any, work: Path, big: list[Path], small: Path
) -> dict[str, float]:
    """B alone, then A's burst with B's request 50 ms into it; a cold store for each."""

    def cold_store(tag: str) -> SnapshotStore:
        objects = S3ObjectStore(
            s3.endpoint, s3.access_key, s3.secret_key, s3.bucket,
            prefix=f"bench-turns-{uuid.uuid4().hex}/",
        )  # fmt: skip
        return SnapshotStore(
            objects, signing_key=SigningKey.generate(), cache_dir=work / f"cache-{tag}"
        )

    def take(requests: SnapshotRequests, name: str, code: Path) -> float:
        started = time.perf_counter()
        requests.create(name, SnapshotInputs(code_dir=code, sandbox_id=name), code)
        return time.perf_counter() - started

    out: dict[str, float] = {}
    tag = uuid.uuid4().hex[:8]
    with cold_store(f"alone-{tag}") as store:
        out["b_alone_s"] = take(requests_of(kind, store, work / "home"), "b", small)
    with cold_store(f"burst-{tag}") as store, ThreadPoolExecutor(WORKERS) as workers:
        requests = requests_of(kind, store, work / "home")
        started = time.perf_counter()
        burst: list[Future[float]] = [
            workers.submit(take, requests, f"a{i}", code) for i, code in enumerate(big)
        ]
        time.sleep(0.05)
        neighbour = workers.submit(take, requests, "b", small)
        out["b_behind_burst_s"] = neighbour.result()
        for done in burst:
            done.result()
        out["a_burst_s"] = time.perf_counter() - started
    return out


def main(rounds: int, big_mb: int, json_only: bool) -> None:
    modes: dict[str, type[SnapshotRequests]] = {
        "one_at_a_time": OneAtATime,
        "per_tree": SnapshotRequests,
    }
    per_round: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory(prefix="dsec-bench-snapshot-turns-") as tmp:
        work = Path(tmp)
        stack = StackFixture(work / "stack")
        try:
            big = [tree(work / f"a{i}", big_mb, 200, seed=i) for i in range(BURST)]
            small = tree(work / "b", 0, 50, seed=99)
            for number in range(rounds):
                order = list(modes) if number % 2 == 0 else list(reversed(modes))
                per_round.append(
                    {m: measure(modes[m], stack.s3, work / f"r{number}-{m}", big, small)
                     for m in order}
                )  # fmt: skip
        finally:
            stack.close()

    def median(mode: str, key: str) -> float:
        return round(statistics.median(r[mode][key] for r in per_round), 4)

    results: dict[str, Any] = {
        f"{mode}_{key}": median(mode, key)
        for mode in modes
        for key in ("b_alone_s", "b_behind_burst_s", "a_burst_s")
    }
    results["ratio_b_behind_burst"] = round(
        statistics.median(
            r["per_tree"]["b_behind_burst_s"] / r["one_at_a_time"]["b_behind_burst_s"]
            for r in per_round
        ),
        3,
    )
    results["ratio_a_burst"] = round(
        statistics.median(
            r["per_tree"]["a_burst_s"] / r["one_at_a_time"]["a_burst_s"] for r in per_round
        ),
        3,
    )
    ratio = (
        f"snapshot turns ({BURST} x {big_mb} MB of tenant A, then tenant B's ~150 KB; "
        f"median of {rounds}): B waits {results['per_tree_b_behind_burst_s']:.2f} s per tree "
        f"against {results['one_at_a_time_b_behind_burst_s']:.2f} s one at a time "
        f"({results['ratio_b_behind_burst']:.2f}x; B alone "
        f"{results['per_tree_b_alone_s']:.2f} s); A's three took "
        f"{results['per_tree_a_burst_s']:.2f} s against "
        f"{results['one_at_a_time_a_burst_s']:.2f} s ({results['ratio_a_burst']:.2f}x)"
    )
    emit_or_json("snapshot_turns", results, ratio, json_only, argv=sys.argv[1:], rounds=per_round)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rounds", type=at_least_one, default=3, help="rounds (median reported)")
    parser.add_argument(
        "--big-mb", type=at_least_one, default=20, help="size of each of tenant A's trees (MB)"
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON document")
    args = parser.parse_args()
    main(args.rounds, args.big_mb, args.json)
