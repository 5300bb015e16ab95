"""The service runtime: durable FastStream consumers, idempotent handlers, retries, metrics.

A service declares handlers with :meth:`Service.handles` by event class
(``service.handles(events.SpecSubmitted)(fn)``). A handler is a function of the input envelope
and its typed payload (an instance of that class) returning the output payloads; the runtime

1. verifies before it acts (:class:`dsec_core.trust.Gate`): the envelope decodes, its key is
   certified by the operator root and not revoked, the signature holds, the authorization table
   lets that producer emit this type for this tenant, and the event id was not handled before
   from another stream position. A message that fails is never handed to the handler: it is
   counted (``dsec_events_rejected_total``), answered by ``security.event_rejected`` and acked;
2. calls the handler;
3. publishes each output with an id derived from the input's type and id
   (``uuid5("<input type>/<input id>", "<output type>#<n>")``) and ``Nats-Msg-Id`` = that id,
   so a redelivery after a crash publishes nothing new;
4. acknowledges the input only after every output was acknowledged by JetStream.

On a handler error the input is NAKed with exponential backoff and redelivered, up to
``max_attempts``; then a ``sandbox.failed`` event (stage = service, the error as reason) is
published and the input acknowledged, so every request ends in a terminal event. FastStream's
default REJECT_ON_ERROR (which silently terminates a failing message) is never used.

A handler registered with ``workers=N`` (independent requests: the policy service's specs, the
builder's resolutions and builds, a node agent's launches) does not run its events in stream
order: each is verified as it arrives, held in its tenant's queue and run by one of N workers,
the tenants taking turns (:mod:`dsec_core.fairness`; bounds ``FAIR_*`` and
``DSEC_TENANT_QUEUE``). With ``select`` (a node-scoped handler: is it this node's?), an event
not selected is acked once verified and never held.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Literal, TypeVar, overload

from faststream import AckPolicy
from faststream.nats import JStream, NatsBroker, PullSub
from faststream.nats.annotations import NatsMessage
from nats import errors as nats_errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.errors import KeyWrongLastSequenceError

from dsec_core import identity, keysource, metrics, natsclient, quickexit
from dsec_core.bus import EventPublisher, StreamWeakened, connect, require_stream
from dsec_core.envelope import Envelope, MalformedEnvelope
from dsec_core.events import EventRejected, Payload, SandboxFailed, model_for
from dsec_core.fairness import FairQueue, QueueClosed, TenantFull
from dsec_core.ids import answer_ids, derive_event_id, output_event_id
from dsec_core.natsperms import durable_name
from dsec_core.settings import TENANT_QUEUE_MAX, Settings, settings_problem
from dsec_core.signing import Signer
from dsec_core.subjects import STREAM, filter_for, subject_for
from dsec_core.trust import (
    Gate,
    KeyRing,
    Refusal,
    handled_bucket,
    handled_key,
    scan_seq,
    unpack_fields,
)

SYSTEM_TENANT = identity.SYSTEM_TENANT
CONSUMER_POLL_S = 15.0
"""How often a service reads its durable consumers' pending counts (``dsec_consumer_pending``)."""


HANDLING_SEQ: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "dsec_handling_seq", default=None
)
"""The stream sequence of the message a handler is running for (``None`` outside a handler):
a handler that must see the log up to its own message (and no further) waits for exactly that."""
log = logging.getLogger(__name__)


def _idle_fetches_are_not_errors() -> None:
    """FastStream 0.7's pull consumer ends an idle fetch by catching ``nats.errors.TimeoutError``,
    but nats-py 2.16 raises the builtin ``TimeoutError`` (its base) when a fetch's deadline
    passes before the second pull request: the consumer task then died on an idle read, and
    FastStream's supervisor logged it as an ERROR with a traceback and started it again (once
    a consumer, about a second after every service start). Its modules catch the base
    instead, which is what they mean: nothing else changes."""
    from faststream.nats.subscriber.usecases import stream_basic, stream_pull_subscriber

    for module in (stream_pull_subscriber, stream_basic):
        if getattr(module, "TimeoutError", None) is nats_errors.TimeoutError:
            module.TimeoutError = TimeoutError  # type: ignore[attr-defined]


_idle_fetches_are_not_errors()


@dataclass(frozen=True)
class Output:
    """One event a handler wants published; defaults to the input's aggregate."""

    payload: Payload
    aggregate_id: str | None = None


Handler = Callable[[Envelope, Any], Awaitable[Sequence[Output | Payload]]]
P = TypeVar("P", bound=Payload)
TypedHandler = Callable[[Envelope, P], Awaitable[Sequence[Output | Payload]]]
"""A handler of one event class: it receives the envelope and the payload as that class."""
Answer = type[Payload] | tuple[type[Payload], str]
"""An event class that answers a request, published by the runtime (its id the runtime's,
``output_event_id``), or ``(class, label)`` for one a handler publishes itself with the id
``derive_event_id(request id, label)`` (the scheduler's placement)."""
MAX_ACK_PENDING = 1024
"""Events a durable consumer may have delivered and not acknowledged (JetStream's
``max_ack_pending``, for all the service's instances together)."""
FAIR_INSTANCE_HELD = TENANT_QUEUE_MAX  # 512
"""Events one instance's fair handler holds for all tenants: past them it takes nothing more
from the bus until one ends (so a wedged instance cannot hold the consumer's whole window;
tenants holding nothing may go an eighth past it, see :mod:`dsec_core.fairness`).
``DSEC_TENANT_QUEUE`` may be at most this (its setting's bound)."""
FAIR_HELD_BYTES = 64 << 20
"""Memory one instance's fair handler holds for all tenants, counted as twice each event's
bytes as received (the message and its decoded envelope): then it takes nothing more from the
bus until one ends. A spec is a few KB; one may be up to NATS's 1 MiB."""
FAIR_TENANT_BYTES = FAIR_HELD_BYTES // 4
"""Memory one tenant's held events may take at a fair handler; the next is ended at once."""
FAIR_REDELIVERIES = 16
"""Deliveries a fair handler's event may have beyond its attempts: an event waiting its turn
is delivered again when its instance stops or dies, without having been tried. Attempts are
counted when a worker starts one (in the handled-ids bucket), not by JetStream's deliveries."""
PULL_EXPIRES_S = 1.0
"""How long a consumer's pull request waits for messages (FastStream's fetch timeout)."""
FAIR_GIVE_BACK_S = 2 * PULL_EXPIRES_S
"""When an event a stopping instance gives back is delivered again: after its own pull
requests have expired."""
STOP_GRACE_S = 15.0
"""How long a stopping service lets the events its handlers without ``workers`` are running
finish (FastStream's ``graceful_timeout``); then they are cancelled, and each is given back
like a fair handler's (:func:`_give_back_msg`)."""
FAIR_STOP_GRACE_S = 5.0
"""How long a stopping service lets its fair handlers' running events finish before it
cancels them (each then has :data:`CANCEL_GRACE_S` to unwind) and gives them back."""
FULL_LOG_EVERY_S = 10.0
"""A tenant's requests ended because it was full are logged once this often, with a count."""
ABANDONED_WAIT_S = 30.0
"""How long a stopped service waits for handlers left running (see :data:`CANCEL_GRACE_S`)
before it leaves without them."""
CANCEL_GRACE_S = 5.0
"""How long a cancelled handler (its attempt timed out, or its service stops) may take to
unwind before the runtime goes on without it: one that ignores its cancellation is left
running, logged, and its worker is free (a stopped service waits :data:`ABANDONED_WAIT_S`
for it, then exits without it)."""


