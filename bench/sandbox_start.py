"""Sandbox start: DSec (every layer) beside plain subprocess, `unshare` and bubblewrap, one run.

    sudo .venv/bin/python bench/sandbox_start.py [--n 50] [--quick] [--json]

Each variant starts the same interpreter with the same one-line program and is timed from the
launch call to the moment its first line of output can be read (launch-to-first-line). Variants
take turns, start by start, so background load hits them alike. The peers' first line is read
from a pipe (the benchmark blocks in ``readline``); DSec's goes to its log file, which the
benchmark watches with inotify (it sleeps until the supervisor writes), so neither observer
takes CPU from the start it measures. ``--poll`` watches the log by polling it every 0.2 ms
instead (the method before 2026-12-02: on 2 busy CPUs the polling loop competes with the
sandbox's interpreter).

- DSec: ``SandboxManager.launch`` — plan, cgroup (v1 memory/cpu/pids + v2 dir), pid/mount/ipc/uts
  namespaces, minimal read-only root via pivot_root, unprivileged uid, no capabilities,
  no_new_privs, Landlock, seccomp, semantic layer (sitecustomize with one rule); its stdout is a
  log file, polled every 0.2 ms. ``sandbox.ready`` (every layer applied, workload exec'd) is
  reported too, with the per-layer breakdown. The pre-exec stage is forked by the node agent's
  pre-forked launcher (the zygote), as in production: its supervisor and init are forked ahead,
  50 ms after the previous launch (the shell), and init makes its mount namespace and the root
  view's /proc and /dev while the manager plans. The disk quota (``/workspace/output``,
  the default 256 MiB) comes from the node's pool of images formatted and mounted ahead, as in
  production: the warm-up start fills it, each start's refill runs in the background, 150 ms
  after the start (a burst of starts faster than the refill formats and mounts its own, as the
  first start does). After each DSec start the benchmark waits for that background work
  (``SandboxManager.settle``), so no variant is timed while another's runs.
- dsec_spawn: the same, with the pre-exec stage started as a fresh interpreter per sandbox (the
  launch path before the zygote), for comparison.
- subprocess: ``subprocess.Popen`` of the interpreter, no isolation.
- unshare: util-linux ``unshare --mount --pid --ipc --uts --fork`` (namespaces only).
- bwrap: bubblewrap with the same namespaces, a minimal read-only root (the runtime and /usr),
  private /proc, /dev and /tmp, all capabilities dropped, and DSec's seccomp filter (--seccomp).
  No cgroup, Landlock, uid change or semantic layer.

Needs root (namespaces, cgroups).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import at_least_one, emit, percentile
from dsec_nodeagent.sandbox import SandboxConfig, SandboxManager
from dsec_nodeagent.sandbox.discovery import RuntimeView, discover
from dsec_nodeagent.sandbox.seccomp import build_filter
from dsec_nodeagent.semantic import compile_rules

PROGRAM = "print('ready', flush=True)"
RULES = {
    "rules": [
        {"name": "no-etc-writes", "on": "open", "match": {"path": "/etc/*"}, "action": "deny"}
    ]
}
"""The semantic layer's rules of every DSec start (one rule: the layer loaded and consulted)."""
POLL_S = 0.0002
IN_MODIFY = 0x2
FIRST_LINE_TIMEOUT_S = 60.0


