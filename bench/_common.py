"""Shared helpers of the benchmarks: percentiles, result files, a throwaway NATS server."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) by nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def free_port() -> int:
    """A TCP port free on loopback right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def nats_server() -> Iterator[str]:
    """A JetStream-enabled nats-server on a free port in a temp dir, for one benchmark run."""
    binary = shutil.which("nats-server") or str(Path(sys.executable).parent / "nats-server")
    port, mon = free_port(), free_port()
    with tempfile.TemporaryDirectory(prefix="dsec-bench-nats-") as store:
        proc = subprocess.Popen(
            [binary, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", store, "-m", str(mon)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            deadline = time.monotonic() + 10
            while True:
                try:
                    url = f"http://127.0.0.1:{mon}/healthz?js-enabled-only=true"
                    with urllib.request.urlopen(url, timeout=1) as r:
                        if r.status == 200:
                            break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("nats-server did not become healthy") from None
                    time.sleep(0.02)
            yield f"nats://127.0.0.1:{port}"
        finally:
            proc.terminate()
            proc.wait(10)


def emit(
    bench: str,
    results: dict[str, Any],
    ratio_line: str,
    *,
    summary: dict[str, Any] | None = None,
    **extra: Any,
) -> None:
    """Print the one-line ratio, write ``bench/results/<bench>.json``, print the JSON last.

    With ``summary`` (a benchmark whose last line has a fixed shape) the file also holds it and
    the last line printed is ``summary`` alone instead of the whole document."""
    doc = {
        "bench": bench,
        "results": results,
        **({"summary": summary} if summary is not None else {}),
        **extra,
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{bench}.json").write_text(json.dumps(doc, indent=2) + "\n")
    print(ratio_line)
    print(json.dumps(doc if summary is None else summary))


def emit_or_json(
    bench: str, results: dict[str, Any], ratio_line: str, json_only: bool, **extra: Any
) -> None:
    """:func:`emit`; with ``json_only`` the file is written the same and only the JSON
    document (with ``extra``) is printed."""
    if not json_only:
        emit(bench, results, ratio_line, **extra)
        return
    with contextlib.redirect_stdout(io.StringIO()):
        emit(bench, results, ratio_line, **extra)
    print(json.dumps({"bench": bench, "results": results, **extra}))


def at_least(least: int) -> Callable[[str], int]:
    """An argparse type: a whole number >= ``least``."""

    def whole(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"{value} is not a count: give {least} or more")
        return value

    return whole


at_least_one = at_least(1)
"""A count of events or runs: a whole number >= 1."""


async def until(check: Callable[[], Any], what: str, timeout: float, poll: float = 0.05) -> Any:
    """``check()``'s first true value, polled every ``poll`` s; exits the bench naming
    ``what`` after ``timeout`` s without one."""
    deadline = time.monotonic() + timeout
    while not (value := check()):
        if time.monotonic() > deadline:
            raise SystemExit(f"{Path(sys.argv[0]).stem} bench: not {what} within {timeout} s")
        await asyncio.sleep(poll)
    return value
