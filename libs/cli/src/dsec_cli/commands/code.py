"""``dsec code bundle``: the git-ignore-aware, content-addressed code bundle of a directory."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from dsec_core.codebundle import DEFAULT_EXCLUDES, Bundle, BundleError, build_bundle
from dsec_core.spec.units import parse_size

from dsec_cli.commands.submit import warn_skipped
from dsec_cli.common import EXIT_BAD_INPUT, console, fail, print_json
from dsec_cli.render import human_size

code_app = typer.Typer(
    help="Code bundles: what `dsec submit` and snapshots take.", no_args_is_help=True
)


def _print_summary(bundle: Bundle, show_files: bool) -> None:
    manifest = bundle.manifest
    console.print(f"[bold]bundle[/] blake3:{bundle.digest}", highlight=False)
    console.print(
        f"  {len(manifest.files)} files, {human_size(manifest.total_size)} "
        f"-> archive {human_size(bundle.size)}",
        highlight=False,
    )
    if manifest.git is not None:
        git = manifest.git
        state = "dirty" if git.dirty else "clean"
        console.print(
            f"  git {git.commit or '(no commit)'} on {git.branch or '(detached)'} "
            f"path '{git.path or '.'}' ({state})",
            highlight=False,
        )
    if bundle.path is not None:
        console.print(f"  wrote {bundle.path}", highlight=False)
    if show_files:
        for f in manifest.files:
            extra = f" -> {f.target}" if f.target is not None else ""
            console.print(f"  {f.mode:o} {f.size:>10} {f.path}{extra}", highlight=False)


_BUNDLE_HELP = (
    "Bundle DIR: every file except .git, git-ignored files, --exclude patterns and the defaults "
    f"({', '.join(DEFAULT_EXCLUDES)}). The archive is deterministic (fixed owners and mtimes), so "
    "its BLAKE3 digest identifies the content."
)


@code_app.command("bundle", help=_BUNDLE_HELP)
def bundle(
    directory: Annotated[Path, typer.Argument(help="Directory to bundle")],
    exclude: Annotated[
        list[str], typer.Option("--exclude", "-x", help="Extra gitignore-style pattern")
    ] = [],  # noqa: B006
    out: Annotated[Path | None, typer.Option(help="Write the .tar.zst archive here")] = None,
    files: Annotated[bool, typer.Option("--files", help="List every file")] = False,
    max_size: Annotated[
        str,
        typer.Option(help="Refuse a tree larger than this once extracted (include_code.max_size)"),
    ] = "256MiB",
    as_json: Annotated[bool, typer.Option("--json", help="Print the manifest as JSON")] = False,
) -> None:
    """Bundle a directory and print (or write) the result."""
    try:
        limit = parse_size(max_size)
    except ValueError as exc:
        fail(f"--max-size {max_size!r}: {exc}", EXIT_BAD_INPUT)
    try:
        result = build_bundle(directory, exclude, out=out, max_size=limit)
    except BundleError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    warn_skipped(result.skipped, directory)
    if as_json:
        print_json(
            {
                "digest": result.digest,
                "size": result.size,
                "files": len(result.manifest.files),
                "total_size": result.manifest.total_size,
                "tree_digest": result.manifest.tree_digest,
                "out": str(out) if out is not None else None,
                "skipped": list(result.skipped),
                "manifest": result.manifest.model_dump(mode="json"),
            }
        )
    else:
        _print_summary(result, files)


def register(app: typer.Typer) -> None:
    """Add ``dsec code``."""
    app.add_typer(code_app, name="code")
