"""Run every benchmark side by side with its peer; print one summary line per benchmark.

    uv run python bench/run_all.py [--quick] [NAME ...]

Each benchmark writes ``bench/results/<name>.json`` and prints a ratio line and a JSON last line.
Kernel benchmarks (sandbox_start, launch_first_instruction, egress, noisy_neighbour) need root.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
BENCHES = {
    "bus": ["--events", "20000"],
    "audit_verify": [],
    "build": [],
    "sandbox_start": ["--n", "50"],
    "launch_first_instruction": ["--n", "40"],
    "egress": [],
    "snapshot": [],
    "snapshot_turns": [],
    "ipc": [],
    "noisy_neighbour": [],
    "placement": [],
    "state": [],
    "migration": [],
    "e2e": [],
    "service_stop": [],
    "tenant_burst": [],
}
QUICK = {
    "bus": ["--quick"],
    "audit_verify": ["--events", "50000", "--repeat", "1"],
    "egress": ["--quick"],
    "ipc": ["--quick"],
    "sandbox_start": ["--n", "20"],
    "launch_first_instruction": ["--quick"],
    "noisy_neighbour": ["--n", "8", "--flood-s", "10"],
    "placement": ["--seeds", "3"],
    "state": ["--quick"],
    "migration": ["--quick"],
    "e2e": ["--quick"],
    "service_stop": ["--rounds", "2"],
    "tenant_burst": ["--burst", "1000", "--rounds", "1"],
    "snapshot_turns": ["--rounds", "1"],
}


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter runs where supported")
    parser.add_argument("names", nargs="*", help=f"default: all of {', '.join(BENCHES)}")
    args = parser.parse_args()
    failed = []
    for name in args.names or list(BENCHES):
        script = HERE / f"{name}.py"
        if not script.exists():
            print(f"{name}: missing {script}", file=sys.stderr)
            failed.append(name)
            continue
        extra = QUICK.get(name, []) if args.quick else BENCHES[name]
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, str(script), *extra], capture_output=True, text=True, cwd=HERE.parent
        )
        lines = [line for line in proc.stdout.strip().splitlines() if line.strip()]
        if proc.returncode != 0 or not lines:
            print(
                f"{name}: FAILED (exit {proc.returncode})\n{proc.stderr[-2000:]}", file=sys.stderr
            )
            failed.append(name)
            continue
        ratio = lines[-2] if len(lines) >= 2 else ""
        json.loads(lines[-1])  # every benchmark ends with its JSON result
        print(f"{ratio}  [{time.monotonic() - started:.0f} s]")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