class _LogWatch:
    """inotify on a log directory: readable when a file in it was written to."""

    def __init__(self, directory: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if libc.inotify_add_watch(self.fd, os.fsencode(directory), IN_MODIFY) < 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"inotify_add_watch {directory}")

    async def until_written(self, path: Path) -> None:
        """Return once ``path`` holds at least one byte (sleeping in between)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FIRST_LINE_TIMEOUT_S
        while not (path.exists() and path.stat().st_size > 0):
            woke: asyncio.Future[None] = loop.create_future()
            loop.add_reader(self.fd, _wake, woke)
            try:
                await asyncio.wait_for(woke, max(0.0, deadline - loop.time()))
            finally:
                loop.remove_reader(self.fd)
            try:
                while os.read(self.fd, 4096):
                    pass
            except BlockingIOError:
                pass

    def close(self) -> None:
        os.close(self.fd)


def _wake(woke: asyncio.Future[None]) -> None:
    if not woke.done():
        woke.set_result(None)


def _stats(samples: list[float]) -> dict[str, float]:
    return {
        "p50_ms": round(percentile(samples, 0.5), 2),
        "p99_ms": round(percentile(samples, 0.99), 2),
        "mean_ms": round(statistics.fmean(samples), 2),
        "n": len(samples),
    }


def _first_line_ms(argv: list[str], **popen: Any) -> float:
    start = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, **popen)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    elapsed = (time.perf_counter() - start) * 1000
    proc.wait()
    if line.strip() != b"ready":
        raise RuntimeError(f"{argv[0]}: unexpected first line {line!r}")
    return elapsed


def _bwrap_dirs(view: RuntimeView) -> list[str]:
    """The host directories bubblewrap binds read-only: the runtime's and the C library's."""
    return sorted({*view.ro_dirs, "/usr/lib/x86_64-linux-gnu"})


def _bwrap_argv(
    runtime_dirs: list[str],
    seccomp_fd: int,
    command: list[str],
    binds: tuple[tuple[str, str], ...] = (),
) -> list[str]:
    """bubblewrap running ``command`` with the namespaces, binds (``runtime_dirs`` at their
    own paths, then ``binds`` as source and destination) and DSec's seccomp filter (read
    from ``seccomp_fd``, which the caller passes on)."""
    argv = ["bwrap"]
    for path in runtime_dirs:
        argv += ["--ro-bind", path, path]
    for source, destination in binds:
        argv += ["--ro-bind", source, destination]
    argv += [
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--ro-bind",
        "/usr/lib64",
        "/usr/lib64",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--tmpfs",
        "/tmp",
        "--unshare-pid",
        "--unshare-ipc",
        "--unshare-uts",
        "--new-session",
        "--die-with-parent",
        "--cap-drop",
        "ALL",
        "--seccomp",
        str(seccomp_fd),
        *command,
    ]
    return argv


async def _dsec_once(
    manager: SandboxManager,
    index: int,
    runtime: Path,
    rules: dict[str, Any],
    code_dir: Path,
    poll: bool = False,
) -> tuple[float, float, dict[str, float]]:
    sid = f"bench-{os.getpid()}-{index}"
    config = SandboxConfig(
        sandbox_id=sid,
        argv=["python", "-c", PROGRAM],
        runtime=runtime,
        code_dir=code_dir,
        write_allowed=["/tmp", "/workspace/output"],
        semantic_rules=rules,
    )
    stdout = manager.log_paths(sid)[0]
    watch = None
    if not poll:  # the directory the manager would make: made here, to be watched
        stdout.parent.mkdir(parents=True, exist_ok=True)
        watch = _LogWatch(stdout.parent)
    try:
        start = time.perf_counter()
        launch = asyncio.ensure_future(manager.launch(config))
        # Watched from the launch call on: the first line may come before launch() returned.
        if watch is not None:
            await watch.until_written(stdout)
        else:
            while not (stdout.exists() and stdout.stat().st_size > 0):
                await asyncio.sleep(POLL_S)
        first_line = (time.perf_counter() - start) * 1000
    finally:
        if watch is not None:
            watch.close()
    ready = await launch
    result = await manager.wait(sid)
    if result.reason.value != "ok" or stdout.read_text().strip() != "ready":
        raise RuntimeError(f"DSec sandbox {sid} ended {result.reason}: {result.detail}")
    await manager.purge(sid)
    # The node's background work after a start (the next shell, the disk image pool's refill)
    # ends before the next variant's start: no variant is timed while another's runs.
    await manager.settle()
    return first_line, ready.ready_ms, ready.timings_ms


async def run(n: int, poll: bool = False) -> None:
    runtime = Path(sys.executable)
    view = discover(runtime)
    python = view.executable
    rules = compile_rules(RULES)
    program = build_filter()
    samples: dict[str, list[float]] = {
        "dsec": [],
        "dsec_spawn": [],
        "subprocess": [],
        "unshare": [],
        "bwrap": [],
    }
    ready_ms: list[float] = []
    spawn_ready_ms: list[float] = []
    layers: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="dsec-bench-start-") as tmp:
        home = Path(tmp) / "home"
        code_dir = Path(tmp) / "code"
        code_dir.mkdir()
        manager = SandboxManager(home)
        spawning = SandboxManager(Path(tmp) / "home-spawn", use_zygote=False, node_id="bench-2")
        seccomp_path = Path(tmp) / "seccomp.bpf"
        seccomp_path.write_bytes(program)
        bwrap_dirs = _bwrap_dirs(view)
        await _dsec_once(manager, -1, runtime, rules, code_dir)  # warm the runtime cache
        await _dsec_once(spawning, -1, runtime, rules, code_dir)  # (and start the zygote)
        for index in range(n):
            first, ready, timings = await _dsec_once(manager, index, runtime, rules, code_dir, poll)
            samples["dsec"].append(first)
            ready_ms.append(ready)
            for layer, ms in timings.items():
                layers.setdefault(layer, []).append(ms)
            first, ready, _ = await _dsec_once(spawning, index, runtime, rules, code_dir, poll)
            samples["dsec_spawn"].append(first)
            spawn_ready_ms.append(ready)
            samples["subprocess"].append(_first_line_ms([python, "-c", PROGRAM]))
            samples["unshare"].append(
                _first_line_ms(
                    [
                        "unshare",
                        "--mount",
                        "--pid",
                        "--ipc",
                        "--uts",
                        "--fork",
                        python,
                        "-c",
                        PROGRAM,
                    ]
                )
            )
            with open(seccomp_path, "rb") as fh:
                samples["bwrap"].append(
                    _first_line_ms(
                        _bwrap_argv(bwrap_dirs, fh.fileno(), [python, "-c", PROGRAM]),
                        pass_fds=(fh.fileno(),),
                    )
                )
        await manager.shutdown(stop_sandboxes=True)
        await spawning.shutdown(stop_sandboxes=True)
    results: dict[str, Any] = {name: _stats(values) for name, values in samples.items()}
    results["dsec"]["target"] = "p50 <= bwrap's in the same run"
    results["dsec_sandbox_ready"] = _stats(ready_ms)
    results["dsec_sandbox_ready"]["target_p50_ms"] = 25
    results["dsec_spawn_sandbox_ready"] = _stats(spawn_ready_ms)
    results["dsec_layers_p50_ms"] = {k: round(percentile(v, 0.5), 3) for k, v in layers.items()}
    d, s = results["dsec"]["p50_ms"], results["subprocess"]["p50_ms"]
    u, b = results["unshare"]["p50_ms"], results["bwrap"]["p50_ms"]
    r = results["dsec_sandbox_ready"]["p50_ms"]
    sp, sr = results["dsec_spawn"]["p50_ms"], results["dsec_spawn_sandbox_ready"]["p50_ms"]
    results["dsec_over_bwrap_p50"] = round(d / b, 3)
    ratio = (
        f"sandbox_start: DSec all layers (zygote) first line p50 {d:.1f} ms (p99 "
        f"{results['dsec']['p99_ms']:.1f}), sandbox.ready p50 {r:.1f} ms (target <= 25); "
        f"without the zygote {sp:.1f} ms (ready {sr:.1f}); "
        f"subprocess {s:.1f} ms, unshare {u:.1f} ms, bwrap {b:.1f} ms -> DSec = "
        f"{d / s:.2f}x subprocess, {d / u:.2f}x unshare, {d / b:.2f}x bwrap (target <= 1)"
    )
    emit(
        "sandbox_start",
        results,
        ratio,
        starts=n,
        favordynmods=_favordynmods(),
        dsec_log_observer="poll" if poll else "inotify",
        load_average=round(os.getloadavg()[0], 2),
    )


def _favordynmods() -> bool:
    with open("/proc/self/mounts") as fh:
        return any(" cgroup2 " in line and "favordynmods" in line for line in fh)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--n", type=at_least_one, default=50, help="starts per variant (>= 50 for p99)"
    )
    parser.add_argument("--quick", action="store_true", help="10 starts per variant")
    parser.add_argument("--json", action="store_true", help="print only the ratio and JSON lines")
    parser.add_argument(
        "--poll", action="store_true", help="watch DSec's log by polling (the old observer)"
    )
    args = parser.parse_args()
    if args.quick:
        args.n = 10
    if os.geteuid() != 0:
        sys.exit("sandbox_start needs root (namespaces and cgroups)")
    for tool in ("unshare", "bwrap"):
        if shutil.which(tool) is None:
            sys.exit(f"sandbox_start needs {tool} (Debian packages util-linux, bubblewrap)")
    asyncio.run(run(args.n, args.poll))


if __name__ == "__main__":
    main()
