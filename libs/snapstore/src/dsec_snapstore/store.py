"""The snapshot library: create, list, inspect, diff, verify, restore, check code, retain, GC.

:class:`SnapshotStore` is what the node agent (snapshots and rollbacks of its sandboxes), the
snapshot service (sandboxes running nowhere, retention, deletes) and the ``dsec snapshot`` CLI
(reads) call.
It talks to an :class:`~dsec_snapstore.adapters.objectstore.ObjectStore` (S3) and, for env hashes
and audit segments, a :class:`~dsec_snapstore.adapters.vault.KeyStore` (Vault); decisions come
from :mod:`dsec_snapstore.domain`.
"""

from __future__ import annotations

import contextlib
import gc
import getpass
import logging
import os
import shutil
import socket
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypeVar

import blake3
import msgspec
import pydantic
import zstandard
from dsec_core import identity
from dsec_core.codebundle import (
    BundleError,
    CodeManifest,
    FileEntry,
    GitInfo,
    TreeEntry,
    check_names,
    file_entry,
    git_info,
    list_tree,
)
from dsec_core.ids import new_event_id
from dsec_core.settings import Settings
from dsec_core.signing import key_id_of, load_or_create_key
from dsec_core.text import untrusted_json
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from dsec_snapstore import crypto, domain
from dsec_snapstore.adapters.files import (
    ChunkRef,
    ChunkSink,
    FileChanged,
    HashedFile,
    StatCache,
    StatCacheMemo,
    hash_and_chunk,
)
from dsec_snapstore.adapters.gpu import probe_gpus
from dsec_snapstore.adapters.kernel import read_kernel_params
from dsec_snapstore.adapters.objectstore import (
    ObjectExists,
    ObjectMissing,
    ObjectStore,
    S3ObjectStore,
)
from dsec_snapstore.adapters.tree import Parents, local_bytes, place, place_in, remove_in
from dsec_snapstore.adapters.vault import KeyMissing, KeyStore, VaultKeyStore
from dsec_snapstore.errors import (
    InvalidInput,
    SnapshotError,
    SnapshotExists,
    SnapshotNotFound,
    StoreUnavailable,
    VerificationFailed,
)
from dsec_snapstore.fairpool import FairExecutor
from dsec_snapstore.locks import Held, StoreLocks
from dsec_snapstore.manifest import (
    AUDIT_PREFIX,
    CHUNK_PREFIX,
    INDEX_PREFIX,
    MANIFEST_PREFIX,
    AuditRecord,
    EnvRecord,
    GpuRecord,
    Signature,
    SignedManifest,
    SnapshotManifest,
    SnapshotSummary,
    Source,
    audit_key,
    chunk_key,
    manifest_key,
    parse_manifest,
    summary_key,
)
from dsec_snapstore.packcache import PackCache, count_read
from dsec_snapstore.packs import (
    GROUP_CHUNK_MAX,
    GROUP_LIMIT,
    PACK_PREFIX,
    PACK_TARGET,
    IndexDoc,
    Loc,
    Member,
    Packer,
    PackFormatError,
    PackIndex,
    Span,
    default_uploader,
    loc_of,
    pack_key,
    plan_reads,
    trailer_spans,
)
from dsec_snapstore.results import (
    CodeCheck,
    CreateResult,
    GcReport,
    RestoreResult,
    SnapshotInputs,
    VerifyReport,
)

_ZSTD_LEVEL = 1
"""Chunks are compressed at zstd's fastest standard level: a cold snapshot is bound by
compressing (two cores) while its packs upload; level 3 saves a few percent of bytes for about
1.5x the CPU. Any level decompresses the same way, so older packs read as before."""
_T = TypeVar("_T")
_RESTORE_BATCH = 64 << 20
"""A restore fetches the chunks of this many bytes of files at once (bounded memory)."""
_FRAME_CONTENT_MAX = 64 << 20
"""No frame of ours holds more (chunks are at most 4 MiB, group frames ~160 KiB): a header
that claims more is altered, refused before decompress() would allocate it."""
PACK_CACHE_BYTES: int = Settings.model_fields["snapshot_pack_cache_mb"].default << 20
"""The node's copies of packs (:class:`.PackCache`) are kept to this many bytes by default
(``DSEC_SNAPSHOT_PACK_CACHE_MB``'s default: one figure for both)."""
_RESTORE_SPAN = 16 << 20
"""The largest ranged GET of a restore (one task: fetch, decompress, check, write)."""
_READ_AHEAD_BYTES = 32 << 20
"""The bytes a restore reads ahead of the spans being checked and written (at least one
span). On 2 cores, a cold-node restore of 5,000 files (28 MB of packs), paired against the code
without the read-ahead: 0.968x with four spans ahead, 0.951x with eight, 0.909-0.935x with
this budget (the whole snapshot's packs)."""
REPACK_BELOW = 0.5
"""GC rewrites a pack whose live (referenced) bytes fall below this fraction of it."""
_local = threading.local()
SIGNER_ROLES = frozenset({"snapshot", "nodeagent"})
"""Roles whose certified keys may sign snapshot manifests."""
_MAX_LINE_DIFFS = 200
"""Changed files shown with a line diff in one ``diff`` or code check; the rest are listed."""
_CHECKED_KEPT = 8
"""Checked manifests kept in memory (see ``SnapshotStore._checked``)."""

log = logging.getLogger(__name__)


class _Checked(NamedTuple):
    """A manifest whose signature held, remembered by the BLAKE3 of its stored bytes."""

    manifest: SnapshotManifest
    digest: str
    valid_until: datetime | None
    """When the signer's certificate expires; ``None``: a key trusted directly, or no expiry."""

    def still_trusted(self) -> bool:
        return self.valid_until is None or datetime.now(UTC) < self.valid_until


