"""Genuine events copied, replayed or buried by an attacker who can publish to the bus (in
memory: the real gate, key ring and log reads over an in-memory stream).

Each test is an attack an adversarial review reproduced against the code before its fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dsec_core import events
from dsec_core.events import KeyRevoked, SandboxScheduled
from dsec_core.subjects import subject_for
from dsec_core.trust import Gate, KeyRing, Refusal
from dsec_testing.inmemory import MemoryLog
from dsec_testing.trust import Producer, certified, pipeline, stack_root
from nacl.signing import SigningKey

pytestmark = pytest.mark.unit
SPEC = 'version: "1.2"\nname: agent\nbase: python:3.11\nentrypoint: [python, a.py]\n'


class _NoCoreNats:
    async def subscribe(self, *_: Any, **__: Any) -> None:
        return None


def _gate(root: SigningKey, log: MemoryLog) -> Gate:
    """A fresh consumer's gate (nothing remembered) over ``log``."""
    ring = KeyRing(_NoCoreNats(), log, bytes(root.verify_key))  # type: ignore[arg-type]
    return Gate(ring, log, log.handled)  # type: ignore[arg-type]


async def _put(log: MemoryLog, subject: str, wire: bytes) -> int:
    return (await log.publish(subject, wire)).seq


async def _register(log: MemoryLog, *producers: Producer) -> None:
    for producer in producers:
        key_id = producer.signer.key_id
        await _put(log, subject_for("audit.key_registered", key_id), producer.registration())


async def test_a_revocation_copied_onto_another_keys_subject_revokes_nothing() -> None:
    """The operator revoked an old user key (a rotation). Its genuine bytes, published again on
    the scheduler key's revocation subject, made every consumer that looked the scheduler up
    afterwards refuse all its events (the platform stopped placing anything)."""
    root, log = SigningKey.generate(), MemoryLog()
    operator = certified(root, "operator", subject="operator")
    scheduler = certified(root, "scheduler")
    old = certified(root, "user", tenant="acme")
    await _register(log, operator, scheduler, old)
    revoked = operator.signer.seal(
        KeyRevoked(key_id=old.signer.key_id, producer=old.signer.producer),
        aggregate_id=old.signer.key_id,
    )
    await _put(log, revoked.subject, revoked.wire)
    await _put(log, subject_for(KeyRevoked.TYPE, scheduler.signer.key_id), revoked.wire)

    gate = _gate(root, log)
    placed = scheduler.signer.seal(SandboxScheduled(node_id="n1"), aggregate_id="sbx_a")
    verdict = await gate.admit(placed.wire, stream_seq=await _put(log, placed.subject, placed.wire))
    assert not isinstance(verdict, Refusal), verdict
    # the genuine revocation still revokes the key it names
    user_event = old.signer.seal(SandboxScheduled(node_id="n1"), aggregate_id="sbx_b")
    seq = await _put(log, user_event.subject, user_event.wire)
    refused = await gate.admit(user_event.wire, stream_seq=seq)
    assert isinstance(refused, Refusal) and refused.reason == "revoked-key"


async def test_forged_messages_on_a_lifecycle_subject_hide_no_genuine_event(
    tmp_path: Path,
) -> None:
    """256 unsigned messages on a running sandbox's ``exited`` subject made its genuine exit
    invisible to every lifecycle reader (the first 256 messages were read, forged or not)."""
    log = MemoryLog()
    world = await pipeline(log, tmp_path, node_id="n1")  # type: ignore[arg-type]
    gate = _gate(stack_root(tmp_path), log)
    sid = "sbx_victim"
    await world.built(SPEC, sid)
    await world.scheduler.publish(events.SandboxScheduled(node_id="n1"), aggregate_id=sid)
    ready = events.SandboxReady(node_id="n1", pid=1, cgroup="/x")
    await world.nodeagent.publish(ready, aggregate_id=sid)
    for _ in range(300):
        await log.publish(subject_for(events.SandboxExited.TYPE, sid), b"\x80")
    exited = events.SandboxExited(exit_code=0, reason="ok", duration_s=1.0)
    sent = await world.nodeagent.publish(exited, aggregate_id=sid)
    assert (await gate.lifecycle(sid)).state == "exited"
    found = await gate.find(subject_for(events.SandboxExited.TYPE, sid))
    assert found is not None and found.id == sent.sealed.envelope.id


async def test_an_old_placements_ready_replayed_does_not_run_the_new_one(tmp_path: Path) -> None:
    """The sandbox was lost on n1 and placed on n1 again (nothing else fit). The first
    placement's genuine ``sandbox.ready``, published again, moved the new placement to
    ``running`` for every lifecycle reader: the node agent then never started it."""
    log = MemoryLog()
    world = await pipeline(log, tmp_path, node_id="n1")  # type: ignore[arg-type]
    gate = _gate(stack_root(tmp_path), log)
    sid = "sbx_victim"
    await world.built(SPEC, sid)
    await world.scheduler.publish(
        events.SandboxScheduled(node_id="n1", attempt=1), aggregate_id=sid
    )
    ready = events.SandboxReady(node_id="n1", pid=1, cgroup="/x")
    first = await world.nodeagent.publish(ready, aggregate_id=sid)
    lost = events.UnitLost(node_id="n1", reason="node lost", action="reschedule", attempt=1)
    await world.scheduler.publish(lost, aggregate_id=sid)
    await world.scheduler.publish(
        events.SandboxScheduled(node_id="n1", attempt=2), aggregate_id=sid
    )
    await log.publish(subject_for(events.SandboxReady.TYPE, sid), first.sealed.wire)
    state = await gate.lifecycle(sid)
    assert (state.state, state.attempt) == ("scheduled", 2)
    again = await world.nodeagent.publish(ready, aggregate_id=sid)  # the new placement's own
    state = await gate.lifecycle(sid)
    assert state.state == "running" and state.last_event_id == again.sealed.envelope.id


async def test_an_event_is_stale_before_its_handled_id_is_forgotten(tmp_path: Path) -> None:
    """A consumer remembers a handled id for HANDLED_TTL from handling; an event may be dated
    up to CLOCK_SKEW ahead. Before, one dated ahead and handled at once could be taken again
    in the CLOCK_SKEW after its id was forgotten (it was not stale yet)."""
    from datetime import UTC, datetime

    from dsec_core.envelope import Envelope, encode
    from dsec_core.signing import signed_bytes
    from dsec_core.trust import CLOCK_SKEW, HANDLED_TTL

    log = MemoryLog()
    world = await pipeline(log, tmp_path, node_id="n1")  # type: ignore[arg-type]
    gate = _gate(stack_root(tmp_path), log)
    sealed = world.scheduler.signer.seal(SandboxScheduled(node_id="n1"), aggregate_id="sbx_old")
    fields = dict(sealed.fields)
    fields["time"] = (datetime.now(UTC) - HANDLED_TTL + CLOCK_SKEW / 2).isoformat()
    fields["sig"] = world.scheduler.signer._key.sign(signed_bytes(fields)).signature.hex()
    wire = encode(Envelope.model_validate(fields))
    seq = await _put(log, sealed.subject, wire)
    refused = await gate.admit(wire, stream_seq=seq, consumer="t-stale")
    assert isinstance(refused, Refusal) and refused.reason == "stale"
