"""The node agent's side of a migration (``unit.migration_started``; docs/migration.md).

The scheduler publishes ``unit.migration_started{migration_id, from_node, to_node, path}``;
every node agent sees it through its own durable. The **source** (``from_node``) moves the unit,
the **target** (``to_node``) resumes it and publishes ``unit.migrated``; either end publishes
``unit.migration_failed`` — the unit keeps running on the source then (``still_running``).

Path ``criu``: the source checkpoints the sandbox's process tree (pre-dump rounds where the
kernel tracks dirty pages, then the final dump, which freezes it and leaves it stopped) and
streams the images, the root view's tmpfs and the sandbox's files to the target over NATS; the
target restores the tree in fresh cgroups (egress programs attached first), the source kills
its stopped copy (no ``sandbox.exited``: the sandbox lives on), the target continues the tree,
adopts it and publishes ``unit.migrated``.

Path ``handover`` (a sandbox with a ``state:`` section; :meth:`Migrations.move_handover`): the
target starts the same sandbox as the warm standby of its copy (its keeper recovers the state
from DSEC_STATE/S3 and streams it to the agent; its tool servers register as standbys); the
source's agent stops taking calls and makes its final checkpoint durable, its cgroup is frozen,
the checkpoints the standby lacks (the final one included) go over the channel, the target
switches the agent and the broker name, then the source's copy is killed (no event) and the
target publishes ``unit.migrated``.

The channel: core NATS request-reply on ``dsec_ipc._migrate.<to_node>`` (outside the audited
stream; node agents already hold ``dsec_ipc.>``). The source's ``offer`` and the target's
``hello`` are signed by each node agent's certified key and carry fresh X25519 keys; every later
frame is a NaCl ``Box`` between them (XSalsa20-Poly1305, a counter in each frame): only the two
node agents read the images (which hold the sandbox's memory, secrets included), and each knows
the other wrote them. The target serves only a migration it saw the scheduler start.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgpack
from dsec_core import canonical, events
from dsec_core.envelope import Envelope
from nacl.exceptions import BadSignatureError, CryptoError
from nacl.public import Box, PrivateKey, PublicKey
from nacl.signing import VerifyKey

from dsec_nodeagent import privdir
from dsec_nodeagent.ipc.registry import AgentKey
from dsec_nodeagent.migration import criu
from dsec_nodeagent.sandbox import quota
from dsec_nodeagent.sandbox.models import Limits
from dsec_nodeagent.sandbox.plan import RULES_FILE
from dsec_nodeagent.state.handover import FINAL_TIMEOUT_S, RECORDS_FRAME_BYTES, CgroupFreezer
from dsec_nodeagent.state.keeper import StateKey

if TYPE_CHECKING:
    from dsec_core.service import Service

    from dsec_nodeagent.agent import NodeAgent
    from dsec_nodeagent.ipc.broker import Broker

log = logging.getLogger(__name__)

SUBJECT_ROOT = "dsec_ipc._migrate"
OFFER_DOMAIN = b"dsec-migrate/1 offer\n"
HELLO_DOMAIN = b"dsec-migrate/1 hello\n"
CHUNK = 512 * 1024
"""Bytes of an image in one frame (NATS' default max payload is 1 MiB)."""
WINDOW = 32
"""Frames in flight (each acknowledged by the target)."""
REQUEST_S = 30.0
EXPECT_S = 15.0
"""How long the target waits to see the scheduler's ``unit.migration_started`` for an offer."""
DELTAS_FRAME_BYTES = 512 * 1024
"""Path ``handover``: checkpoint records in one frame of the channel."""
RECOVER_S = 90.0
"""Path ``handover``: how long the target's sandbox may take to start and open its state."""
SESSION_IDLE_S = 300.0
"""A migration session that has seen no frame for this long (its source crashed, or never got
the hello) is given up when the next migration of its sandbox to this node arrives."""


RUN_FILES = (RULES_FILE,)
"""Files of the source's run dir the root view binds (the semantic layer's rules)."""


def subject(node_id: str) -> str:
    return f"{SUBJECT_ROOT}.{node_id}"


class MigrationError(RuntimeError):
    """A step failed; ``stage`` as ``unit.migration_failed`` names it."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(reason)
        self.stage = stage
        self.reason = reason


def _offer_bytes(fields: dict[str, Any]) -> bytes:
    return OFFER_DOMAIN + canonical.canonical_bytes(fields)


def _hello_bytes(fields: dict[str, Any]) -> bytes:
    return HELLO_DOMAIN + canonical.canonical_bytes(fields)


@dataclass
class _Session:
    """The target's side of one migration."""

    migration_id: str
    sandbox_id: str
    started: events.UnitMigrationStarted
    box: Box
    work: Path
    channel: Any = None
    received: int = 0
    counter: int = 0
    process: asyncio.subprocess.Process | None = None
    restored: dict[str, Any] = field(default_factory=dict)
    cgroup: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    busy: int = 0  # frames being answered now
    last_seen: float = field(default_factory=time.monotonic)

    def idle(self) -> bool:
        """Whether no frame is being answered and none came for :data:`SESSION_IDLE_S`."""
        return not self.busy and time.monotonic() - self.last_seen > SESSION_IDLE_S


@dataclass
class _Standby:
    """Path ``handover``, the target: the warm standby's progress."""

    ready: asyncio.Event = field(default_factory=asyncio.Event)
    final: asyncio.Future[int] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    done: asyncio.Future[float] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    failed: str | None = None
    seq: int = 0
    """The seq of the state the standby recovered."""
    deltas: list[tuple[int, list[dict[str, Any]]]] = field(default_factory=list)
    """The checkpoints after ``seq`` the source sent over the channel, in order."""


class Migrations:
    """Both ends of the node agent's migrations."""

    broker: Callable[[], Broker | None] | None = None
    """The IPC broker (path ``handover``: the moved-in standby's tool names served here)."""

    def __init__(self, service: Service, agent: NodeAgent) -> None:
        self.service = service
        self.agent = agent
        self.node_id = agent.node_id
        self._expected: dict[str, tuple[str, events.UnitMigrationStarted]] = {}
        self._seen = asyncio.Event()
        self._sessions: dict[str, _Session] = {}
        self._moving: set[str] = set()  # sandboxes this node is moving away right now
        self._sub: Any = None
        self.on_stage: Callable[[str, str], Awaitable[None]] | None = None
        """Tests: awaited with (migration id, stage) as the source reaches each stage."""

    def attach(self) -> Migrations:
        self.service.on_start.append(self.start)
        self.service.on_stop.insert(0, self.stop)
        return self

    async def start(self) -> None:
        nc = self.service.nc
        assert nc is not None
        self._sub = await nc.subscribe(subject(self.node_id), cb=self._on_request)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        for session in list(self._sessions.values()):
            await self._discard(session)

    # ------------------------------------------------------------------ the event

    async def on_started(
        self, envelope: Envelope, event: events.UnitMigrationStarted
    ) -> Sequence[events.Payload]:
        """``unit.migration_started`` (every node's durable): the source moves, the target
        expects the offer, every other node skips it."""
        sid = envelope.aggregate_id
        if event.to_node == self.node_id:
            self._expected[event.migration_id] = (sid, event)
            self._seen.set()
            self._seen = asyncio.Event()
            return []
        if event.from_node != self.node_id:
            return []
        if sid in self._moving:
            why = f"{sid} is being moved by another migration already"
            return [self._failed(event, "checkpoint", why, True)]
        self._moving.add(sid)
        try:
            return await self.move(sid, event)
        finally:
            self._moving.discard(sid)

    def exhausted(self, envelope: Envelope, reason: str, attempts: int) -> list[events.Payload]:
        """The runtime gave the event up (retries exhausted): this node, an end of the
        migration, reports it failed; the unit runs where it ran."""
        try:
            event = events.UnitMigrationStarted.model_validate(envelope.payload)
        except ValueError:
            return []
        if self.node_id not in (event.from_node, event.to_node):
            return []
        why = f"the node agent of {self.node_id} gave up after {attempts} attempts: {reason}"
        return [self._failed(event, "checkpoint", why, True)]

    def _failed(
        self, event: events.UnitMigrationStarted, stage: str, reason: str, running: bool
    ) -> events.UnitMigrationFailed:
        return events.UnitMigrationFailed(
            unit=event.unit,
            migration_id=event.migration_id,
            from_node=event.from_node,
            to_node=event.to_node,
            reason=reason[:500],
            stage=stage,
            still_running=running,
        )

    # ------------------------------------------------------------------ source

    async def move(self, sid: str, event: events.UnitMigrationStarted) -> Sequence[events.Payload]:
        """The source's part; returns ``unit.migration_failed`` when it did not happen (the
        target publishes ``unit.migrated`` when it did)."""
        sandbox = self.agent.manager.get(sid)
        if sandbox is None:
            return [
                self._failed(event, "checkpoint", f"{sid} does not run on {self.node_id}", False)
            ]
        if event.path == "handover":
            return await self.move_handover(sid, event)
        if event.path != "criu":
            return [
                self._failed(
                    event,
                    "checkpoint",
                    f"path {event.path!r} is not carried out by node agents yet; only 'criu' "
                    "and 'handover'",
                    True,
                )
            ]
        if not sandbox.state.get("checkpointable"):
            return [
                self._failed(
                    event,
                    "checkpoint",
                    f"{sid} was not started checkpointable (the node agent's "
                    "DSEC_MIGRATION_CHECKPOINTABLE, docs/migration.md): CRIU cannot dump it",
                    True,
                )
            ]
        problem = await criu.check()
        if problem is not None:
            return [self._failed(event, "checkpoint", problem, True)]
        work = Path("/dev/shm") / f"dsec-migrate-{self.node_id}-{event.migration_id}"
        try:
            privdir.own_directory(work)  # the sandbox's memory and files; /dev/shm is everyone's
        except privdir.UnsafeDirectory as exc:
            return [self._failed(event, "checkpoint", str(exc), True)]
        frozen = False
        channel: _Channel | None = None
        init_pid = int(sandbox.state["init_pid"])
        try:
            channel = await _Channel.open(self, sid, event)
            await self._stage(event, "offered")
            mounts = criu.external_mounts(init_pid)
            pipes = criu.pipe_inodes(init_pid)
            root_tar = work / "root.tar"
            await _run(
                [
                    "tar",
                    "-C",
                    f"/proc/{init_pid}/root",
                    "--one-file-system",
                    "-cpf",
                    str(root_tar),
                    ".",
                ],
                "checkpoint",
            )
            await channel.send_file(root_tar, "root.tar")
            await channel.call({"op": "prepare"})  # the target's restorer starts, off the freeze
            stages: dict[str, float] = {}
            t0 = time.perf_counter()

            async def streamed(done: criu.Round, directory: Path) -> None:
                await channel.send_dir(directory, directory.name)

            try:
                dumped = await criu.precopy(init_pid, work / "images", mounts, on_round=streamed)
            except criu.CriuError as exc:
                raise MigrationError("checkpoint", str(exc)) from None
            frozen = True
            final = dumped.rounds[-1]
            stages["precopy"] = round((time.perf_counter() - t0) * 1000 - final.ms, 2)
            stages["dump"] = round(final.ms, 2)
            freeze_t = time.perf_counter() - final.ms / 1000
            t1 = time.perf_counter()
            await channel.send_dir(work / "images" / "final", "final")
            data_tar = work / "data.tar"
            data_dir = self.agent.manager.data_root / sid
            await _run(
                [
                    "tar",
                    "-C",
                    str(data_dir),
                    f"--exclude=./{quota.IMAGE_NAME}",
                    "-cpf",
                    str(data_tar),
                    ".",
                ],
                "transfer",
            )
            await channel.send_file(data_tar, "data.tar")
            run_dir = self.agent.manager.run_dir / sid
            for name in RUN_FILES:  # what the root view binds from the run dir, but sockets
                if (run_dir / name).is_file():
                    await channel.send_file(run_dir / name, f"run/{name}")
            stages["transfer"] = round((time.perf_counter() - t1) * 1000, 2)
            await self._stage(event, "transferred")
            quota_bytes = 0
            if quota.is_mounted(data_dir):
                st = os.statvfs(quota.mount_point(data_dir))
                quota_bytes = st.f_blocks * st.f_frsize
            launched = self.agent.launched(sid)
            limits = launched.config.limits if launched is not None else Limits()
            meta = {
                "mounts": mounts,
                "keys": criu.mount_keys(mounts),
                "pipes": {
                    "stdout": pipes.get(1),
                    "stderr": pipes.get(2),
                    "status": next((name for fd, name in pipes.items() if fd > 2), None),
                },
                "quota_bytes": quota_bytes,
                "source_home": str(self.agent.home),
                "source_data": str(data_dir),
                "source_run": str(self.agent.manager.run_dir / sid),
                "limits": limits.model_dump(mode="json"),
                "state": {
                    k: sandbox.state.get(k)
                    for k in ("uid", "ready", "exec_plan", "agent", "secret_env_names")
                },
            }
            t2 = time.perf_counter()
            answer = await channel.call({"op": "restore", "meta": meta}, timeout=120)
            if not answer.get("ok"):
                raise MigrationError(str(answer.get("stage", "restore")), str(answer.get("reason")))
            stages["restore"] = round(float(answer.get("restore_ms", 0.0)), 2)
            # Never two copies running: the source's stopped copy goes before the target's runs.
            self.agent.release_migrated(sid)
            await asyncio.to_thread(sandbox.cgroup.kill)
            frozen = False
            stages["switch"] = round((time.perf_counter() - t2) * 1000 - stages["restore"], 2)
            bytes_moved = channel.sent
            answer = await channel.call(
                {
                    "op": "commit",
                    "freeze_started_ago_ms": (time.perf_counter() - freeze_t) * 1000,
                    "stages": stages,
                    "bytes": bytes_moved,
                    "rounds": dumped.precopy_rounds,
                },
                timeout=30,
            )
            if not answer.get("ok"):
                log.error("%s: the target could not continue it: %s", sid, answer.get("reason"))
            await self._stage(event, "released")
            return []
        except Exception as caught:  # whatever failed: never leave the unit frozen
            err = (
                caught
                if isinstance(caught, MigrationError)
                else MigrationError(
                    "transfer" if frozen else "checkpoint", f"{type(caught).__name__}: {caught}"
                )
            )
            log.warning(
                "%s: migration %s failed at %s: %s", sid, event.migration_id, err.stage, err
            )
            if frozen:
                await asyncio.to_thread(_resume, sandbox.cgroup.pids())
            if channel is not None:
                with contextlib.suppress(Exception):
                    await channel.call({"op": "abort"}, timeout=10)
            return [
                self._failed(event, err.stage, err.reason, self.agent.manager.get(sid) is not None)
            ]
        finally:
            shutil.rmtree(work, ignore_errors=True)

    async def move_handover(
        self, sid: str, event: events.UnitMigrationStarted
    ) -> Sequence[events.Payload]:
        """Path ``handover`` across nodes, the source's part (docs/migration.md "Path
        ``handover``"): the target starts the sandbox as a warm standby while this copy serves
        (``hprepare``); then the agent stops taking calls and makes its final checkpoint
        durable (the same-node hand-over's final-delta step), its cgroup is frozen, the
        checkpoints after the standby's recovered seq go to the target over the node-to-node
        channel (``hfinal``), the target switches, and only then is this frozen copy killed
        (no ``sandbox.exited``). Any failure before: thawed, told ``handover-aborted``, it
        serves on (``still_running``)."""
        sandbox = self.agent.manager.get(sid)
        keeper = self.agent.state_keeper
        launched = self.agent.launched(sid)
        plan = launched.plan if launched is not None else None
        if sandbox is None or keeper is None or plan is None or plan.state is None:
            why = (
                f"{sid} has no state plane on {self.node_id} (no `state:` section, or it was "
                "re-adopted by a restarted node agent): path handover cannot carry it"
            )
            return [self._failed(event, "checkpoint", why, sandbox is not None)]
        key = StateKey(plan.tenant, plan.effective_task_group, plan.name)
        session = keeper.session_of(key)
        if session is None or session.sandbox_id != sid or session._agent is None:
            why = f"the agent of {sid} holds no open state (AgentState): nothing to hand over"
            return [self._failed(event, "checkpoint", why, True)]
        cgroup_dir = sandbox.ready.cgroup_path
        freezer = CgroupFreezer()
        channel: _Channel | None = None
        stopped = False
        frozen_dir: str | None = None
        stages: dict[str, float] = {}
        released = False  # its copy here is gone: a later failure leaves it not running
        made: list[tuple[int, list[dict[str, Any]]]] = []

        async def collect(seq: int, records: list[dict[str, Any]]) -> None:
            made.append((seq, records))

        session.on_checkpoint(collect)  # what the standby will not have read from DSEC_STATE
        try:
            channel = await _Channel.open(self, sid, event)
            await self._stage(event, "offered")
            t_prep = time.perf_counter()
            answer = await channel.call({"op": "hprepare"}, timeout=180)
            if not answer.get("ok"):
                raise MigrationError(str(answer.get("stage", "restore")), str(answer.get("reason")))
            stages["prepare"] = round((time.perf_counter() - t_prep) * 1000, 2)
            stages["launch"] = round(float(answer.get("launch_ms", 0.0)), 2)
            stages["recover"] = round(float(answer.get("recover_ms", 0.0)), 2)
            await self._stage(event, "standby")
            # The interruption starts here: the agent finishes the call in progress, takes no
            # more, and sends its final checkpoint, made durable (JetStream) by the keeper.
            t0 = time.perf_counter()
            stopped = True
            await session.request_final(sid, timeout_s=FINAL_TIMEOUT_S)
            final_seq = session._seq()
            await freezer.freeze(cgroup_dir)
            frozen_dir = cgroup_dir
            t1 = time.perf_counter()
            stages["final"] = round((t1 - t0) * 1000, 2)
            await self._stage(event, "stopped")
            # The checkpoints after the standby's recovered seq, the final one included: over
            # the node-to-node channel (sealed), in frames the bus carries.
            since = int(answer.get("seq", 0))
            deltas = [[seq, records] for seq, records in made if seq > since]
            sent = 0
            frame: list[list[Any]] = []
            size = 0
            for item in deltas:
                item_bytes = len(msgpack.packb(item, use_bin_type=True))
                if frame and size + item_bytes > DELTAS_FRAME_BYTES:
                    await channel.call({"op": "hdeltas", "deltas": frame})
                    frame, size = [], 0
                frame.append(item)
                size += item_bytes
                sent += item_bytes
            answer = await channel.call(
                {"op": "hfinal", "seq": final_seq, "deltas": frame}, timeout=60
            )
            if not answer.get("ok"):
                raise MigrationError(str(answer.get("stage", "restore")), str(answer.get("reason")))
            t2 = time.perf_counter()
            stages["switch"] = round((t2 - t1) * 1000, 2)
            del made[:]
            # The target's agent holds the state: this frozen copy goes, with no event.
            self.agent.release_migrated(sid)
            keeper.forget_sandbox(sid)
            released = True
            await asyncio.to_thread(sandbox.cgroup.kill)
            frozen_dir = None
            broker = self.broker() if self.broker is not None else None
            if broker is not None:
                await broker.withdraw(AgentKey(plan.effective_task_group, plan.name, plan.tenant))
            stages["release"] = round((time.perf_counter() - t2) * 1000, 2)
            answer = await channel.call(
                {
                    "op": "hcommit",
                    "stopped_ago_ms": (time.perf_counter() - t0) * 1000,
                    "stages": stages,
                    "bytes": sent,
                    "seq": final_seq,
                },
                timeout=30,
            )
            if not answer.get("ok"):
                log.error("%s: the target could not adopt it: %s", sid, answer.get("reason"))
            await self._stage(event, "released")
            return []
        except Exception as caught:  # whatever failed: the source serves on
            err = (
                caught
                if isinstance(caught, MigrationError)
                else MigrationError(
                    "restore" if stopped else "checkpoint", f"{type(caught).__name__}: {caught}"
                )
            )
            log.warning(
                "%s: migration %s failed at %s: %s", sid, event.migration_id, err.stage, err
            )
            if frozen_dir is not None:
                with contextlib.suppress(Exception):
                    await freezer.thaw(frozen_dir)
            if channel is not None:
                with contextlib.suppress(Exception):
                    await channel.call({"op": "abort"}, timeout=30)
            if stopped and not released:  # it stopped taking calls for its final checkpoint
                with contextlib.suppress(Exception):
                    await session.abort_handover(err.reason[:300])
            running = not released and self.agent.manager.get(sid) is not None
            return [self._failed(event, err.stage, err.reason, running)]
        finally:
            session.off_checkpoint(collect)

    async def _stage(self, event: events.UnitMigrationStarted, stage: str) -> None:
        if self.on_stage is not None:
            await self.on_stage(event.migration_id, stage)

    # ------------------------------------------------------------------ target

    async def _on_request(self, msg: Any) -> None:
        try:
            answer = await self._answer(msg.data)
        except ValueError as exc:  # refused: said to the sender, and logged in one line
            log.warning("migration request refused: %s", exc)
            answer = canonical.canonical_bytes({"k": "refused", "reason": str(exc)[:300]})
        except Exception as exc:  # a hostile request must never stop the node agent
            log.exception("migration request failed")
            answer = canonical.canonical_bytes({"k": "refused", "reason": str(exc)[:300]})
        if msg.reply:
            await self.service.nc.publish(msg.reply, answer)  # type: ignore[union-attr]

    async def _answer(self, data: bytes) -> bytes:
        frame = canonical.unpack(data)
        if not isinstance(frame, dict):
            raise ValueError("not a map")
        if frame.get("k") == "offer":
            return await self._hello(frame)
        session = self._sessions.get(str(frame.get("mid")))
        if session is None:
            raise ValueError("no such migration here")
        try:
            body = canonical.unpack(session.box.decrypt(bytes(frame["sealed"])))
        except (CryptoError, KeyError, TypeError) as exc:
            raise ValueError("a frame that does not open") from exc
        if not isinstance(body, dict) or body.get("n") != session.counter:
            raise ValueError("a frame out of order")
        session.counter += 1
        session.busy += 1
        try:
            result = await self._serve(session, body)
        finally:
            session.busy -= 1
            session.last_seen = time.monotonic()
        return canonical.canonical_bytes(
            {"k": "sealed", "sealed": session.box.encrypt(canonical.canonical_bytes(result))}
        )

    async def _hello(self, frame: dict[str, Any]) -> bytes:
        fields = {k: v for k, v in frame.items() if k != "sig"}
        mid, sid = str(frame.get("mid")), str(frame.get("sid"))
        gate = self.service.gate
        assert gate is not None
        cert = await gate.keys.certificate(str(frame.get("key_id")))
        if isinstance(cert, str):
            raise ValueError(cert)
        try:
            VerifyKey(bytes.fromhex(cert.public_key)).verify(
                _offer_bytes(fields), bytes(frame["sig"])
            )
        except (BadSignatureError, ValueError, TypeError, KeyError) as exc:
            raise ValueError("offer signature invalid") from exc
        expected = await self._expect(mid)
        if expected is None:
            raise ValueError(f"no unit.migration_started {mid} for {self.node_id} seen")
        esid, started = expected
        if cert.role != "nodeagent" or cert.node_id != started.from_node or esid != sid:
            raise ValueError("the offer is not from the migration's source node")
        if self.agent.manager.busy(sid):
            raise ValueError(f"{sid} already runs on {self.node_id}")
        for other in [s for s in self._sessions.values() if s.sandbox_id == sid]:
            # (a retried migration while the first one's restore is still here: the two would
            # share the sandbox's run directory, cgroup and egress)
            if not other.idle():
                raise ValueError(f"a migration of {sid} to {self.node_id} is already under way")
            log.warning("%s: migration %s left idle; given up", sid, other.migration_id)
            await self._discard(other)
        if self.agent.exiting(sid):  # an earlier copy's exit still releases its egress
            raise ValueError(f"an earlier copy of {sid} is still ending on {self.node_id}")
        key = PrivateKey.generate()
        box = Box(key, PublicKey(bytes(frame["key"])))
        work = Path("/dev/shm") / f"dsec-restore-{self.node_id}-{mid}"
        try:
            privdir.own_directory(work)  # the sandbox's memory and files; /dev/shm is everyone's
        except privdir.UnsafeDirectory as exc:
            raise ValueError(str(exc)) from None
        self._sessions[mid] = _Session(mid, sid, started, box, work)
        assert self.service.publisher is not None
        signer = self.service.publisher.signer
        hello: dict[str, Any] = {"k": "hello", "mid": mid, "node": self.node_id}
        hello["key_id"] = signer.key_id
        hello["key"] = bytes(key.public_key)
        hello["sig"] = bytes.fromhex(signer.endorse(_hello_bytes(hello)))
        return canonical.canonical_bytes(hello)

    async def _expect(self, mid: str) -> tuple[str, events.UnitMigrationStarted] | None:
        deadline = time.monotonic() + EXPECT_S
        while mid not in self._expected:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._seen.wait(), left)
        return self._expected[mid]

    async def _serve(self, session: _Session, body: dict[str, Any]) -> dict[str, Any]:
        op = body.get("op")
        if op == "file":
            path = _inside(session.work, str(body["path"]))
            path.parent.mkdir(parents=True, exist_ok=True)
            data = bytes(body.get("data", b""))
            await asyncio.to_thread(_write_at, path, int(body["offset"]), data)
            session.received += len(data)
            return {"ok": True}
        if op == "link":
            path = _inside(session.work, str(body["path"]))
            path.parent.mkdir(parents=True, exist_ok=True)
            target = str(body["target"])
            if target.startswith("/") or ".." in Path(target).parts[1:]:
                raise ValueError("a link leaving the images")
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            path.symlink_to(target)
            return {"ok": True}
        if op == "prepare":
            await self._prepare(session)
            return {"ok": True}
        if op == "restore":
            try:
                ms = await self._restore(session, dict(body["meta"]))
            except Exception as exc:  # anything: nothing of the restore stays
                await self._discard(session)
                stage = exc.stage if isinstance(exc, MigrationError) else "restore"
                return {"ok": False, "stage": stage, "reason": str(exc)[:500]}
            return {"ok": True, "restore_ms": ms}
        if op == "commit":
            return await self._commit(session, body)
        if op == "abort":
            await self._discard(session)
            return {"ok": True}
        if op in ("hprepare", "hdeltas", "hfinal"):
            try:
                return await self._handover_step(session, op, body)
            except Exception as exc:  # anything: nothing of the start stays
                log.warning("%s: %s failed: %s", session.sandbox_id, op, exc)
                await self._discard(session)
                stage = exc.stage if isinstance(exc, MigrationError) else "restore"
                return {"ok": False, "stage": stage, "reason": f"{type(exc).__name__}: {exc}"}
        if op == "hcommit":
            return await self._handover_commit(session, body)
        raise ValueError(f"unknown op {op!r}")

    async def _handover_step(
        self, session: _Session, op: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """Path ``handover``, the target. ``hprepare`` (the source serves): start the same
        sandbox as the warm standby of its copy (its keeper here recovers the state from
        DSEC_STATE/S3 and streams it to the agent, whose tool servers register as standbys)
        and answer once the agent said ``ready``. ``hfinal{seq}`` (the source stopped after
        its final checkpoint and froze): the checkpoints after the recovered ones, the final
        included, read from DSEC_STATE and forwarded as ``deltas``; the agent owns the state
        (``switched``) and the broker serves its name here; answered then."""
        sid = session.sandbox_id
        keeper = self.agent.state_keeper
        if keeper is None:
            raise MigrationError("restore", f"no state keeper on {self.node_id}")
        if op == "hprepare":
            standby = _Standby()
            session.meta = {"standby": standby}
            keeper.incoming[sid] = lambda new: self._serve_standby(session, standby, new)
            t0 = time.perf_counter()
            built_env, staging = await self.agent.stage_migrated(sid)
            session.meta["launched"] = True
            await self.agent.launch_migrated(sid, built_env, staging)
            t1 = time.perf_counter()
            deadline = time.monotonic() + RECOVER_S
            while not standby.ready.is_set():
                if standby.failed is not None:
                    raise MigrationError("restore", standby.failed)
                if self.agent.manager.get(sid) is None:
                    raise MigrationError("restore", f"{sid} ended on {self.node_id} as a standby")
                if time.monotonic() > deadline:
                    raise MigrationError(
                        "restore",
                        f"the agent of {sid} did not restore its state on {self.node_id} "
                        f"within {RECOVER_S:g} s",
                    )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(standby.ready.wait(), 0.2)
            return {
                "ok": True,
                "launch_ms": (t1 - t0) * 1000,
                "recover_ms": (time.perf_counter() - t1) * 1000,
                "seq": standby.seq,
            }
        waiting = session.meta.get("standby")
        if not isinstance(waiting, _Standby):
            raise MigrationError("restore", f"{op} before hprepare")
        for item in body.get("deltas") or []:
            seq, records = int(item[0]), list(item[1])
            if seq == (waiting.deltas[-1][0] if waiting.deltas else waiting.seq) + 1:
                waiting.deltas.append((seq, records))
        if op == "hdeltas":
            return {"ok": True}
        if not isinstance(waiting, _Standby) or not waiting.ready.is_set():
            raise MigrationError("restore", "hfinal before the standby was ready")
        waiting.final.set_result(int(body.get("seq", 0)))
        await asyncio.wait_for(asyncio.shield(waiting.done), 60)
        return {"ok": True}

    async def _serve_standby(self, session: _Session, standby: _Standby, new: Any) -> None:
        """The keeper's side of the standby's state session (``keeper.incoming``)."""
        keeper = self.agent.state_keeper
        assert keeper is not None
        sid = session.sandbox_id
        try:
            records, seq0 = await keeper.records_for(new)
            standby.seq = seq0
            batch: list[dict[str, Any]] = []
            size = 0
            for record in records:
                record_bytes = len(msgpack.packb(record, use_bin_type=True))
                if batch and size + record_bytes > RECORDS_FRAME_BYTES:
                    await new.send({"op": "records", "records": batch})
                    batch, size = [], 0
                batch.append(record)
                size += record_bytes
            if batch:
                await new.send({"op": "records", "records": batch})
            await new.send(
                {
                    "op": "fetched",
                    "seq": seq0,
                    "deltas": len(records),
                    "source": "remote" if records else "empty",
                    "ms": 0.0,
                }
            )
            await asyncio.wait_for(new.ready.wait(), RECOVER_S)
            standby.ready.set()
            final_seq = await standby.final
            started = time.perf_counter()
            caught = standby.deltas
            if (caught[-1][0] if caught else seq0) >= final_seq:
                await keeper.apply(new, caught)  # the source's, over the channel
            else:  # a gap in what came over the channel: read them from DSEC_STATE
                caught = await keeper.catch_up(new, seq0)
            for seq, delta in caught:
                await new.send({"op": "deltas", "seq": seq, "records": delta})
            seq = caught[-1][0] if caught else seq0
            if seq < final_seq:
                raise MigrationError(
                    "restore", f"DSEC_STATE holds checkpoints up to {seq}, not {final_seq}"
                )
            keeper.take_owner(new)
            ms = (time.perf_counter() - started) * 1000
            await new.send({"op": "switched", "interruption_ms": ms, "seq": seq})
            standby.done.set_result(ms)
        except BaseException as exc:
            why = str(exc) or type(exc).__name__
            standby.failed = why
            if not standby.done.done():
                standby.done.set_exception(MigrationError("restore", why))
            with contextlib.suppress(Exception):
                await new.send({"op": "error", "code": "handover-failed", "message": why,
                                "seq": None})  # fmt: skip
            if not isinstance(exc, Exception):
                raise
        finally:
            keeper.incoming.pop(sid, None)
            broker = self.broker() if self.broker is not None else None
            if broker is not None:
                broker.forget_handover(sid)

    async def _handover_commit(self, session: _Session, body: dict[str, Any]) -> dict[str, Any]:
        """Path ``handover``: the source released its copy; this one is the sandbox's."""
        sid = session.sandbox_id
        received = time.perf_counter()
        launched = self.agent.launched(sid)
        broker = self.broker() if self.broker is not None else None
        if broker is not None and launched is not None:  # the name is served from here now
            plan = launched.plan
            broker.promote(AgentKey(plan.effective_task_group, plan.name, plan.tenant), sid)
        served = time.perf_counter()
        self._sessions.pop(session.migration_id, None)
        shutil.rmtree(session.work, ignore_errors=True)
        await self.agent.adopted_migrated(sid, session.started)
        migrated = events.UnitMigrated(
            unit=session.started.unit,
            migration_id=session.migration_id,
            from_node=session.started.from_node,
            to_node=self.node_id,
            from_gpus=session.started.from_gpus,
            to_gpus=session.started.to_gpus,
            reason=session.started.reason,
            path="handover",
            # from the stop to the name served here (the commit frame's transit not counted)
            interruption_ms=round(
                float(body.get("stopped_ago_ms", 0.0)) + (served - received) * 1000, 2
            ),
            bytes_moved=int(body.get("bytes", 0)),
            stages_ms={k: float(v) for k, v in dict(body.get("stages") or {}).items()},
        )
        await self.agent.outlet.lifecycle(migrated, sid, None)
        return {"ok": True}

    def _target_path(self, meta: dict[str, Any], host_path: str) -> str:
        """The target's path for a source host path: the sandbox's files are here under its
        own data dir, the source home's other paths (staged environments) under this home."""
        sid = meta["state"]["ready"]["sandbox_id"]
        source_data, source_home = meta["source_data"], meta["source_home"]
        if host_path == source_data or host_path.startswith(source_data + "/"):
            return str(self.agent.manager.data_root / sid) + host_path[len(source_data) :]
        source_run = meta["source_run"]
        if host_path == source_run or host_path.startswith(source_run + "/"):
            return str(self.agent.manager.run_dir / sid) + host_path[len(source_run) :]
        if host_path.startswith(source_home + "/"):
            return str(self.agent.home) + host_path[len(source_home) :]
        return host_path

    async def _prepare(self, session: _Session) -> None:
        """Start the restorer and have it rebuild the root view while the source still runs."""
        root = self.agent.manager.run_dir / session.sandbox_id / "root"
        root.mkdir(parents=True, exist_ok=True)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "dsec_nodeagent.migration.restorer",
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        session.process = process
        assert process.stdin is not None
        first = {"root": str(root), "root_tar": str(session.work / "root.tar")}
        process.stdin.write(_json_line(first))
        await process.stdin.drain()

    async def _restore(self, session: _Session, meta: dict[str, Any]) -> float:
        sid = session.sandbox_id
        manager = self.agent.manager
        session.meta = meta
        data_dir = manager.data_root / sid
        run_dir = manager.run_dir / sid
        try:
            uid = int(meta["state"]["uid"])
        except (KeyError, TypeError, ValueError) as exc:
            raise MigrationError("restore", f"the sandbox's uid is missing: {exc}") from None
        if manager.busy(sid):
            raise MigrationError("restore", f"{sid} already runs or starts on {self.node_id}")
        if not manager.reserve_uid(uid):  # it keeps its uid: its files and processes have it
            raise MigrationError(
                "restore", f"uid {uid} of {sid} is already a sandbox's uid on {self.node_id}"
            )
        session.meta["uid_reserved"] = uid
        try:
            limits = Limits.model_validate(meta["limits"])
            if meta.get("quota_bytes"):
                await asyncio.to_thread(quota.create, data_dir, int(meta["quota_bytes"]))
            data_dir.mkdir(parents=True, exist_ok=True)
            await _run(
                ["tar", "-C", str(data_dir), "-xpf", str(session.work / "data.tar")], "restore"
            )
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "root").mkdir(exist_ok=True)
            for name in RUN_FILES:
                if (session.work / "run" / name).is_file():
                    shutil.copy2(session.work / "run" / name, run_dir / name)
            binds = {hp.rsplit("/", 1)[-1] for hp in meta["mounts"].values()}
            session.channel = await manager.prepare_restored(
                sid,
                uid,
                ipc="ipc" in binds,
                semantic="events.sock" in binds,
            )
            cgroup = await asyncio.to_thread(
                functools.partial(
                    manager.create_cgroup, sid, limits, disk=bool(meta.get("quota_bytes"))
                )
            )
            session.cgroup = cgroup
        except (OSError, quota.QuotaError, ValueError, KeyError) as exc:
            raise MigrationError("restore", f"preparing the target failed: {exc}") from None
        mounts = {mp: self._target_path(meta, hp) for mp, hp in meta["mounts"].items()}
        final = session.work / "final"
        plan = {
            "args": criu.restore_args(
                final, mounts, meta["keys"], {}, final / "restored.pid", run_dir / "root"
            ),
            "pipes": {k: v for k, v in meta["pipes"].items() if v},
            "cgroup_procs": cgroup.procs_files(),
            "placeholders": [(mp, os.path.isdir(hp)) for mp, hp in sorted(mounts.items())],
            "log": str(final / "criu-restore.log"),
            "pidfile": str(final / "restored.pid"),
            "stdout_path": str(data_dir / "logs" / "stdout.log"),
            "stderr_path": str(data_dir / "logs" / "stderr.log"),
            "exit_path": str(run_dir / "exit.json"),
        }
        start = time.perf_counter()
        if session.process is None:  # an old source that sent no prepare
            await self._prepare(session)
        process = session.process
        assert process is not None and process.stdin is not None and process.stdout is not None
        process.stdin.write(_json_line(plan))
        process.stdin.close()
        line = await asyncio.wait_for(process.stdout.readline(), 120)
        ms = (time.perf_counter() - start) * 1000
        try:
            report = json.loads(line or b"{}")
        except ValueError:
            report = {}
        if "restored" not in report:
            raise MigrationError("restore", str(report.get("error", "the restorer said nothing")))
        session.restored = report
        # The egress programs go on the new cgroup now: CRIU itself ran there (its kernel
        # probes connect on loopback, which they would refuse), and the restored tree is
        # still stopped — nothing of the sandbox has run here without them.
        try:
            await self.agent.attach_restored(sid, cgroup.v2_dir, cgroup.inode)
        except (OSError, ValueError) as exc:
            raise MigrationError(
                "restore", f"attaching the egress programs failed: {exc}"
            ) from None
        return ms

    async def _commit(self, session: _Session, body: dict[str, Any]) -> dict[str, Any]:
        sid, meta, report = session.sandbox_id, session.meta, session.restored
        cgroup = session.cgroup
        received = time.perf_counter()
        await asyncio.to_thread(_resume, cgroup.pids())
        resumed = time.perf_counter()
        state = dict(meta["state"])
        ready = dict(state["ready"])
        ready.update(
            pid=int(report["workload"]),
            cgroup_path=str(cgroup.v2_dir),
        )
        exec_plan = dict(state.get("exec_plan") or {})
        exec_plan["cgroup_procs"] = cgroup.procs_files()
        assert session.process is not None
        state.update(
            sandbox_id=sid,
            phase="running",
            supervisor_pid=session.process.pid,
            supervisor_start=None,
            init_pid=int(report["restored"]),
            cgroup=cgroup.to_state(),
            run_dir=str(self.agent.manager.run_dir / sid),
            deadline=None,
            ready=ready,
            exec_plan=exec_plan,
            checkpointable=True,
        )
        self.agent.manager.adopt_restored(state, cgroup, session.process, session.channel)
        await self.agent.adopted_migrated(sid, session.started)
        stages = {k: float(v) for k, v in dict(body.get("stages") or {}).items()}
        interruption = float(body.get("freeze_started_ago_ms", 0.0))
        interruption += (resumed - received) * 1000  # the frame's transit is not counted
        migrated = events.UnitMigrated(
            unit=session.started.unit,
            migration_id=session.migration_id,
            from_node=session.started.from_node,
            to_node=self.node_id,
            from_gpus=session.started.from_gpus,
            to_gpus=session.started.to_gpus,
            reason=session.started.reason,
            path="criu",
            interruption_ms=round(interruption, 2),
            bytes_moved=int(body.get("bytes", session.received)),
            precopy_rounds=int(body.get("rounds", 0)),
            stages_ms=stages,
        )
        self._sessions.pop(session.migration_id, None)
        shutil.rmtree(session.work, ignore_errors=True)
        await self.agent.outlet.lifecycle(migrated, sid, None)
        return {"ok": True}

    async def _discard(self, session: _Session) -> None:
        """Undo a restore that will not be committed (nothing of it stays)."""
        self._sessions.pop(session.migration_id, None)
        sid = session.sandbox_id
        standby = session.meta.get("standby")
        if isinstance(standby, _Standby):
            if not standby.final.done():
                standby.final.set_exception(MigrationError("restore", "aborted"))
                standby.final.exception()  # retrieved: the standby's task may be gone
            if self.agent.state_keeper is not None:
                self.agent.state_keeper.incoming.pop(sid, None)
        if session.meta.get("launched") and self.agent.manager.busy(sid):
            with contextlib.suppress(Exception):  # path handover: the copy started here
                self.agent.release_migrated(sid)
                await self.agent.fence(sid)
        if session.channel is not None:
            with contextlib.suppress(Exception):
                await session.channel.close()
        if session.cgroup is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(session.cgroup.kill)
        if session.process is not None:
            with contextlib.suppress(Exception):
                if session.process.stdin is not None and not session.process.stdin.is_closing():
                    session.process.stdin.close()  # EOF: a restorer still waiting ends
                await asyncio.wait_for(session.process.wait(), 10)
        if session.cgroup is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(session.cgroup.remove)
            await self.agent.detach_restored(sid)
        reserved = session.meta.get("uid_reserved")
        if isinstance(reserved, int) and self.agent.manager.get(sid) is None:
            self.agent.manager.release_uid(reserved)
        data_dir = self.agent.manager.data_root / sid
        # Nothing of a sandbox of this id that runs, starts or has a state here (a standby's
        # restart under way) is removed: only what this restore made.
        if not self.agent.manager.busy(sid):
            with contextlib.suppress(Exception):
                await asyncio.to_thread(quota.release, data_dir, keep_outputs=False)
            shutil.rmtree(data_dir, ignore_errors=True)
            shutil.rmtree(self.agent.manager.run_dir / sid, ignore_errors=True)
        shutil.rmtree(session.work, ignore_errors=True)


