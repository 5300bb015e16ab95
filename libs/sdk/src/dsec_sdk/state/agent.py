"""``AgentState``: an agent's durable state (see docs/state.md, "Using it from an agent")."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, Final, TypeVar

from dsec_sdk.state import codec, msgcount, wire
from dsec_sdk.state.containers import (
    ArrayState,
    Blob,
    Container,
    KVMap,
    MessageLog,
    Thunk,
    VectorIndex,
)
from dsec_sdk.state.store import (
    Ack,
    CheckpointRefused,
    LocalStore,
    NodeStore,
    StateError,
    Store,
    default_dir,
    encode_checkpoint,
)

log = logging.getLogger("dsec_sdk.state")

NAME_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}\Z")
FRAME_BYTES: Final = 3 * codec.MAX_RECORD_BYTES
FRAME_OBJECTS: Final = msgcount.MAX_FRAME_OBJECTS - 64
"""The most MessagePack objects of records a checkpoint frame carries (room for its header
under the keeper's bound)."""
"""Records of one checkpoint frame, at most about (a larger checkpoint: several frames)."""
DEFAULT_WARM_INTERVAL_S: Final = 300.0

C = TypeVar("C", bound=Container)


@dataclass(frozen=True)
class CheckpointInfo:
    """One acknowledged checkpoint. ``seq``: its (last) sequence number; ``bytes``: what was
    sent; ``records``: how many records; ``pause_ms``: how long the containers were locked
    for the capture; ``durable_ms``: from sending to the (last) ack; ``frames``: frames sent
    (a checkpoint larger than one frame takes several, each its own seq)."""

    seq: int
    bytes: int
    records: int
    pause_ms: float
    durable_ms: float
    tiers: tuple[str, ...]
    frames: int = 1


@dataclass(frozen=True)
class RestoreInfo:
    """What :meth:`AgentState.open` restored: ``seq`` (the last checkpoint), ``deltas``
    (checkpoints applied after the newest snapshot), ``source`` (``empty``: nothing was
    saved; ``local``: node disk/tmpfs or a local store; ``remote``: object store +
    JetStream), ``ms`` (hello to fetched, as the agent saw it), ``records`` fetched."""

    seq: int
    deltas: int
    source: str
    ms: float
    records: int


@dataclass(frozen=True)
class SwitchInfo:
    """Hand-over, on the new version: it owns the state now; ``interruption_ms`` is the time
    from the old version frozen to this one serving (measured by the keeper)."""

    interruption_ms: float
    seq: int


class AgentState:
    """An agent's state: typed containers that record their own deltas, checkpoints that send
    only the deltas, restore on open, and live hand-over to a new version.

    Get one with :meth:`open` (or ``await``:meth:`aopen`); inside a DSec sandbox it talks to
    the node agent's state keeper (through the IPC broker; no credentials in the sandbox),
    elsewhere it keeps its checkpoints in a local directory.

    >>> state = AgentState.open()
    >>> history = state.log("history")                 # hot
    >>> adapter = state.array("adapter", (4096, 4096))  # warm, float32
    >>> history.append({"role": "user", "content": "hi"})
    >>> adapter.update([1, 5, 9], [0.1, 0.2, 0.3])
    >>> info = state.checkpoint()                      # durable when it returns
    >>> info.pause_ms                                  # how long the agent was paused

    Thread-safe: every container mutation and a checkpoint's capture take one lock
    (:attr:`lock`); the capture is the only time the agent is paused.
    """

    def __init__(
        self,
        store: Store,
        *,
        agent: str,
        group: str,
        handover: bool = False,
        auto: bool = True,
        interval: float | None = None,
        warm_interval: float | None = None,
        tiers: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        started: float | None = None,
    ) -> None:
        self.agent = agent
        self.group = group
        self.lock = threading.RLock()
        self.timeout = timeout
        self._store = store
        self._ckpt_lock = threading.Lock()
        self._containers: dict[str, Container] = {}
        self._pending: dict[str, list[dict[str, Any]]] = {}
        self._retry: list[tuple[int, list[bytes]]] = []  # (first seq, records) not acked
        self._handover_callbacks: list[Callable[[], Any]] = []
        self._aborted_callbacks: list[Callable[[], Any]] = []
        self._stop = threading.Event()
        self._auto_thread: threading.Thread | None = None
        self._closed = False
        self.handover = handover
        self.handover_to: str | None = None
        """Hand-over, on the old version: the sandbox that took over (once asked)."""
        self.handed_over = threading.Event()
        """Set once this (old) version's final checkpoint is acknowledged: it no longer owns
        the state."""
        self._final_sent = False  # (its final checkpoint is on its way: nothing may follow it)
        self._aborts = 0  # hand-overs aborted (``handover-aborted``), under _handover_lock
        self._handover_lock = threading.Lock()  # (never held across I/O)
        # Frames sent and not answered yet, by seq: their records and their answer's future
        # (under _ckpt_lock; see _refused).
        self._outstanding: dict[int, tuple[list[bytes], Ack[dict[str, Any]]]] = {}
        self.switched: SwitchInfo | None = None
        """Hand-over, on the new version: set when the keeper says it owns the state."""
        self._switched = threading.Event()
        self.last_error: str | None = None
        self.last_checkpoint: CheckpointInfo | None = None
        for name, tier in (tiers or {}).items():
            _check_tier(tier, f"tiers[{name!r}]")
        self._open_tiers = dict(tiers or {})

        t0 = time.perf_counter() if started is None else started
        try:
            welcome = store.hello(agent, group, handover)
            records, fetched = store.fetch()
        except BaseException:
            store.close()
            raise
        # the keeper decides: a hand-over with no live old version to take over from is a
        # plain open (this version owns the state at once)
        self.handover = handover = bool(welcome.get("handover", handover)) and handover
        self.state_id = str(welcome.get("state_id", ""))
        self.config: dict[str, Any] = dict(welcome.get("config") or {})
        self._spec_tiers = _tiers_of(self.config.get("tiers"))
        self._seq = max(int(welcome.get("seq") or 0), int(fetched.get("seq") or 0))
        for r in records:
            self._pending.setdefault(str(r.get("c")), []).append(r)
        self.restored = RestoreInfo(
            seq=int(fetched.get("seq") or 0),
            deltas=int(fetched.get("deltas") or 0),
            source=str(fetched.get("source") or "empty"),
            ms=(time.perf_counter() - t0) * 1000,
            records=len(records),
        )

        if interval is None:
            raw = self.config.get("checkpoint_interval_s")
            interval = float(raw) if raw else None
        self.interval = interval if auto and interval and interval > 0 else None
        raw_warm = self.config.get("warm_interval_s")
        self.warm_interval = float(warm_interval or raw_warm or DEFAULT_WARM_INTERVAL_S)
        store.start(self._on_frame)
        AgentState._current = weakref.ref(self)
        if not handover:
            self._start_auto()

    _current: ClassVar[weakref.ref[AgentState] | None] = None

    @classmethod
    def current(cls) -> AgentState | None:
        """The state this process opened last and has not closed (``DSecClient.serve`` uses
        it for hand-overs when :meth:`DSecClient.attach_state` was not called)."""
        state = cls._current() if cls._current is not None else None
        return state if state is not None and not state._closed else None

    # ------------------------------------------------------------------------- opening
    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        agent: str | None = None,
        group: str | None = None,
        auto: bool = True,
        interval: float | None = None,
        warm_interval: float | None = None,
        tiers: Mapping[str, str] | None = None,
        socket_path: str | os.PathLike[str] | None = None,
        timeout: float = 60.0,
    ) -> AgentState:
        """Open (and restore) this agent's state.

        Inside a sandbox (``$DSEC_IPC_SOCKET`` set and no ``path``, or ``$DSEC_STATE=node``):
        the node agent's keeper, reached through the IPC broker. Elsewhere (or
        ``$DSEC_STATE=local``): a local directory, ``path``, else ``$DSEC_STATE_DIR``, else a
        new temporary directory.

        With ``$DSEC_STATE_HANDOVER_FROM`` set (the node agent sets it on a hand-over's new
        version) it opens as the new version: it restores the old one's state, keeps applying
        the old one's new checkpoints (``deltas``) as they come, and owns the state once the
        keeper says ``switched`` (after :meth:`ready`).

        Args:
            path: A local store's directory (plain Python).
            agent, group: Whose state (default ``$DSEC_AGENT_NAME``, ``$DSEC_TASK_GROUP``).
            auto: Automatic checkpoints (every ``interval``; the spec's ``state.interval``
                inside a sandbox; off outside one unless ``interval`` is given).
            interval: Seconds between automatic checkpoints of the hot (and changed cold)
                containers.
            warm_interval: Seconds between automatic checkpoints that include warm ones
                (default the spec's ``state.warm_interval``, else 300).
            tiers: Container name -> tier, below the spec's ``state.tiers`` and a
                declaration's own ``tier=``.
            socket_path: The broker's socket (default ``$DSEC_IPC_SOCKET``).
            timeout: Seconds to wait for the keeper (hello, fetch, each ack).

        Raises:
            StateError: The keeper refused (``state-held``: another live session owns this
                state) or cannot be reached; the local directory is held by another process.
        """
        agent = agent or os.environ.get("DSEC_AGENT_NAME") or "agent"
        group = group or os.environ.get("DSEC_TASK_GROUP") or "default"
        started = time.perf_counter()
        mode = os.environ.get("DSEC_STATE", "").strip().lower()
        in_sandbox = mode == "node" or (
            mode != "local" and path is None and bool(os.environ.get("DSEC_IPC_SOCKET"))
        )
        handover = False
        store: Store
        if in_sandbox:
            from dsec_sdk.client import default_socket_path

            store = NodeStore.connect(
                socket_path or default_socket_path(), agent, group, timeout=timeout
            )
            handover = bool(os.environ.get("DSEC_STATE_HANDOVER_FROM"))
        else:
            store = LocalStore(Path(path) if path is not None else default_dir())
        return cls(
            store,
            agent=agent,
            group=group,
            handover=handover,
            auto=auto,
            interval=interval,
            warm_interval=warm_interval,
            tiers=tiers,
            timeout=timeout,
            started=started,
        )

    restore = open
    """Same as :meth:`open` (opening restores)."""

    @classmethod
    async def aopen(cls, path: str | os.PathLike[str] | None = None, **kwargs: Any) -> AgentState:
        """:meth:`open` from async code (in a worker thread)."""
        return await asyncio.to_thread(lambda: cls.open(path, **kwargs))

    # ---------------------------------------------------------------------- containers
    def log(self, name: str, *, tier: str | None = None) -> MessageLog:
        """An append-only log (default tier: hot)."""
        return self._declare(MessageLog, name, tier)

    def kv(self, name: str, *, tier: str | None = None) -> KVMap:
        """A key/value map (default tier: hot)."""
        return self._declare(KVMap, name, tier)

    def array(
        self,
        name: str,
        shape: Sequence[int] | int,
        dtype: Any = "float32",
        *,
        tier: str | None = None,
        initial: Any = None,
    ) -> ArrayState:
        """A numpy array with sparse delta capture (default tier: warm). Zeros, or
        ``initial``, unless a restored value replaces it."""
        return self._declare(ArrayState, name, tier, shape=shape, dtype=dtype, initial=initial)

    def vectors(
        self, name: str, dim: int, dtype: Any = "float32", *, tier: str | None = None
    ) -> VectorIndex:
        """A vector index (default tier: warm)."""
        return self._declare(VectorIndex, name, tier, dim=dim, dtype=dtype)

    def blob(self, name: str, *, tier: str | None = None) -> Blob:
        """Opaque bytes (default tier: cold)."""
        return self._declare(Blob, name, tier)

    def containers(self) -> dict[str, Container]:
        return dict(self._containers)

    def tier_of(self, name: str, kind: str, tier: str | None = None) -> str:
        """The tier a container gets: the spec's ``state.tiers`` (the keeper's config), else
        the declaration's ``tier=``, else ``open(tiers=...)``, else its kind's default."""
        if name in self._spec_tiers:
            return self._spec_tiers[name]
        if tier is not None:
            return _check_tier(tier, f"container {name!r}: tier")
        if name in self._open_tiers:
            return self._open_tiers[name]
        return wire.DEFAULT_TIER[kind]

    def _declare(self, cls: type[C], name: str, tier: str | None, **params: Any) -> C:
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise ValueError(
                f"container name {name!r} is invalid: use 1-128 of [A-Za-z0-9_.:-], "
                "starting with a letter or digit"
            )
        with self.lock:
            existing = self._containers.get(name)
            if existing is not None:
                probe = cls(threading.RLock(), name, existing.tier, **params)
                if type(existing) is not cls or existing._params() != probe._params():
                    raise StateError(
                        f"container {name!r} is already declared as {existing!r} "
                        f"{existing._params()}"
                    )
                return existing
            container = cls(self.lock, name, self.tier_of(name, cls.kind, tier), **params)
            records = self._pending.pop(name, None)
            if records:
                kinds = {str(r.get("k")) for r in records} - {"ref"}
                if kinds - {cls.kind}:
                    self._pending[name] = records
                    raise StateError(
                        f"container {name!r} was saved as {sorted(kinds)}, not {cls.kind!r}"
                    )
                try:
                    entry = codec.fold(records)[name]
                    container._load(entry.value)
                except codec.CodecError as exc:
                    raise StateError(f"container {name!r}: cannot restore: {exc}") from exc
            self._containers[name] = container
            return container

    # ----------------------------------------------------------------------- checkpoint
    def checkpoint(
        self, tiers: Iterable[str] | None = None, *, timeout: float | None = None
    ) -> CheckpointInfo:
        """Capture the deltas of the containers of ``tiers`` (default: all), send them, and
        wait until the keeper (or the local store) has made them durable. Everything it
        acknowledged survives a crash of the agent (and, inside a sandbox, of the node).

        Raises:
            StateError: Not acknowledged (the deltas are kept and sent again with the next
                checkpoint), or this version handed its state over.
        """
        info = self._checkpoint(tiers, skip_empty=False, final=False, timeout=timeout)
        assert info is not None
        return info

    async def acheckpoint(
        self, tiers: Iterable[str] | None = None, *, timeout: float | None = None
    ) -> CheckpointInfo:
        """:meth:`checkpoint` from async code (the capture and the wait run in a thread)."""
        return await asyncio.to_thread(lambda: self.checkpoint(tiers, timeout=timeout))

    def _checkpoint(
        self,
        tiers: Iterable[str] | None,
        *,
        skip_empty: bool,
        final: bool,
        timeout: float | None,
        aborts: int | None = None,
    ) -> CheckpointInfo | None:
        chosen = tuple(wire.TIERS if tiers is None else (_check_tier(t, "tiers") for t in tiers))
        with self._ckpt_lock:
            if self.handed_over.is_set():
                raise StateError("this version handed its state over: it checkpoints no more")
            if self._final_sent:
                # (the state goes to the new version as of the final checkpoint: one after it
                # would be refused by the keeper, and lost to both versions)
                raise StateError(
                    "this version is handing its state over (its final checkpoint is sent): "
                    "it checkpoints again only if the hand-over fails"
                )
            if self.handover and self.switched is None:
                raise StateError("a hand-over's new version owns the state only once switched")
            if self._closed and not final:
                raise StateError("the state is closed")
            t0 = time.perf_counter()
            with self.lock:
                thunks: list[Thunk] = []
                for c in self._containers.values():
                    if c.tier in chosen:
                        thunks.extend(c._capture())
            pause_ms = (time.perf_counter() - t0) * 1000
            # deltas of checkpoints not acknowledged go first, oldest first (log order)
            retry = [b for _, records in sorted(self._retry, key=lambda x: x[0]) for b in records]
            packed = retry + [b for thunk in thunks for b in thunk()]
            self._retry = []
            first_seq = self._seq + 1
            if not packed and skip_empty:
                return None
            try:
                batches = _frames(packed)
            except codec.CodecError as exc:
                self._retry.append((first_seq, packed))
                raise StateError(f"checkpoint not sent: {exc}") from None
            if final:
                with self._handover_lock:
                    if aborts is not None and self._aborts != aborts:
                        self._retry.append((first_seq, packed))  # (this version's still)
                        raise StateError("the hand-over was aborted before the final checkpoint")
                    # (set before it is sent: no other checkpoint may follow it; an abort from
                    # here on clears it)
                    self._final_sent = True
            t1 = time.perf_counter()
            futures: list[tuple[int, Ack[dict[str, Any]]]] = []
            sent = 0
            try:
                for i, batch in enumerate(batches):
                    self._seq += 1
                    last = i == len(batches) - 1
                    frame = encode_checkpoint(self._seq, batch, pause_ms, chosen, final and last)
                    sent += len(frame)
                    fut = self._store.checkpoint(self._seq, frame)
                    self._outstanding[self._seq] = (batch, fut)
                    futures.append((self._seq, fut))
                    if fut.done() and fut.exception() is not None:
                        break  # (not taken: the frames after it are not sent, not to pass it)
            except StateError:
                for frame_seq, _ in futures:
                    self._outstanding.pop(frame_seq, None)
                self._retry.append((first_seq, packed))
                if final:
                    self._final_sent = False
                raise
            seq = self._seq
        wait = self.timeout if timeout is None else timeout
        acked = 0
        try:
            for frame_seq, fut in futures:
                ack = fut.result(timeout=wait)
                acked += int(ack.get("bytes") or 0)
                with self._ckpt_lock:
                    self._take(frame_seq, fut)
        except Exception as exc:
            with self._ckpt_lock:
                if isinstance(exc, CheckpointRefused):
                    self._refused()
                else:  # (no answer: whether the keeper took them is not known here)
                    # Sent again: the frames still this call's and not acknowledged (a refusal
                    # may have queued the others already; acknowledged ones are durable), then
                    # those never sent.
                    again: list[tuple[int, list[bytes]]] = []
                    for frame_seq, fut in futures:
                        records = self._take(frame_seq, fut)
                        if records is not None and not (fut.done() and fut.exception() is None):
                            again.append((frame_seq, records))
                    if again:
                        unsent = [b for batch in batches[len(futures) :] for b in batch]
                        self._retry.append(
                            (again[0][0], [b for _, recs in again for b in recs] + unsent)
                        )
                if final:
                    self._final_sent = False
            if isinstance(exc, StateError):
                raise
            raise StateError(f"checkpoint {seq} was not acknowledged: {exc!r}") from exc
        info = CheckpointInfo(
            seq=seq,
            bytes=acked or sent,
            records=len(packed),
            pause_ms=pause_ms,
            durable_ms=(time.perf_counter() - t1) * 1000,
            tiers=chosen,
            frames=len(batches),
        )
        self.last_checkpoint = info
        return info

    def _take(self, frame_seq: int, fut: Ack[dict[str, Any]]) -> list[bytes] | None:
        """The records of the frame ``frame_seq`` this call sent (``fut``), no longer
        outstanding; None when a refusal already took them (under ``_ckpt_lock``)."""
        entry = self._outstanding.get(frame_seq)
        if entry is None or entry[1] is not fut:
            return None
        del self._outstanding[frame_seq]
        return entry[0]

    def _refused(self) -> None:
        """The keeper refused a checkpoint frame (under ``_ckpt_lock``). It answers frames in
        the order they were sent, so every frame sent before a refused one has its answer by
        now, and after the first refusal it takes none of the frames that were already on
        their way (their seqs no longer follow its own). So: the frames before the first
        refusal are durable; that one and every later outstanding frame go again, in their
        order, from the refused seq on. Done once for them all: the waiters of the other
        refused frames find theirs already gone from ``_outstanding``."""
        refused = {
            frame_seq: exc
            for frame_seq, (_, fut) in self._outstanding.items()
            if fut.done() and isinstance(exc := fut.exception(), CheckpointRefused)
        }
        if not refused:  # (another waiter already did it)
            return
        first = min(refused)
        again: list[bytes] = []
        for frame_seq in sorted(self._outstanding):
            records, fut = self._outstanding[frame_seq]
            if frame_seq >= first:
                again.extend(records)
                del self._outstanding[frame_seq]
            elif fut.done() and fut.exception() is None:
                del self._outstanding[frame_seq]  # (durable; its waiter finds it gone)
        self._retry.append((first, again))
        self._seq = first - 1
        # The keeper may be further back (a frame that timed out here was refused there
        # later: its records are queued again already): it says where it is.
        expected = [e.expected for e in refused.values() if e.expected is not None]
        if expected:
            self._seq = min(self._seq, min(expected) - 1)

    # ------------------------------------------------------------------------ automatic
    def _start_auto(self) -> None:
        if self.interval is None or self._auto_thread is not None:
            return
        self._auto_thread = threading.Thread(
            target=self._auto_loop, name="dsec-state-checkpoints", daemon=True
        )
        self._auto_thread.start()

    def _auto_loop(self) -> None:
        assert self.interval is not None
        now = time.monotonic()
        next_hot, next_warm = now + self.interval, now + self.warm_interval
        while not self._stop.wait(max(0.0, min(next_hot, next_warm) - time.monotonic())):
            now = time.monotonic()
            tiers: tuple[str, ...] = ("hot", "cold")
            if now >= next_warm:
                tiers = wire.TIERS
                next_warm = now + self.warm_interval
            if now >= next_hot or tiers == wire.TIERS:
                next_hot = now + self.interval
            try:
                self._checkpoint(tiers, skip_empty=True, final=False, timeout=None)
            except StateError as exc:
                if self.handed_over.is_set() or self._closed:
                    return
                self.last_error = str(exc)
                log.warning("state: automatic checkpoint failed (will retry): %s", exc)

    # ------------------------------------------------------------------------ hand-over
    def on_handover(self, callback: Callable[[], Any]) -> None:
        """Register ``callback()`` to run when the keeper asks this (old) version to hand its
        state over: stop taking work there (``DSecClient.serve`` registers one that stops
        taking calls once the call in progress is done). After the callbacks, the final
        checkpoint (``final: true``) is taken; then :attr:`handed_over` is set and this
        version checkpoints no more (the node agent stops it)."""
        self._handover_callbacks.append(callback)

    def on_handover_aborted(self, callback: Callable[[], Any]) -> None:
        """Register ``callback()`` to run when a hand-over this (old) version took part in
        failed after its final checkpoint (``error`` code ``handover-aborted``): it owns its
        state again, automatic checkpoints go on, and it should take work again
        (``DSecClient`` resumes serving)."""
        self._aborted_callbacks.append(callback)

    def ready(self) -> None:
        """Hand-over, on the new version: it has restored and serves (standby); the keeper
        may now freeze the old one, forward its final delta and switch (:attr:`switched`)."""
        if not self.handover:
            raise StateError("ready() is for a hand-over's new version ($DSEC_STATE_HANDOVER_FROM)")
        self._store.send({"op": "ready"})

    def wait_switched(self, timeout: float | None = None) -> SwitchInfo:
        """Block until this new version owns the state (:attr:`switched`)."""
        if not self._switched.wait(timeout):
            raise StateError(f"not switched within {timeout} s")
        assert self.switched is not None
        return self.switched

    def _on_frame(self, frame: dict[str, Any]) -> None:
        op = frame.get("op")
        if op == "deltas":
            with self.lock:
                for r in frame.get("records") or []:
                    name = str(r.get("c"))
                    c = self._containers.get(name)
                    if c is None:
                        self._pending.setdefault(name, []).append(r)
                    else:
                        c._apply(r)
                self._seq = max(self._seq, int(frame.get("seq") or 0))
        elif op == "switched":
            self.switched = SwitchInfo(
                interruption_ms=float(frame.get("interruption_ms") or 0.0),
                seq=int(frame.get("seq") or self._seq),
            )
            self._seq = max(self._seq, self.switched.seq)
            self._switched.set()
            self._start_auto()
        elif op == "handover":
            self.handover_to = str(frame.get("to") or "")
            with self._handover_lock:
                aborts = self._aborts  # (this hand-over's: an abort after it counts one more)
            threading.Thread(
                target=self._hand_over, args=(aborts,), name="dsec-state-handover", daemon=True
            ).start()
        elif op == "error" and frame.get("code") == "handover-aborted":
            self.last_error = f"handover-aborted: {frame.get('message')}"
            log.warning("state keeper: the hand-over failed; this version goes on")
            with self._handover_lock:
                self._aborts += 1
                self._final_sent = False
                self.handed_over.clear()
            self.handover_to = None
            self._stop.clear()
            self._auto_thread = None
            self._start_auto()
            for callback in list(self._aborted_callbacks):
                try:
                    callback()
                except Exception:
                    log.exception("state: a hand-over-aborted callback failed")
        elif op in ("error", "closed"):
            self.last_error = f"{frame.get('code', op)}: {frame.get('message')}"
            log.warning("state keeper: %s", self.last_error)

    def _hand_over(self, aborts: int) -> None:
        """The old version's side of a hand-over (``aborts``: the count of aborted ones when
        it was asked; an abort since ends it: this version serves on, as it was)."""
        for callback in list(self._handover_callbacks):
            try:
                callback()
            except Exception:
                log.exception("state: a hand-over callback failed")
        with self._handover_lock:
            if self._aborts != aborts:  # (aborted while the callbacks ran: no final)
                return
            self._stop.set()
        try:
            self._checkpoint(None, skip_empty=False, final=True, timeout=None, aborts=aborts)
        except StateError as exc:
            self.last_error = str(exc)
            log.error("state: the final hand-over checkpoint failed: %s", exc)
            return
        with self._handover_lock:
            if self._aborts == aborts:  # (an abort while the final's ack came: it serves on)
                self.handed_over.set()

    # -------------------------------------------------------------------------- closing
    def close(self, *, checkpoint: bool = True) -> None:
        """Stop automatic checkpoints, take a last checkpoint (``checkpoint=True``, unless
        the state was handed over), and close the connection. Idempotent."""
        if self._closed:
            return
        self._stop.set()
        if self._auto_thread is not None and self._auto_thread is not threading.current_thread():
            self._auto_thread.join(timeout=self.timeout)
        owns = not self.handed_over.is_set() and (not self.handover or self.switched is not None)
        if checkpoint and owns:
            try:
                self._checkpoint(None, skip_empty=True, final=False, timeout=None)
            except StateError as exc:
                log.warning("state: the closing checkpoint failed: %s", exc)
        self._closed = True
        self._store.close()

    async def aclose(self, *, checkpoint: bool = True) -> None:
        await asyncio.to_thread(lambda: self.close(checkpoint=checkpoint))

    def __enter__(self) -> AgentState:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> AgentState:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._stop.set()


