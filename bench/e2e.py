"""From a YAML spec to a ready sandbox, end to end, beside doing it yourself on the same machine.

    uv run python bench/e2e.py [--quick] [--data-mb 300] [--warm 5] [--json]

The spec is like the product brief's: 12 real packages from the package index, a secret from
OpenBao (a lease), three allowed APIs in the demo world (DNS + HTTPS on loopback, see
``dsec_testing.demo_world``), and a read-only S3 mount of ``--data-mb`` MiB (node-cached with a
``cache_ttl``). The stack is a throwaway embedded one (NATS, Postgres, SeaweedFS, OpenBao) with
the real policy, builder, scheduler and node agent as processes.

The clock runs from ``DSec.submit`` (the signed ``spec.submitted`` published) to the client
receiving ``sandbox.ready``, the moment a user's ``dsec submit --wait ready`` returns. Three
cases:

* **cold node, cold cache**: the builder's wheel cache (S3 and local), the cluster's environment
  archives and the node's staged environments and S3 cache are all empty: everything is
  resolved, downloaded from the index, built, uploaded, staged and fetched.
* **cold node, warm S3 wheel cache**: a new node (no staged environment, no S3 data cached)
  whose cluster already has the wheels; the environment archive is built again from them.
* **warm node**: the same spec again on a node that ran it (``--warm`` times, p50).

The two cold cases and the peer's two run in turn for ``--rounds`` rounds (median; this VM's
disk and CPU speed move by up to 2x from one cold case to the next). Before each timed case the
disk is flushed and the machine left to go quiet (the services' start-up work done), so no case
inherits another's write-back or start.

The peer is what a user does by hand on the same machine with the same inputs: a fresh venv,
``pip install`` of the same 12 packages (cold, then warm pip cache), the secret read from OpenBao
with ``hvac``, the S3 data downloaded with ``minio``, then ``bwrap`` with the same binds
(read-only venv, data and code; a private /tmp; no network namespace tricks beyond
``--unshare-all --share-net``) printing its first line. Its warm case is the last step only
(venv and data already there). ``docker build`` figures: only where a Docker daemon exists.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import at_least_one, emit
from dsec_testing.stack import ServiceRunner, StackFixture

PACKAGES = [
    ("numpy", ">=1.26"),
    ("pydantic", ">=2"),
    ("httpx", ">=0.27"),
    ("rich", ">=13"),
    ("msgpack", ">=1.0"),
    ("attrs", ">=23"),
    ("idna", ">=3"),
    ("certifi", ">=2024"),
    ("click", ">=8"),
    ("six", ">=1.16"),
    ("pyyaml", ">=6"),
    ("python-dateutil", ">=2.8"),
]
IMPORTS = "numpy, pydantic, httpx, rich, msgpack, attrs, idna, certifi, click, six, yaml, dateutil"
DATA_PREFIX = "default/e2e-data/"
APIS = ["api.websearch.test", "llm.websearch.test", "kv.websearch.test"]

AGENT = f"""\
import os, sys
import {IMPORTS}
files = sorted(os.listdir("/workspace/data"))
size = sum(os.path.getsize(os.path.join("/workspace/data", f)) for f in files)
assert os.environ.get("WEB_SEARCH_KEY"), "no secret"
print(f"ready: 12 packages, {{len(files)}} files, {{size >> 20}} MiB, a secret", flush=True)
"""


def spec_text() -> str:
    deps = "\n".join(f'  - package: {n}\n    version: "{v}"' for n, v in PACKAGES)
    egress = "\n".join(f"      - domain: {d}\n        ports: [443]" for d in APIS)
    return f"""\
version: "1.2"
name: e2e-bench
base: dsec/python311:latest
entrypoint: [python, agent.py]
workdir: /workspace
dependencies:
{deps}
resources:
  cpu: 1
  memory: 1GiB
  pids: 128
timeout: 10m
runtime_context:
  env_vars:
    - name: WEB_SEARCH_KEY
      source: vault://secret/default/agent-tools/websearch#key
      ttl: 2h
  mounts:
    - path: /workspace/data
      source: s3://dsec-demo/{DATA_PREFIX}
      mode: ro
      cache_ttl: 3600s
security_policy:
  dns_passthrough: false
  network:
    egress:
{egress}
  filesystem:
    read_allowed: [/workspace/data]
    write_allowed: [/workspace/output]
