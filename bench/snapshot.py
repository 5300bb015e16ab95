"""Snapshots: DSec beside `tar | zstd` + `sha256sum` and `git add + commit`, same tree, one run.

    uv run python bench/snapshot.py [--rounds 3] [--quick] [--json] [--dir DIR]

Each round times tar and DSec on fresh copies of the tree (which goes first alternates), so a
ratio compares two runs under the same load; the figures are medians over the rounds (git is
timed in the first round only; ``--quick``: one round, no git).

A generated tree of 5,000 files and 50 MB (4,950 source-like text files, 50 random binaries of
400 KB; all written an hour "ago", as code usually is) is snapshotted:

- DSec: ``SnapshotStore.create`` into SeaweedFS (S3 on loopback, started like `dsec up` does;
  chunks packed into pack objects of a few MiB), cold (empty store, no stat cache), then after
  changing 1% of the files (50 text files get a line appended); ``restore`` of the whole tree
  into an empty directory, twice: on the node that took the snapshot (its packs read from the
  node's checked copies, ``DSEC_SNAPSHOT_PACK_CACHE_MB``) and on a cold node (another store on
  the same S3 with an empty cache: the pack index and every pack read from S3); and the
  rollback path (``restore --sync`` of the changed tree back to the first snapshot).
- tar | zstd + sha256sum: `tar -cf - | zstd -3` of the tree plus `sha256sum` of every file (an
  archive and a hash list: what a snapshot holds), before and after the change (it has no
  incremental mode); restore is `zstd -dc | tar -x`, and on a cold node the same after a GET
  of the archive from the same S3 by the same client (the peer of DSec's cold-node restore,
  which also checks every chunk's hash; tar's restore checks none).
- the S3 floor: PUT and GET of as many bytes, in objects of the packs' sizes, four at a time
  (what the object store alone costs a cold snapshot and a restore).
- git: `git add -A && git commit` in a copy of the tree, before and after the change; restore is
  `git clone` of that repository.
- the signed manifest (5,000 file rows): parsing its stored bytes as a restore does, and its
  serialization for signing as a create does (best of 20 each, in ms; no peer).

Setting up servers, generating and copying trees are not timed. Nothing is deleted until the
run ends: on ext4 without a journal (this VM's disk) a new inode skips every inode of its group
freed in the last 60-300 s (``recently_deleted``), so creating 5,000 files right after removing
5,000 took seconds, for whichever tool came second; the trees of all rounds (about 250 MB
each) stay until the end instead. Runs back to back still inherit the previous run's deletions.

``--dir DIR`` puts all of it (the trees, the archives, the restores, the object store's data)
in ``DIR`` instead of a new directory under the system's temporary one: ``--dir /dev/shm``
compares the tools without the disk, whose writeback on this VM can turn a 0.15 s restore into
a 1 s one for whichever tool meets it (both tools write the same files).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import at_least_one, emit_or_json
from dsec_snapstore import SnapshotInputs, SnapshotStore
from dsec_snapstore.adapters.objectstore import S3ObjectStore
from dsec_snapstore.manifest import SignedManifest, manifest_key, parse_manifest
from dsec_snapstore.packs import PACK_PREFIX
from dsec_testing.stack import StackFixture
from nacl.signing import SigningKey, VerifyKey

TEXT_FILES = 4950
BINARY_FILES = 50
BINARY_SIZE = 400_000
TEXT_SIZE = 6_060  # 4,950 x 6,060 + 50 x 400,000 = 50.0 MB
CHANGED = 50  # 1% of the files
GIT_ENV = {
    "GIT_AUTHOR_NAME": "bench",
    "GIT_AUTHOR_EMAIL": "bench@example.com",
    "GIT_COMMITTER_NAME": "bench",
    "GIT_COMMITTER_EMAIL": "bench@example.com",
    "GIT_CONFIG_NOSYSTEM": "1",
}
WORDS = [
    "def", "return", "self", "import", "agent", "tool", "score", "=", "(", ")", "for", "in",
    "if", "else", "async", "await", "value", "items", "config", "#", "None", "True", "0.92",
]  # fmt: skip


def generate(root: Path) -> list[Path]:
    """Write the tree; return the text files (the ones the change touches)."""
    rng = random.Random(2026)
    texts: list[Path] = []
    for i in range(TEXT_FILES):
        path = root / f"pkg{i // 100:02d}" / f"mod{i % 100:03d}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        lines, size = [], 0
        while size < TEXT_SIZE:
            line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + "\n"
            lines.append(line)
            size += len(line)
        path.write_text("".join(lines)[:TEXT_SIZE])
        texts.append(path)
    for i in range(BINARY_FILES):
        path = root / "data" / f"blob{i:02d}.bin"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(rng.randbytes(BINARY_SIZE))
    hour_ago = time.time() - 3600
    for path in root.rglob("*"):
        os.utime(path, (hour_ago, hour_ago))
    return texts


def change(texts: list[Path]) -> None:
    """Append a line to 1% of the files (spread over the tree)."""
    for path in texts[:: len(texts) // CHANGED][:CHANGED]:
        with path.open("a") as fh:
            fh.write("score = 0.87  # changed\n")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = fn()
    return time.perf_counter() - start, value


def sh(cmd: str, cwd: Path, env: dict[str, str] | None = None, stdin: bytes | None = None) -> None:
    subprocess.run(
        ["bash", "-c", f"set -euo pipefail; {cmd}"],
        cwd=cwd,
        check=True,
        input=stdin,
        stdout=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


def tar_snapshot(tree: Path, out: Path) -> None:
    sh(
        f"tar -cf - . | zstd -3 -q -T1 -o {out}.tar.zst -f && "
        f"find . -type f -print0 | sort -z | xargs -0 sha256sum > {out}.sha256",
        tree,
    )


def bench_tar(
    tree: Path, texts: list[Path], work: Path, objects: S3ObjectStore
) -> dict[str, float]:
    out = work / "tar"
    out.mkdir()
    cold, _ = timed(lambda: tar_snapshot(tree, out / "a"))
    change(texts)
    incremental, _ = timed(lambda: tar_snapshot(tree, out / "b"))
    dest = work / "tar-restore"
    dest.mkdir()
    restore, _ = timed(lambda: sh(f"zstd -dc -q {out}/a.tar.zst | tar -xf -", dest))
    # A cold node with tar: the archive is in the same S3 (put there untimed), fetched by the
    # same client DSec uses, then extracted (no hash checked: DSec checks every chunk's).
    objects.put("a.tar.zst", (out / "a.tar.zst").read_bytes())
    there = work / "tar-restore-node-2"
    there.mkdir()
    from_s3, _ = timed(lambda: sh("zstd -dc -q | tar -xf -", there, stdin=objects.get("a.tar.zst")))
    return {"tar_zstd_sha256_cold": cold, "tar_zstd_sha256_after_1pct": incremental,
            "tar_zstd_restore": restore, "tar_zstd_restore_from_s3": from_s3}  # fmt: skip


def bench_git(tree: Path, texts: list[Path], work: Path) -> dict[str, float]:
    repo = work / "git"
    shutil.copytree(tree, repo, symlinks=True)
    sh("git init -q && git config gc.auto 0", repo, GIT_ENV)
    commit = "git add -A && git commit -q -m snap"
    cold, _ = timed(lambda: sh(commit, repo, GIT_ENV))
    change([repo / p.relative_to(tree) for p in texts])
    incremental, _ = timed(lambda: sh(commit, repo, GIT_ENV))
    restore, _ = timed(lambda: sh(f"git clone -q --no-hardlinks {repo} {work}/git-clone", work))
    return {"git_add_commit_cold": cold, "git_add_commit_after_1pct": incremental,
            "git_clone_restore": restore}  # fmt: skip


def bench_dsec(tree: Path, texts: list[Path], work: Path, store: SnapshotStore) -> dict[str, Any]:
    src = SnapshotInputs(code_dir=tree)
    cold, first = timed(lambda: store.create("bench-cold", src))
    change(texts)
    incremental, second = timed(lambda: store.create("bench-1pct", src))
    restore, _ = timed(lambda: store.restore("bench-cold", work / "dsec-restore"))
    with SnapshotStore(  # another node: the same S3 and signer, nothing cached
        store.objects,
        signing_key=SigningKey.generate(),
        cache_dir=work / "cache-node-2",
        trusted_keys=[VerifyKey(store.public_key)],
    ) as there:
        cold_node, _ = timed(lambda: there.restore("bench-cold", work / "dsec-restore-node-2"))
    rollback, back = timed(lambda: store.restore("bench-cold", tree, sync=True))
    verify, report = timed(lambda: store.verify("bench-1pct"))
    assert report.ok and back.files_written == CHANGED, (report, back)
    return {
        "dsec_create_cold": cold,
        "dsec_create_after_1pct": incremental,
        "dsec_restore": restore,
        "dsec_restore_cold_node": cold_node,
        "dsec_rollback_1pct": rollback,
        "dsec_verify": verify,
        "dsec_cold_chunks_uploaded": first.chunks_uploaded,
        "dsec_cold_bytes_uploaded": first.bytes_uploaded,
        "dsec_incremental_chunks_uploaded": second.chunks_uploaded,
        "dsec_incremental_bytes_uploaded": second.bytes_uploaded,
        "dsec_incremental_files_rehashed": second.files_rehashed,
        "dsec_packs": len(store.objects.list(PACK_PREFIX)),
        **s3_floor(store),
        **manifest_costs(store, "bench-cold"),
    }


def manifest_costs(store: SnapshotStore, name: str) -> dict[str, float]:
    """CPU a snapshot's signed manifest costs (5,000 file rows): parsing its stored bytes as a
    restore does, and serializing it for signing as a create does; best of 20 each, in ms."""
    stored = SignedManifest.model_validate_json(store.objects.get(manifest_key(name))).manifest
    signed = stored.signed_bytes()

    def best(fn: Callable[[], Any]) -> float:
        return round(min(timed(fn)[0] for _ in range(20)) * 1e3, 3)

    return {
        "dsec_manifest_parse_ms": best(lambda: parse_manifest(signed)),
        "dsec_manifest_sign_ms": best(stored.signed_bytes),
    }


def s3_floor(store: SnapshotStore) -> dict[str, float]:
    """The object store alone: PUT the bytes of the cold snapshot's packs (as many objects of
    the same sizes, four at a time, as the packer does) and GET them back; what S3 costs a
    snapshot before any hashing, compressing or file writing."""
    packs = sorted((k, i.size) for k, i in store.objects.list(PACK_PREFIX).items())
    bodies = [(f"floor/{n}", os.urandom(size)) for n, (_, size) in enumerate(packs)]
    with ThreadPoolExecutor(4) as pool:
        put, _ = timed(
            lambda: list(pool.map(lambda kb: store.objects.put(*kb, checked_on_read=True), bodies))
        )  # sent as the packs are (UNSIGNED-PAYLOAD: the reader checks their hash)
        get, _ = timed(lambda: list(pool.map(store.objects.get, [k for k, _ in packs])))
    return {"s3_put_floor": put, "s3_get_floor": get}


def one_round(work: Path, s3: Any, number: int, with_git: bool) -> dict[str, Any]:
    """tar, then DSec (odd rounds: DSec first), each on a fresh tree; DSec into an empty store
    prefix with an empty cache (cold)."""
    results: dict[str, Any] = {}
    order: list[str] = ["tar", "dsec"] if number % 2 == 0 else ["dsec", "tar"]
    if with_git:
        order.append("git")
    for name in order:
        tree = work / f"tree-{name}-{number}"
        texts = generate(tree)
        place = work / f"{name}-{number}"
        place.mkdir()
        objects = S3ObjectStore(
            s3.endpoint, s3.access_key, s3.secret_key, s3.bucket,
            prefix=f"bench-{uuid.uuid4().hex}/",
        )  # fmt: skip
        if name == "tar":
            results.update(bench_tar(tree, texts, place, objects))
        elif name == "git":
            results.update(bench_git(tree, texts, place))
        else:
            with SnapshotStore(
                objects, signing_key=SigningKey.generate(), cache_dir=place / "cache"
            ) as store:
                results.update(bench_dsec(tree, texts, place, store))
    return results


def main(rounds: int, with_git: bool, json_only: bool, where: Path | None = None) -> None:
    per_round: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="dsec-bench-snapshot-", dir=where) as tmp:
        work = Path(tmp)
        stack = StackFixture(work / "stack")
        try:
            for number in range(rounds):
                per_round.append(one_round(work, stack.s3, number, with_git and number == 0))
        finally:
            stack.close()
    results: dict[str, Any] = {}
    for key in per_round[0]:
        values = [r[key] for r in per_round if key in r]
        results[key] = statistics.median(values) if isinstance(values[0], float) else values[0]
    for key in ("git_add_commit_cold", "git_add_commit_after_1pct", "git_clone_restore"):
        if key in per_round[0]:
            results[key] = per_round[0][key]
    pairs = {
        "ratio_cold_vs_tar": ("dsec_create_cold", "tar_zstd_sha256_cold"),
        "ratio_restore_vs_tar": ("dsec_restore", "tar_zstd_restore"),
        "ratio_restore_cold_node_vs_tar": ("dsec_restore_cold_node", "tar_zstd_restore"),
        "ratio_restore_cold_node_vs_tar_s3": ("dsec_restore_cold_node", "tar_zstd_restore_from_s3"),
        "ratio_incremental_vs_tar": ("dsec_create_after_1pct", "tar_zstd_sha256_after_1pct"),
    }
    for ratio, (ours, theirs) in pairs.items():  # per round (same load), then the median
        results[ratio] = round(statistics.median(r[ours] / r[theirs] for r in per_round), 3)
        results[f"{ratio}_rounds"] = [round(r[ours] / r[theirs], 3) for r in per_round]
    results = {k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}
    inc = results["dsec_create_after_1pct"]
    if "git_add_commit_after_1pct" in results:
        results["ratio_incremental_vs_git"] = round(inc / results["git_add_commit_after_1pct"], 3)
    if not json_only:
        for key, value in results.items():
            if isinstance(value, float) and not key.startswith("ratio"):
                unit = "ms" if key.endswith("_ms") else "s"
                print(f"  {key:<30} {value:8.4f} {unit}")
    ratio = (
        f"snapshot ({TEXT_FILES + BINARY_FILES} files, 50 MB, median of {rounds} round(s)): "
        f"cold {results['dsec_create_cold']:.2f} s = {results['ratio_cold_vs_tar']:.2f}x "
        f"tar|zstd+sha256sum (target <= 1); restore {results['dsec_restore']:.2f} s = "
        f"{results['ratio_restore_vs_tar']:.2f}x tar|zstd (target <= 1), on a cold node "
        f"{results['dsec_restore_cold_node']:.2f} s = "
        f"{results['ratio_restore_cold_node_vs_tar']:.2f}x tar from a local file, "
        f"{results['ratio_restore_cold_node_vs_tar_s3']:.2f}x tar fetched from the same S3 "
        f"({results['tar_zstd_restore_from_s3']:.2f} s); after a 1% change "
        f"{inc:.3f} s (target <= 0.18 s) = {results['ratio_incremental_vs_tar']:.2f}x tar; "
        f"rollback {results['dsec_rollback_1pct']:.3f} s (target <= 0.15 s); S3 alone: PUT "
        f"{results['s3_put_floor']:.2f} s, GET {results['s3_get_floor']:.2f} s of the packs; "
        f"the signed manifest: parsed in {results['dsec_manifest_parse_ms']:.2f} ms, "
        f"serialized for signing in {results['dsec_manifest_sign_ms']:.2f} ms"
    )
    emit_or_json("snapshot", results, ratio, json_only, argv=sys.argv[1:], rounds=per_round)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=at_least_one, default=3, help="rounds (median reported)")
    parser.add_argument("--quick", action="store_true", help="one round, no git")
    parser.add_argument("--json", action="store_true", help="print only the JSON document")
    parser.add_argument(
        "--dir",
        type=Path,
        help="where the trees, restores and object store go (e.g. /dev/shm: no disk in it)",
    )
    args = parser.parse_args()
    if args.dir is not None and not args.dir.is_dir():
        parser.error(f"--dir {args.dir}: not a directory")
    main(1 if args.quick else max(1, args.rounds), not args.quick, args.json, args.dir)
