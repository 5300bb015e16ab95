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
    max_msgs_per_subject: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Keep at most N messages per subject (bounds node heartbeats; keys and each "
            "sandbox's events stay). Needs --approve-discard",
        ),
    ] = None,
    max_age: Annotated[
        str | None,
        typer.Option(help="Drop messages older than this (30d): keys too. Needs --approve-discard"),
    ] = None,
    max_bytes: Annotated[
        str | None,
        typer.Option(help="Drop the oldest messages above this size (500GiB): keys too"),
    ] = None,
    approve_discard: Annotated[
        bool,
        typer.Option(
            "--approve-discard",
            help="Approve that the limits discard events from the stream (archive them first: "
            "`dsec events archive`)",
        ),
    ] = False,
    no_limits: Annotated[
        bool, typer.Option("--no-limits", help="Lift every limit and the approval")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable")] = False,
) -> None:
    """As the operator: create DSEC_EVENTS, or restore its guarantees (deny delete/purge, no
    limits that discard history unless approved). Other identities get a permissions error.

    With a limit and --approve-discard: put approved retention limits on the stream (see
    docs/operations.md, "Retention"); --no-limits lifts them. Without either, limits an operator
    approved before are kept.
    """
    from dsec_core.bus import ensure_stream, set_retention, stream_problems
    from dsec_core.settings import Settings
    from dsec_core.subjects import STREAM

    from dsec_cli.common import EXIT_BAD_INPUT, EXIT_FAILED, fail, run
    from dsec_cli.common import bus as connect_bus

    retention = _retention(max_msgs_per_subject, max_age, max_bytes)
    if retention is not None and no_limits:
        fail("--no-limits lifts every limit: give it alone", EXIT_BAD_INPUT)
    if retention is not None and not approve_discard:
        fail(
            "a limit discards events from the log for good: archive them first "
            "(`dsec events archive`) and add --approve-discard",
            EXIT_BAD_INPUT,
        )
    settings = Settings()
    operator = _embedded_operator_url(settings)
    if operator is not None:  # the embedded stack: its operator identity, from stack.json
        settings = settings.model_copy(update={"nats_url": operator})

    async def go() -> tuple[list[str], dict[str, Any]]:
        async with connect_bus(settings, check_stream=False) as (_nc, js):
            try:
                await ensure_stream(js, replicas=replicas)
            except Exception as exc:
                fail(
                    f"could not create or update {STREAM} ({type(exc).__name__}: {exc}); "
                    "only the operator identity may",
                    EXIT_FAILED,
                )
            if retention is not None or no_limits:
                await set_retention(js, retention)
            config = (await js.stream_info(STREAM)).config
            return stream_problems(config), _limits(config)

    problems, limits = run(go())
    if as_json:
        print_json({"stream": STREAM, "problems": problems, "limits": limits})
    elif problems:
        console.print(f"{STREAM}: " + "; ".join(problems), highlight=False, markup=False)
    elif limits:
        shown = ", ".join(f"{k}={v}" for k, v in limits.items())
        console.print(
            f"{STREAM} ready: append-only, with approved limits {shown} (archive before they "
            "discard: `dsec events archive`)",
            highlight=False,
        )
    else:
        console.print(f"{STREAM} ready: append-only, no limits that discard history")
    if problems:
        raise typer.Exit(EXIT_FAILED)


def _retention(per_subject: int | None, max_age: str | None, max_bytes: str | None) -> Any:
    """The limits asked for, or ``None``; exit 2 naming a bad duration or size."""
    from dsec_core.bus import Retention
    from dsec_core.spec.units import parse_duration, parse_size

    from dsec_cli.common import EXIT_BAD_INPUT, fail

    if per_subject is None and max_age is None and max_bytes is None:
        return None
    try:
        age = parse_duration(max_age).total_seconds() if max_age is not None else None
    except ValueError as exc:
        fail(f"--max-age {max_age!r}: {exc}", EXIT_BAD_INPUT)
    try:
        size = parse_size(max_bytes) if max_bytes is not None else None
    except ValueError as exc:
        fail(f"--max-bytes {max_bytes!r}: {exc}", EXIT_BAD_INPUT)
    return Retention(max_msgs_per_subject=per_subject, max_age_s=age, max_bytes=size)


def _limits(config: Any) -> dict[str, Any]:
    """The limits set on a stream configuration (those that discard messages)."""
    found = {
        "max_msgs_per_subject": config.max_msgs_per_subject,
        "max_age_s": config.max_age,
        "max_bytes": config.max_bytes,
        "max_msgs": config.max_msgs,
    }
    return {k: v for k, v in found.items() if v is not None and v > 0}


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
