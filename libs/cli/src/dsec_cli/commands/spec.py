"""``dsec spec check``: every problem of a spec at once, compiler style.

Exit codes: 0 the spec is valid (warnings may be printed), 2 the spec (or a file) is bad input.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from dsec_core.settings import Settings
from dsec_core.spec import SpecError
from dsec_core.spec.source import MAX_DOCUMENT_BYTES
from dsec_rules.adapters.code_files import CodeDirError, read_python_sources
from dsec_rules.adapters.org_policy_file import OrgPolicyError, load_org_policy
from dsec_rules.adapters.stack_facts import stack_facts
from dsec_rules.domain import ValidationOutcome, validate
from dsec_rules.guardrails import OrgPolicy

from dsec_cli.common import EXIT_BAD_INPUT, fail


def register(app: typer.Typer) -> None:
    """Add the ``spec`` command group to the ``dsec`` app."""
    spec_app = typer.Typer(
        help="Sandbox specs: check them before submitting.", no_args_is_help=True
    )
    spec_app.command("check")(check)
    app.add_typer(spec_app, name="spec")


def check(
    file: Annotated[Path, typer.Argument(help="The spec file (YAML)")],
    code: Annotated[
        Path | None, typer.Option("--code", help="Agent code directory to compare with the spec")
    ] = None,
    org_policy: Annotated[
        Path | None,
        typer.Option("--org-policy", help="Org guardrails file (default: DSEC_ORG_POLICY)"),
    ] = None,
    tenant: Annotated[
        str, typer.Option("--tenant", help="Check as this tenant (the service uses the signer's)")
    ] = "default",
    as_json: Annotated[bool, typer.Option("--json", help="Print a JSON report")] = False,
) -> None:
    """Validate FILE and print every error as FILE:LINE:COL: message. Exit 2 on errors."""
    text = _read(file)
    settings = Settings()
    policy = _org_policy(org_policy or settings.org_policy)
    code_files = None
    if code is not None:
        try:
            code_files = read_python_sources(code)
        except CodeDirError as exc:
            fail(f"--code {exc}", EXIT_BAD_INPUT)
    outcome = validate(
        text, str(file), code_files, policy, tenant=tenant, facts=stack_facts(settings)
    )
    if as_json:
        typer.echo(json.dumps(_report(str(file), outcome), indent=2))
    else:
        _print(str(file), outcome)
    if not outcome.ok:
        raise typer.Exit(EXIT_BAD_INPUT)


def _read(path: Path) -> bytes:
    try:
        with path.open("rb") as fh:  # no more than the parser accepts (+1 so it can say so)
            return fh.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        fail(f"{path}: cannot read: {exc.strerror or exc}", EXIT_BAD_INPUT)


def _org_policy(path: Path | None) -> OrgPolicy:
    try:
        return load_org_policy(path)
    except OrgPolicyError as exc:
        typer.echo(str(exc), err=True)
        fail(f"{path}: invalid org policy", EXIT_BAD_INPUT)


def _print(file: str, outcome: ValidationOutcome) -> None:
    diagnostics = sorted(
        [*outcome.errors, *outcome.warnings], key=lambda e: (e.file != file, e.line, e.column)
    )
    for diagnostic in diagnostics:
        typer.echo(diagnostic.format())
    summary = f"{_count(len(outcome.errors), 'error')}, {_count(len(outcome.warnings), 'warning')}"
    if outcome.ok and outcome.plan is not None:
        typer.echo(f"{file}: valid ({summary}); plan {outcome.plan.digest()[:16]}")
    else:
        typer.echo(f"{file}: invalid ({summary})")


def _count(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _report(file: str, outcome: ValidationOutcome) -> dict[str, object]:
    def dump(errors: tuple[SpecError, ...]) -> list[dict[str, object]]:
        return [e.model_dump(mode="json") for e in errors]

    plan = outcome.plan
    return {
        "file": file,
        "valid": outcome.ok,
        "errors": dump(outcome.errors),
        "warnings": dump(outcome.warnings),
        "plan": plan.model_dump(mode="json") if plan else None,
        "plan_digest": plan.digest() if plan else None,
    }
