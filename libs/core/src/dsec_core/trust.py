"""The gate every consumer passes an event through before it acts on it.

:class:`Gate.admit` answers, for the raw bytes of one message, either the decoded envelope or the
reason it must be ignored:

1. the bytes are an envelope (``malformed``);
2. its key is registered in the log with a certificate from the operator root (``unknown-key``,
   ``uncertified-key``) and not revoked (``revoked-key``) — see :class:`KeyRing`;
3. its signature is valid for that key (``bad-signature``);
4. the certificate's role may emit this type, for this tenant / node (``unauthorized``,
   :mod:`dsec_core.authz`);
5. the sandbox it is about belongs to the event's tenant, and a ``spec.submitted`` opens a new
   sandbox rather than reusing another's id (``cross-tenant``, ``aggregate-exists``);
6. this consumer has not handled the same event id from another stream position before
   (``replayed``: old genuine bytes published again, after JetStream's duplicate window).

Keys are looked up once per key id (a direct get on ``dsec.producer.<key_id>.key_registered``)
and cached; revocations arrive live on a core-NATS subscription.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BadRequestError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from dsec_core import authz
from dsec_core.envelope import Envelope, MalformedEnvelope
from dsec_core.events import KeyRegistered, KeyRevoked, SpecSubmitted
from dsec_core.eventtypes import unpack_fields as unpack_fields
from dsec_core.identity import Certificate
from dsec_core.ids import canonical_uuid as canonical_uuid
from dsec_core.lifecycle import LIFECYCLE_TYPES, Lifecycle, fold_envelopes
from dsec_core.natsperms import ID_CLAIMS
from dsec_core.signing import verify_raw
from dsec_core.subjects import STREAM, filter_for, subject_for
from dsec_core.trustcheck import registration_problem as registration_problem  # (defined there)
from dsec_core.trustcheck import shape_problem as shape_problem
from dsec_core.trustcheck import signed_time
from dsec_core.trustcheck import user_id_problem as user_id_problem

log = logging.getLogger(__name__)

HANDLED_BUCKET = "dsec-handled"
HANDLED_TTL = timedelta(days=7)
"""How long a consumer remembers the ids it handled; older events are refused as stale."""
_SCAN_LIMIT = 32  # messages read on one registration subject before giving up
CLOCK_SKEW = timedelta(minutes=5)
RECHECK_S = 60.0
"""A cached key's revocation status is read from the log again after this long."""
"""Events dated further in the future are refused (they would outlive the replay window)."""


@dataclass(frozen=True)
class Refusal:
    """Why a message is not acted on."""

    reason: str
    detail: str
    event_id: str | None = None
    event_type: str | None = None
    producer: str | None = None


class _Revoked(Exception):
    pass


