"""``dsec unit``: move a running compute unit to another node, and the migrations so far.

``migrate`` publishes ``unit.migration_requested`` signed with the operator's key and follows
the scheduler's answer (``unit.migration_started`` or ``unit.migration_failed``) and, with
``--wait``, the end of the move (``unit.migrated`` from the target's node agent, or
``unit.migration_failed``). The migration's id is derived from the request's event id exactly
as the scheduler derives it, so only the events of this request are taken. ``migrations``
reads the three event types from the log (each checked by the trust gate when a trust root is
known) and shows one row per migration.

Exit codes: 0 moved (or, without ``--wait``, started); 1 refused or failed (the unit stays where
it ran unless the event says otherwise); 2 bad input, unknown sandbox, or not the operator; 3
the stack is unreachable; 4 no answer in time.
"""

from __future__ import annotations

import time
from typing import Annotated, Any

import typer
from rich.table import Table

from dsec_cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_TIMEOUT,
    bus,
    cli_gate,
    console,
    err_console,
    fail,
    operator_identity,
    print_json,
    run,
    safe_text,
    submitter,
)
from dsec_cli.render import decode_or_warn, human_size

unit_app = typer.Typer(
    help="Compute units: move a running unit to another node (operator); list migrations.",
    no_args_is_help=True,
)

STARTED = "unit.migration_started"
MIGRATED = "unit.migrated"
FAILED = "unit.migration_failed"
TYPES = (STARTED, MIGRATED, FAILED)


