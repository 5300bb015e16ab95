"""``dsec sandbox``: the sandboxes as the read models see them."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dsec_cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    bus,
    client,
    confirm,
    console,
    err_console,
    fail,
    pg_connect,
    print_json,
    read_refused,
    run,
    safe_text,
    submitter,
)

if TYPE_CHECKING:  # imported where used: `dsec sandbox ... --help` stays fast
    from dsec_core.events import SpecSubmitted

sandbox_app = typer.Typer(
    help="List, inspect, stop, roll back and start sandboxes from snapshots.", no_args_is_help=True
)

_STATE_STYLE = {
    "running": "green",
    "exited": "bold",
    "rejected": "red",
    "conflict": "red",
    "failed": "red",
    "pending": "yellow",
    "lost": "yellow",
}
_WITH_REASON = frozenset({"pending", "lost"})
"""States whose row shows why (no node fits; its node was lost)."""


def state_cell(row: dict[str, Any]) -> str:
    """The STATE column: the state, styled; a waiting or lost sandbox with its reason."""
    text = safe_text(row["state"])
    if row["state"] in _WITH_REASON and row.get("reason"):
        text += f" ({safe_text(row['reason'])})"
    style = _STATE_STYLE.get(row["state"], "")
    return f"[{style}]{text}[/]" if style else text


async def _rows(query: str, *args: Any) -> list[dict[str, Any]]:
    import asyncpg

    conn = await pg_connect()
    try:
        return [dict(r) for r in await conn.fetch(query, *args)]
    except asyncpg.UndefinedTableError:  # no projector has run yet: nothing projected
        return []
    except asyncpg.InsufficientPrivilegeError:
        read_refused()
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
            "SELECT sandbox_id, name, state, node_id, attempt, exit_code, reason, created_at,"
            " updated_at, last_event FROM sandboxes WHERE ($1::text IS NULL OR state = $1)"
            " ORDER BY created_at DESC LIMIT $2",
            state,
            limit,
        )
    )
    if as_json:
        print_json(rows)
        return
    from rich.table import Table

    table = Table()
    table.add_column("sandbox", no_wrap=True)
    for column in ("name", "state", "node", "exit", "last event", "updated"):
        table.add_column(column)
    for r in rows:
        table.add_row(
            safe_text(r["sandbox_id"]),
            safe_text(r["name"] or ""),
            state_cell(r),
            safe_text(r["node_id"] or ""),
            "" if r["exit_code"] is None else str(r["exit_code"]),
            safe_text(r["last_event"]),
            r["updated_at"].strftime("%m-%d %H:%M:%S"),
        )
    console.print(table)


@sandbox_app.command("show")
def show(
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox id (sbx_...)")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Show one sandbox: state, spec status and its event timeline."""

    async def load() -> dict[str, Any] | None:
        import asyncpg

        conn = await pg_connect()
        try:
            try:
                row = await conn.fetchrow(
                    "SELECT * FROM sandboxes WHERE sandbox_id = $1", sandbox_id
                )
            except asyncpg.UndefinedTableError:  # no projector has run yet
                return None
            except asyncpg.InsufficientPrivilegeError:
                read_refused()
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
        f"[bold]{safe_text(data['sandbox_id'])}[/] {safe_text(data['name'] or '')} — state "
        f"[bold]{safe_text(data['state'])}[/]"
        + (f", exit {data['exit_code']}" if data["exit_code"] is not None else "")
    )
    if data.get("node_id"):
        attempt = data.get("attempt") or 0
        console.print(
            f"node: {safe_text(data['node_id'])}"
            + (f" (placement attempt {attempt})" if attempt > 1 else ""),
            highlight=False,
        )
    if data["reason"]:
        console.print(f"reason: {safe_text(data['reason'])}", highlight=False)
    if data.get("restarts"):
        console.print(
            f"restarted {data['restarts']} times after dying (state.restart: on-failure)",
            highlight=False,
        )
    if data.get("refusals") or data.get("reports"):
        console.print(
            f"refused {data.get('refusals', 0)} times; "
            f"{data.get('reports', 0)} reports of its own semantic layer",
            highlight=False,
        )
    from rich.table import Table

    table = Table("seq", "time", "event", "producer", "details")
    for e in data["events"]:
        details = " ".join(f"{k}={v}" for k, v in e["summary"].items())
        table.add_row(
            str(e["seq"]),
            e["time"].strftime("%H:%M:%S.%f")[:-3],
            safe_text(e["type"]),
            safe_text(e["producer"]),
            safe_text(details),
        )
    console.print(table)


