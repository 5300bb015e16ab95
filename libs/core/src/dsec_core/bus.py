"""The event bus: one JetStream stream, signed publishing with dedup ids, and stream replay.

Publishing: every envelope goes out with ``Nats-Msg-Id`` = its id, so a retried publish (after a
crash or a lost ack) is dropped by JetStream's duplicate window instead of doubled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError, MaxPayloadError, NoRespondersError, ProtocolError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    Header,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import (
    BadRequestError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.protocol.parser import AWAITING_CONTROL_LINE as _AWAITING_CONTROL_LINE
from nats.protocol.parser import Parser

from dsec_core import natsclient
from dsec_core.settings import Settings
from dsec_core.subjects import ALL_EVENTS, STATE_STREAM, STATE_SUBJECTS, STREAM

if TYPE_CHECKING:
    from dsec_core.envelope import Envelope
    from dsec_core.events import Payload
    from dsec_core.identity import Certificate
    from dsec_core.signing import Sealed, Signer

# The event models, identities and signatures (a third of a second of imports) load on first
# use: `dsec audit verify` replays the stream without them (its reader, and its forked verifier,
# which reads key events with dsec_core.eventbase alone).

log = logging.getLogger(__name__)

DUPLICATE_WINDOW_S = 120.0


def stream_config(replicas: int = 1) -> StreamConfig:
    """The ``DSEC_EVENTS`` stream: file storage, no delete, no purge, a duplicate window;
    ``replicas`` copies on as many servers of a NATS cluster (the embedded stack: min(3, N))."""
    return StreamConfig(
        name=STREAM,
        description="DSec event log and signed audit trail",
        subjects=[ALL_EVENTS],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        duplicate_window=DUPLICATE_WINDOW_S,
        deny_delete=True,
        deny_purge=True,
        allow_direct=True,
        num_replicas=replicas,
    )


def state_stream_config(replicas: int = 1) -> StreamConfig:
    """The ``DSEC_STATE`` stream of agents' hot state deltas (docs/state.md): one subject per
    agent, file storage, no deletes; a keeper's warm snapshot replaces an agent's older deltas
    with one ``Nats-Rollup: sub`` marker (so no role but the operator ever needs the purge API);
    as many replicas as ``DSEC_EVENTS``."""
    return StreamConfig(
        name=STATE_STREAM,
        description="DSec agents' state deltas (encrypted, chunked; never events)",
        subjects=[STATE_SUBJECTS],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        discard=DiscardPolicy.OLD,
        duplicate_window=DUPLICATE_WINDOW_S,
        deny_delete=True,
        deny_purge=False,  # a rollup is a purge of the subject's older messages
        allow_rollup_hdrs=True,
        max_msg_size=1 << 20,
        num_replicas=replicas,
    )


async def ensure_state_stream(js: JetStreamContext, *, replicas: int | None = None) -> None:
    """Create ``DSEC_STATE`` or restore its settings (operator only, like :func:`ensure_stream`,
    which calls it)."""
    wanted = state_stream_config(replicas or 1)
    try:
        current = (await js.stream_info(STATE_STREAM)).config
    except NotFoundError:
        try:
            await js.add_stream(wanted)
            return
        except BadRequestError:  # created concurrently
            current = (await js.stream_info(STATE_STREAM)).config
    fields = ("subjects", "deny_delete", "allow_rollup_hdrs", "duplicate_window")
    changed = any(getattr(current, f) != getattr(wanted, f) for f in fields)
    if replicas is not None and current.num_replicas != replicas:
        current.num_replicas = replicas
        changed = True
    if changed:
        for f in fields:
            setattr(current, f, getattr(wanted, f))
        await js.update_stream(current)


async def connect(settings: Settings, name: str) -> NATS:
    """Connect with the settings' credentials and TLS, unlimited reconnects (a restarting
    server is waited for)."""
    return await natsclient.connect(
        settings,
        name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.2,
        connect_timeout=5,
        allow_reconnect=True,
    )


async def ensure_stream(js: JetStreamContext, *, replicas: int | None = None) -> None:
    """Create the stream, or update it to the expected configuration.

    Operator only: NATS permissions refuse stream creation and updates to every other role
    (:mod:`dsec_core.natsperms`); services call :func:`require_stream` instead. ``replicas``
    (the embedded cluster's min(3, N)) is applied to the stream and the replay bucket; ``None``
    keeps what an operator chose on an existing stream (R1 when it is created here).
    """
    from dsec_core.trust import handled_bucket

    wanted = stream_config(replicas or 1)
    try:
        current = (await js.stream_info(STREAM)).config
    except NotFoundError:
        try:
            await js.add_stream(wanted)
            await handled_bucket(js, replicas=replicas)
            await ensure_state_stream(js, replicas=replicas)
            return
        except BadRequestError:  # created concurrently
            current = (await js.stream_info(STREAM)).config
    # Only the guarantees DSec relies on are enforced; what an operator tuned on an external
    # cluster (replicas, placement, limits it approved in the metadata) is kept.
    fields = ("subjects", "deny_delete", "deny_purge", "duplicate_window", "allow_rollup_hdrs")
    changed = any(getattr(current, f) != getattr(wanted, f) for f in fields)
    if replicas is not None and current.num_replicas != replicas:
        log.info("stream %s: replicas %s -> %s", STREAM, current.num_replicas, replicas)
        current.num_replicas = replicas
        changed = True
    for f in fields:
        setattr(current, f, getattr(wanted, f))
    if stream_problems(current):  # limits that discard history, never approved: lift them
        for f in ("max_msgs", "max_bytes", "max_age", "max_msgs_per_subject"):
            if _limited(getattr(current, f)):
                log.warning("stream %s: removing %s=%s", STREAM, f, getattr(current, f))
                setattr(current, f, -1 if f != "max_age" else 0)
                changed = True
    if changed:
        await js.update_stream(current)
    # The operator also creates the consumers' replay-protection bucket (services may only
    # write their own keys into it), with as many replicas as the stream, and the state plane's
    # stream of agents' deltas.
    await handled_bucket(js, replicas=replicas)
    await ensure_state_stream(js, replicas=replicas)


RETENTION_APPROVED_KEY = "dsec_retention_approved"
"""Stream metadata key the operator sets to ``"true"`` to accept limits that discard history."""


class StreamWeakened(RuntimeError):
    """``DSEC_EVENTS`` is missing or configured so that history can be lost or rewritten."""


def _limited(value: float | int | None) -> bool:
    return value is not None and value > 0


def stream_problems(config: StreamConfig) -> list[str]:
    """What is wrong with ``config`` for an append-only audit log (pure; empty when sound).

    ``deny_delete``/``deny_purge``, limits retention, no rollup, and ``dsec.>`` captured are
    always required. Limits that discard history (``max_msgs``, ``max_bytes``, ``max_age``,
    ``max_msgs_per_subject``) are accepted only when the operator approved them in the stream's
    metadata (``dsec_retention_approved: "true"``).
    """
    problems: list[str] = []
    if not config.deny_delete:
        problems.append("deny_delete is off (messages can be deleted)")
    if not config.deny_purge:
        problems.append("deny_purge is off (the stream can be purged)")
    if config.retention not in (None, RetentionPolicy.LIMITS):
        problems.append(f"retention is {config.retention} (acknowledged events would be removed)")
    if config.allow_rollup_hdrs:
        problems.append("allow_rollup_hdrs is on (a publisher can purge a subject)")
    if ALL_EVENTS not in (config.subjects or []):
        problems.append(f"subjects {config.subjects} do not capture {ALL_EVENTS}")
    approved = (config.metadata or {}).get(RETENTION_APPROVED_KEY) == "true"
    limits = {
        "max_msgs": config.max_msgs,
        "max_bytes": config.max_bytes,
        "max_age": config.max_age,
        "max_msgs_per_subject": config.max_msgs_per_subject,
    }
    set_limits = [f"{k}={v}" for k, v in limits.items() if _limited(v)]
    if set_limits and not approved:
        discard = str(getattr(config.discard, "value", config.discard) or "old")
        problems.append(
            f"{', '.join(set_limits)} with discard={discard} would lose events; the operator "
            f"must remove the limits or approve them (metadata {RETENTION_APPROVED_KEY}=true)"
        )
    return problems


@dataclass(frozen=True)
class Retention:
    """Limits an operator approves on ``DSEC_EVENTS`` (``None``: no limit of that kind).

    ``max_msgs_per_subject`` is the one that suits the log: a subject per key, per sandbox and
    event type, per node and event type, so it bounds what repeats on one subject (node
    heartbeats) and keeps key registrations, revocations and each sandbox's first submission.
    ``max_age`` and ``max_bytes`` drop the oldest messages of every subject, keys included.
    """

    max_msgs_per_subject: int | None = None
    max_age_s: float | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_msgs_per_subject", "max_age_s", "max_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")


async def set_retention(js: JetStreamContext, retention: Retention | None) -> StreamConfig:
    """Operator only: put the given limits on ``DSEC_EVENTS`` and approve them in its
    metadata (:data:`RETENTION_APPROVED_KEY`), so services accept the stream; ``None`` lifts
    every limit and the approval. Limits not given are lifted. Returns the new configuration.

    What a limit discards is gone from the stream (``deny_purge`` forbids every other removal):
    archive first (:mod:`dsec_core.eventarchive`), and verify with the archive.
    """
    config = (await js.stream_info(STREAM)).config
    metadata = dict(config.metadata or {})
    wanted = retention or Retention()
    config.max_msgs_per_subject = wanted.max_msgs_per_subject or -1
    config.max_age = wanted.max_age_s or 0
    config.max_bytes = wanted.max_bytes or -1
    config.max_msgs = -1
    if retention is None:
        metadata.pop(RETENTION_APPROVED_KEY, None)
    else:
        metadata[RETENTION_APPROVED_KEY] = "true"
    config.metadata = metadata
    await js.update_stream(config)
    return (await js.stream_info(STREAM)).config


async def require_stream(js: JetStreamContext) -> StreamConfig:
    """Check (never change) ``DSEC_EVENTS``: what services do at start.

    Raises:
        StreamWeakened: the stream does not exist (the operator creates it: ``dsec up``), or
            :func:`stream_problems` found something.
    """
    try:
        config = (await js.stream_info(STREAM)).config
    except NotFoundError:
        raise StreamWeakened(
            f"stream {STREAM} does not exist; the operator creates it (`dsec up`, or "
            "`nats stream add --config deploy/nats/DSEC_EVENTS.json` with operator credentials)"
        ) from None
    problems = stream_problems(config)
    if problems:
        raise StreamWeakened(f"stream {STREAM} is weakened: " + "; ".join(problems))
    return config


@dataclass(frozen=True)
class Published:
    """Where an envelope landed."""

    sealed: Sealed
    stream_seq: int
    duplicate: bool

    @property
    def envelope(self) -> Envelope:
        """The published envelope."""
        return self.sealed.envelope


PUBLISH_WINDOW = 512
"""Envelopes :meth:`EventPublisher.publish_many` keeps unacknowledged at most."""
ACK_WAIT_S = 5.0
"""How long a batch waits for the next ack before the rest goes the slow way (with retries)."""
_ACK_DECODER = msgspec.json.Decoder()


class EventPublisher:
    """Signs and publishes envelopes of one producer instance."""

    def __init__(
        self,
        js: JetStreamContext,
        signer: Signer,
        *,
        certificate: Certificate | None = None,
        retries: int = 60,
    ) -> None:
        self.js = js
        self.signer = signer
        self.certificate = certificate
        self._retries = retries
        self._chain_lock = asyncio.Lock()
        self._in_doubt: Sealed | None = None

    async def register_key(self, *, endorsement: str | None = None) -> Published:
        """Publish this producer's public key and its certificate (subject per key id);
        ``endorsement``: on a rotation, the new key signed by the previous one."""
        from dsec_core.events import KeyRegistered
        from dsec_core.identity import SYSTEM_TENANT

        cert = self.certificate
        reg = KeyRegistered(
            producer=self.signer.producer,
            key_id=self.signer.key_id,
            public_key=self.signer.public_raw.hex(),
            endorsement=endorsement,
            certificate=cert.model_dump(mode="json") if cert is not None else None,
        )
        return await self.publish(reg, aggregate_id=self.signer.key_id, tenant=SYSTEM_TENANT)

    async def rekey(self, signer: Signer, certificate: Certificate) -> None:
        """Sign with another key from now on (a rotated key picked up while running): the
        envelope still in doubt lands in the old chain first; the new key opens a new chain."""
        async with self._chain_lock:
            if self._in_doubt is not None:
                await self.publish_sealed(self._in_doubt)
                self._in_doubt = None
            self.signer = signer
            self.certificate = certificate

    async def publish(
        self,
        payload: Payload,
        *,
        aggregate_id: str,
        event_id: str | None = None,
        causation: Envelope | None = None,
        correlation_id: str | None = None,
        tenant: str | None = None,
    ) -> Published:
        """Sign ``payload`` into an envelope and publish it until JetStream acknowledges it.

        A derived ``event_id`` that JetStream already holds (a handler's output republished
        after a crash) is deduplicated; the new envelope then never entered the log, so its
        chain position is taken back and the next envelope reuses it — the chain stays unbroken.
        """
        async with self._chain_lock:
            if self._in_doubt is not None:
                # The last envelope of this chain may not have reached the log: land it (the
                # same id, so a copy that did arrive is deduplicated) before chaining another.
                await self.publish_sealed(self._in_doubt)
                self._in_doubt = None
            sealed = self.signer.seal(
                payload,
                aggregate_id=aggregate_id,
                event_id=event_id,
                causation=causation,
                correlation_id=correlation_id,
                tenant=tenant,
            )
            try:
                published = await self.publish_sealed(sealed)
            except PublishFailed:
                self._in_doubt = sealed
                raise
            except EventTooLarge:
                self.signer.rewind(sealed)  # it never left: the next envelope takes its place
                raise
            if published.duplicate:
                held = await self._held(published)
                if held == "taken":
                    # Another message took this id first in the duplicate window (derived ids
                    # are predictable, the window is stream-wide): the envelope goes in under
                    # an id only this key can compute, not dropped as a "duplicate".
                    log.warning("event id %s was taken first: published under its claim", sealed.id)
                    published = await self.publish_sealed(
                        sealed, msg_id=self.signer.claimed_id(sealed.id)
                    )
                    held = await self._held(published) if published.duplicate else "this"
                if held == "earlier":
                    self.signer.rewind(sealed)
            return published

    async def _held(self, published: Published) -> Literal["this", "earlier", "taken"]:
        """What the log holds at a duplicate's acknowledged sequence: this very envelope, an
        earlier one of this producer's key with the same id (a handler's output published again
        after a crash), or anything else (another message took the id first)."""
        from dsec_core.envelope import MalformedEnvelope
        from dsec_core.signing import verify_raw
        from dsec_core.trust import unpack_fields

        stored = (await self.js.get_msg(STREAM, published.stream_seq)).data or b""
        if stored == published.sealed.wire:
            return "this"
        try:
            fields = unpack_fields(stored)
        except MalformedEnvelope:  # not an envelope at all
            return "taken"
        earlier = (
            fields.get("id") == published.sealed.id
            and fields.get("key_id") == self.signer.key_id
            and isinstance(fields.get("sig"), str)
            and verify_raw(fields, self.signer.public_raw)
        )
        return "earlier" if earlier else "taken"

    async def publish_sealed(self, sealed: Sealed, *, msg_id: str | None = None) -> Published:
        """Publish an already signed envelope, retrying through server restarts (``msg_id``:
        its ``Nats-Msg-Id``, the envelope's id unless said)."""
        headers = {"Nats-Msg-Id": msg_id or sealed.id}
        delay = 0.05
        for attempt in range(self._retries):
            try:
                ack = await self.js.publish(sealed.subject, sealed.wire, headers=headers, timeout=5)
                return Published(sealed, ack.seq, bool(ack.duplicate))
            except MaxPayloadError:
                raise EventTooLarge(sealed.type, len(sealed.wire), self._max_payload()) from None
            except (
                TimeoutError,
                NatsTimeoutError,
                NoRespondersError,
                NoStreamResponseError,
            ) as exc:
                # NoStreamResponseError: a NATS cluster electing the stream's new leader.
                log.warning("publish %s attempt %d failed: %s", sealed.type, attempt + 1, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
        raise PublishFailed(f"could not publish {sealed.type} {sealed.id}")

    async def publish_many(
        self, batch: Sequence[Sealed], *, window: int = PUBLISH_WINDOW
    ) -> list[Published]:
        """Publish a batch with pipelined acknowledgements; order on the wire is preserved.

        JetStream's asynchronous publish: each envelope is one core publish (``Nats-Msg-Id`` =
        its id) with a reply subject of its own under one inbox, at most ``window`` of them
        unacknowledged, the acks read by one subscription callback; nats-py's ``js.publish``
        would build a request future and a timeout for each. An envelope whose ack is not a
        stored position in ``DSEC_EVENTS`` (an error, no stream, no ack within
        :data:`ACK_WAIT_S`) is published again by :meth:`publish_sealed`, with its retries and
        the same id, so a copy that did land is deduplicated.

        For envelopes with fresh ids only: a deduplicated envelope inside a batch cannot give
        its chain position back (later ones were sealed after it). Derived ids go through
        :meth:`publish`.
        """
        nc = getattr(self.js, "_nc", None)  # JetStreamContext keeps its connection private
        if len(batch) < 2 or not isinstance(nc, NATS):
            return list(await asyncio.gather(*(self.publish_sealed(s) for s in batch)))
        results: list[Published | None] = [None] * len(batch)
        progress = asyncio.Event()
        waiting = {"count": 0}

        async def on_ack(msg: Msg) -> None:
            index = int(msg.subject.rsplit(".", 1)[1])
            if results[index] is None:
                try:
                    ack = _ACK_DECODER.decode(msg.data) if msg.data else None
                except msgspec.DecodeError:
                    ack = None
                seq = ack.get("seq") if isinstance(ack, dict) else None
                if isinstance(ack, dict) and ack.get("stream") == STREAM and isinstance(seq, int):
                    results[index] = Published(batch[index], seq, bool(ack.get("duplicate")))
            waiting["count"] -= 1
            progress.set()

        async def until(more_room: int) -> bool:
            """Wait until at most ``more_room`` acks are outstanding; False: none came."""
            while waiting["count"] > more_room:
                progress.clear()
                try:
                    await asyncio.wait_for(progress.wait(), ACK_WAIT_S)
                except TimeoutError:
                    return False
            return True

        inbox = nc.new_inbox()
        sub = await nc.subscribe(f"{inbox}.*", cb=on_ack)
        try:
            for index, sealed in enumerate(batch):
                if not await until(window - 1):
                    break
                try:
                    await nc.publish(
                        sealed.subject,
                        sealed.wire,
                        reply=f"{inbox}.{index}",
                        headers={"Nats-Msg-Id": sealed.id},
                    )
                except MaxPayloadError:
                    continue  # publish_sealed says how large it is
                waiting["count"] += 1
            await until(0)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()  # no late ack lands while the rest is retried
        for index, published in enumerate(results):
            if published is None:
                results[index] = await self.publish_sealed(batch[index])
        return [p for p in results if p is not None]

    def _max_payload(self) -> int:
        # The connection's limit (the server's max_payload); JetStreamContext keeps it private.
        nc = getattr(self.js, "_nc", None)
        return int(getattr(nc, "max_payload", 0) or 0)


class PublishFailed(RuntimeError):
    """JetStream did not acknowledge an envelope after every retry."""


class EventTooLarge(ValueError):
    """An envelope is larger than the NATS server accepts (``max_payload``): never published.

    Attributes:
        event_type: the event's type.
        size: the envelope's bytes on the wire.
        limit: the server's ``max_payload`` (0 when unknown).
    """

    def __init__(self, event_type: str, size: int, limit: int) -> None:
        self.event_type, self.size, self.limit = event_type, size, limit
        over = f"the bus' max payload of {limit} bytes" if limit else "the bus' max payload"
        super().__init__(f"{event_type} is {size} bytes, over {over} (NATS max_payload)")


def _ordered_config(filter_subject: str, start_seq: int) -> ConsumerConfig:
    return ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=max(start_seq, 1),
        ack_policy=AckPolicy.NONE,
        filter_subject=filter_subject,
        inactive_threshold=30.0,
        mem_storage=True,
        num_replicas=1,  # a reader's cursor: on a cluster, no replicated consumer per reader
    )


UNAVAILABLE_RECREATE_S = 2.0
"""A reader whose consumer stays unavailable this long reads on from a new one."""


async def _subscribe(
    js: JetStreamContext, filter_subject: str, config: ConsumerConfig, attempts: int = 20
) -> JetStreamContext.PullSubscription:
    """A pull subscription with its consumer; a NATS cluster that answers "temporarily
    unavailable" (electing a leader, or too busy to commit the consumer in time) is asked again."""
    delay = 0.1
    for _ in range(attempts - 1):
        try:
            return await js.pull_subscribe(filter_subject, stream=STREAM, config=config)
        except (ServiceUnavailableError, NatsTimeoutError) as exc:
            log.warning("creating a consumer for %s: %s; retrying", filter_subject, exc)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
    return await js.pull_subscribe(filter_subject, stream=STREAM, config=config)


async def follow(
    js: JetStreamContext,
    *,
    filter_subject: str = ALL_EVENTS,
    start_seq: int = 1,
    batch: int = 512,
    idle_s: float = 0.5,
) -> AsyncIterator[list[tuple[int, bytes]]]:
    """Yield batches of ``(stream_seq, data)`` forever; an empty batch after ``idle_s`` idle.

    A fetch asks for at most ``batch`` messages, and for fewer once large ones were seen: what
    it may make the server queue behind this reader stays near ``PULL_MAX_BYTES`` (nats-py's
    fetch takes no byte budget). Messages lost on the way halve the next fetches until
    reads are whole again (a burst of large events a reader had not seen yet)."""
    sub = await _subscribe(js, filter_subject, _ordered_config(filter_subject, start_seq))
    next_seq, unavailable_since = start_seq, 0.0
    delivered = 0  # the consumer sequence of the last message read: 1, 2, 3... without holes
    # (a test double of JetStream may have no connection)
    budget = _pull_max_bytes(getattr(js, "_nc", None))
    largest = 0  # the largest message read lately (decays as smaller ones come)
    cap = batch  # halved when messages were lost, doubled back after whole reads

    async def anew() -> JetStreamContext.PullSubscription:
        # The reader's consumer is gone (it lives in memory, so a NATS restart drops it, and
        # the server deletes it after `inactive_threshold` if this process stalled that long),
        # or messages it delivered were lost on the way. Read on from the last one read.
        log.warning(
            "reader of %s: consumer gone or messages lost; reading on from %d",
            filter_subject,
            next_seq,
        )
        with contextlib.suppress(Exception):
            await sub.unsubscribe()
        return await _subscribe(js, filter_subject, _ordered_config(filter_subject, next_seq))

    try:
        while True:
            count = max(1, min(cap, budget // largest if largest else batch))
            try:
                msgs = await sub.fetch(count, timeout=idle_s)
            except TimeoutError:  # nats-py raises both its own and the builtin TimeoutError
                # An idle fetch is not the end: a slow server or a sparse filter looks the
                # same. Only report "caught up" when the consumer has nothing pending.
                try:
                    info = await sub.consumer_info()
                except NotFoundError:
                    sub, delivered = await anew(), 0
                    continue
                sent = getattr(info.delivered, "consumer_seq", 0) or 0
                if sent > delivered:
                    # Delivered, never read: lost with a connection (a reconnect, or the server
                    # dropping a slow reader). Not "caught up": read them again.
                    sub, delivered, cap = await anew(), 0, max(1, cap // 2)
                    continue
                if info.num_pending:
                    continue
                yield []
                continue
            except NotFoundError:
                sub, delivered = await anew(), 0
                continue
            except ServiceUnavailableError:
                # On a NATS cluster: the reader's consumer is not served (just created, or its
                # server went away). Ask again; after a while, read on from a new consumer.
                now = asyncio.get_running_loop().time()
                unavailable_since = unavailable_since or now
                if now - unavailable_since > UNAVAILABLE_RECREATE_S:
                    with contextlib.suppress(Exception):
                        await sub.unsubscribe()
                    config = _ordered_config(filter_subject, next_seq)
                    sub, delivered = await _subscribe(js, filter_subject, config), 0
                    unavailable_since = 0.0
                await asyncio.sleep(0.1)
                continue
            unavailable_since = 0.0
            good: list[tuple[int, bytes]] = []
            hole = False
            for m in msgs:
                try:
                    seq, number = _ack_seqs(m.reply)
                except (ValueError, AttributeError):  # not the usual subject: nats-py reads it
                    seq, number = int(m.metadata.sequence.stream), delivered + 1
                if number != delivered + 1:
                    hole = True  # lost before this one: read on anew from the last good one
                    break
                delivered = number
                good.append((seq, m.data))
            if msgs:
                largest = max(largest // 2, max(len(m.data) for m in msgs))
            if good:
                next_seq = good[-1][0] + 1
            if hole:
                sub, delivered, cap = await anew(), 0, max(1, cap // 2)
            elif cap < batch:
                cap = min(batch, cap * 2)
            yield good
    finally:
        # The caller may close the connection before this generator is finalized.
        with contextlib.suppress(ConnectionClosedError):
            await sub.unsubscribe()


async def replay(
    js: JetStreamContext,
    *,
    filter_subject: str = ALL_EVENTS,
    start_seq: int = 1,
    batch: int = 512,
) -> AsyncIterator[tuple[int, bytes]]:
    """Yield ``(stream_seq, data)`` from ``start_seq`` to the end of the stream as it is now
    (one by one; :func:`replay_batches` yields them as they are read, a list at a time)."""
    async for msgs in replay_batches(
        js, filter_subject=filter_subject, start_seq=start_seq, batch=batch
    ):
        for item in msgs:
            yield item


async def replay_batches(
    js: JetStreamContext,
    *,
    filter_subject: str = ALL_EVENTS,
    start_seq: int = 1,
    batch: int = 512,
) -> AsyncIterator[list[tuple[int, bytes]]]:
    """Yield lists of ``(stream_seq, data)`` from ``start_seq`` to the end of the stream as it
    is now, in stream order, each message once.

    Read with pipelined pull requests whose messages the connection's :class:`_ReplayTap` cuts
    out of the bytes read (:func:`_pulled`): nats-py builds a ``Msg`` and hands it to a task
    for each message, which capped a replay (``dsec audit verify``, the read models' rebuild)
    below what the verifier keeps up with. Whatever that fast path does not expect (a cluster
    electing a leader, a replica behind, an unexpected status) hands over to :func:`follow`,
    from the next position.
    """
    info = await js.stream_info(STREAM)
    last = info.state.last_seq
    if info.state.messages == 0 or start_seq > last:
        return
    next_seq = start_seq
    nc = getattr(js, "_nc", None)  # JetStreamContext keeps its connection private
    if isinstance(nc, NATS):
        async for msgs in _pulled(js, nc, filter_subject, start_seq, last):
            if msgs[-1][0] >= last:
                head = [m for m in msgs if m[0] <= last]
                if head:
                    yield head
                return
            yield msgs
            next_seq = msgs[-1][0] + 1
    async for msgs in follow(js, filter_subject=filter_subject, start_seq=next_seq, batch=batch):
        if not msgs:  # nothing more matches the filter up to ``last``
            return
        if msgs[-1][0] >= last:
            head = [m for m in msgs if m[0] <= last]
            if head:
                yield head
            return
        yield msgs


PULL_BATCH = 2048
"""Messages one pull request of a replay asks for (the next is sent before a batch is used)."""

PULL_MAX_BYTES = 16 * 1024 * 1024
"""Bytes one pull request of a replay asks for at most (at least twice the server's
``max_payload``)."""


def _pull_max_bytes(nc: Any) -> int:
    """:data:`PULL_MAX_BYTES`, or twice the connection's ``max_payload`` where that is more
    (``nc`` may be ``None``: the limit is then unknown)."""
    return max(PULL_MAX_BYTES, 2 * int(getattr(nc, "max_payload", 0) or 0))


_BYTES_FULL = "409 max bytes"
_HOLE = "hole"


def _ack_seqs(reply: str) -> tuple[int, int]:
    """The stream and consumer sequences in a JetStream message's ack subject (see
    :func:`_ack_seqs_bytes`)."""
    try:
        return _ack_seqs_bytes(reply.encode())
    except (ValueError, IndexError) as exc:
        raise ValueError(f"{exc}: {reply[:80]!r}") from None


def _ack_stream_seq(reply: str) -> int:
    """The stream sequence in a JetStream message's ack subject, as nats-py's
    ``Msg.metadata`` reads it, without building it."""
    return _ack_seqs(reply)[0]


def stream_seq(msg: Msg) -> int:
    """The stream sequence of a message a JetStream consumer delivered (from its ack subject,
    without nats-py's ``Msg.metadata``, which builds a dataclass tree for every message)."""
    try:
        return _ack_stream_seq(msg.reply)
    except (ValueError, IndexError, AttributeError):
        return int(msg.metadata.sequence.stream)


async def _pulled(
    js: JetStreamContext,
    nc: NATS,
    filter_subject: str,
    start_seq: int,
    last: int,
    *,
    wait_s: float = 5.0,
) -> AsyncIterator[list[tuple[int, bytes]]]:
    """Batches of ``(stream_seq, data)`` from ``start_seq`` through an ephemeral consumer (the
    configuration :func:`follow` uses) and ``no_wait`` pull requests answered into the
    connection's :class:`_ReplayTap` (or, where it cannot go in, a subscription callback).
    Ends at ``last``, when the server has no more for the filter, or at anything unexpected
    (the caller goes on from the next position with :func:`follow`)."""
    try:
        consumer = await js.add_consumer(STREAM, _ordered_config(filter_subject, start_seq))
    except Exception as exc:  # e.g. a cluster electing a leader: the slow path copes
        log.debug("replay: no consumer for the fast path (%s)", exc)
        return
    batch = PULL_BATCH
    inbox = nc.new_inbox()
    arrived: list[tuple[int, bytes]] = []
    state: dict[str, Any] = {"status": None, "delivered": 0}
    done = asyncio.Event()

    async def on_message(msg: Msg) -> None:
        if not msg.reply:  # a status: 404 no (more) messages, 408, 409 ...
            headers = msg.headers or {}
            status = headers.get("Status", "?")
            described = str(headers.get(Header.DESCRIPTION) or headers.get("Description") or "")
            if status == "409" and described == "Batch Completed":
                return  # after a full batch (which already woke the reader): nothing to do
            if status == "409" and "MaxBytes" in described:
                status = _BYTES_FULL  # the request's byte budget is used up: ask again
            state["status"] = status
            done.set()
            return
        try:  # (data messages come here only where the tap could not go in)
            seq, delivered = _ack_seqs(msg.reply)
        except ValueError as exc:
            state["status"] = str(exc)
            done.set()
            return
        if delivered != state["delivered"] + 1:
            state["status"] = _HOLE
            done.set()
            return
        state["delivered"] = delivered
        arrived.append((seq, msg.data))
        if len(arrived) >= batch:
            done.set()

    # A byte budget per request: the server queues what a request asks for at once, and more
    # than its per-client limit (64 MiB by default) behind a slow reader makes it drop the
    # connection (large events are enough: 2,048 of 32 KiB). One request is in flight at a
    # time, so this bounds what waits for this reader.
    max_bytes = _pull_max_bytes(nc)
    request = json.dumps({"batch": batch, "no_wait": True, "max_bytes": max_bytes}).encode()
    subject = f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.{consumer.name}"
    tap = _ReplayTap.install(nc, arrived, batch, done)
    sub = None
    try:
        sub = await nc.subscribe(inbox, cb=on_message)
        if tap is not None:
            tap.sid = str(sub._id).encode()
        await nc.publish(subject, request, reply=inbox)
        while True:
            try:
                await asyncio.wait_for(done.wait(), wait_s)
            except TimeoutError:
                return
            done.clear()
            msgs = arrived[:]
            del arrived[:]
            status, state["status"] = state["status"], None
            if tap is not None and tap.hole:
                status = _HOLE  # what came before the hole is good; the rest is read again
            finished = bool(msgs) and msgs[-1][0] >= last
            # A full batch, or a byte budget used up by some messages: ask for the next now.
            more = not finished and (status is None or (status == _BYTES_FULL and bool(msgs)))
            if status == _HOLE:
                log.warning("replay: messages lost on the way (a reconnect); reading on anew")
            if more:
                await nc.publish(subject, request, reply=inbox)
            if msgs:
                yield msgs
            if not more:
                return
    finally:
        if tap is not None:
            tap.remove()
        # The consumer goes with its inactivity threshold, as follow()'s (only the operator
        # may delete consumers).
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


def _count(token: bytes) -> int:
    """A size or sequence number of the protocol: ASCII digits only (``int`` also takes
    ``-5``, ``+5``, ``1_0`` and `` 5``: a negative size sent the replay's reader backwards, for
    ever)."""
    if not token.isdigit():  # (bytes.isdigit: ASCII digits, not empty)
        raise ValueError(f"not a count: {token[:24]!r}")
    return int(token)


def _ack_seqs_bytes(reply: bytes) -> tuple[int, int]:
    """The stream and consumer sequences in an ack subject's raw bytes, in both of its
    layouts: ``$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>...`` and the one with
    domain and account hash after ``ACK``. The consumer sequence counts 1, 2, 3... the
    messages one consumer delivers, so a hole means messages were lost on the way."""
    tokens = reply.split(b".")
    if tokens[0] != b"$JS" or tokens[1] != b"ACK":
        raise ValueError("not a JetStream ack subject")
    if len(tokens) == 9:
        return _count(tokens[5]), _count(tokens[6])
    if len(tokens) >= 11:
        return _count(tokens[7]), _count(tokens[8])
    raise ValueError("unexpected JetStream ack subject")


try:  # the C scanner of a replay's common frames (dsec_core/_framescan.c), where it was built
    from dsec_core._framescan import scan as _scan_frames
except ImportError:  # (no C compiler where it was installed: the Python path alone)
    _scan_frames = None

_TOKEN = rb"[^ .\r\n]+"
_DATA_LINE = re.compile(
    rb"(H?)MSG [^ \r\n]+ ([^ \r\n]+) \$JS\.ACK\."
    + rb"\.".join([_TOKEN] * 3)
    + rb"\.([0-9]+)\.([0-9]+)\."
    + _TOKEN
    + rb"\."
    + _TOKEN
    + rb"(?: ([0-9]+))? ([0-9]+)\r\n"
)
"""A replay's data message's control line, as the server writes it, in one match (no split):
``MSG <subject> <sid> <ack subject> <size>`` or ``HMSG ... <header size> <size>``, the ack
subject in its 9-token layout (stream and consumer sequences the 4th and 5th numbers). What it
does not match goes the general way (:meth:`_ReplayTap.parse`), which reads the same values."""


class _ReplayTap:
    """Stands in for a connection's protocol parser while :func:`_pulled` reads.

    The replay's data messages are cut out of the bytes read, in one loop, into its list (no
    ``Msg``, no task hand-off per message: nats-py's path cost a replay more than the verifier
    spends on an event); every other frame (pings, infos, errors, the pull requests' status
    messages, other subscriptions' messages) goes whole and in order to nats-py's parser.
    Goes in before the replay subscribes (so no message of it takes the slower path first and
    arrives out of order), and out when the replay ends.
    """

    def __init__(
        self, nc: NATS, inner: Parser, sink: list[tuple[int, bytes]], batch: int, full: Any
    ) -> None:
        self._nc = nc
        self._inner = inner
        self._sink = sink
        self._batch = batch
        self._full = full
        self._parts: list[bytes] = []  # the start of a frame not read whole yet
        self._have = 0  # their bytes
        self._need = 0  # the bytes that frame takes (0: not known yet)
        self.sid = b""  # the replay subscription's id, once it has one
        self.delivered = 0  # the consumer sequence of the last message taken
        self.hole = False  # a consumer sequence skipped: messages were lost (a reconnect)

    @staticmethod
    def install(
        nc: NATS, sink: list[tuple[int, bytes]], batch: int, full: asyncio.Event
    ) -> _ReplayTap | None:
        """Put a tap in; ``None`` where it cannot go (a nats-py whose parser this does not
        know, one in the middle of a message's payload, or another tap already in)."""
        inner = getattr(nc, "_ps", None)
        if (
            type(inner) is not Parser
            or inner.state != _AWAITING_CONTROL_LINE
            or not isinstance(inner.buf, bytearray)
        ):
            return None
        tap = _ReplayTap(nc, inner, sink, batch, full)
        tap._parts = [bytes(inner.buf)]  # a partial control line: the tap's now
        tap._have = len(inner.buf)
        inner.buf.clear()
        nc._ps = tap  # type: ignore[assignment]
        return tap

    def remove(self) -> None:
        if self._nc._ps is self:  # type: ignore[comparison-overlap]
            self._inner.buf.extend(b"".join(self._parts))  # a partial frame: nats-py's again
            self._parts, self._have = [], 0
            self._nc._ps = self._inner

    def reset(self) -> None:
        """nats-py on a reconnect: what was read of the old connection is gone."""
        self._parts, self._have, self._need = [], 0, 0
        self._inner.reset()

    async def parse(self, data: bytes = b"") -> None:
        if self._parts:
            self._parts.append(data)
            self._have += len(data)
            if self._have < self._need:  # a large message, still incomplete: no copy yet
                return
            buf = b"".join(self._parts)
            self._parts, self._have, self._need = [], 0, 0
        else:
            buf = bytes(data)
        end, pos, sid, sink, inner = len(buf), 0, self.sid, self._sink, self._inner
        match, scan = _DATA_LINE.match, _scan_frames
        while pos < end:
            if scan is not None and not self.hole:
                # The common frames in C (what the match below takes, the same way); it stops
                # at any other, which the code below reads, then it goes on from the next.
                pos, self.delivered = scan(buf, pos, sid, self.delivered, sink)
                if pos >= end:
                    break
            line = match(buf, pos)
            if line is not None:
                # The common frame, read in one match: the values the general way reads below.
                hmsg, line_sid, seq_text, delivered_text, header, size = line.groups()
                if line_sid == sid and (header is not None) == (hmsg == b"H"):
                    seq = int(seq_text)
                    body = line.end()
                    frame = body + int(size) + 2
                    start = body + int(header or 0)
                    if (
                        seq
                        and frame <= end
                        and start <= frame - 2
                        and buf[frame - 2 : frame] == b"\r\n"
                        and not self.hole
                    ):
                        delivered = int(delivered_text)
                        if delivered == self.delivered + 1:
                            self.delivered = delivered
                            sink.append((seq, buf[start : frame - 2]))
                            pos = frame
                            continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                break
            tokens = buf[pos:eol].split(b" ")
            op = tokens[0]
            if op == b"MSG" or op == b"HMSG":
                try:
                    frame = eol + 4 + _count(tokens[-1])
                except ValueError:
                    frame = eol + 2  # malformed: nats-py's parser says so (a protocol error)
                if frame > end:
                    self._need = frame - pos
                    break
                if frame > eol + 2 and buf[frame - 2 : frame] != b"\r\n":
                    raise ProtocolError("nats: a message does not end where its size says")
                # MSG <subject> <sid> <reply> <size>, HMSG ... <reply> <header size> <size>
                # (a stored message's headers, e.g. Nats-Msg-Id, are not the event's)
                if len(tokens) == (5 if op == b"MSG" else 6) and tokens[2] == sid:
                    try:
                        seq, delivered = _ack_seqs_bytes(tokens[3])
                        body = eol + 2 + (_count(tokens[4]) if op == b"HMSG" else 0)
                    except (ValueError, IndexError):
                        seq = 0  # no stored message (a status): the callback tells what
                    if seq and body > frame - 2:
                        raise ProtocolError("nats: a message's headers are larger than it")
                    if seq:
                        if delivered != self.delivered + 1 or self.hole:
                            # Lost messages before this one: take nothing more; the replay
                            # goes on from the last message before the hole.
                            self.hole = True
                            self._full.set()
                        else:
                            self.delivered = delivered
                            sink.append((seq, buf[body : frame - 2]))
                        pos = frame
                        continue
            else:
                frame = eol + 2
            await inner.parse(buf[pos:frame])
            pos = frame
        if pos < end:
            self._parts, self._have = [buf[pos:]], end - pos
        if len(sink) >= self._batch:
            self._full.set()
