"""Archive of the event log in the S3 object store: verified segments and their manifest.

``DSEC_EVENTS`` is append-only (``deny_delete``/``deny_purge``, which NATS never lets anyone
turn off again). The archive copies it, incrementally, into the object store as **segments**:
each one the messages of a contiguous range of stream sequences exactly as JetStream stored
them (sequence, subject, stored time, the envelope's bytes), so every signature and chain link
still verifies from the archive alone. ``manifest.json`` lists the segments with their first and
last sequence, their count and the BLAKE3 of each object:

* :func:`archive` appends what the stream holds after the manifest's last sequence (up to a
  sequence or a time), writes each segment, **reads it back** and checks hash, count and
  sequences before it enters the manifest;
* :func:`archived_records` reads the archive back in order, checking each segment against the
  manifest (:class:`ArchiveCorrupt` names the altered one) — ``dsec audit verify --archive``
  feeds them to the audit verifier, then the live stream after them;
* :func:`restore` publishes an archive into an empty stream at the same sequences (a lost
  NATS store rebuilt from S3).

**The manifest is signed** by the operator's certified key (role ``operator``, issued by the
operator root): Ed25519 over the canonical MessagePack of its body, which holds the segments,
the last archived sequence and the BLAKE3 of that last message's bytes, and ``prev``, the digest
of the manifest it replaced (a hash chain of archive runs). Every reader (:func:`read_manifest`)
verifies it against the trust root, so whoever may only write the bucket can no longer cut the
newest archived events (rewrite the last segment and the manifest to agree): an unsigned or
wrongly signed manifest is :class:`ArchiveCorrupt`. What it cannot prove: a holder of the
operator key (or the root) can still sign a shorter archive (see ``docs/operations.md``).

Layout under the bucket: ``archive/events/manifest.json`` and
``archive/events/segments/<first seq>-<last seq>.seg.zst`` (zstd-compressed MessagePack, one
``[seq, subject, stored_us, data]`` array per message).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import blake3
import msgpack
import zstandard
from minio import Minio
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from dsec_core import canonical, identity, objectstore
from dsec_core.subjects import ALL_EVENTS, STREAM
from dsec_core.text import untrusted_json

PREFIX = "archive/events/"
MANIFEST_KEY = f"{PREFIX}manifest.json"
FORMAT = 2
"""Format 2: signed manifests (format 1 had no signature; an archive of it must be re-made)."""
SEGMENT_EVENTS = 10_000
"""Messages per segment (at most; a segment also ends at :data:`SEGMENT_BYTES`)."""
SEGMENT_BYTES = 64 << 20
_MAX_SEGMENT_OBJECT = 1 << 30  # what a reader accepts for one segment object


class ArchiveError(RuntimeError):
    """The archive cannot be written or read as asked (a clear, one-line reason)."""


class ArchiveCorrupt(ArchiveError):
    """A segment or the manifest does not hold what the manifest says: altered or lost.

    Attributes:
        first_seq: the first stream sequence of the segment concerned (0: the manifest).
    """

    def __init__(self, message: str, first_seq: int = 0) -> None:
        super().__init__(message)
        self.first_seq = first_seq


@dataclass(frozen=True)
class Record:
    """One stored message of the stream, byte-exact."""

    seq: int
    subject: str
    stored_us: int  # JetStream's storage time, microseconds since the epoch
    data: bytes

    @property
    def stored_at(self) -> datetime:
        return datetime.fromtimestamp(self.stored_us / 1_000_000, UTC)


@dataclass(frozen=True)
class Segment:
    """One archived object: the messages of stream sequences ``first_seq..last_seq``."""

    key: str
    first_seq: int
    last_seq: int
    count: int
    size: int
    blake3: str
    first_time: str
    last_time: str


@dataclass(frozen=True)
class ManifestSigner:
    """Who signs the manifests an archive run writes: the operator's key, its certificate
    (role ``operator``) and the trust root (public) that certificate must chain to — the
    existing manifest is verified against it before a run extends it."""

    key: SigningKey
    cert: identity.Certificate
    anchor: bytes

    def __post_init__(self) -> None:
        if self.cert.role != "operator":
            raise ArchiveError(f"the archive is signed by the operator, not role {self.cert.role}")
        if self.cert.public_key != bytes(self.key.verify_key).hex():
            raise ArchiveError("the operator certificate is not the signing key's")
        try:
            identity.check(self.cert, self.anchor)
        except identity.CertificateError as exc:
            raise ArchiveError(f"the operator certificate does not hold: {exc}") from None


def message_hash(data: bytes) -> str:
    """The BLAKE3 (hex) of one stored message's bytes, as the manifest records its last."""
    return blake3.blake3(data).hexdigest()


