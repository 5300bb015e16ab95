"""``dsec audit``: prove the signed event log is intact; replay it filtered."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from dsec_core.audit import Verifier, VerifyReport
from dsec_core.subjects import ALL_EVENTS, aggregate_filter
from rich.table import Table

from dsec_cli.common import (
    EXIT_FAILED,
    bus,
    check_event_types,
    console,
    parse_since,
    print_json,
    run,
    safe_text,
)
from dsec_cli.render import decode_or_warn, event_json, event_line

audit_app = typer.Typer(help="Verify and replay the signed audit trail.", no_args_is_help=True)


async def _verify() -> VerifyReport:
    from dsec_core.bus import replay

    verifier = Verifier()
    async with bus() as (_, js):
        async for seq, data in replay(js):
            if verifier.feed(seq, data) is not None:
                break
    return verifier.finish()


def _report_dict(report: VerifyReport) -> dict[str, Any]:
    finding = report.finding
    return {
        "ok": report.ok,
        "events": report.events,
        "producers": sorted(report.producers),
        "chains": report.chains,
        "first_seq": report.first_seq,
        "last_seq": report.last_seq,
        "first_bad": None
        if finding is None
        else {
            "seq": finding.stream_seq,
            "id": finding.event_id,
            "type": finding.event_type,
            "producer": finding.producer,
            "reason": finding.reason,
        },
    }


@audit_app.command("verify")
def verify(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result")] = False,
) -> None:
    """Replay the whole stream: every signature, chain link and sequence must hold.

    Exit 0 when the trail is intact; 1 naming the first bad event and why.
    """
    report = run(_verify())
    result = _report_dict(report)
    if as_json:
        print_json(result)
    elif report.ok:
        console.print(
            f"[green]audit trail intact[/]: {report.events} events (seq {report.first_seq}–"
            f"{report.last_seq}), {len(report.producers)} producers, {report.chains} chains; "
            "every signature, chain link and sequence verified"
        )
    else:
        bad = result["first_bad"]
        console.print(
            f"[bold red]audit trail BROKEN[/] at stream seq {bad['seq']}"
            f" (event {safe_text(bad['id'] or '?')}, type {safe_text(bad['type'] or '?')},"
            f" producer {safe_text(bad['producer'] or '?')}): {safe_text(bad['reason'])}"
        )
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)


async def _replay(sandbox: str | None, types: list[str], since: str | None, as_json: bool) -> int:
    from dsec_core.bus import replay

    since_t = parse_since(since) if since else None
    filt = aggregate_filter("sandbox", sandbox) if sandbox else ALL_EVENTS
    shown = 0
    async with bus() as (_, js):
        async for seq, data in replay(js, filter_subject=filt):
            env = decode_or_warn(seq, data)
            if env is None or (types and env.type not in types) or (since_t and env.time < since_t):
                continue
            shown += 1
            if as_json:
                print_json(event_json(seq, env))
            else:
                console.print(event_line(seq, env), highlight=False, soft_wrap=True)
    return shown


@audit_app.command("replay")
def replay_cmd(
    sandbox: Annotated[str | None, typer.Option(help="Only events of this sandbox")] = None,
    type_: Annotated[list[str], typer.Option("--type", "-t", help="Only this event type")] = [],  # noqa: B006
    since: Annotated[str | None, typer.Option(help="ISO time or age (30s, 15m, 2h, 1d)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line")] = False,
) -> None:
    """Replay recorded events, filtered by sandbox, type and time."""
    check_event_types(type_)
    shown = run(_replay(sandbox, type_, since, as_json))
    if not as_json:
        console.print(f"[dim]{shown} events[/]")


@audit_app.command("keys")
def keys(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result")] = False,
) -> None:
    """List the producer keys registered in the log."""

    async def collect() -> list[dict[str, Any]]:
        from dsec_core.bus import replay

        found: dict[tuple[str, str], dict[str, Any]] = {}
        async with bus() as (_, js):
            async for seq, data in replay(js, filter_subject="dsec.producer.>"):
                env = decode_or_warn(seq, data)
                if env is None or env.type != "audit.key_registered":
                    continue
                key = (env.payload["producer"], env.payload["key_id"])
                found.setdefault(key, {"producer": key[0], "key_id": key[1], "first_seq": seq})
        return list(found.values())

    rows = run(collect())
    if as_json:
        print_json(rows)
        return
    table = Table("producer", "key id", "registered at seq")
    for row in rows:
        table.add_row(safe_text(row["producer"]), safe_text(row["key_id"]), str(row["first_seq"]))
    console.print(table)


def register(app: typer.Typer) -> None:
    """Add ``dsec audit``."""
    app.add_typer(audit_app, name="audit")
