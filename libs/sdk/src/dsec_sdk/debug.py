"""``python -m dsec_sdk.debug``: the entrypoint of a repair sandbox (``dsec sandbox debug``).

It lists the calls the sandbox can replay (from ``$DSEC_REPLAY_FILE``), the failed ones first,
then waits, so that a person can run the agent (or ``python -m pdb agent.py``) in it with
``dsec sandbox exec``: every recorded call is answered from the recording, none made live.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import msgpack

from dsec_sdk.recording import ENV_REPLAY, Entry, decode_outcome, read_entries


def describe(path: Path) -> list[str]:
    """One line per recorded call: failed ones first."""
    entries = read_entries(path)
    lines = []
    for entry in sorted(entries, key=lambda e: not e.failed):
        mark = "FAILED" if entry.failed else "ok    "
        detail = ""
        if entry.key.kind == "tool" and entry.failed:
            _, frame = decode_outcome(entry.response)
            if isinstance(frame, list) and len(frame) >= 3:
                detail = f"  {frame[1]}: {frame[2]}"[:200]
        lines.append(f"{mark} {entry.key.kind} {_call(entry)}{detail}")
    return lines


def _call(entry: Entry) -> str:
    """``agent.tool(arg=value, ...)`` of a tool call; ``METHOD /path host`` of HTTP."""
    if entry.key.kind != "tool":
        return entry.key.describe()
    try:
        arguments = msgpack.unpackb(entry.key.body, raw=False)
    except (ValueError, msgpack.ExtraData):
        arguments = {}
    shown = ", ".join(f"{k}={v!r}" for k, v in dict(arguments).items())
    return f"{entry.key.describe()}({shown[:120]})"


def main() -> int:
    replay = os.environ.get(ENV_REPLAY)
    if not replay:
        print("no recording to replay here ($DSEC_REPLAY_FILE is not set)", flush=True)
    else:
        lines = describe(Path(replay))
        failed = sum(1 for line in lines if line.startswith("FAILED"))
        print(f"{len(lines)} recorded calls ready to replay, {failed} failed:", flush=True)
        for line in lines:
            print("  " + line, flush=True)
    print("repair sandbox ready: run your agent in it with `dsec sandbox exec`", flush=True)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
