"""``dsec snapshot``: create, list, inspect, diff, verify, restore, check code, remove, retain, GC.

``create SANDBOX_ID`` asks on the bus: the node agent that runs the sandbox snapshots its code
copy (the snapshot service, from the code bundle, when it runs nowhere). ``rm`` and ``gc`` ask
the snapshot service (``snapshot.delete_requested`` → ``snapshot.deleted``), which deletes only
the user's own tenant's snapshots. ``ls``, ``inspect``, ``diff``, ``verify``, ``restore`` and
``check-code`` read the store through the :mod:`dsec_snapstore` library.

Exit codes: 0 ok, 1 a check failed (verify, code mismatch, snapshot refused), 2 bad input (name,
directory, flag, unknown snapshot), 3 S3, Vault or NATS unreachable, 4 no answer in time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dsec_cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_TIMEOUT,
    EXIT_UNREACHABLE,
    client,
    confirm,
    console,
    err_console,
    fail,
    print_json,
    run,
    safe_lines,
    safe_text,
    spinner,
    submitter,
)
from dsec_cli.render import human_size

if TYPE_CHECKING:
    from dsec_core.envelope import Envelope
    from dsec_core.events import Payload
    from dsec_snapstore import SnapshotStore
    from dsec_snapstore.domain import Inspection, SnapshotDiff

snapshot_app = typer.Typer(
    help="Signed, content-addressed snapshots of sandbox code and state.", no_args_is_help=True
)

_DURATION = re.compile(r"^(\d+)([smhd])\Z")


def _duration(value: str, flag: str) -> timedelta:
    match = _DURATION.fullmatch(value)
    if match is None:
        fail(f"{flag} {value!r}: expected an age like 30s, 15m, 2h, 7d", EXIT_BAD_INPUT)
    seconds = {"s": 1, "m": 60, "h": 3600, "d": 86400}[match.group(2)]
    return timedelta(seconds=int(match.group(1)) * seconds)


@contextmanager
def snapshot_store() -> Iterator[SnapshotStore]:
    """Open the store; map library errors to the documented exit codes."""
    from dsec_snapstore import SnapshotStore
    from dsec_snapstore.errors import (
        InvalidInput,
        SnapshotError,
        SnapshotExists,
        SnapshotNotFound,
        StoreUnavailable,
        VerificationFailed,
    )

    try:
        with SnapshotStore.from_settings() as store:
            yield store
    except (InvalidInput, SnapshotNotFound, SnapshotExists) as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    except StoreUnavailable as exc:
        fail(str(exc), EXIT_UNREACHABLE)
    except VerificationFailed as exc:
        fail("\n".join([exc.subject + ":", *(f"  {p}" for p in exc.problems)]), EXIT_FAILED)
    except SnapshotError as exc:
        fail(str(exc), EXIT_FAILED)


ANSWERS = frozenset({"snapshot.taken", "snapshot.restored", "snapshot.failed"})


async def _request(
    payload: Payload, aggregate_id: str, answers: frozenset[str], timeout: float
) -> Envelope | None:
    """Publish a request signed by the user; return the first event of ``answers`` caused by
    it on the request's aggregate (``None`` when none comes within ``timeout``):
    :meth:`dsec_client.DSec.request`."""
    from dsec_client import Timeout

    async with client() as d:
        try:
            return (await d.request(payload, aggregate_id, answers, timeout)).envelope
        except Timeout:
            return None
    return None


def ask_snapshot_service(payload: Payload, sandbox_id: str, timeout: float) -> Envelope:
    """Publish ``payload`` on the sandbox's subjects and wait for the answer of the sandbox's
    node agent, or of the snapshot service when it runs nowhere (``snapshot.taken`` /
    ``restored`` / ``failed``); exit 4 when none comes in time."""
    from dsec_core.subjects import InvalidSubjectToken, subject_for

    try:
        subject_for(payload.TYPE, sandbox_id)
    except InvalidSubjectToken as exc:
        fail(f"sandbox id: {exc}", EXIT_BAD_INPUT)
    with spinner(f"{payload.TYPE} for {sandbox_id}: waiting for its node agent"):
        answer = run(_request(payload, sandbox_id, ANSWERS, timeout))
    if answer is None:
        fail(
            f"no answer to {payload.TYPE} for {sandbox_id} within {timeout:.0f} s: is the "
            "snapshot service running? (and, for a running sandbox, its node's agent; "
            "`dsec status`)",
            EXIT_TIMEOUT,
        )
    return answer


def _create_by_request(
    sandbox_id: str,
    name: str,
    *,
    include_code: bool,
    include_deps: bool,
    full_state: bool,
    timeout: float,
    as_json: bool,
) -> None:
    """``snapshot create SANDBOX_ID``: the sandbox's node agent takes it (the snapshot service
    when the sandbox runs nowhere)."""
    from dsec_core.events import SnapshotRequested

    request = SnapshotRequested(
        name=name,
        requested_by=submitter(),
        include_code=include_code,
        include_deps=include_deps,
        full_state=full_state,
    )
    answer = ask_snapshot_service(request, sandbox_id, timeout)
    p = answer.payload
    ok = answer.type == "snapshot.taken"
    if as_json:
        print_json({"sandbox_id": sandbox_id, "event": answer.type, "ok": ok, **p})
    elif ok:
        console.print(
            f"[green]snapshot {safe_text(name)}[/] of {sandbox_id}: {p['files']} files, "
            f"{human_size(p['bytes_total'])}; uploaded {human_size(p['bytes_uploaded'])}",
            highlight=False,
        )
        console.print(f"  manifest blake3:{p['manifest_digest']}", highlight=False)
    else:
        err_console.print(
            f"[bold red]error:[/] snapshot {safe_text(name)} of {sandbox_id} failed: "
            f"{safe_text(str(p['reason']))}",
            highlight=False,
            soft_wrap=True,
        )
    if not ok:
        raise typer.Exit(EXIT_FAILED)


@snapshot_app.command("create")
def create(
    sandbox_id: Annotated[str | None, typer.Argument(help="Sandbox to snapshot")] = None,
    name: Annotated[str, typer.Option("--name", "-n", help="Snapshot name (unique)")] = "",
    directory: Annotated[
        Path | None, typer.Option("--dir", help="Snapshot this directory instead of a sandbox")
    ] = None,
    exclude: Annotated[
        list[str], typer.Option("--exclude", "-x", help="Extra gitignore-style pattern (--dir)")
    ] = [],  # noqa: B006
    env: Annotated[
        list[str],
        typer.Option("--env", help="Record this variable, name + keyed hash only (--dir)"),
    ] = [],  # noqa: B006
    include_code: Annotated[
        bool, typer.Option("--include-code/--no-include-code", help="Record the code tree")
    ] = True,
    include_deps: Annotated[
        bool, typer.Option("--include-deps/--no-include-deps", help="Record the dependency lock")
    ] = True,
    full_state: Annotated[
        bool, typer.Option("--full-state", help="Process state too (not supported: refused)")
    ] = False,
    timeout: Annotated[
        float, typer.Option(help="Seconds to wait for the answer (SANDBOX_ID)")
    ] = 120.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON")] = False,
) -> None:
    """Take a snapshot of a sandbox (SANDBOX_ID, by its node agent) or of a directory.

    Exit 0 taken; 1 refused or failed (the reason is printed); 2 bad input; 3 unreachable;
    4 no answer in time (is the snapshot service running?).
    """
    if not name:
        fail("--name is required", EXIT_BAD_INPUT)
    if directory is None and sandbox_id is None:
        fail("give a SANDBOX_ID or --dir DIR", EXIT_BAD_INPUT)
    if directory is None:
        assert sandbox_id is not None
        if exclude or env:
            fail(
                "--exclude and --env apply to --dir only (a sandbox's come from its spec)",
                EXIT_BAD_INPUT,
            )
        _validate_name(name)
        _create_by_request(
            sandbox_id,
            name,
            include_code=include_code,
            include_deps=include_deps,
            full_state=full_state,
            timeout=timeout,
            as_json=as_json,
        )
        return
    _create_from_dir(directory, name, sandbox_id, exclude, env, as_json)


def _validate_name(name: str) -> None:
    from dsec_snapstore.domain import validate_name
    from dsec_snapstore.errors import InvalidInput

    try:
        validate_name(name)
    except InvalidInput as exc:
        fail(str(exc), EXIT_BAD_INPUT)


def _create_from_dir(
    directory: Path,
    name: str,
    sandbox_id: str | None,
    exclude: list[str],
    env: list[str],
    as_json: bool,
) -> None:
    from dsec_snapstore import SnapshotInputs

    missing = [v for v in env if v not in os.environ]
    if missing:
        fail(f"--env {missing[0]}: not set in this environment", EXIT_BAD_INPUT)
    tenant = _own_tenant()
    inputs = SnapshotInputs(
        code_dir=directory,
        exclude_patterns=tuple(exclude),
        sandbox_id=sandbox_id,
        env={v: os.environ[v] for v in env} or None,
        labels={"tenant": tenant} if tenant else {},
    )
    with snapshot_store() as store, spinner(f"snapshot {name}: hashing and uploading"):
        result = store.create(name, inputs)
    m = result.manifest
    if as_json:
        print_json(
            {
                "snapshot": m.name,
                "id": m.id,
                "manifest_digest": result.manifest_digest,
                "parent": m.parent,
                "files": result.files,
                "bytes_total": result.bytes_total,
                "bytes_uploaded": result.bytes_uploaded,
                "chunks_total": result.chunks_total,
                "chunks_uploaded": result.chunks_uploaded,
                "files_rehashed": result.files_rehashed,
                "duration_s": round(result.duration_s, 4),
                "gpu": m.gpu.models or None,
            }
        )
        return
    console.print(
        f"[green]snapshot {safe_text(m.name)}[/] {result.files} files, "
        f"{human_size(result.bytes_total)}; uploaded {result.chunks_uploaded}/"
        f"{result.chunks_total} chunks ({human_size(result.bytes_uploaded)}) "
        f"in {result.duration_s:.2f} s",
        highlight=False,
    )
    console.print(f"  manifest blake3:{result.manifest_digest}", highlight=False)
    gpu = ", ".join(m.gpu.models) if m.gpu.present else f"none ({m.gpu.reason})"
    console.print(f"  parent {safe_text(m.parent or '-')}; GPU {safe_text(gpu)}", highlight=False)


def _own_tenant() -> str | None:
    """The tenant of this machine's user identity, when it has one (a ``--dir`` snapshot
    records it: only that tenant may delete it; none recorded means ``default``)."""
    from dsec_core import identity
    from dsec_core.settings import Settings

    from dsec_cli.common import user_identity

    settings = Settings()
    paths = identity.TrustPaths(settings.home)
    if settings.credential is None and not paths.user_cert.exists():
        return None
    _, cert = user_identity(settings)
    return str(cert.tenant) if cert.tenant else None


@snapshot_app.command("ls")
def ls(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List snapshots, oldest first."""
    with snapshot_store() as store:
        rows = store.list_snapshots()
    if as_json:
        print_json([r.model_dump(mode="json") for r in rows])
        return
    if not rows:
        console.print("no snapshots")
    for r in rows:
        when = r.created_at.strftime("%Y-%m-%d %H:%M:%S")
        console.print(
            f"{safe_text(r.name):<32} {when}  {r.files:>6} files {human_size(r.bytes_total):>10}  "
            f"[dim]{safe_text(r.series)}[/]",
            highlight=False,
        )