class SnapshotStore:
    """Signed, content-addressed snapshots in an object store.

    Thread-safe for concurrent calls; ``close()`` (or ``with``) stops its upload threads.
    """

    def __init__(
        self,
        objects: ObjectStore,
        *,
        signing_key: SigningKey,
        keys: KeyStore | None = None,
        cache_dir: Path | None = None,
        trusted_keys: Iterable[VerifyKey] = (),
        workers: int = 16,
        certificate: identity.Certificate | None = None,
        anchor: bytes | None = None,
        pack_target: int = PACK_TARGET,
        create_wait_s: float = 120.0,
        gc_wait_s: float = 30.0,
        pack_cache_bytes: int = PACK_CACHE_BYTES,
    ) -> None:
        self.objects = objects
        # A GC and a create never run at once, in any process (see dsec_snapstore.locks): a
        # create waits up to create_wait_s for a GC, a GC up to gc_wait_s for the creates.
        self.locks = StoreLocks(objects)
        self._create_wait_s = create_wait_s
        self._gc_wait_s = gc_wait_s
        self._pack_target = pack_target
        self._certificate = certificate
        self._anchor = anchor
        self.keys = keys
        self._signing_key = signing_key
        self._public = bytes(signing_key.verify_key)
        raw_keys = [self._public, *(bytes(k) for k in trusted_keys)]
        self._trusted = {key_id_of(k): k for k in raw_keys}
        self._cache_dir = cache_dir
        self._workers = workers
        self._pool: Executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="snap")
        self._uploader = default_uploader()
        # Hashing, compressing, decompressing and checking is CPU work: one thread per core.
        # Each of those calls releases the GIL, and with more threads than cores every release
        # hands it to a thread that was waiting (measured on 2 cores, 4 threads against 2: a
        # restore into tmpfs 0.238-0.248 s against 0.202-0.221 s, a cold create 0.39 s
        # against 0.37 s).
        self._cpu_threads = max(1, min(workers, os.cpu_count() or 1))
        # Taking turns between the creates and restores that submit to it (one per worker
        # thread of the caller): a small snapshot's runs do not wait behind every run of the
        # large ones queued before it (dsec_snapstore.fairpool).
        self._cpu: Executor = FairExecutor(self._cpu_threads, name="snap-cpu")
        index_cache = None
        # The node's copies of packs it stored or read (see dsec_snapstore.packcache).
        self.pack_cache: PackCache | None = None
        if cache_dir is not None:
            ident = blake3.blake3(objects.identity.encode()).hexdigest()[:32]
            index_cache = cache_dir / "pack-index" / ident
            if pack_cache_bytes > 0:
                self.pack_cache = PackCache(cache_dir / "packs" / ident, pack_cache_bytes)
        self.index = PackIndex(objects, index_cache)
        self._stat_memo = StatCacheMemo()
        # Manifests checked already, by the BLAKE3 of their stored document: a snapshot taken
        # here, or loaded before, is not parsed and its signature not checked again when the
        # bytes read back are the same (they are immutable; a rollback re-reads them), until
        # the certificate of the key that signed it expires.
        self._checked: OrderedDict[str, _Checked] = OrderedDict()
        self._checked_lock = threading.Lock()
        self._gc_lock = threading.Lock()

    @classmethod
    def from_settings(
        cls,
        settings: Settings | None = None,
        *,
        signer: str = "snapshot",
        cache_dir: Path | None = None,
        pack_cache_bytes: int | None = None,
    ) -> SnapshotStore:
        """Build a store from ``DSEC_*`` settings / ``$DSEC_HOME/stack.json``.

        Manifests are signed with the producer key of ``signer`` (``keys/<signer>.key``, the
        snapshot service's or a node agent's) and carry its certificate when there is one; a
        manifest is trusted when signed by that key or by any key the operator root certified
        for the snapshot service or a node agent. ``cache_dir`` holds the stat caches of
        incremental snapshots (default ``$DSEC_HOME/cache/snapshot``) and the node's copies of
        packs, kept to ``pack_cache_bytes`` (default ``DSEC_SNAPSHOT_PACK_CACHE_MB``; 0: none).

        Raises:
            StoreUnavailable: no S3 endpoint is configured.
        """
        settings = settings or Settings()
        endpoint = settings.endpoint("s3_endpoint")
        if not endpoint:
            raise StoreUnavailable(
                "no S3 endpoint: start the stack with `dsec up` or set DSEC_S3_ENDPOINT"
            )
        objects = S3ObjectStore(
            str(endpoint),
            settings.endpoint("s3_access_key"),
            settings.endpoint("s3_secret_key"),
            settings.s3_bucket,
            secure=settings.s3_secure,
        )
        vault_addr = settings.endpoint("vault_addr")
        keys = VaultKeyStore(vault_addr, settings.endpoint("vault_token")) if vault_addr else None
        paths = identity.TrustPaths(settings.home)
        key = load_or_create_key(paths.key(signer))
        try:
            cert: identity.Certificate | None = identity.read_cert(paths.cert(signer))
        except identity.CertificateError:
            cert = None
        if cert is not None and cert.public_key != bytes(key.verify_key).hex():
            cert = None
        try:
            anchor = identity.read_anchor(paths, settings.trust_root)
        except identity.CertificateError:
            anchor = None
        return cls(
            objects,
            signing_key=key,
            keys=keys,
            cache_dir=cache_dir or settings.home / "cache" / "snapshot",
            gc_wait_s=settings.snapshot_gc_wait_s,
            pack_cache_bytes=(
                settings.snapshot_pack_cache_mb << 20
                if pack_cache_bytes is None
                else pack_cache_bytes
            ),
            certificate=cert,
            anchor=anchor,
        )

    def prune_pack_cache(self, min_age_s: float = 3600.0) -> int:
        """Remove this node's copies of packs the store's index no longer names (a GC, in
        whichever process, deleted or repacked them), when older than ``min_age_s`` (a snapshot
        being taken stores packs before its index document names them); how many went. The
        node agent calls it periodically; the index is read again first.

        Raises:
            StoreUnavailable: S3 failed (nothing was removed).
        """
        if self.pack_cache is None:
            return 0
        self.index.refresh(self._pool)
        return self.pack_cache.retain(self.index.pack_keys(), min_age_s)

    @property
    def public_key(self) -> bytes:
        """The raw Ed25519 key this store signs manifests with (another store trusts it with
        ``trusted_keys=[VerifyKey(...)]``)."""
        return self._public

    def close(self) -> None:
        """Stop the worker threads."""
        self._pool.shutdown(wait=True)
        self._uploader.shutdown(wait=True)
        self._cpu.shutdown(wait=True)
        if self.pack_cache is not None:
            self.pack_cache.close()  # (the copies still waiting are written first)

    def __enter__(self) -> SnapshotStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- create ---------------------------------------------------------------------------

    def create(
        self, name: str, inputs: SnapshotInputs, *, now: datetime | None = None
    ) -> CreateResult:
        """Take a snapshot called ``name``; only chunks not stored yet are uploaded.

        ``now`` sets the recorded creation time (periodic snapshots pass their tick).

        Raises:
            InvalidInput: bad name, directory or exclude pattern.
            SnapshotExists: the name is taken.
            StoreUnavailable: S3 or Vault failed (or Vault is needed and not configured).
            SnapshotError: a file changed while it was read.
        """
        started = time.perf_counter()
        domain.validate_name(name)
        root = Path(inputs.code_dir).absolute()
        with _no_gc(), contextlib.ExitStack() as held:
            return self._create(name, inputs, root, now, started, held)

    def _create(
        self,
        name: str,
        inputs: SnapshotInputs,
        root: Path,
        now: datetime | None,
        started: float,
        held: contextlib.ExitStack,
    ) -> CreateResult:
        cache = self._stat_cache(root)
        # The store's shared lock (no GC runs while it is held: dsec_snapstore.locks), taken on
        # the pool while the tree is listed; what it protects is read only once it is held:
        # the pack index (dedup) and whether the stat cache's snapshot is still there. Released
        # with ``held`` when the create ends.
        what = f"snapshot create {name!r}"

        lock_held: list[Held] = []
        locked: Future[None] = Future()
        # Set when the create fails before its lock is held (the name is taken, a bad exclude
        # pattern): it answers at once instead of after waiting out a GC (create_wait_s).
        given_up = threading.Event()

        def lock() -> None:  # on a thread of its own: no pool worker sleeps while it waits
            try:
                taken_lock = self.locks.acquire(
                    "shared", self._create_wait_s, what, given_up=given_up
                )
            except BaseException as exc:
                locked.set_exception(exc)
                return
            lock_held.append(taken_lock)
            held.callback(taken_lock.release)  # (on any error; once only)
            locked.set_result(None)

        def once_locked(fn: Callable[..., _T], *args: Any) -> Future[_T]:
            """``fn(*args)`` on the pool once the lock is held (submitted then: it never
            holds a worker while the lock is awaited); the lock's error if it is not."""
            out: Future[_T] = Future()

            def go(_: Future[None]) -> None:
                error = locked.exception()
                if error is not None:
                    out.set_exception(error)
                    return
                try:
                    self._pool.submit(fn, *args).add_done_callback(lambda f: _settle(out, f))
                except BaseException as exc:  # (the pool shut down)
                    out.set_exception(exc)

            locked.add_done_callback(go)
            return out

        taken = self._pool.submit(self._exists, name)
        # The cache's snapshot is still there and still the one it was (by id: deleted and
        # taken again under its name, it is another): its manifest and its row, both at once.
        parent_alive = (
            (
                once_locked(self._exists, cache.snapshot),
                once_locked(self._row_is, cache.snapshot, cache.snapshot_id),
            )
            if cache.snapshot and cache.snapshot_id
            else None
        )
        # what is stored already: dedup
        index_read = once_locked(self.index.refresh)
        git = self._pool.submit(git_info, root)  # runs git: meanwhile
        # Started once nothing above can fail: a lock taken after the create failed would be
        # released by no one.
        threading.Thread(target=lock, name="snap-lock-take", daemon=True).start()
        scan_ns = time.time_ns()
        try:
            try:
                entries = list_tree(root, inputs.exclude_patterns)
                check_names(entries)
            except BundleError as exc:
                raise InvalidInput(str(exc)) from exc
            if taken.result():
                raise SnapshotExists(f"snapshot {name!r} exists already (snapshots are immutable)")
            parent = (
                cache.snapshot
                if parent_alive is not None and all(f.result() for f in parent_alive)
                else None
            )
            index_read.result()
        except BaseException:
            given_up.set()
            wait([locked, index_read, *(parent_alive or ())])  # then ``held`` releases it
            raise
        packer = Packer(
            self.objects,
            self._uploader.queue(),  # this snapshot's uploads take turns with the others'
            target=self._pack_target,
            on_stored=self._keep_own if self.pack_cache is not None else None,
        )
        try:
            hashed, rehashed = self._hash_all(
                entries, cache if parent else None, _PackingSink(self.index, packer)
            )
        except BaseException:
            with contextlib.suppress(Exception):
                packer.finish()  # let the uploads end; those packs are orphans GC removes
            raise
        packer.seal()  # the last pack uploads while the manifest is built
        # The manifest is built while the last packs upload (it names chunks, not packs); it
        # is written only after they are stored and indexed.
        total_chunks = len({c.id for _, h in hashed.values() for c in h.chunks})
        snapshot_id = new_event_id()
        created = now or datetime.now(UTC)
        try:
            manifest = self._manifest(
                name, snapshot_id, root, inputs, hashed, parent, created, git.result()
            )
        except BaseException:
            with contextlib.suppress(Exception):
                packer.finish()
            raise
        # The manifest is signed and the stat cache encoded and written while the last packs
        # upload; the cache names this snapshot, so it is removed again if the snapshot is not
        # stored after all.
        signing = self._pool.submit(self._signed_document, manifest)
        saved = self._pool.submit(
            cache.save, name, hashed, scan_ns, rehashed if parent else None, snapshot_id=snapshot_id
        )
        try:
            self._store_packs(packer)
            doc, digest = signing.result()
            # Still held (not taken for a crashed holder's by a GC elsewhere): then no GC
            # has run since this create read the pack index.
            lock_held[0].check(what)
            try:  # created only: another create of this name may have finished meanwhile
                self.objects.put(manifest_key(manifest.name), doc, if_absent=True)
            except ObjectExists:
                # Ours, when a retried PUT (a lost answer, a 5xx) found its first try stored.
                if not self._stored_is(manifest_key(manifest.name), doc):
                    raise SnapshotExists(
                        f"snapshot {name!r} exists already (snapshots are immutable): another "
                        "create of this name stored it first"
                    ) from None
            try:  # still held while it was written (a slow PUT, refreshes failing)
                lock_held[0].check(what)
            except StoreUnavailable:
                self._take_back(manifest_key(manifest.name), doc)  # a GC may have run
                raise
            self._remember(blake3.blake3(doc).hexdigest(), manifest, digest)
        except BaseException:
            if manifest.audit is not None and self.keys is not None:
                self.keys.delete_segment_key(snapshot_id)
            with contextlib.suppress(Exception):
                saved.result()
            cache.forget()
            raise
        # Stored: a GC counts its chunks live from now on. The lock goes while the summary is
        # written (gone before this returns).
        released = self._pool.submit(lock_held[0].release)
        uploaded, uploaded_bytes = packer.chunks, packer.bytes
        total = manifest.code.total_size
        new_bytes = _new_to_parent(hashed, rehashed if parent else None)
        self._write_summary(manifest, digest, new_bytes)
        saved.result()
        released.result()
        return CreateResult(
            manifest=manifest,
            manifest_digest=digest,
            files=len(manifest.code.files),
            bytes_total=total,
            bytes_uploaded=uploaded_bytes,
            chunks_total=total_chunks,
            chunks_uploaded=uploaded,
            files_rehashed=len(rehashed),
            duration_s=time.perf_counter() - started,
            bytes_new=new_bytes,
        )

    def _stat_cache(self, root: Path) -> StatCache:
        if self._cache_dir is None:
            return StatCache(None)  # no cache directory: nothing is read or written
        ident = blake3.blake3(f"{self.objects.identity}\0{root}".encode()).hexdigest()[:32]
        return StatCache(self._cache_dir / f"{ident}.msgpack", self._stat_memo)

    def _exists(self, name: str) -> bool:
        return self.objects.exists(manifest_key(name))

    def _row_is(self, name: str, snapshot_id: str) -> bool:
        """Whether ``name``'s listing row is that of ``snapshot_id`` (alone it proves nothing:
        a delete removes row and manifest in one request, which S3 may carry out in part)."""
        try:
            row = untrusted_json(self.objects.get(summary_key(name)))
        except (ObjectMissing, ValueError):
            return False
        return isinstance(row, dict) and row.get("id") == snapshot_id

    def _stored_is(self, key: str, data: bytes) -> bool:
        """Whether the object at ``key`` holds exactly ``data`` (signed: no one else's is)."""
        try:
            return self.objects.get(key) == data
        except ObjectMissing:
            return False

    def _store_packs(self, packer: Packer) -> None:
        """Wait for the packs' uploads, then record them in a new index document (before the
        manifest that needs them is written)."""
        packs = packer.finish()
        if packs:
            self.index.write(IndexDoc(packs))

    def _hash_all(
        self,
        entries: list[TreeEntry],
        cache: StatCache | None,
        sink: ChunkSink | None = None,
    ) -> tuple[dict[str, tuple[TreeEntry, HashedFile]], set[str]]:
        """Hash every file (reusing the stat cache); also return the paths actually read.

        ``sink`` gets the chunks of every file read (not of stat cache hits).
        """
        out: dict[str, tuple[TreeEntry, HashedFile]] = {}
        todo: list[TreeEntry] = []
        for entry in entries:
            if entry.kind == "symlink":
                target = os.fsencode(entry.target or "")
                out[entry.path] = (entry, HashedFile(blake3.blake3(target).hexdigest(), 0, ()))
                continue
            hit = cache.lookup(entry) if cache is not None else None
            if hit is not None:
                out[entry.path] = (entry, hit)
            else:
                todo.append(entry)

        def hash_run(run: Sequence[TreeEntry]) -> list[HashedFile]:
            out = [hash_and_chunk(f"{e.root}/{e.path}", sink, listed_size=e.size) for e in run]
            if isinstance(sink, _PackingSink):
                sink.flush()  # this thread's last group frame
            return out

        try:
            # Runs of neighbouring files per task: one task per file costs more than a small
            # file's hash, and neighbours land in the same pack (fewer ranged GETs later).
            for run, results in zip(
                runs := _weighed_runs(todo, self._cpu_threads),
                self._cpu.map(hash_run, runs),
                strict=True,
            ):
                for entry, result in zip(run, results, strict=True):
                    out[entry.path] = (entry, result)
        except (FileChanged, OSError) as exc:
            raise SnapshotError(f"cannot read the code: {exc}") from exc
        ordered = {e.path: out[e.path] for e in entries}  # manifests list files sorted by path
        return ordered, {e.path for e in todo}

    def _manifest(
        self,
        name: str,
        snapshot_id: str,
        root: Path,
        inputs: SnapshotInputs,
        hashed: dict[str, tuple[TreeEntry, HashedFile]],
        parent: str | None,
        created_at: datetime,
        git: GitInfo | None,
    ) -> SnapshotManifest:
        files = tuple(
            file_entry(e, h.blake3, h.size if e.kind == "file" else None)
            for e, h in hashed.values()
        )
        chunk_map = {
            path: tuple(c.id for c in h.chunks)
            for path, (_, h) in hashed.items()
            if len(h.chunks) > 1
        }
        return SnapshotManifest(
            id=snapshot_id,
            name=name,
            created_at=created_at,
            created_by=f"{getpass.getuser()}@{socket.gethostname()}",
            parent=parent,
            source=Source(sandbox_id=inputs.sandbox_id, code_dir=str(root), node_id=inputs.node_id),
            labels=dict(inputs.labels),
            code=CodeManifest(
                files=files, git=git, exclude_patterns=tuple(inputs.exclude_patterns)
            ),
            chunk_map=chunk_map,
            deps=inputs.deps,
            env=self._env_record(inputs.env),
            kernel=dict(inputs.kernel) if inputs.kernel is not None else read_kernel_params(),
            gpu=inputs.gpu if inputs.gpu is not None else probe_gpus(),
            audit=self._store_audit(snapshot_id, inputs.audit_segment),
        )

    def _require_keys(self, what: str) -> KeyStore:
        if self.keys is None:
            raise StoreUnavailable(
                f"{what} needs Vault to hold its key: start the stack with `dsec up` "
                "or set DSEC_VAULT_ADDR and DSEC_VAULT_TOKEN"
            )
        return self.keys

    def _env_record(self, env: Mapping[str, str] | None) -> EnvRecord | None:
        if not env:
            return None
        key = self._require_keys("hashing environment values").env_hash_key()
        return EnvRecord(key_id=crypto.key_id(key), hashes=crypto.hash_env(env, key))

    def _store_audit(self, snapshot_id: str, segment: bytes | None) -> AuditRecord | None:
        if segment is None:
            return None
        keys = self._require_keys("the audit segment")
        key = crypto.new_key()
        blob = crypto.encrypt_segment(segment, key, snapshot_id)
        digest = blake3.blake3(blob).hexdigest()
        self.objects.put(audit_key(digest), blob)
        ref = keys.put_segment_key(snapshot_id, key)
        return AuditRecord(
            object_key=audit_key(digest),
            blake3=digest,
            size=len(blob),
            plaintext_size=len(segment),
            key_ref=ref,
        )

    def _signed_document(self, manifest: SnapshotManifest) -> tuple[bytes, str]:
        """The :class:`SignedManifest` document to store, and the manifest's digest."""
        signed_bytes = manifest.signed_bytes()
        signature = Signature(
            key_id=key_id_of(self._public),
            public_key=self._public.hex(),
            value=self._signing_key.sign(signed_bytes).signature.hex(),
            certificate=(self._certificate.model_dump(mode="json") if self._certificate else None),
        )
        # The SignedManifest layout, written without serializing the manifest a second time.
        doc = (
            b'{"manifest":' + signed_bytes + b',"signature":' + signature.model_dump_json().encode()
        )
        return doc + b"}", blake3.blake3(signed_bytes).hexdigest()

    def _take_back(self, key: str, doc: bytes) -> None:
        """Delete the manifest this create stored (only if it is still this create's: a
        slow PUT's name may have been deleted and taken again meanwhile); a failure is
        logged, as that manifest may name chunks a GC deleted (``dsec snapshot verify``)."""
        try:
            if self._stored_is(key, doc):
                self.objects.delete_many([key])
        except Exception as exc:
            log.error(
                "could not delete %s, stored while its create's lock was lost: it may name "
                "chunks a GC deleted; run `dsec snapshot verify` on it (%s)",
                key,
                exc,
            )

    def _write_summary(self, m: SnapshotManifest, digest: str, uploaded: int) -> None:
        summary = SnapshotSummary(
            name=m.name,
            id=m.id,
            created_at=m.created_at,
            series=m.source.series,
            parent=m.parent,
            files=len(m.code.files),
            bytes_total=m.code.total_size,
            bytes_uploaded=uploaded,
            manifest_digest=digest,
            git_commit=m.code.git.commit if m.code.git else None,
            labels=m.labels,
        )
        self.objects.put(summary_key(m.name), summary.model_dump_json().encode())

    # --- reading --------------------------------------------------------------------------

    def load(self, name: str) -> SnapshotManifest:
        """Return a snapshot's manifest after checking its signature.

        Raises:
            SnapshotNotFound: no such snapshot.
            VerificationFailed: the manifest is malformed, altered, or signed by an untrusted key.
        """
        return self._load_digest(name)[0]

    def _load_digest(self, name: str) -> tuple[SnapshotManifest, str]:
        """:meth:`load`, with the manifest's digest (its signed bytes serialized once)."""
        domain.validate_name(name)
        manifest, problems, digest = self._load_checked(name)
        if manifest is None or problems:
            raise VerificationFailed(f"snapshot {name!r}", problems)
        return manifest, digest

    def _load_with_index(self, name: str) -> tuple[SnapshotManifest, str]:
        """:meth:`_load_digest`, for a restore. A store that has read no pack index document
        yet (a cold node) reads the index meanwhile: the restore needs both before its first
        pack read, and both mostly wait on S3."""
        if self.index.docs:
            return self._load_digest(name)
        loading = self._pool.submit(self._load_digest, name)
        try:
            self.index.refresh(self._pool)
        except BaseException:
            wait([loading])
            loading.result()  # (its error first: a missing snapshot says more)
            raise
        return loading.result()

    def _load_checked(self, name: str) -> tuple[SnapshotManifest | None, list[str], str]:
        key = manifest_key(name)
        try:
            raw = self.objects.get(key)
        except ObjectMissing:
            raise SnapshotNotFound(f"no snapshot named {name!r}") from None
        raw_digest = blake3.blake3(raw).hexdigest()
        with self._checked_lock:
            known = self._checked.get(raw_digest)
        if known is not None and known.manifest.name == name and known.still_trusted():
            return known.manifest, [], known.digest  # (else checked again below)
        fast = self._check_stored_bytes(key, name, raw)
        if fast is not None:
            manifest, digest, valid_until = fast
            self._remember(raw_digest, manifest, digest, valid_until)
            return manifest, [], digest
        # Anything else is checked in full (which says what is wrong): parsed, serialized
        # again, and that checked against the signature.
        try:
            doc = SignedManifest.model_validate_json(raw)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            problem = f"manifest {key}: not a valid manifest (field {where!r}: {first['msg']})"
            return None, [problem], ""
        signed = doc.manifest.signed_bytes()
        problems, valid_until = self._signature_problems(key, doc.signature, signed)
        if doc.manifest.name != name:
            problems.append(f"manifest {key}: records name {doc.manifest.name!r}, not {name!r}")
        digest = blake3.blake3(signed).hexdigest()
        if not problems:
            self._remember(raw_digest, doc.manifest, digest, valid_until)
        return doc.manifest, problems, digest

    def _remember(
        self,
        raw_digest: str,
        manifest: SnapshotManifest,
        digest: str,
        valid_until: datetime | None = None,
    ) -> None:
        """Keep a checked manifest (the last :data:`_CHECKED_KEPT`), trusted until its
        signer's certificate expires (``valid_until``; ``None``: a key trusted directly)."""
        with self._checked_lock:
            self._checked[raw_digest] = _Checked(manifest, digest, valid_until)
            self._checked.move_to_end(raw_digest)
            while len(self._checked) > _CHECKED_KEPT:
                self._checked.popitem(last=False)

    def _check_stored_bytes(
        self, key: str, name: str, raw: bytes
    ) -> tuple[SnapshotManifest, str, datetime | None] | None:
        """A stored manifest checked as it was written (:meth:`_signed_document` embeds the
        signed bytes verbatim): the signature over those bytes first, then those very bytes
        parsed, once, with no second serialization. Returns the manifest, its digest and until
        when its signer is trusted; None for anything else (checked in full by the caller).

        Only the writer's exact layout takes this path: a document msgspec reads otherwise than
        pydantic would (a member repeated, bytes it skips unchecked) is checked in full, so
        ``verify`` and the GC, which parse the whole document, judge it as a restore does."""
        try:
            parts = _STORED.decode(raw)
        except (msgspec.DecodeError, RecursionError):  # (RecursionError: nested too deep)
            return None
        signed, stored_signature = bytes(parts.manifest), bytes(parts.signature)
        if raw != b'{"manifest":' + signed + b',"signature":' + stored_signature + b"}":
            return None
        try:
            signature = Signature.model_validate_json(stored_signature)
        except pydantic.ValidationError:
            return None
        problems, valid_until = self._signature_problems(key, signature, signed)
        if problems:
            return None
        try:
            manifest = parse_manifest(signed)
        except (ValueError, RecursionError):  # (pydantic's and msgspec's errors are both)
            return None
        if manifest.name != name:
            return None
        return manifest, blake3.blake3(signed).hexdigest(), valid_until

    def _signature_problems(
        self, key: str, sig: Signature, signed: bytes
    ) -> tuple[list[str], datetime | None]:
        """What is wrong with a manifest's signature, and until when its signer is trusted
        (its certificate's expiry; ``None`` for a key trusted directly, or no expiry)."""
        trusted, valid_until = self._trusted.get(sig.key_id), None
        if trusted is None:
            cert = self._certified(sig)
            if cert is not None:
                trusted, valid_until = bytes.fromhex(cert.public_key), cert.expires_at
        if trusted is None or trusted.hex() != sig.public_key:
            return [f"manifest {key}: signed by untrusted key {sig.key_id}"], None
        try:
            VerifyKey(trusted).verify(signed, bytes.fromhex(sig.value))
        except (BadSignatureError, ValueError):
            return [f"manifest {key}: signature does not match its content (altered)"], None
        return [], valid_until

    def _certified(self, sig: Signature) -> identity.Certificate | None:
        """The signer's certificate when the operator root issued it, still valid, for a role
        that takes snapshots (the snapshot service, a node agent)."""
        if sig.certificate is None or self._anchor is None:
            return None
        try:
            cert = identity.parse(sig.certificate)
            identity.check(cert, self._anchor)
        except identity.CertificateError:
            return None
        if cert.role not in SIGNER_ROLES or cert.key_id != sig.key_id:
            return None
        return cert

    def list_snapshots(self) -> list[SnapshotSummary]:
        """Every snapshot's index row, oldest first."""
        keys = sorted(self.objects.list(INDEX_PREFIX))
        rows = list(self._pool.map(self._summary, keys))
        return sorted((r for r in rows if r is not None), key=lambda s: (s.created_at, s.name))

    def _summary(self, key: str) -> SnapshotSummary | None:
        try:
            return SnapshotSummary.model_validate_json(self.objects.get(key))
        except (ObjectMissing, pydantic.ValidationError):
            return None  # deleted meanwhile, or a foreign object in the index

    def inspect(self, name: str) -> domain.Inspection:
        """What takes space in a snapshot (by directory and kind) and what dominates."""
        return domain.inspect_manifest(self.load(name))

    def diff(self, a: str, b: str) -> domain.SnapshotDiff:
        """Files, lines, dependencies, env and kernel parameters that differ from ``a`` to ``b``."""
        old, new = self.load(a), self.load(b)
        result = domain.diff_manifests(old, new)
        changed = self._with_line_diffs(
            result.code.changed, old, lambda f: self._file_bytes(new, f), a, b
        )
        code = domain.CodeDelta(result.code.added, result.code.removed, changed)
        return domain.SnapshotDiff(
            a=result.a, b=result.b, code=code, deps=result.deps,
            deps_fingerprint=result.deps_fingerprint, env=result.env, kernel=result.kernel,
            gpu=result.gpu,
        )  # fmt: skip

    def _with_line_diffs(
        self,
        changes: Sequence[domain.FileChange],
        old: SnapshotManifest,
        new_bytes: Callable[[FileEntry], bytes],
        old_label: str,
        new_label: str,
    ) -> tuple[domain.FileChange, ...]:
        def one(change: domain.FileChange) -> domain.FileChange:
            if change.old.blake3 == change.new.blake3 or "file" not in (
                change.old.kind,
                change.new.kind,
            ):
                return change
            if max(change.old.size, change.new.size) > domain.TEXT_DIFF_LIMIT:
                return _note(change, f"larger than {domain.TEXT_DIFF_LIMIT} bytes: no line diff")
            before = self._file_bytes(old, change.old) if change.old.kind == "file" else b""
            after = new_bytes(change.new) if change.new.kind == "file" else b""
            text, note = domain.text_diff(
                change.path, before, after, old_label=old_label, new_label=new_label
            )
            return domain.FileChange(change.path, change.old, change.new, text, note)

        shown = list(self._pool.map(one, changes[:_MAX_LINE_DIFFS]))
        rest = [_note(c, "too many changed files: no line diff") for c in changes[_MAX_LINE_DIFFS:]]
        return tuple(shown + rest)

    def _fetch_chunks(
        self,
        ids: Iterable[str],
        problems: dict[str, str] | None = None,
        *,
        keep: bool = True,
        parallel: bool = True,
    ) -> dict[str, bytes]:
        """Fetch and check chunks: from packs by few ranged GETs in parallel, else (snapshots
        from before packs) from their own ``chunks/`` objects.

        Without ``problems``, the first bad chunk raises; with it, each bad chunk's problem is
        put there (by chunk id) and the others are returned (``keep=False``: only checked).
        ``parallel=False`` reads one range after the other in the calling thread (for callers
        that run on the worker pool themselves: waiting on it from there could deadlock).

        Raises:
            VerificationFailed: a chunk is missing, altered or undecodable (without ``problems``).
        """
        wanted = set(ids)
        out: dict[str, bytes] = {}
        found: dict[str, str] = {}
        pool = self._pool if parallel else None
        located, unknown = self._locate(wanted, refreshed=False, pool=pool)
        for attempt in range(2):
            spans = plan_reads(located.items())
            readers = self._cpu if parallel else None  # decompressing and hashing: CPU work
            missing_packs = self._read_spans(spans, out, found, keep, readers)
            if not missing_packs:
                break
            gone = {c for c, loc in located.items() if loc.pack in missing_packs}
            if attempt == 0:
                self.index.refresh(pool)  # a GC may have repacked them: look again
                moved, more = self._locate(gone, refreshed=True, pool=pool)
                unknown |= more
                located = {c: loc for c, loc in moved.items() if loc.pack not in missing_packs}
                gone -= located.keys() | more
            for chunk_id in gone:
                loc = located.get(chunk_id) or self.index.lookup(chunk_id)
                where = loc.pack if loc is not None else PACK_PREFIX
                found[chunk_id] = f"{where}: missing (holds chunk {chunk_id})"
            if attempt == 0 and not located:
                break
        legacy = sorted(unknown)
        results = (pool.map if pool is not None else map)(self._legacy_chunk, legacy)
        for chunk_id, result in zip(legacy, results, strict=True):
            if isinstance(result, bytes):
                if keep:
                    out[chunk_id] = result
            else:
                found[chunk_id] = result
        if problems is None and found:
            chunk_id, problem = next(iter(sorted(found.items())))
            raise VerificationFailed(problem.split(": ", 1)[0], [problem.split(": ", 1)[1]])
        if problems is not None:
            problems.update(found)
        return out

    def _locate(
        self, ids: set[str], *, refreshed: bool, pool: Executor | None = None
    ) -> tuple[dict[str, Loc], set[str]]:
        """Where each chunk is per the pack index (read again once when some are unknown)."""
        located: dict[str, Loc] = {}
        unknown: set[str] = set()
        for chunk_id in ids:
            loc = self.index.lookup(chunk_id)
            if loc is None:
                unknown.add(chunk_id)
            else:
                located[chunk_id] = loc
        if unknown and not refreshed:
            self.index.refresh(pool)
            more, unknown = self._locate(unknown, refreshed=True, pool=pool)
            located.update(more)
        return located, unknown

    def _read_spans(
        self,
        spans: list[Span],
        out: dict[str, bytes],
        problems: dict[str, str],
        keep: bool,
        pool: Executor | None,
    ) -> set[str]:
        """Read ``spans`` (in parallel on ``pool``) into ``out`` (bad chunks into ``problems``);
        return the packs found missing."""
        mapper = pool.map if pool is not None else map
        read = mapper(lambda span: self._read_span(span, out, problems, keep), spans)
        return {span.pack for span, gone in zip(spans, read, strict=True) if gone}

    def _read_span(
        self,
        span: Span,
        out: dict[str, bytes],
        problems: dict[str, str],
        keep: bool,
        views: bool = False,
        cached: bool = True,
        early: Future[_SpanRead] | None = None,
    ) -> bool:
        """One ranged GET, or a read of the node's copy (:attr:`pack_cache`): each chunk
        decompressed (from a view of the body, not a copy) and checked, into ``out`` or
        ``problems``; True when the pack is missing. ``keep=False`` (a verify) reads what the
        object store holds, never a copy. A copy in which a chunk does not check is dropped
        and the pack read from the store again (``cached=False``); a read of a pack from its
        start in which every chunk checked is kept as a copy. ``views``: a chunk of a group
        frame goes into ``out`` as a view of the frame's content (no copy; for callers that
        only write or join the bytes). ``early``: the span's bytes, read ahead by
        :meth:`_span_bytes` (with the pack cache when ``keep``)."""
        keeper = self.pack_cache if keep else None
        read = (
            early.result()
            if early is not None
            else self._span_bytes(span, keeper if cached else None, keep)
        )
        if read is None:
            return True
        body, source = read
        own = source == "own"  # (checked whole: no chunk is hashed)
        fetched = body if source == "s3" else None  # (a copy may be kept once it checked)
        view = memoryview(body)
        decompressor = _decompressor()
        last = -1
        content: bytes | memoryview | None = None
        bad = False
        for chunk_id, offset, length, inner, size in span.chunks:
            if offset != last:  # the chunks of a group frame come one after the other
                last = offset
                frame = view[offset - span.start : offset - span.start + length]
                try:
                    # A header may claim any size, which decompress() would allocate first.
                    if zstandard.get_frame_parameters(frame).content_size > _FRAME_CONTENT_MAX:
                        content = None
                    else:
                        content = decompressor.decompress(frame)
                        if views:
                            content = memoryview(content)
                except (zstandard.ZstdError, MemoryError, ValueError):
                    content = None
            if content is None:
                problems[chunk_id] = (
                    f"{span.pack}@{offset}: chunk {chunk_id} is not a zstd frame (altered)"
                )
                bad = True
                continue
            data = content if size < 0 else content[inner : inner + size]
            if not own and blake3.blake3(data).hexdigest() != chunk_id:
                problems[chunk_id] = (
                    f"{span.pack}@{offset}: chunk {chunk_id} content does not match its hash"
                    " (altered)"
                )
                bad = True
            elif keep:
                out[chunk_id] = data  # type: ignore[assignment]  # (a view only with views)
        if bad and fetched is None and keeper is not None:
            # The node's copy did not check: dropped, and the pack read from the store again.
            keeper.drop(span.pack)
            for chunk_id, *_ in span.chunks:
                problems.pop(chunk_id, None)
                out.pop(chunk_id, None)
            return self._read_span(span, out, problems, keep, views, cached=False)
        if (
            keeper is not None
            and fetched is not None
            and not bad
            and span.start == 0
            and len(fetched) == span.end - span.start  # (not what an odd S3 sent beyond)
        ):
            keeper.keep(span.pack, bytes(fetched))  # the next read of this pack stays local
        return False

    def _span_bytes(self, span: Span, copies: PackCache | None, counted: bool) -> _SpanRead:
        """``span``'s bytes and where they came from: this node's own pack, checked whole
        (:func:`_own_pack`); a copy whose chunks are still to be checked; or S3 (``copies``:
        ``None`` for S3 only). ``None``: the pack is missing. ``counted``: a read of a restore,
        rollback or diff, counted in ``dsec_snapshot_pack_reads_total``."""
        wanted = span.end - span.start
        if copies is not None:
            own = _own_pack(copies, span)
            if own is not None and own is not _DISAGREES:
                count_read(from_cache=True)
                return own, "own"
            # (the index places a chunk elsewhere than this node's genuine pack says: S3, whose
            # chunks are checked, and the copy stays)
            copy = copies.read(span.pack, span.start, wanted) if own is None else None
            if copy is not None:
                count_read(from_cache=True)
                return copy, "copy"
        try:
            body = self.objects.get_range(span.pack, span.start, wanted)
        except ObjectMissing:
            return None
        if counted:
            count_read(from_cache=False)
        return body, "s3"

    def _keep_own(self, key: str, body: bytes) -> None:
        """The packer's hand-over of a pack it stored: kept as this node's own copy."""
        assert self.pack_cache is not None
        self.pack_cache.keep(key, body, own=True)

    def _legacy_chunk(self, chunk_id: str) -> bytes | str:
        """A chunk stored as its own object (before packs); a problem text when bad."""
        key = chunk_key(chunk_id)
        try:
            body = self.objects.get(key)
        except ObjectMissing:
            return f"{key}: missing (in no pack either)"
        try:
            data = _decompressor().decompress(body)
        except zstandard.ZstdError:
            return f"{key}: not a zstd frame (altered)"
        if blake3.blake3(data).hexdigest() != chunk_id:
            return f"{key}: content does not match its hash (altered)"
        return data

    def _file_bytes(self, manifest: SnapshotManifest, entry: FileEntry) -> bytes:
        """Reassemble a file of a snapshot, checking every chunk and the whole file's hash."""
        if entry.kind == "symlink":
            return os.fsencode(entry.target or "")
        ids = manifest.chunks_of(entry)
        chunks = self._fetch_chunks(ids, parallel=False)  # callers run on the pool
        return _assemble(entry, ids, chunks)

    # --- verify ---------------------------------------------------------------------------

    def verify(self, name: str) -> VerifyReport:
        """Check the signature and every object the snapshot references; name each problem.

        Raises:
            SnapshotNotFound: no such snapshot.
        """
        domain.validate_name(name)
        manifest, problems, digest = self._load_checked(name)
        if manifest is None:
            return VerifyReport(name, None, 1, tuple(problems))
        users: dict[str, list[str]] = {}
        for entry in manifest.code.files:
            for chunk_id in manifest.chunks_of(entry):
                users.setdefault(chunk_id, []).append(entry.path)

        bad: dict[str, str] = {}
        self._fetch_chunks(users, bad, keep=False)
        problems += [f"{bad[c]} (used by {', '.join(users[c][:3])})" for c in sorted(bad)]
        problems += self._multi_chunk_problems(manifest)
        problems += self._audit_problems(manifest)
        checked = 1 + len(users) + (1 if manifest.audit else 0)
        return VerifyReport(name, digest, checked, tuple(problems))

    def _multi_chunk_problems(self, manifest: SnapshotManifest) -> list[str]:
        split = [f for f in manifest.code.files if f.path in manifest.chunk_map]

        def check(entry: FileEntry) -> str | None:
            try:
                self._file_bytes(manifest, entry)
            except VerificationFailed as exc:
                return f"file {entry.path}: {exc}"
            return None

        return [p for p in self._pool.map(check, split) if p is not None]

    def _audit_problems(self, manifest: SnapshotManifest) -> list[str]:
        audit = manifest.audit
        if audit is None:
            return []
        try:
            blob = self.objects.get(audit.object_key)
        except ObjectMissing:
            return [f"{audit.object_key} (audit segment): missing"]
        if blake3.blake3(blob).hexdigest() != audit.blake3:
            return [f"{audit.object_key} (audit segment): content does not match its hash"]
        return []

    def read_audit_segment(self, name: str) -> bytes:
        """Decrypt a snapshot's audit segment (needs the key from Vault).

        Raises:
            SnapshotNotFound: no snapshot, or it has no audit segment.
            VerificationFailed: the segment was altered or its key is gone.
        """
        manifest = self.load(name)
        audit = manifest.audit
        if audit is None:
            raise SnapshotNotFound(f"snapshot {name!r} has no audit segment")
        keys = self._require_keys("reading the audit segment")
        try:
            blob = self.objects.get(audit.object_key)
            key = keys.get_segment_key(manifest.id)
            return crypto.decrypt_segment(blob, key, manifest.id)
        except ObjectMissing:
            raise VerificationFailed(audit.object_key, ["missing"]) from None
        except KeyMissing:
            raise VerificationFailed(audit.key_ref, ["key is gone (snapshot deleted?)"]) from None
        except crypto.DecryptionFailed:
            raise VerificationFailed(audit.object_key, ["does not decrypt (altered)"]) from None

    # --- restore and code checks ----------------------------------------------------------

    def restore(self, name: str, dest: Path, *, sync: bool = False) -> RestoreResult:
        """Materialize a snapshot's code tree at ``dest``; every byte is hash-checked.

        Args:
            name: The snapshot.
            dest: Without ``sync``: a directory to create (absent or empty); it appears only
                when the whole tree was written. With ``sync`` (rollback): an existing
                directory made identical to the snapshot by rewriting only differing files
                (each replaced atomically) and removing files the snapshot lacks; files the
                bundle excludes (``.venv``, ignored files...) are left alone.
            sync: See ``dest``.

        Raises:
            SnapshotNotFound: no such snapshot.
            VerificationFailed: the manifest or an object is altered or missing (nothing of the
                tree is left behind without ``sync``).
            InvalidInput: ``dest`` is not usable.
        """
        started = time.perf_counter()
        with _no_gc():  # thousands of short-lived records (see _no_gc)
            dest = Path(dest).absolute()
            # A rollback reads the tree and its stat cache while the manifest is fetched and
            # checked (listed without the snapshot's own exclude patterns, known only then: the
            # listing is used when it has none, else the tree is listed again with them).
            early = (
                (self._pool.submit(list_tree, dest), self._pool.submit(self._stat_cache, dest))
                if sync and dest.is_dir()
                else None
            )
            manifest, digest = self._load_with_index(name)
            if sync:
                written, removed, size = self._sync_into(manifest, dest, early)
            else:
                written, size = self._restore_fresh(manifest, dest)
                removed = 0
        return RestoreResult(
            manifest=manifest,
            manifest_digest=digest,
            dest=dest,
            files_written=written,
            files_removed=removed,
            bytes_written=size,
            duration_s=time.perf_counter() - started,
        )

    def _restore_fresh(self, manifest: SnapshotManifest, dest: Path) -> tuple[int, int]:
        if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
            raise InvalidInput(f"{dest}: exists and is not an empty directory")
        dest.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}.restore-"))
        try:
            size = self._write_files(manifest, staging, manifest.code.files)
            staging.chmod(0o755)
            if dest.exists():
                dest.rmdir()
            staging.rename(dest)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return len(manifest.code.files), size

    def _sync_into(
        self,
        manifest: SnapshotManifest,
        dest: Path,
        early: tuple[Future[list[TreeEntry]], Future[StatCache]] | None,
    ) -> tuple[int, int, int]:
        """``early``: the tree's listing and stat cache, started by :meth:`restore` (None: ``dest``
        was no directory then)."""
        if early is None or not dest.is_dir():
            raise InvalidInput(f"{dest}: not a directory (rollback needs the existing code dir)")
        listed, cache_read = early
        try:
            if manifest.code.exclude_patterns:
                listed.cancel()
                current_entries = list_tree(dest, manifest.code.exclude_patterns)
            else:
                current_entries = listed.result()
        except BundleError as exc:
            raise InvalidInput(str(exc)) from exc
        cache = cache_read.result()
        # Each file's hash: from the stat cache when its stat data is unchanged, else read.
        digests: dict[str, str] = {}
        todo: list[TreeEntry] = []
        for entry in current_entries:
            if entry.kind == "symlink":
                target = os.fsencode(entry.target or "")
                digests[entry.path] = blake3.blake3(target).hexdigest()
            elif (digest := cache.digest(entry)) is not None:
                digests[entry.path] = digest
            else:
                todo.append(entry)
        if todo:
            hashed, _ = self._hash_all(todo, None)
            digests.update((path, h.blake3) for path, (_, h) in hashed.items())
        current = {e.path: e for e in current_entries}
        wanted = manifest.code.by_path()
        stale = [
            entry
            for path, entry in wanted.items()
            if (here := current.get(path)) is None
            or (entry.kind, entry.blake3, entry.mode, entry.target)
            != (here.kind, digests[path], here.mode, here.target)
        ]
        extra = [current[p] for p in current if p not in wanted]
        # The tree may be in use (a sandbox's code dir): every write and removal below one fd
        # of it, no parent followed as a link (place_in, remove_in).
        root_fd = os.open(dest, _DIR_OPEN)
        try:
            size = self._write_files(manifest, dest, stale, root_fd)
            for entry in extra:
                remove_in(root_fd, entry.path)
        finally:
            os.close(root_fd)
        return len(stale), len(extra), size

    def _write_files(
        self,
        manifest: SnapshotManifest,
        root: Path,
        entries: Sequence[FileEntry],
        root_fd: int | None = None,
    ) -> int:
        """Write ``entries`` below ``root``: new files into a fresh tree, or (``root_fd``, an fd
        of ``root``: a rollback) each replaced atomically below that fd."""
        return sum(
            self._write_batch(manifest, root, batch, root_fd)
            for batch in _batches(entries, _RESTORE_BATCH)
        )

    def _write_batch(
        self,
        manifest: SnapshotManifest,
        root: Path,
        entries: list[FileEntry],
        root_fd: int | None,
    ) -> int:
        """Write files while their packs are read, pipelined: each ranged GET is one task that
        decompresses and checks its chunks and then writes, in the same thread, every file
        whose last chunk it brought (no hand-off; a file starts as soon as its bytes are in).
        The GETs start first; the target paths (and directories) are made meanwhile.
        ``root_fd``: as :meth:`_write_files`'s."""
        chunk_map = manifest.chunk_map  # (manifest.chunks_of, inlined: 5,000 calls a restore)
        ids_of = [
            chunk_map.get(e.path, (e.blake3,)) if e.kind == "file" and e.size != 0 else ()
            for e in entries
        ]
        located, unknown = self._locate(
            {c for row in ids_of for c in row}, refreshed=False, pool=self._pool
        )
        chunks: dict[str, bytes] = self._fetch_chunks(unknown) if unknown else {}
        # Spans of at most _RESTORE_SPAN: many small tasks start writing sooner and share the
        # cores evenly; neighbours within a span still come in one GET.
        spans = plan_reads(located.items(), limit=_RESTORE_SPAN)
        # Big spans (a full restore) are mostly decompressing, hashing and writing: as many
        # tasks as cores. Many small ones (a rollback's scattered files) mostly wait on S3.
        span_bytes = sum(s.end - s.start for s in spans)
        small = len(spans) > self._cpu_threads and span_bytes < len(spans) * (256 << 10)
        runner = self._pool if small else self._cpu
        # On the CPU threads, the spans' S3 reads run ahead on the I/O pool, in span order,
        # while the bytes read and not yet checked fit _READ_AHEAD_BYTES, so a core never
        # waits on S3 while there is work for it. (A pack this node holds a copy of is read
        # by its task: that read is a local one.)
        reads: dict[int, Future[_SpanRead]] = {}  # started and not used yet, by span number
        reads_lock = threading.Lock()
        next_read = 0  # the next span whose read is to start (or to be left to its task)
        read_bytes = 0  # bytes read ahead and not used yet
        keeper = self.pack_cache

        def read_ahead(number: int = -1) -> Future[_SpanRead] | None:
            """Start reads while they fit (always up to span ``number``, which a task needs
            now); ``number``'s read."""
            nonlocal next_read, read_bytes
            if runner is not self._cpu:
                return None
            with reads_lock:
                while next_read < len(spans):
                    span = spans[next_read]
                    width = span.end - span.start
                    if keeper is not None and keeper.holds(span.pack):
                        pass  # (read by its task)
                    elif (
                        next_read > number and read_bytes and read_bytes + width > _READ_AHEAD_BYTES
                    ):
                        break
                    else:
                        reads[next_read] = self._pool.submit(self._span_bytes, span, keeper, True)
                        read_bytes += width
                    next_read += 1
                return reads.get(number)

        def used(number: int) -> None:
            nonlocal read_bytes
            with reads_lock:
                del reads[number]  # (its body freed with the task that used it)
                read_bytes -= spans[number].end - spans[number].start
            read_ahead()

        # Each file waits for its distinct chunks that a span brings: the files waiting on a
        # chunk, and how many chunks each file still waits for (none: written at once).
        waiting: dict[str, list[int]] = {}
        left: list[int] = []
        ready: list[int] = []
        for n, row in enumerate(ids_of):
            count = 0
            for chunk_id in row if len(row) < 2 else set(row):
                if chunk_id in located:  # (else fetched on its own already)
                    waiting.setdefault(chunk_id, []).append(n)
                    count += 1
            left.append(count)
            if not count:
                ready.append(n)
        problems: dict[str, str] = {}
        planned = threading.Event()  # set once `batch` below is complete
        batch: list[tuple[FileEntry, str]] = []
        skipped: list[int] = []
        lock = threading.Lock()
        umask = _umask()

        def write(files: Iterable[int]) -> int:
            size = 0
            fresh: list[tuple[str, bytes, int, bool]] = []  # new files, for _write_new
            for n in files:
                entry, target = batch[n]
                if any(c not in chunks for c in ids_of[n]):
                    skipped.append(n)  # a chunk is bad or its pack moved: after the reads
                    continue
                data = _assemble(entry, ids_of[n], chunks) if entry.kind == "file" else b""
                if root_fd is not None:  # a rollback: every parent opened without a link
                    place_in(root_fd, entry, data, umask=umask)
                    size += len(data)
                elif entry.kind != "file" or _write_new is None:
                    place(entry, target, data, replace=False, umask=umask)
                    size += len(data)
                else:
                    mode = entry.mode
                    fresh.append((target, data, mode, umask is not None and not mode & umask))
            if fresh:
                size += _write_new(fresh)
            return size

        def fetch_and_write(number: int) -> int:
            span = spans[number]
            # (a missing pack: fetched again below). Views of group frames for a fresh
            # restore, which writes most members of each frame; a rollback's few files keep
            # copies, not whole frames.
            early = read_ahead(number)
            try:
                self._read_span(span, chunks, problems, True, views=root_fd is None, early=early)
            finally:
                if early is not None:
                    used(number)
            planned.wait()
            if len(batch) != len(entries):
                return 0  # the targets could not be made: the restore fails
            done: list[int] = []
            with lock:
                for chunk_id, *_ in span.chunks:
                    for n in waiting[chunk_id]:
                        left[n] -= 1
                        if left[n] == 0:
                            done.append(n)
            return write(done)

        read_ahead()
        tasks = [runner.submit(fetch_and_write, number) for number in range(len(spans))]
        try:
            try:
                batch.extend(_targets(root, entries))
            finally:
                planned.set()  # (the tasks write nothing when the targets are incomplete)
            size = write(ready)  # links and empty files (no chunks) meanwhile
            size += sum(t.result() for t in tasks)
        except BaseException:
            for task in tasks:  # every writer stopped before the caller removes the tree
                task.cancel()
            wait(tasks)
            with reads_lock:
                early_reads = list(reads.values())
            for read in early_reads:  # (and no read left running)
                read.cancel()
            wait(early_reads)
            raise
        if problems:
            problem = min(problems.items())[1]
            where, _, what = problem.partition(": ")
            raise VerificationFailed(where, [what])
        if skipped:  # chunks of packs a GC moved meanwhile: look them up again
            again = {c for n in skipped for c in ids_of[n] if c not in chunks}
            chunks.update(self._fetch_chunks(again))
            redo, skipped[:] = sorted(skipped), []
            size += write(redo)
            if skipped:
                raise VerificationFailed(batch[skipped[0]][0].path, ["a chunk could not be read"])
        return size

    def verify_code_dir(self, name: str, directory: Path) -> CodeCheck:
        """Compare ``directory`` with a snapshot's code, with line diffs of changed files.

        The directory is read with the snapshot's own exclude patterns, so what the snapshot
        left out (``.venv``, ignored files) does not count as a difference.

        Raises:
            SnapshotNotFound: no such snapshot.
            VerificationFailed: the snapshot itself is altered.
            InvalidInput: ``directory`` is not a directory.
        """
        manifest = self.load(name)
        root = Path(directory).absolute()
        try:
            entries = list_tree(root, manifest.code.exclude_patterns)
        except BundleError as exc:
            raise InvalidInput(str(exc)) from exc
        hashed, _ = self._hash_all(entries, self._stat_cache(root))
        actual = CodeManifest(
            files=tuple(
                file_entry(e, h.blake3, h.size if e.kind == "file" else None)
                for e, h in hashed.values()
            )
        )
        delta = domain.compare_code(manifest.code, actual)
        local = {e.path: e for e, _ in hashed.values()}
        changed = self._with_line_diffs(
            delta.changed, manifest, lambda f: local_bytes(local[f.path]), name, str(root)
        )
        return CodeCheck(name, root, domain.CodeDelta(delta.added, delta.removed, changed))

    def require_code_match(self, name: str, directory: Path) -> CodeCheck:
        """:meth:`verify_code_dir`, raising when anything differs (``run --snapshot --code``).

        Raises:
            VerificationFailed: one problem per mismatch line (file, then its line diff).
        """
        check = self.verify_code_dir(name, directory)
        if not check.ok:
            raise VerificationFailed(
                f"{directory} does not match snapshot {name!r}", check.describe()
            )
        return check

    def check_gpu(self, name: str, current: GpuRecord | None = None) -> domain.GpuCheck:
        """Compare the snapshot's GPU models with this node's (differ: compatibility mode)."""
        return domain.check_gpu(self.load(name).gpu, current or probe_gpus())

    # --- lifecycle ------------------------------------------------------------------------

    def delete(self, name: str) -> None:
        """Delete a snapshot's manifest, index row and audit key (chunks go at the next GC).

        Raises:
            SnapshotNotFound: no such snapshot.
        """
        domain.validate_name(name)
        try:
            raw = self.objects.get(manifest_key(name))
        except ObjectMissing:
            raise SnapshotNotFound(f"no snapshot named {name!r}") from None
        try:
            manifest: SnapshotManifest | None = SignedManifest.model_validate_json(raw).manifest
        except pydantic.ValidationError:
            manifest = None  # a damaged manifest can still be deleted
        self.objects.delete_many([summary_key(name), manifest_key(name)])
        if manifest is not None and manifest.audit is not None and self.keys is not None:
            self.keys.delete_segment_key(manifest.id)

    def apply_retention(
        self,
        policy: domain.RetentionPolicy,
        *,
        series: str | None = None,
        now: datetime | None = None,
        dry_run: bool = False,
    ) -> list[str]:
        """Delete the snapshots ``policy`` does not keep (of one series, or of all)."""
        rows = [s for s in self.list_snapshots() if series is None or s.series == series]
        expired = domain.select_expired(rows, policy, now or datetime.now(UTC))
        if not dry_run:
            for name in expired:
                self.delete(name)
        return expired

    def run_periodic(
        self,
        policy: domain.PeriodicPolicy,
        inputs: SnapshotInputs,
        *,
        now: datetime | None = None,
    ) -> CreateResult | None:
        """Take the periodic snapshot of ``inputs`` if one is due, then apply retention.

        The service calls this on a timer per sandbox; it returns ``None`` when not yet due.
        """
        now = now or datetime.now(UTC)
        series = Source(
            sandbox_id=inputs.sandbox_id,
            code_dir=str(Path(inputs.code_dir).absolute()),
            node_id=inputs.node_id,
        ).series
        last = max((s.created_at for s in self._periodic(series, policy)), default=None)
        if not domain.is_due(last, now, policy.interval):
            return None
        labels = {**inputs.labels, "periodic": policy.name_prefix}
        name = domain.periodic_name(policy.name_prefix, now)
        result = self.create(name, replace(inputs, labels=labels), now=now)
        for expired in domain.select_expired(self._periodic(series, policy), policy.retention, now):
            self.delete(expired)
        return result

    def _periodic(self, series: str, policy: domain.PeriodicPolicy) -> list[SnapshotSummary]:
        return [
            s
            for s in self.list_snapshots()
            if s.series == series and s.labels.get("periodic") == policy.name_prefix
        ]

    def gc(
        self,
        *,
        grace: timedelta = timedelta(hours=1),
        dry_run: bool = False,
        repack_below: float = REPACK_BELOW,
    ) -> GcReport:
        """Free what no snapshot references (objects older than ``grace``) and repack.

        A pack none of whose chunks is referenced is deleted; one whose live bytes fall below
        ``repack_below`` of it has its live chunks copied (checked) into new packs. Steps, each
        safe to crash after: (1) new packs are written; (2) one index document listing every
        kept and new pack and superseding the documents read is written; (3) the superseded
        documents, then (4) the dead and repacked packs, are deleted. Packs in no index (a
        snapshot that crashed before its index, a GC before step 2) go after ``grace``;
        pre-pack ``chunks/`` objects and audit segments are collected as before.

        Raises:
            SnapshotError: a manifest cannot be read, or a live chunk does not check; nothing
                is deleted then.
        """
        # One GC of this store at a time in this process (the service's periodic retention
        # and a user's delete both collect): two repacking the same packs apart would each
        # index their own copy and delete the other's source.
        with self._gc_lock:
            if dry_run:  # deletes nothing: no lock needed
                return self._gc(grace=grace, dry_run=dry_run, repack_below=repack_below)
            # And in no other process while any create runs (see dsec_snapstore.locks).
            held = self.locks.acquire("exclusive", self._gc_wait_s, "snapshot gc")
            try:
                with contextlib.suppress(StoreUnavailable):  # crashed holders' locks
                    self.objects.delete_many(self.locks.stale())
                return self._gc(grace=grace, dry_run=dry_run, repack_below=repack_below, held=held)
            finally:
                held.release()

    def _gc(
        self, *, grace: timedelta, dry_run: bool, repack_below: float, held: Held | None = None
    ) -> GcReport:
        def still_held() -> None:  # before each step that deletes or supersedes
            if held is not None:
                held.check("snapshot gc")

        now = datetime.now(UTC)
        names = [
            k[len(MANIFEST_PREFIX) : -len(".json")]
            for k in self.objects.list(MANIFEST_PREFIX)
            if k.endswith(".json")
        ]
        live: set[str] = set()
        audits: set[str] = set()
        for manifest in self._pool.map(self._manifest_for_gc, names):
            if manifest is None:
                continue  # deleted since the listing: its chunks are no longer kept for it
            live |= manifest.all_chunks()
            if manifest.audit is not None:
                audits.add(manifest.audit.object_key)
        self.index.refresh(self._pool)
        read_docs, effective = self.index.read()
        packs_stored = self.objects.list(PACK_PREFIX)
        legacy = self.objects.list(CHUNK_PREFIX)
        audit_stored = self.objects.list(AUDIT_PREFIX)

        # Each pack's entries (first document wins) and which chunks it keeps alive.
        entries: dict[str, list[list[Any]]] = {}
        for key in effective:
            for pack, rows in read_docs[key].packs.items():
                entries.setdefault(pack, [list(r) for r in rows])
        home: dict[str, str] = {}  # live chunk -> the one pack that keeps it
        for pack in sorted(entries, key=lambda p: (p not in packs_stored, p)):
            for chunk_id, *_ in entries[pack]:
                if chunk_id in live and pack in packs_stored:
                    home.setdefault(chunk_id, pack)

        def old(info_time: datetime) -> bool:
            return now - info_time > grace

        keep: list[str] = []
        repack: list[str] = []
        drop: list[str] = []
        dead_chunks = 0
        for pack, rows in sorted(entries.items()):
            info = packs_stored.get(pack)
            if info is None:
                continue  # listed but gone: the new index leaves it out
            homed = {r[0] for r in rows if home.get(r[0]) == pack}
            total, live_bytes = _frame_bytes(rows, homed)
            if not old(info.last_modified) or live_bytes / total >= repack_below:
                keep.append(pack)
                continue
            dead_chunks += sum(1 for r in rows if home.get(r[0]) != pack)
            (repack if live_bytes else drop).append(pack)
        orphans = [k for k, i in packs_stored.items() if k not in entries and old(i.last_modified)]
        legacy_dead = domain.collectable(
            {k: i.last_modified for k, i in legacy.items()},
            {chunk_key(c) for c in live if c not in home},
            now,
            grace,
        )
        audit_dead = domain.collectable(
            {k: i.last_modified for k, i in audit_stored.items()}, audits, now, grace
        )
        doomed = sorted(repack + drop + orphans) + legacy_dead + audit_dead
        sizes = {**packs_stored, **legacy, **audit_stored}
        freed = sum(sizes[k].size for k in doomed)
        written: dict[str, int] = {}
        if not dry_run and (repack or drop or len(effective) > 1):  # > 1: compact the index
            written = self._repack(repack, entries, home, keep, read_docs, still_held)
            # A pack written again with the same content has the same key: it stays.
            doomed = [k for k in doomed if k not in written]
        elif not dry_run and len(read_docs) > len(effective):
            # Documents a durable one supersedes (a GC stopped after its step 2).
            still_held()
            self.objects.delete_many(sorted(read_docs.keys() - set(effective)))
            self.index.refresh(self._pool)
        if not dry_run:
            for start in range(0, len(doomed), _GC_DELETE_BATCH):  # (a long delete: checked)
                still_held()
                self.objects.delete_many(doomed[start : start + _GC_DELETE_BATCH])
            if self.pack_cache is not None:  # (their copies would only take room here)
                for key in doomed:
                    self.pack_cache.drop(key)
        referenced = {*(home.values()), *(chunk_key(c) for c in live if c not in home), *audits}
        stored_keys = sizes.keys()
        return GcReport(
            objects_stored=len(stored_keys),
            objects_referenced=len(referenced & stored_keys),
            deleted=tuple(doomed),
            bytes_freed=max(0, freed - sum(written.values())),
            dry_run=dry_run,
            chunks_removed=dead_chunks + len(legacy_dead),
            packs_repacked=len(repack),
        )

    def _repack(
        self,
        repack: list[str],
        entries: dict[str, list[list[Any]]],
        home: dict[str, str],
        keep: list[str],
        read_docs: Mapping[str, IndexDoc],
        still_held: Callable[[], None],
    ) -> dict[str, int]:
        """Steps 1-3 of :meth:`gc`: copy the live chunks of ``repack`` into new packs, write
        the index that supersedes every document read, delete those; return the new packs
        and their sizes."""
        moving = [
            (row[0], loc_of(pack, row))
            for pack in repack
            for row in entries[pack]
            if home.get(row[0]) == pack
        ]
        packer = Packer(self.objects, self._uploader.queue(), target=self._pack_target)
        bad: dict[str, str] = {}

        def copy(span: Span) -> None:
            try:
                body = self.objects.get_range(span.pack, span.start, span.end - span.start)
            except ObjectMissing:
                bad[span.pack] = f"{span.pack}: missing"
                return
            view = memoryview(body)
            frames: dict[tuple[int, int], list[Member]] = {}
            for chunk_id, offset, length, inner, size in span.chunks:
                frames.setdefault((offset, length), []).append((chunk_id, inner, size))
            for (offset, length), members in frames.items():
                frame = bytes(view[offset - span.start : offset - span.start + length])
                try:
                    content = _decompressor().decompress(frame)
                except zstandard.ZstdError:
                    content = b""
                kept: list[tuple[str, bytes]] = []
                for chunk_id, inner, size in members:
                    data = content if size < 0 else content[inner : inner + size]
                    if blake3.blake3(data).hexdigest() != chunk_id:
                        bad[chunk_id] = f"{span.pack}: chunk {chunk_id} does not check"
                    elif packer.claim(chunk_id):
                        kept.append((chunk_id, data))
                if len(kept) == 1 and members[0][2] < 0:
                    packer.add(kept[0][0], frame)  # copied as stored: no recompression
                elif kept:  # a group's live chunks, compressed again without the dead ones
                    _add_group(packer, kept)

        try:
            for _ in self._pool.map(copy, plan_reads(moving)):
                pass
        finally:
            new_packs = packer.finish()
        if bad:
            raise SnapshotError(
                "gc stopped: live chunks do not check, nothing was deleted: "
                + "; ".join(sorted(bad.values())[:5])
            )
        packs = {p: entries[p] for p in keep}
        packs.update(new_packs)
        still_held()  # (the copies took a while)
        self.index.write(IndexDoc(packs, tuple(sorted(read_docs))))
        self.objects.delete_many(sorted(read_docs))
        self.index.refresh(self._pool)
        return {k: packer.sizes[k] for k in new_packs}

    def _manifest_for_gc(self, name: str) -> SnapshotManifest | None:
        """A listed snapshot's manifest (``None``: deleted since it was listed)."""
        key = manifest_key(name)
        try:
            return SignedManifest.model_validate_json(self.objects.get(key)).manifest
        except ObjectMissing:
            return None
        except pydantic.ValidationError as exc:
            raise SnapshotError(
                f"gc stopped: cannot read {key} ({type(exc).__name__}); nothing was deleted"
            ) from exc


