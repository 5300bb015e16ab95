"""``dsec submit``: publish a spec (and its code bundle) and follow its lifecycle."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from dsec_core import lifecycle

from dsec_cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_TIMEOUT,
    client,
    console,
    err_console,
    fail,
    print_json,
    run,
    safe_text,
    spinner,
)
from dsec_cli.render import event_line, waiting_for

if TYPE_CHECKING:  # (loaded when the command runs: `dsec submit --help` needs no event model)
    from dsec_core.envelope import Envelope
    from dsec_core.events import BundleRef, Payload

WAIT_FOR = {
    "validated": "spec.validated",
    "built": "env.built",
    "ready": "sandbox.ready",
    "exited": "sandbox.exited",
}


@dataclass
class Outcome:
    """What ``submit`` saw for one sandbox."""

    sandbox_id: str
    life: lifecycle.Lifecycle = field(default_factory=lifecycle.Lifecycle)
    """The one lifecycle fold of the events seen so far."""
    events: list[dict[str, Any]] = field(default_factory=list)
    stalled_after: str | None = None
    skipped: list[str] = field(default_factory=list)
    said_pending: str | None = None
    """The pending reason last printed (a waiting sandbox's reason is said once)."""

    @property
    def state(self) -> str:
        return "submitted" if self.life.state == "unknown" else self.life.state

    @property
    def exit_code(self) -> int | None:
        return self.life.exit_code

    @property
    def waiting(self) -> bool:
        """Pending in the scheduler's queue: not stalled, not terminal; a node may come."""
        return self.life.state == "pending"

    def as_json(self) -> dict[str, Any]:
        return {
            "sandbox_id": self.sandbox_id,
            "state": self.state,
            "node_id": self.life.node_id,
            "reason": self.life.reason,
            "exit_code": self.exit_code,
            "stalled_after": self.stalled_after,
            "skipped": self.skipped,
            "events": self.events,
        }


def warn_skipped(skipped: Sequence[str], code: Path) -> None:
    """Say which special files of ``code`` the bundle leaves out (they are not code)."""
    if skipped:
        err_console.print(
            f"[yellow]warning:[/] --code {code}: left out {len(skipped)} special file(s) "
            f"(not code): {', '.join(skipped)}",
            highlight=False,
            soft_wrap=True,
        )


async def upload_code(
    d: Any, code: Path, spec_text: str, skipped: list[str] | None = None
) -> BundleRef:
    """Bundle ``code`` (with the spec's exclude patterns and size bound) and store it under
    this user's tenant with the policy service's grant, through the open client ``d``
    (:meth:`dsec_client.Client.upload_code`); ``skipped`` receives the special files left out.
    Exits 2 for code that cannot be bundled, 3 when no policy service or object store answers."""
    from dsec_client.errors import DSecError, InvalidInput

    try:
        ref: BundleRef = await d.upload_code(code, spec_text, skipped)
        return ref
    except InvalidInput as exc:
        fail(f"--code {exc}", EXIT_BAD_INPUT)
    except DSecError as exc:
        fail(str(exc), exc.EXIT)


def _record(outcome: Outcome, seq: int, env: Envelope, as_json: bool) -> bool:
    """Fold one event into ``outcome`` and print it; ``False`` when the fold refused it (an
    event that cannot follow the state: it changes nothing)."""
    before = outcome.life
    outcome.life = lifecycle.step(before, env.type, env.payload, event_id=env.id, tenant=env.tenant)
    refused = len(outcome.life.refused) > len(before.refused)
    outcome.events.append(
        {"seq": seq, "type": env.type, "time": env.time.isoformat(), "payload": env.payload}
        | ({"refused": outcome.life.refused[-1].describe()} if refused else {})
    )
    if as_json:
        return not refused
    if refused:
        err_console.print(
            f"[yellow]ignored[/] seq {seq}: {safe_text(outcome.life.refused[-1].describe())}",
            highlight=False,
        )
    elif env.type == "sandbox.pending":
        if outcome.life.reason != outcome.said_pending:  # the same reason again: said already
            outcome.said_pending = outcome.life.reason
            console.print(event_line(seq, env), highlight=False, soft_wrap=True)
            console.print(
                f"    pending: {safe_text(outcome.life.reason or '')} (waiting for a node)",
                highlight=False,
            )
    else:
        console.print(event_line(seq, env), highlight=False, soft_wrap=True)
        _explain(env)
    return not refused


def _explain(env: Envelope) -> None:
    """Print the details a user needs when the chain ends badly."""
    p = env.payload
    if env.type == "spec.rejected":
        for e in p.get("errors", []):
            where = f"{e.get('file')}:{e.get('line')}:{e.get('column')}"
            console.print(f"    [red]{where}: {e.get('message')}[/]", highlight=False)
    elif env.type == "deps.conflict":
        console.print(f"    [red]{p.get('explanation')}[/]", highlight=False)
        for alt in p.get("alternatives", []):
            mark = "resolves" if alt.get("verified") else "unverified"
            console.print(
                f"    try: {alt['requirement']} -> [green]{alt['suggestion']}[/] ({mark})",
                highlight=False,
            )


def _submitted_name(spec: Path) -> str:
    """The name the services see the spec by (:func:`dsec_client.code.submitted_name`)."""
    from dsec_client.code import submitted_name

    return submitted_name(spec)


async def submit_and_follow(
    spec_text: str,
    filename: str,
    code_ref: BundleRef | None,
    wait: str,
    timeout: float,
    stall: float,
    as_json: bool,
    *,
    also: Sequence[Payload] = (),
    start_from_snapshot: str | None = None,
    code: Path | None = None,
) -> Outcome:
    """Publish ``spec.submitted`` for a new sandbox (with the snapshot it starts from, if any;
    then ``also``) and follow the sandbox's events until ``wait`` is reached, a terminal
    event, a stall or the timeout (:meth:`dsec_client.Sandbox.wait`). ``code``: a directory
    to bundle and store first (its left-out special files are warned about and reported in
    the outcome's ``skipped``), instead of a stored ``code_ref``."""
    from dsec_client import SandboxEnded, Timeout

    skipped: list[str] = []
    async with client() as d:
        if code is not None:
            code_ref = await upload_code(d, code, spec_text, skipped)
            warn_skipped(skipped, code)
        sandbox = await d.submit(
            spec_text,
            code_ref,
            filename=filename,
            start_from_snapshot=start_from_snapshot,
            also=also,
        )
        outcome = Outcome(sandbox.id, skipped=skipped)

        def on_event(event: Any) -> None:
            _record(outcome, event.seq, event.envelope, as_json)
            show(waiting_for(event.type))

        try:
            with spinner(waiting_for(None)) as show:  # on a terminal only, never with --json
                await sandbox.wait(wait, timeout=timeout, stall=stall, on_event=on_event)
        except SandboxEnded:
            pass  # the outcome says how it ended
        except Timeout:
            outcome.stalled_after = outcome.events[-1]["type"] if outcome.events else None
    return outcome


def _exit_code(outcome: Outcome) -> int:
    if outcome.stalled_after is not None:
        return EXIT_TIMEOUT
    if outcome.state in ("rejected", "conflict", "failed"):
        return EXIT_FAILED
    if outcome.state == "exited" and outcome.exit_code != 0:
        return EXIT_FAILED
    return EXIT_OK


def submit(
    spec: Annotated[Path, typer.Argument(help="The sandbox spec (YAML)")],
    code: Annotated[
        Path | None, typer.Option(help="Directory to bundle as the sandbox's code")
    ] = None,
    wait: Annotated[
        str, typer.Option(help="Follow until: validated|built|ready|exited")
    ] = "exited",
    timeout: Annotated[float, typer.Option(help="Give up after this many seconds")] = 900.0,
    stall: Annotated[
        float, typer.Option(help="Stop when no event arrives for this long (s)")
    ] = 60.0,
    as_json: Annotated[bool, typer.Option("--json", help="Last line: one JSON result")] = False,
) -> None:
    """Submit SPEC to the bus and print its lifecycle as events arrive.

    Exit 0 when the wait level is reached (and, for `exited`, the sandbox exited 0); 1 when the
    spec ends rejected, in conflict, failed, or exited non-zero; 2 for bad input; 3 when the
    stack is unreachable; 4 when the chain stalled or timed out before the wait level.
    """
    if wait not in WAIT_FOR:
        fail(f"--wait {wait!r} is not valid; use one of {', '.join(WAIT_FOR)}", EXIT_BAD_INPUT)
    try:
        spec_text = spec.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read spec {spec}: {exc}", EXIT_BAD_INPUT)
    if code is not None and not code.is_dir():
        fail(f"--code {code} is not a directory", EXIT_BAD_INPUT)

    try:
        outcome = run(
            submit_and_follow(
                spec_text, _submitted_name(spec), None, wait, timeout, stall, as_json, code=code
            )
        )
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    finish(outcome, wait, stall, as_json)


def finish(outcome: Outcome, wait: str, stall: float, as_json: bool) -> NoReturn:
    """Report how following a submitted sandbox ended, and exit with its code."""
    if outcome.stalled_after is not None and not as_json:
        err_console.print(
            f"[yellow]stalled:[/] no event for {stall:.0f} s after "
            f"{outcome.stalled_after or 'spec.submitted'}; waiting for {WAIT_FOR[wait]}. "
            "Is the service that handles it running? (`dsec status`)"
        )
    if as_json:
        print_json(outcome.as_json())
    raise typer.Exit(_exit_code(outcome))


def register(app: typer.Typer) -> None:
    """Add ``dsec submit``."""
    app.command("submit")(submit)


__all__ = [
    "WAIT_FOR",
    "Outcome",
    "finish",
    "register",
    "submit_and_follow",
    "upload_code",
    "warn_skipped",
]
