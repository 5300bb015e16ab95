"""Drive a service's real handlers through FastStream's in-memory broker (``TestNatsBroker``).

What works under ``TestNatsBroker`` as it is: the subscribers ``Service.handles`` declares (pull
consumers on the stream are matched by subject and stream name and called once per publish),
manual acks (no-ops). What does not: a message from the in-memory broker carries no JetStream
metadata (delivery attempt, stream sequence), and the trust gate, the publisher and handlers
that read history need the stream itself (direct gets by subject, ordered replays, the handled
ids bucket).

The seam is therefore small and explicit:

* :attr:`dsec_core.service.Service.delivery` (the only change to the runtime) takes the attempt
  and stream sequence from :class:`MemoryLog` instead of the message's metadata;
* :class:`MemoryLog` is an in-memory ``DSEC_EVENTS``: the subset of ``JetStreamContext`` the
  runtime, :class:`~dsec_core.trust.Gate`, :class:`~dsec_core.trust.KeyRing`,
  :class:`~dsec_core.bus.EventPublisher` and :func:`~dsec_core.bus.replay` call (publish with
  ``Nats-Msg-Id`` dedup, direct get by subject, stream info, ordered pull consumers, the
  handled-ids bucket).

The gate is the real one, with a real operator root, real certificates and signatures: an
unsigned, forged, unauthorized, cross-tenant or replayed message is refused exactly as on the
real server, answered by ``security.event_rejected`` in the log, and never reaches the handler.
Not covered in memory: redelivery and backoff (the in-memory broker delivers once), NATS
permissions, the stream's own configuration; the real-server tests cover those.

Use::

    service = create_service(settings)
    async with in_memory(service) as bus:
        sent = await bus.send("user", SpecSubmitted(spec_yaml=...), "sbx_1")
        (answer,) = bus.caused_by(sent)
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, cast

from dsec_core.bus import EventPublisher
from dsec_core.envelope import Envelope, decode
from dsec_core.events import Payload
from dsec_core.identity import Role
from dsec_core.service import Service
from dsec_core.subjects import STREAM, subject_for
from dsec_core.trust import Gate, KeyRing
from faststream.nats import TestNatsBroker
from faststream.nats.annotations import NatsMessage
from nacl.signing import SigningKey
from nats.js.errors import KeyWrongLastSequenceError, NotFoundError

from dsec_testing.trust import Producer, certified


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, a final ``>`` one or more."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


@dataclass
class _Entry:
    key: str
    value: bytes
    revision: int


class MemoryKV:
    """The handled-ids bucket: ``create`` fails on an existing key, as JetStream KV does."""

    def __init__(self) -> None:
        self._items: dict[str, _Entry] = {}
        self._revision = 0

    async def create(self, key: str, value: bytes) -> int:
        if key in self._items:
            raise KeyWrongLastSequenceError()
        self._revision += 1
        self._items[key] = _Entry(key, value, self._revision)
        return self._revision

    async def get(self, key: str) -> _Entry:
        if key not in self._items:
            raise NotFoundError()
        return self._items[key]

    async def put(self, key: str, value: bytes) -> int:
        self._revision += 1
        self._items[key] = _Entry(key, value, self._revision)
        return self._revision

    async def update(self, key: str, value: bytes, last: int | None = None) -> int:
        if key not in self._items or self._items[key].revision != last:
            raise KeyWrongLastSequenceError()
        self._revision += 1
        self._items[key] = _Entry(key, value, self._revision)
        return self._revision


class _OrderedSub:
    """An ordered pull consumer over the log from a start sequence (``bus.follow``)."""

    def __init__(self, log: MemoryLog, subject: str, start_seq: int) -> None:
        self._log, self._subject, self._next = log, subject, max(start_seq, 1)

    def _pending(self) -> list[tuple[int, str, bytes]]:
        return [r for r in self._log.records if r[0] >= self._next and self._match(r[1])]

    def _match(self, subject: str) -> bool:
        return subject_matches(self._subject, subject)

    async def fetch(self, batch: int = 1, timeout: float | None = None) -> list[Any]:
        found = self._pending()[:batch]
        if not found:
            raise TimeoutError
        self._next = found[-1][0] + 1
        return [
            SimpleNamespace(
                data=data,
                subject=subject,
                metadata=SimpleNamespace(sequence=SimpleNamespace(stream=seq)),
            )
            for seq, subject, data in found
        ]

    async def consumer_info(self) -> Any:
        return SimpleNamespace(num_pending=len(self._pending()))

    async def unsubscribe(self) -> None:
        return None


class MemoryLog:
    """An in-memory ``DSEC_EVENTS`` stream (the ``JetStreamContext`` calls DSec makes)."""

    def __init__(self) -> None:
        self.records: list[tuple[int, str, bytes]] = []
        self._ids: dict[str, int] = {}
        self.handled = MemoryKV()

    # --- JetStreamContext ------------------------------------------------------------------

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,
        stream: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> Any:
        msg_id = (headers or {}).get("Nats-Msg-Id")
        if msg_id is not None and msg_id in self._ids:  # the duplicate window
            return SimpleNamespace(stream=STREAM, seq=self._ids[msg_id], duplicate=True)
        seq = len(self.records) + 1
        self.records.append((seq, subject, payload))
        if msg_id is not None:
            self._ids[msg_id] = seq
        return SimpleNamespace(stream=STREAM, seq=seq, duplicate=False)

    async def get_msg(
        self,
        stream_name: str,
        seq: int | None = None,
        subject: str | None = None,
        next: bool = False,
    ) -> Any:
        for rseq, rsubject, data in self.records:
            if seq is not None and (rseq < seq if next else rseq != seq):
                continue
            if subject is not None and not subject_matches(subject, rsubject):
                continue
            return SimpleNamespace(seq=rseq, subject=rsubject, data=data)
        raise NotFoundError()

    async def stream_info(self, name: str) -> Any:
        last = len(self.records)
        return SimpleNamespace(state=SimpleNamespace(last_seq=last, messages=last))

    async def pull_subscribe(
        self,
        subject: str,
        durable: str | None = None,
        stream: str | None = None,
        config: Any = None,
    ) -> _OrderedSub:
        return _OrderedSub(self, subject, int(getattr(config, "opt_start_seq", 1) or 1))

    async def key_value(self, bucket: str) -> MemoryKV:
        return self.handled

    # --- for tests -------------------------------------------------------------------------

    def seq_of(self, data: bytes) -> int:
        """The newest stream sequence holding exactly ``data`` (0: not in the log)."""
        return next((seq for seq, _, d in reversed(self.records) if d == data), 0)

    def seq_of_id(self, event_id: str) -> int:
        """The stream sequence of the envelope with ``event_id`` (0: not in the log)."""
        return next((seq for seq, _, d in self.records if decode(d).id == event_id), 0)

    def envelopes(self, pattern: str = "dsec.>") -> list[Envelope]:
        """The envelopes stored on subjects matching ``pattern``, in log order."""
        return [decode(d) for _, s, d in self.records if subject_matches(pattern, s)]


class _Connection:
    """What a service holds as its NATS connection, in memory (``jetstream()`` is the log)."""

    def __init__(self, log: MemoryLog) -> None:
        self._log = log
        self.is_connected = True

    def jetstream(self) -> MemoryLog:
        return self._log

    async def subscribe(self, subject: str, **_: Any) -> _Subscription:
        """Core NATS (requests outside the stream): nothing is published there in memory."""
        return _Subscription()

    async def drain(self) -> None:
        self.is_connected = False


class _Subscription:
    async def unsubscribe(self) -> None:
        pass


@dataclass
class MemoryBus:
    """A started service in memory: its log, the operator root, and certified producers."""

    service: Service
    log: MemoryLog
    root: SigningKey
    broker: Any
    _producers: dict[tuple[str, str | None], EventPublisher] = field(default_factory=dict)

    async def producer(
        self, role: Role, *, tenant: str | None = None, node_id: str | None = None
    ) -> EventPublisher:
        """A publisher certified by this bus' root for ``role`` (its key in the log)."""
        key = (role, tenant or node_id)
        if key not in self._producers:
            made: Producer = certified(
                self.root, role, tenant=tenant, node_id=node_id, acts_for=tenant or "default"
            )
            pub = EventPublisher(cast(Any, self.log), made.signer, certificate=made.cert)
            await pub.register_key()
            self._producers[key] = pub
        return self._producers[key]

    async def send(
        self,
        role: Role,
        payload: Payload,
        aggregate_id: str,
        *,
        tenant: str | None = None,
        node_id: str | None = None,
        deliver: bool = True,
    ) -> Envelope:
        """Publish ``payload`` as a certified ``role`` into the log, then (``deliver``) through
        the in-memory broker to the service's subscriber of its type."""
        pub = await self.producer(role, tenant=tenant, node_id=node_id)
        published = await pub.publish(payload, aggregate_id=aggregate_id)
        if deliver:
            await self.deliver(published.sealed.wire, published.sealed.subject)
        return published.sealed.envelope

    async def deliver(self, data: bytes, subject: str, *, again: bool = False) -> None:
        """Hand raw bytes to the service as JetStream would deliver them (forgeries too).
        Bytes not in the log yet, or ``again`` (a replay: the same bytes at a new stream
        position), are stored first."""
        if again or not self.log.seq_of(data):
            self.log.records.append((len(self.log.records) + 1, subject, data))
        await self.broker.publish(data, subject, stream=STREAM)
        await self.service.settled()  # a handler with workers runs it in a task: wait for it

    def caused_by(self, cause: Envelope) -> list[Envelope]:
        """The events the service published in answer to ``cause``."""
        return [e for e in self.log.envelopes() if e.causation_id == cause.id]

    def rejections(self) -> list[Envelope]:
        """The ``security.event_rejected`` answers in the log."""
        return self.log.envelopes("dsec.security.>")