# --- helpers ------------------------------------------------------------------------------


_GC_DELETE_BATCH = 1000  # a GC checks its lock before each batch of deletes


def _settle(out: Future[_T], done: Future[_T]) -> None:
    """Give ``out`` the outcome of ``done``."""
    if done.cancelled():
        out.cancel()
        return
    error = done.exception()
    if error is not None:
        out.set_exception(error)
    else:
        out.set_result(done.result())


_SpanRead = tuple[bytes | memoryview, Literal["own", "copy", "s3"]] | None
"""A span's bytes and where they came from (:meth:`SnapshotStore._span_bytes`); None: its
pack is missing."""


class _Stored(msgspec.Struct, forbid_unknown_fields=True):
    """A stored :class:`SignedManifest` with its two members left as their JSON bytes."""

    manifest: msgspec.Raw
    signature: msgspec.Raw


_STORED = msgspec.json.Decoder(_Stored)


_NO_GC_LOCK = threading.Lock()
_no_gc_holders = 0
_gc_was_enabled = False
_no_gc_since = 0.0
NO_GC_MAX_S = 10.0
"""The longest the GC stays paused while snapshots overlap back to back (then one collection
runs, and the pause goes on)."""


@contextlib.contextmanager
def _no_gc() -> Iterator[None]:
    """Pause the cyclic GC while thousands of short-lived records are built (as Mercurial's
    ``util.nogc`` does): collections triggered by allocation alone cost a third of an
    incremental snapshot. Reference counting still frees everything. Counted across threads
    (creates of different trees run at once): the GC is back on, if it was on, once the last
    holder ends (each holder saving and restoring it left it off for good when two
    interleaved)."""
    global _no_gc_holders, _gc_was_enabled, _no_gc_since
    collect = False
    with _NO_GC_LOCK:
        if not _no_gc_holders:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
            _no_gc_since = time.monotonic()
        elif _gc_was_enabled and time.monotonic() - _no_gc_since > NO_GC_MAX_S:
            collect, _no_gc_since = True, time.monotonic()
        _no_gc_holders += 1
    if collect:  # (outside the lock: a collection can take a while)
        gc.collect()
    try:
        yield
    finally:
        with _NO_GC_LOCK:
            _no_gc_holders -= 1
            if not _no_gc_holders and _gc_was_enabled:
                gc.enable()


