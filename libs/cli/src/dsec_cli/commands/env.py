"""``dsec env ls`` / ``dsec env gc``: the environments the builder built on this node.

They live under the builder's root, ``$DSEC_HOME/builder/envs/<lock hash>/``, immutable; each is
also stored once for the cluster as an archive in the object store (``envs/<lock hash>.tar.zst``),
which is what node agents stage from.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Annotated

import typer
from dsec_core.layout import NodeLayout
from dsec_core.settings import Settings
from rich.table import Table

from dsec_cli.common import EXIT_BAD_INPUT, console, fail, print_json
from dsec_cli.render import human_size

if TYPE_CHECKING:
    from dsec_builder.adapters.store import EnvironmentStore
    from dsec_builder.models import EnvironmentInfo

env_app = typer.Typer(
    help="Environments on this node, content-addressed by lock hash.", no_args_is_help=True
)


def _store() -> EnvironmentStore:
    # Imported here: the builder pulls in its HTTP and S3 clients, which other commands skip.
    from dsec_builder.adapters.store import EnvironmentStore

    return EnvironmentStore(NodeLayout.of(Settings().home).builder / "envs")


def _age(timestamp: float) -> str:
    seconds = max(0.0, time.time() - timestamp)
    for unit, width in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= width:
            return f"{seconds / width:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def _table(infos: list[EnvironmentInfo]) -> Table:
    table = Table(box=None, pad_edge=False)
    for column in ("LOCK HASH", "PACKAGES", "SIZE", "LAST USED", "FINGERPRINT", "PATH"):
        table.add_column(column, no_wrap=column != "PATH", overflow="fold")
    for info in infos:
        table.add_row(
            info.lock_hash[:16],
            str(info.packages),
            human_size(info.size_bytes),
            _age(info.last_used_at),
            info.fingerprint[:16],
            str(info.path),
        )
    return table


@env_app.command("ls")
def ls(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """List environments, most recently used first."""
    infos = _store().environments()
    if as_json:
        print_json({"environments": [info.model_dump(mode="json") for info in infos]})
        return
    if not infos:
        console.print("no environments on this node")
        return
    console.print(_table(infos))


@env_app.command("gc")
def gc(
    keep: Annotated[
        int, typer.Option(help="Environments to keep (the most recently used)", min=0)
    ] = 10,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only show what would go")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """Remove all but the --keep most recently used environments, and crashed builds.

    An environment being built at that moment is left alone.
    """
    try:
        removed = _store().gc(keep, dry_run=dry_run)
    except ValueError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    freed = sum(info.size_bytes for info in removed)
    if as_json:
        print_json(
            {
                "dry_run": dry_run,
                "removed": [info.model_dump(mode="json") for info in removed],
                "freed_bytes": freed,
            }
        )
        return
    verb = "would remove" if dry_run else "removed"
    for info in removed:
        console.print(
            f"{verb} {info.lock_hash[:16]} ({human_size(info.size_bytes)})", highlight=False
        )
    console.print(
        f"{verb} {len(removed)} environment(s), {human_size(freed)}; kept up to {keep}",
        highlight=False,
    )


def register(app: typer.Typer) -> None:
    """Add ``dsec env``."""
    app.add_typer(env_app, name="env")
