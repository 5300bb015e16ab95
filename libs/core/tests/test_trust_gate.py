"""The trust gate on a real stream: hostile messages a consumer must refuse, never act on."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import nats
import pytest
from dsec_core.bus import ensure_stream
from dsec_core.envelope import Envelope, decode, encode
from dsec_core.events import KeyRevoked, SandboxStopRequested, SpecSubmitted
from dsec_core.ids import new_sandbox_id
from dsec_core.trust import Gate, KeyRing, Refusal, handled_bucket
from dsec_testing import trust
from nats.js import JetStreamContext

pytestmark = pytest.mark.integration


@pytest.fixture
async def stream(nats_url: str) -> AsyncIterator[tuple[object, JetStreamContext]]:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_stream(js)
    yield nc, js
    await nc.close()


async def _gate(stream, dsec_stack) -> Gate:  # type: ignore[no-untyped-def]
    nc, js = stream
    anchor = bytes(trust.stack_root(dsec_stack.home).verify_key)
    return Gate(KeyRing(nc, js, anchor), js, await handled_bucket(js))


def _setting(value: str):  # type: ignore[no-untyped-def]
    """The operator's ``cluster.config_set`` of one GPU temperature threshold."""
    from dsec_core.events import ClusterConfigSet

    return ClusterConfigSet(
        key="gpu.temperature_c", value=value, config={"gpu.temperature_c": value}
    )


async def _raw(js: JetStreamContext, subject: str, data: bytes) -> int:
    ack = await js.publish(subject, data, headers={"Nats-Msg-Id": uuid.uuid4().hex})
    return ack.seq


async def test_a_signed_message_posing_as_another_kind_is_refused(stream, dsec_stack) -> None:
    _, js = stream
    user = await trust.publisher(js, dsec_stack.home, "user", tenant="team-b")
    sealed = user.signer.seal(SandboxStopRequested(), aggregate_id=new_sandbox_id())
    # re-signed by the user itself with a bogus aggregate: the signature holds, the shape not
    fields = dict(sealed.fields)
    fields["aggregate"] = "zzz"
    from dsec_core.signing import signed_bytes

    fields["sig"] = user.signer._key.sign(signed_bytes(fields)).signature.hex()
    posed = Envelope.model_validate({**fields})
    seq = await _raw(js, sealed.subject, encode(posed))
    refused = await (await _gate(stream, dsec_stack)).admit(encode(posed), stream_seq=seq)
    assert isinstance(refused, Refusal) and refused.reason == "malformed"
    assert "aggregate 'zzz'" in refused.detail


async def test_a_genuine_event_copied_onto_another_subject_is_misrouted(stream, dsec_stack) -> None:
    _, js = stream
    user = await trust.publisher(js, dsec_stack.home, "user")
    sid = new_sandbox_id()
    genuine = await user.publish(SpecSubmitted(spec_yaml="x"), aggregate_id=sid)
    stop_subject = f"dsec.sandbox.{sid}.stop_requested"
    seq = await _raw(js, stop_subject, genuine.sealed.wire)
    refused = await (await _gate(stream, dsec_stack)).admit(
        genuine.sealed.wire,
        stream_seq=seq,
        consumer="t-stop",
        subject=stop_subject,
        event_type="sandbox.stop_requested",
    )
    assert isinstance(refused, Refusal) and refused.reason == "misrouted"


async def test_a_registration_filed_under_another_key_id_certifies_nothing(
    stream, dsec_stack
) -> None:
    _, js = stream
    user = await trust.publisher(js, dsec_stack.home, "user")
    alias = uuid.uuid4().hex[:16]
    registration = await js.get_last_msg(
        "DSEC_EVENTS", f"dsec.producer.{user.signer.key_id}.audit.key_registered"
    )
    await _raw(js, f"dsec.producer.{alias}.audit.key_registered", registration.data)
    sealed = user.signer.seal(SpecSubmitted(spec_yaml="x"), aggregate_id=new_sandbox_id())
    as_alias = decode(sealed.wire).model_copy(update={"key_id": alias})
    gate = await _gate(stream, dsec_stack)
    refused = await gate.admit(encode(as_alias), stream_seq=1)
    assert isinstance(refused, Refusal)
    assert refused.reason in {"unknown-key", "uncertified-key"}


