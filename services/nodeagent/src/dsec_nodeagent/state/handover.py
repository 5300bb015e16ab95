"""The live hand-over: a new version of an agent takes over the running one's state and tool
name with no visible break (docs/state.md "Hand-over").

The keeper calls :func:`hand_over` (``keeper.handover``) when the NEW sandbox's agent says
``hello{handover: true}``. In order:

1. forward every checkpoint OLD makes from now on (``old.on_checkpoint``), buffered;
2. stream OLD's state as it stands to NEW (``keeper.records_of``: what a fetch sends, as
   ``records`` frames then ``fetched``: NEW's own ``fetch`` is answered by this);
3. forward the buffered and later checkpoints to NEW as ``deltas`` until NEW says ``ready``
   (it has restored and registered its tool server as a standby on the broker);
4. ``old.request_final``: OLD finishes the tool call in progress, stops taking calls and sends
   its final checkpoint, made durable;
5. freeze OLD's cgroup (``cgroup.freeze``; nothing in it runs any more);
6. forward the final records, switch the broker (OLD's tool name now names NEW's server; OLD's
   callers are told ``moved`` and re-send a call OLD had not taken), make NEW the owner of the
   state (``keeper.switch_owner``), send NEW ``switched{interruption_ms, seq}`` (from asking
   OLD for its final delta — it takes no call from then on — to the switch);
7. now final: tell OLD's callers which of their channels moved (``release``: a call OLD never
   read goes to NEW at once, not when OLD's process is gone), stop OLD
   (``sandbox.exited{reason: handed_over}``), publish ``state.handed_over``.

Every failure before the switch is complete thaws OLD and leaves it serving (the broker name
is given back to it when it was already moved); NEW gets an ``error`` frame and is stopped.
Never both dead, never both serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import msgpack
from dsec_core.events import StateHandedOver

from dsec_nodeagent.state.keeper import SandboxState, StateError, StateKeeper, StateSession

log = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0
"""How long NEW may take to restore and say ``ready``."""
FINAL_TIMEOUT_S = 10.0
# How long a failed hand-over waits to tell either version (one that reads nothing is cut off).
TELL_TIMEOUT_S = 2.0
# How long NEW may take to read one frame (at most ~8 MiB of records) before the hand-over fails.
SEND_TIMEOUT_S = 30.0
"""How long OLD may take to finish its call in progress and send its final checkpoint."""
FREEZE_TIMEOUT_S = 2.0
"""How long the kernel may take to report OLD's cgroup frozen."""
RECORDS_FRAME_BYTES = 8 << 20
"""The records of one ``records`` frame of the initial stream (as the keeper's fetch)."""


class HandOverError(RuntimeError):
    """The hand-over could not complete (OLD keeps serving); the message says why."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Freezer(Protocol):
    """Stops and resumes every process of a sandbox's cgroup."""

    async def freeze(self, cgroup_dir: str) -> None: ...

    async def thaw(self, cgroup_dir: str) -> None: ...


class CgroupFreezer:
    """The cgroup v2 freezer: ``cgroup.freeze`` = 1, then wait until ``cgroup.events`` says
    ``frozen 1`` (every task of the cgroup stopped); thaw writes 0."""

    def __init__(self, timeout_s: float = FREEZE_TIMEOUT_S, poll_s: float = 0.0002) -> None:
        self.timeout_s = timeout_s
        self.poll_s = poll_s

    async def freeze(self, cgroup_dir: str) -> None:
        await self._set(cgroup_dir, 1)

    async def thaw(self, cgroup_dir: str) -> None:
        await self._set(cgroup_dir, 0)

    async def _set(self, cgroup_dir: str, value: int) -> None:
        directory = Path(cgroup_dir)
        try:
            # A pseudo-file of the kernel: the write returns at once (no disk behind it).
            (directory / "cgroup.freeze").write_text(f"{value}\n")
        except OSError as exc:
            raise HandOverError(
                "freezer", f"cannot write {value} to {directory / 'cgroup.freeze'}: {exc}"
            ) from exc
        deadline = time.monotonic() + self.timeout_s
        while frozen(directory) != bool(value):
            if time.monotonic() > deadline:
                what = "frozen" if value else "thawed"
                raise HandOverError(
                    "freezer", f"cgroup {directory} not {what} within {self.timeout_s:g} s"
                )
            await asyncio.sleep(self.poll_s)


