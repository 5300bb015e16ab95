"""Environment builds: DSec beside `pip install` and `uv pip install`, same packages, one run.

    uv run python bench/build.py

Every path installs the same lock (resolved once by DSec's resolver; pinned with sha256 hashes
for pip and uv, `--no-deps` everywhere since the lock is complete) for the sandbox interpreter:

- pip: `pip install` into a fresh venv, with an empty (cold) and then a filled (warm) cache;
  `--no-compile` because uv and DSec do not write bytecode either; pip's config files are off.
- uv:  `uv pip install` into a fresh venv, cold and warm cache (uv's default hardlink mode).
- DSec: a *fresh node* (empty node cache) whose cluster cache in S3 (SeaweedFS) is warm, the
  same node again once its environment is gone (*warm node*), and an *identical lock* (reuse).
  For reference also a cold node with a cold S3 cache, and the resolution time.

Venv creation is not timed. Downloads come from PyPI over this machine's network.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import emit
from dsec_builder.adapters.artifacts import S3WheelCache
from dsec_builder.adapters.uv import Uv, uv_binary
from dsec_builder.builder import EnvironmentBuilder, default_interpreter
from dsec_builder.models import BuiltEnv, Lock, Requirement, Resolved
from dsec_builder.resolver import Resolver
from dsec_testing.stack import StackFixture

REQUIREMENTS = [
    "numpy",
    "pydantic",
    "httpx",
    "rich",
    "msgpack",
    "attrs",
    "idna",
    "certifi",
    "click",
    "six",
    "packaging",
    "typing-extensions",
    "pyyaml",
    "python-dateutil",
]
IMPORTS = "import numpy, pydantic, httpx, rich, msgpack, attrs, idna, certifi, click, six, yaml"


def _timed(command: list[str], env: dict[str, str] | None = None) -> float:
    started = time.perf_counter()
    subprocess.run(command, check=True, env=env, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def _check_imports(python: str, env: dict[str, str] | None = None) -> None:
    subprocess.run([python, "-c", IMPORTS], check=True, env=env)


def _pinned(lock: Lock, path: Path) -> Path:
    path.write_text(
        "".join(f"{p.name}=={p.version} --hash=sha256:{p.sha256}\n" for p in lock.packages)
    )
    return path


def _clean_pip_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull  # no site pip.conf (local wheel mirrors) for the peer
    return env


def bench_pip(requirements: Path, work: Path, python: Path) -> dict[str, float]:
    env = _clean_pip_env()
    cache = work / "pip-cache"
    results = {}
    for label in ("pip_cold", "pip_warm"):
        venv = work / f"venv-{label}"
        subprocess.run([str(python), "-m", "venv", str(venv)], check=True)
        pip = [str(venv / "bin" / "pip"), "install", "--disable-pip-version-check", "--no-compile"]
        pip += ["--no-deps", "--only-binary", ":all:", "--cache-dir", str(cache)]
        results[label] = _timed([*pip, "-r", str(requirements)], env)
        _check_imports(str(venv / "bin" / "python"))
    return results


def bench_uv(requirements: Path, work: Path, python: Path) -> dict[str, float]:
    cache = work / "uv-cache"
    results = {}
    for label in ("uv_cold", "uv_warm"):
        venv = work / f"venv-{label}"
        subprocess.run(
            [str(uv_binary()), "venv", "-q", "--python", str(python), str(venv)], check=True
        )
        install = [str(uv_binary()), "pip", "install", "--no-config", "--no-deps", "-q"]
        install += ["--python", str(venv / "bin" / "python"), "--cache-dir", str(cache)]
        results[label] = _timed([*install, "-r", str(requirements)])
        _check_imports(str(venv / "bin" / "python"))
    return results


def _check_env(env: BuiltEnv) -> None:
    _check_imports(str(default_interpreter()), {"PYTHONPATH": str(env.path), "PATH": "/usr/bin"})


async def bench_dsec(lock: Lock, work: Path, cluster: S3WheelCache) -> dict[str, Any]:
    def node(name: str) -> EnvironmentBuilder:
        home = work / name
        return EnvironmentBuilder(
            home, uv=Uv(cache_dir=home / "cache" / "uv"), cluster_cache=cluster
        )

    seed, fresh = node("seed-node"), node("fresh-node")
    try:
        cold = await seed.build(lock)  # cold node, cold S3: fills the cluster cache
        from_s3 = await fresh.build(lock)
        _check_env(from_s3)
        fresh.store.gc(keep=0)  # the node keeps its caches, loses the environment
        warm = await fresh.build(lock)
        _check_env(warm)
        reuse = [await fresh.build(lock) for _ in range(5)]
    finally:
        await seed.close()
        await fresh.close()
    assert from_s3.bytes_from.index == 0 and from_s3.bytes_from.local == 0
    assert warm.bytes_from.s3 == 0 and warm.bytes_from.index == 0
    assert all(r.reused for r in reuse)
    return {
        "dsec_cold_node_cold_s3": cold.timings.total_s,
        "dsec_fresh_node_warm_s3": from_s3.timings.total_s,
        "dsec_warm_node": warm.timings.total_s,
        "dsec_identical_lock": statistics.median(r.timings.total_s for r in reuse),
        "dsec_fresh_node_warm_s3_phases": from_s3.timings.model_dump(),
        "dsec_warm_node_phases": warm.timings.model_dump(),
        "dsec_bytes_from_s3": from_s3.bytes_from.s3,
    }


async def resolve(work: Path) -> tuple[Resolved, float, float]:
    resolver = Resolver(Uv(cache_dir=work / "resolve-uv-cache"))
    requirements = [Requirement.parse(r) for r in REQUIREMENTS]
    cold = await resolver.resolve(requirements)
    warm = await resolver.resolve(requirements)
    assert isinstance(cold, Resolved) and isinstance(warm, Resolved), (cold, warm)
    assert warm.lock_hash == cold.lock_hash
    return warm, cold.duration_s, warm.duration_s


async def main() -> None:
    python = default_interpreter()
    with tempfile.TemporaryDirectory(prefix="dsec-bench-build-") as tmp:
        work = Path(tmp)
        stack = StackFixture(work / "stack")
        try:
            s3 = stack.s3
            client = s3.client()
            if not client.bucket_exists(s3.bucket):
                client.make_bucket(s3.bucket)
            cluster = S3WheelCache(client, s3.bucket, prefix="bench/wheels/sha256/")
            resolved, resolve_cold, resolve_warm = await resolve(work)
            requirements = _pinned(resolved.lock, work / "requirements.txt")
            results: dict[str, Any] = {}
            results.update(bench_pip(requirements, work, python))
            results.update(bench_uv(requirements, work, python))
            results.update(await bench_dsec(resolved.lock, work, cluster))
        finally:
            stack.close()
        shutil.rmtree(work, ignore_errors=True)

    results["resolve_cold"] = resolve_cold
    results["resolve_warm"] = resolve_warm
    results["packages"] = len(resolved.lock.packages)
    results["lock_bytes"] = sum(p.size or 0 for p in resolved.lock.packages)
    results = {k: round(v, 4) if isinstance(v, float) else v for k, v in results.items()}
    warm_vs_uv = results["dsec_warm_node"] / results["uv_warm"]
    s3_vs_pip = results["dsec_fresh_node_warm_s3"] / results["pip_cold"]
    results["ratio_warm_node_vs_uv_warm"] = round(warm_vs_uv, 3)
    results["ratio_fresh_node_warm_s3_vs_pip_cold"] = round(s3_vs_pip, 3)
    results["ratio_fresh_node_warm_s3_vs_uv_cold"] = round(
        results["dsec_fresh_node_warm_s3"] / results["uv_cold"], 3
    )
    for key in (
        "pip_cold",
        "pip_warm",
        "uv_cold",
        "uv_warm",
        "dsec_cold_node_cold_s3",
        "dsec_fresh_node_warm_s3",
        "dsec_warm_node",
        "dsec_identical_lock",
        "resolve_cold",
        "resolve_warm",
    ):
        print(f"  {key:<26} {results[key]:8.4f} s")
    ratio = (
        f"build ({results['packages']} packages, {results['lock_bytes'] / 1e6:.1f} MB): "
        f"identical lock {results['dsec_identical_lock'] * 1000:.2f} ms (target <= 100 ms); "
        f"warm node {warm_vs_uv:.2f}x warm uv (target <= 1.3x); "
        f"fresh node + warm S3 {s3_vs_pip:.2f}x cold pip (target < 1x), "
        f"{results['ratio_fresh_node_warm_s3_vs_uv_cold']:.2f}x cold uv"
    )
    emit("build", results, ratio, interpreter=str(python), argv=sys.argv[1:])


if __name__ == "__main__":
    asyncio.run(main())