class KeyRing:
    """Certified keys, looked up in the log by key id and cached; revocations followed live."""

    def __init__(self, nc: NATS, js: JetStreamContext, anchor: bytes | None) -> None:
        self._nc = nc
        self._js = js
        self.anchor = anchor
        self._certs: OrderedDict[str, Certificate] = OrderedDict()
        self._checked: dict[str, float] = {}  # key id -> when the log was last read for it
        self._bad: OrderedDict[str, str] = OrderedDict()
        # key id -> the registration subject's last stream seq read without finding it (junk
        # stored there is read once, not again for every event signed by that key id)
        self._unregistered: OrderedDict[str, int] = OrderedDict()
        self._revoked: dict[str, int] = {}  # key id -> stream seq of its revocation (0: unknown)
        self._sub: Any = None

    async def start(self) -> None:
        """Follow revocations as they are published (core NATS: no consumer to manage)."""
        self._sub = await self._nc.subscribe(filter_for(KeyRevoked.TYPE), cb=self._on_revoked)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def _on_revoked(self, msg: Msg) -> None:
        with contextlib.suppress(MalformedEnvelope, ValueError, KeyError):
            fields = unpack_fields(msg.data)
            if await self._valid_revocation(fields):
                key_id = str(fields["payload"]["key_id"])
                # Where the log holds it: what the key signed before stays valid (0 if unread).
                self._revoked[key_id] = await self._revoked_in_log(key_id) or 0
                log.warning("key %s revoked by the operator", key_id)

    async def _valid_revocation(self, fields: dict[str, Any]) -> bool:
        if fields.get("type") != KeyRevoked.TYPE or not isinstance(fields.get("payload"), dict):
            return False
        signer = str(fields.get("key_id"))
        if signer == fields["payload"].get("key_id"):
            return False  # a key never revokes itself (nor recurses into its own lookup)
        cert = await self.certificate(signer, check_revocation=False)
        if isinstance(cert, str) or cert.role != "operator":
            return False
        public = bytes.fromhex(cert.public_key)
        return verify_raw(fields, public) and authz.refusal(fields, cert) is None

    async def certificate(
        self, key_id: str, *, check_revocation: bool = True, at_seq: int | None = None
    ) -> Certificate | str:
        """The certificate of ``key_id``, or why it has none (not registered, not certified,
        revoked). ``at_seq``: the stream position of the event it signed; an event stored
        before the key's revocation still counts (a rotated key's earlier events), one stored
        after it (or of unknown position) does not."""
        revoked_at = self._revoked.get(key_id)
        if revoked_at == 0 and at_seq is not None:  # followed live before the log had it
            revoked_at = self._revoked[key_id] = await self._revoked_in_log(key_id) or 0
        if revoked_at is not None and (at_seq is None or at_seq >= revoked_at):
            return f"key {key_id} was revoked by the operator"
        cert = self._certs.get(key_id)
        if cert is not None:
            if cert.expires_at is not None and datetime.now(UTC) >= cert.expires_at:
                return f"key {key_id}: certificate expired at {cert.expires_at.isoformat()}"
            recent = time.monotonic() - self._checked.get(key_id, 0) < RECHECK_S
            if not check_revocation or recent or revoked_at is not None:
                return cert
            # Revocations arrive live, but one published while this consumer was cut off from
            # core NATS would be missed: the log is read again now and then.
            return await self._still_valid(key_id, cert)
        if key_id in self._bad:
            return self._bad[key_id]
        if self.anchor is None:
            return "no trust root configured (DSEC_TRUST_ROOT or $DSEC_HOME/trust/root.pub)"
        found = await self._lookup(key_id, self.anchor)
        if isinstance(found, Certificate):
            _remember(self._certs, key_id, found)
            if check_revocation:
                checked = await self._still_valid(key_id, found, at_seq)
                if isinstance(checked, str):
                    return checked
        elif "not registered" not in found:  # it may register later; a bad one stays bad
            _remember(self._bad, key_id, found)
        return found

    async def _still_valid(
        self, key_id: str, cert: Certificate, at_seq: int | None = None
    ) -> Certificate | str:
        """``cert``, unless the log holds a revocation of its key (read now) stored before
        ``at_seq``."""
        self._checked[key_id] = time.monotonic()
        revoked_at = await self._revoked_in_log(key_id)
        if revoked_at is not None:
            self._revoked[key_id] = revoked_at
            if at_seq is None or at_seq >= revoked_at:
                return f"key {key_id} was revoked by the operator"
        return cert

    async def _lookup(self, key_id: str, anchor: bytes) -> Certificate | str:
        try:
            subject = subject_for(KeyRegistered.TYPE, key_id)
        except ValueError:
            return f"key id {key_id!r} is not a key id"
        problem = f"key {key_id} is not registered in the log"
        # every message of the subject (32 junk ones stored first would hide the registration),
        # each once: a later lookup goes on from where this one stopped
        read = self._unregistered.pop(key_id, 0)
        async for seq, data in scan_seq(self._js, subject, 1 << 62, after=read):
            read = seq
            with contextlib.suppress(MalformedEnvelope):
                found = registration_problem(unpack_fields(data), anchor)
                if isinstance(found, Certificate) and found.key_id == key_id:
                    return found
                if isinstance(found, str):
                    problem = found
        _remember(self._unregistered, key_id, read)
        return problem

    async def _revoked_in_log(self, key_id: str) -> int | None:
        """The stream seq of the first valid revocation of ``key_id`` in the log, if any: one
        that names ``key_id`` (its payload and aggregate) where it is stored. A genuine
        revocation of another key copied onto this key's subject revokes nothing (before, it
        revoked whichever key's subject it was copied to)."""
        # every message of the subject: 32 junk ones first used to hide a genuine revocation
        subject = subject_for(KeyRevoked.TYPE, key_id)
        async for seq, data in scan_seq(self._js, subject, 1 << 62):
            with contextlib.suppress(MalformedEnvelope, KeyError, ValueError, TypeError):
                fields = unpack_fields(data)
                if (
                    shape_problem(fields) is None
                    and fields["aggregate_id"] == key_id
                    and fields["payload"]["key_id"] == key_id
                    and await self._valid_revocation(fields)
                ):
                    return seq
        return None