def register(app: typer.Typer) -> None:
    """Add ``dsec sandbox``."""
    app.add_typer(sandbox_app, name="sandbox")


@sandbox_app.command("logs")
def logs(
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox id (sbx_...)")],
    follow: Annotated[
        bool, typer.Option("-f", "--follow", help="Keep printing until it exits")
    ] = False,
    stderr: Annotated[bool, typer.Option("--stderr", help="Show stderr instead of stdout")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help='One {"stream", "data"} object per line per chunk')
    ] = False,
) -> None:
    """Print a sandbox's output (kept after it exits), from any machine that reaches the bus.

    Streamed, encrypted, from the node agent that runs it, which checks that you are a user of
    the sandbox's tenant. On a terminal, control characters the sandbox wrote (ANSI escapes,
    carriage returns, bidi overrides, ...) are shown escaped (``\\x1b``), line breaks kept;
    piped or redirected, the bytes are written unchanged (``dsec sandbox logs ID > out.log`` is
    the raw log).
    """
    from dsec_cli.remote import Sink, session
    from dsec_cli.render import JsonChunks

    stream = "stderr" if stderr else "stdout"
    sink = JsonChunks(stream) if as_json else Sink(sys.stdout.buffer, terminal=sys.stdout.isatty())
    args = {"stream": stream, "follow": follow}
    try:
        run(session("logs", sandbox_id, args, lambda _, data: sink.write(data)))
    except KeyboardInterrupt:
        raise typer.Exit(0) from None
    sink.write(b"", final=True)


@sandbox_app.command("exec", context_settings={"allow_interspersed_args": False})
def exec_(
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox id (sbx_...)")],
    command: Annotated[list[str], typer.Argument(help="Command to run, after --")],
    tty: Annotated[
        bool, typer.Option("-t", "--tty", help="Run it on a pseudo-terminal (interactive)")
    ] = False,
    interactive: Annotated[
        bool, typer.Option("-i", "--interactive", help="Send stdin (always done; for -it)")
    ] = True,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help='Output as {"stream", "data"} lines, then {"exit_code"} (give it before ID; '
            "not with -t)",
        ),
    ] = False,
) -> None:
    """Run COMMAND inside a running sandbox, with the same isolation (no secrets).

    Works from any machine that reaches the bus: your stdin goes to the command and its
    stdout/stderr come back (encrypted), and dsec exits with the command's exit code. Only a
    user of the sandbox's tenant may. With -t (`dsec sandbox exec -it ID -- bash`) the command
    gets a pseudo-terminal: this terminal is put in raw mode (Ctrl-C, Ctrl-D and every key go
    to the command), its size follows yours, stdout and stderr arrive as one stream.
    """
    from dsec_cli.remote import Sink, session
    from dsec_cli.render import JsonChunks

    argv = command[1:] if command[:1] == ["--"] else list(command)
    if not argv:
        fail("give the command to run after --", EXIT_BAD_INPUT)
    if tty:
        if as_json:
            fail("--json and -t do not go together (a terminal is not JSON)", EXIT_BAD_INPUT)
        _exec_tty(sandbox_id, argv)
    sinks: dict[str, Any] = {
        "stdout": Sink(sys.stdout.buffer, terminal=sys.stdout.isatty()),
        "stderr": Sink(sys.stderr.buffer, terminal=sys.stderr.isatty()),
    }
    if as_json:
        sinks = {"stdout": JsonChunks("stdout"), "stderr": JsonChunks("stderr")}
    try:
        ended = run(
            session(
                "exec",
                sandbox_id,
                {"argv": argv},
                lambda stream, data: sinks.get(stream, sinks["stdout"]).write(data),
                forward_stdin=True,
            )
        )
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    if ended.code is None:
        fail(f"the command did not finish: {ended.reason}", EXIT_FAILED)
    if as_json:
        for sink in sinks.values():
            sink.write(b"", final=True)
        print_json({"exit_code": ended.code})
    raise typer.Exit(ended.code)


