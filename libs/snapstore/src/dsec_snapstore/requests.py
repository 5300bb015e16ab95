"""Answering snapshot requests: who acts, and the taking and rolling back itself.

Both the node agent and the snapshot service hold a :class:`SnapshotRequests`; which requests
each serves follows from one pure decision, :func:`dsec_snapstore.sandboxes.acting_node`:

* a sandbox that runs (or is scheduled) on node N: only the node agent of N acts, on its own
  code copy (``snapshot.requested`` → ``snapshot.taken``; ``snapshot.restore_requested`` → the
  code dir rewritten in place → ``snapshot.restored``); every other node acks and skips;
* a sandbox that runs nowhere: the snapshot service answers (a snapshot from the submitted code
  bundle in S3; a rollback is refused: there is nothing running to roll back).

A deterministic refusal (unknown sandbox or snapshot, a taken name, another tenant's snapshot)
is answered at once with ``snapshot.failed``; a transient error (S3, Vault) raises, so the
runtime retries it (its last attempt also ends in ``snapshot.failed``). The store's calls
block: they run in worker threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from dsec_core import events
from dsec_core.bus import replay
from dsec_core.codebundle import BundleError, archive_bound, extract_bundle
from dsec_core.envelope import Envelope, MalformedEnvelope, decode
from dsec_core.identity import DEFAULT_TENANT
from dsec_core.ids import answer_ids
from dsec_core.lifecycle import fold_envelopes
from dsec_core.objectstore import BundleAltered, ObjectMissing, fetch_bundle
from dsec_core.service import HANDLING_SEQ
from dsec_core.settings import Settings
from dsec_core.subjects import aggregate_filter
from dsec_core.trust import Gate, unpack_fields
from nats.js import JetStreamContext

from dsec_snapstore import metrics, sandboxes
from dsec_snapstore.adapters.gpu import probe_gpus
from dsec_snapstore.domain import GpuCheck, PeriodicPolicy, check_gpu
from dsec_snapstore.errors import (
    InvalidInput,
    SnapshotExists,
    SnapshotNotFound,
    StoreUnavailable,
    VerificationFailed,
)
from dsec_snapstore.results import CreateResult, RestoreResult, SnapshotInputs
from dsec_snapstore.sandboxes import SandboxFacts
from dsec_snapstore.store import SnapshotStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BundleFile:
    """A sandbox's submitted bundle, streamed to a file (digest-checked, bounded by its spec),
    unpacked for one snapshot and then removed: never held whole in memory."""

    path: Path
    max_size: int


CodeSource = Path | BundleFile | None
"""The running sandbox's code copy, its bundle archive, or no code at all."""

_Read = tuple[list[tuple[int, bytes]], list[Envelope], SandboxFacts]
"""A sandbox's history as read once: stream positions and bytes, decoded, and its facts."""


@dataclass
class _Turns:
    """One sandbox's requests taking turns on this holder."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0
    """Requests holding or waiting for the turn (the entry goes with the last)."""
    taken: int = 0
    """Turns taken so far: one taken meanwhile means the sandbox may have changed."""


PRUNE_EVERY_S = 300.0
"""How often a node agent removes its copies of packs no index names any more."""
PERIODIC_REQUESTER = "periodic"
"""``requested_by`` of the snapshot service's periodic requests."""


def code_label(code: CodeSource) -> str:
    """Which code a snapshot recorded: the running sandbox's copy, its bundle, or none."""
    if isinstance(code, Path):
        return "running"
    return "bundle" if code is not None else "none"


class Refused(Exception):
    """A deterministic reason a request cannot be served: becomes ``snapshot.failed``."""


def _answered(
    request: Envelope, history: Sequence[Envelope], *answers: type[events.Payload]
) -> bool:
    """Whether ``history`` holds an answer to ``request`` (the service runtime derives its id
    from the request's): a request delivered again after it was answered (an ack lost, its
    wait exceeded) must not act twice."""
    ids = set().union(
        *(answer_ids(request.type, request.id, a.TYPE, key_id=request.key_id) for a in answers)
    )
    return any(e.id in ids for e in history)


