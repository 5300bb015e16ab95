"""``dsec nats``: who may do what on NATS, and credentials for a deployment."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from dsec_cli.common import console, print_json

nats_app = typer.Typer(help="NATS authorization: roles, permissions, credentials.")


@nats_app.command("permissions")
def permissions(
    role: Annotated[str | None, typer.Argument(help="one role (default: all)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False,
) -> None:
    """What each role may publish and subscribe to (dsec_core.natsperms)."""
    from dsec_core import natsperms

    from dsec_cli.common import EXIT_BAD_INPUT, fail

    roles = natsperms.ROLES if role is None else (role,)
    try:
        table = {r: natsperms.permissions(r) for r in roles}
    except ValueError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    if as_json:
        print_json(table)
        return
    for name, perms in table.items():
        console.print(f"[bold]{name}[/]", highlight=False)
        for p in perms["publish"]["allow"]:
            console.print(f"  pub   {p}", highlight=False, markup=False)
        for p in perms["publish"].get("deny", []):
            console.print(f"  deny  {p}", highlight=False, markup=False)
        for p in perms["subscribe"]["allow"]:
            console.print(f"  sub   {p}", highlight=False, markup=False)


@nats_app.command("credentials")
def credentials(
    out: Annotated[Path, typer.Argument(help="directory to write (0700)")],
    tenant: Annotated[
        list[str] | None, typer.Option("--tenant", help="a tenant's user (repeatable)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False,
) -> None:
    """Write nkey seeds, the operator password and nats-server.env for
    deploy/nats/nats-server.conf (docker compose, Kubernetes). Existing ones are kept."""
    from dsec_cli.stack.adapters.natsauth import write_deploy_credentials

    publics = write_deploy_credentials(out, tenant or ["default"])
    if as_json:
        print_json({"dir": str(out), "identities": publics})
        return
    for identity, key in publics.items():
        console.print(f"{identity:<16} {key}  ({out / (identity + '.nk')})", highlight=False)
    console.print(
        f"operator password in {out / 'operator.password'}; server env in "
        f"{out / 'nats-server.env'}",
        highlight=False,
    )


@nats_app.command("stream")
def stream(
    replicas: Annotated[
        int | None,
        typer.Option(
            "--replicas",
            min=1,
            max=5,
            help="copies of the stream and the replay bucket on a NATS cluster (3 on a "
            "three-server cluster); unset: created at 1, kept as the operator set it",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False,
) -> None:
    """As the operator: create DSEC_EVENTS, or restore its guarantees (deny delete/purge, no
    limits that discard history unless approved). Other identities get a permissions error."""
    from dsec_core.bus import ensure_stream, stream_problems
    from dsec_core.settings import Settings
    from dsec_core.subjects import STREAM

    from dsec_cli.common import EXIT_FAILED, fail, run
    from dsec_cli.common import bus as connect_bus

    settings = Settings()
    operator = _embedded_operator_url(settings)
    if operator is not None:  # the embedded stack: its operator identity, from stack.json
        settings = settings.model_copy(update={"nats_url": operator})

    async def go() -> list[str]:
        async with connect_bus(settings, check_stream=False) as (_nc, js):
            try:
                await ensure_stream(js, replicas=replicas)
            except Exception as exc:
                fail(
                    f"could not create or update {STREAM} ({type(exc).__name__}: {exc}); "
                    "only the operator identity may",
                    EXIT_FAILED,
                )
            return stream_problems((await js.stream_info(STREAM)).config)

    problems = run(go())
    if as_json:
        print_json({"stream": STREAM, "problems": problems})
    elif problems:
        console.print(f"{STREAM}: " + "; ".join(problems), highlight=False, markup=False)
    else:
        console.print(f"{STREAM} ready: append-only, no limits that discard history")
    if problems:
        raise typer.Exit(EXIT_FAILED)


def _embedded_operator_url(settings: Any) -> str | None:
    """The embedded NATS as its operator, when no NATS endpoint is configured."""
    if settings.nats_url is not None:
        return None
    state = settings.stack_state
    password = state.get("servers", {}).get("nats", {}).get("credentials", {})
    password = password.get("operator_password") if isinstance(password, dict) else None
    url = state.get("nats_url")
    if not password or not url:
        return None
    from dsec_cli.stack.adapters.natsauth import operator_url

    return operator_url(str(url), str(password))


def register(app: typer.Typer) -> None:
    """Add ``dsec nats``."""
    app.add_typer(nats_app, name="nats")
