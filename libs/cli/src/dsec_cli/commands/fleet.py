"""``dsec fleet simulate``: thousands of simulated GPU nodes in one process (KWOK-style).

The simulation runs in its own process (``python -m dsec_fleetsim``: the CLI imports no
service) in the foreground, until Ctrl-C or ``--for SECONDS``. It signs every node's events
with a node-agent identity the operator root certifies (so it needs the root key: run it on the
operator's machine) and connects to NATS as the ``fleetsim`` identity ``dsec up`` creates.
See ``docs/fleet-sim.md``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Annotated, Any

import typer
from dsec_core import natsperms
from dsec_core.natsclient import credential_path
from dsec_core.settings import Settings
from rich.live import Live
from rich.text import Text

from dsec_cli.common import EXIT_BAD_INPUT, EXIT_FAILED, console, err_console, fail

fleet_app = typer.Typer(
    help="A simulated fleet: many GPU nodes that join, heartbeat and run placements, "
    "indistinguishable from real node agents for the scheduler.",
    no_args_is_help=True,
)

MODULE = "dsec_fleetsim"


def _overriding_credential(settings: Settings) -> bool:
    """A credential that wins over an nkey seed (user in the URL, a ``.creds`` file)."""
    url = settings.nats_url or ""
    in_url = any("@" in part.partition("://")[2] for part in url.split(","))
    return in_url or settings.nats_creds is not None


def simulation_env(settings: Settings) -> dict[str, str]:
    """The environment of the simulation process: the caller's, connecting as the embedded
    stack's ``fleetsim`` NATS identity when the stack has one (a user's own credential may not
    publish node events); else as configured (a deployment: ``DSEC_NATS_NKEY_SEED`` pointing at
    the ``fleetsim.nk`` of ``dsec nats credentials``).

    Raises:
        typer.Exit: no credential for the fleet (a stack started by an older ``dsec up``).
    """
    env = dict(os.environ)
    env["DSEC_HOME"] = str(settings.home.resolve())
    seed = credential_path(settings.home, natsperms.FLEETSIM)
    if _overriding_credential(settings):
        return env
    if seed.is_file():
        env["DSEC_NATS_NKEY_SEED"] = str(seed.resolve())
        return env
    explicit = (settings.nats_url, settings.nats_nkey_seed, settings.nats_user)
    if any(v is not None for v in explicit):
        return env  # an external server: its own credential (or none)
    fail(
        f"no NATS identity for the simulated fleet at {seed}: restart the stack "
        "(`dsec down && dsec up`) so it creates one, or set DSEC_NATS_NKEY_SEED to a "
        "`fleetsim` credential (`dsec nats credentials`)",
        EXIT_BAD_INPUT,
    )


def _status_text(line: dict[str, Any]) -> Text:
    text = Text()
    text.append(f"t={line.get('t', 0):>6.0f}s  ", style="dim")
    text.append(f"{line.get('alive', 0)}/{line.get('nodes', 0)} nodes  ", style="bold")
    text.append(f"{line.get('events_per_s', 0):>7.0f} events/s  ")
    text.append(f"{line.get('cpu_us_per_event', 0):>5.0f} µs CPU/event  ")
    text.append(f"placements {line.get('placements', 0)} (running {line.get('running', 0)})  ")
    refused = int(line.get("refused", 0))
    text.append(f"refused {refused}  ", style="red" if refused else "")
    errors = int(line.get("publish_errors", 0))
    text.append(f"publish errors {errors}  ", style="red" if errors else "")
    text.append(f"RSS {line.get('rss_mib', 0):.0f} MiB", style="dim")
    return text


@fleet_app.command("simulate")
def simulate(
    nodes_csv: Annotated[
        Path | None,
        typer.Option(
            "--nodes-csv",
            help="An openb node list (sn,cpu_milli,memory_mib,gpu,model), e.g. "
            "bench/data/openb/openb_node_list_gpu_node.csv; node ids are sn, sanitised",
        ),
    ] = None,
    inventory: Annotated[
        Path | None,
        typer.Option("--inventory", help="A YAML inventory mixing models (docs/fleet-sim.md)"),
    ] = None,
    nodes: Annotated[
        int | None, typer.Option("--nodes", help="N identical nodes sim-0 .. sim-N-1")
    ] = None,
    gpus: Annotated[int, typer.Option("--gpus", help="GPUs per node (with --nodes)")] = 8,
    gpu_model: Annotated[
        str, typer.Option("--gpu-model", help="GPU model (with --nodes): H100, A100-80GB, ...")
    ] = "H100",
    cpu: Annotated[str, typer.Option("--cpu", help="CPU cores per node (with --nodes)")] = "128",
    memory: Annotated[str, typer.Option("--memory", help="Memory per node (with --nodes)")] = (
        "1TiB"
    ),
    prefix: Annotated[
        str | None, typer.Option("--prefix", help="Node id prefix (default sim; CSV: none)")
    ] = None,
    label: Annotated[
        list[str] | None, typer.Option("--label", help="k=v on every node (repeatable)")
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", help="Only the first N nodes")] = None,
    heartbeat_s: Annotated[
        float | None,
        typer.Option("--heartbeat-s", help="Heartbeat interval (default: the node agent's, 5 s)"),
    ] = None,
    run_for: Annotated[
        float, typer.Option("--run-for", help="Seconds a placed unit runs before it exits")
    ] = 300.0,
    script: Annotated[
        Path | None,
        typer.Option("--script", help="Health script: GPU heat, XID errors, crashes (YAML)"),
    ] = None,
    duration: Annotated[
        float | None, typer.Option("--for", help="Stop after SECONDS (default: until Ctrl-C)")
    ] = None,
    measure: Annotated[
        bool,
        typer.Option("--measure", help="Publish nothing: report signing cost and stream size"),
    ] = False,
    root_key: Annotated[
        Path | None,
        typer.Option("--root-key", help="Operator root key (default $DSEC_HOME/trust/root.key)"),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the JSON status lines (started/status/stopped)")
    ] = False,
) -> None:
    """Run simulated nodes until Ctrl-C (or --for): each joins, heartbeats a declared GPU
    inventory signed by its own certified node-agent key, runs what the scheduler places on
    it for --run-for seconds, and follows the health script.

    Examples: `dsec fleet simulate --nodes 1000 --gpus 8 --gpu-model H100`;
    `dsec fleet simulate --nodes-csv bench/data/openb/openb_node_list_gpu_node.csv`.
    """
    given = [x for x in (nodes_csv, inventory, nodes) if x is not None]
    if len(given) != 1:
        fail("give exactly one of --nodes-csv FILE, --inventory FILE, --nodes N", EXIT_BAD_INPUT)
    args: list[str] = []
    if nodes_csv is not None:
        args += ["--nodes-csv", str(nodes_csv)]
    elif inventory is not None:
        args += ["--inventory", str(inventory)]
    else:
        args += ["--nodes", str(nodes), "--gpus", str(gpus), "--gpu-model", gpu_model]
        args += ["--cpu", cpu, "--memory", memory]
    for flag, value in (
        ("--prefix", prefix),
        ("--limit", limit),
        ("--heartbeat-s", heartbeat_s),
        ("--script", script),
        ("--for", duration),
        ("--root-key", root_key),
    ):
        if value is not None:
            args += [flag, str(value)]
    for item in label or []:
        args += ["--label", item]
    args += ["--run-for", str(run_for)]
    if measure:
        args.append("--measure")
    settings = Settings()
    env = simulation_env(settings) if not measure else {**os.environ}
    code = _run([sys.executable, "-m", MODULE, *args], env, as_json)
    if code:
        raise typer.Exit(code)


class _Renderer:
    """The simulation's JSON lines for a person (a live status line) or as they are."""

    def __init__(self, as_json: bool) -> None:
        self.as_json = as_json
        self.live: Live | None = None

    def line(self, raw: str) -> None:
        try:
            line = json.loads(raw)
        except json.JSONDecodeError:
            return
        if self.as_json:
            print(json.dumps(line), flush=True)
            return
        kind = line.get("event")
        if kind == "started":
            console.print(
                f"[bold]{line['nodes']}[/] simulated nodes ({line['gpus']} GPUs) joined in "
                f"{line['join_s']:.1f} s; heartbeat every {line['heartbeat_s']:g} s "
                f"(e.g. {', '.join(line.get('node_ids', []))}). Ctrl-C stops them."
            )
            if console.is_terminal:  # piped: only the first and the last line
                self.live = Live(Text("waiting for the first status…"), console=console)
                self.live.start()
        elif kind == "status" and self.live is not None:
            self.live.update(_status_text(line))
        elif kind == "stopped":
            self.close()
            console.print(Text("stopped: ").append(_status_text(line)))
        elif kind == "measured":
            for key, value in line.items():
                if key != "event":
                    console.print(f"{key}: {value}")

    def close(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None


def _run(argv: list[str], env: dict[str, str], as_json: bool) -> int:
    """Run the simulation, rendering its status lines; Ctrl-C stops it cleanly (its last
    status is still shown)."""
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True, bufsize=1)
    assert proc.stdout is not None

    def _terminated(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # `kill`: stop the simulation as Ctrl-C does, never orphan it

    if threading.current_thread() is threading.main_thread():  # (in-process callers: not)
        signal.signal(signal.SIGTERM, _terminated)
    render = _Renderer(as_json)
    try:
        for raw in proc.stdout:
            render.line(raw)
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)  # it stops publishing and reports once more
        for raw in proc.stdout:
            render.line(raw)
    finally:
        render.close()
        code = proc.wait()
    if code not in (0, -signal.SIGINT):
        err_console.print(f"the simulation exited with status {code} (its errors are above)")
        return code if code > 0 else EXIT_FAILED
    return 0


def register(app: typer.Typer) -> None:
    """Add ``dsec fleet``."""
    app.add_typer(fleet_app, name="fleet")
