"""``dsec audit``: prove the signed event log is intact; replay it filtered."""

from __future__ import annotations

from typing import Annotated, Any

import typer
from dsec_core.audit_report import VerifyReport
from dsec_core.audit_worker import BatchVerifier, VerifierFailed
from dsec_core.subjects import ALL_EVENTS, aggregate_filter
from rich.table import Table

from dsec_cli.common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    bus,
    check_event_types,
    confirm,
    console,
    err_console,
    fail,
    operator_identity,
    operator_root,
    parse_since,
    print_json,
    run,
    safe_text,
)
from dsec_cli.render import decode_or_warn, event_json, event_line

audit_app = typer.Typer(help="Verify and replay the signed audit trail.", no_args_is_help=True)


def trust_anchor() -> bytes:
    """The operator root public key verification trusts, or exit 2 saying where to set it."""
    from dsec_core import trustroot  # (not identity: verify's reader never loads the models)
    from dsec_core.settings import Settings

    settings = Settings()
    try:
        anchor = trustroot.read_anchor(trustroot.TrustPaths(settings.home), settings.trust_root)
    except trustroot.CertificateError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    if anchor is None:
        fail(
            "no trust root: set DSEC_TRUST_ROOT to the operator's root public key (hex) "
            "or run on the machine of `dsec up`",
            EXIT_BAD_INPUT,
        )
    return anchor


async def _verify(verifier: BatchVerifier, archive: Any = None) -> VerifyReport:
    """Replay the stream (``archive``: ``(store, bucket, manifest)`` — the archived segments
    first, then the live stream after them) into ``verifier``."""
    from dsec_core.subjects import STREAM

    try:
        async with bus() as (_, js):
            state = (await js.stream_info(STREAM)).state
            return await _feed(js, verifier, state.first_seq, archive, state.last_seq)
    finally:
        verifier.close()  # (here, while its pipe's event loop runs; again after: a no-op)


async def _feed(
    js: Any, verifier: BatchVerifier, first: int, archive: Any, last: int = 0
) -> VerifyReport:
    """Feed the archive's records (if any), then the live stream from after them, through
    ``last`` (the stream's last sequence when verify began): a replay that ends before it
    read that far proves nothing about the rest and is reported so, never as intact."""
    from dsec_core.audit_report import Finding
    from dsec_core.bus import replay_batches

    start = 1
    if archive is not None:
        # (here, not above: the archive's reader, with the object store's client, is a fifth
        # of a second of imports that verifying the live stream alone does not need)
        from dsec_core.eventarchive import ArchiveCorrupt, archived_records

        store, bucket, manifest = archive
        batch: list[tuple[int, bytes]] = []
        try:
            async for record in archived_records(store, bucket, manifest):
                batch.append((record.seq, record.data))
                if len(batch) >= 2048:
                    if await verifier.feed(batch):
                        return await verifier.finish()
                    batch = []
            if batch and await verifier.feed(batch):
                return await verifier.finish()
        except ArchiveCorrupt as exc:
            # what came before the corrupt segment counts: a finding there comes first
            found = bool(batch) and await verifier.feed(batch)
            report: VerifyReport = await verifier.finish()
            if not found:
                report.finding = Finding(exc.first_seq, None, None, None, str(exc))
            return report
        start = (manifest.last_seq or 0) + 1
        problem = await _tail_problem(js, manifest)
        if problem is not None:
            report = await verifier.finish()
            report.finding = Finding(start - 1, None, None, None, problem)
            return report
    elif first > 1:
        err_console.print(
            f"[yellow]note:[/] the stream starts at seq {first} (earlier events were "
            "discarded by its limits): keys registered before are unknown here; "
            "verify with --archive",
            highlight=False,
        )
    async for msgs in replay_batches(js, start_seq=start):
        if await verifier.feed(msgs):
            break
    report = await verifier.finish()
    read_to = report.last_seq or 0
    if report.finding is None and last >= start and read_to < last:
        report.finding = Finding(
            read_to + 1,
            None,
            None,
            None,
            f"incomplete: the stream held events up to seq {last} when verify began, and the "
            f"replay ended after seq {read_to} (messages lost on the way to this reader); "
            "nothing after it was checked: run verify again",
        )
    return report