def _exec_tty(sandbox_id: str, argv: list[str]) -> None:
    from dsec_cli.remote_io import exec_tty

    try:
        stdin_fd = sys.stdin.fileno()
    except (OSError, ValueError):
        fail("--tty needs a stdin with a file descriptor (a terminal or a pipe)", EXIT_BAD_INPUT)
    try:
        ended = run(exec_tty(sandbox_id, argv, stdin_fd, sys.stdout.buffer))
    except KeyboardInterrupt:  # stdin not a terminal (a terminal's Ctrl-C goes to the sandbox)
        raise typer.Exit(130) from None
    if ended.code is None:
        fail(f"the command did not finish: {ended.reason}", EXIT_FAILED)
    raise typer.Exit(ended.code)


@sandbox_app.command("cp")
def cp(
    source: Annotated[str, typer.Argument(help="ID:/path in the sandbox, or a local path")],
    dest: Annotated[str, typer.Argument(help="A local path, or ID:/path in the sandbox")],
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Copy files and directories out of or into a running sandbox, like `docker cp`.

    `dsec sandbox cp ID:/tmp/out ./out` and `dsec sandbox cp ./data ID:/tmp/in`, from any
    machine that reaches the bus (encrypted, users of the sandbox's tenant only). Only the
    sandbox's writable dirs (its `write_allowed` paths, /tmp) and, to read, its workdir; the
    copy runs inside the sandbox with its isolation and follows no symlink (symlinks and
    special files inside a directory are skipped and listed). Into an existing directory the
    copy lands inside it. Exit 0 copied; 1 the copy failed; 2 bad input or a path outside
    those dirs; 3 unreachable.
    """
    from dsec_core.remote import RemoteError, sandbox_path

    from dsec_cli.remote_io import CopyError, copy_from, copy_to, split_remote, summary

    where = split_remote(source), split_remote(dest)
    if (where[0] is None) == (where[1] is None):
        fail(
            "give one side as SANDBOX_ID:/path and the other as a local path "
            "(e.g. `dsec sandbox cp sbx_1a2b:/tmp/out ./out`)",
            EXIT_BAD_INPUT,
        )
    remote_side = where[0] or where[1]
    assert remote_side is not None
    sandbox_id, path = remote_side
    try:
        path = sandbox_path(path)
    except RemoteError as exc:
        fail(f"{exc} (e.g. {sandbox_id}:/tmp/out)", EXIT_BAD_INPUT)
    direction = "get" if where[0] is not None else "put"
    local = Path(dest if direction == "get" else source)
    if direction == "put" and not local.exists():
        fail(f"{local} does not exist", EXIT_BAD_INPUT)
    try:
        if direction == "get":
            ended, copied = run(copy_from(sandbox_id, path, local))
        else:
            ended, copied = run(copy_to(sandbox_id, local, path))
    except CopyError as exc:
        fail(str(exc), EXIT_FAILED)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    if ended.code != 0:
        fail(f"the copy failed: {safe_text(ended.reason)}", EXIT_FAILED)
    result = summary(direction, sandbox_id, path, local, copied)
    if as_json:
        print_json(result)
        return
    for skipped in copied.skipped:
        err_console.print(f"skipped {safe_text(skipped)} (a symlink or special file)")
    arrow = (
        f"{sandbox_id}:{path} -> {local}"
        if direction == "get"
        else f"{local} -> {sandbox_id}:{path}"
    )
    console.print(
        f"copied {safe_text(arrow)}: {copied.files} files and directories, {copied.bytes} bytes",
        highlight=False,
    )


@sandbox_app.command("stop")
def stop(
    sandbox_id: Annotated[str, typer.Argument(help="Sandbox id (sbx_...)")],
    grace: Annotated[float, typer.Option(help="Seconds between SIGTERM and SIGKILL")] = 5.0,
    wait: Annotated[bool, typer.Option(help="Wait for sandbox.exited")] = True,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print {sandbox_id, requested, exit_code, detail}")
    ] = False,
) -> None:
    """Ask the node agent to stop a sandbox (published as ``sandbox.stop_requested``)."""
    from dsec_client import Timeout

    async def go() -> int | None:
        async with client() as d:
            sandbox = d.sandbox(sandbox_id)
            ended = await sandbox.ended()
            if ended is not None:
                payload = ended.data
                detail = (
                    f"exit code {payload['exit_code']}" if "exit_code" in payload else ended.type
                )
                if as_json:
                    already.append(detail)
                else:
                    console.print(f"{sandbox_id} is not running: it already ended ({detail})")
                return None
            try:
                return await sandbox.stop(grace=grace, wait=wait)
            except Timeout as exc:
                fail(str(exc), EXIT_FAILED)

    already: list[str] = []
    code = run(go())
    if as_json:
        result = {"sandbox_id": sandbox_id, "requested": not already, "exit_code": code}
        print_json({**result, "detail": f"already ended ({already[0]})" if already else None})
    elif code is not None:
        console.print(f"{sandbox_id} stopped (exit code {code})")


@sandbox_app.command("rollback")
def rollback(
    sandbox_id: Annotated[str, typer.Argument(help="Running sandbox (sbx_...)")],
    to: Annotated[str, typer.Option("--to", help="Snapshot to roll back to")],
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the node agent")] = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Put a running sandbox's code back on a snapshot (``snapshot.restored`` records it).

    The node agent that runs the sandbox rewrites its code dir in place, so the running process
    sees the restored files at once;
    a different dependency environment cannot be swapped under it and is reported instead.
    Exit 0 restored; 1 refused (exited sandbox, unknown or altered snapshot); 2 bad input;
    3 unreachable; 4 no answer in time.
    """
    from dsec_core.events import SnapshotRestoreRequested

    from dsec_cli.commands.snapshot import ask_snapshot_service

    request = SnapshotRestoreRequested(snapshot=to, requested_by=submitter())
    answer = ask_snapshot_service(request, sandbox_id, timeout)
    p = answer.payload
    ok = answer.type == "snapshot.restored"
    if as_json:
        print_json({"sandbox_id": sandbox_id, "event": answer.type, "ok": ok, **p})
    elif not ok:
        fail(f"rollback of {sandbox_id} to {to} failed: {p['reason']}", EXIT_FAILED)
    else:
        console.print(
            f"[green]rolled {sandbox_id} back to {safe_text(to)}[/] in {p['duration_ms']:.0f} ms: "
            f"{p.get('files_written', 0)} files written, {p.get('files_removed', 0)} removed",
            highlight=False,
        )
        if p.get("note"):
            err_console.print(f"[yellow]note:[/] {safe_text(p['note'])}", highlight=False)
    if not ok:
        raise typer.Exit(EXIT_FAILED)


@sandbox_app.command("run")
def run_from_snapshot(
    snapshot: Annotated[str, typer.Option("--snapshot", help="Snapshot to start from")],
    code: Annotated[
        Path | None,
        typer.Option("--code", help="Run this directory; refused unless it matches the snapshot"),
    ] = None,
    spec: Annotated[
        Path | None,
        typer.Option(
            help="Spec to run (default: the one the snapshot's sandbox was submitted "
            "with, from the log)"
        ),
    ] = None,
    wait: Annotated[str, typer.Option(help="Follow until: validated|built|ready|exited")] = "ready",
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds")] = 900.0,
    stall: Annotated[
        float, typer.Option(help="Stop when no event arrives for this long (s)")
    ] = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="Last line: one JSON result")] = False,
) -> None:
    """Start a new sandbox from a snapshot: its signature is checked, --code DIR must match the
    snapshot's code exactly (each differing file is listed with its changed lines), then the
    spec is submitted again with the snapshot to start from (fresh leases from its own runtime
    context); the node agent that starts the sandbox restores the snapshot's code into it and
    publishes ``snapshot.restored`` (a GPU model other than the snapshot's is flagged there as
    compatibility mode).

    Exit codes as `dsec submit`; 1 also when the snapshot is altered or --code differs.
    """
    from dsec_cli.commands.submit import WAIT_FOR, finish, submit_and_follow

    if wait not in WAIT_FOR:
        fail(f"--wait {wait!r} is not valid; use one of {', '.join(WAIT_FOR)}", EXIT_BAD_INPUT)
    if code is not None and not code.is_dir():
        fail(f"--code {code} is not a directory", EXIT_BAD_INPUT)
    start = _prepare_run(snapshot, code, spec)
    try:
        outcome = run(
            submit_and_follow(
                start.spec_text,
                start.filename,
                None,
                wait,
                timeout,
                stall,
                as_json,
                start_from_snapshot=snapshot,
                code=code,
            )
        )
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    _warn_if_environment_differs(outcome.events, start.deps_fingerprint, as_json)
    _warn_if_compatibility_mode(outcome.events, as_json)
    finish(outcome, wait, stall, as_json)