class _PackingSink:
    """What a file read for a snapshot hands each chunk to: unless some pack has it already
    (or another file of this snapshot), compress it into the open pack. Small chunks are
    gathered per thread and compressed together (one frame per :data:`GROUP_LIMIT` bytes);
    each worker calls :meth:`flush` at the end of its run of files."""

    def __init__(self, index: PackIndex, packer: Packer) -> None:
        self._index = index
        self._packer = packer
        self._local = threading.local()

    def __call__(self, ref: ChunkRef, data: bytes | memoryview) -> None:
        if ref.id in self._index or not self._packer.claim(ref.id):
            return
        if ref.length > GROUP_CHUNK_MAX:
            self._packer.add(ref.id, _compressor().compress(data))
            return
        group: list[tuple[str, bytes]] | None = getattr(self._local, "group", None)
        if group is None:
            group = self._local.group = []
            self._local.size = 0
        group.append((ref.id, bytes(data)))  # a small file's own bytes: no copy
        self._local.size += ref.length
        if self._local.size >= GROUP_LIMIT:
            self.flush()

    def flush(self) -> None:
        """Compress and pack this thread's open group."""
        group: list[tuple[str, bytes]] | None = getattr(self._local, "group", None)
        self._local.group = None
        if not group:
            return
        if len(group) == 1:
            self._packer.add(group[0][0], _compressor().compress(group[0][1]))
            return
        _add_group(self._packer, group)


