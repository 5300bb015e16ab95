"""CLI start-up: wall time of the installed ``dsec`` entry point for a few common commands.

    uv run python bench/cli_start.py [--runs 20] [--dsec PATH]

Each command runs ``--runs`` times (after one warm-up run that fills the OS page cache and
the bytecode cache) as a fresh process, output discarded; p50 and p90 are reported, beside
``python -c pass`` (the interpreter's own start, the floor) and a bare Typer app with one
command (the floor of any Typer + rich CLI). None of these commands needs the stack.
Target: p50 ≤ 200 ms for each.
"""

from __future__ import annotations

import argparse
import os
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
]

BARE_TYPER = """
import typer
app = typer.Typer()
@app.command()
def hello(name: str = "x") -> None:
    "Say hello."
app()
"""


def timed(argv: list[str], runs: int) -> list[float]:
    """Seconds of each of ``runs`` runs of ``argv`` (one untimed warm-up first)."""
    env = {**os.environ, "COLUMNS": "100"}
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=True
        )
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument(
        "--dsec",
        default=str(Path(sys.executable).parent / "dsec"),
        help="the entry point to time (default: the one beside this Python)",
    )
    args = parser.parse_args()
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        bare = Path(tmp) / "bare_typer.py"
        bare.write_text(BARE_TYPER)
        cases = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "bare typer app --help": [sys.executable, str(bare), "--help"],
            **{f"dsec {' '.join(c)}": [args.dsec, *c] for c in COMMANDS},
        }
        for name, argv in cases.items():
            t = timed(argv, args.runs)
            results[name] = {
                "p50_ms": round(statistics.median(t) * 1000, 1),
                "p90_ms": round(percentile(t, 0.9) * 1000, 1),
                "min_ms": round(min(t) * 1000, 1),
            }
            print(f"{name:<28} p50 {results[name]['p50_ms']:7.1f} ms", file=sys.stderr)
    dsec_p50 = [v["p50_ms"] for k, v in results.items() if k.startswith("dsec ")]
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