def frozen(cgroup_dir: Path) -> bool:
    """Whether ``cgroup.events`` of ``cgroup_dir`` says ``frozen 1``."""
    for line in (cgroup_dir / "cgroup.events").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "frozen":
            return value.strip() == "1"
    return False


Switch = Callable[[SandboxState, SandboxState], Awaitable[int]]
"""Points OLD's tool name at NEW's server on the broker and tells OLD's callers ``moved``
(:meth:`dsec_nodeagent.ipc.broker.Broker.switch`); returns how many callers were told."""


@dataclass
class HandOverHooks:
    """What the hand-over needs from the node agent (everything but the keeper)."""

    freezer: Freezer = field(default_factory=CgroupFreezer)
    switch: Switch | None = None
    """The broker switch and its undo (called with the arguments swapped); None: no broker."""
    release: Switch | None = None
    """Once the hand-over is final (nothing thaws OLD any more), before OLD is stopped: tell
    the callers waiting on OLD's server, channel by channel, so a call it never read goes to
    NEW at once (:meth:`dsec_nodeagent.ipc.broker.Broker.release`); returns how many channels."""
    stop_old: Callable[[str], Awaitable[None]] | None = None
    """Stop OLD's sandbox with ``sandbox.exited{reason: handed_over}``."""
    stop_new: Callable[[str, str], Awaitable[None]] | None = None
    """Stop NEW's sandbox (``sandbox_id``, why) after a failed hand-over."""
    publish: Callable[[str, StateHandedOver], Awaitable[None]] | None = None
    """Publish ``state.handed_over`` for NEW's sandbox."""
    cgroup_of: Callable[[str], str | None] | None = None
    """A sandbox's cgroup directory when its registration has none (the node agent's)."""
    done: Callable[[str], None] | None = None
    """Called with NEW's sandbox id when the hand-over ended, done or failed (the broker
    forgets the expected hand-over)."""
    ready_timeout_s: float = READY_TIMEOUT_S
    final_timeout_s: float = FINAL_TIMEOUT_S


@dataclass
class HandOverResult:
    """What a completed hand-over measured."""

    seq: int
    interruption_ms: float
    deltas_streamed: int
    callers_moved: int


async def hand_over(
    keeper: StateKeeper,
    old: StateSession,
    new: StateSession,
    *,
    hooks: HandOverHooks | None = None,
) -> HandOverResult | None:
    """Hand OLD's state and tool name over to NEW (see the module's docstring).

    Returns what was measured, or ``None`` when the hand-over failed (OLD keeps serving, NEW
    got an ``error`` frame and was stopped). Set as ``keeper.handover`` with
    ``functools.partial(hand_over, hooks=...)``.
    """
    hooks = hooks or HandOverHooks()
    run = _Run(keeper, old, new, hooks)
    try:
        return await run.go()
    except (HandOverError, StateError, TimeoutError, ConnectionError, OSError) as exc:
        code = exc.code if isinstance(exc, HandOverError | StateError) else "handover-failed"
        await run.fail(code, str(exc) or type(exc).__name__)
        return None
    except BaseException as exc:
        await run.fail("handover-failed", str(exc) or type(exc).__name__)
        raise
    finally:
        old.off_checkpoint(run._on_checkpoint)  # (OLD serves on after a failure)
        if hooks.done is not None:
            hooks.done(new.sandbox_id)