class _Channel:
    """The source's side of the sealed stream to the target."""

    def __init__(self, migrations: Migrations, mid: str, to_node: str, box: Box) -> None:
        self.m = migrations
        self.mid = mid
        self.to_node = to_node
        self.box = box
        self.counter = 0
        self.sent = 0
        self._lock = asyncio.Lock()

    @classmethod
    async def open(cls, m: Migrations, sid: str, event: events.UnitMigrationStarted) -> _Channel:
        assert m.service.publisher is not None and m.service.nc is not None
        signer = m.service.publisher.signer
        key = PrivateKey.generate()
        offer: dict[str, Any] = {
            "k": "offer",
            "mid": event.migration_id,
            "sid": sid,
            "from": m.node_id,
            "to": event.to_node,
            "key_id": signer.key_id,
            "key": bytes(key.public_key),
            "time": datetime.now(UTC).isoformat(),
        }
        offer["sig"] = bytes.fromhex(signer.endorse(_offer_bytes(offer)))
        try:
            msg = await m.service.nc.request(
                subject(event.to_node), canonical.canonical_bytes(offer), timeout=EXPECT_S + 5
            )
        except Exception as exc:
            why = f"the target {event.to_node} did not answer: {exc}"
            raise MigrationError("transfer", why) from None
        hello = canonical.unpack(msg.data)
        if not isinstance(hello, dict) or hello.get("k") != "hello":
            reason = hello.get("reason") if isinstance(hello, dict) else "?"
            raise MigrationError("transfer", f"the target {event.to_node} refused: {reason}")
        gate = m.service.gate
        assert gate is not None
        cert = await gate.keys.certificate(str(hello.get("key_id")))
        fields = {k: v for k, v in hello.items() if k != "sig"}
        try:
            if isinstance(cert, str) or cert.node_id != event.to_node:
                raise BadSignatureError("not the target's key")
            VerifyKey(bytes.fromhex(cert.public_key)).verify(
                _hello_bytes(fields), bytes(hello["sig"])
            )
        except (BadSignatureError, ValueError, TypeError, KeyError) as exc:
            raise MigrationError("transfer", f"the target's hello does not verify: {exc}") from None
        return cls(m, event.migration_id, event.to_node, Box(key, PublicKey(bytes(hello["key"]))))

    async def call(self, body: dict[str, Any], timeout: float = REQUEST_S) -> dict[str, Any]:
        nc = self.m.service.nc
        assert nc is not None
        async with self._lock:  # frames are numbered in the order they are sealed and sent
            sealed = self.box.encrypt(canonical.canonical_bytes({**body, "n": self.counter}))
            self.counter += 1
            request = nc.request(
                subject(self.to_node),
                canonical.canonical_bytes({"k": "frame", "mid": self.mid, "sealed": sealed}),
                timeout=timeout,
            )
            task = asyncio.ensure_future(request)
        try:
            msg = await task
        except Exception as exc:
            raise MigrationError("transfer", f"the target stopped answering: {exc}") from None
        answer = canonical.unpack(msg.data)
        if not isinstance(answer, dict) or answer.get("k") != "sealed":
            reason = answer.get("reason") if isinstance(answer, dict) else "?"
            raise MigrationError("transfer", f"the target refused a frame: {reason}")
        try:
            result = canonical.unpack(self.box.decrypt(bytes(answer["sealed"])))
        except CryptoError as exc:
            raise MigrationError("transfer", "an answer that does not open") from exc
        assert isinstance(result, dict)
        return result

    async def send_file(self, path: Path, name: str) -> None:
        size = path.stat().st_size
        pending: list[asyncio.Task[dict[str, Any]]] = []
        with path.open("rb") as fh:
            offset = 0
            while True:
                data = fh.read(CHUNK)
                if not data and offset > 0:
                    break
                body = {"op": "file", "path": name, "offset": offset, "data": data}
                pending.append(asyncio.ensure_future(self.call(body)))
                self.sent += len(data)
                offset += len(data)
                if len(pending) >= WINDOW:
                    await pending.pop(0)
                if offset >= size:
                    break
        for task in pending:
            await task

    async def send_dir(self, directory: Path, name: str) -> None:
        for entry in sorted(directory.iterdir()):
            if entry.is_symlink():
                await self.call({"op": "link", "path": f"{name}/{entry.name}",
                                 "target": os.readlink(entry)})  # fmt: skip
            elif entry.is_file() and entry.name not in ("criu.log",):
                await self.send_file(entry, f"{name}/{entry.name}")


def _json_line(data: dict[str, Any]) -> bytes:
    return json.dumps(data).encode() + b"\n"


def _inside(root: Path, name: str) -> Path:
    parts = Path(name).parts
    if not parts or Path(name).is_absolute() or ".." in parts or len(parts) > 3:
        raise ValueError(f"a path outside the images: {name!r}")
    return root.joinpath(*parts)


def _write_at(path: Path, offset: int, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def _resume(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


async def _run(argv: list[str], stage: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    if proc.returncode != 0:
        raise MigrationError(stage, f"{argv[0]} failed: {err.decode(errors='replace')[-300:]}")


__all__ = ["MigrationError", "Migrations"]