async def test_an_unsigned_self_revocation_neither_recurses_nor_revokes(stream, dsec_stack) -> None:
    _, js = stream
    user = await trust.publisher(js, dsec_stack.home, "user")
    key_id = user.signer.key_id
    forged = user.signer.seal(
        KeyRevoked(key_id=key_id, producer=user.signer.producer), aggregate_id=key_id
    )
    await _raw(js, forged.subject, forged.wire)
    gate = await _gate(stream, dsec_stack)
    cert = await gate.keys.certificate(key_id)
    assert not isinstance(cert, str), cert


async def test_a_future_dated_event_is_refused(stream, dsec_stack) -> None:
    _, js = stream
    user = await trust.publisher(js, dsec_stack.home, "user")
    sealed = user.signer.seal(SpecSubmitted(spec_yaml="x"), aggregate_id=new_sandbox_id())
    fields = dict(sealed.fields)
    future = datetime.now(UTC) + timedelta(days=365)
    fields["time"] = future.isoformat()
    # (its id dated with it, as a client whose clock is a year ahead makes them)
    ms = f"{int(future.timestamp() * 1000):012x}"
    fields["id"] = f"{ms[:8]}-{ms[8:]}-7{sealed.envelope.id[15:]}"
    from dsec_core.signing import signed_bytes

    fields["sig"] = user.signer._key.sign(signed_bytes(fields)).signature.hex()
    wire = encode(Envelope.model_validate(fields))
    seq = await _raw(js, sealed.subject, wire)
    refused = await (await _gate(stream, dsec_stack)).admit(wire, stream_seq=seq, consumer="t-f")
    assert isinstance(refused, Refusal) and refused.reason == "future"


async def test_a_node_agent_speaks_only_for_sandboxes_scheduled_on_its_node(
    stream, dsec_stack
) -> None:
    from dsec_core.events import PolicyViolation, SandboxExited, SandboxScheduled

    _, js = stream
    home = dsec_stack.home
    user = await trust.publisher(js, home, "user")
    scheduler = await trust.publisher(js, home, "scheduler", acts_for="default")
    n1 = await trust.publisher(js, home, "nodeagent", node_id="n1", acts_for="default")
    n2 = await trust.publisher(js, home, "nodeagent", node_id="n2", acts_for="default")
    gate = await _gate(stream, dsec_stack)
    sid = new_sandbox_id()

    async def verdict(agent, payload) -> str | None:  # type: ignore[no-untyped-def]
        sent = await agent.publish(payload, aggregate_id=sid)
        admitted = await gate.admit(sent.sealed.wire, stream_seq=sent.stream_seq)
        return admitted.reason if isinstance(admitted, Refusal) else None

    violation = PolicyViolation(
        layer="kernel", rule_id="r", action="deny", operation="connect", target="x", message="m"
    )
    await user.publish(SpecSubmitted(spec_yaml="x"), aggregate_id=sid)
    assert await verdict(n1, violation) == "wrong-node"  # scheduled nowhere yet
    await scheduler.publish(SandboxScheduled(node_id="n1"), aggregate_id=sid)
    assert await verdict(n1, violation) is None
    assert await verdict(n2, violation) == "wrong-node"
    # rescheduled to n2 (n1 was lost): n1 may no longer speak for it, n2 may
    await scheduler.publish(
        SandboxScheduled(node_id="n2", attempt=2, previous_node="n1"), aggregate_id=sid
    )
    exited = SandboxExited(exit_code=0, reason="ok", duration_s=1.0)
    assert await verdict(n1, exited) == "wrong-node"
    assert await verdict(n2, violation) is None
    # a scheduled event signed by a node agent moves nothing
    forged = await n1.publish(SandboxScheduled(node_id="n1", attempt=3), aggregate_id=sid)
    refused = await gate.admit(forged.sealed.wire, stream_seq=forged.stream_seq)
    assert isinstance(refused, Refusal) and refused.reason == "unauthorized"
    assert await verdict(n1, exited) == "wrong-node"


