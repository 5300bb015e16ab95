"""``dsec policy infer`` and ``dsec policy tools``: the policy an agent's code needs.

Exit codes: 0 ok, 2 bad input (missing code directory).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from dsec_rules.adapters.code_files import CodeDirError, read_python_sources
from dsec_rules.domain import infer as infer_needs
from dsec_rules.infer.catalogue import load_catalogue
from dsec_rules.infer.render import render_policy_yaml

from dsec_cli.common import EXIT_BAD_INPUT, fail


def register(app: typer.Typer) -> None:
    """Add the ``policy`` command group to the ``dsec`` app."""
    policy_app = typer.Typer(help="Policy inferred from agent code.", no_args_is_help=True)
    policy_app.command("infer")(infer)
    policy_app.command("tools")(tools)
    app.add_typer(policy_app, name="policy")


def infer(
    code: Annotated[Path, typer.Option("--code", help="Agent code directory")],
    workdir: Annotated[
        str, typer.Option("--workdir", help="Where the code runs (resolves relative paths)")
    ] = "/workspace",
    as_json: Annotated[bool, typer.Option("--json", help="Print the needs as JSON")] = False,
) -> None:
    """Print a ready-to-paste runtime_context.env_vars + security_policy block for the code."""
    try:
        files = read_python_sources(code)
    except CodeDirError as exc:
        fail(f"--code {exc}", EXIT_BAD_INPUT)
    needs = infer_needs(files)
    if as_json:
        typer.echo(needs.model_dump_json(indent=2))
    else:
        typer.echo(render_policy_yaml(needs, workdir), nl=False)


def tools(
    as_json: Annotated[bool, typer.Option("--json", help="Print the catalogue as JSON")] = False,
) -> None:
    """List the catalogue of tool semantics used by inference."""
    catalogue = load_catalogue()
    if as_json:
        typer.echo(json.dumps(catalogue.model_dump(mode="json")["tools"], indent=2))
        return
    for tool in catalogue.tools:
        hosts = ", ".join(e.domain for e in tool.egress) or "-"
        secrets = ", ".join(tool.secrets) or "-"
        typer.echo(f"{tool.name:<18} {tool.category:<10} {hosts:<40} {secrets}")
