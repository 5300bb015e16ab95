"""``dsec up``, ``dsec down``, ``dsec status``: the embedded stack under ``DSEC_HOME``.

Exit codes: 0 ok; 1 something did not start/stop or is unhealthy; 2 bad input (malformed
``DSEC_*`` endpoint, bad service name, unreadable stack.json); 3 (status) never started here.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from dsec_cli.common import fail
from dsec_cli.stack import (
    NeverStarted,
    Stack,
    StackConfigError,
    StackError,
    StackStateError,
    StackStatus,
    StartFailed,
    State,
)

_STATE_STYLE = {
    State.RUNNING: "green",
    State.EXTERNAL: "cyan",
    State.ABSENT: "dim",
    State.STOPPED: "yellow",
    State.UNHEALTHY: "red",
}

out = Console()
err = Console(stderr=True, soft_wrap=True)


def _stack(**kwargs: Any) -> Stack:
    """Build the stack from Settings (env ``DSEC_*``); exit 2 on bad input."""
    from dsec_core.settings import Settings, settings_problem
    from pydantic import ValidationError

    try:
        settings = Settings()
        return Stack.from_settings(settings, **kwargs)
    except ValidationError as exc:
        fail(settings_problem(exc) or str(exc), 2)
    except (StackConfigError, StackStateError) as exc:
        fail(str(exc), 2)


def _table(status: StackStatus) -> Table:
    table = Table(title=f"DSec stack — {status.home}", title_justify="left")
    for col in ("component", "kind", "state"):
        table.add_column(col, no_wrap=True)
    table.add_column("endpoint", overflow="fold")
    table.add_column("version", overflow="fold")
    table.add_column("pid", no_wrap=True)
    for row in [*status.servers, *status.services]:
        style = _STATE_STYLE.get(row.state, "")
        state = f"[{style}]{row.state.value}[/]" if style else row.state.value
        if row.detail and row.state not in (State.RUNNING, State.EXTERNAL):
            state += f" [dim]({row.detail})[/]"
        table.add_row(
            row.name,
            row.kind,
            state,
            row.endpoint or "-",
            row.version or "-",
            str(row.pid) if row.pid else "-",
        )
    return table


def _print_failure(exc: StackError, stack: Stack) -> None:
    err.print(f"[red]error:[/] {exc}")
    if isinstance(exc, StartFailed):
        for name, (reason, log_tail) in sorted(exc.failures.items()):
            log = (
                stack.service(name).log_path if "@" in name else stack.home / "logs" / f"{name}.log"
            )
            err.print(f"\n[bold]{name}[/]: {reason}")
            if log_tail:
                err.print(f"[dim]--- last lines of {log} ---[/]")
                err.print(log_tail, markup=False, highlight=False, soft_wrap=True)


def up(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
    service: Annotated[
        list[str] | None,
        typer.Option(
            "--service",
            "-s",
            help="Start only these services (repeatable; default: all five)",
        ),
    ] = None,
    no_services: Annotated[
        bool, typer.Option("--no-services", help="Start only the servers")
    ] = False,
    timeout: Annotated[
        float, typer.Option(help="Seconds each server/service gets to become healthy", min=1)
    ] = 30.0,
    nodes: Annotated[
        int | None,
        typer.Option(
            "--nodes",
            help="Nodes on this machine: N NATS servers in one JetStream cluster (the event "
            "stream on min(3, N) of them) and a node agent per node, each with its own home "
            "under DSEC_HOME/nodes/ (default: as this home was started, 1 at first; fixed once "
            "the home has an event log)",
        ),
    ] = None,
) -> None:
    """Start the embedded stack (NATS, Postgres, S3, OpenBao, Prometheus) and every service.

    Servers whose DSEC_* endpoint is set are used as they are (external). Data under
    DSEC_HOME/data survives down/up; OpenBao runs in dev mode (in memory). Exit 1 when a server
    or service does not become healthy (the tail of its log is printed).
    """
    services: list[str] | None = [] if no_services else (service or None)
    try:
        stack = _stack(
            services=services, server_timeout=timeout, service_timeout=timeout, nodes=nodes
        )
    except StackConfigError as exc:
        fail(str(exc), 2)
    t0 = time.monotonic()

    def progress(name: str, message: str) -> None:
        err.print(f"  [dim]{time.monotonic() - t0:5.2f}s[/] [bold]{name}[/] {message}")

    try:
        with err.status("Starting the DSec stack…"):
            result = stack.up(progress=progress)
    except (StackConfigError, StackStateError) as exc:
        fail(str(exc), 2)
    except StackError as exc:
        _print_failure(exc, stack)
        if as_json:
            failures = exc.failures if isinstance(exc, StartFailed) else {}
            payload_err = {
                "error": {"code": "failed", "exit_code": 1, "message": str(exc)},
                "home": str(stack.home),
                "healthy": False,
                "failures": {name: reason for name, (reason, _) in failures.items()},
            }
            typer.echo(json.dumps(payload_err))
        raise typer.Exit(1) from None
    except KeyboardInterrupt:
        err.print("[red]interrupted:[/] run `dsec down` to stop what had started")
        raise typer.Exit(130) from None
    if as_json:
        payload = {
            **result.status.to_dict(),
            "started": result.started,
            "elapsed_s": round(result.elapsed_s, 3),
        }
        typer.echo(json.dumps(payload))
    else:
        out.print(_table(result.status))
        out.print(
            f"healthy in {result.elapsed_s:.2f}s; endpoints and credentials in "
            f"{stack.state_file} (mode 0600)"
        )
    if not result.status.healthy:
        raise typer.Exit(1)


def down(
    keep_sandboxes: Annotated[
        bool,
        typer.Option(
            "--keep-sandboxes",
            help="Leave running sandboxes running (the next `dsec up` re-adopts them and "
            "records the exit of those that ended meanwhile, which removed their own cgroups)",
        ),
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Stop every service, then every server; verify nothing keeps running or listening.

    The node agent first stops this node's sandboxes (each ends with `sandbox.exited`, reason
    `stopped`) and removes their cgroups, egress programs and pinned maps, unless
    --keep-sandboxes. Idempotent. External servers are left alone. Data under DSEC_HOME/data
    is kept.
    """
    stack = _stack()

    def progress(name: str, message: str) -> None:
        if not as_json:
            err.print(f"  [bold]{name}[/] {message}")

    try:
        result = stack.down(progress=progress, keep_sandboxes=keep_sandboxes)
    except StackStateError as exc:
        fail(str(exc), 2)
    except StackError as exc:
        fail(str(exc), 1)
    if as_json:
        typer.echo(json.dumps({"home": str(stack.home), "stopped": result.stopped}))
    elif result.stopped:
        out.print(f"stopped: {', '.join(result.stopped)}")
    else:
        out.print("nothing was running")


def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object")] = False,
) -> None:
    """Show every server and service: state, endpoint, version, pid (never a secret).

    Exit 0 when all are healthy, 1 otherwise, 3 when the stack was never started here.
    """
    stack = _stack()
    try:
        report = stack.status()
    except NeverStarted as exc:
        fail(str(exc), 3)
    except StackStateError as exc:
        fail(str(exc), 2)
    if as_json:
        typer.echo(json.dumps(report.to_dict()))
    else:
        out.print(_table(report))
    raise typer.Exit(report.exit_code)


def register(app: typer.Typer) -> None:
    """Add ``up``, ``down`` and ``status`` to the ``dsec`` app."""
    app.command("up")(up)
    app.command("down")(down)
    app.command("status")(status)