@sandbox_app.command("debug")
def debug(
    sandbox_id: Annotated[str, typer.Argument(help="The sandbox to repair (sbx_...)")],
    with_: Annotated[
        list[str] | None,
        typer.Option("--with", help="Extra packages for the repair sandbox (e.g. ipdb)"),
    ] = None,
    hold: Annotated[str, typer.Option(help="How long the repair sandbox lives")] = "1h",
    wait: Annotated[str, typer.Option(help="Follow until: validated|built|ready")] = "ready",
    stall: Annotated[
        float, typer.Option(help="Stop when no event arrives for this long (s)")
    ] = 120.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON")] = False,
) -> None:
    """Open a repair sandbox: the same spec and code, debugging tools (--with), and the calls
    the sandbox recorded ready to replay (none made live); it lists them, the failed ones first,
    and waits for `dsec sandbox exec NEW -- python -m pdb agent.py` (docs/experiments.md).

    Exit codes as `dsec submit`; 2 also when the sandbox recorded nothing.
    """
    from dsec_client import DSecError

    from dsec_cli.experiments.debug import DebugError, open_repair

    async def go() -> dict[str, Any]:
        async with client() as d:
            try:
                new, recording, _ = await open_repair(d, sandbox_id, with_ or [], hold)
            except DebugError as exc:
                fail(str(exc), EXIT_BAD_INPUT)
            try:
                await d.sandbox(new).wait(wait, timeout=900.0, stall=stall)
            except DSecError as exc:
                fail(f"repair sandbox {new}: {exc}", exc.EXIT)
            return {"sandbox_id": new, "debugs": sandbox_id, "replays": recording}

    result = run(go())
    if as_json:
        print_json(result)
        return
    new = result["sandbox_id"]
    console.print(
        f"repair sandbox [bold]{new}[/] of {sandbox_id}, replaying {result['replays']}\n"
        f"  the recorded calls:  dsec sandbox logs {new}\n"
        f"  debug the agent:     dsec sandbox exec {new} -- python -m pdb agent.py\n"
        f"  when done:           dsec sandbox stop {new}",
        highlight=False,
    )


