"""``dsec env ls``: the environment archives in the object store.

The builder builds an environment once per lock hash for the whole cluster and stores it as
``envs/<lock_hash>.tar.zst`` in the system bucket (``dsec_core.objectstore.env_archive_key``);
each node agent unpacks the archives it needs into its own cache. The CLI only reads the
store: the builder and the node agents own their caches, so there is no ``dsec env gc``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any

import typer
from dsec_core.settings import Settings
from rich.table import Table

from dsec_cli.common import EXIT_UNREACHABLE, console, fail, print_json, s3_client, safe_text
from dsec_cli.render import human_size

ENV_ARCHIVES = "envs/"
"""Key prefix of the environment archives (the scheme of ``objectstore.env_archive_key``)."""
ARCHIVE_SUFFIX = ".tar.zst"

env_app = typer.Typer(
    help="Environments, content-addressed by lock hash, as the object store holds them.",
    no_args_is_help=True,
)


def archive_row(key: str, size: int, modified: datetime | None) -> dict[str, Any] | None:
    """One listed archive, or None for a key under ``envs/`` that is no archive (a part
    upload, a stray object)."""
    name = key.removeprefix(ENV_ARCHIVES)
    if not name.endswith(ARCHIVE_SUFFIX) or "/" in name:
        return None
    lock_hash = name.removesuffix(ARCHIVE_SUFFIX)
    if not lock_hash:
        return None
    return {
        "lock_hash": lock_hash,
        "object_key": key,
        "size_bytes": size,
        "stored_at": modified.isoformat() if modified is not None else None,
    }


def list_archives(settings: Settings) -> list[dict[str, Any]]:
    """Every archive in the system bucket, most recently stored first (exit 3 when the store
    cannot be reached)."""
    from minio.error import S3Error
    from urllib3.exceptions import HTTPError

    store = s3_client(settings)
    rows: list[dict[str, Any]] = []
    try:
        for obj in store.list_objects(settings.s3_bucket, prefix=ENV_ARCHIVES, recursive=True):
            row = archive_row(str(obj.object_name), int(obj.size or 0), obj.last_modified)
            if row is not None:
                rows.append(row)
    except S3Error as exc:
        if exc.code != "NoSuchBucket":
            fail(f"cannot list s3://{settings.s3_bucket}/{ENV_ARCHIVES}: {exc.code}", 1)
    except (HTTPError, OSError) as exc:
        fail(
            f"cannot reach the object store ({type(exc).__name__}); is the stack up? "
            "(`dsec status`)",
            EXIT_UNREACHABLE,
        )
    rows.sort(key=lambda r: (r["stored_at"] or "", r["lock_hash"]), reverse=True)
    return rows


def _table(rows: list[dict[str, Any]]) -> Table:
    table = Table(box=None, pad_edge=False)
    for column in ("LOCK HASH", "SIZE", "STORED", "OBJECT"):
        table.add_column(column, no_wrap=column != "OBJECT", overflow="fold")
    for row in rows:
        table.add_row(
            safe_text(row["lock_hash"][:16]),
            human_size(row["size_bytes"]),
            (row["stored_at"] or "")[:19].replace("T", " "),
            safe_text(row["object_key"]),
        )
    return table


@env_app.command("ls")
def ls(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON")] = False,
) -> None:
    """List the environment archives of the cluster, most recently stored first."""
    rows = list_archives(Settings())
    if as_json:
        print_json({"environments": rows})
        return
    if not rows:
        console.print("no environment archives in the object store")
        return
    console.print(_table(rows))


def register(app: typer.Typer) -> None:
    """Add ``dsec env``."""
    app.add_typer(env_app, name="env")