class _Run:
    def __init__(
        self, keeper: StateKeeper, old: StateSession, new: StateSession, hooks: HandOverHooks
    ) -> None:
        self.keeper, self.old, self.new, self.hooks = keeper, old, new, hooks
        self.frozen_dir: str | None = None
        self.switched_to: tuple[SandboxState, SandboxState] | None = None
        self.seq = 0
        self.streamed = 0
        self.pending: asyncio.Queue[tuple[int, list[dict[str, Any]]]] = asyncio.Queue()
        self.final_asked = False

    def _infos(self) -> tuple[SandboxState, SandboxState]:
        old_info = self.keeper.sandbox_of(self.old.sandbox_id)
        new_info = self.keeper.sandbox_of(self.new.sandbox_id)
        if old_info is None or new_info is None:
            raise HandOverError("handover-refused", "a sandbox of the hand-over is not registered")
        if new_info.handover_from != old_info.sandbox_id:
            raise HandOverError(
                "handover-refused",
                f"sandbox {new_info.sandbox_id} was not started to take over {old_info.sandbox_id}",
            )
        if (old_info.tenant, old_info.group, old_info.agent) != (
            new_info.tenant,
            new_info.group,
            new_info.agent,
        ):
            raise HandOverError(
                "handover-refused",
                f"sandbox {old_info.sandbox_id} is another agent (tenant, task group and agent "
                "name must be the same)",
            )
        if not old_info.cgroup_dir and self.hooks.cgroup_of is not None:
            old_info = replace(old_info, cgroup_dir=self.hooks.cgroup_of(old_info.sandbox_id))
        if not old_info.cgroup_dir:
            raise HandOverError(
                "handover-refused", f"sandbox {old_info.sandbox_id} has no cgroup to freeze"
            )
        return old_info, new_info

    async def _stream(self) -> tuple[int, int]:
        """OLD's state as it stands, to NEW, as a fetch is answered: ``records``... ``fetched``."""
        started = time.perf_counter()
        records, seq = await self.keeper.records_of(self.old)
        batch: list[dict[str, Any]] = []
        size = 0
        for record in records:
            record_bytes = len(msgpack.packb(record, use_bin_type=True))
            if batch and size + record_bytes > RECORDS_FRAME_BYTES:
                await self._to_new({"op": "records", "records": batch})
                batch, size = [], 0
            batch.append(record)
            size += record_bytes
        if batch:
            await self._to_new({"op": "records", "records": batch})
        await self._to_new(
            {
                "op": "fetched",
                "seq": seq,
                "deltas": len(records),
                "source": "local" if records else "empty",
                "ms": (time.perf_counter() - started) * 1000,
            }
        )
        return seq, len(records)

    async def _to_new(self, frame: dict[str, Any]) -> None:
        """Send NEW a frame; one it does not take within SEND_TIMEOUT_S fails the hand-over
        (a NEW that read nothing held the hand-over, and OLD's queued checkpoints, for good)."""
        await asyncio.wait_for(self.new.send(frame), SEND_TIMEOUT_S)

    async def _on_checkpoint(self, seq: int, records: list[dict[str, Any]]) -> None:
        await self.pending.put((seq, records))

    async def _forward_pending(self) -> None:
        while not self.pending.empty():
            seq, records = self.pending.get_nowait()
            await self._forward(seq, records)

    async def _forward(self, seq: int, records: list[dict[str, Any]]) -> None:
        if seq <= self.seq:  # already part of what was streamed
            return
        await self._to_new({"op": "deltas", "seq": seq, "records": records})
        self.seq = seq
        self.streamed += len(records)

    async def go(self) -> HandOverResult:
        old_info, new_info = self._infos()
        self.old.on_checkpoint(self._on_checkpoint)
        self.seq, self.streamed = await self._stream()
        # The ready timeout holds the deltas forwarded meanwhile too: a send that waited on a
        # NEW reading nothing kept it from being looked at (and OLD's checkpoints queued).
        async with asyncio.timeout(self.hooks.ready_timeout_s):
            await self._until_ready()
            await self._forward_pending()
        return await self._finish(old_info, new_info)

    async def _until_ready(self) -> None:
        """Forward OLD's checkpoints to NEW until NEW is ready."""
        ready = asyncio.ensure_future(self.new.ready.wait())
        try:
            while not ready.done():
                getter = asyncio.ensure_future(self.pending.get())
                done, _ = await asyncio.wait({ready, getter}, return_when=asyncio.FIRST_COMPLETED)
                if getter in done:
                    await self._forward(*getter.result())
                else:
                    getter.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await getter
            ready.result()
        finally:
            if not ready.done():
                ready.cancel()

    async def _finish(self, old_info: SandboxState, new_info: SandboxState) -> HandOverResult:
        self.final_asked = True
        # The interruption callers can see starts here: OLD stops taking calls once it gets
        # `handover` (it finishes the one in progress, then sends its final delta).
        stopped_at = time.perf_counter()
        final = await self.old.request_final(
            self.new.sandbox_id, timeout_s=self.hooks.final_timeout_s
        )
        assert old_info.cgroup_dir is not None
        await self.hooks.freezer.freeze(old_info.cgroup_dir)
        self.frozen_dir = old_info.cgroup_dir
        # Checkpoints made durable before the final one, then the final (its seq: the one the
        # keeper reported for it, the same records object; else the next).
        reported: int | None = None
        while not self.pending.empty():
            seq, records = self.pending.get_nowait()
            if records is final:
                reported = seq
                continue
            await self._forward(seq, records)
        final_seq = reported if reported is not None else self.seq + 1
        if final:
            await self._forward(final_seq, final)
        elif reported is not None:
            # An empty final checkpoint still took a seq: NEW's next one follows it.
            self.seq = max(self.seq, reported)
        durable = self.old._seq()
        if self.seq != durable:  # (NEW would go on from a seq whose records it never got)
            raise HandOverError(
                "handover-failed",
                f"the state is durable up to checkpoint {durable}, the new version got it up to "
                f"{self.seq}",
            )
        moved = 0
        if self.hooks.switch is not None:
            self.switched_to = (old_info, new_info)
            moved = await self.hooks.switch(old_info, new_info)
        self.keeper.switch_owner(self.old, self.new)
        interruption_ms = (time.perf_counter() - stopped_at) * 1000
        await self._to_new({"op": "switched", "interruption_ms": interruption_ms, "seq": self.seq})
        # From here NEW owns the state and serves the name: OLD is only stopped.
        self.frozen_dir = None
        self.switched_to = None
        result = HandOverResult(self.seq, interruption_ms, self.streamed, moved)
        if self.hooks.release is not None:
            try:
                await self.hooks.release(old_info, new_info)
            except Exception:  # (its callers then go on when OLD is gone, as without it)
                log.exception("hand-over: telling %s's callers failed", old_info.sandbox_id)
        if self.hooks.stop_old is not None:
            try:
                await self.hooks.stop_old(old_info.sandbox_id)
            except Exception:
                log.exception("hand-over: stopping %s failed", old_info.sandbox_id)
        if self.hooks.publish is not None:
            await self.hooks.publish(
                new_info.sandbox_id,
                StateHandedOver(
                    agent=new_info.agent,
                    group=new_info.group,
                    from_sandbox=old_info.sandbox_id,
                    seq=self.seq,
                    interruption_ms=round(interruption_ms, 3),
                    deltas_streamed=self.streamed,
                ),
            )
        log.info(
            "hand-over %s -> %s: interruption %.2f ms, %d records streamed, %d callers moved",
            old_info.sandbox_id,
            new_info.sandbox_id,
            interruption_ms,
            self.streamed,
            moved,
        )
        return result

    async def fail(self, code: str, message: str) -> None:
        """Give OLD back everything (name, CPU) and stop NEW."""
        log.warning(
            "hand-over %s -> %s failed: %s", self.old.sandbox_id, self.new.sandbox_id, message
        )
        if self.switched_to is not None and self.hooks.switch is not None:
            old_info, new_info = self.switched_to
            try:
                await self.hooks.switch(new_info, old_info)
            except Exception:
                log.exception("hand-over: giving the tool name back to %s failed", old_info)
        if self.frozen_dir is not None:
            try:
                await self.hooks.freezer.thaw(self.frozen_dir)
            except Exception:
                log.exception("hand-over: thawing %s failed", self.frozen_dir)
        if self.final_asked:
            # OLD stopped taking calls for its final checkpoint: it serves again on this.
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.old.abort_handover(message), TELL_TIMEOUT_S)
        # (a NEW that reads nothing would hold this send, and the hand-over, for good)
        error = {"op": "error", "code": code, "message": message, "seq": None}
        try:
            await asyncio.wait_for(self.new.send(error), TELL_TIMEOUT_S)
        except Exception:
            self.new.abort()
        if self.hooks.stop_new is not None:
            try:
                await self.hooks.stop_new(self.new.sandbox_id, message)
            except Exception:
                log.exception("hand-over: stopping %s failed", self.new.sandbox_id)