def outcome(events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """One migration's row from its events in log order: the first terminal event decides."""
    row: dict[str, Any] = {"outcome": "started"}
    for event_type, p in events:
        if row["outcome"] in {"migrated", "failed"}:
            break
        for key in ("migration_id", "unit", "from_node", "to_node", "reason", "path"):
            if p.get(key) is not None and (key not in row or event_type == STARTED):
                row[key] = p[key]
        if event_type == STARTED:
            row["from_gpus"], row["to_gpus"] = p.get("from_gpus") or [], p.get("to_gpus") or []
        elif event_type == MIGRATED:
            row["outcome"] = "migrated"
            row["interruption_ms"] = p.get("interruption_ms")
            row["bytes_moved"] = p.get("bytes_moved")
            row["path"] = p.get("path") or row.get("path")
            row["to_gpus"] = p.get("to_gpus") or row.get("to_gpus") or []
        else:
            row["outcome"] = "failed"
            row["stage"] = p.get("stage")
            row["why"] = p.get("reason")
            row["still_running"] = p.get("still_running")
            if "path" not in row:
                row["path"] = None
    return row


def _gpus(gpus: list[int] | None) -> str:
    return f" (GPU {','.join(str(g) for g in gpus)})" if gpus else ""


def describe(row: dict[str, Any]) -> str:
    """One line a person reads: from → to, path, interruption (or why not)."""
    unit = row.get("unit", "main")
    src = f"{row.get('from_node') or '?'}{_gpus(row.get('from_gpus'))}"
    dst = f"{row.get('to_node') or '?'}{_gpus(row.get('to_gpus'))}"
    if row["outcome"] == "migrated":
        moved = f", {human_size(row['bytes_moved'])} moved" if row.get("bytes_moved") else ""
        return (
            f"unit {unit} moved {src} → {dst} by {row.get('path')}: interrupted "
            f"{row.get('interruption_ms', 0):.1f} ms{moved}"
        )
    if row["outcome"] == "started":
        return f"unit {unit} moving {src} → {dst} by {row.get('path')} ({row.get('reason')})"
    where = "still runs" if row.get("still_running") else "does not run"
    return (
        f"unit {unit} not moved ({row.get('stage')}): {row.get('why')} — it {where} "
        f"on {row.get('from_node') or 'its node'}"
    )


# ---------------------------------------------------------------------- migrate


async def _migrate(
    sandbox_id: str, unit: str, to_node: str | None, wait: bool, timeout: float, quiet: bool
) -> tuple[dict[str, Any] | None, str]:
    from dsec_core.bus import EventPublisher, follow
    from dsec_core.events import UnitMigrationRequested
    from dsec_core.ids import answer_event_id, earlier_answer_ids
    from dsec_core.signing import Signer
    from dsec_core.subjects import STREAM, aggregate_filter

    key, cert = operator_identity()
    async with bus() as (nc, js):
        gate = cli_gate(nc, js)
        tenant = await gate.tenant_of(sandbox_id) if gate is not None else None
        if gate is not None and tenant is None:
            fail(f"no sandbox {sandbox_id} (no authentic spec.submitted)", EXIT_BAD_INPUT)
        start = (await js.stream_info(STREAM)).state.last_seq + 1
        publisher = EventPublisher(js, Signer(cert.subject, key), certificate=cert)
        await publisher.register_key()
        request = UnitMigrationRequested(unit=unit, to_node=to_node, requested_by=submitter())
        published = await publisher.publish(request, aggregate_id=sandbox_id, tenant=tenant)
        asked = published.envelope
        mid = answer_event_id(asked.type, asked.id, "migration", key_id=asked.key_id)
        # (or the id a scheduler of an earlier release gives the migration)
        ours = {mid, *earlier_answer_ids(asked.type, asked.id, "migration")}
        if not quiet:
            target = f" to {to_node}" if to_node else ""
            err_console.print(
                f"migration of {safe_text(sandbox_id)}/{safe_text(unit)}{safe_text(target)} "
                f"requested ({mid}); waiting up to {timeout:g} s",
                highlight=False,
            )
        seen: list[tuple[str, dict[str, Any]]] = []
        deadline = time.monotonic() + timeout
        filt = aggregate_filter("sandbox", sandbox_id)
        async for batch in follow(js, filter_subject=filt, start_seq=start, idle_s=0.25):
            for seq, data in batch:
                env = decode_or_warn(seq, data)
                if env is None or env.type not in TYPES:
                    continue
                if env.payload.get("migration_id") not in ours:
                    continue
                if gate is not None and await gate.authentic(data) is None:
                    err_console.print(f"[yellow]ignored[/] an unauthentic {env.type} at {seq}")
                    continue
                seen.append((env.type, env.payload))
                row = outcome(seen)
                if row["outcome"] == "started" and not quiet:
                    err_console.print(describe(row), highlight=False)
                if row["outcome"] != "started" or not wait:
                    return row, mid
            if time.monotonic() > deadline:
                return (outcome(seen) if seen else None), mid
    return None, mid


@unit_app.command("migrate")
def migrate(
    sandbox_id: Annotated[str, typer.Argument(help="The sandbox whose unit moves")],
    unit: Annotated[str, typer.Option("--unit", help="The unit (topology task)")] = "main",
    to: Annotated[
        str | None, typer.Option("--to", help="The target node (default: the scheduler chooses)")
    ] = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="Wait until the unit runs on the target (or failed)")
    ] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the outcome")] = 180.0,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result")] = False,
) -> None:
    """Move a running unit to another node (operator only), live: the node agents carry its
    state (CRIU, or the state plane's hand-over). Prints from → to, path and interruption.

    Exit 0 moved (without --wait: started); 1 refused or failed; 2 bad input, unknown sandbox
    or not the operator; 3 unreachable; 4 no answer in time.
    """
    from dsec_core.subjects import InvalidSubjectToken, subject_for

    try:
        subject_for("unit.migration_requested", sandbox_id)
    except InvalidSubjectToken as exc:
        fail(f"sandbox id: {exc}", EXIT_BAD_INPUT)
    if not unit or len(unit) > 128:
        fail("--unit: a unit name of 1-128 characters", EXIT_BAD_INPUT)
    row, mid = run(_migrate(sandbox_id, unit, to, wait, timeout, quiet=as_json))
    if row is None:
        fail(
            f"no answer to migration {mid} within {timeout:g} s: is the scheduler running? "
            "(`dsec status`); the request stays in the log and is acted on when it starts",
            EXIT_TIMEOUT,
        )
    row = {"sandbox_id": sandbox_id, **row}
    if as_json:
        print_json(row)
    elif row["outcome"] == "failed":
        err_console.print(f"[bold red]error:[/] {safe_text(describe(row))}", highlight=False)
    else:
        console.print(safe_text(describe(row)), highlight=False)
    if row["outcome"] == "failed":
        raise typer.Exit(EXIT_FAILED)
    if wait and row["outcome"] == "started":
        fail(f"migration {mid} started but did not end within {timeout:g} s", EXIT_TIMEOUT)


