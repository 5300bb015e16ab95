"""``dsec events``: follow the event log live; export the bus's AsyncAPI schema."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from dsec_cli.common import (
    EXIT_BAD_INPUT,
    bus,
    check_event_types,
    console,
    fail,
    print_json,
    run,
)

events_app = typer.Typer(help="Follow the event log; export the bus schema.", no_args_is_help=True)


async def _tail(
    types: list[str], sandbox: str | None, from_start: bool, as_json: bool, count: int | None
) -> None:
    from dsec_core.bus import follow
    from dsec_core.subjects import ALL_EVENTS, STREAM, InvalidSubjectToken, aggregate_filter

    from dsec_cli.render import decode_or_warn, event_json, event_line

    try:
        filt = aggregate_filter("sandbox", sandbox) if sandbox else ALL_EVENTS
    except InvalidSubjectToken as exc:
        fail(f"--sandbox: {exc}", EXIT_BAD_INPUT)
    shown = 0
    async with bus() as (_, js):
        info = await js.stream_info(STREAM)
        start = 1 if from_start else info.state.last_seq + 1
        async for batch in follow(js, filter_subject=filt, start_seq=start):
            for seq, data in batch:
                env = decode_or_warn(seq, data)
                if env is None or (types and env.type not in types):
                    continue
                if as_json:
                    print_json(event_json(seq, env))
                else:
                    console.print(event_line(seq, env), highlight=False, soft_wrap=True)
                shown += 1
                if count is not None and shown >= count:
                    return


@events_app.command("tail")
def tail(
    type_: Annotated[list[str], typer.Option("--type", "-t", help="Only this event type")] = [],  # noqa: B006
    sandbox: Annotated[str | None, typer.Option(help="Only events of this sandbox")] = None,
    from_start: Annotated[bool, typer.Option("--all", help="Start at the first event")] = False,
    count: Annotated[int | None, typer.Option("-n", help="Stop after N events")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line")] = False,
) -> None:
    """Follow the event log live (Ctrl-C to stop)."""
    check_event_types(type_)
    try:
        run(_tail(type_, sandbox, from_start, as_json, count))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None


@events_app.command("schema")
def schema(
    out: Annotated[Path | None, typer.Option(help="Write to this file instead of stdout")] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="With --out: print what was written as JSON")
    ] = False,
) -> None:
    """Export the AsyncAPI 3.0 document of every event on the bus (JSON)."""
    from dsec_core.events import EVENT_TYPES
    from dsec_core.schema import asyncapi_document

    text = json.dumps(asyncapi_document(), indent=2)
    if out is None:
        print(text)  # the document is JSON already, with or without --json
        return
    try:
        out.write_text(text + "\n")
    except OSError as exc:
        fail(f"cannot write {out}: {exc.strerror}", EXIT_BAD_INPUT)
    if as_json:
        print_json({"path": str(out), "event_types": len(EVENT_TYPES)})
    else:
        console.print(f"wrote {out} ({len(EVENT_TYPES)} event types)")


def register(app: typer.Typer) -> None:
    """Add ``dsec events`` (with ``archive``, ``archived`` and ``restore``, which live in
    :mod:`dsec_cli.commands._events_archive` and hang on ``events_app`` when imported)."""
    from dsec_cli.commands import _events_archive  # noqa: F401

    app.add_typer(events_app, name="events")
