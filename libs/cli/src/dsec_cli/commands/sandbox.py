"""``dsec sandbox``: the sandboxes as the read models see them."""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from dsec_core.projections import ensure_schema
from rich.table import Table

from dsec_cli.common import EXIT_BAD_INPUT, console, fail, pg_connect, print_json, run

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