async def _tail_problem(js: Any, manifest: Any) -> str | None:
    """Where the live stream still holds the archive's last sequence, its message must be the
    one the signed manifest records (BLAKE3); ``None`` when it is, or when the stream no
    longer holds it (then the verifier's sequence check joins archive and stream)."""
    from dsec_core.eventarchive import message_hash
    from dsec_core.subjects import STREAM
    from nats.js.errors import NotFoundError

    last = manifest.last_seq
    if last is None:
        return None
    state = (await js.stream_info(STREAM)).state
    if not state.messages or not state.first_seq <= last <= state.last_seq:
        return None
    try:
        stored = await js.get_msg(STREAM, last)
    except NotFoundError:  # discarded by a per-subject limit
        return None
    if message_hash(bytes(stored.data or b"")) != manifest.last_hash:
        return (
            f"the archive's last message (seq {last}) is not the live stream's: the signed "
            "manifest records another BLAKE3"
        )
    return None


def _archive_source(bucket: str | None, anchor: bytes) -> Any:
    """``(store, bucket, manifest)`` of the event archive (its signature verified against the
    trust root), or exit 2 when there is none, 1 when the manifest is not the operator's."""
    from dsec_core.eventarchive import read_manifest
    from dsec_core.settings import Settings

    from dsec_cli.commands._events_archive import guarded
    from dsec_cli.common import s3_client

    name = bucket or Settings().s3_bucket
    store = s3_client()
    manifest = guarded(read_manifest(store, name, anchor))
    if manifest is None:
        fail(
            f"no event archive in bucket {name!r} (`dsec events archive` writes one)",
            EXIT_BAD_INPUT,
        )
    return store, name, manifest


def _report_dict(report: VerifyReport) -> dict[str, Any]:
    finding = report.finding
    return {
        "ok": report.ok,
        "events": report.events,
        "producers": sorted(report.producers),
        "chains": report.chains,
        "first_seq": report.first_seq,
        "last_seq": report.last_seq,
        "first_bad": None
        if finding is None
        else {
            "seq": finding.stream_seq,
            "id": finding.event_id,
            "type": finding.event_type,
            "producer": finding.producer,
            "reason": finding.reason,
        },
        "injected": [
            {
                "seq": i.stream_seq,
                "id": i.event_id,
                "type": i.event_type,
                "producer": i.producer,
                "reason": i.reason,
                "answered_by": i.answered_by,
            }
            for i in report.injected
        ],
    }


def _print_injected(report: VerifyReport) -> None:
    table = Table("seq", "type", "claimed producer", "why it is foreign", "refused by (seq)")
    for item in report.injected:
        table.add_row(
            str(item.stream_seq),
            safe_text(item.event_type or "?"),
            safe_text(item.producer or "?"),
            safe_text(item.reason),
            ", ".join(map(str, item.answered_by)) or "-",
        )
    console.print(table)