@dataclass
class Manifest:
    """What the archive holds, in order; sequences are contiguous across segments.

    ``prev``: the digest (:meth:`digest`) of the manifest this one replaced (``None``: the
    first); ``last_hash``: BLAKE3 of the last archived message's bytes; ``cert`` and ``sig``:
    the operator's certificate and Ed25519 signature over :meth:`signed_bytes`.
    """

    stream: str = STREAM
    format: int = FORMAT
    segments: list[Segment] = field(default_factory=list)
    prev: str | None = None
    last_hash: str | None = None
    cert: dict[str, Any] | None = None
    sig: str | None = None

    @property
    def first_seq(self) -> int | None:
        return self.segments[0].first_seq if self.segments else None

    @property
    def last_seq(self) -> int | None:
        return self.segments[-1].last_seq if self.segments else None

    @property
    def events(self) -> int:
        return sum(s.count for s in self.segments)

    def body(self) -> dict[str, Any]:
        """Every field the signature covers (all but ``sig``)."""
        return {
            "stream": self.stream,
            "format": self.format,
            "segments": [asdict(s) for s in self.segments],
            "last_seq": self.last_seq,
            "last_hash": self.last_hash,
            "prev": self.prev,
            "cert": self.cert,
        }

    def to_bytes(self) -> bytes:
        """The object ``manifest.json``: the body and the signature, as JSON."""
        return json.dumps({**self.body(), "sig": self.sig}, indent=1).encode()

    def signed_bytes(self) -> bytes:
        """The canonical bytes the operator's signature covers."""
        return canonical.canonical_bytes(self.body())

    def digest(self) -> str:
        """BLAKE3 of the signed body and its signature: what the next manifest's ``prev`` is."""
        return blake3.blake3(
            canonical.canonical_bytes({**self.body(), "sig": self.sig})
        ).hexdigest()

    def sign(self, key: SigningKey, cert: identity.Certificate) -> None:
        """Sign the manifest as it stands now (after its segments and ``last_hash`` are set)
        with ``key``, whose certificate is ``cert`` (readers accept only role ``operator``)."""
        self.cert = cert.model_dump(mode="json")
        self.sig = key.sign(self.signed_bytes()).signature.hex()

    def verify(self, anchor: bytes) -> identity.Certificate:
        """The signer's certificate, once the signature is the operator's under ``anchor``.

        Raises:
            ArchiveCorrupt: unsigned, a certificate the root did not issue (or not role
                operator), or a signature that does not cover this body (altered after signing).
        """
        if self.sig is None or self.cert is None:
            raise ArchiveCorrupt(
                f"{MANIFEST_KEY} is not signed: an archive manifest without the operator's "
                "signature is tampering (whoever may write the bucket could have cut events)"
            )
        try:
            cert = identity.parse(self.cert)
            identity.check(cert, anchor)
        except identity.CertificateError as exc:
            raise ArchiveCorrupt(
                f"{MANIFEST_KEY} is signed by a key the operator root did not certify: {exc}"
            ) from None
        if cert.role != "operator":
            raise ArchiveCorrupt(
                f"{MANIFEST_KEY} is signed by {cert.subject!r} (role {cert.role}), not by the "
                "operator"
            )
        try:
            VerifyKey(bytes.fromhex(cert.public_key)).verify(
                self.signed_bytes(), bytes.fromhex(self.sig)
            )
        except (BadSignatureError, ValueError) as exc:
            raise ArchiveCorrupt(
                f"{MANIFEST_KEY}: the operator's signature does not match it (altered after it "
                f"was signed: {str(exc)[:100]})"
            ) from None
        if self.segments and self.last_hash is None:
            raise ArchiveCorrupt(f"{MANIFEST_KEY} records no hash of its last message")
        return cert

    @classmethod
    def parse(cls, data: bytes) -> Manifest:
        """Read a manifest; :class:`ArchiveCorrupt` names what is wrong with it."""
        try:
            body = untrusted_json(data)
            manifest = cls(
                stream=str(body["stream"]),
                format=int(body["format"]),
                segments=[Segment(**s) for s in body["segments"]],
                prev=_opt_str(body.get("prev")),
                last_hash=_opt_str(body.get("last_hash")),
                cert=body.get("cert"),
                sig=_opt_str(body.get("sig")),
            )
            if manifest.cert is not None and not isinstance(manifest.cert, dict):
                raise TypeError("cert is not an object")
            stated_last = body.get("last_seq", manifest.last_seq)
        except (ValueError, KeyError, TypeError) as exc:
            raise ArchiveCorrupt(f"{MANIFEST_KEY} is not a manifest: {str(exc)[:200]}") from None
        if manifest.format == 1:
            raise ArchiveCorrupt(
                f"{MANIFEST_KEY} is format 1, not signed: an unsigned archive manifest is "
                "refused as tampering (archive again into a new bucket with this version)"
            )
        if manifest.format != FORMAT:
            raise ArchiveCorrupt(f"{MANIFEST_KEY}: format {manifest.format}, expected {FORMAT}")
        if stated_last != manifest.last_seq:
            raise ArchiveCorrupt(
                f"{MANIFEST_KEY}: last_seq {stated_last}, but its segments end at "
                f"{manifest.last_seq}"
            )
        expected = manifest.first_seq
        for seg in manifest.segments:
            if seg.first_seq != expected or seg.last_seq - seg.first_seq + 1 != seg.count:
                raise ArchiveCorrupt(
                    f"{MANIFEST_KEY}: segment {seg.key} covers {seg.first_seq}-{seg.last_seq} "
                    f"({seg.count} messages) where sequence {expected} comes next",
                    seg.first_seq,
                )
            expected = seg.last_seq + 1
        return manifest