@dataclass(frozen=True)
class _Handling:
    """What the runtime needs to run one registered handler."""

    event_type: str
    durable: str
    fn: Handler
    policy: RetryPolicy
    failure: FailureEvents
    answers: Sequence[Answer]
    deliveries: int
    """Deliveries after which a delivery only ends the request (``max_deliver`` - 1)."""
    select: Callable[[Envelope, Any], bool] | None = None
    """Which verified events this instance acts on (``Service.handles``): the rest are acked."""
    confirm: Callable[[Envelope, Any], Awaitable[bool]] | None = None
    """Whether a selected event is still this instance's to end (``Service.handles``)."""


@dataclass
class _Held:
    """A verified delivery held by a fair handler, kept alive meanwhile. ``msg`` is its latest
    delivery: JetStream may deliver it again while it is held (a late heartbeat), and then that
    one is acked for it."""

    msg: NatsMessage
    envelope: Envelope
    seq: int
    heartbeat: asyncio.Task[None]
    counted: bool = False
    """Its latest start was counted as an attempt in the bucket (``Service._attempt``; not
    when it fell back to JetStream's count): only then may a stop take it back."""


@dataclass
class _FairHandling:
    handling: _Handling
    queue: FairQueue[_Held]
    workers: int
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    held: dict[int, _Held] = field(default_factory=dict)  # by stream sequence
    stopping: bool = False
    fetched: asyncio.Future[None] | None = None
    """Set when the latest delivery taken from the bus has its place in its tenant's order
    (see ``Service._hold``)."""
    tenant_tail: dict[str, asyncio.Future[None]] = field(default_factory=dict)
    """Per tenant: set when its latest delivery was placed (held or ended at once)."""


def _resolve_after(prev: asyncio.Future[None] | None, mine: asyncio.Future[None]) -> None:
    """Resolve ``mine`` once ``prev`` is (a delivery that leaves early keeps the order of
    those after it)."""
    if mine.done():
        return
    if prev is None or prev.done():
        mine.set_result(None)
        return

    def then(_: asyncio.Future[None]) -> None:
        if not mine.done():
            mine.set_result(None)

    prev.add_done_callback(then)


async def _give_back_msg(msg: NatsMessage) -> str:
    """NAK a delivery not acked or given back yet (the one way this module gives one back):
    a held one a stopping instance lets go (:func:`_give_back`), or one whose consume was
    cancelled: its service stops (FastStream cancels what still runs after
    :data:`STOP_GRACE_S`, and what it fetched as it stopped), or a handler raised
    ``CancelledError`` (anyio then cancels the rest of its fetched batch too, and each of
    those is given back the same way). It is
    delivered again after :data:`FAIR_GIVE_BACK_S`, not after the consumer's whole
    ``ack_wait`` (30–60 s; a request of a node-scoped consumer held that consumer's ack floor
    meanwhile). Best effort: the NAK is queued on the connection before the first suspension
    point, and a NATS failure leaves the delivery to ``ack_wait`` as before. Returns what
    became of it, for the log."""
    if msg.committed is not None or msg.raw_message._ackd:
        return "it was acked (or given back) already"
    try:
        await msg.nack(delay=FAIR_GIVE_BACK_S)
    except Exception as exc:
        return f"not given back ({type(exc).__name__}): delivered again after its ack_wait"
    except BaseException:  # cancelled again: the NAK was queued before (see above)
        pass
    return f"given back, delivered again in {FAIR_GIVE_BACK_S:g} s"


def _fetched_queues(subscribers: Iterable[object]) -> list[asyncio.Queue[Msg]]:
    """nats-py's queue of what each pull subscription received and FastStream has not taken
    yet (``PullSubscription._sub._pending_queue``: private to nats-py, which keeps it after
    an unsubscribe; ``libs/core/tests`` and ``tests/test_backbone.py`` hold it to that)."""
    queues: list[asyncio.Queue[Msg]] = []
    for sub in subscribers:
        inner = getattr(getattr(sub, "subscription", None), "_sub", None)
        queue = getattr(inner, "_pending_queue", None)
        if isinstance(queue, asyncio.Queue):
            queues.append(queue)
    return queues


async def _give_back(held: _Held) -> None:
    """Give a held delivery back so another instance takes it (its heartbeat stopped first).
    Redelivered after :data:`FAIR_GIVE_BACK_S`, not at once: a pull request this stopping
    instance still has open would take it and drop it, and then it would wait the whole
    ``ack_wait``."""
    held.heartbeat.cancel()
    await _give_back_msg(held.msg)


ANSWER_SCAN = 256
"""Messages of one subject a spare delivery reads looking for a request's answer (see
``Service._answered``): an answer behind more forgeries than this is not found, and the request
ends with its failure event, never without an end."""
FailureEvents = Callable[[Envelope, str, int], Sequence[Payload]]
"""Builds the terminal event(s) of a request whose retries are exhausted: (input, reason,
attempts) -> payloads. The default is ``sandbox.failed`` for events of a sandbox."""


def sandbox_failed(service: str) -> FailureEvents:
    """The default failure events: ``sandbox.failed`` with the stage and the reason."""

    def build(envelope: Envelope, reason: str, attempts: int) -> Sequence[Payload]:
        if envelope.aggregate != SandboxFailed.AGGREGATE:
            return []
        return [
            SandboxFailed(
                stage=service, reason=reason, attempts=attempts, failed_event_id=envelope.id
            )
        ]

    return build


@dataclass(frozen=True)
class RetryPolicy:
    """Bounded redelivery with exponential backoff before the failure event."""

    max_attempts: int = 5
    base_delay_s: float = 0.2
    max_delay_s: float = 5.0
    ack_wait_s: float = 30.0
    attempt_timeout_s: float | None = None
    """The longest one attempt of the handler may run (``None``: no limit). Past it the
    handler is cancelled and the attempt fails like an error (:class:`AttemptTimedOut`),
    retried with backoff and then ended with the failure event: a hung handler does not keep
    its worker, and its request, for ever."""

    def __post_init__(self) -> None:
        if self.attempt_timeout_s is not None and not self.attempt_timeout_s > 0:
            raise ValueError(f"attempt_timeout_s must be > 0 s, not {self.attempt_timeout_s}")

    def delay(self, attempt: int) -> float:
        """Backoff before redelivery after ``attempt`` (1-based) failed."""
        return float(min(self.base_delay_s * 2 ** (attempt - 1), self.max_delay_s))


class AttemptTimedOut(TimeoutError):
    """An attempt of a handler ran past its policy's ``attempt_timeout_s`` and was cancelled."""


def jetstream_delivery(msg: NatsMessage) -> tuple[int, int]:
    """``(delivery attempt, stream sequence)`` of a message pulled from the stream."""
    meta = msg.raw_message.metadata
    return int(meta.num_delivered), int(meta.sequence.stream)


def package_version(dist: str) -> str:
    """Installed version of ``dist`` (``0+unknown`` when not installed as a distribution)."""
    try:
        return version(dist)
    except PackageNotFoundError:
        return "0+unknown"


