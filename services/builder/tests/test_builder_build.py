"""Environment builds against a real S3 store (SeaweedFS) and a local package index.

Each test is a node (or several) sharing one cluster cache: what it fetches from where, what it
catches, and what a sandbox can import afterwards.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _dsec_builder_testkit import WheelIndex, run_in_sandbox_python

from dsec_builder.adapters.artifacts import S3WheelCache
from dsec_builder.adapters.store import EnvironmentStore
from dsec_builder.adapters.uv import Uv
from dsec_builder.builder import EnvironmentBuilder
from dsec_builder.errors import InstallError, MissingArtifactsError
from dsec_builder.models import BuiltEnv, Lock, Target

pytestmark = pytest.mark.integration

UNREACHABLE = "http://127.0.0.1:9/files"


@pytest.fixture
def cluster(s3: Any, cache_prefix: str) -> S3WheelCache:
    return S3WheelCache(s3.client(), s3.bucket, prefix=cache_prefix)


@pytest.fixture
def lock(index: WheelIndex) -> Lock:
    packages = [index.add(f"dsecpkg{i}", "1.0", f"value-{i}") for i in range(3)]
    return Lock(target=Target(), packages=tuple(packages))


class Nodes:
    """Fresh nodes (own ``$DSEC_HOME``) sharing one cluster cache."""

    def __init__(self, root: Path, cluster: S3WheelCache | None) -> None:
        self.root = root
        self.cluster = cluster
        self.builders: list[EnvironmentBuilder] = []

    def new(self, name: str) -> EnvironmentBuilder:
        home = self.root / name
        builder = EnvironmentBuilder(
            home, uv=Uv(cache_dir=home / "cache" / "uv"), cluster_cache=self.cluster
        )
        self.builders.append(builder)
        return builder


@pytest.fixture
async def nodes(tmp_path: Path, cluster: S3WheelCache) -> Any:
    fleet = Nodes(tmp_path / "nodes", cluster)
    yield fleet
    for builder in fleet.builders:
        await builder.close()


def _moved(lock: Lock, base_url: str) -> Lock:
    packages = [p.model_copy(update={"url": f"{base_url}/{p.filename}"}) for p in lock.packages]
    return lock.model_copy(update={"packages": tuple(packages)})


def _total(lock: Lock) -> int:
    return sum(p.size or 0 for p in lock.packages)


def _put(cluster: S3WheelCache, sha256: str, data: bytes) -> None:
    cluster.client.put_object(cluster.bucket, cluster.key(sha256), io.BytesIO(data), len(data))


def _imports(env: BuiltEnv, count: int = 3) -> list[str]:
    code = "; ".join(f"import dsecpkg{i}" for i in range(count))
    values = ", ".join(f"dsecpkg{i}.VALUE" for i in range(count))
    return (
        run_in_sandbox_python(env.path, f"{code}; print(repr([{values}]))")
        .strip("[]")
        .replace("'", "")
        .split(", ")
    )


async def test_first_build_fetches_from_the_index_and_fills_the_cluster_cache(
    nodes: Nodes, lock: Lock, index: WheelIndex, cluster: S3WheelCache
) -> None:
    env = await nodes.new("node-a").build(lock)

    assert not env.reused and env.integrity_failures == ()
    assert env.bytes_from.index == _total(lock) and env.bytes_from.s3 == 0
    assert _imports(env) == ["value-0", "value-1", "value-2"]
    for package in lock.packages:
        stored = cluster.client.get_object(cluster.bucket, cluster.key(package.sha256)).read()
        assert hashlib.sha256(stored).hexdigest() == package.sha256
    # Immutable once built: no write bit anywhere, and the store names it by its lock hash.
    assert env.path.parent.name == env.lock_hash
    for directory, _dirs, files in os.walk(env.path.parent):
        for name in [*files, "."]:
            assert os.stat(os.path.join(directory, name)).st_mode & 0o222 == 0


async def test_identical_lock_reuses_the_environment(
    nodes: Nodes, lock: Lock, index: WheelIndex
) -> None:
    node = nodes.new("node-a")
    first = await node.build(lock)
    hits = sum(index.hits.values())

    again = await node.build(lock.model_copy())

    assert again.reused and again.path == first.path and again.fingerprint == first.fingerprint
    assert again.bytes_from.model_dump() == {"local": 0, "s3": 0, "index": 0}
    assert sum(index.hits.values()) == hits


async def test_warm_node_takes_artifacts_from_its_own_cache(
    nodes: Nodes, lock: Lock, index: WheelIndex
) -> None:
    node = nodes.new("node-a")
    await node.build(Lock(target=lock.target, packages=lock.packages[:2]))

    env = await node.build(lock)

    sizes = [p.size or 0 for p in lock.packages]
    assert (env.bytes_from.local, env.bytes_from.index) == (sizes[0] + sizes[1], sizes[2])


async def test_fresh_node_takes_every_artifact_from_the_cluster_cache(
    nodes: Nodes, lock: Lock, index: WheelIndex
) -> None:
    await nodes.new("node-a").build(lock)
    hits = sum(index.hits.values())

    env = await nodes.new("node-b").build(lock)

    assert not env.reused
    assert (env.bytes_from.s3, env.bytes_from.index) == (_total(lock), 0)
    assert sum(index.hits.values()) == hits
    assert _imports(env) == ["value-0", "value-1", "value-2"]


async def test_tampered_cluster_cache_object_is_caught_refetched_and_never_installed(
    nodes: Nodes, lock: Lock, index: WheelIndex, cluster: S3WheelCache
) -> None:
    await nodes.new("node-a").build(lock)
    victim = lock.packages[1]
    evil = (index.root / victim.filename).read_bytes().replace(b"value-1", b"EVIL-1!")
    _put(cluster, victim.sha256, evil)

    env = await nodes.new("node-b").build(lock)

    [failure] = env.integrity_failures
    assert (failure.package, failure.tier) == ("dsecpkg1==1.0", "s3")
    assert failure.expected_sha256 == victim.sha256
    assert failure.actual_sha256 == hashlib.sha256(evil).hexdigest()
    assert "refetched from the package index" in failure.action
    assert _imports(env) == ["value-0", "value-1", "value-2"]
    assert index.hits[victim.filename] == 2  # node-a's first download, node-b's refetch
    repaired = cluster.client.get_object(cluster.bucket, cluster.key(victim.sha256)).read()
    assert hashlib.sha256(repaired).hexdigest() == victim.sha256


async def test_tampered_node_cache_file_is_caught_and_refetched(
    nodes: Nodes, lock: Lock, index: WheelIndex
) -> None:
    node = nodes.new("node-a")
    await node.build(Lock(target=lock.target, packages=lock.packages[:1]))
    cached = node.cache.path(lock.packages[0])
    cached.chmod(0o644)
    cached.write_bytes(b"not a wheel")

    env = await node.build(lock)

    assert [(f.package, f.tier) for f in env.integrity_failures] == [("dsecpkg0==1.0", "local")]
    assert _imports(env) == ["value-0", "value-1", "value-2"]


async def test_offline_node_builds_from_the_cluster_cache(nodes: Nodes, lock: Lock) -> None:
    await nodes.new("online").build(lock)

    env = await nodes.new("offline").build(_moved(lock, UNREACHABLE))

    assert (env.bytes_from.s3, env.bytes_from.index) == (_total(lock), 0)
    assert _imports(env) == ["value-0", "value-1", "value-2"]


async def test_offline_node_names_the_artifacts_it_cannot_get(
    nodes: Nodes, lock: Lock, index: WheelIndex
) -> None:
    await nodes.new("online").build(Lock(target=lock.target, packages=lock.packages[:2]))
    offline = nodes.new("offline")

    with pytest.raises(MissingArtifactsError) as caught:
        await offline.build(_moved(lock, UNREACHABLE))

    [missing] = caught.value.missing
    assert (missing.package, missing.filename) == ("dsecpkg2==1.0", "dsecpkg2-1.0-py3-none-any.whl")
    assert "not in the cluster cache" in missing.reason and "127.0.0.1:9" in missing.reason
    assert "dsecpkg2==1.0" in str(caught.value)
    assert offline.store.environments() == []


async def test_index_serving_wrong_bytes_fails_the_build_without_installing(
    tmp_path: Path, lock: Lock, index: WheelIndex
) -> None:
    victim = lock.packages[0]
    index.serve_wrong_bytes(victim.filename, b"compromised mirror")
    builder = EnvironmentBuilder(tmp_path / "home", uv=Uv(cache_dir=tmp_path / "uv"))

    with pytest.raises(MissingArtifactsError) as caught:
        await builder.build(lock)
    await builder.close()

    assert [(f.package, f.tier) for f in caught.value.integrity_failures] == [
        ("dsecpkg0==1.0", "index")
    ]
    assert "wrong sha256" in caught.value.missing[0].reason
    assert not builder.cache.path(victim).exists()
    assert builder.store.environments() == []


async def test_concurrent_builds_of_one_lock_build_once(
    nodes: Nodes, lock: Lock, index: WheelIndex
) -> None:
    first, second = nodes.new("node-a"), nodes.new("node-a")  # two builders, one node

    envs = await asyncio.gather(first.build(lock), second.build(lock))

    assert sorted(env.reused for env in envs) == [False, True]
    assert envs[0].path == envs[1].path
    assert all(index.hits[p.filename] == 1 for p in lock.packages)


async def test_install_failure_leaves_nothing_behind(tmp_path: Path, lock: Lock) -> None:
    fake_uv = tmp_path / "uv"
    fake_uv.write_text("#!/bin/sh\necho 'error: the wheel is broken' >&2\nexit 2\n")
    fake_uv.chmod(0o755)
    home = tmp_path / "home"
    builder = EnvironmentBuilder(home, uv=Uv(cache_dir=tmp_path / "uvc", binary=fake_uv))

    with pytest.raises(InstallError, match="the wheel is broken"):
        await builder.build(lock)
    await builder.close()

    assert builder.store.environments() == []
    assert list((home / "builder" / "envs" / ".staging").iterdir()) == []


CRASHING_BUILD = """
import asyncio, sys
from pathlib import Path
from dsec_builder.adapters.uv import Uv
from dsec_builder.builder import EnvironmentBuilder
from dsec_builder.models import Lock