def failed(
    snapshot: str, operation: Literal["create", "restore"], reason: str
) -> events.SnapshotFailed:
    """The ``snapshot.failed`` answer to a request."""
    return events.SnapshotFailed(snapshot=snapshot, operation=operation, reason=reason[:2000])


class TreeLocks:
    """A lock per directory tree, held while a snapshot of it is taken (threads): creates of
    one tree take turns, those of different trees run at once. A tree's lock goes once no one
    holds or waits for it."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[Path, tuple[threading.Lock, list[int]]] = {}

    @contextlib.contextmanager
    def held(self, tree: Path) -> Iterator[None]:
        key = Path(tree).absolute()
        with self._guard:
            lock, users = self._locks.setdefault(key, (threading.Lock(), [0]))
            users[0] += 1
        try:
            with lock:
                yield
        finally:
            with self._guard:
                users[0] -= 1
                if not users[0]:
                    del self._locks[key]

    def __len__(self) -> int:
        """Trees held or waited for now."""
        with self._guard:
            return len(self._locks)


class SnapshotRequests:
    """Snapshots and rollbacks of the sandboxes in the log.

    ``node_id`` is the node agent's node (it acts on the sandboxes it owns, from their code
    dirs under ``code_dir_of``); ``None`` is the snapshot service (it acts on sandboxes that run
    nowhere). ``signer`` names the producer key the manifests are signed with.
    """

    def __init__(
        self,
        settings: Settings,
        js: Callable[[], JetStreamContext],
        gate: Callable[[], Gate],
        *,
        node_id: str | None = None,
        code_dir_of: Callable[[str], Path] | None = None,
        scratch: Path | None = None,
        cache_dir: Path | None = None,
        signer: str = "snapshot",
        store_required: bool = True,
    ) -> None:
        self.settings = settings
        self.js = js
        self.gate = gate
        self.node_id = node_id
        self.code_dir_of = code_dir_of
        self.scratch = scratch or settings.home.resolve() / "snapshot" / "code"
        self.signer = signer
        self.cache_dir = cache_dir
        self.store_required = store_required
        self._store: SnapshotStore | None = None
        self._unavailable: str | None = None
        # One snapshot of a tree at a time: a directory's stat cache is one file that
        # concurrent creates of the same tree would both rewrite. Different trees (different
        # sandboxes) are snapshotted at once: a neighbour's snapshot no longer waits for a
        # tenant's creates already under way.
        self._trees = TreeLocks()
        self._per_sandbox: dict[str, _Turns] = {}
        self._pruner: asyncio.Task[None] | None = None

    @property
    def store(self) -> SnapshotStore:
        """The snapshot store (opened by :meth:`start`)."""
        if self._store is None:
            raise StoreUnavailable(self._unavailable or "the snapshot store is not open yet")
        return self._store

    async def start(self) -> None:
        """Open the store (S3 + Vault from the settings). Without ``store_required`` (the node
        agent) a node without an object store still starts; its snapshot requests then fail
        naming the reason."""
        try:
            self._store = await asyncio.to_thread(
                SnapshotStore.from_settings,
                self.settings,
                signer=self.signer,
                cache_dir=self.cache_dir,
                # A node keeps copies of the packs it stores and reads (its restores and
                # rollbacks read them back); the snapshot service, which restores nothing it
                # took, keeps none.
                pack_cache_bytes=None if self.node_id is not None else 0,
            )
        except StoreUnavailable as exc:
            if self.store_required:
                raise
            self._unavailable = str(exc)
            log.warning("snapshots unavailable on this node: %s", exc)
            return
        if self._store.pack_cache is not None:
            self._pruner = asyncio.create_task(self._prune_forever(), name="snapshot-pack-prune")

    async def close(self) -> None:
        """Stop the store's worker threads."""
        if self._pruner is not None:
            self._pruner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._pruner
        if self._store is not None:
            await asyncio.to_thread(self._store.close)

    async def _prune_forever(self) -> None:
        """Remove, every :data:`PRUNE_EVERY_S`, the node's copies of packs a GC (run by the
        snapshot service or an operator) deleted: their snapshots are gone, so are they."""
        while True:
            await asyncio.sleep(PRUNE_EVERY_S)
            try:
                removed = await asyncio.to_thread(
                    self.store.prune_pack_cache, self.settings.snapshot_gc_min_grace_s
                )
            except Exception as exc:  # S3 away: the next turn tries again
                log.warning("pack copies not pruned: %s", exc)
                continue
            if removed:
                log.info("removed %d copies of packs no snapshot uses any more", removed)

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
            # (at its position: an event signed before its key was revoked still counts, as
            # Gate.lifecycle counts it)
            if await self.gate().check(fields, envelope, stream_seq=seq) is None:
                kept.append((seq, data))
        return kept

    async def _read(self, sandbox_id: str) -> _Read:
        """The sandbox's authentic history (stream positions and bytes, decoded) and its facts."""
        records = await self.history(sandbox_id)
        envelopes = [decode(data) for _, data in records]
        return records, envelopes, SandboxFacts.from_events(sandbox_id, envelopes)

    async def facts(self, sandbox_id: str) -> tuple[SandboxFacts, str | None, list[Envelope]]:
        """The sandbox's facts, the node acting for its request (``None``: none; see
        :func:`_acting_for_request`) and its history."""
        read, owner = await self._owned(sandbox_id)
        return read[2], owner, read[1]

    async def _owned(self, sandbox_id: str) -> tuple[_Read, str | None]:
        """The sandbox's history as :meth:`_read` gives it, and the node acting for it."""
        read = await self._read(sandbox_id)
        return read, _acting_for_request(sandbox_id, *read)

    def mine(self, owner: str | None) -> bool:
        """Whether this holder acts for a sandbox acted for by ``owner``."""
        return owner == self.node_id

    # --------------------------------------------------------------- create

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, sandbox_id: str) -> AsyncIterator[bool]:
        """One request of a sandbox acted on here at a time (snapshots, rollbacks and a start
        from a snapshot read or write one code dir, on several workers: two rollbacks at once
        each listed the tree, then both wrote it, leaving a tree that matched neither
        snapshot). First come, first served among those waiting; that is the order workers
        reach it, close to but not always the log's (a retried request comes back later).

        Yields whether another request of the sandbox held or took its turn first (what was
        read of the sandbox before is then stale: read it again)."""
        turns = self._per_sandbox.setdefault(sandbox_id, _Turns())
        behind = turns.lock.locked()
        taken = turns.taken
        turns.users += 1
        try:
            async with turns.lock:
                turns.taken += 1
                yield behind or turns.taken != taken + 1
        finally:
            turns.users -= 1
            if not turns.users:
                del self._per_sandbox[sandbox_id]

    async def on_requested(
        self, envelope: Envelope, event: events.SnapshotRequested
    ) -> Sequence[events.Payload]:
        """Take the snapshot asked for, if this holder is the one to act."""
        sid = envelope.aggregate_id
        read, owner = await self._owned(sid)
        if not self.mine(owner):
            log.debug("snapshot %s of %s: acted on by %s, skipped here", event.name, sid, owner)
            return []
        async with self._one_at_a_time(sid) as waited:
            # read again once its turn came: what it waited behind may have taken minutes
            return await self._take(envelope, event, await self._read(sid) if waited else read)

    async def _take(
        self, envelope: Envelope, event: events.SnapshotRequested, read: _Read
    ) -> Sequence[events.Payload]:
        sid = envelope.aggregate_id
        records, envelopes, facts = read
        if _answered(envelope, envelopes, events.SnapshotTaken, events.SnapshotFailed):
            return []  # delivered again after its answer (the snapshot may be deleted since)
        started = time.perf_counter()
        refusal = sandboxes.create_refusal(facts, event)
        if refusal is not None:
            return metrics.answered("create", started, [failed(event.name, "create", refusal)])
        labels = {"request": envelope.id, "tenant": envelope.tenant}
        if envelope.producer == "snapshot" and event.requested_by == PERIODIC_REQUESTER:
            labels["periodic"] = sandboxes.periodic_prefix(sid)
        code: CodeSource = None
        try:
            code = await self._code_source(facts, event.include_code)
            labels["code"] = code_label(code)
            inputs = self.inputs(facts, records, include_deps=event.include_deps, labels=labels)
            result = await asyncio.to_thread(self.create, event.name, inputs, code)
        except SnapshotExists:
            return metrics.answered(
                "create",
                started,
                [await asyncio.to_thread(self._taken_before, event.name, envelope.id)],
            )
        except (Refused, InvalidInput, BundleError) as exc:
            return metrics.answered("create", started, [failed(event.name, "create", str(exc))])
        finally:
            if isinstance(code, BundleFile):
                await asyncio.to_thread(code.path.unlink, missing_ok=True)
        return metrics.answered("create", started, [taken_event(result)])

    async def _code_source(self, facts: SandboxFacts, include_code: bool) -> CodeSource:
        """On a node: the running code copy; for a sandbox running nowhere: its submitted
        bundle (hash-checked)."""
        if not include_code:
            return None
        if self.node_id is not None:
            return self._running_code_dir(facts)
        assert facts.validated is not None
        ref = facts.validated.code
        if ref is None:
            return None
        max_size = facts.validated.plan.code_max_size
        await asyncio.to_thread(self.scratch.mkdir, parents=True, exist_ok=True)
        path = self.scratch / f".bundle-{facts.sandbox_id}-{uuid.uuid4().hex[:8]}.tar.zst"
        try:
            await fetch_bundle(
                self.settings, ref.object_key, ref.digest, path,
                max_bytes=archive_bound(max_size),
            )  # fmt: skip
        except ObjectMissing:
            raise Refused(
                f"code bundle {ref.object_key} of sandbox {facts.sandbox_id} is missing from "
                "the object store"
            ) from None
        except BundleAltered as exc:
            raise Refused(str(exc)) from None
        return BundleFile(path, max_size)

    def _running_code_dir(self, facts: SandboxFacts) -> Path | None:
        """The code copy of a sandbox this node runs (``None``: it runs without code)."""
        assert self.code_dir_of is not None and self.node_id is not None
        refusal = sandboxes.running_refusal(facts, self.node_id)
        if refusal is not None:
            raise Refused(refusal)
        if facts.ready is None or facts.ready.code_dir is None:
            return None
        code_dir = self.code_dir_of(facts.sandbox_id)
        refusal = sandboxes.code_dir_refusal(facts, code_dir)
        if refusal is not None:
            raise Refused(refusal)
        if not code_dir.is_dir():
            raise Refused(f"the sandbox's code dir {code_dir} is gone")
        return code_dir

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
            node_id=ready.node_id if ready is not None else self.node_id,
        )

    def create(self, name: str, inputs: SnapshotInputs, code: CodeSource) -> CreateResult:
        """Store the snapshot (blocking); a bundle is unpacked for it and always removed."""
        if isinstance(code, Path):
            with self._trees.held(code):
                return self.store.create(name, replace(inputs, code_dir=code))
        # Unpacked under one scratch dir per sandbox, so the stat cache and the snapshot's
        # parent follow the sandbox (a fresh temp name each time would not).
        scratch = self.scratch / (inputs.sandbox_id or "unknown")
        with self._trees.held(scratch):
            shutil.rmtree(scratch, ignore_errors=True)
            try:
                if code is None:
                    scratch.mkdir(parents=True)
                else:
                    extract_bundle(code.path, scratch, max_size=code.max_size)
                return self.store.create(name, replace(inputs, code_dir=scratch))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)

    def run_periodic(self, policy: PeriodicPolicy, inputs: SnapshotInputs) -> CreateResult | None:
        """:meth:`SnapshotStore.run_periodic`, one snapshot of a tree at a time (blocking)."""
        with self._trees.held(Path(inputs.code_dir)):
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
        """Roll a running sandbox's code back to a snapshot (the owning node), or say why
        not (the snapshot service, for a sandbox that runs nowhere)."""
        name = event.snapshot
        facts, owner, history = await self.facts(envelope.aggregate_id)
        if not self.mine(owner):
            return []
        async with self._one_at_a_time(envelope.aggregate_id) as waited:
            if waited:  # read again once its turn came
                facts, _, history = await self.facts(envelope.aggregate_id)
            if _answered(envelope, history, events.SnapshotRestored, events.SnapshotFailed):
                return []  # delivered again after its answer: the rollback is not done twice
            started = time.perf_counter()
            return metrics.answered(
                "restore", started, await self._restore_requested(envelope, name, facts)
            )

    async def _restore_requested(
        self, envelope: Envelope, name: str, facts: SandboxFacts
    ) -> Sequence[events.Payload]:
        if self.node_id is None:  # runs nowhere: nothing to roll back
            return [failed(name, "restore", sandboxes.not_running(facts, name))]
        try:
            code_dir = self._running_code_dir(facts)
        except Refused as exc:
            return [failed(name, "restore", str(exc))]
        if code_dir is None:
            return [
                failed(
                    name,
                    "restore",
                    f"sandbox {facts.sandbox_id} runs without a code bundle: there is no code "
                    "to roll back",
                )
            ]
        foreign = await self.foreign_snapshot(name, envelope.tenant)
        if foreign is not None:
            return [failed(name, "restore", foreign)]
        try:
            result, gpu = await asyncio.to_thread(self._restore, name, code_dir, True)
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
        return [restored_event(name, result, gpu, deps_match, "; ".join(n for n in notes if n))]

    async def snapshot_tenant(self, name: str) -> str | None:
        """The tenant a snapshot belongs to: recorded in its labels, else its sandbox's
        (snapshots taken before tenants were recorded); ``None``: none known."""
        try:
            manifest = await asyncio.to_thread(self.store.load, name)
        except (SnapshotNotFound, InvalidInput):
            return None
        return await self.tenant_of_manifest(manifest.labels, manifest.source.sandbox_id)

    async def tenant_of_manifest(
        self, labels: dict[str, str], sandbox_id: str | None
    ) -> str | None:
        """The tenant of a snapshot with these labels, taken of ``sandbox_id``."""
        if labels.get("tenant"):
            return labels["tenant"]
        return await self.gate().tenant_of(sandbox_id) if sandbox_id else None

    async def foreign_snapshot(self, name: str, tenant: str) -> str | None:
        """Why ``tenant`` may not use snapshot ``name``: it was taken of a sandbox of another
        tenant (snapshot names are visible on the bus; their code is not everyone's). A
        snapshot whose tenant is known nowhere (no ``tenant`` label, its sandbox unknown to
        the log) is the ``default`` tenant's, as for a delete: before, every tenant could
        restore one."""
        try:
            manifest = await asyncio.to_thread(self.store.load, name)
        except (SnapshotNotFound, InvalidInput):
            return None  # (the restore says it is not there)
        owner = await self.tenant_of_manifest(dict(manifest.labels), manifest.source.sandbox_id)
        if (owner or DEFAULT_TENANT) != tenant:
            return (
                f"snapshot {name!r} belongs to another tenant; a sandbox of {tenant!r} "
                "cannot use it"
            )
        return None

    def _restore(self, name: str, code_dir: Path, sync: bool) -> tuple[RestoreResult, GpuCheck]:
        result = self.store.restore(name, code_dir, sync=sync)
        return result, check_gpu(result.manifest.gpu, probe_gpus())

    # --------------------------------------------------------------- start from a snapshot

    async def restore_for_start(
        self, sandbox_id: str, name: str, tenant: str, code_dir: Path, max_size: int
    ) -> events.SnapshotRestored:
        """Put snapshot ``name``'s code into a new sandbox's code dir before it starts: into
        an absent dir, or over the code bundle just unpacked there (``--code`` that the CLI
        checked against the snapshot). Raises :class:`Refused` with the reason."""
        started = time.perf_counter()
        try:
            async with self._one_at_a_time(sandbox_id):  # (a rollback of an older placement)
                restored = await self._restore_for_start(
                    sandbox_id, name, tenant, code_dir, max_size
                )
        except Refused:
            metrics.observe("start", started, "failed")
            raise
        metrics.observe("start", started, "ok")
        return restored

    async def _restore_for_start(
        self, sandbox_id: str, name: str, tenant: str, code_dir: Path, max_size: int
    ) -> events.SnapshotRestored:
        started = time.perf_counter()
        foreign = await self.foreign_snapshot(name, tenant)
        if foreign is not None:
            raise Refused(foreign)
        try:
            manifest = await asyncio.to_thread(self.store.load, name)
            if manifest.code.total_size > max_size:
                raise Refused(
                    f"snapshot {name!r} holds {manifest.code.total_size} bytes of code, over "
                    f"include_code.max_size ({max_size} bytes)"
                )
            sync = code_dir.exists()
            result, gpu = await asyncio.to_thread(self._restore, name, code_dir, sync)
        except (SnapshotNotFound, InvalidInput, VerificationFailed) as exc:
            raise Refused(f"cannot start from snapshot {name!r}: {exc}") from None
        how = "code checked against it" if sync else "code restored from it"
        note = f"started from snapshot {name} ({how})"
        if gpu.compatibility_mode:
            note += f"; {gpu.message}"
        result = replace(result, duration_s=time.perf_counter() - started)
        log.info("sandbox %s starts from snapshot %s", sandbox_id, name)
        return restored_event(name, result, gpu, None, note)