@sandbox_app.command("upgrade")
def upgrade(
    sandbox_id: Annotated[str, typer.Argument(help="The running sandbox to replace (sbx_...)")],
    code: Annotated[
        Path | None,
        typer.Option("--code", help="The new version's code directory (default: the old one's)"),
    ] = None,
    spec: Annotated[
        Path | None,
        typer.Option(help="The new version's spec (default: the old one's, from the log)"),
    ] = None,
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds")] = 900.0,
    stall: Annotated[
        float, typer.Option(help="Stop when no event arrives for this long (s)")
    ] = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="Last line: one JSON result")] = False,
) -> None:
    """Replace a running sandbox by a new version with a live hand-over: the old one's spec
    (its authentic ``spec.submitted``, or --spec) is submitted with the new code and
    ``handover_from``; the new sandbox starts on the old one's node, receives its agent state,
    takes over its tool name (callers see at most one slower call) and the old one exits
    (``handed_over``). Follows the new sandbox until ``state.handed_over`` and prints the
    measured interruption.

    Exit 0 when handed over; 1 when the new sandbox was rejected, failed or ended first (the
    old one keeps running), or the old one is not running; 2 for bad input; 3 when the stack
    is unreachable; 4 when it stalled or timed out.
    """
    from dsec_core.subjects import InvalidSubjectToken, subject_for

    try:
        subject_for("spec.submitted", sandbox_id)
    except InvalidSubjectToken as exc:
        fail(f"sandbox id: {exc}", EXIT_BAD_INPUT)
    if code is None and spec is None:
        fail(
            "nothing to upgrade to: give the new version's --code DIR and/or --spec FILE",
            EXIT_BAD_INPUT,
        )
    if code is not None and not code.is_dir():
        fail(f"--code {code} is not a directory", EXIT_BAD_INPUT)
    spec_given: tuple[str, str] | None = None
    if spec is not None:
        try:
            spec_given = spec.read_text(), spec.name
        except (OSError, UnicodeDecodeError) as exc:
            fail(f"cannot read spec {spec}: {exc}", EXIT_BAD_INPUT)
    try:
        outcome = run(_upgrade(sandbox_id, code, spec_given, timeout, stall, as_json))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    if as_json:
        print_json(outcome)
    elif outcome["state"] == "handed_over":
        console.print(
            f"[green]handed over[/]: {outcome['sandbox_id']} took over {sandbox_id} "
            f"({outcome['deltas_streamed']} state records streamed), interruption "
            f"{outcome['interruption_ms']:.2f} ms",
            highlight=False,
        )
    elif outcome["state"] == "stalled":
        err_console.print(
            f"[yellow]stalled:[/] {safe_text(outcome['reason'] or '')}", highlight=False
        )
    else:
        err_console.print(
            f"[bold red]not handed over[/]: {outcome['sandbox_id']} {outcome['state']}"
            f"{': ' + safe_text(outcome['reason']) if outcome['reason'] else ''}; "
            f"{sandbox_id} keeps running",
            highlight=False,
        )
    codes = {"handed_over": 0, "stalled": 4}
    raise typer.Exit(codes.get(outcome["state"], EXIT_FAILED))