def _add_group(packer: Packer, chunks: Sequence[tuple[str, bytes]]) -> None:
    """Compress claimed ``(chunk id, bytes)`` together into one group frame of ``packer``."""
    members: list[Member] = []
    at = 0
    for chunk_id, data in chunks:
        members.append((chunk_id, at, len(data)))
        at += len(data)
    packer.add_group(members, _compressor().compress(b"".join(d for _, d in chunks)))


def _frame_bytes(rows: Sequence[Sequence[Any]], live: Collection[str]) -> tuple[int, float]:
    """Stored bytes of a pack's frames (a group frame counted once) and the share of them the
    ``live`` chunks hold (in a group frame: in proportion to the live chunks' plain sizes)."""
    frames: dict[int, list[Sequence[Any]]] = {}
    for row in rows:
        frames.setdefault(int(row[1]), []).append(row)
    total = 0
    alive = 0.0
    for members in frames.values():
        length = int(members[0][2])
        total += length
        if len(members[0]) == 5:
            plain = sum(int(m[4]) for m in members) or 1
            alive += length * sum(int(m[4]) for m in members if m[0] in live) / plain
        elif any(m[0] in live for m in members):
            alive += length
    return total or 1, alive


def _compressor() -> zstandard.ZstdCompressor:
    """This thread's zstd compressor (one is not safe to share between threads)."""
    comp = getattr(_local, "comp", None)
    if comp is None:
        comp = _local.comp = zstandard.ZstdCompressor(level=_ZSTD_LEVEL)
    return comp


