"""``dsec events archive | archived | restore``: the event log in the object store.

The stream is append-only (NATS refuses to purge it, by design); the archive is its verified,
incremental copy in S3 — the backup of JetStream, and what ``dsec audit verify --archive``
reads before the live stream. See ``docs/operations.md``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from typing import Annotated, Any, TypeVar

import typer
from rich.table import Table

from dsec_cli.commands.events import events_app
from dsec_cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_UNREACHABLE,
    bus,
    console,
    err_console,
    fail,
    parse_since,
    print_json,
    run,
    s3_client,
    safe_text,
)

T = TypeVar("T")

BucketOption = Annotated[
    str | None,
    typer.Option(help="Bucket of the archive (default: DSEC_S3_BUCKET, the stack's bucket)"),
]


def _bucket(bucket: str | None) -> str:
    from dsec_core.settings import Settings

    return bucket or Settings().s3_bucket


def _anchor() -> bytes:
    """The trust root the manifest's signature must chain to (exit 2 when none is known)."""
    from dsec_cli.commands.audit import trust_anchor

    return trust_anchor()


def _signer() -> Any:
    """The operator's certified key, which signs the manifest (exit 2 off the operator's
    machine: only the operator archives)."""
    from dsec_core.eventarchive import ArchiveError, ManifestSigner

    from dsec_cli.common import operator_identity, operator_root

    key, cert = operator_identity()
    try:
        return ManifestSigner(key, cert, bytes(operator_root().verify_key))
    except ArchiveError as exc:
        fail(str(exc), EXIT_BAD_INPUT)