@audit_app.command("verify")
def verify(
    archive: Annotated[
        bool,
        typer.Option(
            "--archive",
            help="Verify the archived segments (`dsec events archive`) first, then the live "
            "stream after them, as one log",
        ),
    ] = False,
    bucket: Annotated[
        str | None, typer.Option(help="Bucket of the archive (default: DSEC_S3_BUCKET)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result")] = False,
) -> None:
    """Replay the whole stream and tell tampering from injected-and-ignored messages.

    Tampering (exit 1, naming the first bad event): a sequence gap, a broken chain of a
    certified producer, or an authorized producer that acted on an injected or replayed
    message. Foreign messages (no certified key, bad signature, unauthorized producer, copies
    of old events) nobody acted on are listed with the refusals that answered them (exit 0).
    Trust comes from the operator root key (DSEC_TRUST_ROOT or the stack's trust/root.pub).
    With --archive, the manifest must carry the operator's signature (certified by the trust
    root; unsigned or wrongly signed is tampering, exit 1), an archived segment that is not the
    one the manifest lists is tampering, and where the live stream still holds the archive's
    last sequence it must be the message the manifest records.
    """
    from dsec_core.audit_report import c_path_wanted
    from dsec_core.audit_worker import open_verifier

    try:
        c_path_wanted()  # (a bad DSEC_AUDIT_PURE_PYTHON: said here, not by the forked verifier)
    except ValueError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    anchor = trust_anchor()
    # The verifier is forked first, on a core of its own: it loads the signature checks while
    # this process connects and reads the log.
    verifier = open_verifier(anchor)
    try:
        source = _archive_source(bucket, anchor) if archive else None
        report = run(_verify(verifier, source))
    except VerifierFailed as exc:
        fail(f"audit verify could not finish: {exc}", EXIT_FAILED)
    finally:
        verifier.close()
    result = _report_dict(report)
    if source is not None:
        result["archived_upto"] = source[2].last_seq
    if as_json:
        print_json(result)
    elif report.ok:
        console.print(
            f"[green]audit trail intact[/]: {report.events} authentic events (seq "
            f"{report.first_seq}–{report.last_seq}), {len(report.producers)} producers, "
            f"{report.chains} chains; every certificate, signature, chain link and sequence "
            "verified"
            + (f" (seq ≤ {source[2].last_seq} from the archive)" if source is not None else "")
        )
        if report.injected:
            console.print(
                f"[yellow]{len(report.injected)} foreign message(s) injected and ignored[/] "
                "(no service acted on them):"
            )
            _print_injected(report)
    else:
        bad = result["first_bad"]
        console.print(
            f"[bold red]audit trail BROKEN[/] at stream seq {bad['seq']}"
            f" (event {safe_text(bad['id'] or '?')}, type {safe_text(bad['type'] or '?')},"
            f" producer {safe_text(bad['producer'] or '?')}): {safe_text(bad['reason'])}",
            highlight=False,
        )
        if source is None and bad["reason"].startswith("gap:"):
            err_console.print(
                "[yellow]note:[/] if retention limits discard events from the stream (`dsec "
                "nats stream --json` shows them), verify with --archive",
                highlight=False,
            )
    if not report.ok:
        raise typer.Exit(EXIT_FAILED)


async def _replay(sandbox: str | None, types: list[str], since: str | None, as_json: bool) -> int:
    from dsec_core.bus import replay
    from dsec_core.subjects import InvalidSubjectToken

    since_t = parse_since(since) if since else None
    try:
        filt = aggregate_filter("sandbox", sandbox) if sandbox else ALL_EVENTS
    except InvalidSubjectToken as exc:
        fail(f"--sandbox: {exc}", EXIT_BAD_INPUT)
    shown = 0
    async with bus() as (_, js):
        async for seq, data in replay(js, filter_subject=filt):
            env = decode_or_warn(seq, data)
            if env is None or (types and env.type not in types) or (since_t and env.time < since_t):
                continue
            shown += 1
            if as_json:
                print_json(event_json(seq, env))
            else:
                console.print(event_line(seq, env), highlight=False, soft_wrap=True)
    return shown


@audit_app.command("replay")
def replay_cmd(
    sandbox: Annotated[str | None, typer.Option(help="Only events of this sandbox")] = None,
    type_: Annotated[list[str], typer.Option("--type", "-t", help="Only this event type")] = [],  # noqa: B006
    since: Annotated[str | None, typer.Option(help="ISO time or age (30s, 15m, 2h, 1d)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line")] = False,
) -> None:
    """Replay recorded events, filtered by sandbox, type and time."""
    check_event_types(type_)
    shown = run(_replay(sandbox, type_, since, as_json))
    if not as_json:
        console.print(f"[dim]{shown} events[/]")