_OPERATION = {"snapshot.requested": "create", "snapshot.restore_requested": "restore"}


def _acting_for_request(
    sandbox_id: str,
    records: Sequence[tuple[int, bytes]],
    envelopes: Sequence[Envelope],
    facts: SandboxFacts,
) -> str | None:
    """The node that acts for the request being handled: the one acting for the sandbox where
    the request is in the log (its stream position, ``HANDLING_SEQ``), so every holder of it
    (each node agent, the snapshot service), whenever it reads, names the same one. Decided
    from the log as it is now, a request held while its sandbox exited was skipped by the
    snapshot service (it ran on a node then) and by that node (it ran nowhere by then): no
    answer at all; the other way round, two. Outside a handler: the node acting now."""
    upto = HANDLING_SEQ.get()
    if upto is None or not records or records[-1][0] <= upto:
        return sandboxes.acting_node(fold_envelopes(envelopes), facts)
    then = [e for (seq, _), e in zip(records, envelopes, strict=True) if seq <= upto]
    return sandboxes.acting_node(fold_envelopes(then), SandboxFacts.from_events(sandbox_id, then))


def snapshot_failed(envelope: Envelope, reason: str, attempts: int) -> Sequence[events.Payload]:
    """A snapshot request whose retries are exhausted (or that was never started: its tenant
    full at the instance) ends in ``snapshot.failed``: a snapshot that could not be taken says
    nothing about the sandbox, which ``sandbox.failed`` (terminal) would mark as failed."""
    request = envelope.payload
    return [
        events.SnapshotFailed(
            snapshot=str(request.get("name") or request.get("snapshot") or ""),
            operation="create" if _OPERATION.get(envelope.type) == "create" else "restore",
            # 0 attempts: ended before it started (its tenant holds its most at the node)
            reason=f"gave up after {attempts} attempts: {reason}" if attempts else reason,
        )
    ]


def restored_event(
    name: str, result: RestoreResult, gpu: GpuCheck, deps_match: bool | None, note: str
) -> events.SnapshotRestored:
    """``snapshot.restored`` of a rollback or of a start from a snapshot."""
    return events.SnapshotRestored(
        snapshot=name,
        manifest_digest=result.manifest_digest,
        duration_ms=round(result.duration_s * 1000, 2),
        compatibility_mode=gpu.compatibility_mode,
        files_written=result.files_written,
        files_removed=result.files_removed,
        deps_match=deps_match,
        note=note,
    )


def taken_event(result: CreateResult) -> events.SnapshotTaken:
    """``snapshot.taken`` of a snapshot just stored."""
    return sandboxes.snapshot_taken(
        result.manifest.name,
        result.manifest_digest,
        result.files,
        result.bytes_total,
        result.bytes_new,  # (never the store's dedup count: see CreateResult)
    )
