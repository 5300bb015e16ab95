"""Genuine events copied, replayed or buried by an attacker who can publish to the bus (in
memory: the real gate, key ring and log reads over an in-memory stream).

Each test is an attack an adversarial review reproduced against the code before its fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dsec_core import events
from dsec_core.envelope import Envelope
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


async def _placed_again_on_the_same_node(
    tmp_path: Path, copies: int
) -> tuple[Gate, str, Envelope, Any]:
    """A sandbox lost on n1 and placed on n1 again (nothing else fit); the first placement's
    genuine ``sandbox.ready`` published ``copies`` times more. Returns the gate, the sandbox,
    the new placement's own ready (published last) and the first one."""
    log = MemoryLog()
    world = await pipeline(log, tmp_path, node_id="n1")  # type: ignore[arg-type]
    sid = "sbx_victim"
    await world.built(SPEC, sid)
    for attempt in (1, 2):
        if attempt == 2:
            lost = events.UnitLost(node_id="n1", reason="lost", action="reschedule", attempt=1)
            await world.scheduler.publish(lost, aggregate_id=sid)
        placed = events.SandboxScheduled(node_id="n1", attempt=attempt)
        await world.scheduler.publish(placed, aggregate_id=sid)
        if attempt == 1:
            ready = events.SandboxReady(node_id="n1", pid=1, cgroup="/x")
            first = await world.nodeagent.publish(ready, aggregate_id=sid)
    for _ in range(copies):
        await log.publish(subject_for(events.SandboxReady.TYPE, sid), first.sealed.wire)
    gate = _gate(stack_root(tmp_path), log)
    state = await gate.lifecycle(sid)
    assert (state.state, state.attempt) == ("scheduled", 2)
    again = await world.nodeagent.publish(ready, aggregate_id=sid)  # the new placement's own
    return gate, sid, again.sealed.envelope, first


async def test_an_old_placements_ready_replayed_does_not_run_the_new_one(tmp_path: Path) -> None:
    """The first placement's genuine ``sandbox.ready``, published again after the sandbox was
    placed on the same node again, moved the new placement to ``running`` for every lifecycle
    reader: the node agent then never started it."""
    gate, sid, again, _ = await _placed_again_on_the_same_node(tmp_path, copies=1)
    state = await gate.lifecycle(sid)
    assert state.state == "running" and state.last_event_id == again.id


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


async def test_junk_ahead_of_a_revocation_hides_it_from_no_consumer() -> None:
    """Revocations were read from the first 32 messages of the key's revocation subject,
    junk included: 32 junk messages published first hid the operator's revocation from every
    consumer started afterwards, and the revoked key was admitted."""
    root, log = SigningKey.generate(), MemoryLog()
    operator = certified(root, "operator", subject="operator")
    stolen = certified(root, "scheduler")
    await _register(log, operator, stolen)
    for _ in range(40):
        await _put(log, subject_for(KeyRevoked.TYPE, stolen.signer.key_id), b"\x80")
    revoked = operator.signer.seal(
        KeyRevoked(key_id=stolen.signer.key_id, producer=stolen.signer.producer),
        aggregate_id=stolen.signer.key_id,
    )
    await _put(log, revoked.subject, revoked.wire)
    placed = stolen.signer.seal(SandboxScheduled(node_id="n1"), aggregate_id="sbx_b")
    seq = await _put(log, placed.subject, placed.wire)
    verdict = await _gate(root, log).admit(placed.wire, stream_seq=seq)
    assert isinstance(verdict, Refusal) and verdict.reason == "revoked-key"


async def test_copies_of_a_genuine_event_hide_no_later_one(tmp_path: Path) -> None:
    """300 copies of the first placement's genuine sandbox.ready (authentic, so they counted
    toward the readers' limit) hid the new placement's own ready from lifecycle and find."""
    gate, sid, again, _ = await _placed_again_on_the_same_node(tmp_path, copies=300)
    state = await gate.lifecycle(sid)
    assert state.state == "running" and state.last_event_id == again.id
    found = await gate.find(subject_for(events.SandboxReady.TYPE, sid))
    assert found is not None and found.id == again.id