keys_app = typer.Typer(
    help="Producer keys: list them, rotate a service's key, revoke a key.",
    invoke_without_command=True,
)


@keys_app.callback()
def keys(
    ctx: typer.Context,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result")] = False,
) -> None:
    """List the producer keys registered in the log, with their certificates and revocations."""
    if ctx.invoked_subcommand is not None:
        return

    async def collect() -> list[dict[str, Any]]:
        from dsec_core.bus import replay

        found: dict[str, dict[str, Any]] = {}
        revoked: dict[str, int] = {}
        async with bus() as (_, js):
            async for seq, data in replay(js, filter_subject="dsec.producer.>"):
                env = decode_or_warn(seq, data)
                if env is None:
                    continue
                if env.type == "audit.key_revoked":
                    revoked.setdefault(str(env.payload.get("key_id")), seq)
                    continue
                if env.type != "audit.key_registered":
                    continue
                cert = env.payload.get("certificate") or {}
                found.setdefault(
                    env.payload["key_id"],
                    {
                        "producer": env.payload["producer"],
                        "key_id": env.payload["key_id"],
                        "role": cert.get("role"),
                        "tenant": cert.get("tenant"),
                        "node_id": cert.get("node_id"),
                        "first_seq": seq,
                        # a rotation: the previous key signed this one
                        "endorsed": bool(env.payload.get("endorsement")),
                    },
                )
        for key_id, row in found.items():
            row["revoked_at_seq"] = revoked.get(key_id)
        return list(found.values())

    rows = run(collect())
    if as_json:
        print_json(rows)
        return
    table = Table(
        "producer", "key id", "role", "tenant / node", "registered at seq", "rotated in", "revoked"
    )
    for row in rows:
        where = row["tenant"] or row["node_id"] or "-"
        table.add_row(
            safe_text(row["producer"]),
            safe_text(row["key_id"]),
            safe_text(row["role"] or "[uncertified]"),
            safe_text(where),
            str(row["first_seq"]),
            "yes" if row["endorsed"] else "-",
            f"at seq {row['revoked_at_seq']}" if row["revoked_at_seq"] else "-",
        )
    console.print(table)


async def _publish_as_operator(payload: Any, aggregate_id: str) -> int:
    from dsec_core.bus import EventPublisher
    from dsec_core.signing import Signer

    key, cert = operator_identity()
    async with bus() as (_, js):
        publisher = EventPublisher(js, Signer(cert.subject, key), certificate=cert)
        await publisher.register_key()
        published = await publisher.publish(payload, aggregate_id=aggregate_id)
    return published.stream_seq


@keys_app.command("revoke")
def revoke(
    key_id: Annotated[str, typer.Argument(help="The key id to revoke (see `dsec audit keys`)")],
    reason: Annotated[str, typer.Option(help="Why, recorded in the log")] = "",
    producer: Annotated[str, typer.Option(help="The producer it was certified for")] = "",
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation")] = False,
) -> None:
    """Revoke a key (operator only): every consumer refuses what it signs from now on."""
    from dsec_core.events import KeyRevoked
    from dsec_core.subjects import InvalidSubjectToken

    confirm(f"revoke key {key_id} for good (what it signs is refused from now on)", yes)
    try:
        seq = run(
            _publish_as_operator(
                KeyRevoked(key_id=key_id, producer=producer, reason=reason), key_id
            )
        )
    except InvalidSubjectToken:
        fail(f"{key_id!r} is not a key id (16 hex characters)", EXIT_BAD_INPUT)
    if as_json:
        print_json({"revoked": key_id, "stream_seq": seq})
    else:
        console.print(f"revoked key {safe_text(key_id)} (audit.key_revoked at seq {seq})")