# ---------------------------------------------------------------------- migrations


async def _history(sandbox_id: str | None) -> list[dict[str, Any]]:
    from dsec_core.bus import replay
    from dsec_core.subjects import filter_for

    by_id: dict[str, list[tuple[int, str, dict[str, Any], str, str]]] = {}
    async with bus() as (nc, js):
        gate = cli_gate(nc, js)
        for event_type in TYPES:
            subject = filter_for(event_type, sandbox_id or "*")
            async for seq, data in replay(js, filter_subject=subject):
                env = decode_or_warn(seq, data)
                if env is None or (gate is not None and await gate.authentic(data) is None):
                    continue
                mid = str(env.payload.get("migration_id") or f"?{env.id}")
                by_id.setdefault(mid, []).append(
                    (seq, env.type, env.payload, env.aggregate_id, env.time.isoformat())
                )
    rows = []
    for mid, evs in by_id.items():
        evs.sort(key=lambda e: e[0])
        row = outcome([(t, p) for _, t, p, _, _ in evs])
        row.update(migration_id=mid, sandbox_id=evs[0][3], time=evs[0][4], seq=evs[0][0])
        rows.append(row)
    return sorted(rows, key=lambda r: r["seq"])


@unit_app.command("migrations")
def migrations(
    sandbox: Annotated[
        str | None, typer.Option("--sandbox", help="Only this sandbox's migrations")
    ] = None,
    limit: Annotated[int, typer.Option(help="The most recent N")] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result")] = False,
) -> None:
    """Recent migrations from the event log: from → to, reason, path, outcome, interruption.

    Exit 0 listed (also none); 2 bad input; 3 unreachable.
    """
    from dsec_core.subjects import InvalidSubjectToken, subject_for

    if sandbox is not None:
        try:
            subject_for("unit.migrated", sandbox)
        except InvalidSubjectToken as exc:
            fail(f"--sandbox: {exc}", EXIT_BAD_INPUT)
    if limit < 1:
        fail("--limit: at least 1", EXIT_BAD_INPUT)
    rows = run(_history(sandbox))[-limit:]
    if as_json:
        print_json(rows)
        return
    if not rows:
        console.print("no migrations")
        return
    table = Table("time", "sandbox", "unit", "from → to", "reason", "path", "outcome", "ms")
    for r in rows:
        src = f"{r.get('from_node') or '?'}{_gpus(r.get('from_gpus'))}"
        dst = f"{r.get('to_node') or '?'}{_gpus(r.get('to_gpus'))}"
        out = r["outcome"]
        if out == "failed":
            out = f"failed ({r.get('stage')}): {r.get('why')}"
        ms = r.get("interruption_ms")
        table.add_row(
            str(r["time"])[:19],
            safe_text(r["sandbox_id"]),
            safe_text(str(r.get("unit", "main"))),
            safe_text(f"{src} → {dst}"),
            safe_text(str(r.get("reason") or "")),
            safe_text(str(r.get("path") or "")),
            safe_text(out),
            f"{ms:.1f}" if isinstance(ms, int | float) else "",
        )
    console.print(table)


def register(app: typer.Typer) -> None:
    """Add ``dsec unit``."""
    app.add_typer(unit_app, name="unit")