def _opt_str(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


def segment_key(first_seq: int, last_seq: int) -> str:
    """The object key of the segment of ``first_seq..last_seq`` (sorts in stream order)."""
    return f"{PREFIX}segments/{first_seq:020d}-{last_seq:020d}.seg.zst"


def pack_segment(records: Iterable[Record]) -> bytes:
    """A segment object's bytes: zstd over one MessagePack array per message."""
    packer = msgpack.Packer(use_bin_type=True)
    raw = b"".join(packer.pack([r.seq, r.subject, r.stored_us, r.data]) for r in records)
    return zstandard.ZstdCompressor(level=6).compress(raw)


def unpack_segment(blob: bytes) -> list[Record]:
    """The messages of a segment object (raises :class:`ValueError` when it is none)."""
    try:
        raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=_MAX_SEGMENT_OBJECT)
        unpacker = msgpack.Unpacker(raw=False, max_buffer_size=_MAX_SEGMENT_OBJECT)
        unpacker.feed(raw)
        out = []
        for item in unpacker:
            seq, subject, stored_us, data = item
            if not (
                isinstance(seq, int)
                and isinstance(subject, str)
                and isinstance(stored_us, int)
                and isinstance(data, bytes)
            ):
                raise ValueError("a record is not [seq, subject, stored_us, data]")
            out.append(Record(seq, subject, stored_us, data))
        return out
    except (zstandard.ZstdError, msgpack.UnpackException, ValueError, TypeError) as exc:
        raise ValueError(f"not a segment: {str(exc)[:200]}") from None


def check_segment(segment: Segment, blob: bytes) -> list[Record]:
    """The messages of ``blob``, once it is exactly the object the manifest lists.

    Raises:
        ArchiveCorrupt: another hash, unreadable, or other sequences than listed.
    """
    where = f"archived segment {segment.key} (seq {segment.first_seq}-{segment.last_seq})"
    digest = blake3.blake3(blob).hexdigest()
    if digest != segment.blake3:
        raise ArchiveCorrupt(
            f"{where} was altered: BLAKE3 {digest[:16]}…, the manifest says {segment.blake3[:16]}…",
            segment.first_seq,
        )
    try:
        records = unpack_segment(blob)
    except ValueError as exc:
        raise ArchiveCorrupt(f"{where}: {exc}", segment.first_seq) from None
    seqs = [r.seq for r in records]
    if seqs != list(range(segment.first_seq, segment.last_seq + 1)):
        raise ArchiveCorrupt(f"{where} does not hold those sequences", segment.first_seq)
    return records