lock = Lock.model_validate_json(Path(sys.argv[1]).read_text())
builder = EnvironmentBuilder(Path(sys.argv[2]), uv=Uv(cache_dir=Path(sys.argv[3]),
                             binary=Path(sys.argv[4])))
asyncio.run(builder.build(lock))
"""


async def test_crash_mid_build_leaves_no_half_environment(tmp_path: Path, lock: Lock) -> None:
    # An installer that writes part of the environment, then hangs until the node dies.
    hanging_uv = tmp_path / "uv"
    hanging_uv.write_text(
        '#!/bin/sh\nfor a; do case "$prev" in --target) mkdir -p "$a"; '
        'echo partial > "$a/half.py";; esac; prev="$a"; done\nexec sleep 60\n'
    )
    hanging_uv.chmod(0o755)
    (tmp_path / "lock.json").write_text(lock.model_dump_json())
    home = tmp_path / "home"
    node = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CRASHING_BUILD,
            str(tmp_path / "lock.json"),
            str(home),
            str(tmp_path / "uvc"),
            str(hanging_uv),
        ],
        start_new_session=True,
    )
    store = EnvironmentStore(home / "builder" / "envs")
    try:
        deadline = time.monotonic() + 30
        while not list((home / "builder" / "envs" / ".staging").glob("*/site-packages/half.py")):
            assert node.poll() is None, "the build process exited before it was killed"
            assert time.monotonic() < deadline, "the build never started installing"
            await asyncio.sleep(0.05)
    finally:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait()

    assert store.environments() == []
    envs = home / "builder" / "envs"
    assert [p.name for p in envs.iterdir() if not p.name.startswith(".")] == []

    builder = EnvironmentBuilder(home, uv=Uv(cache_dir=tmp_path / "uvc"))
    env = await builder.build(lock)
    await builder.close()
    assert not env.reused and _imports(env) == ["value-0", "value-1", "value-2"]
    assert list((home / "builder" / "envs" / ".staging").iterdir()) == []
    assert not (env.path / "half.py").exists()
    assert json.loads((env.path.parent / "env.json").read_text())["lock_hash"] == env.lock_hash


async def test_gc_removes_least_recently_used_environments_and_crashed_builds(
    nodes: Nodes, lock: Lock
) -> None:
    node = nodes.new("node-a")
    small = Lock(target=lock.target, packages=lock.packages[:1])
    old = await node.build(small)
    recent = await node.build(lock)
    crashed = node.store.new_staging("c" * 64)
    (crashed / "half.py").write_text("partial\n")

    removed = node.store.gc(keep=1)

    assert [info.lock_hash for info in removed] == [old.lock_hash]
    assert not old.path.parent.exists() and not crashed.exists()
    assert _imports(recent) == ["value-0", "value-1", "value-2"]
    rebuilt = await node.build(small)
    assert not rebuilt.reused and rebuilt.bytes_from.local == lock.packages[0].size


async def test_a_build_cancelled_while_committing_cleans_up_only_after_the_commit(
    tmp_path: Path, lock: Lock, index: WheelIndex, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attempt's timeout (or a stop) cancels a build while its environment is renamed into
    place in a thread: its cleanup (removing the staging tree) waits for that thread, never
    removing a tree that is being committed; the environment ends complete."""
    import threading

    import dsec_builder.builder as building

    builder = EnvironmentBuilder(tmp_path / "home", uv=Uv(cache_dir=tmp_path / "uv"))
    times: dict[str, float] = {}
    committing = threading.Event()
    commit, remove = builder.store.commit, building.remove_tree

    def slow_commit(*args: Any) -> Path:
        committing.set()
        time.sleep(0.3)
        try:
            return commit(*args)
        finally:
            times["commit ended"] = time.monotonic()

    def timed_remove(root: Path) -> None:
        times.setdefault("cleanup started", time.monotonic())
        remove(root)

    monkeypatch.setattr(builder.store, "commit", slow_commit)
    monkeypatch.setattr(building, "remove_tree", timed_remove)
    build = asyncio.create_task(builder.build(lock))
    await asyncio.to_thread(committing.wait, 60)
    build.cancel()
    with pytest.raises(asyncio.CancelledError):
        await build
    await builder.close()
    assert times["cleanup started"] >= times["commit ended"], times
    (env,) = builder.store.environments()
    assert builder.store.exists(env.lock_hash)