class Service:
    """One DSec service process: its handlers, its publisher, its metrics endpoint."""

    def __init__(self, name: str, settings: Settings | None = None) -> None:
        self.name = name
        self.settings = settings or Settings()
        self.version = package_version(f"dsec-{name}")
        self.broker = NatsBroker(
            **natsclient.broker_options(
                self.settings, name=f"dsec-{name}-consumers", max_reconnect_attempts=-1
            ),
            # FastStream's "Received"/"Processed" lines for every event at DEBUG, not INFO: two
            # log lines an event was most of a service's log (and ~5 % of its CPU under a
            # burst); a handler's error is still logged at ERROR.
            log_level=logging.DEBUG,
            graceful_timeout=STOP_GRACE_S,
        )
        self._stream = JStream(name=STREAM, declare=False)
        self.nc: NATS | None = None
        self.publisher: EventPublisher | None = None
        self.metrics = metrics.MetricsServer(name, self.version, self._healthy, self.problems)
        self.loop_watch = metrics.LoopWatch()
        self.health_checks: list[Callable[[], str | None]] = [
            self._nats_problem,
            metrics.fd_budget_problem,
            self.loop_watch.problem,
            self._workers_problem,
        ]
        """Each returns why the service cannot serve, or ``None``; ``/healthz`` shows them."""
        self._stopping = asyncio.Event()
        self.on_start: list[Callable[[], Awaitable[None]]] = []
        self.on_stop: list[Callable[[], Awaitable[None]]] = []
        self.keys: KeyRing | None = None
        self.gate: Gate | None = None
        self.durables: list[str] = []  # its durable consumers (NATS permissions allow only these)
        self._fair: list[_FairHandling] = []  # handlers registered with workers
        self._full_logged: dict[tuple[str, str], list[float]] = {}  # see _log_full
        self._abandoned: set[asyncio.Future[Any]] = set()  # see _left_running
        self._in_stop = False  # (a cancelled delivery is then given back and logged once)
        self.stream_problem: str | None = None  # set while DSEC_EVENTS is weakened
        self._watch: asyncio.Task[None] | None = None
        self._key_watch: asyncio.Task[None] | None = None
        self._consumer_watch: asyncio.Task[None] | None = None
        self.consumer_poll_s = CONSUMER_POLL_S
        """How often its durables' pending/ack-pending counts are read for ``/metrics``."""
        self.recheck_key = asyncio.Event()
        """Set (SIGHUP does) to read the key source again now."""
        self.delivery: Callable[[NatsMessage], tuple[int, int]] = jetstream_delivery
        """Where a message's attempt and stream sequence come from: JetStream's metadata. The
        one seam for FastStream's in-memory broker (``dsec_testing.inmemory``), whose messages
        carry none; everything after it (the gate, the handler, publishing) is unchanged."""

    def endorse(self, data: bytes) -> str:
        """``data`` signed by this service's certified key (hex): answers it sends outside the
        stream (remote sessions, code-upload grants). Only once the service runs."""
        assert self.publisher is not None, "the service signs once it runs"
        return self.publisher.signer.endorse(data)

    @property
    def key_id(self) -> str:
        """The id of the key :meth:`endorse` signs with (once the service runs)."""
        assert self.publisher is not None, "the service signs once it runs"
        return self.publisher.signer.key_id

    def _healthy(self) -> bool:
        connected = self.nc is not None and self.nc.is_connected
        return connected and self.stream_problem is None

    async def _watch_stream(self, js: JetStreamContext) -> None:
        """Re-check the stream while running: weakened later, the service reports unhealthy
        (``dsec status``; ``dsec up`` repairs the stream as the operator and restarts it)."""
        while True:
            await asyncio.sleep(self.settings.stream_check_s)
            try:
                await require_stream(js)
            except StreamWeakened as exc:
                if self.stream_problem != str(exc):
                    log.critical("%s: %s; reporting unhealthy", self.name, exc)
                self.stream_problem = str(exc)
                continue
            except Exception as exc:  # disconnected or slow: the connection state shows it
                log.debug("%s: stream check skipped: %s", self.name, exc)
                continue
            if self.stream_problem is not None:
                log.warning("%s: stream %s is sound again", self.name, STREAM)
            self.stream_problem = None

    def _nats_problem(self) -> str | None:
        if self.nc is None or not self.nc.is_connected:
            return "not connected to NATS"
        return None

    def problems(self) -> list[str]:
        """Why this service cannot serve now (empty: healthy)."""
        found = []
        for check in self.health_checks:
            try:
                problem = check()
            except Exception as exc:  # a broken check is a problem, not a crash
                problem = f"health check {getattr(check, '__name__', check)} failed: {exc}"
            if problem:
                found.append(problem)
        return found

    @overload
    def handles(
        self,
        event: type[P],
        *,
        retry: RetryPolicy | None = None,
        batch: int = 16,
        on_exhausted: FailureEvents | None = None,
        scope: Literal["service", "node"] = "service",
        answers: Sequence[Answer] = (),
        workers: int = 0,
        tenant_workers: int | None = None,
        select: Callable[[Envelope, P], bool] | None = None,
        confirm: Callable[[Envelope, P], Awaitable[bool]] | None = None,
    ) -> Callable[[TypedHandler[P]], TypedHandler[P]]: ...

    @overload
    def handles(
        self,
        event: str,
        *,
        retry: RetryPolicy | None = None,
        batch: int = 16,
        on_exhausted: FailureEvents | None = None,
        scope: Literal["service", "node"] = "service",
        answers: Sequence[Answer] = (),
        workers: int = 0,
        tenant_workers: int | None = None,
        select: Callable[[Envelope, Any], bool] | None = None,
        confirm: Callable[[Envelope, Any], Awaitable[bool]] | None = None,
    ) -> Callable[[Handler], Handler]: ...

    def handles(
        self,
        event: type[Payload] | str,
        *,
        retry: RetryPolicy | None = None,
        batch: int = 16,
        on_exhausted: FailureEvents | None = None,
        scope: Literal["service", "node"] = "service",
        answers: Sequence[Answer] = (),
        workers: int = 0,
        tenant_workers: int | None = None,
        select: Callable[[Envelope, Any], bool] | None = None,
        confirm: Callable[[Envelope, Any], Awaitable[bool]] | None = None,
    ) -> Callable[[Any], Any]:
        """Register ``fn`` as the durable handler of the event class ``event`` for this
        service; ``fn(envelope, payload)`` receives the payload as an instance of that class.

        ``event`` may still be the type's name (``"spec.submitted"``) for one release, so
        handlers written against the string form keep working; new code passes the class.
        ``on_exhausted`` builds the terminal event(s) once retries are exhausted (default:
        ``sandbox.failed``); a request must always end in a terminal event. ``scope="node"``:
        every node's instance has a durable of its own (``<service>-<node id>-<type>``), so
        each sees every event (the handler acts only on its own node's). ``answers``: the event
        classes that answer a request (``spec.validated``, ``spec.rejected``): when every attempt
        crashed, the spare delivery publishes the failure only if none of them is in the log
        (an attempt may have answered before its process died); without them, it always does.
        ``workers``: 0 (the default) handles one event at a time in stream order; N > 0 holds
        verified events per tenant and runs N at once, the tenants taking turns
        (:mod:`dsec_core.fairness`): for independent requests (a spec, a build), so that one
        tenant's backlog does not hold another's request. A tenant with
        ``DSEC_TENANT_QUEUE`` held has its next request ended at once with the failure event.
        ``tenant_workers``: the most of those N one tenant runs at once (default N - 1, at
        least 1), so one tenant's slow requests leave a worker to the others.
        ``select``: which verified events this instance acts on, from the envelope and the
        payload (a node-scoped handler: those placed on its node); any other is acked at once,
        the handler never called, and (with ``workers``) it is never held, so it counts
        against no tenant's bound and no other node ends it. It must be cheap and must not
        block (it runs for every event of the type); one that raises selects the event, and
        the handler decides. ``confirm``: asked before the runtime itself ends a selected
        event with the failure event (its tenant was full, every attempt crashed, or the last
        attempt raised): whether it is still this instance's to end (a node agent: the launch
        is still the sandbox's latest placement on this node, not a late copy of an old one;
        the snapshot's sandbox runs here). False: acked without an end (the request it stood
        for ended, or another node has it).
        """
        model = model_for(event) if isinstance(event, str) else event  # fails fast on a typo
        for name, given in (("select", select), ("confirm", confirm)):
            if given is not None and not callable(given):
                raise TypeError(
                    f"{name} must be a function of (envelope, payload), not {type(given).__name__}"
                )
        running = tenant_workers if tenant_workers is not None else max(1, workers - 1)
        if tenant_workers is not None and not 1 <= tenant_workers <= workers:
            raise ValueError(f"tenant_workers must be 1..workers ({workers}), not {running}")
        if model_for(model.TYPE) is not model:
            raise ValueError(f"{model.__name__} is not the registered model of {model.TYPE}")
        event_type = model.TYPE
        policy = retry or RetryPolicy()
        failure = on_exhausted or sandbox_failed(self.name)
        answered_by = tuple(answers)
        node = self.settings.node_id if scope == "node" else None
        durable = durable_name(self.name, event_type, node)
        self.durables.append(durable)

        def register(fn: Handler) -> Handler:
            deliveries = policy.max_attempts + (FAIR_REDELIVERIES if workers > 0 else 0)
            config = ConsumerConfig(
                durable_name=durable,
                deliver_policy=DeliverPolicy.ALL,
                ack_wait=policy.ack_wait_s,
                max_deliver=deliveries + 1,
                max_ack_pending=MAX_ACK_PENDING,
            )

            handling = _Handling(
                event_type, durable, fn, policy, failure, answered_by, deliveries, select, confirm
            )
            if workers > 0:
                fair = _FairHandling(
                    handling,
                    FairQueue(
                        per_tenant=self.settings.tenant_queue,  # (at most FAIR_INSTANCE_HELD)
                        total=FAIR_INSTANCE_HELD,
                        per_tenant_bytes=FAIR_TENANT_BYTES,
                        total_bytes=FAIR_HELD_BYTES,
                        per_tenant_running=running,
                        workers=workers,
                    ),
                    workers,
                )
                self._fair.append(fair)

                async def consume(msg: NatsMessage) -> None:
                    try:
                        await self._hold(fair, msg)
                    except asyncio.CancelledError:
                        if self.delivery(msg)[1] in fair.held:  # (held: its queue's)
                            outcome = "held: given back with the queue"
                        else:
                            outcome = await _give_back_msg(msg)
                        if not self._stopped_while(handling, msg, outcome):
                            raise

            else:

                async def consume(msg: NatsMessage) -> None:
                    try:
                        await self._dispatch(handling, msg)
                    except asyncio.CancelledError:
                        outcome = await _give_back_msg(msg)
                        if not self._stopped_while(handling, msg, outcome):
                            raise

            self.broker.subscriber(
                filter_for(event_type),
                stream=self._stream,
                durable=durable,
                config=config,
                pull_sub=PullSub(batch_size=batch, timeout=PULL_EXPIRES_S),
                ack_policy=AckPolicy.MANUAL,
                # the pull requests' replies come to this identity's own inboxes
                inbox_prefix=self._inbox_prefix(),
                title=f"{self.name}:{event_type}",
            )(consume)
            return fn

        return register

    def _stopped_while(self, h: _Handling, msg: NatsMessage, outcome: str) -> bool:
        """A delivery's consume was cancelled (``outcome``: what became of the delivery): true
        when the service stops, logged as one warning line, not FastStream's ERROR with a
        traceback for what a stop does; false when a handler raised ``CancelledError`` itself
        (the cancellation goes on)."""
        if not self._in_stop:
            return False
        log.warning(
            "%s: stopped while handling %s (stream sequence %d): %s",
            self.name,
            h.event_type,
            self.delivery(msg)[1],
            outcome,
        )
        return True

    def _inbox_prefix(self) -> bytes:
        """The pull requests' reply prefix: this identity's inboxes (nats-py's default when
        the credential names no identity)."""
        prefix = natsclient.inbox_options(self.settings).get("inbox_prefix", "_INBOX")
        return f"{prefix}.".encode()

    async def _dispatch(self, h: _Handling, msg: NatsMessage) -> None:
        admitted = await self._admit(h, msg)
        if admitted is not None:
            await self._handle(h, msg, *admitted)

    async def _admit(
        self, h: _Handling, msg: NatsMessage, *, spare: bool = True
    ) -> tuple[Envelope, int] | None:
        """The verified envelope and its attempt, or ``None`` when the message was refused or
        was a spare delivery that only ended its request (acked either way; ``spare=False``:
        the caller ends spare deliveries itself)."""
        attempt, stream_seq = self.delivery(msg)
        labels = (self.name, h.event_type)
        if attempt > 1:
            metrics.REDELIVERIES.labels(*labels).inc()
        assert self.gate is not None
        admitted = await self.gate.admit(
            msg.raw_message.data,
            stream_seq=stream_seq,
            consumer=h.durable,
            subject=msg.raw_message.subject,
            event_type=h.event_type,
        )
        if isinstance(admitted, Refusal):
            await self._refuse(h.durable, h.event_type, stream_seq, msg, admitted)
            return None
        envelope = admitted
        metrics.EVENTS_CONSUMED.labels(*labels).inc()
        if h.select is not None and not self._selected(h, envelope):
            await msg.ack_sync()  # another node's (for one): nothing to do here, nothing held
            return None
        if spare and attempt > h.deliveries:
            await self._spare(h, msg, envelope, attempt)
            return None
        return envelope, attempt

    def _selected(self, h: _Handling, envelope: Envelope) -> bool:
        """Whether this instance acts on ``envelope`` (``select``); one that raises selects
        it (the handler decides), logged."""
        assert h.select is not None
        try:
            return bool(h.select(envelope, envelope.decoded()))
        except Exception as exc:
            log.warning(
                "%s: selecting %s %s failed (%s: %s): handled",
                self.name,
                h.event_type,
                envelope.id,
                type(exc).__name__,
                exc,
            )
            return True

    async def _spare(
        self, h: _Handling, msg: NatsMessage, envelope: Envelope, attempt: int
    ) -> None:
        """The handler crashed the process (or outran ack_wait) on every attempt: this spare
        delivery only ends the request, it does not run the handler again."""
        _, stream_seq = self.delivery(msg)
        if await self._confirmed(h, envelope, stream_seq) is not False:  # (not known: ended)
            await self._end_unfinished(envelope, stream_seq, attempt - 1, h.failure, h.answers)
        await msg.ack_sync()

    async def _confirmed(self, h: _Handling, envelope: Envelope, stream_seq: int) -> bool | None:
        """``confirm``'s answer (True without one); ``None`` when it failed (logged). It is
        asked with ``HANDLING_SEQ`` at the event's stream position, as its handler would be:
        both decide from the same log (a handler deciding whose a request is where it is in
        the log, and ``confirm`` from the log as it is now, could both say "not mine")."""
        if h.confirm is None:
            return True
        token = HANDLING_SEQ.set(stream_seq)
        try:
            return bool(await h.confirm(envelope, envelope.decoded()))
        except Exception as exc:
            log.warning(
                "%s: whether %s %s is still to be ended here is not known (%s: %s)",
                self.name,
                h.event_type,
                envelope.id,
                type(exc).__name__,
                exc,
            )
            return None
        finally:
            HANDLING_SEQ.reset(token)

    async def _handle(
        self,
        h: _Handling,
        msg: NatsMessage,
        envelope: Envelope,
        attempt: int,
        heartbeat: asyncio.Task[None] | None = None,
    ) -> float | None:
        """Run the handler, publish its outputs, ack; on an error retry or end the request.
        Returns the NAK's delay when it is to be retried, ``None`` when it was acked."""
        _, stream_seq = self.delivery(msg)
        started = time.perf_counter()
        if heartbeat is None:
            heartbeat = self._heartbeat(msg, h)
        token = HANDLING_SEQ.set(stream_seq)
        try:
            outputs = await self._call(h, envelope, attempt)
            await self._publish_outputs(envelope, outputs)
        except Exception as exc:  # any handler error: retry, then a failure event
            heartbeat.cancel()  # (a beat after the NAK would hold it for ack_wait, not its delay)
            return await self._on_failure(h, envelope, exc, attempt, msg)
        finally:
            heartbeat.cancel()
            HANDLING_SEQ.reset(token)
        metrics.HANDLER_SECONDS.labels(self.name, h.event_type).observe(
            time.perf_counter() - started
        )
        await msg.ack_sync()
        return None

    async def _call(
        self, h: _Handling, envelope: Envelope, attempt: int
    ) -> Sequence[Output | Payload]:
        """The handler's outputs, within the policy's ``attempt_timeout_s``: past it the
        handler is cancelled and given :data:`CANCEL_GRACE_S` to unwind (one that ignores the
        cancellation is left running without its worker), and the attempt fails."""
        limit = h.policy.attempt_timeout_s
        payload = envelope.decoded()  # an instance of the handled class
        if limit is None:
            return await h.fn(envelope, payload)
        # Its own task: a cancellation it swallows cannot keep the worker (asyncio.timeout
        # cancels once, and wait_for may drop a cancel that meets a result).
        task = asyncio.ensure_future(h.fn(envelope, payload))
        try:
            done, _ = await asyncio.wait({task}, timeout=limit)
            if not done:
                task.cancel()
                await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        except asyncio.CancelledError:  # the worker stops: the handler stops with it
            task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
            self._left_running(h, envelope, task)
            raise
        if done or (task.done() and not task.cancelled() and task.exception() is None):
            return task.result()  # (raises the handler's own error)
        metrics.HANDLER_TIMEOUTS.labels(self.name, h.event_type).inc()
        self._left_running(h, envelope, task)
        raise AttemptTimedOut(
            f"{self.name} did not finish {h.event_type} {envelope.id} within {limit:g} s "
            f"(attempt {attempt} of {h.policy.max_attempts}); it was cancelled"
        )

    def _left_running(self, h: _Handling, envelope: Envelope, task: asyncio.Future[Any]) -> None:
        """A cancelled handler still running after its grace: logged, its end collected."""
        if task.done():
            if not task.cancelled():
                task.exception()  # (collected: it was past its time)
            return
        log.error(
            "%s: the handler of %s %s ignored its cancellation for %g s: left running",
            self.name,
            h.event_type,
            envelope.id,
            CANCEL_GRACE_S,
        )
        self._abandon(task)

    def _abandon(self, task: asyncio.Future[Any]) -> None:
        """Keep a task left running after its cancellation until it ends (asyncio keeps only a
        weak reference to a task; a stopped service waits for it, see ``_leave_abandoned``),
        and collect its end."""
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _hold(self, fair: _FairHandling, msg: NatsMessage) -> None:
        """A fair handler's delivery: verify it now, then hold it in its tenant's queue (kept
        alive meanwhile) for a worker; a tenant already holding its share has it ended at
        once. Waits (so FastStream fetches nothing more) while the instance holds its most.

        FastStream runs a fetched batch's deliveries at once: each is verified (and, delivered
        again, looked up) concurrently and kept alive from then on; then each takes its place
        in its tenant's order in the order they were fetched, and is placed (held, or found
        over its tenant's bound) after the tenant's delivery before it. A tenant waiting for
        room does not hold another tenant's delivery."""
        prev, mine = fair.fetched, asyncio.get_running_loop().create_future()
        fair.fetched = mine
        try:
            await self._hold_in_order(fair, msg, prev, mine)
        finally:
            _resolve_after(prev, mine)

    async def _hold_in_order(
        self,
        fair: _FairHandling,
        msg: NatsMessage,
        prev: asyncio.Future[None] | None,
        mine: asyncio.Future[None],
    ) -> None:
        h = fair.handling
        admitted = await self._admit(h, msg, spare=False)
        if admitted is None:
            return
        envelope, attempt = admitted
        _, seq = self.delivery(msg)
        held = fair.held.get(seq)
        if held is not None:  # delivered again while held here: not a second request
            held.heartbeat.cancel()
            held.msg = msg
            held.heartbeat = self._heartbeat(msg, h)
            return
        if attempt > h.deliveries:
            await self._spare(h, msg, envelope, attempt)
            return
        held = fair.held[seq] = _Held(msg, envelope, seq, self._heartbeat(msg, h))
        placed = False
        try:
            if prev is not None and not prev.done():
                await asyncio.wait({prev})  # (not cancelling it if this one is cancelled)
            tenant = envelope.tenant
            before = fair.tenant_tail.get(tenant)
            turn = fair.tenant_tail[tenant] = asyncio.get_running_loop().create_future()
            mine.set_result(None)  # the next delivery may take its place
            try:
                if attempt > 1:  # (a slow lookup holds only this tenant's later deliveries)
                    ended = await self._ended(h, msg, envelope, attempt)
                    if ended is not False:
                        fair.held.pop(seq, None)
                        held.heartbeat.cancel()
                        if ended is None:  # not known now: ask again later, not end it twice
                            await held.msg.nack(delay=h.policy.delay(1))
                        else:
                            await held.msg.ack_sync()
                        return
                if before is not None and not before.done():
                    await asyncio.wait({before})
                # Twice the bytes received: the message and its decoded envelope are held.
                await fair.queue.put(tenant, held, 2 * len(msg.raw_message.data))
                placed = True
            except TenantFull as full:
                _resolve_after(before, turn)  # (now: the tenant's next need not wait the end)
                held.heartbeat.cancel()
                fair.held.pop(seq, None)
                try:
                    still = await self._confirmed(h, envelope, seq)
                    if still is None:  # not known now: asked again when it comes back
                        await held.msg.nack(delay=h.policy.delay(1))
                    elif not still:  # a late copy of what is no longer this instance's
                        await held.msg.ack_sync()
                    else:
                        await self._tenant_full(h, held.msg, envelope, full)
                except Exception as exc:  # its end not published: delivered again soon
                    log.warning("%s: %s not ended at once: %s", self.name, envelope.id, exc)
                    with contextlib.suppress(Exception):
                        await held.msg.nack(delay=h.policy.delay(1))
            except QueueClosed:  # stopping
                pass
            finally:
                _resolve_after(before, turn)
                if fair.tenant_tail.get(tenant) is turn:
                    del fair.tenant_tail[tenant]
        finally:
            if not placed and fair.held.get(seq) is held:  # not held: ended, or given back
                fair.held.pop(seq, None)
                with contextlib.suppress(BaseException):
                    await _give_back(held)
        metrics.HANDLER_WAITING.labels(self.name, h.event_type).set(fair.queue.waiting)

    def _heartbeat(self, msg: NatsMessage, h: _Handling) -> asyncio.Task[None]:
        return asyncio.create_task(self._keep_alive(msg, h.policy.ack_wait_s / 3))

    async def _attempt(self, h: _Handling, held: _Held) -> int:
        """This start's attempt number: counted in the handled-ids bucket when a worker starts
        the event (a delivery that waited its turn and was given back is no attempt). Without
        the bucket, or when NATS does not answer, JetStream's delivery count stands in."""
        deliveries, _ = self.delivery(held.msg)
        fallback = min(deliveries, h.policy.max_attempts)  # (deliveries include waiting)
        kv = None if self.gate is None else self.gate.handled
        if kv is None:
            return fallback
        key = _starts_key(h.durable, held.envelope)
        try:
            try:
                await kv.create(key, b"1")
                held.counted = True
                return 1
            except KeyWrongLastSequenceError:
                pass
            for _ in range(8):  # another replica starting it at the same moment: read again
                entry = await kv.get(key)
                count = int((entry.value or b"0").decode()) + 1
                try:
                    await kv.update(key, str(count).encode(), last=entry.revision)
                    held.counted = True
                    return count
                except KeyWrongLastSequenceError:
                    continue
            return fallback
        except Exception as exc:
            log.warning("%s: attempts of %s not counted (%s)", self.name, held.envelope.id, exc)
            return fallback

    async def _uncount(self, h: _Handling, held: _Held) -> None:
        """A start its service's stop cut short is no attempt: its count is taken back, so
        restarts during one long start (a cold launch, a build) do not end the request as if
        it had failed that often (bounded still: JetStream delivers it at most
        ``FAIR_REDELIVERIES`` more times). Best effort, within a second."""
        kv = None if self.gate is None else self.gate.handled
        if kv is None:
            return
        key = _starts_key(h.durable, held.envelope)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(1.0):
                entry = await kv.get(key)
                count = int((entry.value or b"1").decode())
                if count > 0:
                    await kv.update(key, str(count - 1).encode(), last=entry.revision)

    async def _ended(
        self, h: _Handling, msg: NatsMessage, envelope: Envelope, attempt: int
    ) -> bool | None:
        """Whether a redelivered request already ended: in one of its answers (``answers``)
        or its failure event (ended at once for its tenant, or after its last attempt), and
        the ack was lost. Then it is neither held nor refused again: a refusal after an answer
        would end it twice."""
        _, stream_seq = self.delivery(msg)
        kinds: list[Answer] = list(h.answers)
        kinds += [k for k in dict.fromkeys(type(p) for p in h.failure(envelope, "", attempt))]
        try:
            return bool(kinds) and await self._answered(envelope, stream_seq, kinds)
        except Exception as exc:  # not known (``None``): the caller asks again later
            log.warning("%s: end of %s not looked up (%s)", self.name, envelope.id, exc)
            return None

    async def _tenant_full(
        self, h: _Handling, msg: NatsMessage, envelope: Envelope, full: TenantFull
    ) -> None:
        metrics.TENANT_FULL.labels(self.name, h.event_type).inc()
        reason = (
            f"{self.name} already holds {full.held} requests of tenant {full.tenant!r} "
            f"({full.held_bytes:,} bytes; DSEC_TENANT_QUEUE = {full.limit} requests or "
            f"{FAIR_TENANT_BYTES >> 20} MiB, the most one tenant may have waiting or running "
            "here); this one was not started: submit it again when some of them have ended"
        )
        self._log_full(h, envelope, reason)
        # attempts 0: never started here (an attempt is a worker's start, not a delivery)
        await self._publish_outputs(envelope, h.failure(envelope, reason, 0))
        await msg.ack_sync()

    def _log_full(self, h: _Handling, envelope: Envelope, reason: str) -> None:
        """Log a tenant-full ending: the first of a tenant's, then at most one line each
        :data:`FULL_LOG_EVERY_S` with how many more there were (a burst of 100,000 specs is a
        few lines, not 100,000; every one is counted in ``dsec_handler_tenant_full_total`` and
        ends in its own failure event)."""
        now = time.monotonic()
        key = (h.event_type, envelope.tenant)
        entry = self._full_logged.get(key)
        if entry is not None and now - entry[0] < FULL_LOG_EVERY_S:
            entry[1] += 1
            return
        more = "" if entry is None or not entry[1] else f" ({entry[1]:,} more since the last)"
        log.warning("%s: %s: %s%s", self.name, envelope.id, reason, more)
        if len(self._full_logged) >= 4096:  # tenants seen: forget those quiet for a while
            quiet = [k for k, v in self._full_logged.items() if now - v[0] >= FULL_LOG_EVERY_S]
            for event_type, tenant in quiet:
                count = self._full_logged.pop((event_type, tenant))[1]
                if count:
                    log.warning(
                        "%s: %s: %d more requests of tenant %r ended: it was full",
                        self.name,
                        event_type,
                        count,
                        tenant,
                    )
        self._full_logged[key] = [now, 0]

    async def _work(self, fair: _FairHandling) -> None:
        """One worker of a fair handler: the tenants' queues in turn, one event at a time."""
        h, queue = fair.handling, fair.queue
        while True:
            ticket = await queue.take()
            held = ticket.item
            metrics.HANDLER_WAITING.labels(self.name, h.event_type).set(queue.waiting)
            try:
                await self._run_held(h, held)
            except asyncio.CancelledError:
                await _give_back(held)
                task = asyncio.current_task()
                if fair.stopping or (task is not None and task.cancelling()):
                    if fair.stopping and held.counted:
                        await self._uncount(h, held)
                    raise
                # The handler itself raised it: a failed attempt, not the worker's end.
                log.error("%s: %s: the handler was cancelled", self.name, held.envelope.id)
            except Exception as exc:  # publishing or acking failed: redelivered after ack_wait
                log.warning("%s: %s not handled: %s", self.name, held.envelope.id, exc)
            finally:
                held.heartbeat.cancel()
                fair.held.pop(held.seq, None)
                await queue.done(ticket)

    async def _run_held(self, h: _Handling, held: _Held) -> None:
        attempt = await self._attempt(h, held)
        if attempt > h.policy.max_attempts:  # started that often; each time it died
            await self._spare(h, held.msg, held.envelope, attempt)
            return
        used = held.msg
        delay = await self._handle(h, used, held.envelope, attempt, held.heartbeat)
        if held.msg is not used:  # delivered again meanwhile: answer that delivery too
            with contextlib.suppress(Exception):
                await (held.msg.ack() if delay is None else held.msg.nack(delay=delay))

    async def _end_unfinished(
        self,
        envelope: Envelope,
        stream_seq: int,
        attempts: int,
        failure: FailureEvents,
        answers: Sequence[Answer] = (),
    ) -> None:
        """End a request no attempt of which was acknowledged: its failure event(s), unless an
        attempt answered it (one of ``answers``) before its process died (its outputs reached
        the log, its ack did not): a request ends in one answer, never in a success and a
        failure. Whatever keeps the answer from being found (NATS slow, forgeries crowding its
        subject) ends the request with the failure: never without an end."""
        reason = f"no attempt of {self.name} completed (crashed or timed out {attempts}x)"
        outputs = failure(envelope, reason, attempts)
        try:
            answered = bool(answers) and await self._answered(envelope, stream_seq, answers)
        except Exception as exc:
            log.warning("%s: answer to %s not looked up (%s)", self.name, envelope.id, exc)
            answered = False
        if answered:
            log.warning(
                "%s: %s was answered by an attempt that was never acknowledged: no failure",
                self.name,
                envelope.id,
            )
            return
        await self._publish_outputs(envelope, outputs)

    async def _answered(
        self, envelope: Envelope, stream_seq: int, answers: Sequence[Answer]
    ) -> bool:
        """Whether the log holds, after the request, an answer of one of the ``answers``
        classes this producer gave it: the id the runtime derives for it (the first output of
        that type), on the subject it was published to, authentic and authorized where the
        log holds it. A copy (another aggregate's answer, the same bytes on this subject) or a
        forgery does not count. Reads at most :data:`ANSWER_SCAN` messages per subject."""
        assert self.publisher is not None and self.gate is not None
        for answer in answers:
            if isinstance(answer, tuple):
                model, wanted = answer[0], frozenset({derive_event_id(envelope.id, answer[1])})
            else:
                model = answer
                wanted = answer_ids(envelope.type, envelope.id, answer.TYPE, key_id=envelope.key_id)
            subject = subject_for(model.TYPE, envelope.aggregate_id)
            async for seq, data in scan_seq(
                self.publisher.js, subject, ANSWER_SCAN, after=stream_seq
            ):
                try:
                    fields = unpack_fields(data)
                    if fields.get("id") not in wanted or fields.get("subject") != subject:
                        continue
                    found = Envelope.model_validate(fields)
                except (MalformedEnvelope, ValueError):
                    continue
                if found.aggregate_id != envelope.aggregate_id:
                    continue
                if await self.gate.check(fields, found, stream_seq=seq) is None:
                    return True
        return False

    async def _refuse(
        self, durable: str, event_type: str, seq: int, msg: NatsMessage, refusal: Refusal
    ) -> None:
        """Never act on it: count it, answer it with ``security.event_rejected``, ack it."""
        if refusal.reason == "malformed":
            metrics.MALFORMED.labels(self.name).inc()
        metrics.EVENTS_REJECTED.labels(self.name, event_type, refusal.reason).inc()
        log.warning(
            "%s: refused message %d on %s (%s): %s",
            self.name,
            seq,
            msg.raw_message.subject,
            refusal.reason,
            refusal.detail,
        )
        assert self.publisher is not None
        answer = EventRejected(
            stream_seq=seq,
            event_id=refusal.event_id,
            event_type=refusal.event_type,
            producer=refusal.producer,
            subject=msg.raw_message.subject[:300],
            consumer=durable,
            reason=refusal.reason,
            detail=refusal.detail,
        )
        await self.publisher.publish(
            answer,
            aggregate_id=durable,
            event_id=derive_event_id(f"{durable}/{seq}", EventRejected.TYPE),
            tenant=SYSTEM_TENANT,
        )
        await msg.ack_sync()

    @staticmethod
    async def _keep_alive(msg: NatsMessage, every_s: float) -> None:
        """Tell JetStream a long handler is still working, so the ack deadline can stay short
        (a crashed handler's message is redelivered after ``ack_wait``, not after a build)."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await msg.in_progress()
            except Exception as exc:  # NATS away a moment: the next beat tries again
                log.debug("in_progress not sent: %s", exc)

    async def _publish_outputs(
        self, envelope: Envelope, outputs: Sequence[Output | Payload]
    ) -> None:
        assert self.publisher is not None
        per_type: dict[str, int] = {}
        for item in outputs:
            out = item if isinstance(item, Output) else Output(item)
            # Numbered per type, not by position: a redelivery that returns fewer events
            # (e.g. only the `ready` of a sandbox already launched) derives the same ids.
            n = per_type[out.payload.TYPE] = per_type.get(out.payload.TYPE, -1) + 1
            await self.publisher.publish(
                out.payload,
                aggregate_id=out.aggregate_id or envelope.aggregate_id,
                event_id=output_event_id(
                    envelope.id,
                    out.payload.TYPE,
                    n,
                    input_type=envelope.type,
                    key_id=envelope.key_id,
                ),
                causation=envelope,
            )
            metrics.EVENTS_PUBLISHED.labels(self.name, out.payload.TYPE).inc()

    async def _on_failure(
        self, h: _Handling, envelope: Envelope, exc: Exception, attempt: int, msg: NatsMessage
    ) -> float | None:
        labels = (self.name, envelope.type)
        reason = f"{type(exc).__name__}: {exc}"[:1000]
        policy = h.policy
        if attempt < policy.max_attempts:
            metrics.HANDLER_FAILURES.labels(*labels, "false").inc()
            log.warning("%s: %s attempt %d failed: %s", self.name, envelope.id, attempt, reason)
            delay = policy.delay(attempt)
            await msg.nack(delay=delay)
            return delay
        metrics.HANDLER_FAILURES.labels(*labels, "true").inc()
        log.error("%s: %s failed after %d attempts: %s", self.name, envelope.id, attempt, reason)
        # (a node's handler that failed on another node's request: that node ends it; not
        # known: ended here, as a request must end)
        if await self._confirmed(h, envelope, self.delivery(msg)[1]) is not False:
            await self._publish_outputs(envelope, h.failure(envelope, reason, attempt))
        await msg.ack_sync()
        return None

    async def start(self) -> None:
        """Connect, declare the stream, register the key, start consuming and serving metrics."""
        self._in_stop = False
        settings = self.settings
        paths = identity.TrustPaths(settings.home)
        # A service signs only with a key the operator root certified (``dsec up``,
        # ``dsec admin issue-service`` or its ``--to-vault`` stored it): no key, no start, and
        # never a key of its own making (the error names the command that issues one).
        loaded = await asyncio.to_thread(keysource.load_service_key, settings, self.name)
        key, cert = loaded.key, loaded.cert
        anchor = identity.read_anchor(paths, settings.trust_root)
        if anchor is None:
            raise identity.CertificateError(
                "no trust root: set DSEC_TRUST_ROOT or run `dsec up` (writes trust/root.pub)"
            )
        identity.check(cert, anchor)
        self.nc = await connect(settings, f"dsec-{self.name}")
        js = self.nc.jetstream()
        try:
            # Only the operator creates or changes the stream; a service refuses to run on a
            # log that could lose or rewrite history.
            await require_stream(js)
        except StreamWeakened as exc:
            log.critical("%s refuses to start: %s", self.name, exc)
            raise
        self.publisher = EventPublisher(js, Signer(cert.subject, key), certificate=cert)
        await self.publisher.register_key()
        self.keys = KeyRing(self.nc, js, anchor)
        await self.keys.start()
        # Replay protection is for durable consumers; a service without handlers (the
        # scheduler's projector) verifies without it (and NATS lets it open no bucket).
        handled = await handled_bucket(js) if self.durables else None
        self.gate = Gate(self.keys, js, handled)
        for hook in self.on_start:
            await hook()
        self.start_workers()
        await self.broker.start()
        self.loop_watch.start()
        self._watch = asyncio.create_task(self._watch_stream(js), name="stream-check")
        self._key_watch = asyncio.create_task(self._watch_key(anchor), name="key-check")
        if self.durables:
            self._consumer_watch = asyncio.create_task(
                self._watch_consumers(js), name="consumer-metrics"
            )
        port = await self.metrics.start(settings.metrics_port, settings.metrics_host)
        log.info(
            "%s %s ready; metrics on %s:%d", self.name, self.version, settings.metrics_host, port
        )

    async def export_consumers(self, js: JetStreamContext) -> None:
        """Read each of its durables' state from JetStream into the ``dsec_consumer_*``
        gauges (labels: service and durable name, a fixed set per deployment)."""
        for durable in self.durables:
            try:
                info = await js.consumer_info(STREAM, durable, timeout=5.0)
            except Exception as exc:  # not created yet, or NATS slow: the next poll retries
                metrics.CONSUMER_INFO_FAILURES.labels(self.name).inc()
                log.debug("%s: consumer %s not read: %s", self.name, durable, exc)
                continue
            metrics.CONSUMER_PENDING.labels(self.name, durable).set(info.num_pending or 0)
            metrics.CONSUMER_ACK_PENDING.labels(self.name, durable).set(info.num_ack_pending or 0)
            metrics.CONSUMER_REDELIVERED.labels(self.name, durable).set(info.num_redelivered or 0)

    async def _watch_consumers(self, js: JetStreamContext) -> None:
        while True:
            await self.export_consumers(js)
            await asyncio.sleep(self.consumer_poll_s)

    async def _watch_key(self, anchor: bytes) -> None:
        """Pick up a rotated key while running: the key source is read again every
        ``key_check_s`` seconds, and at once on SIGHUP."""
        problem: str | None = None
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.recheck_key.wait(), self.settings.key_check_s)
            self.recheck_key.clear()
            try:
                await self.reload_key(anchor)
            except Exception as exc:  # keep signing with the key in hand; say why, once
                if str(exc) != problem:
                    log.warning("%s: key source not re-read: %s", self.name, exc)
                problem = str(exc)
                continue
            if problem is not None:
                log.warning("%s: key source readable again", self.name)
            problem = None

    async def reload_key(self, anchor: bytes) -> bool:
        """Sign with the key the source holds now, if it is another certified key of this
        producer (a new chain, opened by its registration). Returns whether the key changed.

        Raises:
            CertificateError: the stored key is not certified by the root for this producer.
        """
        assert self.publisher is not None
        loaded = await asyncio.to_thread(keysource.load_service_key, self.settings, self.name)
        current = self.publisher.signer
        if loaded.key_id == current.key_id:
            return False
        identity.check(loaded.cert, anchor)
        held = self.publisher.certificate
        assert held is not None  # a service publishes only with its certificate
        was = (held.subject, held.role, held.node_id)
        now = (loaded.cert.subject, loaded.cert.role, loaded.cert.node_id)
        if now != was:
            raise identity.CertificateError(
                f"the stored key {loaded.key_id} is certified as {now} (subject, role, node), "
                f"not {was}"
            )
        await self.publisher.rekey(Signer(loaded.cert.subject, loaded.key), loaded.cert)
        await self.publisher.register_key()
        log.warning(
            "%s: signing with key %s now (was %s)", self.name, loaded.key_id, current.key_id
        )
        return True

    async def stop(self) -> None:
        """Stop consuming, run stop hooks, close connections."""
        self._in_stop = True
        if self._watch is not None:
            self._watch.cancel()
        if self._key_watch is not None:
            self._key_watch.cancel()
        if self._consumer_watch is not None:
            self._consumer_watch.cancel()
        # Give back what waits (a delivery waiting for room is told, and gives itself back),
        # fetch nothing more, let what runs finish, and give back what is left in the pull
        # subscriptions' queues, all while the consumers' connection still acks and NAKs;
        # then close it.
        fetched = _fetched_queues(self.broker.subscribers)
        await self._close_queues()
        await asyncio.gather(
            *(sub.stop() for sub in self.broker.subscribers), return_exceptions=True
        )
        await self._give_back_fetched(fetched)
        await self.stop_workers()
        await self.broker.stop()
        for hook in self.on_stop:
            await hook()
        if self.keys is not None:
            await self.keys.stop()
        await self.metrics.stop()
        self.loop_watch.stop()
        if self.nc is not None:
            await self.nc.drain()

    async def _give_back_fetched(self, queues: list[asyncio.Queue[Msg]]) -> None:
        """NAK what the pull subscriptions received and nobody took from their queue (once
        they are unsubscribed: NATS delivers nothing more to a pull request whose inbox has no
        interest): delivered again in :data:`FAIR_GIVE_BACK_S` instead of after the
        consumer's whole ``ack_wait``. What a fetch had already taken from the queue when the
        stop cancelled it is not here; it still waits out ``ack_wait`` (a stop within a few
        ms of the delivery, see ``docs/architecture.md``). Best effort: nats-py internals that
        are not there make it give back nothing, never fail the stop."""
        given = 0
        with contextlib.suppress(Exception):
            for queue in queues:
                while not queue.empty():
                    msg = queue.get_nowait()
                    if JetStreamContext.is_status_msg(msg) or not msg.reply:
                        continue  # (a pull request's status, not a delivery)
                    if getattr(msg, "_ackd", False):
                        continue
                    with contextlib.suppress(Exception):
                        await msg.nak(delay=FAIR_GIVE_BACK_S)
                        given += 1
        if given:
            log.warning(
                "%s: stopped with %d fetched event(s) not yet handled: given back, delivered "
                "again in %g s",
                self.name,
                given,
                FAIR_GIVE_BACK_S,
            )

    def start_workers(self) -> None:
        """Start the workers of the handlers registered with ``workers`` (:meth:`start` does);
        after :meth:`stop_workers`, with fresh queues."""
        for fair in self._fair:
            if fair.stopping:
                fair.queue, fair.stopping = fair.queue.fresh(), False
                fair.held.clear()
            fair.fetched = None
            fair.tenant_tail.clear()
            if not fair.tasks:
                fair.tasks = [
                    asyncio.create_task(self._work(fair), name=f"{fair.handling.durable}-{n}")
                    for n in range(fair.workers)
                ]

    async def settled(self) -> None:
        """Wait until no fair handler holds an event (each was handled or ended)."""
        for fair in self._fair:
            await fair.queue.empty()

    async def stop_workers(self, grace_s: float = FAIR_STOP_GRACE_S) -> None:
        """Fair handlers: what waits goes back to JetStream now (another instance takes it);
        a running handler may finish within ``grace_s``, then it is cancelled and its event
        given back the same way (handlers are idempotent)."""
        await self._close_queues()
        deadline = time.monotonic() + grace_s
        for fair in self._fair:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(fair.queue.empty(), max(0.0, deadline - time.monotonic()))
            for task in fair.tasks:
                task.cancel()
            # A handler's unwind may take its CANCEL_GRACE_S, no more: one still unwinding
            # after it is left running (the stopped service waits ABANDONED_WAIT_S for it).
            if fair.tasks:
                _, unwinding = await asyncio.wait(fair.tasks, timeout=CANCEL_GRACE_S)
                for task in unwinding:
                    log.error(
                        "%s: a handler of %s ignored its cancellation for %g s: left running",
                        self.name,
                        fair.handling.event_type,
                        CANCEL_GRACE_S,
                    )
                    self._abandon(task)
            for task in fair.tasks:
                if task.done() and not task.cancelled():
                    task.exception()  # (collected: the worker ended with the stop)
            fair.tasks = []

    async def _close_queues(self) -> None:
        for fair in self._fair:
            fair.stopping = True
            for held in await fair.queue.close():
                fair.held.pop(held.seq, None)
                await _give_back(held)

    def _workers_problem(self) -> str | None:
        for fair in self._fair:
            for task in fair.tasks:
                if task.done() and not fair.stopping:
                    error = None if task.cancelled() else task.exception()
                    return f"a worker of {fair.handling.durable} ended ({error!r})"
        return None

    async def run(self) -> None:
        """Run until SIGTERM/SIGINT."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self.recheck_key.set)
        await self.start()
        await self._stopping.wait()
        try:
            await self.stop()
        except BaseException:
            log.exception("%s: the stop failed", self.name)
            await self._leave_abandoned(1)
            raise
        log.info("%s %s stopped", self.name, self.version)
        await self._leave_abandoned(0)

    async def _leave_abandoned(self, code: int) -> None:
        """Handlers left running (they ignored their cancellation, or wait for thread work
        that cannot be stopped) get :data:`ABANDONED_WAIT_S` to end; then the process leaves
        without them: asyncio.run would wait for them for ever."""
        if not self._abandoned:
            return
        _, pending = await asyncio.wait(set(self._abandoned), timeout=ABANDONED_WAIT_S)
        if pending:
            log.warning(
                "%s: %d handler(s) still running %g s after the stop: leaving without them",
                self.name,
                len(pending),
                ABANDONED_WAIT_S,
            )
            quickexit.leave(code, force=True)


def main(create: Callable[[], Service]) -> None:
    """Entry point used by each service's ``__main__``: ``create`` builds the service (and
    reads its settings); a bad ``DSEC_*`` setting exits 2 with one line naming it."""
    try:
        service = create()
    except Exception as exc:
        problem = settings_problem(exc)
        if problem is None:
            raise
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(2) from None
    logging.basicConfig(
        level=service.settings.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        asyncio.run(service.run())
    except identity.CertificateError as exc:  # no certified key, no trust root: say what to do
        log.critical("%s cannot start: %s", service.name, exc)
        raise SystemExit(2) from None
    # Stopped cleanly: every hook ran and the connection drained. The interpreter's teardown
    # would only free memory, for about 0.2 s that `dsec down` waits on each service.
    quickexit.leave(0)


def _starts_key(durable: str, envelope: Envelope) -> str:
    """Where a durable counts the starts of an event: beside its record, keyed by key and id
    (two users' requests under one id, one copied off the bus, are two requests)."""
    return f"{handled_key(durable, envelope, user=True)}.starts"