def _iso(us: int) -> str:
    return datetime.fromtimestamp(us / 1_000_000, UTC).isoformat()


def make_segment(records: list[Record]) -> tuple[Segment, bytes]:
    """The manifest entry and object bytes of contiguous ``records``."""
    blob = pack_segment(records)
    first, last = records[0], records[-1]
    segment = Segment(
        key=segment_key(first.seq, last.seq),
        first_seq=first.seq,
        last_seq=last.seq,
        count=len(records),
        size=len(blob),
        blake3=blake3.blake3(blob).hexdigest(),
        first_time=_iso(first.stored_us),
        last_time=_iso(last.stored_us),
    )
    return segment, blob


# -- the object store ------------------------------------------------------------------------------


async def _read_unverified(store: Minio, bucket: str) -> Manifest | None:
    try:
        data = await objectstore.get_bytes(store, bucket, MANIFEST_KEY)
    except objectstore.ObjectMissing:
        return None
    return Manifest.parse(data)


async def read_manifest(store: Minio, bucket: str, anchor: bytes) -> Manifest | None:
    """The archive's manifest, its signature verified against the trust root ``anchor``;
    ``None`` when nothing was archived in ``bucket``.

    Raises:
        ArchiveCorrupt: malformed, unsigned or not signed by the operator (tampering).
    """
    manifest = await _read_unverified(store, bucket)
    if manifest is not None:
        manifest.verify(anchor)
    return manifest


async def _get_segment(store: Minio, bucket: str, segment: Segment) -> list[Record]:
    try:
        blob = await objectstore.get_bytes(store, bucket, segment.key)
    except objectstore.ObjectMissing:
        raise ArchiveCorrupt(
            f"archived segment {segment.key} (seq {segment.first_seq}-{segment.last_seq}) "
            "is missing from the object store",
            segment.first_seq,
        ) from None
    return check_segment(segment, blob)


async def archived_records(
    store: Minio, bucket: str, manifest: Manifest, *, prefetch: int = 2
) -> AsyncIterator[Record]:
    """Every archived message in stream order, each segment checked against the manifest
    (the next ones are fetched while the caller works on one)."""
    pending: list[asyncio.Task[list[Record]]] = []
    segments = list(manifest.segments)
    try:
        while segments or pending:
            while segments and len(pending) < prefetch:
                pending.append(asyncio.create_task(_get_segment(store, bucket, segments.pop(0))))
            records = await pending.pop(0)
            for record in records:
                if (
                    record.seq == manifest.last_seq
                    and manifest.last_hash is not None
                    and message_hash(record.data) != manifest.last_hash
                ):
                    raise ArchiveCorrupt(
                        f"the last archived message (seq {record.seq}) is not the one the "
                        "signed manifest records",
                        record.seq,
                    )
                yield record
    finally:
        for task in pending:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


@dataclass(frozen=True)
class ArchiveCheck:
    """What reading the whole archive back found."""

    segments: int
    events: int
    first_seq: int | None
    last_seq: int | None
    bytes: int


async def check_archive(store: Minio, bucket: str, anchor: bytes) -> ArchiveCheck:
    """Read every segment back and check it against the (signed, verified) manifest.

    Raises:
        ArchiveError: nothing archived in ``bucket``.
        ArchiveCorrupt: the first segment (or the manifest) that is altered or missing.
    """
    manifest = await read_manifest(store, bucket, anchor)
    if manifest is None:
        raise ArchiveError(f"no event archive in bucket {bucket!r} (run `dsec events archive`)")
    count = 0
    async for _ in archived_records(store, bucket, manifest):
        count += 1
    return ArchiveCheck(
        len(manifest.segments),
        count,
        manifest.first_seq,
        manifest.last_seq,
        sum(s.size for s in manifest.segments),
    )


# -- the stream ------------------------------------------------------------------------------------