async def scan_seq(
    js: JetStreamContext, subject: str, limit: int = _SCAN_LIMIT, *, after: int = 0
) -> AsyncIterator[tuple[int, bytes]]:
    """The first ``limit`` messages stored on ``subject`` after stream seq ``after``, with
    their stream seqs, oldest first (direct reads by subject: no consumer to create or clean
    up)."""
    seq = after + 1
    for _ in range(limit):
        try:
            msg = await js.get_msg(STREAM, seq=seq, subject=subject, next=True)
        except NotFoundError:
            return
        if msg.data is None or msg.seq is None:
            return
        seq = msg.seq + 1
        yield msg.seq, msg.data


_MIGRATION_ENDS = frozenset({"unit.migrated", "unit.migration_failed"})


def _attempt(payload: dict[str, Any]) -> int:
    """The placement attempt a ``sandbox.scheduled`` payload names (0 when unreadable)."""
    try:
        return int(payload.get("attempt", 1))
    except (TypeError, ValueError):
        return 0


def _remember(cache: OrderedDict[str, Any], key: str, value: Any, limit: int = 4096) -> None:
    cache[key] = value
    cache.move_to_end(key)
    while len(cache) > limit:
        cache.popitem(last=False)


async def handled_bucket(js: JetStreamContext, *, replicas: int | None = None) -> KeyValue:
    """The bucket of handled event ids (created by the operator; a service only opens it).

    ``replicas`` (operator only): copies on a NATS cluster; an existing bucket is brought to it.
    """
    try:
        kv = await js.key_value(HANDLED_BUCKET)
    except (NotFoundError, BadRequestError):
        return await js.create_key_value(
            KeyValueConfig(
                bucket=HANDLED_BUCKET,
                history=1,
                ttl=HANDLED_TTL.total_seconds(),
                storage=StorageType.FILE,
                description="Event ids each DSec consumer handled (replay protection)",
                replicas=replicas or 1,
            )
        )
    if replicas is not None:
        info = await js.stream_info(f"KV_{HANDLED_BUCKET}")
        if info.config.num_replicas != replicas:
            info.config.num_replicas = replicas
            await js.update_stream(info.config)
    return kv


def handled_key(consumer: str, envelope: Envelope, *, user: bool) -> str:
    """Where ``consumer`` records that it handled ``envelope`` (in the handled-ids bucket).

    A user's event is keyed by its signing key as well as its id: a user chooses its ids, and
    another tenant may copy one off the bus onto a request of its own (a raw publish under
    another ``Nats-Msg-Id`` stores both). Keyed by id alone, whichever copy a consumer admitted
    first (not the first stored: a fair runtime admits a fetched batch at once) made it refuse
    the other as a replay, and the victim's request never had an answer. A service's ids are
    derived from its input's, so its events stay keyed by id alone."""
    if user:
        return f"{consumer}.{envelope.key_id}.{envelope.id}"
    return f"{consumer}.{envelope.id}"