def _frames(packed: list[bytes]) -> list[list[bytes]]:
    """Packed records, in order, as the batches of one checkpoint frame each: at most about
    :data:`FRAME_BYTES` and at most :data:`FRAME_OBJECTS` MessagePack objects (a record of many
    items is cut first: ``codec.split_packed``)."""
    batches: list[list[bytes]] = [[]]
    size = objects = 0
    for body in packed:
        for piece, n in codec.split_packed(body):
            if batches[-1] and (size + len(piece) > FRAME_BYTES or objects + n > FRAME_OBJECTS):
                batches.append([])
                size = objects = 0
            batches[-1].append(piece)
            size += len(piece)
            objects += n
    return batches


def _check_tier(tier: Any, what: str) -> str:
    if tier not in wire.TIERS:
        raise ValueError(f"{what}: {tier!r} is not a tier (one of {', '.join(wire.TIERS)})")
    return str(tier)


def _tiers_of(raw: Any) -> dict[str, str]:
    """The keeper's ``config.tiers``: a map, or [[name, tier], ...] (StatePlan's form)."""
    if not raw:
        return {}
    pairs = raw.items() if isinstance(raw, Mapping) else raw
    out: dict[str, str] = {}
    for name, tier in pairs:
        if tier in wire.TIERS:
            out[str(name)] = str(tier)
    return out