_OWN_SHARE = 0.5
"""A read whose frames are at least this share of the pack's own copy is checked as a whole (a
rollback's few kilobytes of a 2 MiB pack are cheaper to check chunk by chunk)."""


_DISAGREES = memoryview(b"")
"""What :func:`_own_pack` answers when the index places a chunk of the read elsewhere than
this node's genuine copy of the pack says (an index an S3 attacker wrote): the read goes to S3
and is checked chunk by chunk, and the copy stays."""


def _own_pack(cache: PackCache, span: Span) -> memoryview | None:
    """``span``'s bytes from the whole copy of its pack that this node's packer made, when
    that copy is authentic and says what the index says: its BLAKE3 is the pack's name (a copy
    still in memory, written by this process, is not hashed again) and its trailer, which this
    node wrote, lists every chunk of ``span`` at the offset, length and place in its frame the
    index gave. Then every chunk of the span is what the packer compressed, whose id it
    computed from the bytes it compressed, and no chunk needs hashing; ``None`` otherwise (the
    read is checked chunk by chunk), :data:`_DISAGREES` when the trailer and the index differ.
    A copy read from S3 is never taken for one: its trailer is whatever the object store
    held."""
    size = cache.own_size(span.pack)
    if size is None or span.end > size:
        return None
    # the frames the read decompresses, not the bytes between them (a rollback's few files
    # spread over a pack: cheaper chunk by chunk)
    if sum(length for _, length in {(c[1], c[2]) for c in span.chunks}) < _OWN_SHARE * size:
        return None
    found = cache.read_own(span.pack)
    if found is None:
        return None
    pack, in_memory = found
    if span.end > len(pack):
        return None
    if not in_memory and pack_key(blake3.blake3(pack).hexdigest()) != span.pack:
        cache.drop(span.pack)  # altered on this disk: S3 from now on
        return None
    try:
        rows = trailer_spans(pack)
    except PackFormatError:
        cache.drop(span.pack)
        return None
    if not all(chunk in rows for chunk in span.chunks):
        return _DISAGREES
    return memoryview(pack)[span.start : span.end]