async def _upgrade(
    old_id: str,
    code: Path | None,
    spec_given: tuple[str, str] | None,
    timeout: float,
    stall: float,
    as_json: bool,
) -> dict[str, Any]:
    """Submit the new version with ``handover_from`` and follow it (see :func:`upgrade`)."""
    from dsec_client import SandboxEnded, Stalled, Timeout
    from dsec_core.events import SpecSubmitted

    from dsec_cli.commands.submit import upload_code
    from dsec_cli.render import event_line

    async with client() as d:
        old = d.sandbox(old_id)
        last = await d.last("spec.submitted", old.id)  # verified: signed by its submitter
        if last is None:
            fail(f"no sandbox {old_id} in the event log", EXIT_FAILED)
        submitted = last.envelope.decoded()
        assert isinstance(submitted, SpecSubmitted)
        ended = await old.ended()
        if ended is not None:
            fail(
                f"sandbox {old_id} has ended ({ended.type}): nothing to hand over from", EXIT_FAILED
            )
        spec_text, filename = spec_given or (submitted.spec_yaml, submitted.filename)
        code_ref = await upload_code(d, code, spec_text) if code is not None else submitted.code
        new = await d.submit(spec_text, code_ref, filename=filename, handover_from=old.id)
        result: dict[str, Any] = {
            "sandbox_id": new.id,
            "handover_from": old.id,
            "state": "submitted",
            "reason": None,
            "interruption_ms": None,
            "deltas_streamed": None,
        }

        def show(event: Any) -> None:
            if not as_json:
                console.print(
                    event_line(event.seq, event.envelope), highlight=False, soft_wrap=True
                )

        try:
            done = await new.wait("state.handed_over", timeout=timeout, stall=stall, on_event=show)
        except SandboxEnded as exc:
            result.update(state=exc.state, reason=exc.reason)
        except (Stalled, Timeout) as exc:
            result.update(state="stalled", reason=str(exc))
        else:
            payload = done.envelope.payload
            result.update(
                state="handed_over",
                interruption_ms=payload["interruption_ms"],
                deltas_streamed=payload["deltas_streamed"],
            )
        return result


