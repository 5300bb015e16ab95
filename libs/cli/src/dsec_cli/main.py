"""The ``dsec`` command line.

Exit codes (for every command): 0 ok, 1 a check failed (verify, rejected spec, failed sandbox),
2 bad input (unreadable file, invalid flag, spec errors), 3 the stack/server is unreachable,
4 timed out waiting (submit, snapshot, rollback).

Start-up stays fast (``dsec --help`` imports no command module): the top-level commands are
listed in :data:`COMMANDS` with their one-line help, and a command's module is imported only
when that command runs (or its ``--help`` or completion is asked for). A command module keeps
its heavy imports (nats, the event models, rich tables, yaml) inside its functions.
``tests`` check that the index matches the modules and that ``dsec --help`` imports none of them.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from typer import _click as click
from typer.core import TyperCommand, TyperGroup

from dsec_cli import commands

_TYPER = "0.29.1"  # the version :func:`_defer_coercion` was written for (pinned in pyproject)


def _defer_coercion() -> None:
    """Typer builds a pydantic ``TypeAdapter`` for every option of the command that runs, set
    or not, before it looks at the value; the first one imports pydantic (~70 ms, and more with
    each adapter). An unset option (``None``) is never coerced (:meth:`RuntimeParam.coerce`
    returns it as it is), so the adapter of each parameter is built when a value first needs
    it: the same coercion, the same errors, and a command given only flags and defaults of
    ``None`` imports no pydantic for its options. Only for the Typer it was written for."""
    from dataclasses import dataclass

    from typer import _coercion
    from typer import core as typer_core

    if typer.__version__ != _TYPER or (
        getattr(typer_core, "build_runtime_param", None) is not _coercion.build_runtime_param
    ):
        return

    @dataclass(frozen=True)
    class Deferred(_coercion.RuntimeParam):
        descriptor: _coercion.TypeDescriptor

        def _coerce_value(self, value: Any, param: Any, ctx: click.Context) -> Any:
            built = param._runtime_param = _coercion.build_runtime_param(self.descriptor)
            return built._coerce_value(value, param=param, ctx=ctx)

    def deferred(descriptor: _coercion.TypeDescriptor) -> _coercion.RuntimeParam:
        return Deferred(descriptor.parameter_info, descriptor.annotation, descriptor)

    setattr(typer_core, "build_runtime_param", deferred)  # noqa: B010 (not exported: mypy)


_defer_coercion()

#: Every top-level command: the module of :mod:`dsec_cli.commands` that registers it, and the
#: one-line help ``dsec --help`` shows without importing it (a test keeps it equal to the real
#: one). A module that is not named here is imported at start-up (and the test fails).
COMMANDS: dict[str, tuple[str, str]] = {
    "audit": ("audit", "Verify and replay the signed audit trail."),
    "cluster": ("cluster", "Cluster-wide operator settings."),
    "code": ("code", "Code bundles: what `dsec submit` and snapshots take."),
    "env": ("env", "Environments, content-addressed by lock hash, as the object store holds them."),
    "events": ("events", "Follow the event log; export the bus schema."),
    "experiment": (
        "experiment",
        "A/B experiments: agent variants over the same recorded inputs, scored and compared.",
    ),
    "fleet": (
        "fleet",
        "A simulated fleet: many GPU nodes that join, heartbeat and run placements, "
        "indistinguishable from real node agents for the scheduler.",
    ),
    "login": (
        "identity",
        "Install the identity this CLI signs with: a key bound to a user and a tenant.",
    ),
    "whoami": ("identity", "Show the identity this CLI signs with (exit 2 when there is none)."),
    "admin": ("identity", "Operator tasks: issue credentials and service keys."),
    "nats": ("nats", "NATS authorization: roles, permissions, credentials."),
    "node": (
        "node",
        "Nodes: list and inspect them (heartbeats), cordon, uncordon and drain them.",
    ),
    "policy": ("policy", "Policy inferred from agent code."),
    "projections": ("projections", "Manage the read models."),
    "sandbox": ("sandbox", "List, inspect, stop, roll back and start sandboxes from snapshots."),
    "schedule": (
        "schedule",
        "Placement: why a sandbox's units run where they run, or why they wait.",
    ),
    "snapshot": ("snapshot", "Signed, content-addressed snapshots of sandbox code and state."),
    "spec": ("spec", "Sandbox specs: check them before submitting."),
    "up": (
        "stack",
        "Start the embedded stack (NATS, Postgres, S3, OpenBao, Prometheus) and every service.",
    ),
    "down": (
        "stack",
        "Stop every service, then every server; verify nothing keeps running or listening.",
    ),
    "status": (
        "stack",
        "Show every server and service: state, endpoint, version, pid (never a secret).",
    ),
    "submit": ("submit", "Submit SPEC to the bus and print its lifecycle as events arrive."),
    "unit": (
        "unit",
        "Compute units: move a running unit to another node (operator); list migrations.",
    ),
}

#: The distributions ``dsec --version`` reports (those installed).
DISTRIBUTIONS = (
    "dsec-cli",
    "dsec-core",
    "dsec-client",
    "dsec-sdk",
    "dsec-rules",
    "dsec-snapstore",
)


def wants_json(args: list[str]) -> bool:
    """Whether a command line asks for ``--json`` (before any ``--``)."""
    for arg in args:
        if arg == "--":
            return False
        if arg == "--json":
            return True
    return False


class LazyGroup(TyperGroup):
    """The root group: commands are imported from their module on first use."""

    _listing = False

    def _load(self, module_name: str) -> None:
        module = importlib.import_module(f"{commands.__name__}.{module_name}")
        _resume_gc()
        holder = typer.Typer()
        module.register(holder)
        group = typer.main.get_group(holder)
        for name, command in group.commands.items():
            self.commands.setdefault(name, command)

    def _unindexed(self) -> list[str]:
        """Command modules missing from :data:`COMMANDS` (a new one): loaded eagerly."""
        known = {module for module, _ in COMMANDS.values()}
        found = {
            name.removesuffix(".py")
            for path in commands.__path__
            for name in os.listdir(path)
            if name.endswith(".py") and not name.startswith("_")
        }
        return sorted(found - known)

    def list_commands(self, ctx: click.Context) -> list[str]:
        for module_name in self._unindexed():
            self._load(module_name)
        return [*COMMANDS, *(name for name in self.commands if name not in COMMANDS)]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module_name, short_help = COMMANDS[cmd_name]
            if self._listing:  # `dsec --help`, completion of a top-level name: the index is enough
                return TyperCommand(name=cmd_name, help=short_help, short_help=short_help)
            self._load(module_name)
        if cmd_name not in self.commands and cmd_name not in COMMANDS:
            for module_name in self._unindexed():
                self._load(module_name)
        return self.commands.get(cmd_name)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        try:
            return super().resolve_command(ctx, args)
        except click.exceptions.UsageError as exc:  # Typer suggests only loaded commands
            from difflib import get_close_matches

            matches = get_close_matches(args[0], self.list_commands(ctx)) if args else []
            if matches and "Did you mean" not in exc.message:
                names = ", ".join(repr(m) for m in matches)
                exc.message = f"{exc.message.rstrip('.')}. Did you mean {names}?"
            raise

    @contextmanager
    def _index_only(self) -> Iterator[None]:
        self._listing = True
        try:
            yield
        finally:
            self._listing = False

    def format_help(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        with self._index_only():
            super().format_help(ctx, formatter)

    def shell_complete(self, ctx: click.Context, incomplete: str) -> list[Any]:
        with self._index_only():
            return super().shell_complete(ctx, incomplete)

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        as_json = wants_json(args)  # `fail` then prints its errors as JSON on stdout
        if as_json or "dsec_cli.common" in sys.modules:  # (not imported for `dsec --help`)
            from dsec_cli import common

            common.json_errors = as_json
        try:
            return super().make_context(info_name, args, parent, **extra)
        except click.ClickException as exc:
            _json_usage_error(exc)
            raise

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except click.ClickException as exc:
            _json_usage_error(exc)
            raise


def _json_usage_error(exc: click.ClickException) -> None:
    """With ``--json``, a usage error (unknown option, bad value) is one JSON error too."""
    from dsec_cli import common

    if common.json_errors:
        common.json_error(exc.format_message(), exc.exit_code)
        raise typer.Exit(exc.exit_code)


def versions() -> dict[str, str]:
    """Versions of the installed DSec packages and of Python."""
    from importlib import metadata

    found = {"python": sys.version.split()[0]}
    for dist in DISTRIBUTIONS:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return found


def _print_versions(as_json: bool) -> None:
    found = versions()
    if as_json:
        from dsec_cli.common import print_json

        print_json(found)
    else:
        print(f"dsec {found.get('dsec-cli', '?')}")
        for name, version in found.items():
            if name != "dsec-cli":
                print(f"  {name} {version}")


def _version_option(value: bool) -> None:
    if value:
        _print_versions(as_json=False)
        raise typer.Exit(0)


app = typer.Typer(
    name="dsec",
    cls=LazyGroup,
    help="DSec: declarative, verified, isolated sandboxes for AI agents.\n\n"
    "Exit codes: 0 ok, 1 failed check, 2 bad input, 3 stack unreachable, 4 timed out.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            help="Print the versions of the DSec packages and exit.",
            is_eager=True,
            callback=_version_option,
        ),
    ] = False,
) -> None:
    pass


@app.command("version")
def version(
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output")] = False,
) -> None:
    """Print the versions of the DSec packages and of Python."""
    _print_versions(as_json)


_gc_paused = False


def _resume_gc() -> None:
    """After start-up (see :func:`main`): what the imports made is frozen, collections resume."""
    global _gc_paused
    if _gc_paused:
        _gc_paused = False
        gc.freeze()
        gc.enable()


def main() -> None:
    """Run the command line (ends in ``SystemExit``, as Click's standalone mode does).

    Collecting while a command's modules are imported walks the thousands of long-lived objects
    the imports make (event models, nats-py's dataclasses) again and again to find almost
    nothing. Collection is paused until the command's module is loaded
    (:meth:`LazyGroup._load`); what the imports made is then frozen, so no collection walks it
    again, and collection resumes for the command itself.
    """
    global _gc_paused
    if gc.isenabled():
        gc.disable()
        _gc_paused = True
    try:
        app()
    except Exception as exc:  # a bad DSEC_* setting, wherever a command reads the settings
        _settings_failed(exc)
        raise
    finally:
        _resume_gc()


def _settings_failed(exc: Exception) -> None:
    """Exit 2 with one line naming the variable when ``exc`` is a bad ``DSEC_*`` setting (it
    would print a traceback); else return."""
    if type(exc).__name__ != "ValidationError":
        return
    from dsec_core.settings import settings_problem  # (loaded: it raised the error)

    from dsec_cli import common

    problem = settings_problem(exc)
    if problem is None:
        return
    try:
        common.fail(problem, common.EXIT_BAD_INPUT)
    except typer.Exit as done:
        raise SystemExit(done.exit_code) from None


def run() -> None:
    """Entry point of the ``dsec`` script: :func:`main`, then the process ends.

    Python's own shutdown frees every module and object one by one: about 0.1 s once the event
    models are loaded, longer than some commands take. When only this thread is left (nothing
    else can still be writing), the ``atexit`` handlers run, the output is flushed and the
    process ends without that teardown (:func:`dsec_core.quickexit.leave`), with the exit
    status ``SystemExit`` would give.
    """
    try:
        main()
    except SystemExit as exc:
        from dsec_core.quickexit import leave

        leave(exc.code)
        raise


if __name__ == "__main__":
    run()