@keys_app.command("rotate")
def rotate(
    service: Annotated[str, typer.Argument(help="policy, builder, snapshot, scheduler, nodeagent")],
    revoke_old: Annotated[bool, typer.Option(help="Also revoke the previous key")] = True,
    grace: Annotated[
        float,
        typer.Option(
            min=0,
            help="Seconds to wait before revoking the old key, so running replicas switch first "
            "(they re-read their key every DSEC_KEY_CHECK_S, default 5, or on SIGHUP)",
        ),
    ] = 10.0,
    node: Annotated[
        str | None,
        typer.Option(help="Node agents: the node whose agent's key (default DSEC_NODE_ID)"),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable result")] = False,
) -> None:
    """Give a service a new certified key (operator only), where its replicas read it.

    The new key's certificate is issued by the operator root and registered at once, endorsed
    by the old key (`audit.key_registered` with the old key's signature of the new one); it is
    stored where the service reads its key (DSEC_KEY_SOURCE: HOME/keys, or Vault). Running
    replicas switch to it by themselves; after --grace seconds the old key is revoked (unless
    --no-revoke-old), so events it signs from then on are refused. Events it signed before stay
    valid.
    """
    import time

    from dsec_core import identity, keysource
    from dsec_core.events import KeyRevoked
    from dsec_core.settings import Settings
    from nacl.signing import SigningKey

    if service not in identity.SERVICE_ROLES:
        fail(f"{service!r} is not a service; valid: {', '.join(identity.SERVICE_ROLES)}", 2)
    settings = Settings(node_id=node) if node else Settings()
    root = operator_root()
    try:
        old = keysource.load_service_key(settings, service)
    except keysource.KeySourceError as exc:
        fail(str(exc), EXIT_BAD_INPUT)
    key = SigningKey.generate()
    old_cert = old.cert
    cert = identity.issue(
        root,
        bytes(key.verify_key),
        subject=old_cert.subject,
        role=old_cert.role,
        tenant=old_cert.tenant,
        node_id=old_cert.node_id,
    )
    endorsement = old.key.sign(bytes(key.verify_key)).signature.hex()
    registered = run(_register_rotated(key, cert, endorsement))
    try:
        where = keysource.store_service_key(settings, service, key, cert)
    except keysource.KeySourceError as exc:
        fail(f"the new key {cert.key_id} is registered but not stored: {exc}", EXIT_FAILED)
    if revoke_old:
        if grace > 0 and not as_json:
            console.print(f"waiting {grace:g}s for running replicas to switch keys…")
        time.sleep(grace)
        run(
            _publish_as_operator(
                KeyRevoked(key_id=old.key_id, producer=old_cert.subject, reason="rotated"),
                old.key_id,
            )
        )
    result = {
        "service": service,
        "new_key_id": cert.key_id,
        "old_key_id": old.key_id,
        "registered_at_seq": registered,
        "stored": where,
        "old_revoked": revoke_old,
    }
    if as_json:
        print_json(result)
    else:
        console.print(
            f"{service}: new key {cert.key_id} stored in {safe_text(where)} (old {old.key_id}"
            f"{' revoked' if revoke_old else ' still valid'}); running replicas switch within "
            "DSEC_KEY_CHECK_S, or at once on SIGHUP",
            highlight=False,
        )


async def _register_rotated(key: Any, cert: Any, endorsement: str) -> int:
    """Register the new key in the log as its producer, endorsed by the old key."""
    from dsec_core.bus import EventPublisher
    from dsec_core.signing import Signer

    async with bus() as (_, js):
        publisher = EventPublisher(js, Signer(cert.subject, key), certificate=cert)
        published = await publisher.register_key(endorsement=endorsement)
    return published.stream_seq


audit_app.add_typer(keys_app, name="keys")


def register(app: typer.Typer) -> None:
    """Add ``dsec audit``."""
    app.add_typer(audit_app, name="audit")
