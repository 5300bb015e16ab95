"""Request ids a user cannot choose: a user's event id is a fresh UUIDv7 dated with its signing
time, so no user takes a service's predictable id first (another tenant's periodic snapshot,
refused as a replay) nor uses one of its own again on another kind of request (two answers under
one id, which `dsec audit verify` reports as tampering)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from dsec_core import events
from dsec_core.audit import Verifier
from dsec_core.bus import EventPublisher
from dsec_core.events import SnapshotRequested
from dsec_core.ids import new_sandbox_id
from dsec_core.settings import Settings
from dsec_core.trust import Refusal
from dsec_testing import trust
from dsec_testing.inmemory import MemoryLog, memory_gate, register_keys
from dsec_testing.trust import certified, pipeline, stack_root

pytestmark = pytest.mark.unit
SPEC = 'version: "1.2"\nname: agent\nbase: python:3.11\nentrypoint: [python, a.py]\n'


def _verify_finds_no_tampering(root: Any, log: MemoryLog) -> Any:
    """``dsec audit verify`` over the log (every signature checked): no finding; its report."""
    verifier = Verifier(bytes(root.verify_key), signature_every=1)
    for seq, _, data in log.records:
        verifier.feed(seq, data)
    report = verifier.finish()
    assert report.finding is None, f"audit verify: TAMPERING: {report.finding}"
    return report


async def _running_victim(log: MemoryLog, tmp_path: Path) -> tuple[str, Any]:
    """Tenant ``default``'s sandbox, running on node n1 (its genuine lifecycle)."""
    world = await pipeline(log, tmp_path, node_id="n1")  # type: ignore[arg-type]
    sid = new_sandbox_id()
    await world.built(SPEC, sid)
    await world.scheduler.publish(events.SandboxScheduled(node_id="n1"), aggregate_id=sid)
    ready = events.SandboxReady(node_id="n1", pid=1, cgroup="/x")
    await world.nodeagent.publish(ready, aggregate_id=sid)
    return sid, world


async def test_another_tenant_cannot_pre_claim_the_id_of_a_periodic_snapshot_request(
    tmp_path: Path,
) -> None:
    """The snapshot service asks for a running sandbox's periodic snapshot under a derived,
    predictable event id: ``derive_event_id(sid, "snapshot.requested#auto-<sid>-<second>")``
    (the sandbox id and the cadence are on the bus). Replay protection remembers
    ``<consumer>.<event id>`` whoever signed the event, so a user of another tenant publishes,
    ahead of time, its own ``snapshot.requested`` (about a sandbox of nobody) under each id of
    the next minutes; the genuine periodic requests are then refused as ``replayed`` by the
    owning node agent and by the snapshot service: the victim's sandbox gets no periodic
    snapshot at all."""
    from dsec_snapshot.periodic import PeriodicSnapshots

    root, log = stack_root(tmp_path), MemoryLog()
    sid, _ = await _running_victim(log, tmp_path)
    snapshot_service = certified(root, "snapshot")
    attacker = certified(root, "user", tenant="evil")
    await register_keys(log, snapshot_service, attacker)

    # what the periodic service will ask at `now` (its own code computes the id)
    asked: list[tuple[Any, str, str | None]] = []

    async def capture(payload: Any, aggregate_id: str, event_id: str | None) -> None:
        asked.append((payload, aggregate_id, event_id))

    periodic = PeriodicSnapshots(None, capture, interval_s=60.0, keep=3)  # type: ignore[arg-type]
    now = datetime(2026, 12, 7, 18, 30, 0, tzinfo=UTC)
    await periodic._ask_if_due(sid, [], now)
    (request, _, periodic_id) = asked[0]
    assert periodic_id is not None

    # the attacker, before: a request of its own tenant, about a sandbox that does not exist,
    # under the id the service will use (it would compute one per second of a window)
    squat = attacker.signer.seal(
        SnapshotRequested(name="x", requested_by="evil"),
        aggregate_id=new_sandbox_id(),
        event_id=periodic_id,
    )
    consumers = ("nodeagent-n1-snapshot-requested", "snapshot-snapshot-requested")
    gate = memory_gate(root, log)
    seq = (await log.publish(squat.subject, squat.wire, headers={"Nats-Msg-Id": "squat"})).seq
    for consumer in consumers:
        squatted = await gate.admit(squat.wire, stream_seq=seq, consumer=consumer)
        # a user's event ids are fresh UUIDv7s: a service's derived id is none of them
        assert isinstance(squatted, Refusal) and squatted.reason == "id-not-fresh", squatted

    # the genuine periodic request, later, as the snapshot service publishes it
    genuine = snapshot_service.signer.seal(
        request, aggregate_id=sid, event_id=periodic_id, tenant="default"
    )
    seq = (await log.publish(genuine.subject, genuine.wire)).seq
    for consumer in consumers:
        verdict = await gate.admit(genuine.wire, stream_seq=seq, consumer=consumer)
        # secure behaviour: another tenant's event cannot use up this request's id
        assert not isinstance(verdict, Refusal), f"{consumer}: {verdict}"
    # and `dsec audit verify` refuses the squat as every gate did: the service's own request
    # under that id is no replay it acted on (the C path and the Python path alike)
    for signature_every in (1, 256):
        verifier = Verifier(bytes(root.verify_key), signature_every=signature_every)
        for record_seq, _, data in log.records:
            verifier.feed(record_seq, data)
        report = verifier.finish()
        assert report.finding is None, report.finding
        assert [i.event_id for i in report.injected if "id-not-fresh" in i.reason] == [periodic_id]


