"""``dsec sandbox``: the sandboxes as the read models see them."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Annotated, Any

import typer
from dsec_core.projections import ensure_schema
from rich.table import Table

from dsec_cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    bus,
    cli_publisher,
    console,
    fail,
    pg_connect,
    print_json,
    run,
    submitter,
)

sandbox_app = typer.Typer(help="List and inspect sandboxes.", no_args_is_help=True)

_STATE_STYLE = {
    "running": "green",
    "exited": "bold",
    "rejected": "red",
    "conflict": "red",
    "failed": "red",
}


async def _rows(query: str, *args: Any) -> list[dict[str, Any]]:
    conn = await pg_connect()
    try:
        await ensure_schema(conn)
        return [dict(r) for r in await conn.fetch(query, *args)]
    finally:
        await conn.close()


@sandbox_app.command("list")
def list_(
    state: Annotated[str | None, typer.Option(help="Only sandboxes in this state")] = None,
    limit: Annotated[int, typer.Option(help="At most this many, newest first")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """List sandboxes, newest first."""
    rows = run(
        _rows(
            "SELECT sandbox_id, name, state, node_id, exit_code, reason, created_at, updated_at,"
            " last_event FROM sandboxes WHERE ($1::text IS NULL OR state = $1)"
            " ORDER BY created_at DESC LIMIT $2",
            state,
            limit,
        )
    )
    if as_json:
        print_json(rows)
        return
    table = Table("sandbox", "name", "state", "node", "exit", "last event", "updated")
    for r in rows:
        style = _STATE_STYLE.get(r["state"], "")
        table.add_row(
            r["sandbox_id"],
            r["name"] or "",
            f"[{style}]{r['state']}[/]" if style else r["state"],
            r["node_id"] or "",
            "" if r["exit_code"] is None else str(r["exit_code"]),
            r["last_event"],
            r["updated_at"].strftime("%Y-%m-%d %H:%M:%S"),
        )
    console.print(table)


@sandbox_app.command("show")
def show(
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox id (sbx_...)")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Show one sandbox: state, spec status and its event timeline."""

    async def load() -> dict[str, Any] | None:
        conn = await pg_connect()
        try:
            await ensure_schema(conn)
            row = await conn.fetchrow("SELECT * FROM sandboxes WHERE sandbox_id = $1", sandbox_id)
            if row is None:
                return None
            spec = await conn.fetchrow(
                "SELECT name, filename, spec_digest, status, errors FROM specs"
                " WHERE sandbox_id = $1",
                sandbox_id,
            )
            events = await conn.fetch(
                "SELECT seq, type, producer, time, summary FROM sandbox_events"
                " WHERE sandbox_id = $1 ORDER BY seq",
                sandbox_id,
            )
            result = dict(row)
            result["spec"] = (
                None if spec is None else {**dict(spec), "errors": json.loads(spec["errors"])}
            )
            result["events"] = [{**dict(e), "summary": json.loads(e["summary"])} for e in events]
            return result
        finally:
            await conn.close()

    data = run(load())
    if data is None:
        fail(f"no sandbox {sandbox_id!r} (see `dsec sandbox list`)", EXIT_BAD_INPUT)
    if as_json:
        print_json(data)
        return
    console.print(
        f"[bold]{data['sandbox_id']}[/] {data['name'] or ''} — state "
        f"[bold]{data['state']}[/]"
        + (f", exit {data['exit_code']}" if data["exit_code"] is not None else "")
    )
    if data["reason"]:
        console.print(f"reason: {data['reason']}", highlight=False)
    table = Table("seq", "time", "event", "producer", "details")
    for e in data["events"]:
        details = " ".join(f"{k}={v}" for k, v in e["summary"].items())
        table.add_row(
            str(e["seq"]), e["time"].strftime("%H:%M:%S.%f")[:-3], e["type"], e["producer"], details
        )
    console.print(table)


def register(app: typer.Typer) -> None:
    """Add ``dsec sandbox``."""
    app.add_typer(sandbox_app, name="sandbox")


def _manager() -> Any:
    from dsec_core.settings import Settings
    from dsec_nodeagent.sandbox.manager import SandboxManager

    return SandboxManager(Settings().home)


@sandbox_app.command("logs")
def logs(
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox id (sbx_...)")],
    follow: Annotated[bool, typer.Option("-f", "--follow", help="Keep printing until it exits")]
    = False,
    stderr: Annotated[bool, typer.Option("--stderr", help="Show stderr instead of stdout")]
    = False,
) -> None:
    """Print a sandbox's output (kept after it exits). Runs on the sandbox's node."""
    manager = _manager()
    path = manager.log_paths(sandbox_id)[1 if stderr else 0]
    if not path.exists():
        fail(f"no logs for {sandbox_id!r} on this node ({path.parent})", EXIT_BAD_INPUT)

    async def stream() -> None:
        with open(path, errors="replace") as fh:
            while True:
                chunk = fh.read()
                if chunk:
                    sys.stdout.write(chunk)
                    sys.stdout.flush()
                elif not follow or manager.states.read(sandbox_id) is None:
                    return
                else:
                    await asyncio.sleep(0.1)

    try:
        run(stream())
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


@sandbox_app.command("exec", context_settings={"allow_interspersed_args": False})
def exec_(
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox id (sbx_...)")],
    command: Annotated[list[str], typer.Argument(help="Command to run, after --")],
) -> None:
    """Run COMMAND inside a running sandbox, with the same isolation (no secrets)."""
    try:
        code = run(_manager().exec(sandbox_id, list(command)))
    except KeyError as exc:
        fail(f"{exc.args[0]} on this node (see `dsec sandbox list`)", EXIT_BAD_INPUT)
    raise typer.Exit(code)


@sandbox_app.command("stop")
def stop(
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox id (sbx_...)")],
    grace: Annotated[float, typer.Option(help="Seconds between SIGTERM and SIGKILL")] = 5.0,
    wait: Annotated[bool, typer.Option(help="Wait for sandbox.exited")] = True,
) -> None:
    """Ask the node agent to stop a sandbox (published as ``sandbox.stop_requested``)."""
    from dsec_core.bus import follow as follow_log
    from dsec_core.envelope import decode
    from dsec_core.events import SandboxStopRequested
    from dsec_core.subjects import STREAM, subject_for

    async def go() -> int | None:
        async with bus() as (_, js):
            start = (await js.stream_info(STREAM)).state.last_seq + 1
            publisher = await cli_publisher(js)
            await publisher.publish(
                SandboxStopRequested(requested_by=submitter(), grace_s=grace),
                aggregate_id=sandbox_id,
            )
            if not wait:
                return None
            deadline = asyncio.get_running_loop().time() + grace + 30
            async for batch in follow_log(js, filter_subject=subject_for("sandbox.exited",
                                                                         sandbox_id),
                                          start_seq=start):
                for _, data in batch:
                    return int(decode(data).payload["exit_code"])
                if asyncio.get_running_loop().time() > deadline:
                    fail(f"{sandbox_id} did not exit within {grace + 30:.0f} s; is its node "
                         "agent running? (`dsec status`)", EXIT_FAILED)
        return None

    code = run(go())
    if code is not None:
        console.print(f"{sandbox_id} stopped (exit code {code})")