def _inspection_json(i: Inspection) -> dict[str, Any]:
    import msgspec

    doc = asdict(i)
    doc["largest"] = msgspec.to_builtins(i.largest)
    return doc


@snapshot_app.command("inspect")
def inspect(
    name: str,
    depth: Annotated[int, typer.Option(help="Directory depth of the breakdown")] = 2,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """What takes space in a snapshot: by directory and kind, and what dominates."""
    from dsec_snapstore.domain import inspect_manifest

    with snapshot_store() as store:
        result = inspect_manifest(store.load(name), depth=depth)
    if as_json:
        print_json(_inspection_json(result))
        return
    console.print(
        f"[bold]{safe_text(name)}[/]: {result.files} files, {human_size(result.total_bytes)} "
        f"({human_size(result.unique_bytes)} unique)",
        highlight=False,
    )
    console.print(f"[yellow]{safe_text(result.dominant)}[/]", highlight=False)
    total = result.total_bytes or 1
    for title, shares in (("by directory", result.by_directory), ("by kind", result.by_kind)):
        console.print(f"[bold]{title}[/]")
        for s in shares[:15]:
            console.print(
                f"  {safe_text(s.key):<40} {human_size(s.bytes):>10} {100 * s.bytes / total:5.1f}%"
                f" {s.files:>6} files",
                highlight=False,
            )
    console.print("[bold]largest files[/]")
    for f in result.largest:
        console.print(f"  {safe_text(f.path):<50} {human_size(f.size):>10}", highlight=False)


def _diff_json(d: SnapshotDiff) -> dict[str, Any]:
    def change(c: Any) -> dict[str, Any]:
        return {"path": c.path, "what": c.what, "diff": c.diff, "note": c.note}

    return {
        "a": d.a,
        "b": d.b,
        "identical": d.empty,
        "files": {
            "added": [f.path for f in d.code.added],
            "removed": [f.path for f in d.code.removed],
            "changed": [change(c) for c in d.code.changed],
        },
        "deps": asdict(d.deps) | {"fingerprint": list(d.deps_fingerprint)},
        "env": asdict(d.env),
        "kernel": asdict(d.kernel),
        "gpu": list(d.gpu) if d.gpu else None,
    }


def _print_diff(d: SnapshotDiff) -> None:
    if d.empty:
        console.print(f"{safe_text(d.a)} and {safe_text(d.b)} record the same state")
        return
    for f in d.code.added:
        console.print(f"[green]+ {safe_text(f.path)}[/]", highlight=False)
    for f in d.code.removed:
        console.print(f"[red]- {safe_text(f.path)}[/]", highlight=False)
    for c in d.code.changed:
        console.print(f"[yellow]~ {safe_text(c.path)}[/] ({safe_text(c.what)})", highlight=False)
        if c.diff:
            console.print(
                safe_lines(c.diff.rstrip("\n"), markup=False), highlight=False, markup=False
            )
        elif c.note:
            console.print(f"  ({safe_text(c.note)})", highlight=False)
    for pkg, version in d.deps.added.items():
        console.print(f"[green]+ dep {safe_text(pkg)}=={safe_text(version)}[/]", highlight=False)
    for pkg, version in d.deps.removed.items():
        console.print(f"[red]- dep {safe_text(pkg)}=={safe_text(version)}[/]", highlight=False)
    for pkg, (old, new) in d.deps.changed.items():
        console.print(f"[yellow]~ dep {safe_text(pkg)} {old} -> {new}[/]", highlight=False)
    for label, names in (("+", d.env.added), ("-", d.env.removed), ("~", d.env.changed)):
        for n in names:
            console.print(f"{label} env {safe_text(n)}", highlight=False)
    if not d.env.comparable:
        console.print("(env values hashed under different keys: value changes not comparable)")
    for key, (old, new) in d.kernel.changed.items():
        console.print(
            f"~ kernel {safe_text(key)}: {safe_text(old)} -> {safe_text(new)}", highlight=False
        )
    for key in (*d.kernel.added, *d.kernel.removed):
        console.print(f"~ kernel {safe_text(key)} present on one side only", highlight=False)
    if d.gpu:
        old_gpu, new_gpu = ", ".join(d.gpu[0]) or "none", ", ".join(d.gpu[1]) or "none"
        console.print(f"~ GPU {safe_text(old_gpu)} -> {safe_text(new_gpu)}", highlight=False)


@snapshot_app.command("diff")
def diff(a: str, b: str, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """What changed from snapshot A to B: files (with line diffs), dependencies, env, kernel."""
    with snapshot_store() as store:
        result = store.diff(a, b)
    if as_json:
        print_json(_diff_json(result))
    else:
        _print_diff(result)


@snapshot_app.command("verify")
def verify(name: str, as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """Check the signature and every stored object's hash; exit 1 naming what is wrong."""
    with snapshot_store() as store:
        report = store.verify(name)
    if as_json:
        print_json(asdict(report) | {"ok": report.ok})
    elif report.ok:
        console.print(
            f"[green]ok[/] {safe_text(name)}: signature valid, "
            f"{report.objects_checked} objects intact",
            highlight=False,
        )
    else:
        console.print(f"[bold red]{safe_text(name)} failed verification:[/]", highlight=False)
        for problem in report.problems:
            console.print(f"  {safe_text(problem)}", highlight=False)
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)


@snapshot_app.command("restore")
def restore(
    name: str,
    dest: Path,
    sync: Annotated[
        bool, typer.Option("--sync", help="Roll an existing directory back in place")
    ] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Materialize a snapshot's code at DEST (every byte hash-checked)."""
    with snapshot_store() as store, spinner(f"restoring {name}: fetching and checking"):
        result = store.restore(name, dest, sync=sync)
    if as_json:
        print_json(
            {
                "snapshot": name,
                "manifest_digest": result.manifest_digest,
                "dest": str(result.dest),
                "files_written": result.files_written,
                "files_removed": result.files_removed,
                "bytes_written": result.bytes_written,
                "duration_s": round(result.duration_s, 4),
            }
        )
        return
    console.print(
        f"restored {safe_text(name)} to {safe_text(result.dest)}: "
        f"{result.files_written} files written, {result.files_removed} removed in "
        f"{result.duration_s:.2f} s",
        highlight=False,
    )


@snapshot_app.command("check-code")
def check_code(
    name: str, directory: Path, as_json: Annotated[bool, typer.Option("--json")] = False
) -> None:
    """Compare DIRECTORY with a snapshot's code; exit 1 listing each file and differing lines."""
    with snapshot_store() as store:
        check = store.verify_code_dir(name, directory)
    if as_json:
        print_json({"snapshot": name, "directory": str(directory), "ok": check.ok,
                    "mismatches": check.describe()})  # fmt: skip
    elif check.ok:
        console.print(f"[green]ok[/] {safe_text(str(directory))} matches {safe_text(name)}")
    else:
        console.print(f"[bold red]{safe_text(str(directory))} differs from {safe_text(name)}:[/]")
        console.print(
            safe_lines("\n".join(check.describe()), markup=False), highlight=False, markup=False
        )
    if not check.ok:
        raise typer.Exit(EXIT_FAILED)


def ask_delete(names: list[str], *, collect: bool, grace_s: float, timeout: float) -> Envelope:
    """``snapshot.delete_requested`` (signed by the user) and the answer; exit 4 on none."""
    from dsec_core.events import SnapshotDeleteRequested

    request = SnapshotDeleteRequested(
        names=names, gc=collect, gc_grace_s=grace_s, requested_by=submitter()
    )
    what = f"{len(names)} snapshot(s)" if names else "unreferenced chunks"
    from dsec_core.ids import new_event_id

    request_id = "del-" + new_event_id().replace("-", "")  # the request's own aggregate
    with spinner(f"asking the snapshot service to delete {what}"):
        answer = run(_request(request, request_id, frozenset({"snapshot.deleted"}), timeout))
    if answer is None:
        fail(
            f"no snapshot.deleted within {timeout:.0f} s: is the snapshot service running? "
            "(`dsec status`)",
            EXIT_TIMEOUT,
        )
    return answer


def delete_in_batches(
    names: list[str], *, collect: bool, grace_s: float, timeout: float
) -> dict[str, Any]:
    """Delete ``names`` a request of at most ``MAX_DELETE_NAMES`` at a time (the service
    refuses more in one), collecting (``collect``) with the last; the answers' payloads as one
    (``names``, ``missing`` and ``failed`` of them all, the rest from the last)."""
    from dsec_core.events import MAX_DELETE_NAMES

    step = MAX_DELETE_NAMES
    batches = [names[i : i + step] for i in range(0, len(names), step)] or [[]]
    merged: dict[str, Any] = {"names": [], "missing": [], "failed": []}
    for n, batch in enumerate(batches):
        last = n == len(batches) - 1
        answer = ask_delete(batch, collect=collect and last, grace_s=grace_s, timeout=timeout)
        payload = dict(answer.payload)
        for key in ("names", "missing", "failed"):
            merged[key] += list(payload.pop(key, None) or ())
        if last:
            merged.update(payload)
    return merged


@snapshot_app.command("rm")
def rm(
    names: Annotated[list[str], typer.Argument(help="Snapshots to delete")],
    collect: Annotated[
        bool, typer.Option("--gc", help="Also free the chunks no snapshot refers to any more")
    ] = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the snapshot service")] = 60.0,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Delete snapshots of your tenant (their chunks are freed by `gc`, or `--gc`).

    Exit 0 all deleted; 1 `--gc` asked and the service did not collect (see `gc`); 2 bad
    name, or some did not exist (or are another tenant's: they are reported like missing
    ones; this wins over 1 and 3); 3 unreachable, or the service gave up on some (its object
    store failing: `failed` in `--json`); 4 no answer in time.
    """
    for name in names:
        _validate_name(name)
    confirm(
        f"delete snapshot(s) {', '.join(names)}" + (" and free their chunks" if collect else ""),
        yes,
    )
    p = delete_in_batches(names, collect=collect, grace_s=3600.0, timeout=timeout)
    if as_json:
        print_json({"event": "snapshot.deleted", **p})
    else:
        for name in p["names"]:
            console.print(f"deleted {safe_text(name)}", highlight=False)
        for name in p["missing"]:
            err_console.print(
                f"[bold red]error:[/] no snapshot named {safe_text(name)} (of your tenant)",
                highlight=False,
            )
        for name in p.get("failed") or ():
            err_console.print(
                f"[bold red]error:[/] {safe_text(name)} was not deleted: {_GAVE_UP}. Try again.",
                highlight=False,
            )
        if collect and p.get("gc_grace_s") is not None:
            console.print(
                f"freed {p['chunks_removed']} objects ({human_size(p['bytes_freed'])})",
                highlight=False,
            )
    not_run = _gc_not_run(p) if collect else None
    if not_run is not None and not as_json:
        err_console.print(f"[bold red]error:[/] {not_run[1]}", highlight=False)
    if p["missing"]:
        raise typer.Exit(EXIT_BAD_INPUT)
    if p.get("failed"):
        raise typer.Exit(EXIT_UNREACHABLE)
    if not_run is not None:
        raise typer.Exit(not_run[0])


_GAVE_UP = (
    "the snapshot service gave up after its retries (the object store failing; its log says why)"
)
_GC_SKIPPED = {
    "busy": (
        EXIT_FAILED,
        "the snapshot service did not collect: the store was busy (snapshots being taken, or "
        "a GC elsewhere, held it longer than the service's GC waits: "
        "DSEC_SNAPSHOT_GC_WAIT_S). Try again later.",
    ),
    "unreadable": (
        EXIT_FAILED,
        "the snapshot service did not collect: a snapshot's manifest cannot be read, or a "
        "chunk a snapshot needs does not check, so nothing was deleted; the service's log "
        "names it.",
    ),
    "gave_up": (EXIT_UNREACHABLE, f"the snapshot service did not collect: {_GAVE_UP}."),
}


def _gc_not_run(p: dict[str, Any]) -> tuple[int, str] | None:
    """A collection asked for that did not run (``snapshot.deleted`` without ``gc_grace_s``):
    the exit code and what to tell the user (``gc_skipped`` says why, since 1.2)."""
    if p.get("gc_grace_s") is not None:
        return None
    return _GC_SKIPPED.get(
        str(p.get("gc_skipped")),
        (
            EXIT_FAILED,
            "the snapshot service did not say it collected (a service older than this CLI?); "
            "its log says why.",
        ),
    )


@snapshot_app.command("retain")
def retain(
    keep_last: Annotated[int, typer.Option(help="Keep the newest N per series")] = 10,
    keep_within: Annotated[str | None, typer.Option(help="Keep all younger than (7d)")] = None,
    keep_daily: Annotated[int, typer.Option(help="Keep the newest of each of N days")] = 0,
    series: Annotated[str | None, typer.Option(help="Only this series")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Apply a retention policy: delete the snapshots it does not keep (of your tenant).

    Exit 0 done; 2 bad input; 3 unreachable, or the snapshot service gave up on some
    (`failed` in `--json`); 4 no answer in time.
    """
    from dsec_snapstore.domain import RetentionPolicy
    from dsec_snapstore.errors import InvalidInput

    within = _duration(keep_within, "--keep-within") if keep_within else None
    failed: list[str] = []
    try:  # (before the store is opened: a bad policy is bad input whether S3 is up or not)
        policy = RetentionPolicy(keep_last=keep_last, keep_within=within, keep_daily=keep_daily)
    except InvalidInput as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    with snapshot_store() as store:  # decided here (read-only), deleted by the snapshot service
        expired = store.apply_retention(policy, series=series, dry_run=True)
    if expired and not dry_run:
        confirm(f"delete {len(expired)} snapshot(s): {', '.join(expired)}", yes)
        done = delete_in_batches(expired, collect=False, grace_s=3600.0, timeout=60.0)
        expired = list(done["names"])
        failed = list(done.get("failed") or ())
        if failed and not as_json:
            err_console.print(
                f"[bold red]error:[/] not deleted: {safe_text(', '.join(failed))}: {_GAVE_UP}. "
                "Try again.",
                highlight=False,
            )
    if as_json:
        print_json({"deleted": expired, "failed": failed, "dry_run": dry_run})
    else:
        verb = "would delete" if dry_run else "deleted"
        console.print(
            f"{verb} {len(expired)} snapshots: {safe_text(', '.join(expired) or '-')}",
            highlight=False,
        )
    if failed:
        raise typer.Exit(EXIT_UNREACHABLE)


@snapshot_app.command("gc")
def gc(
    grace: Annotated[str, typer.Option(help="Keep unreferenced objects younger than")] = "1h",
    dry_run: Annotated[bool, typer.Option("--dry-run")] = False,
    timeout: Annotated[
        float, typer.Option(help="Seconds to wait for the snapshot service")
    ] = 300.0,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation")] = False,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Delete chunks and audit blobs that no snapshot references (the snapshot service does;
    `--dry-run` only reads the store here).

    The service keeps at least `DSEC_SNAPSHOT_GC_MIN_GRACE_S` (1 h by default): a shorter
    `--grace` is raised to it, and the answer says so (`gc_grace_s` in `--json`).

    Exit 0 collected; 1 the service did not collect (snapshots being taken held the store
    longer than `DSEC_SNAPSHOT_GC_WAIT_S`, or a manifest is unreadable: `gc_skipped` in
    `--json` says which); 2 bad input; 3 unreachable (or the service's object store failed
    past its retries); 4 no answer in time.
    """
    period = _duration(grace, "--grace")
    if not dry_run:
        confirm(f"delete the snapshot objects no snapshot refers to, older than {grace}", yes)
        answer = ask_delete([], collect=True, grace_s=period.total_seconds(), timeout=timeout)
        p = answer.payload
        applied = p.get("gc_grace_s")
        not_run = _gc_not_run(p)
        if as_json:
            print_json({"event": answer.type, **p})
        elif not_run is not None:
            err_console.print(f"[bold red]error:[/] {not_run[1]}", highlight=False)
        if not_run is not None:
            raise typer.Exit(not_run[0])
        if as_json:
            return
        console.print(
            f"freed {p['chunks_removed']} objects ({human_size(p['bytes_freed'])})",
            highlight=False,
        )
        if applied is not None and applied > period.total_seconds():
            _grace_raised(grace, applied)
        return
    from dsec_core.settings import Settings

    asked = period
    least = Settings().snapshot_gc_min_grace_s  # what the service applies, if set alike
    if least > asked.total_seconds():
        period = timedelta(seconds=least)
    with snapshot_store() as store:
        report = store.gc(grace=period, dry_run=True)
    if as_json:
        print_json(
            asdict(report) | {"deleted": len(report.deleted), "gc_grace_s": period.total_seconds()}
        )
        return
    console.print(
        f"{report.objects_stored} objects, {report.objects_referenced} referenced; would free "
        f"{len(report.deleted)} ({human_size(report.bytes_freed)})",
        highlight=False,
    )
    if period > asked:
        _grace_raised(grace, period.total_seconds())


def _grace_raised(asked: str, applied_s: float) -> None:
    err_console.print(
        f"[yellow]note:[/] kept everything younger than {_age(applied_s)}, not {safe_text(asked)}: "
        "the snapshot service's least grace (DSEC_SNAPSHOT_GC_MIN_GRACE_S) protects packs a "
        "snapshot being taken has uploaded but not yet named",
        highlight=False,
    )


def _age(seconds: float) -> str:
    """``seconds`` as the largest whole unit ``--grace`` takes (3600 -> ``1h``)."""
    whole = int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if whole >= size and whole % size == 0:
            return f"{whole // size}{unit}"
    return f"{whole}s"


def register(app: typer.Typer) -> None:
    """Add ``dsec snapshot``."""
    app.add_typer(snapshot_app, name="snapshot")