"""


# --------------------------------------------------------------------------------------- DSec


async def _submit_until_ready(spec: str, code: Path) -> dict[str, Any]:
    from dsec_client import DSec

    stages: dict[str, float] = {}
    async with DSec() as d:
        started = time.perf_counter()
        sb = await d.submit(spec, code=code)

        built: dict[str, Any] = {}

        def seen(event: Any) -> None:
            stages.setdefault(event.type, round((time.perf_counter() - started) * 1000, 1))
            if event.type == "env.built":
                built.update(event.envelope.payload.get("timings_ms", {}))

        ready = await sb.wait("ready", timeout=1800, on_event=seen)
        ready_ms = (time.perf_counter() - started) * 1000
        exited = await sb.wait("exited", timeout=600)
        code_ = exited.envelope.payload.get("exit_code")
        if code_ != 0:
            logs = (await sb.logs(stderr=True))[-2000:]
            raise RuntimeError(f"the sandbox exited {code_}: {logs}")
        out = await sb.logs()
        start_stages = ready.envelope.payload.get("start_latency_ms", {})
    return {
        "ready_ms": round(ready_ms, 1),
        "events_ms": stages,
        "node_ms": start_stages,
        "build_ms": built,
        "output": out.strip().splitlines()[-1:],
    }


def _median_round(runs: list[Any], key: str = "ready_ms") -> Any:
    """The run whose ``key`` is the median (the lower middle one of an even count)."""
    ordered = sorted(runs, key=lambda r: r[key])
    return ordered[(len(ordered) - 1) // 2]


def _cpu_busy(window_s: float = 0.25) -> float:
    """The machine's busy CPU fraction over ``window_s`` (from /proc/stat)."""

    def sample() -> tuple[int, int]:
        with open("/proc/stat") as fh:
            values = [int(v) for v in fh.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # total, idle + iowait

    total0, idle0 = sample()
    time.sleep(window_s)
    total1, idle1 = sample()
    return 1.0 - (idle1 - idle0) / max(1, total1 - total0)


def _settle(say: Any, quiet: float = 0.10, timeout_s: float = 30.0) -> None:
    """Before a timed case: the disk flushed and the machine quiet (the services' start-up work
    done: imports, the zygote, the disk image pool), so no case inherits the previous one's
    write-back or the services' start."""
    started = time.monotonic()
    os.sync()
    while _cpu_busy() > quiet and time.monotonic() - started < timeout_s:
        pass
    say(f"  (settled in {time.monotonic() - started:.1f} s)")


def _wipe_node(home: Path) -> None:
    """Forget what the node (node-1: the stack's home) staged and cached."""
    for name in ("envs", "cache"):
        shutil.rmtree(home / name, ignore_errors=True)


def _wipe_builder(home: Path) -> None:
    shutil.rmtree(home / "builder", ignore_errors=True)


def _remove_prefix(stack: StackFixture, prefix: str) -> int:
    client = stack.s3.client()
    bucket = stack.s3.bucket
    names = [o.object_name for o in client.list_objects(bucket, prefix=prefix, recursive=True)]
    for name in names:
        client.remove_object(bucket, name)
    return len(names)


def _seed_data(stack: StackFixture, mib: int) -> int:
    client = stack.s3.client()
    files = max(1, mib // 12)
    per = (mib << 20) // files
    block = os.urandom(1 << 20)
    for i in range(files):
        body = (block * (per // len(block) + 1))[:per]
        body = i.to_bytes(8, "big") + body[8:]
        client.put_object(
            "dsec-demo", f"{DATA_PREFIX}part-{i:03d}.bin", io.BytesIO(body), len(body)
        )
    return files * per


# --------------------------------------------------------------------------------------- peer


def _peer(
    work: Path, stack: StackFixture, *, pip_cache: Path, fresh_venv: bool
) -> dict[str, float]:
    """The do-it-yourself path; returns stage times (ms)."""
    times: dict[str, float] = {}
    venv, data = work / "venv", work / "data"
    t0 = time.perf_counter()
    if fresh_venv:
        shutil.rmtree(venv, ignore_errors=True)
        shutil.rmtree(data, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        times["venv"] = (time.perf_counter() - t0) * 1000
        t = time.perf_counter()
        env = {**os.environ, "PIP_CACHE_DIR": str(pip_cache), "PIP_CONFIG_FILE": os.devnull}
        subprocess.run(
            [
                str(venv / "bin" / "pip"),
                "install",
                "-q",
                "--disable-pip-version-check",
                *(f"{n}{v}" for n, v in PACKAGES),
            ],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
        times["pip_install"] = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        client = stack.s3.client()
        data.mkdir(parents=True)
        for obj in client.list_objects("dsec-demo", prefix=DATA_PREFIX, recursive=True):
            client.fget_object("dsec-demo", obj.object_name, str(data / Path(obj.object_name).name))
        times["s3_download"] = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    key = stack.vault.client().secrets.kv.v2.read_secret_version(
        path="default/agent-tools/websearch", mount_point="secret", raise_on_deleted_version=True
    )["data"]["data"]["key"]
    times["vault"] = (time.perf_counter() - t) * 1000
    t = time.perf_counter()
    code = work / "code"
    code.mkdir(exist_ok=True)
    (code / "agent.py").write_text(AGENT)
    proc = subprocess.Popen(
        [
            "bwrap",
            "--unshare-all",
            "--share-net",
            "--die-with-parent",
            "--tmpfs",
            "/tmp",
            "--ro-bind",
            "/usr",
            "/usr",
            "--ro-bind",
            "/lib",
            "/lib",
            "--ro-bind-try",
            "/lib64",
            "/lib64",
            "--ro-bind",
            "/bin",
            "/bin",
            "--ro-bind",
            "/etc/resolv.conf",
            "/etc/resolv.conf",
            "--ro-bind",
            str(Path(sys.base_prefix)),
            str(Path(sys.base_prefix)),
            "--ro-bind",
            str(venv),
            str(venv),
            "--tmpfs",
            "/workspace",
            "--ro-bind",
            str(code / "agent.py"),
            "/workspace/agent.py",
            "--ro-bind",
            str(data),
            "/workspace/data",
            "--proc",
            "/proc",
            "--dev",
            "/dev",
            "--chdir",
            "/workspace",
            "--setenv",
            "WEB_SEARCH_KEY",
            key,
            str(venv / "bin" / "python"),
            "agent.py",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    times["bwrap_first_line"] = (time.perf_counter() - t) * 1000
    _, err = proc.communicate(timeout=120)
    if proc.returncode != 0 or not first.startswith(b"ready"):
        raise RuntimeError(f"peer sandbox failed ({proc.returncode}): {first!r} {err[-800:]!r}")
    times["total"] = (time.perf_counter() - t0) * 1000
    return {k: round(v, 1) for k, v in times.items()}


# --------------------------------------------------------------------------------------- main


def _world(home: Path, env: dict[str, str]) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    world_dir = home / "world"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dsec_testing.demo_world",
            "--dir",
            str(world_dir),
            "--dns-port",
            "0",
            "--max-seconds",
            "3600",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **env},
    )
    deadline = time.monotonic() + 60
    while not (world_dir / "world.json").exists():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("the demo world did not start (it needs root for port 443)")
        time.sleep(0.1)
    subprocess.run(
        [sys.executable, "-m", "dsec_testing.demo_world", "seed", "--dir", str(world_dir)],
        check=True,
        env={**os.environ, **env},
        stdout=subprocess.DEVNULL,
    )
    return proc, json.loads((world_dir / "world.json").read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="60 MiB of data, 2 warm runs")
    parser.add_argument("--data-mb", type=int, default=300)
    parser.add_argument("--warm", type=int, default=5, help="warm-node runs (p50)")
    parser.add_argument(
        "--rounds",
        type=at_least_one,
        default=3,
        help="rounds of the cold cases, DSec's and the peer's in turn (median; this VM's disk "
        "speed moves by 2x from one cold case to the next)",
    )
    parser.add_argument("--json", action="store_true", help="only the JSON line")
    args = parser.parse_args()
    if args.quick:
        args.data_mb, args.warm, args.rounds = min(args.data_mb, 60), 2, 1
    if os.geteuid() != 0 or shutil.which("bwrap") is None:
        print("e2e needs root (sandboxes, port 443 of the demo world) and bwrap", file=sys.stderr)
        return 2
    say = (lambda *_: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    result: dict[str, Any] = {"packages": len(PACKAGES), "apis": len(APIS)}
    with tempfile.TemporaryDirectory(prefix="dsec-e2e-") as tmp:
        home = Path(tmp) / "stack"
        stack = StackFixture(home)
        services = ServiceRunner(stack)
        world = None
        try:
            env = stack.env()
            os.environ.update(env)
            world, info = _world(Path(tmp), env)
            node_env = {"DSEC_DNS_UPSTREAM": info["dns"], "DSEC_DNS_TRUSTED_TARGETS": "127.0.0.53"}
            result["data_bytes"] = _seed_data(stack, args.data_mb)
            code = Path(tmp) / "code"
            code.mkdir()
            (code / "agent.py").write_text(AGENT)
            spec = spec_text()
            cold: list[dict[str, Any]] = []
            warm_s3: list[dict[str, Any]] = []
            peer_cold: list[dict[str, float]] = []
            peer_warm_cache: list[dict[str, float]] = []

            services.start("policy", "builder", "nodeagent", env=node_env, timeout=120)
            work = Path(tmp) / "peer"
            work.mkdir()

            def cold_case(wheels_too: bool) -> dict[str, Any]:
                """A new node (nothing staged or cached), the builder's and the cluster's
                environments gone and, ``wheels_too``, the cluster's wheel cache too."""
                services.stop("builder")
                services.stop("nodeagent")
                if wheels_too:
                    _remove_prefix(stack, "wheels/")
                _remove_prefix(stack, "envs/")
                _wipe_builder(home)
                _wipe_node(home)
                services.start("builder", "nodeagent", env=node_env, timeout=120)
                _settle(say)
                return asyncio.run(_submit_until_ready(spec, code))

            for round_ in range(args.rounds):
                say(f"round {round_ + 1} of {args.rounds}: cold node, cold cache ...")
                cold.append(cold_case(wheels_too=True))
                say(f"  {cold[-1]['ready_ms'] / 1000:.1f} s  {cold[-1]['output']}")
                say("cold node, warm S3 wheel cache ...")
                warm_s3.append(cold_case(wheels_too=False))
                say(f"  {warm_s3[-1]['ready_ms'] / 1000:.1f} s")

                say("peer: venv + pip (cold, then warm cache) + hvac + minio + bwrap ...")
                pip_cache = Path(tmp) / f"pip-cache-{round_}"  # (a cold pip cache each round)
                _settle(say)
                peer_cold.append(_peer(work, stack, pip_cache=pip_cache, fresh_venv=True))
                _settle(say)
                peer_warm_cache.append(_peer(work, stack, pip_cache=pip_cache, fresh_venv=True))
                pc, pw = peer_cold[-1]["total"], peer_warm_cache[-1]["total"]
                say(f"  {pc / 1000:.1f} s, {pw / 1000:.1f} s")

            say(f"warm node x{args.warm} ...")
            _settle(say)
            warm_runs = [asyncio.run(_submit_until_ready(spec, code)) for _ in range(args.warm)]
            warm_ms = statistics.median(r["ready_ms"] for r in warm_runs)
            say(f"  p50 {warm_ms / 1000:.2f} s")
            peer_warm = [
                _peer(work, stack, pip_cache=pip_cache, fresh_venv=False) for _ in range(args.warm)
            ]
            peer_warm_ms = statistics.median(r["total"] for r in peer_warm)
        finally:
            services.close()
            if world is not None:
                world.terminate()
                world.wait(timeout=30)
            stack.close()
    docker = (
        shutil.which("docker") is not None
        and subprocess.run(["docker", "info"], capture_output=True).returncode == 0
    )
    mid = _median_round(cold)
    mid_s3 = _median_round(warm_s3)
    mid_peer = _median_round(peer_cold, key="total")
    result.update(
        {
            "rounds": args.rounds,
            "dsec": {
                "cold_ms": mid["ready_ms"],
                "cold_ms_rounds": [r["ready_ms"] for r in cold],
                "cold_warm_s3_ms": mid_s3["ready_ms"],
                "cold_warm_s3_ms_rounds": [r["ready_ms"] for r in warm_s3],
                "warm_ms_p50": round(warm_ms, 1),
                # (each figure and its stages: the round whose time is the median)
                "cold_events_ms": mid["events_ms"],
                "cold_build_ms": mid["build_ms"],
                "cold_node_ms": mid["node_ms"],
                "warm_s3_events_ms": mid_s3["events_ms"],
                "warm_s3_build_ms": mid_s3["build_ms"],
                "warm_s3_node_ms": mid_s3["node_ms"],
                "warm_events_ms": warm_runs[-1]["events_ms"],
                "warm_node_ms": warm_runs[-1]["node_ms"],
            },
            "peer": {
                "cold_ms": mid_peer["total"],
                "cold_ms_rounds": [r["total"] for r in peer_cold],
                "cold_stages_ms": mid_peer,
                "warm_pip_cache_ms": _median_round(peer_warm_cache, key="total")["total"],
                "warm_pip_cache_ms_rounds": [r["total"] for r in peer_warm_cache],
                "warm_ms_p50": round(peer_warm_ms, 1),
            },
            "docker": "no Docker daemon on this machine" if not docker else "not measured",
        }
    )
    c, p = result["dsec"]["cold_ms"] / 1000, result["peer"]["cold_ms"] / 1000
    s3, pw = result["dsec"]["cold_warm_s3_ms"] / 1000, result["peer"]["warm_pip_cache_ms"] / 1000
    ratio = (
        f"e2e (median of {args.rounds} round(s)): spec->ready cold {c:.1f} s vs peer {p:.1f} s"
        f" ({p / c:.2f}x); warm S3 {s3:.1f} s vs peer warm pip {pw:.1f} s; warm node"
        f" {warm_ms / 1000:.2f} s vs peer {peer_warm_ms / 1000:.2f} s"
    )
    if args.json:
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            emit("e2e", result, ratio)
        print(json.dumps(result))
    else:
        emit("e2e", result, ratio)
    return 0


if __name__ == "__main__":
    sys.exit(main())