@dataclass(frozen=True)
class _RunStart:
    """What a run from a snapshot submits."""

    spec_text: str
    filename: str
    deps_fingerprint: str | None


def _prepare_run(name: str, code: Path | None, spec: Path | None) -> _RunStart:
    """Check the snapshot (and ``code``) and find the spec (read-only access to the store)."""
    from dsec_cli.commands.snapshot import snapshot_store

    with snapshot_store() as store:
        manifest = store.load(name)  # signature checked: an altered manifest exits 1
        if code is not None:
            check = store.verify_code_dir(name, code)
            if not check.ok:
                err_console.print(
                    f"[bold red]error:[/] {safe_text(str(code))} does not match snapshot "
                    f"{safe_text(name)}; refusing to run it:",
                    highlight=False,
                )
                console.print(
                    "\n".join(check.describe()), highlight=False, markup=False, soft_wrap=True
                )
                raise typer.Exit(EXIT_FAILED)
    spec_text, filename = _spec_of(manifest.source.sandbox_id, spec, name)
    fingerprint = manifest.deps.fingerprint if manifest.deps is not None else None
    return _RunStart(spec_text, filename, fingerprint)


def _spec_of(sandbox_id: str | None, spec: Path | None, name: str) -> tuple[str, str]:
    """The spec to submit: ``--spec``, else the snapshot's sandbox's, from the log."""
    if spec is not None:
        try:
            return spec.read_text(), spec.name
        except (OSError, UnicodeDecodeError) as exc:
            fail(f"cannot read spec {spec}: {exc}", EXIT_BAD_INPUT)
    if sandbox_id is None:
        fail(
            f"snapshot {name} was not taken of a sandbox: give the spec with --spec FILE",
            EXIT_BAD_INPUT,
        )

    async def load() -> SpecSubmitted | None:
        from dsec_core.envelope import decode
        from dsec_core.events import SpecSubmitted
        from dsec_core.subjects import STREAM, subject_for
        from nats.js.errors import NotFoundError

        async with bus() as (_, js):
            try:
                raw = await js.get_last_msg(STREAM, subject_for("spec.submitted", sandbox_id))
            except NotFoundError:
                return None
        payload = decode(raw.data or b"").decoded()
        return payload if isinstance(payload, SpecSubmitted) else None

    submitted = run(load())
    if submitted is None:
        fail(
            f"the spec of {sandbox_id} (snapshot {name}) is not in the event log: give it "
            "with --spec FILE",
            EXIT_BAD_INPUT,
        )
    return submitted.spec_yaml, submitted.filename


