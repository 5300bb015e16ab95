"""Bus handlers of the snapshot service.

``snapshot.requested`` → the sandbox's code, environment, env vars and audit segment, gathered
from the event log → :meth:`SnapshotStore.create` → ``snapshot.taken``;
``snapshot.restore_requested`` → :meth:`SnapshotStore.restore` (``sync``) into the running
sandbox's code copy → ``snapshot.restored``.

A deterministic refusal (unknown sandbox or snapshot, a sandbox that is not running on this
node, a taken name) is answered at once with ``snapshot.failed``; a transient error (S3, Vault)
raises, so the runtime retries it (its last attempt also ends in ``snapshot.failed``, see
:mod:`dsec_snapshot.app`). The store's calls block: they run in worker threads.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Literal

from dsec_core import events
from dsec_core.bus import replay
from dsec_core.codebundle import MAX_SIZE_LIMIT, BundleError, extract_bundle
from dsec_core.envelope import Envelope, MalformedEnvelope, decode
from dsec_core.objectstore import BundleAltered, ObjectMissing, get_bundle
from dsec_core.settings import Settings
from dsec_core.subjects import aggregate_filter
from dsec_core.trust import Gate, unpack_fields
from nats.js import JetStreamContext

from dsec_snapshot import sandboxes
from dsec_snapshot.adapters.gpu import probe_gpus
from dsec_snapshot.domain import GpuCheck, PeriodicPolicy, check_gpu
from dsec_snapshot.errors import (
    InvalidInput,
    SnapshotExists,
    SnapshotNotFound,
    VerificationFailed,
)
from dsec_snapshot.results import CreateResult, RestoreResult, SnapshotInputs
from dsec_snapshot.sandboxes import SandboxFacts
from dsec_snapshot.store import SnapshotStore

log = logging.getLogger(__name__)

CodeSource = Path | bytes | None
"""The running sandbox's code copy, its bundle archive, or no code at all."""


def code_label(code: CodeSource) -> str:
    """Which code a snapshot recorded: the running sandbox's copy, its bundle, or none."""
    if isinstance(code, Path):
        return "running"
    return "bundle" if code is not None else "none"


class Refused(Exception):
    """A deterministic reason a request cannot be served: becomes ``snapshot.failed``."""


def failed(
    snapshot: str, operation: Literal["create", "restore"], reason: str
) -> events.SnapshotFailed:
    """The ``snapshot.failed`` answer to a request."""
    return events.SnapshotFailed(snapshot=snapshot, operation=operation, reason=reason[:2000])