def guarded(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro``; an unreachable object store or a bad archive is one clear line."""
    from dsec_core.eventarchive import ArchiveCorrupt, ArchiveError
    from minio.error import MinioException
    from urllib3.exceptions import HTTPError

    try:
        return run(coro)
    except ArchiveCorrupt as exc:
        fail(str(exc), EXIT_FAILED)
    except ArchiveError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    except (MinioException, HTTPError, OSError) as exc:
        fail(
            f"cannot use the object store ({type(exc).__name__}: {str(exc)[:200]}); is the "
            "stack up (`dsec status`), or DSEC_S3_ENDPOINT and its keys set?",
            EXIT_UNREACHABLE,
        )


@asynccontextmanager
async def operator_bus() -> AsyncIterator[Any]:
    """JetStream as the operator on the embedded stack (the identity in DSEC_NATS_* else)."""
    from dsec_core.settings import Settings

    from dsec_cli.commands.nats import _embedded_operator_url

    settings = Settings()
    operator = _embedded_operator_url(settings)
    if operator is not None:
        settings = settings.model_copy(update={"nats_url": operator})
    async with bus(settings, check_stream=False) as (_nc, js):
        yield js


@events_app.command("archive")
def archive_cmd(
    upto: Annotated[
        int | None, typer.Option(min=1, help="Archive up to this stream sequence (inclusive)")
    ] = None,
    before: Annotated[
        str | None,
        typer.Option(help="Archive what was stored before this ISO time or age (30d, 12h)"),
    ] = None,
    segment_events: Annotated[
        int, typer.Option(min=1, help="Messages per segment object (at most)")
    ] = 10_000,
    bucket: BucketOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result")] = False,
) -> None:
    """Copy the event log into the object store, after what is archived already.

    Each segment (the stored messages of a range of sequences, byte-exact) is written, read
    back and checked (BLAKE3, count, sequences) before the manifest lists it. The manifest is
    signed with the operator's certified key (run it as the operator). Nothing is removed from
    the stream. `dsec audit verify --archive` verifies archive and stream as one.
    """
    from dsec_core import eventarchive

    before_t = parse_since(before) if before else None
    name = _bucket(bucket)
    signer = _signer()
    store = s3_client()

    def progress(seg: Any) -> None:
        if not as_json:
            err_console.print(
                f"  segment {seg.first_seq}-{seg.last_seq}: {seg.count} events, "
                f"{seg.size} bytes, verified",
                highlight=False,
            )

    async def go() -> Any:
        async with bus() as (_nc, js):
            return await eventarchive.archive(
                js,
                store,
                name,
                signer=signer,
                upto=upto,
                before=before_t,
                segment_events=segment_events,
                progress=progress,
            )

    result = guarded(go())
    out = {
        "bucket": name,
        "archived_events": result.events,
        "first_seq": result.first_seq,
        "last_seq": result.last_seq,
        "archived_upto": result.archived_upto,
        "segments": [s.key for s in result.segments],
    }
    if as_json:
        print_json(out)
    elif result.events:
        console.print(
            f"archived {result.events} events (seq {result.first_seq}–{result.last_seq}) in "
            f"{len(result.segments)} segment(s) to s3://{safe_text(name)}/"
            f"{eventarchive.PREFIX}; every segment read back and verified",
            highlight=False,
        )
    else:
        upto_text = result.archived_upto if result.archived_upto is not None else "nothing"
        console.print(f"nothing new to archive (archived up to seq {upto_text})")


@events_app.command("archived")
def archived_cmd(
    check: Annotated[
        bool, typer.Option(help="Read every segment back and check it against the manifest")
    ] = True,
    bucket: BucketOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result")] = False,
) -> None:
    """List the archive's segments; check each one's BLAKE3, count and sequences (exit 1 when
    one is altered or missing, or the manifest is not signed by the operator)."""
    from dsec_core import eventarchive

    name = _bucket(bucket)
    anchor = _anchor()
    store = s3_client()

    async def go() -> tuple[Any, Any]:
        manifest = await eventarchive.read_manifest(store, name, anchor)
        checked = None
        if check and manifest is not None:
            checked = await eventarchive.check_archive(store, name, anchor)
        return manifest, checked

    manifest, checked = guarded(go())
    out = eventarchive.summary(manifest)
    out["bucket"] = name
    out["verified"] = checked is not None
    out["signature_verified"] = manifest is not None
    if as_json:
        print_json(out)
        return
    if manifest is None:
        console.print(f"no event archive in bucket {safe_text(name)}")
        return
    table = Table("segment", "first seq", "last seq", "events", "bytes", "stored from", "to")
    for seg in manifest.segments:
        table.add_row(
            safe_text(seg.key.rsplit("/", 1)[-1]),
            str(seg.first_seq),
            str(seg.last_seq),
            str(seg.count),
            str(seg.size),
            seg.first_time[:19],
            seg.last_time[:19],
        )
    console.print(table)
    state = "every segment read back and verified" if checked else "not checked (--no-check)"
    signer = safe_text(str((manifest.cert or {}).get("subject")))
    console.print(
        f"{manifest.events} events, seq {manifest.first_seq}–{manifest.last_seq}: {state}; "
        f"manifest signed by {signer} (certified by the trust root)",
        highlight=False,
    )


@events_app.command("restore")
def restore_cmd(
    bucket: BucketOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result")] = False,
) -> None:
    """As the operator: publish the archive into an empty DSEC_EVENTS (created if missing), each
    message at the sequence it had, so the restored log verifies like the original.

    Run it with every service stopped, on a new NATS store; it refuses a stream that holds
    anything.
    """
    from dsec_core import eventarchive
    from dsec_core.bus import ensure_stream

    name = _bucket(bucket)
    anchor = _anchor()
    store = s3_client()

    def progress(seq: int) -> None:
        if not as_json:
            err_console.print(f"  restored up to seq {seq}", highlight=False)

    async def go() -> int:
        async with operator_bus() as js:
            await ensure_stream(js)
            return await eventarchive.restore(js, store, name, anchor, progress=progress)

    last = guarded(go())
    if as_json:
        print_json({"bucket": name, "restored_upto": last})
    else:
        console.print(
            f"restored the event log up to seq {last} from s3://{safe_text(name)}; "
            "check it with `dsec audit verify`"
        )


def register(app: typer.Typer) -> None:
    """The commands hang on ``dsec events`` (see :mod:`dsec_cli.commands.events`)."""