async def stream_records(
    js: JetStreamContext, start_seq: int, upto_seq: int, *, batch: int = 512
) -> AsyncIterator[Record]:
    """The stored messages of sequences ``start_seq..upto_seq``, in order, byte-exact (an
    ordered, unacknowledged pull consumer: reading changes nothing in the stream)."""
    if start_seq > upto_seq:
        return
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=max(start_seq, 1),
        ack_policy=AckPolicy.NONE,
        filter_subject=ALL_EVENTS,
        inactive_threshold=30.0,
        mem_storage=True,
        num_replicas=1,
    )
    sub = await js.pull_subscribe(ALL_EVENTS, stream=STREAM, config=config)
    try:
        while True:
            try:
                msgs = await sub.fetch(batch, timeout=2.0)
            except (TimeoutError, NatsTimeoutError):
                if (await sub.consumer_info()).num_pending:
                    continue
                return
            for msg in msgs:
                meta = msg.metadata
                seq = meta.sequence.stream
                if seq > upto_seq:
                    return
                stored = round(meta.timestamp.timestamp() * 1_000_000)
                yield Record(seq, msg.subject, stored, bytes(msg.data))
                if seq >= upto_seq:
                    return
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


@dataclass
class ArchiveResult:
    """What one :func:`archive` run added."""

    segments: list[Segment] = field(default_factory=list)
    first_seq: int | None = None
    last_seq: int | None = None
    archived_upto: int | None = None  # the manifest's last sequence after the run

    @property
    def events(self) -> int:
        return sum(s.count for s in self.segments)


async def _end_seq(
    js: JetStreamContext, start: int, last: int, upto: int | None, before: datetime | None
) -> int:
    """The last sequence to archive: ``upto``, the last one stored before ``before``, or the
    stream's last."""
    end = min(last, upto) if upto is not None else last
    if before is None:
        return end
    # The last message stored before ``before``: stored times only grow with sequences.
    found = start - 1
    async for record in stream_records(js, start, end):
        if record.stored_at >= before:
            break
        found = record.seq
    return found


async def archive(
    js: JetStreamContext,
    store: Minio,
    bucket: str,
    *,
    signer: ManifestSigner,
    upto: int | None = None,
    before: datetime | None = None,
    segment_events: int = SEGMENT_EVENTS,
    segment_bytes: int = SEGMENT_BYTES,
    progress: Callable[[Segment], None] | None = None,
) -> ArchiveResult:
    """Append to the archive what the stream holds after it, up to sequence ``upto`` or the
    last message stored before ``before`` (default: all of it).

    Each segment is written, read back and checked (hash, count, sequences) before the
    manifest lists it; the manifest is rewritten (and signed by ``signer``, chained to the one
    it replaces) after each segment, so an interrupted run keeps what it verified and the next
    run continues after it. The existing manifest is verified first: a run never signs on top
    of a manifest someone else altered.

    Raises:
        ArchiveError: the stream no longer holds the next sequence to archive (its limits
            discarded it before it was archived), a gap in the stream, or a stream of another
            name in the manifest.
        ArchiveCorrupt: a segment read back is not what was written.
    """
    if segment_events < 1:
        raise ValueError(f"segment_events must be >= 1, got {segment_events}")
    await asyncio.to_thread(objectstore.ensure_bucket, store, bucket)
    manifest = await read_manifest(store, bucket, signer.anchor) or Manifest()
    if manifest.stream != STREAM:
        raise ArchiveError(f"the archive in {bucket!r} is of stream {manifest.stream}")
    state = (await js.stream_info(STREAM)).state
    start = (manifest.last_seq or 0) + 1
    result = ArchiveResult(archived_upto=manifest.last_seq)
    if state.messages == 0 or start > state.last_seq:
        return result
    if state.first_seq > start:
        raise ArchiveError(
            f"the stream no longer holds sequences {start}-{state.first_seq - 1} (discarded by "
            "its limits before they were archived); the archive cannot continue without a gap"
        )
    end = await _end_seq(js, start, state.last_seq, upto, before)
    chunk: list[Record] = []
    size = 0
    prev_digest = manifest.digest() if manifest.sig is not None else None

    async def flush() -> None:
        nonlocal chunk, size, prev_digest
        segment, blob = make_segment(chunk)
        await objectstore.put_bytes(store, bucket, segment.key, blob)
        await _get_segment(store, bucket, segment)  # read back: hash, count, sequences
        current = await _read_unverified(store, bucket)
        current_digest = None if current is None else current.digest()
        if current_digest != prev_digest:
            now_ends = None if current is None else current.last_seq
            raise ArchiveError(
                f"another archive run wrote to {bucket!r} meanwhile (the manifest now ends at "
                f"seq {now_ends}, not {manifest.last_seq}); run one at a time"
            )
        manifest.segments.append(segment)
        manifest.last_hash = message_hash(chunk[-1].data)
        manifest.prev = prev_digest
        manifest.sign(signer.key, signer.cert)
        await objectstore.put_bytes(store, bucket, MANIFEST_KEY, manifest.to_bytes())
        if Manifest.parse(await objectstore.get_bytes(store, bucket, MANIFEST_KEY)) != manifest:
            raise ArchiveCorrupt("the manifest read back is not the one written")
        prev_digest = manifest.digest()
        result.segments.append(segment)
        result.first_seq = result.first_seq or segment.first_seq
        result.last_seq = result.archived_upto = segment.last_seq
        if progress is not None:
            progress(segment)
        chunk, size = [], 0

    expected = start
    async for record in stream_records(js, start, end):
        if record.seq != expected:
            raise ArchiveError(
                f"the stream holds no sequence {expected}-{record.seq - 1} (expected "
                "contiguous sequences in an append-only stream)"
            )
        expected += 1
        chunk.append(record)
        size += len(record.data) + len(record.subject) + 16
        if len(chunk) >= segment_events or size >= segment_bytes:
            await flush()
    if chunk:
        await flush()
    if expected <= end:
        raise ArchiveError(f"the stream ended at sequence {expected - 1}, before {end}")
    return result