def _delivery(log: MemoryLog) -> Any:
    def delivery(msg: NatsMessage) -> tuple[int, int]:
        return 1, log.seq_of(msg.raw_message.data)

    return delivery


async def until(check: Callable[[], object], what: str, timeout_s: float = 5.0) -> None:
    """Wait for ``check()`` to be true (a loop turn at a time), or fail naming ``what``."""
    try:
        async with asyncio.timeout(timeout_s):
            while not check():
                await asyncio.sleep(0.001)
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s} s: {what}") from None


@contextlib.asynccontextmanager
async def in_memory(service: Service, *, run_hooks: bool = True) -> AsyncIterator[MemoryBus]:
    """Start ``service`` on an in-memory log and broker: its own key certified by a fresh
    operator root and registered in the log, the real gate (with replay protection) in front
    of its handlers; its ``on_start``/``on_stop`` hooks run unless ``run_hooks`` is false."""
    log = MemoryLog()
    root = SigningKey.generate()
    me = certified(root, cast(Role, service.name), acts_for="system")
    service.nc = cast(Any, _Connection(log))
    service.publisher = EventPublisher(cast(Any, log), me.signer, certificate=me.cert)
    await service.publisher.register_key()
    service.keys = KeyRing(cast(Any, None), cast(Any, log), bytes(root.verify_key))
    service.gate = Gate(service.keys, cast(Any, log), cast(Any, log.handled))
    service.delivery = _delivery(log)
    if run_hooks:
        for hook in service.on_start:
            await hook()
    try:
        service.start_workers()
        async with TestNatsBroker(service.broker) as broker:
            yield MemoryBus(service, log, root, broker)
    finally:
        await service.stop_workers()
        if run_hooks:
            for hook in service.on_stop:
                await hook()


__all__ = ["MemoryBus", "MemoryKV", "MemoryLog", "in_memory", "subject_matches", "until"]


class _NoCoreNats:
    """Core NATS for a key ring over a :class:`MemoryLog` (its revocation feed: none)."""

    async def subscribe(self, *_: Any, **__: Any) -> None:
        return None


def memory_gate(root: SigningKey, log: MemoryLog) -> Gate:
    """A fresh consumer's gate (nothing remembered) over ``log``, trusting ``root``."""
    ring = KeyRing(cast(Any, _NoCoreNats()), cast(Any, log), bytes(root.verify_key))
    return Gate(ring, cast(Any, log), cast(Any, log.handled))


async def register_keys(log: MemoryLog, *producers: Producer) -> None:
    """Store each producer's key registration in ``log``."""
    for producer in producers:
        subject = subject_for("audit.key_registered", producer.signer.key_id)
        await log.publish(subject, producer.registration())
