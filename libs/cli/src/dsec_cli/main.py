"""The ``dsec`` command line.

Exit codes (for every command): 0 ok, 1 a check failed (verify, rejected spec, failed sandbox),
2 bad input (unreadable file, invalid flag, spec errors), 3 the stack/server is unreachable,
4 timed out waiting (submit, snapshot, rollback).
"""

from __future__ import annotations

import importlib
import pkgutil

import typer

from dsec_cli import commands

app = typer.Typer(
    name="dsec",
    help="DSec: declarative, verified, isolated sandboxes for AI agents.\n\n"
    "Exit codes: 0 ok, 1 failed check, 2 bad input, 3 stack unreachable, 4 timed out.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


def _register_commands() -> None:
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        module.register(app)


_register_commands()


def main() -> None:
    """Entry point of the ``dsec`` script."""
    app()
