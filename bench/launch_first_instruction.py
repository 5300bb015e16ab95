"""Launch to the workload's first instruction: DSec (every layer) beside bubblewrap, one run.

    sudo .venv/bin/python bench/launch_first_instruction.py [--n 40] [--json]

``bench/sandbox_start.py`` times the first line of an interpreter, ~30 ms of which is the
interpreter's own start; this one times what each tool does before the workload runs. The
workload is a static C program (built here with the C compiler the project's extensions need)
that prints ``CLOCK_MONOTONIC`` at its first instruction; the benchmark subtracts the launch
call's time. Starts alternate, DSec's and bubblewrap's, so background load hits both alike.

- DSec: ``SandboxManager.launch`` with every layer on (as ``sandbox_start.py``: the zygote, a
  shell made ahead, the disk quota from the pool, one semantic rule), the stage records beside
  it: when the workload's process made its ``execve`` call (``exec_call_ms``) and how long the
  node agent waited for the ready signal after it (the ``exec`` layer).
- bubblewrap: the same namespaces, read-only runtime binds, private /proc, /dev and /tmp, no
  capabilities and DSec's seccomp filter (``sandbox_start.py``'s argv), started with
  ``subprocess`` from this process.

Needs root and a C compiler (``cc``) with a static C library.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import at_least_one, emit
from dsec_nodeagent.sandbox import SandboxConfig, SandboxManager
from dsec_nodeagent.sandbox.discovery import discover
from dsec_nodeagent.sandbox.seccomp import build_filter
from dsec_nodeagent.semantic import compile_rules
from sandbox_start import RULES, _bwrap_argv, _bwrap_dirs, _stats

PROBE = r"""
#include <stdio.h>
#include <time.h>
#include <unistd.h>
int main(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    char line[32];
    int n = snprintf(line, sizeof line, "%lld\n", now.tv_sec * 1000000000LL + now.tv_nsec);
    return write(1, line, n) == n ? 0 : 1;
}
"""


def _build_probe(directory: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("launch_first_instruction needs a C compiler (cc)")
    source, binary = directory / "probe.c", directory / "probe"
    source.write_text(PROBE)
    subprocess.run([cc, "-static", "-O2", "-o", str(binary), str(source)], check=True)
    return binary


async def _dsec_once(
    manager: SandboxManager, index: int, code_dir: Path, rules: dict[str, Any]
) -> dict[str, float]:
    sid = f"first-insn-{os.getpid()}-{index}"
    config = SandboxConfig(
        sandbox_id=sid,
        argv=["/workspace/code/probe"],
        runtime=Path(sys.executable),
        code_dir=code_dir,
        write_allowed=["/tmp", "/workspace/output"],
        semantic_rules=rules,
    )
    start = time.monotonic_ns()
    ready = await manager.launch(config)
    result = await manager.wait(sid)
    printed = Path(result.stdout_path).read_text().strip()
    if result.reason.value != "ok" or not printed.isdigit():
        raise RuntimeError(f"DSec sandbox {sid} ended {result.reason}: {result.detail}")
    await manager.purge(sid)
    await manager.settle()  # (the node's background work ends before the next start)
    exec_layer = ready.timings_ms.get("exec", 0.0)
    return {
        "first_instruction_ms": (int(printed) - start) / 1e6,
        "exec_call_ms": ready.ready_ms - exec_layer,
        "exec_layer_ms": exec_layer,
        "ready_ms": ready.ready_ms,
    }


def _bwrap_once(dirs: list[str], probe: Path, seccomp_path: Path) -> float:
    fd = os.open(seccomp_path, os.O_RDONLY)
    try:
        argv = _bwrap_argv(dirs, fd, ["/probe"], binds=((str(probe), "/probe"),))
        start = time.monotonic_ns()
        done = subprocess.run(argv, pass_fds=(fd,), capture_output=True, check=True)
    finally:
        os.close(fd)
    return (int(done.stdout) - start) / 1e6


async def run(n: int) -> None:
    rules = compile_rules(RULES)
    view = discover(Path(sys.executable))
    with tempfile.TemporaryDirectory(prefix="dsec-bench-first-") as tmp:
        work = Path(tmp)
        code_dir = work / "code"
        code_dir.mkdir()
        probe = _build_probe(code_dir)
        seccomp_path = work / "seccomp.bpf"
        seccomp_path.write_bytes(build_filter())
        dirs = _bwrap_dirs(view)  # (sandbox_start.py's bubblewrap, the probe in place of Python)
        manager = SandboxManager(work / "home")
        samples: dict[str, list[float]] = {}
        try:
            await _dsec_once(manager, -1, code_dir, rules)  # warm: the zygote, the pool
            for index in range(n):
                for key, value in (await _dsec_once(manager, index, code_dir, rules)).items():
                    samples.setdefault(f"dsec_{key}", []).append(value)
                samples.setdefault("bwrap_first_instruction_ms", []).append(
                    _bwrap_once(dirs, probe, seccomp_path)
                )
        finally:
            await manager.shutdown()
    results = {key: _stats(values) for key, values in samples.items()}
    d = results["dsec_first_instruction_ms"]["p50_ms"]
    b = results["bwrap_first_instruction_ms"]["p50_ms"]
    results["dsec_over_bwrap_p50"] = round(d / b, 3)
    ratio = (
        f"launch_first_instruction: DSec p50 {d:.2f} ms (execve call at "
        f"{results['dsec_exec_call_ms']['p50_ms']:.2f}, exec layer "
        f"{results['dsec_exec_layer_ms']['p50_ms']:.2f}), bwrap p50 {b:.2f} ms -> "
        f"{d / b:.2f}x bwrap"
    )
    emit("launch_first_instruction", results, ratio, starts=n)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=at_least_one, default=40, help="starts per variant")
    parser.add_argument("--quick", action="store_true", help="10 starts per variant")
    parser.add_argument("--json", action="store_true", help="print only the ratio and JSON lines")
    args = parser.parse_args()
    if args.quick:
        args.n = 10
    if os.geteuid() != 0:
        sys.exit("launch_first_instruction needs root (namespaces and cgroups)")
    if shutil.which("bwrap") is None:
        sys.exit("launch_first_instruction needs bwrap (Debian package bubblewrap)")
    asyncio.run(run(args.n))


if __name__ == "__main__":
    main()