class SnapshotHandlers:
    """Snapshots and rollbacks of the sandboxes in the log, with this node's store."""

    def __init__(
        self,
        settings: Settings,
        js: Callable[[], JetStreamContext],
        gate: Callable[[], Gate],
    ) -> None:
        self.settings = settings
        self.js = js
        self.gate = gate
        self.sandboxes_root = settings.home.resolve() / "sandboxes"
        self._store: SnapshotStore | None = None
        # One snapshot at a time: a directory's stat cache is one file that concurrent creates
        # of the same tree (a request during a periodic snapshot) would both rewrite.
        self._create_lock = threading.Lock()

    @property
    def store(self) -> SnapshotStore:
        """The snapshot store (opened by :meth:`start`)."""
        if self._store is None:
            raise RuntimeError("the snapshot handlers were not started")
        return self._store

    async def start(self) -> None:
        """Open the store (S3 + Vault from the settings)."""
        self._store = await asyncio.to_thread(SnapshotStore.from_settings, self.settings)

    async def close(self) -> None:
        """Stop the store's worker threads."""
        if self._store is not None:
            await asyncio.to_thread(self._store.close)

    # --------------------------------------------------------------- the sandbox, from the log

    async def history(self, sandbox_id: str) -> list[tuple[int, bytes]]:
        """Every *authentic* event of the sandbox recorded so far: ``(stream seq, wire bytes)``;
        forged or unauthorized messages on its subjects are left out."""
        subject = aggregate_filter("sandbox", sandbox_id)
        kept = []
        async for seq, data in replay(self.js(), filter_subject=subject):
            try:
                fields = unpack_fields(data)
                envelope = Envelope.model_validate(fields)
            except (MalformedEnvelope, ValueError):
                continue
            if envelope.aggregate_id != sandbox_id:  # another sandbox's event copied here
                continue
            if await self.gate().check(fields, envelope, stream_seq=seq) is None:
                kept.append((seq, data))
        return kept

    async def current(self, sandbox_id: str) -> SandboxFacts:
        """Whether the sandbox runs, where, and on which environment: the lifecycle fold of
        its authentic history (the latest event of a kind alone could be one the fold refuses,
        e.g. a second ``sandbox.ready``)."""
        records = await self.history(sandbox_id)
        return SandboxFacts.from_events(sandbox_id, (decode(data) for _, data in records))

    # --------------------------------------------------------------- create

    async def on_requested(
        self, envelope: Envelope, event: events.SnapshotRequested
    ) -> Sequence[events.Payload]:
        """Take the snapshot a user asked for."""
        sid = envelope.aggregate_id
        records = await self.history(sid)
        facts = SandboxFacts.from_events(sid, (decode(data) for _, data in records))
        refusal = sandboxes.create_refusal(facts, event)
        if refusal is not None:
            return [failed(event.name, "create", refusal)]
        try:
            code = await self._code_source(facts, event.include_code)
            labels = {"request": envelope.id, "code": code_label(code)}
            inputs = self.inputs(facts, records, include_deps=event.include_deps, labels=labels)
            result = await asyncio.to_thread(self.create, event.name, inputs, code)
        except SnapshotExists:
            return [await asyncio.to_thread(self._taken_before, event.name, envelope.id)]
        except (Refused, InvalidInput, BundleError) as exc:
            return [failed(event.name, "create", str(exc))]
        return [taken_event(result)]

    async def _code_source(self, facts: SandboxFacts, include_code: bool) -> CodeSource:
        """The running code copy on this node, else the submitted bundle (hash-checked)."""
        if not include_code:
            return None
        local = facts.local_code_dir(self.settings.node_id, self.sandboxes_root)
        if local is not None and local.is_dir():
            return local
        assert facts.validated is not None
        ref = facts.validated.code
        if ref is None:
            return None
        try:
            data = await get_bundle(self.settings, ref.object_key, ref.digest)
        except ObjectMissing:
            raise Refused(
                f"code bundle {ref.object_key} of sandbox {facts.sandbox_id} is missing from "
                "the object store"
            ) from None
        except BundleAltered as exc:
            raise Refused(str(exc)) from None
        return data

    def inputs(
        self,
        facts: SandboxFacts,
        records: Sequence[tuple[int, bytes]],
        *,
        include_deps: bool = True,
        labels: dict[str, str] | None = None,
    ) -> SnapshotInputs:
        """What the store records of the sandbox (the code dir is filled in by :meth:`create`)."""
        ready = facts.ready
        return SnapshotInputs(
            code_dir=Path(),
            exclude_patterns=sandboxes.exclude_patterns(facts),
            sandbox_id=facts.sandbox_id,
            deps=sandboxes.deps_record(facts) if include_deps else None,
            env=sandboxes.env_values(facts) or None,
            audit_segment=sandboxes.audit_segment(records),
            labels=labels or {},
            node_id=ready.node_id if ready is not None else self.settings.node_id,
        )

    def create(self, name: str, inputs: SnapshotInputs, code: CodeSource) -> CreateResult:
        """Store the snapshot (blocking); a bundle is unpacked for it and always removed."""
        if isinstance(code, Path):
            with self._create_lock:
                return self.store.create(name, replace(inputs, code_dir=code))
        # Unpacked under one scratch dir per sandbox, so the stat cache and the snapshot's
        # parent follow the sandbox (a fresh temp name each time would not).
        sid = inputs.sandbox_id or "unknown"
        scratch = self.settings.home.resolve() / "tmp" / "snapshot-code" / sid
        with self._create_lock:
            shutil.rmtree(scratch, ignore_errors=True)
            try:
                if code is None:
                    scratch.mkdir(parents=True)
                else:
                    # the sandbox's own bundle, already bounded by its node: only the ceiling
                    extract_bundle(code, scratch, max_size=MAX_SIZE_LIMIT)
                return self.store.create(name, replace(inputs, code_dir=scratch))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)

    def run_periodic(self, policy: PeriodicPolicy, inputs: SnapshotInputs) -> CreateResult | None:
        """:meth:`SnapshotStore.run_periodic`, one snapshot at a time (blocking)."""
        with self._create_lock:
            return self.store.run_periodic(policy, inputs)

    def _taken_before(self, name: str, request_id: str) -> events.Payload:
        """A redelivered request whose snapshot was stored: the same answer; else the name
        is taken by another snapshot."""
        try:
            manifest = self.store.load(name)
        except VerificationFailed as exc:
            return failed(name, "create", f"snapshot name {name!r} is taken ({exc})")
        if manifest.labels.get("request") != request_id:
            return failed(
                name,
                "create",
                f"snapshot {name!r} exists already (snapshots are immutable): choose another name",
            )
        return sandboxes.snapshot_taken(
            name, manifest.digest(), len(manifest.code.files), manifest.code.total_size, 0
        )

    # --------------------------------------------------------------- restore

    async def on_restore_requested(
        self, envelope: Envelope, event: events.SnapshotRestoreRequested
    ) -> Sequence[events.Payload]:
        """Roll a running sandbox's code back to a snapshot."""
        name = event.snapshot
        facts = await self.current(envelope.aggregate_id)
        refusal = sandboxes.restore_refusal(facts, self.settings.node_id, self.sandboxes_root, name)
        if refusal is not None:
            return [failed(name, "restore", refusal)]
        code_dir = sandboxes.code_dir_of(self.sandboxes_root, envelope.aggregate_id)
        if not code_dir.is_dir():
            return [failed(name, "restore", f"the sandbox's code dir {code_dir} is gone")]
        foreign = await self._foreign_snapshot(name, envelope.tenant)
        if foreign is not None:
            return [failed(name, "restore", foreign)]
        try:
            result, gpu = await asyncio.to_thread(self._restore, name, code_dir)
        except (SnapshotNotFound, InvalidInput) as exc:
            return [failed(name, "restore", str(exc))]
        except VerificationFailed as exc:
            return [
                failed(
                    name,
                    "restore",
                    f"{exc}; files checked before the bad object may already be rolled "
                    f"back: see `dsec snapshot verify {name}`",
                )
            ]
        deps_match, deps_note = sandboxes.deps_verdict(result.manifest.deps, facts.built)
        notes = [deps_note, gpu.message if gpu.compatibility_mode else ""]
        return [
            events.SnapshotRestored(
                snapshot=name,
                manifest_digest=result.manifest_digest,
                duration_ms=round(result.duration_s * 1000, 2),
                compatibility_mode=gpu.compatibility_mode,
                files_written=result.files_written,
                files_removed=result.files_removed,
                deps_match=deps_match,
                note="; ".join(n for n in notes if n),
            )
        ]

    async def _foreign_snapshot(self, name: str, tenant: str) -> str | None:
        """Why ``tenant`` may not roll back to snapshot ``name``: it was taken of a sandbox of
        another tenant (snapshot names are visible on the bus; their code is not everyone's)."""
        try:
            manifest = await asyncio.to_thread(self.store.load, name)
        except (SnapshotNotFound, InvalidInput):
            return None  # the restore itself says so
        source = manifest.source.sandbox_id
        owner = await self.gate().tenant_of(source) if source else None
        if owner is not None and owner != tenant:
            return (
                f"snapshot {name!r} belongs to another tenant; a sandbox of {tenant!r} "
                "cannot use it"
            )
        return None

    def _restore(self, name: str, code_dir: Path) -> tuple[RestoreResult, GpuCheck]:
        result = self.store.restore(name, code_dir, sync=True)
        return result, check_gpu(result.manifest.gpu, probe_gpus())


def taken_event(result: CreateResult) -> events.SnapshotTaken:
    """``snapshot.taken`` of a snapshot just stored."""
    return sandboxes.snapshot_taken(
        result.manifest.name,
        result.manifest_digest,
        result.files,
        result.bytes_total,
        result.bytes_uploaded,
    )
