"""The node agent's two ways onto the bus: lifecycle first, refusals bounded behind it.

Lifecycle events (``sandbox.exited``; ``context.injected`` and ``sandbox.ready`` are the
runtime's handler outputs) are published at once. Refusals and reports never are: each goes
through the :class:`~dsec_nodeagent.refusals.RefusalGate`, and what it lets through waits in one
bounded queue that a single worker publishes, one event at a time, and only while no lifecycle
event is being published. So at most one refusal event is ever ahead of a lifecycle event (the
publisher's chain lock is first come, first served), and the queue never grows: an event that
finds it full is counted into its key's next summary instead (coalesced, not dropped).

Every ``interval_s`` the pending counts become ``policy.violation_summary`` events (as many as
the queue has room for; the others keep counting). A sandbox's last summaries are published
when it exits (:meth:`EventOutlet.sandbox_done`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from dsec_core import events
from prometheus_client import Counter, Gauge

from dsec_nodeagent.refusals import Admission, Key, RefusalGate, metric_rule

log = logging.getLogger(__name__)

Publish = Callable[[events.Payload, str, str | None], Awaitable[None]]
FloodHandler = Callable[[str], Awaitable[None]]

REFUSALS = Counter(
    "dsec_policy_refusals_total",
    "Refusals and sandbox reports seen by the node agent, by layer and rule (bounded labels)",
    ["layer", "rule"],
)
REFUSAL_EVENTS = Counter(
    "dsec_policy_refusal_events_total",
    "Events published for refusals: each refusal of a burst, or one summary per key and interval",
    ["type"],
)
COALESCED = Counter(
    "dsec_policy_refusals_coalesced_total",
    "Refusals admitted as events that found the queue full and were counted into a summary",
)
QUEUE_DEPTH = Gauge("dsec_policy_event_queue", "Refusal events waiting behind lifecycle events")
FLOODS = Counter("dsec_policy_floods_total", "Sandboxes that passed the refusal limit", ["action"])


class EventOutlet:
    """Publishes lifecycle events first and refusals through a gate and a bounded queue.

    Args:
        publish: the service's publisher (``payload, aggregate_id, event_id``).
        gate: the per-sandbox counters.
        queue_size: refusal events that may wait.
        interval_s: how often pending counts become summaries.
        on_flood: awaited once for a sandbox that passed the gate's flood limit.
    """

    def __init__(
        self,
        publish: Publish,
        gate: RefusalGate,
        *,
        queue_size: int = 256,
        interval_s: float = 10.0,
        on_flood: FloodHandler | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._publish = publish
        self.gate = gate
        self.interval_s = interval_s
        self.on_flood = on_flood
        self._clock = clock
        self._queue: asyncio.Queue[tuple[events.Payload, str]] = asyncio.Queue(queue_size)
        self._lifecycle_busy = 0
        self._lifecycle_idle = asyncio.Event()
        self._lifecycle_idle.set()
        self._tasks: list[asyncio.Task[None]] = []
        self._flood_tasks: set[asyncio.Task[None]] = set()  # also late summaries
        self.before_flush: list[Callable[[], None]] = []
        """Called before each interval's summaries (the egress layer adds the kernel's counts
        of verdicts its ring buffer dropped)."""

    # ------------------------------------------------------------------ lifecycle

    async def lifecycle(
        self, payload: events.Payload, aggregate_id: str, event_id: str | None
    ) -> None:
        """Publish a lifecycle event now; refusal events wait until it is acknowledged."""
        self._lifecycle_busy += 1
        self._lifecycle_idle.clear()
        try:
            await self._publish(payload, aggregate_id, event_id)
        finally:
            self._lifecycle_busy -= 1
            if self._lifecycle_busy == 0:
                self._lifecycle_idle.set()

    # ------------------------------------------------------------------ refusals

    def refusal(
        self,
        sandbox_id: str,
        key: Key,
        target: str,
        event: Callable[[], events.Payload],
        *,
        refused: bool = True,
        counted_elsewhere: bool = False,
    ) -> Admission:
        """Count one refusal; queue its event (built by ``event``) when the gate admits it.

        Synchronous and O(1): called from the readers of the kernel, the DNS proxy and the
        semantic channel, for every refusal of a flood. ``refused`` false: a decision that
        allowed (a logged request), summarized alike but not counted towards the flood limit.
        ``counted_elsewhere``: refusals past the burst (and a burst event that finds the queue
        full) are not counted here; the caller adds them from its own count (:meth:`unseen`).
        """
        now = self._clock()
        REFUSALS.labels(key.layer, metric_rule(key.rule_id)).inc()
        decision = self.gate.admit(
            sandbox_id, key, target, now, refused=refused, count=not counted_elsewhere
        )
        if decision.flooded:
            self._flooded(sandbox_id)
        if decision.admission is Admission.COUNTED:
            return Admission.COUNTED
        try:
            self._queue.put_nowait((event(), sandbox_id))
        except asyncio.QueueFull:
            COALESCED.inc()
            if counted_elsewhere:
                if refused:
                    self.gate.uncount(sandbox_id)
            else:
                self.gate.demote(sandbox_id, key, target, now)
            return Admission.COUNTED
        QUEUE_DEPTH.set(self._queue.qsize())
        return Admission.EVENT

    def unseen(self, sandbox_id: str, key: Key, count: int, sample: str = "") -> None:
        """Count ``count`` refusals known only as a number (the kernel's counters)."""
        if count <= 0:
            return
        REFUSALS.labels(key.layer, metric_rule(key.rule_id)).inc(count)
        if self.gate.add(sandbox_id, key, count, self._clock(), sample):
            self._flooded(sandbox_id)

    def _flooded(self, sandbox_id: str) -> None:
        action = "stop" if self.on_flood is not None else "report"
        FLOODS.labels(action).inc()
        log.warning("sandbox %s passed the refusal limit (%d)", sandbox_id, self.gate.flood_limit)
        if self.on_flood is not None:
            task = asyncio.ensure_future(self.on_flood(sandbox_id))
            self._flood_tasks.add(task)
            task.add_done_callback(self._flood_tasks.discard)

    # ------------------------------------------------------------------ workers

    async def start(self) -> None:
        """Start the publishing worker and the summary ticker."""
        self._tasks = [asyncio.create_task(self._worker()), asyncio.create_task(self._ticker())]

    async def _worker(self) -> None:
        while True:
            payload, sandbox_id = await self._queue.get()
            QUEUE_DEPTH.set(self._queue.qsize())
            await self._lifecycle_idle.wait()
            try:
                await self._publish(payload, sandbox_id, None)
                REFUSAL_EVENTS.labels(payload.TYPE).inc()
            except Exception:  # the publisher retried for a minute: the bus is gone
                log.exception("publishing %s of %s failed", payload.TYPE, sandbox_id)
            finally:
                self._queue.task_done()

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            self.flush_summaries()

    def flush_summaries(self) -> None:
        """Queue every sandbox's pending summaries the queue has room for."""
        for hook in self.before_flush:
            try:
                hook()
            except Exception:
                log.exception("counting refusals before the summaries failed")
        for sandbox_id in self.gate.sandboxes():
            room = self._queue.maxsize - self._queue.qsize()
            if room <= 0:
                return
            for summary in self.gate.take_summaries(sandbox_id, limit=room):
                self._queue.put_nowait((summary, sandbox_id))

    async def sandbox_done(self, sandbox_id: str) -> None:
        """Queue the last summaries of a sandbox that ended, then forget it. Never waits: what
        finds the queue full is queued by a task (the exit is not held up behind a flood)."""
        late = []
        for summary in self.gate.take_summaries(sandbox_id):
            try:
                self._queue.put_nowait((summary, sandbox_id))
            except asyncio.QueueFull:
                late.append(summary)
        self.gate.forget(sandbox_id)
        if late:
            task = asyncio.ensure_future(self._put_all(late, sandbox_id))
            self._flood_tasks.add(task)
            task.add_done_callback(self._flood_tasks.discard)

    async def _put_all(self, payloads: list[events.PolicyViolationSummary], sid: str) -> None:
        for payload in payloads:
            await self._queue.put((payload, sid))

    async def drain(self, timeout_s: float = 10.0) -> None:
        """Wait until every queued event was published (tests, shutdown)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._queue.join(), timeout_s)

    async def stop(self) -> None:
        """Publish what is pending (summaries included), then stop the workers."""
        for sandbox_id in self.gate.sandboxes():
            await self.sandbox_done(sandbox_id)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(10.0):
                while self._flood_tasks:
                    await asyncio.gather(*self._flood_tasks, return_exceptions=True)
        await self.drain()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