def _decompressor() -> zstandard.ZstdDecompressor:
    """This thread's zstd decompressor."""
    dec = getattr(_local, "dec", None)
    if dec is None:
        dec = _local.dec = zstandard.ZstdDecompressor()
    return dec


_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
"""How a rollback opens the tree it writes below (the tree itself is the caller's path, a link
or not)."""

try:  # a restore's new files written without the GIL (dsec_snapstore/_placefiles.c)
    from dsec_snapstore._placefiles import write_files as _write_new
except ImportError:  # (no C compiler where it was installed: each file from Python, by place)
    _write_new = None


def _assemble(entry: FileEntry, ids: Sequence[str], chunks: Mapping[str, bytes]) -> bytes:
    """A file's bytes from its checked chunks; the whole is checked unless it is one chunk
    (whose id is the file's hash, checked already)."""
    if not ids:
        data = b""
    elif len(ids) == 1:
        data = chunks[ids[0]]
        if ids[0] == entry.blake3:
            return data
    else:
        data = b"".join(chunks[c] for c in ids)
    if blake3.blake3(data).hexdigest() != entry.blake3:
        raise VerificationFailed(entry.path, ["reassembled content does not match its hash"])
    return data


def _umask() -> int | None:
    """This process's umask, read without changing it (Linux); None when unknown."""
    try:
        with open("/proc/self/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return None


_FILE_COST = 16 << 10
"""What opening and closing a file costs, in bytes of reading, hashing and compressing."""
_RUN_LEAST = 2 << 20
"""The least work of one run (bytes plus per-file costs): a small tree, or the few files an
incremental snapshot reads, is one or a few tasks, not eight tiny ones each waiting its turn
behind the runs of the node's large snapshots (``dsec_snapstore.fairpool``)."""


def _weighed_runs(entries: Sequence[TreeEntry], workers: int) -> list[Sequence[TreeEntry]]:
    """Cut ``entries`` into contiguous runs of about equal work (bytes plus a per-file cost),
    a few per worker, heaviest first: big files start at once, so the packs they fill upload
    while the many small files are still being compressed (not all at the end)."""
    weights = [e.size + _FILE_COST for e in entries]
    target = max(_RUN_LEAST, sum(weights) // (workers * 4))
    runs: list[Sequence[TreeEntry]] = []
    start = acc = 0
    for i, weight in enumerate(weights):
        acc += weight
        if acc >= target:
            runs.append(entries[start : i + 1])
            start, acc = i + 1, 0
    if start < len(entries):
        runs.append(entries[start:])
    runs.sort(key=lambda run: sum(e.size for e in run), reverse=True)
    return runs


def _targets(root: Path, entries: Sequence[FileEntry]) -> list[tuple[FileEntry, str]]:
    """Each entry with the path to write it at; parents created, none a symlink or a file.

    Each directory is made and checked once (:class:`Parents`); a plain relative path whose
    parent was checked is joined as a string.
    """
    parents: set[str] = set()  # plain parents checked already
    base = str(root)
    out: list[tuple[FileEntry, str]] = []
    with Parents(root) as made:
        for entry in entries:
            path = entry.path
            parent, _, name = path.rpartition("/")
            if parent in parents and name not in _ODD_NAMES and "\0" not in name:
                out.append((entry, f"{base}/{path}"))  # the common case: a lookup, no split
                continue
            plain = (
                path
                and "\0" not in path
                and not path.startswith("/")
                and name not in ("", ".", "..")
                and not any(p in ("", ".", "..") for p in parent.split("/") if parent)
            )
            if plain and (not parent or parent in parents):
                out.append((entry, f"{base}/{path}"))
                continue
            out.append((entry, str(made.make(path))))
            if plain:
                parents.add(parent)
    return out


_ODD_NAMES = frozenset({"", ".", ".."})


def _batches(entries: Sequence[FileEntry], limit: int) -> Iterator[list[FileEntry]]:
    """Split files into runs of about ``limit`` bytes."""
    batch: list[FileEntry] = []
    size = 0
    for item in entries:
        batch.append(item)
        size += item.size or 0
        if size >= limit:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _note(change: domain.FileChange, note: str) -> domain.FileChange:
    return domain.FileChange(change.path, change.old, change.new, None, note)


def _new_to_parent(hashed: dict[str, tuple[TreeEntry, HashedFile]], read: set[str] | None) -> int:
    """Bytes of the distinct chunks of the files ``read`` (every file without a parent:
    ``read`` None) that no file kept from the parent holds: the snapshot's content new to its
    own series, whatever other snapshots of the store hold."""
    kept = (
        set()
        if read is None
        else {c.id for path, (_, h) in hashed.items() if path not in read for c in h.chunks}
    )
    fresh = {
        c.id: c.length
        for path, (_, h) in hashed.items()
        if read is None or path in read
        for c in h.chunks
        if c.id not in kept
    }
    return sum(fresh.values())