async def test_a_replayed_placement_never_moves_a_sandbox_back_to_the_node_it_left(
    stream, dsec_stack
) -> None:
    """The bytes of the first, genuine ``sandbox.scheduled`` (to n1) published again after the
    sandbox moved to n2: authentic, but an older attempt. n2 keeps speaking for the sandbox;
    n1 (the node it left, perhaps fenced) still may not."""
    from dsec_core.events import SandboxExited, SandboxScheduled

    _, js = stream
    home = dsec_stack.home
    user = await trust.publisher(js, home, "user")
    scheduler = await trust.publisher(js, home, "scheduler", acts_for="default")
    n1 = await trust.publisher(js, home, "nodeagent", node_id="n1", acts_for="default")
    n2 = await trust.publisher(js, home, "nodeagent", node_id="n2", acts_for="default")
    sid = new_sandbox_id()
    await user.publish(SpecSubmitted(spec_yaml="x"), aggregate_id=sid)
    first = await scheduler.publish(SandboxScheduled(node_id="n1"), aggregate_id=sid)
    await scheduler.publish(
        SandboxScheduled(node_id="n2", attempt=2, previous_node="n1"), aggregate_id=sid
    )
    gate = await _gate(stream, dsec_stack)
    assert await gate.placement(sid) == "n2"
    await _raw(js, first.sealed.subject, first.sealed.wire)  # the replay
    fresh = await _gate(stream, dsec_stack)  # one that reads the whole history, replay included
    for g in (gate, fresh):
        assert await g.placement(sid) == "n2"
        exited = SandboxExited(exit_code=0, reason="ok", duration_s=1.0)
        by_n1 = await n1.publish(exited, aggregate_id=sid)
        refused = await g.admit(by_n1.sealed.wire, stream_seq=by_n1.stream_seq)
        assert isinstance(refused, Refusal) and refused.reason == "wrong-node"
        by_n2 = await n2.publish(exited, aggregate_id=sid)
        admitted = await g.admit(by_n2.sealed.wire, stream_seq=by_n2.stream_seq)
        assert not isinstance(admitted, Refusal)


async def test_only_the_scheduler_places_fences_or_drains(stream, dsec_stack) -> None:
    """A user picking its sandbox's node, a node agent of another node fencing the sandbox
    (``unit.lost``) or placing it, a user answering a drain, a user or node agent naming the
    sandbox's environment (``env.built``): each refused ``unauthorized``, and the sandbox stays
    where the scheduler put it."""
    from dsec_core.events import EnvBuilt, NodeCordoned, SandboxScheduled, UnitLost

    _, js = stream
    home = dsec_stack.home
    user = await trust.publisher(js, home, "user")
    scheduler = await trust.publisher(js, home, "scheduler", acts_for="default")
    n2 = await trust.publisher(js, home, "nodeagent", node_id="n2", acts_for="default")
    gate = await _gate(stream, dsec_stack)
    sid = new_sandbox_id()
    await user.publish(SpecSubmitted(spec_yaml="x"), aggregate_id=sid)
    await scheduler.publish(SandboxScheduled(node_id="n1"), aggregate_id=sid)
    lost = UnitLost(node_id="n1", reason="x", action="reschedule", attempt=1)
    hostile_env = EnvBuilt(
        lock_hash="other", fingerprint="f", object_key="envs/other.tar.zst", digest="d",
        size_bytes=1, reused=True,
    )  # fmt: skip
    attempts = [
        (user, SandboxScheduled(node_id="n2", attempt=2), sid),
        (n2, SandboxScheduled(node_id="n2", attempt=2), sid),
        (n2, lost, sid),
        (user, lost, sid),
        (user, NodeCordoned(node_id="n1", cordoned=True, draining=True), "n1"),
        # an environment of the user's choosing (another tenant's lock, a hostile archive)
        (user, hostile_env, sid),
        (n2, hostile_env, sid),
    ]
    for producer, payload, aggregate in attempts:
        sent = await producer.publish(payload, aggregate_id=aggregate)
        refused = await gate.admit(sent.sealed.wire, stream_seq=sent.stream_seq)
        assert isinstance(refused, Refusal) and refused.reason == "unauthorized", payload
    assert await gate.placement(sid) == "n1"