async def _snapshot_service_and_a_user(tmp_path: Path) -> tuple[Any, MemoryLog, Any, Any, Any]:
    """A stack root, its log, the snapshot service's runtime (publishing as itself), a user of
    tenant ``evil`` and a gate reading the log."""
    from dsec_core.service import Service

    root, log = stack_root(tmp_path), MemoryLog()
    snap = certified(root, "snapshot")
    service = Service("snapshot", Settings(home=tmp_path))
    service.publisher = EventPublisher(log, snap.signer, certificate=snap.cert)  # type: ignore[arg-type]
    await service.publisher.register_key()
    user = await trust.publisher(log, tmp_path, "user", tenant="evil")  # type: ignore[arg-type]
    return root, log, service, user, memory_gate(root, log)


async def _rollback_under(user: Any, gate: Any, event_id: str) -> Any:
    """``user`` asks a rollback of a sandbox of nobody under ``event_id``; the rollback
    consumer's verdict."""
    sent = await user.publish(
        events.SnapshotRestoreRequested(snapshot="a"),
        aggregate_id=new_sandbox_id(),
        event_id=event_id,
    )
    return await gate.admit(
        sent.sealed.wire, stream_seq=sent.stream_seq, consumer="snapshot-snapshot-restore_requested"
    )


async def test_a_user_reusing_its_own_request_id_does_not_make_audit_verify_report_tampering(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replay protection remembers ``<consumer>.<id>``: an id already handled by one consumer
    is new to every other. A service derives its answer's id from the request's id and the
    answer's type only (``output_event_id``). A user asks the snapshot service for a snapshot
    of a sandbox that runs nowhere (``snapshot.requested``, id V: answered ``snapshot.failed``
    under ``f(V)``), waits out JetStream's 2-minute duplicate window, then asks a rollback
    (``snapshot.restore_requested``) under the same id V: another consumer, so it is admitted,
    and answered ``snapshot.failed`` under the same ``f(V)``. ``dsec audit verify`` sees the
    snapshot service emit one event id twice and reports TAMPERING ("its producer acted on a
    replay", exit 1). The first finding sticks: nothing after it is verified any more."""
    from dsec_snapstore.requests import failed

    root, log, service, user, gate = await _snapshot_service_and_a_user(tmp_path)
    sid = new_sandbox_id()  # no such sandbox: the snapshot service answers

    first = await user.publish(SnapshotRequested(name="a"), aggregate_id=sid)
    verdict = await gate.admit(
        first.sealed.wire, stream_seq=first.stream_seq, consumer="snapshot-snapshot-requested"
    )
    assert not isinstance(verdict, Refusal), verdict
    await service._publish_outputs(verdict, [failed("a", "create", "no sandbox")])

    log._ids.clear()  # JetStream's duplicate window (120 s) passes
    later = datetime.now(UTC) + timedelta(seconds=130)
    monkeypatch.setattr("dsec_core.signing.utcnow", lambda: later)

    # (about another sandbox of nobody: the handler's own `_answered` reads that sandbox's
    # history, where no answer to the id is)
    verdict2 = await _rollback_under(user, gate, first.sealed.id)
    # a user's event id is dated when it is made: used again on another request after the
    # duplicate window, it is refused by every consumer, so no service answers it twice
    assert isinstance(verdict2, Refusal) and verdict2.reason == "id-not-fresh", verdict2

    _verify_finds_no_tampering(root, log)


async def test_one_fresh_id_admits_one_message_for_every_consumer(tmp_path: Path) -> None:
    """The same attack within the id's freshness: a user stores two requests under one fresh
    id at once, with a ``Nats-Msg-Id`` of its own on the second (so JetStream stores both):
    of two kinds (two consumers), or of one kind about two sandboxes, taken by two services
    (the node agent and the snapshot service each consume ``snapshot.requested``). Replay
    protection per consumer let each take one: two answers under one id (``dsec audit
    verify``: TAMPERING, for ever, once they land 2 minutes apart), or one request's answer
    taken for the other's. The first consumer to admit one claims the id: every consumer
    admits that message alone. Answer ids are derived from the request's type as well."""
    from dsec_core.ids import output_event_id
    from dsec_snapstore.requests import failed

    root, log, service, user, gate = await _snapshot_service_and_a_user(tmp_path)
    first = await user.publish(SnapshotRequested(name="a"), aggregate_id=new_sandbox_id())
    log._ids.clear()  # (each with a Nats-Msg-Id of its own: JetStream stores them all)
    other_kind = await user.publish(
        events.SnapshotRestoreRequested(snapshot="a"),
        aggregate_id=new_sandbox_id(),
        event_id=first.sealed.id,
    )
    log._ids.clear()
    same_kind = await user.publish(
        SnapshotRequested(name="b"), aggregate_id=new_sandbox_id(), event_id=first.sealed.id
    )

    async def admit(sent: Any, consumer: str) -> Any:
        return await gate.admit(sent.sealed.wire, stream_seq=sent.stream_seq, consumer=consumer)

    # the snapshot service's consumer takes the third first; the node agent's, the first
    taken = await admit(same_kind, "snapshot-snapshot-requested")
    assert not isinstance(taken, Refusal), taken
    for sent, consumer in (
        (first, "nodeagent-n1-snapshot-requested"),
        (first, "snapshot-snapshot-requested"),
        (other_kind, "snapshot-snapshot-restore_requested"),
    ):
        refused = await admit(sent, consumer)
        assert isinstance(refused, Refusal) and refused.reason == "replayed", (consumer, refused)
        assert f"stream sequence {same_kind.stream_seq}" in refused.detail
    assert not isinstance(await admit(same_kind, "nodeagent-n1-snapshot-requested"), Refusal)
    await service._publish_outputs(taken, [failed("b", "create", "no sandbox")])

    _verify_finds_no_tampering(root, log)
    key = first.sealed.envelope.key_id
    answer = output_event_id(
        first.sealed.id, "snapshot.failed", input_type="snapshot.requested", key_id=key
    )
    assert answer != output_event_id(
        first.sealed.id, "snapshot.failed", input_type="snapshot.restore_requested", key_id=key
    )


async def test_another_users_message_under_a_copied_id_gets_no_request_refused(
    tmp_path: Path,
) -> None:
    """Users read every subject: a user of another tenant copies a request's fresh id onto a
    request of its own of another kind, taken first by an idle consumer. A claim on the id
    alone then had every consumer refuse the victim's request as a replay. Claims are per
    signing key."""
    _, log, _, user, gate = await _snapshot_service_and_a_user(tmp_path)
    victim = await trust.publisher(log, tmp_path, "user", tenant="default")  # type: ignore[arg-type]
    asked = await victim.publish(SnapshotRequested(name="a"), aggregate_id=new_sandbox_id())
    log._ids.clear()
    first = await _rollback_under(user, gate, asked.sealed.id)
    assert not isinstance(first, Refusal), first
    for consumer in ("snapshot-snapshot-requested", "nodeagent-n1-snapshot-requested"):
        verdict = await gate.admit(
            asked.sealed.wire, stream_seq=asked.stream_seq, consumer=consumer
        )
        assert not isinstance(verdict, Refusal), (consumer, verdict)


async def test_a_request_id_copied_by_another_tenant_onto_the_same_kind_refuses_nothing(
    tmp_path: Path,
) -> None:
    """Another tenant's user reads a request off the bus and sends a request of the same kind,
    for a sandbox of its own, under the same id (a raw publish under another ``Nats-Msg-Id``).
    A fair runtime admits a fetched batch at once, so the copy may pass its gate first.

    Before (found by an adversarial review, 2026-12-07): the consumer's replay record was
    ``<consumer>.<event id>``, whoever signed it, so it refused the victim's genuine, earlier
    request as a replay (12 of 12 victim specs never answered against the real policy service).
    Its answer ids were derived without the key too: answering both put two answers under one
    id, and JetStream dropped the second. Now both are admitted, each answered under an id of
    its own, and each answer is stored."""
    from dsec_core.ids import output_event_id
    from dsec_snapstore.requests import failed

    root, log, service, attacker, gate = await _snapshot_service_and_a_user(tmp_path)
    victim = await trust.publisher(log, tmp_path, "user", tenant="default")  # type: ignore[arg-type]
    asked = await victim.publish(SnapshotRequested(name="a"), aggregate_id=new_sandbox_id())
    log._ids.clear()  # (the copy under a Nats-Msg-Id of its own: stored too)
    copy = await attacker.publish(
        SnapshotRequested(name="a"), aggregate_id=new_sandbox_id(), event_id=asked.sealed.id
    )
    consumer = "snapshot-snapshot-requested"
    verdicts = []
    for sent in (copy, asked):  # the copy's gate finished first
        verdict = await gate.admit(sent.sealed.wire, stream_seq=sent.stream_seq, consumer=consumer)
        assert not isinstance(verdict, Refusal), verdict
        verdicts.append(verdict)
        await service._publish_outputs(verdict, [failed("a", "create", "no sandbox")])
    answers = {
        output_event_id(
            sent.sealed.id,
            "snapshot.failed",
            input_type="snapshot.requested",
            key_id=sent.sealed.envelope.key_id,
        )
        for sent in (copy, asked)
    }
    assert len(answers) == 2
    stored = {record[2] for record in log.records}
    assert sum(1 for data in stored if any(a.encode() in data for a in answers)) == 2
    # each is still one message for its consumer: a redelivery is no replay, a second copy is
    again = await gate.admit(asked.sealed.wire, stream_seq=asked.stream_seq, consumer=consumer)
    assert not isinstance(again, Refusal), again
    log._ids.clear()
    twice = await victim.publish(
        SnapshotRequested(name="b"), aggregate_id=new_sandbox_id(), event_id=asked.sealed.id
    )
    refused = await gate.admit(twice.sealed.wire, stream_seq=twice.stream_seq, consumer=consumer)
    assert isinstance(refused, Refusal) and refused.reason == "replayed", refused
    _verify_finds_no_tampering(root, log)


async def test_a_claim_no_such_message_backs_refuses_nothing(tmp_path: Path) -> None:
    """Every consumer may write the id claims. One written by a compromised consumer refuses
    nothing unless it names where the log holds an authentic event of the same key and id on
    its own subject: not an unrelated event, not the request's own bytes stored on another
    subject, not another key's event under that id."""
    _, log, _, user, gate = await _snapshot_service_and_a_user(tmp_path)
    other = await trust.publisher(log, tmp_path, "user", tenant="evil")  # type: ignore[arg-type]
    decoy = await user.publish(SnapshotRequested(name="x"), aggregate_id=new_sandbox_id())
    asked = await user.publish(SnapshotRequested(name="a"), aggregate_id=new_sandbox_id())
    copy = await log.publish("dsec.node.joined.n9", asked.sealed.wire)
    log._ids.clear()
    theirs = await other.publish(
        SnapshotRequested(name="b"), aggregate_id=new_sandbox_id(), event_id=asked.sealed.id
    )
    claim = f"id.{asked.sealed.envelope.key_id}.{asked.sealed.id}"
    for n, pointed in enumerate((decoy.stream_seq, copy.seq, theirs.stream_seq)):
        await log.handled.put(claim, str(pointed).encode())
        verdict = await gate.admit(
            asked.sealed.wire, stream_seq=asked.stream_seq, consumer=f"snapshot-{n}"
        )
        assert not isinstance(verdict, Refusal), (pointed, verdict)


async def test_a_message_stored_under_an_answered_requests_id_makes_verify_report_nothing(
    tmp_path: Path,
) -> None:
    """Anyone may store a message under an id read on the bus. Signed by a key never
    registered (or out of its chain), the verifier sets it aside, and it matched it to the
    answers by id alone: the genuine request's answer read as "an authentic event acted on the
    injected message", TAMPERING for ever, from one message of any tenant."""
    from dsec_snapstore.requests import failed

    root, log, service, user, gate = await _snapshot_service_and_a_user(tmp_path)
    asked = await user.publish(SnapshotRequested(name="a"), aggregate_id=new_sandbox_id())
    verdict = await gate.admit(
        asked.sealed.wire, stream_seq=asked.stream_seq, consumer="snapshot-snapshot-requested"
    )
    assert not isinstance(verdict, Refusal), verdict
    await service._publish_outputs(verdict, [failed("a", "create", "no sandbox")])
    stranger = certified(root, "user", tenant="other")  # its key never registered
    copy = stranger.signer.seal(
        SnapshotRequested(name="b"), aggregate_id=new_sandbox_id(), event_id=asked.sealed.id
    )
    await log.publish(copy.subject, copy.wire)

    report = _verify_finds_no_tampering(root, log)
    assert [i.event_id for i in report.injected] == [asked.sealed.id]


async def test_a_user_event_whose_time_is_not_a_time_is_refused_alike_and_stops_no_verify(
    tmp_path: Path,
) -> None:
    """A user's event signed with ``time`` a number (or no zone, or junk): the verifier parsed
    it to check the id's date and raised, so `dsec audit verify` never finished again. The
    gate and the verifier refuse it alike (malformed), and verify goes on."""
    from dsec_core import canonical
    from dsec_core.sigkeys import signed_bytes

    root, log = stack_root(tmp_path), MemoryLog()
    user = certified(root, "user", tenant="evil")
    await register_keys(log, user)
    gate = memory_gate(root, log)
    for bad in (1796667229, "2026-12-07T18:30:00", "not a time"):
        sealed = user.signer.seal(SnapshotRequested(name="a"), aggregate_id=new_sandbox_id())
        fields = dict(sealed.fields)
        fields["time"] = bad
        fields["sig"] = user.signer._key.sign(signed_bytes(fields)).signature.hex()
        wire = canonical.pack(canonical.canonicalize(fields))
        seq = (await log.publish(sealed.subject, wire)).seq
        refused = await gate.admit(wire, stream_seq=seq, consumer="snapshot-snapshot-requested")
        assert isinstance(refused, Refusal) and refused.reason == "malformed", (bad, refused)
    verifier = Verifier(bytes(root.verify_key), signature_every=1)
    for record_seq, _, data in log.records:
        verifier.feed(record_seq, data)
    report = verifier.finish()
    assert report.finding is None, report.finding
    # (the first breaks the user's chain: the next two are refused as out of its order too)
    assert len(report.injected) == 3 and "malformed: time" in report.injected[0].reason


async def test_an_answer_under_the_id_an_earlier_release_derived_is_still_found(
    tmp_path: Path,
) -> None:
    """Answer ids now include the request's type: a request redelivered across an upgrade,
    answered by the release before (its id from the request's id alone), is still answered,
    for the runtime and for the snapshot handlers alike, so it is not acted on twice."""
    from dsec_core.ids import derive_event_id
    from dsec_snapstore.requests import _answered, failed

    _, log, service, user, gate = await _snapshot_service_and_a_user(tmp_path)
    asked = await user.publish(SnapshotRequested(name="a"), aggregate_id=new_sandbox_id())
    request = await gate.admit(asked.sealed.wire, stream_seq=asked.stream_seq)
    assert not isinstance(request, Refusal), request
    assert service.publisher is not None
    await service.publisher.publish(
        failed("a", "create", "no sandbox"),
        aggregate_id=request.aggregate_id,
        event_id=derive_event_id(request.id, "snapshot.failed#0"),
        causation=request,
    )
    service.gate = gate
    assert await service._answered(request, asked.stream_seq, [events.SnapshotFailed])
    assert _answered(request, log.envelopes(), events.SnapshotFailed)
