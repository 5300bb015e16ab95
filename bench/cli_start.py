"""CLI start-up: wall time of the installed ``dsec`` entry point for a few common commands.

    uv run python bench/cli_start.py [--runs 20] [--dsec PATH] [--against SRC]

Each command runs ``--runs`` times (after one warm-up run that fills the OS page cache and
the bytecode cache) as a fresh process, output discarded; the p50 and p90 of the wall time and
the p50 of the CPU time (user + system: less sensitive than the wall time to other work on a
shared machine) are reported, beside ``python -c pass`` (the interpreter's own start, the
floor) and a bare Typer app with one command (the floor of any Typer + rich CLI). None of
these commands needs the stack. Target: p50 ≤ 200 ms for each.

``--against SRC``: also time another version of the CLI, its sources in SRC (e.g.
``git archive OLD libs | tar -x -C /tmp/old`` and ``python -m compileall``; its ``libs/*/src``
go first on ``sys.path``), each of its runs right after the same run of this one, so that both
see the same load (a command it does not have, such as ``--version`` before it existed, fails
at once: its figure then is that of a usage error).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import emit, percentile

COMMANDS = [
    ["--help"],
    ["--version"],
    ["version", "--json"],
    ["sandbox", "list", "--help"],
    ["events", "tail", "--help"],
    ["submit", "--help"],
    ["events", "schema"],  # a command that runs: loads the event models, prints 270 KB
]

BARE_TYPER = """
import typer
app = typer.Typer()
@app.command()
def hello(name: str = "x") -> None:
    "Say hello."
app()
"""

# A group, its subcommand's help asked for: Typer then also coerces the root's options
# (completion), which imports pydantic (typer._adapters) — the floor of `dsec sandbox list --help`.
BARE_TYPER_GROUP = """
import typer
app = typer.Typer()
sub = typer.Typer()
app.add_typer(sub, name="sub")
@sub.command()
def hello(name: str = "x") -> None:
    "Say hello."
@sub.command()
def bye() -> None:
    "Say bye."
app()
"""


OLD_MAIN = """
import sys
sys.path[:0] = SRC
from dsec_cli.main import main
sys.argv[0] = "dsec"
main()
"""


def once(argv: list[str], check: bool = True) -> tuple[float, float]:
    """Wall and CPU seconds of one run of ``argv``."""
    env = {**os.environ, "COLUMNS": "100"}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=check)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def summary(samples: list[tuple[float, float]]) -> dict[str, float]:
    walls = [w for w, _ in samples]
    return {
        "p50_ms": round(statistics.median(walls) * 1000, 1),
        "p90_ms": round(percentile(walls, 0.9) * 1000, 1),
        "cpu_p50_ms": round(statistics.median(c for _, c in samples) * 1000, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument(
        "--dsec",
        default=str(Path(sys.executable).parent / "dsec"),
        help="the entry point to time (default: the one beside this Python)",
    )
    parser.add_argument("--against", type=Path, help="sources of another version to compare")
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        bare = Path(tmp) / "bare_typer.py"
        bare.write_text(BARE_TYPER)
        group = Path(tmp) / "bare_typer_group.py"
        group.write_text(BARE_TYPER_GROUP)
        cases: dict[str, list[list[str]]] = {
            "python -c pass": [[sys.executable, "-c", "pass"]],
            "bare typer app --help": [[sys.executable, str(bare), "--help"]],
            "bare typer sub hello --help": [[sys.executable, str(group), "sub", "hello", "--help"]],
        }
        old_main = ""
        if args.against is not None:
            src = [str(p) for p in sorted((args.against / "libs").glob("*/src"))]
            old_main = OLD_MAIN.replace("SRC", repr(src))
        for c in COMMANDS:
            cases[f"dsec {' '.join(c)}"] = [[args.dsec, *c]] + (
                [[sys.executable, "-c", old_main, *c]] if old_main else []
            )
        for name, argvs in cases.items():
            for i, argv in enumerate(argvs):
                once(argv, check=i == 0)  # warm-up: page cache, bytecode
            samples: list[list[tuple[float, float]]] = [[] for _ in argvs]
            for _ in range(args.runs):
                for i, argv in enumerate(argvs):  # interleaved: the same load for both
                    samples[i].append(once(argv, check=i == 0))
            results[name] = summary(samples[0])
            line = f"{name:<28} p50 {results[name]['p50_ms']:7.1f} ms"
            line += f" (CPU {results[name]['cpu_p50_ms']:.0f} ms)"
            if len(samples) > 1:
                results[name + " (against)"] = old = summary(samples[1])
                line += f"; against: p50 {old['p50_ms']:7.1f} ms (CPU {old['cpu_p50_ms']:.0f} ms)"
            print(line, file=sys.stderr)
    dsec_p50 = [
        v["p50_ms"] for k, v in results.items() if k.startswith("dsec ") and "against" not in k
    ]
    load = os.getloadavg()[0]
    emit(
        "cli_start",
        results,
        f"dsec start-up p50 {min(dsec_p50):.0f}-{max(dsec_p50):.0f} ms over {len(COMMANDS)} "
        f"commands (target ≤ 200 ms); bare typer {results['bare typer app --help']['p50_ms']:.0f}"
        f" ms; load average {load:.1f}",
        runs=args.runs,
        load_average=load,
    )


if __name__ == "__main__":
    main()