async def test_a_migration_moves_who_speaks_for_a_sandbox_and_only_its_ends_report_it(
    stream, dsec_stack
) -> None:
    """``unit.migrated`` from the target of an authentic ``unit.migration_started`` moves the
    sandbox there: the target speaks for it from then on, what the source said before stays
    authentic, and a node agent that is no end of the migration cannot report one."""
    from dsec_core.events import (
        SandboxExited,
        SandboxScheduled,
        UnitMigrated,
        UnitMigrationFailed,
        UnitMigrationStarted,
    )

    _, js = stream
    home = dsec_stack.home
    user = await trust.publisher(js, home, "user")
    scheduler = await trust.publisher(js, home, "scheduler", acts_for="default")
    n1 = await trust.publisher(js, home, "nodeagent", node_id="n1", acts_for="default")
    n2 = await trust.publisher(js, home, "nodeagent", node_id="n2", acts_for="default")
    n3 = await trust.publisher(js, home, "nodeagent", node_id="n3", acts_for="default")
    gate = await _gate(stream, dsec_stack)
    sid = new_sandbox_id()

    async def verdict(agent, payload) -> str | None:  # type: ignore[no-untyped-def]
        sent = await agent.publish(payload, aggregate_id=sid)
        admitted = await gate.admit(sent.sealed.wire, stream_seq=sent.stream_seq)
        return admitted.reason if isinstance(admitted, Refusal) else None

    await user.publish(SpecSubmitted(spec_yaml="x"), aggregate_id=sid)
    await scheduler.publish(SandboxScheduled(node_id="n1"), aggregate_id=sid)
    before_exit = await n1.publish(
        SandboxExited(exit_code=0, reason="ok", duration_s=1.0), aggregate_id=sid
    )
    ends = {"from_node": "n1", "to_node": "n3", "reason": "operator", "path": "criu"}
    moved = UnitMigrated(migration_id="m-1", interruption_ms=5.0, **ends)
    # no migration_started with that id: nobody may report it
    assert await verdict(n3, moved) == "wrong-node"
    await scheduler.publish(UnitMigrationStarted(migration_id="m-1", **ends), aggregate_id=sid)
    failed = UnitMigrationFailed(migration_id="m-1", from_node="n1", to_node="n3", reason="x")
    assert await verdict(n2, failed) == "unauthorized"  # authz: n2 is no end
    assert await verdict(n3, moved) is None
    exited = SandboxExited(exit_code=0, reason="ok", duration_s=1.0)
    assert await verdict(n3, exited) is None  # n3 speaks for it now
    assert await verdict(n1, exited) == "wrong-node"
    # the source's word from before the migration stays authentic
    again = await gate.admit(before_exit.sealed.wire, stream_seq=before_exit.stream_seq)
    assert not isinstance(again, Refusal)


