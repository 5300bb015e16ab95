"""Helpers for tests of the stack and the CLI: run ``dsec`` as a user does (a process) or in this
process, read ``stack.json``, find the processes and listening ports a stack home left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
from dsec_cli.stack.adapters.procs import port_listening

DSEC = Path(sys.executable).parent / "dsec"


def run_dsec(
    *args: str, home: Path, env: dict[str, str] | None = None, timeout: float = 90.0
) -> subprocess.CompletedProcess[str]:
    """Run ``dsec ARGS`` as a user would: a process with ``DSEC_HOME=home``, no inherited
    ``DSEC_*`` variables, ``env`` added."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    base.update({"DSEC_HOME": str(home), "COLUMNS": "200"})
    base.update(env or {})
    return subprocess.run(
        [str(DSEC), *args], env=base, capture_output=True, text=True, timeout=timeout, check=False
    )


def run_dsec_inproc(*args: str, home: Path, env: dict[str, str] | None = None) -> Any:
    """Run ``dsec ARGS`` in this process (for commands that start nothing: saves the CLI's start
    time). Returns click's ``Result`` (``exit_code``, ``stdout``, ``stderr``)."""
    from dsec_cli.main import app
    from typer.testing import CliRunner

    cleared: dict[str, str | None] = {k: None for k in os.environ if k.startswith("DSEC_")}
    full_env: dict[str, str | None] = {**cleared, "DSEC_HOME": str(home), "COLUMNS": "200"}
    full_env.update(env or {})
    return CliRunner().invoke(app, list(args), env=full_env, catch_exceptions=False)


def read_stack_state(home: Path) -> dict[str, Any]:
    """``<home>/stack.json`` as a dict."""
    data: dict[str, Any] = json.loads((home / "stack.json").read_text())
    return data


def processes_under(home: Path) -> list[str]:
    """Live processes whose working directory is inside ``home`` (every server and service the
    stack starts runs there)."""
    root = str(home.resolve())
    found: list[str] = []
    for proc in psutil.process_iter(["pid", "name"]):
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            cwd = proc.cwd()
        except psutil.Error:
            continue
        if cwd == root or cwd.startswith(root + os.sep):
            found.append(f"{proc.info['name']} (pid {proc.pid})")
    return found


def recorded_ports(home: Path) -> list[int]:
    """Every port ``stack.json`` lists (server ports with their +offset siblings, service ports)."""
    st = read_stack_state(home)
    offsets = {"s3": (0, 10000), "vault": (0, 1)}
    ports: list[int] = []
    for name, rec in st["servers"].items():
        if rec.get("external"):
            continue
        for port in rec.get("ports", []):
            ports.extend(port + off for off in offsets.get(name, (0,)))
    ports.extend(rec["metrics_port"] for rec in st["services"].values())
    return ports


def listening(ports: list[int]) -> list[int]:
    """The ports among ``ports`` that accept connections."""
    return [p for p in ports if port_listening(p)]