def _warn_if_compatibility_mode(events: list[dict[str, Any]], as_json: bool) -> None:
    """The node that started it has another GPU model than the snapshot recorded: say so."""
    restored = next((e["payload"] for e in events if e["type"] == "snapshot.restored"), None)
    if as_json or restored is None or not restored.get("compatibility_mode"):
        return
    err_console.print(f"[yellow]warning:[/] {safe_text(restored.get('note', ''))}", highlight=False)


def _warn_if_environment_differs(
    events: list[dict[str, Any]], fingerprint: str | None, as_json: bool
) -> None:
    """The spec is resolved again: say so when that gave another environment."""
    built = next((e["payload"] for e in events if e["type"] == "env.built"), None)
    if as_json or built is None or fingerprint is None or built["fingerprint"] == fingerprint:
        return
    err_console.print(
        f"[yellow]warning:[/] the new sandbox's environment {built['fingerprint'][:12]} differs "
        f"from the snapshot's {fingerprint[:12]}: its spec resolves to other packages today",
        highlight=False,
    )


@sandbox_app.command("gc")
def gc(
    older_than: Annotated[
        str, typer.Option("--older-than", help="Remove sandboxes that ended longer ago (1d, 6h)")
    ] = "1d",
    keep: Annotated[
        int | None,
        typer.Option("--keep", min=0, help="Also keep at most this many ended sandboxes"),
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would go")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Remove the directories (code copy, logs, outputs) of ENDED sandboxes on this node.

    Runs on the node, as root, on `$DSEC_HOME/sandboxes` (like `dsec sandbox logs`); a running
    sandbox is never touched. The node agent applies the same policy on its own
    (DSEC_SANDBOX_KEEP_HOURS, DSEC_SANDBOX_KEEP_MAX).
    """
    import os

    from dsec_core import retention
    from dsec_core.settings import Settings
    from dsec_core.spec.units import parse_duration

    try:
        zero = older_than.strip() in ("0", "0s")  # every ended sandbox
        older_than_s = 0.0 if zero else parse_duration(older_than).total_seconds()
    except ValueError as exc:
        fail(f"--older-than {older_than!r}: {exc} (e.g. 1d, 6h, 30m)", EXIT_BAD_INPUT)
    home = Settings().home.resolve()
    if not dry_run:
        kept = f" (keeping at most {keep})" if keep is not None else ""
        confirm(f"remove ended sandboxes older than {older_than} under {home}{kept}", yes)
    if not dry_run and os.geteuid() != 0:
        fail(
            "dsec sandbox gc removes files owned by sandbox uids: run it as root on the node "
            "(or with --dry-run)",
            EXIT_BAD_INPUT,
        )
    now = time.time()
    chosen = retention.choose(
        retention.scan(home, now), now, older_than_s=older_than_s, keep_max=keep
    )
    done: list[dict[str, Any]] = []
    for removal in chosen:
        freed = retention.size_of(removal.entry.path) if dry_run else None
        if not dry_run:
            freed = retention.remove(home, removal)
        if freed is not None:
            done.append(
                {
                    "sandbox_id": removal.entry.sandbox_id,
                    "path": str(removal.entry.path),
                    "bytes": freed,
                    "why": removal.why,
                }
            )
    if as_json:
        print_json({"dry_run": dry_run, "removed": done})
        return
    verb = "would remove" if dry_run else "removed"
    for item in done:
        console.print(
            f"{verb} {item['sandbox_id']} ({item['bytes'] / 2**20:.1f} MiB): {item['why']}",
            highlight=False,
        )
    total = sum(item["bytes"] for item in done) / 2**20
    console.print(f"{verb} {len(done)} ended sandbox(es), {total:.1f} MiB", highlight=False)