async def restore(
    js: JetStreamContext,
    store: Minio,
    bucket: str,
    anchor: bytes,
    *,
    progress: Callable[[int], None] | None = None,
) -> int:
    """Publish the whole archive into the stream, which must be empty and start at the
    archive's first sequence (a new stream: sequence 1), so every message lands at the
    sequence it had: chains, ``stream_seq`` references and the audit verify as before.

    Returns the last sequence restored.

    Raises:
        ArchiveError: no archive, or the stream is not empty.
        ArchiveCorrupt: a segment is altered (nothing after it is published).
    """
    manifest = await read_manifest(store, bucket, anchor)
    if manifest is None or manifest.first_seq is None:
        raise ArchiveError(f"no event archive in bucket {bucket!r}")
    state = (await js.stream_info(STREAM)).state
    if state.messages or state.last_seq + 1 != manifest.first_seq:
        raise ArchiveError(
            f"stream {STREAM} must be empty with sequence {manifest.first_seq} next (it holds "
            f"{state.messages} messages, next sequence {state.last_seq + 1}); restore into a "
            "new stream"
        )
    last = 0
    async for record in archived_records(store, bucket, manifest):
        # No Nats-Msg-Id: the duplicate window must not drop a message the log holds twice.
        ack = await js.publish(record.subject, record.data, timeout=10)
        if ack.seq != record.seq:
            raise ArchiveError(
                f"archived sequence {record.seq} was stored at {ack.seq}: something else "
                "publishes into the stream; stop every producer and restore into a new stream"
            )
        last = record.seq
        if progress is not None and last % 1000 == 0:
            progress(last)
    return last


def summary(manifest: Manifest | None) -> dict[str, Any]:
    """The manifest as shown by ``dsec events archived --json``."""
    if manifest is None:
        return {"segments": [], "events": 0, "first_seq": None, "last_seq": None}
    return {
        "stream": manifest.stream,
        "events": manifest.events,
        "first_seq": manifest.first_seq,
        "last_seq": manifest.last_seq,
        "bytes": sum(s.size for s in manifest.segments),
        "last_hash": manifest.last_hash,
        "prev": manifest.prev,
        "digest": manifest.digest(),
        "signed_by": (manifest.cert or {}).get("subject"),
        "signer_key_id": (manifest.cert or {}).get("key_id"),
        "segments": [asdict(s) for s in manifest.segments],
    }