async def test_a_flood_of_forged_settings_hides_no_newer_genuine_one(stream, dsec_stack) -> None:
    """Any user may store messages on ``cluster.config_set``'s subject (the operator's CLI
    connects as a user); 300 user-signed settings around the operator's must not hide it, nor
    a newer one of the operator's, from the readers that take the newest (node agents, the
    simulated fleet), which read only what came since the last time."""
    from dsec_core.gpuhealth import CONFIG_ID
    from dsec_core.subjects import subject_for

    _, js = stream
    home = dsec_stack.home
    user = await trust.publisher(js, home, "user")
    operator = await trust.publisher(js, home, "operator", subject="operator")
    gate = await _gate(stream, dsec_stack)
    subject = subject_for("cluster.config_set", CONFIG_ID)
    _, start = await gate.newest(subject)  # what earlier tests stored on it

    await operator.publish(_setting("84"), aggregate_id=CONFIG_ID)
    for _ in range(300):
        await user.publish(_setting("110"), aggregate_id=CONFIG_ID)
    found, read = await gate.newest(subject, after=start)
    assert found is not None and found.payload["value"] == "84"
    again, same = await gate.newest(subject, after=read)  # nothing new since
    assert (again, same) == (None, read)
    # the newest genuine setting is the default again: the session stack is shared
    await operator.publish(_setting("85"), aggregate_id=CONFIG_ID)
    await user.publish(_setting("110"), aggregate_id=CONFIG_ID)
    newer, _ = await gate.newest(subject, after=read)
    assert newer is not None and newer.payload["value"] == "85"


async def test_a_copy_of_an_older_setting_published_again_is_not_the_newest(
    stream, dsec_stack
) -> None:  # type: ignore[no-untyped-def]
    """Anyone may publish an authentic event's bytes again: a user republished the operator's
    older setting, and every reader of "the newest" took it as the one in force (node agents
    and the simulated fleet, reading only what came since, and `dsec cluster config show`,
    reading it all). Newest means signed last."""
    from dsec_core.gpuhealth import CONFIG_ID
    from dsec_core.subjects import subject_for

    _, js = stream
    operator = await trust.publisher(js, dsec_stack.home, "operator", subject="operator")
    gate = await _gate(stream, dsec_stack)
    subject = subject_for("cluster.config_set", CONFIG_ID)
    _, start = await gate.newest(subject)

    old = await operator.publish(_setting("84"), aggregate_id=CONFIG_ID)
    await operator.publish(_setting("85"), aggregate_id=CONFIG_ID)  # (the default: shared stack)
    in_force, read = await gate.newest(subject, after=start)
    assert in_force is not None and in_force.payload["value"] == "85"
    await _raw(js, subject, old.sealed.wire)  # the older one's bytes, stored again
    again, _ = await gate.newest(subject, after=read, than=in_force)
    assert again is None
    everything, _ = await gate.newest(subject)
    assert everything is not None and everything.id == in_force.id


async def test_a_setting_dated_ahead_is_not_the_newest_until_its_date(stream, dsec_stack) -> None:  # type: ignore[no-untyped-def]
    """The setting in force is the one signed last: one signed on a clock a year ahead would
    have stayed in force for a year, every correct-clock change after it ignored."""
    from dsec_core.gpuhealth import CONFIG_ID
    from dsec_core.signing import signed_bytes
    from dsec_core.subjects import subject_for

    _, js = stream
    operator = await trust.publisher(js, dsec_stack.home, "operator", subject="operator")
    gate = await _gate(stream, dsec_stack)
    subject = subject_for("cluster.config_set", CONFIG_ID)
    _, start = await gate.newest(subject)

    # (a publisher of its own, which publishes nothing after it: the session's log stays a
    # log whose every chain verifies)
    ahead = await trust.publisher(js, dsec_stack.home, "operator", subject="operator")
    sealed = ahead.signer.seal(_setting("70"), aggregate_id=CONFIG_ID)
    fields = dict(sealed.fields)
    fields["time"] = (datetime.now(UTC) + timedelta(days=365)).isoformat()
    fields["sig"] = ahead.signer._key.sign(signed_bytes(fields)).signature.hex()
    await _raw(js, subject, encode(Envelope.model_validate(fields)))
    await operator.publish(_setting("85"), aggregate_id=CONFIG_ID)  # (the default: shared stack)
    found, _ = await gate.newest(subject, after=start)
    assert found is not None and found.payload["value"] == "85"
