"""``dsec projections``: rebuild the Postgres read models from the event log."""

from __future__ import annotations

import time
from typing import Annotated

import typer

from dsec_cli.common import EXIT_UNREACHABLE, bus, console, fail, print_json, run

projections_app = typer.Typer(help="Manage the read models.", no_args_is_help=True)


@projections_app.command("rebuild")
def rebuild_cmd(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Drop the read models and replay the whole event log into them."""

    async def go() -> tuple[int, float]:
        from dsec_core.projections import rebuild
        from dsec_core.settings import Settings
        from dsec_core.trust import Gate, KeyRing

        from dsec_cli.commands.audit import trust_anchor

        anchor = trust_anchor()

        import asyncpg

        dsn = Settings().endpoint("postgres_dsn")
        if not dsn:  # (the read-only DSN users hold cannot rebuild)
            fail(
                "rebuilding the read models needs the stack's own DSN: run it where `dsec up` "
                "ran, or set DSEC_POSTGRES_DSN",
                EXIT_UNREACHABLE,
            )
        try:  # fail fast with a clear message when Postgres is down
            conn = await asyncpg.connect(str(dsn), timeout=5)
        except (TimeoutError, OSError, asyncpg.PostgresError) as exc:
            fail(f"cannot reach PostgreSQL ({type(exc).__name__})", EXIT_UNREACHABLE)
        await conn.close()
        started = time.perf_counter()
        async with bus() as (nc, js):
            gate = Gate(KeyRing(nc, js, anchor), js, None)  # only authentic events are projected
            position = await rebuild(js, str(dsn), gate)
        return position, time.perf_counter() - started

    position, seconds = run(go())
    if as_json:
        print_json({"applied_seq": position, "seconds": round(seconds, 3)})
    else:
        console.print(f"read models rebuilt up to stream seq {position} in {seconds:.2f} s")


def register(app: typer.Typer) -> None:
    """Add ``dsec projections``."""
    app.add_typer(projections_app, name="projections")