class Gate:
    """Admits an event to a handler, or says why not. One per consumer process."""

    def __init__(self, keys: KeyRing, js: JetStreamContext, handled: KeyValue | None) -> None:
        self.keys = keys
        self._js = js
        self._handled = handled
        self.handled = handled
        """The handled-ids bucket (``None`` without replay protection): the service runtime
        also counts its fair handlers' attempts there, under the consumer's own keys."""
        self._tenants: OrderedDict[str, tuple[str, str]] = OrderedDict()
        # sandbox id -> its spec.submitted subject's last stream seq read without a submission
        self._unsubmitted: OrderedDict[str, int] = OrderedDict()
        # sandbox -> (stream position read up to, node and attempt of its latest placement)
        self._nodes: OrderedDict[str, tuple[int, str | None, int, int]] = OrderedDict()
        self._moves: OrderedDict[str, tuple[int, list[tuple[int, str, str]], frozenset[str]]] = (
            OrderedDict()
        )
        self._lock = asyncio.Lock()

    async def admit(
        self,
        data: bytes,
        *,
        stream_seq: int,
        consumer: str | None = None,
        subject: str | None = None,
        event_type: str | None = None,
    ) -> Envelope | Refusal:
        """Check one message; ``consumer`` (a durable's name) turns on replay protection;
        ``subject`` / ``event_type``: where it was stored and what the consumer takes (a genuine
        event copied onto another subject is refused, never handed over as something else)."""
        try:
            fields = unpack_fields(data)
            envelope = Envelope.model_validate(fields)
        except (MalformedEnvelope, ValueError) as exc:
            return Refusal("malformed", str(exc)[:300])
        refusal: tuple[str, str] | None = None
        if subject is not None and envelope.subject != subject:
            refusal = ("misrouted", f"an envelope for {envelope.subject!r} stored on {subject!r}")
        elif event_type is not None and envelope.type != event_type:
            refusal = ("misrouted", f"a {envelope.type} where {event_type} was expected")
        checked = refusal or await self._verified(fields, envelope, stream_seq)
        refusal = None if isinstance(checked, Certificate) else checked
        if isinstance(checked, Certificate) and consumer is not None:
            try:
                refusal = await self._replay(
                    envelope, stream_seq, consumer, user=checked.role == "user"
                )
            except (TypeError, ValueError) as exc:
                refusal = ("malformed", f"{type(exc).__name__}: {exc}")
        if refusal is None:
            return envelope
        return Refusal(refusal[0], refusal[1][:500], envelope.id, envelope.type, envelope.producer)

    async def check(
        self, fields: dict[str, Any], envelope: Envelope, *, stream_seq: int | None = None
    ) -> tuple[str, str] | None:
        """Shape, signature, certificate, authorization and tenant checks (no replay check).
        ``stream_seq``: where the log holds it (an event a key signed before its revocation
        still counts; without a position, a revoked key's events never do).

        Never raises: whatever a hostile message makes go wrong is a refusal (``malformed``).
        """
        checked = await self._verified(fields, envelope, stream_seq)
        return None if isinstance(checked, Certificate) else checked

    async def _verified(
        self, fields: dict[str, Any], envelope: Envelope, stream_seq: int | None
    ) -> tuple[str, str] | Certificate:
        """:meth:`check`, with the certificate that signed the event where it passes."""
        try:
            return await self._check(fields, envelope, stream_seq)
        except Exception as exc:  # a hostile message must never stop a consumer
            return "malformed", f"{type(exc).__name__}: {exc}"

    async def _check(
        self, fields: dict[str, Any], envelope: Envelope, stream_seq: int | None
    ) -> tuple[str, str] | Certificate:
        problem = shape_problem(fields)
        if problem is not None:
            return "malformed", problem
        signed = signed_time(fields)
        if isinstance(signed, str):
            return "malformed", signed
        cert = await self.keys.certificate(envelope.key_id, at_seq=stream_seq)
        if isinstance(cert, str):
            reason = "revoked-key" if "revoked" in cert else "unknown-key"
            if "certificate" in cert or "root" in cert or "registered as" in cert:
                reason = "uncertified-key"
            return reason, cert
        if not verify_raw(fields, bytes.fromhex(cert.public_key)):
            return "bad-signature", f"signature invalid for key {envelope.key_id}"
        problem = authz.refusal(fields, cert)
        if problem is not None:
            return "unauthorized", problem
        if cert.role == "user":  # (its time as the verifier reads it: signed_time above)
            problem = user_id_problem(envelope.id, signed)
            if problem is not None:
                return "id-not-fresh", problem
        return await self._tenant(envelope) or await self._node(envelope, cert, stream_seq) or cert

    async def _node(
        self, envelope: Envelope, cert: Certificate, stream_seq: int | None = None
    ) -> tuple[str, str] | None:
        """A node agent speaks for a sandbox only while the sandbox's latest authentic
        ``sandbox.scheduled`` names its node: a rescheduled sandbox moves, and the node it left
        may say nothing more about it."""
        if cert.role != "nodeagent" or envelope.aggregate != SpecSubmitted.AGGREGATE:
            return None
        if envelope.type in _MIGRATION_ENDS:
            return await self._migration_end(envelope, cert)
        node = await self.placement(envelope.aggregate_id, before=stream_seq)
        if node != cert.node_id:
            where = f"on {node!r}" if node is not None else "on no node"
            return (
                "wrong-node",
                f"sandbox {envelope.aggregate_id} is scheduled {where}, not on {cert.node_id!r}",
            )
        return None

    async def _migration_end(self, envelope: Envelope, cert: Certificate) -> tuple[str, str] | None:
        """A node agent reports a migration (``unit.migrated``, ``unit.migration_failed``)
        only as an end of one the scheduler started: an authentic ``unit.migration_started`` of
        this sandbox with the same id, unit and nodes, its node one of them."""
        p = envelope.payload
        mid = p.get("migration_id")
        ends = (p.get("from_node"), p.get("to_node"))
        sid = envelope.aggregate_id
        subject = subject_for("unit.migration_started", sid)
        if mid:
            async for _, data in scan_seq(self._js, subject, limit=1 << 30):
                started = await self.authentic(data)
                if started is None or started.subject != subject:
                    continue
                s = started.payload
                if s.get("migration_id") != mid:
                    continue
                if (
                    (s.get("from_node"), s.get("to_node")) == ends
                    and s.get("unit", "main") == p.get("unit", "main")
                    and cert.node_id in ends
                ):
                    return None
        return (
            "wrong-node",
            f"no migration {mid!r} of sandbox {sid} from {ends[0]!r} to {ends[1]!r} was started "
            f"for node {cert.node_id!r} to report",
        )

    async def placement(self, sandbox_id: str, *, before: int | None = None) -> str | None:
        """The node of the sandbox's latest authentic ``sandbox.scheduled`` or ``unit.migrated``
        (read from the log each time: only the stream positions already read are remembered).
        Attempts only grow: a placement whose attempt is not above the one before is the
        replayed bytes of an old one (a genuine event re-published), and never moves the
        sandbox back. A migration moves it from the node it is on (its ``from_node``), once per
        ``migration_id``, and only when logged after the placement it moves; ``before``: the
        stream position of the event being checked (what the source said before it migrated
        stays the source's)."""
        subject = subject_for("sandbox.scheduled", sandbox_id)
        read, node, attempt, placed_seq = self._nodes.get(sandbox_id, (0, None, 0, 0))
        async for seq, data in scan_seq(self._js, subject, limit=1 << 30, after=read):
            read = seq
            envelope = await self.authentic(data)
            if envelope is not None and envelope.subject == subject:
                placed = _attempt(envelope.payload)
                if placed > attempt:
                    node, attempt, placed_seq = str(envelope.payload.get("node_id")), placed, seq
        _remember(self._nodes, sandbox_id, (read, node, attempt, placed_seq))
        moved = await self._migrations(sandbox_id)
        for seq, from_node, to_node in moved:
            if before is not None and seq > before:
                break
            if seq > placed_seq and from_node == node:
                node = to_node
        return node

    async def _migrations(self, sandbox_id: str) -> list[tuple[int, str, str]]:
        """``(stream seq, from_node, to_node)`` of the sandbox's authentic ``unit.migrated``,
        in log order, each migration id once."""
        subject = subject_for("unit.migrated", sandbox_id)
        read, found, ids = self._moves.get(sandbox_id, (0, [], frozenset()))
        async for seq, data in scan_seq(self._js, subject, limit=1 << 30, after=read):
            read = seq
            envelope = await self.authentic(data)
            if envelope is None or envelope.subject != subject:
                continue
            mid = str(envelope.payload.get("migration_id"))
            if mid in ids or envelope.payload.get("unit", "main") != "main":
                continue  # each migration once; only the unit main moves the sandbox
            ids = ids | {mid}
            p = envelope.payload
            found = [*found, (seq, str(p.get("from_node")), str(p.get("to_node")))]
        _remember(self._moves, sandbox_id, (read, found, ids))
        return found

    async def lifecycle(
        self, sandbox_id: str, limit: int = 256, *, upto: int | None = None
    ) -> Lifecycle:
        """The sandbox's state: the fold of its authentic lifecycle events in log order (each
        lifecycle type's subject read directly; forged or unauthorized ones are skipped, and
        only authentic ones count toward ``limit`` per type, so no number of forged messages
        on a subject hides a genuine event after them). ``upto``: its state as of that stream
        position (the events logged after it left out)."""
        found: list[tuple[int, Envelope]] = []
        for event_type in sorted(LIFECYCLE_TYPES):
            kept = 0
            async for seq, envelope in self._genuine(subject_for(event_type, sandbox_id), upto):
                found.append((seq, envelope))
                kept += 1
                if kept >= limit:
                    break
        found.sort(key=lambda item: item[0])
        return fold_envelopes(envelope for _, envelope in found)

    async def _tenant(self, envelope: Envelope) -> tuple[str, str] | None:
        if envelope.aggregate != SpecSubmitted.AGGREGATE:
            return None
        first = await self._first_submission(envelope.aggregate_id)
        if envelope.type == SpecSubmitted.TYPE:
            if first is not None and first[0] != envelope.id:
                return "aggregate-exists", f"sandbox {envelope.aggregate_id} was submitted before"
            return None
        if first is None:
            return None  # no such sandbox: the handler answers that (a terminal event)
        if first[1] != envelope.tenant:
            sandbox, tenant = envelope.aggregate_id, envelope.tenant
            return "cross-tenant", f"sandbox {sandbox} belongs to another tenant, not {tenant!r}"
        return None

    async def tenant_of(self, sandbox_id: str) -> str | None:
        """The tenant of a sandbox: that of its first authentic ``spec.submitted``."""
        first = await self._first_submission(sandbox_id)
        return first[1] if first is not None else None

    async def _first_submission(self, sandbox_id: str) -> tuple[str, str] | None:
        """(id, tenant) of the first *authentic* spec.submitted of a sandbox, cached. Every
        message is read until it: 32 junk messages stored first on the subject (any user may
        store them) unbound the sandbox from its tenant, and the tenant checks with it."""
        cached = self._tenants.get(sandbox_id)
        if cached is not None:
            return cached[0], cached[1]
        subject = subject_for(SpecSubmitted.TYPE, sandbox_id)
        # each message once: a later lookup goes on from where this one stopped (junk stored on
        # a sandbox never submitted is not read again for every event about it)
        read = self._unsubmitted.pop(sandbox_id, 0)
        undecided = 0  # the first one whose key the log may yet show otherwise: read it again
        async for seq, data in scan_seq(self._js, subject, 1 << 62, after=read):
            read = seq
            try:
                fields = unpack_fields(data)
                env = Envelope.model_validate(fields)
            except (MalformedEnvelope, ValueError):
                continue
            if env.subject != subject:  # another sandbox's submission, copied here
                continue
            cert = await self.keys.certificate(env.key_id, at_seq=seq)
            if isinstance(cert, str):  # a registration or revocation the log may show later
                later = "not registered" in cert or "revoked" in cert
                undecided = undecided or (seq if later else 0)
                continue
            if not verify_raw(fields, bytes.fromhex(cert.public_key)):
                continue
            if authz.refusal(fields, cert) is None:
                found = (env.id, env.tenant)
                _remember(self._tenants, sandbox_id, found)
                return found
        _remember(self._unsubmitted, sandbox_id, undecided - 1 if undecided else read)
        return None

    async def authentic(self, data: bytes, *, stream_seq: int | None = None) -> Envelope | None:
        """The envelope when it is authentic and authorized (no replay check), else None;
        ``stream_seq``: where the log holds it (see :meth:`check`)."""
        try:
            fields = unpack_fields(data)
            envelope = Envelope.model_validate(fields)
        except (MalformedEnvelope, ValueError):
            return None
        checked = await self.check(fields, envelope, stream_seq=stream_seq)
        return envelope if checked is None else None

    async def find(
        self, subject: str, *, event_id: str | None = None, limit: int = 256
    ) -> Envelope | None:
        """An authentic, authorized event on ``subject``: the one with ``event_id``, else the
        newest of the first ``limit`` authentic ones. Forged or unauthorized messages on the
        subject are skipped, never returned, and do not count toward ``limit`` (before, 256 of
        them hid every genuine event after them)."""
        found: Envelope | None = None
        kept = 0
        async for _, envelope in self._genuine(subject, event_id=event_id):
            if event_id is not None:
                return envelope
            found = envelope
            kept += 1
            if kept >= limit:
                break
        return found

    async def _genuine(
        self, subject: str, upto: int | None = None, *, event_id: str | None = None
    ) -> AsyncIterator[tuple[int, Envelope]]:
        """The authentic, authorized events filed on ``subject`` (up to stream seq ``upto``;
        only the one with ``event_id``), oldest first, with their stream seqs; each event id
        once (a genuine event published again is a copy). Every message is read: no number
        of forged or copied ones hides a genuine event after them."""
        seen: set[str] = set()
        async for seq, data in scan_seq(self._js, subject, 1 << 62):
            if upto is not None and seq > upto:
                return  # (oldest first: the rest are later too)
            try:
                fields = unpack_fields(data)
                envelope = Envelope.model_validate(fields)
            except (MalformedEnvelope, ValueError):
                continue
            if event_id is not None and envelope.id != event_id:
                continue
            if envelope.subject != subject or envelope.id in seen:  # copied from elsewhere, again
                continue
            if await self.check(fields, envelope, stream_seq=seq) is None:
                seen.add(envelope.id)
                yield seq, envelope

    async def newest(
        self, subject: str, *, after: int = 0, than: Envelope | None = None
    ) -> tuple[Envelope | None, int]:
        """The newest authentic, authorized event on ``subject`` stored after stream seq
        ``after`` and signed later than ``than`` (the one in force; ``None`` when there is no
        such event), and the last stream seq read. Every message after ``after`` is read, so no
        number of forged messages on the subject hides a genuine newer one (:meth:`find` reads
        the first ``limit``); callers pass the seq back in to read only what came since.

        Newest means signed last, not stored last: anyone may publish an authentic event's
        bytes again (a user republished an old operator setting, and every node took it as the
        one in force), and a copy keeps its signing time."""
        found: Envelope | None = None
        newest = than
        last = after
        async for seq, data in scan_seq(self._js, subject, 1 << 62, after=after):
            last = seq
            try:
                fields = unpack_fields(data)
                envelope = Envelope.model_validate(fields)
            except (MalformedEnvelope, ValueError):
                continue
            if envelope.subject != subject:  # copied here from elsewhere
                continue
            if newest is not None and envelope.time <= newest.time:
                continue  # an older one, or a copy of the one in force
            if envelope.time - datetime.now(UTC) > CLOCK_SKEW:
                continue  # dated ahead: it would stay "newest" until that date
            if await self.check(fields, envelope, stream_seq=seq) is None:
                found = newest = envelope
        return found, last

    async def _replay(
        self, envelope: Envelope, stream_seq: int, consumer: str, *, user: bool
    ) -> tuple[str, str] | None:
        if self._handled is None:
            return None
        if envelope.time - datetime.now(UTC) > CLOCK_SKEW:
            return "future", f"event dated {envelope.time.isoformat()}, in the future"
        # stale a little before the handled id is forgotten: an event dated up to CLOCK_SKEW
        # ahead and handled at once would otherwise be taken again in that gap
        if datetime.now(UTC) - envelope.time > HANDLED_TTL - CLOCK_SKEW:
            return (
                "stale",
                f"event from {envelope.time.isoformat()} is older than the replay window",
            )
        if not canonical_uuid(envelope.id):
            # Ids key what a consumer handled (``<consumer>.<id>``, and its runtime's attempts
            # beside it): an id with dots could land on another request's keys.
            return "malformed", f"event id {envelope.id[:80]!r} is not a UUID"
        taken = await self._claim(envelope, stream_seq) if user else None
        if taken is not None:
            return "replayed", taken
        seen = await self._first(handled_key(consumer, envelope, user=user), stream_seq)
        if seen is None and user:
            # (handled by the release before, which keyed a user's events by id alone)
            seen = await self._recorded(f"{consumer}.{envelope.id}")
        if seen is None or seen == str(stream_seq):
            return None  # (the same message again: a redelivery, the handler is idempotent)
        return "replayed", f"event {envelope.id} was handled at stream sequence {seen}"

    async def _recorded(self, key: str) -> str | None:
        """The stream position recorded under ``key``, if any."""
        assert self._handled is not None
        try:
            entry = await self._handled.get(key)
        except NotFoundError:
            return None
        return (entry.value or b"").decode()

    async def _first(self, key: str, stream_seq: int) -> str | None:
        """Record ``stream_seq`` under ``key`` unless a value is there: None when recorded
        now, else the value found."""
        assert self._handled is not None
        try:
            await self._handled.create(key, str(stream_seq).encode())
            return None
        except KeyWrongLastSequenceError:
            entry = await self._handled.get(key)
        return (entry.value or b"").decode()

    async def _claim(self, envelope: Envelope, stream_seq: int) -> str | None:
        """One message per user key and event id, for every consumer alike: why this one (a
        user's event) is not it. (Not a service's: its ids are derived from its input.)

        A user chooses its ids (fresh, but its own) and may store two requests under one (a
        raw publish with a ``Nats-Msg-Id`` of its own). Replay protection per consumer let
        each consumer take one of them: two services answered two requests under one answer
        id, or one request's answer passed for the other's. The first consumer to admit one
        claims the id for its stream position (``id.<key id>.<event id>``, in the handled-ids
        bucket); every consumer then admits that message alone. Claims are per signing key:
        another user's message under a copied id claims nothing of this one's. A claim is read
        back from the log before it refuses anything (the same key, id and subject, stored
        where it says), so a claim no such message backs (written by a compromised consumer,
        pointed at a copy elsewhere) refuses nothing."""
        try:
            found = await self._first(f"{ID_CLAIMS}.{envelope.key_id}.{envelope.id}", stream_seq)
            claimed = int(found) if found is not None else stream_seq
        except (ValueError, NotFoundError):
            return None  # (a claim junk or gone meanwhile: the consumer's own check stands)
        if claimed == stream_seq or not await self._same_at(claimed, envelope):
            return None
        return (
            f"event id {envelope.id} was already used by this key's event at stream sequence "
            f"{claimed}: one id admits one message (publish each request under a new id)"
        )

    async def _same_at(self, stream_seq: int, envelope: Envelope) -> bool:
        """Whether the log holds, at ``stream_seq``, an authentic event of ``envelope``'s id and
        signing key, stored on its own subject (not a copy elsewhere)."""
        try:
            msg = await self._js.get_msg(STREAM, seq=stream_seq)
            fields = unpack_fields(msg.data or b"")
            found = Envelope.model_validate(fields)
        except Exception:  # (gone, or not an event: no claim to honour)
            return False
        if (found.id, found.key_id) != (envelope.id, envelope.key_id):
            return False
        if msg.subject != found.subject:
            return False
        return await self.check(fields, found, stream_seq=stream_seq) is None
