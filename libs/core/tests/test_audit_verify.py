"""The audit verifier tells tampering (a finding) from injected-and-ignored messages (pure)."""

from __future__ import annotations

import pytest
from dsec_core import canonical
from dsec_core.audit import SIGNATURE_EVERY, Verifier, verify_stream
from dsec_core.envelope import decode, encode
from dsec_core.events import (
    EventRejected,
    KeyRegistered,
    KeyRevoked,
    SandboxExited,
    SpecSubmitted,
    SpecValidated,
)
from dsec_core.signing import Signer, envelope_hash
from dsec_testing.plans import minimal_plan
from dsec_testing.trust import Producer, certified
from nacl.signing import SigningKey

pytestmark = pytest.mark.unit

VALIDATED = SpecValidated(name="x", spec_digest="d", plan=minimal_plan())

ROOT = SigningKey.generate()
ANCHOR = bytes(ROOT.verify_key)


def _log(producer: Producer, n: int = 3, prefix: str = "sbx") -> list[bytes]:
    wires = [producer.registration()]
    for i in range(n):
        wires.append(
            producer.signer.seal(
                SpecSubmitted(spec_yaml=f"v{i}"), aggregate_id=f"{prefix}_{i}"
            ).wire
        )
    return wires


def _agent_log(n: int = 3) -> tuple[Producer, list[bytes]]:
    """A node agent's chain (a service: a break in it is tampering, not a client's mistake)."""
    agent = certified(ROOT, "nodeagent", node_id="n1")
    wires = [agent.registration()]
    for i in range(n):
        exited = SandboxExited(exit_code=0, reason="ok", duration_s=float(i))
        wires.append(agent.signer.seal(exited, aggregate_id=f"sbx_{i}").wire)
    return agent, wires


def _numbered(wires: list[bytes], first: int = 1) -> list[tuple[int, bytes]]:
    return list(enumerate(wires, start=first))


def _user(tenant: str = "default") -> Producer:
    return certified(ROOT, "user", tenant=tenant)


def _validated(policy: Producer, sandbox: str, tenant: str = "default") -> bytes:
    payload = SpecValidated(name="x", spec_digest="d", plan=minimal_plan())
    return policy.signer.seal(payload, aggregate_id=sandbox, tenant=tenant).wire


def test_intact_log_verifies() -> None:
    a, b = _user(), _user("team-b")
    wires = _log(a) + _log(b, prefix="sbb")
    report = verify_stream(_numbered(wires), ANCHOR)
    assert report.ok, report.finding
    assert report.events == 8 and not report.injected
    assert report.producers == {a.signer.producer, b.signer.producer}


def test_without_the_root_nothing_is_trusted() -> None:
    report = verify_stream(_numbered(_log(_user())), None)
    assert report.ok and report.events == 0
    assert [i.reason.split(":")[0] for i in report.injected] == ["uncertified-key"] + [
        "unknown-key"
    ] * 3


def test_self_registered_producer_is_injected_not_trusted() -> None:
    """A key registered by itself (no root certificate) is never a producer: its events are
    listed as injected, and verify still passes when nobody acted on them."""
    user = _user()
    rogue = Signer("policy-replica", SigningKey.generate())
    reg = KeyRegistered(
        producer=rogue.producer, key_id=rogue.key_id, public_key=rogue.public_raw.hex()
    )
    wires = [*_log(user, n=1), rogue.seal(reg, aggregate_id=rogue.key_id).wire]
    wires.append(
        rogue.seal(
            SpecValidated(name="x", spec_digest="d", plan=minimal_plan()), aggregate_id="sbx_0"
        ).wire
    )
    report = verify_stream(_numbered(wires), ANCHOR)
    assert report.ok, report.finding
    assert [(i.stream_seq, i.reason.split(":")[0]) for i in report.injected] == [
        (3, "uncertified-key"),
        (4, "unknown-key"),
    ]


def test_certificate_from_another_root_is_refused() -> None:
    other = certified(SigningKey.generate(), "policy")
    report = verify_stream(_numbered([*_log(_user(), n=1), other.registration()]), ANCHOR)
    assert report.ok
    assert "not by the operator root" in report.injected[0].reason


def test_unsigned_forgery_with_a_random_signature_is_injected_and_answered() -> None:
    user, policy = _user(), certified(ROOT, "policy")
    wires = [*_log(user, n=1), policy.registration(), _validated(policy, "sbx_0")]
    forged = decode(_validated(policy, "sbx_0"))
    wires.append(encode(forged.model_copy(update={"sig": "00" * 64})))
    answer = EventRejected(
        stream_seq=5, subject="s", consumer="builder-spec-validated", reason="bad-signature"
    )
    builder = certified(ROOT, "builder")
    wires += [builder.registration(), builder.signer.seal(answer, aggregate_id="x").wire]
    report = verify_stream(_numbered(wires), ANCHOR)
    assert report.ok, report.finding
    (injected,) = report.injected
    assert injected.stream_seq == 5 and injected.reason.startswith("bad-signature")
    assert injected.answered_by == [7]


def test_an_injected_message_someone_acted_on_is_tampering() -> None:
    user, policy = _user(), certified(ROOT, "policy")
    policy_reg = policy.registration()
    rogue = Signer("user-x", SigningKey.generate())
    forged = rogue.seal(SpecSubmitted(spec_yaml="evil"), aggregate_id="sbx_9")
    acted = policy.signer.seal(
        SpecValidated(name="x", spec_digest="d", plan=minimal_plan()),
        aggregate_id="sbx_9",
        causation=forged.envelope,
    )
    wires = [*_log(user, n=1), policy_reg, forged.wire, acted.wire]
    report = verify_stream(_numbered(wires), ANCHOR)
    assert report.finding is not None
    assert report.finding.stream_seq == 5
    assert "acted on the injected message at seq 4" in report.finding.reason


def test_wrong_producer_for_the_type_is_injected() -> None:
    user = _user()
    wires = [*_log(user, n=1), _validated(user, "sbx_0")]  # a user may not validate specs
    report = verify_stream(_numbered(wires), ANCHOR)
    assert report.ok
    assert report.injected[0].reason.startswith("unauthorized: role 'user' may not emit")


def test_user_acting_for_another_tenant_is_injected() -> None:
    victim, attacker = _user("team-a"), _user("team-b")
    wires = [*_log(victim, n=1), attacker.registration()]
    stop = attacker.signer.seal(
        SandboxExited(exit_code=0, reason="ok", duration_s=1), aggregate_id="sbx_0"
    )
    wires.append(stop.wire)
    submit = attacker.signer.seal(SpecSubmitted(spec_yaml="x"), aggregate_id="sbx_0")
    wires.append(submit.wire)
    report = verify_stream(_numbered(wires), ANCHOR)
    assert report.ok
    reasons = [i.reason.split(":")[0] for i in report.injected]
    assert reasons == ["unauthorized", "aggregate-exists"]


def test_replayed_copy_of_an_old_event_is_injected() -> None:
    user = _user()
    wires = _log(user)
    wires.append(wires[1])
    report = verify_stream(_numbered(wires), ANCHOR)
    assert report.ok, report.finding
    assert report.injected[0].stream_seq == 5
    assert report.injected[0].reason.startswith("replayed: copy of the event at seq 2")


def test_a_producer_that_emits_an_event_id_again_acted_on_a_replay() -> None:
    user, policy = _user(), certified(ROOT, "policy")
    policy_reg = policy.registration()
    payload = SpecValidated(name="x", spec_digest="d", plan=minimal_plan())
    first = policy.signer.seal(payload, aggregate_id="sbx_0", event_id="e-1", tenant="default")
    again = policy.signer.seal(payload, aggregate_id="sbx_0", event_id="e-1", tenant="default")
    wires = [*_log(user, n=1), policy_reg, first.wire, again.wire]
    report = verify_stream(_numbered(wires), ANCHOR)
    assert report.finding is not None and report.finding.stream_seq == 5
    assert "acted on a replay" in report.finding.reason


def test_revoked_key_is_refused_after_its_revocation() -> None:
    user, operator = _user(), certified(ROOT, "operator", subject="operator")
    operator_reg = operator.registration()
    revoke = operator.signer.seal(
        KeyRevoked(key_id=user.signer.key_id, producer=user.signer.producer),
        aggregate_id=user.signer.key_id,
    )
    wires = [*_log(user, n=1), operator_reg, revoke.wire]
    wires.append(user.signer.seal(SpecSubmitted(spec_yaml="late"), aggregate_id="sbx_5").wire)
    report = verify_stream(_numbered(wires), ANCHOR)
    assert report.ok
    assert report.injected[0].reason.startswith("revoked-key")


def test_altered_payload_is_tampering_named_at_the_altered_event() -> None:
    _, wires = _agent_log()
    env = decode(wires[2])
    wires[2] = encode(env.model_copy(update={"payload": {**env.payload, "exit_code": 1}}))
    report = verify_stream(_numbered(wires), ANCHOR)
    assert report.finding is not None
    assert (report.finding.stream_seq, report.finding.event_id) == (3, env.id)
    assert "this event was altered" in report.finding.reason


def test_broken_chain_is_named() -> None:
    _, wires = _agent_log(n=4)
    del wires[2]  # an event of the chain never reached the log
    report = verify_stream(_numbered(wires), ANCHOR)
    assert report.finding is not None
    assert report.finding.stream_seq == 3
    assert "broken: expected position 2, found 3" in report.finding.reason


def test_a_users_own_broken_chain_is_listed_not_tampering() -> None:
    """A certified user's client may skip or reuse its own positions: its events are listed,
    and the trail still verifies (one user cannot make verification fail forever)."""
    user = _user()
    wires = _log(user, n=4)
    del wires[2]
    report = verify_stream(_numbered(wires), ANCHOR)
    assert report.ok, report.finding
    assert any("out of its chain's order" in i.reason for i in report.injected)


def test_sequence_gap_is_named() -> None:
    numbered = _numbered(_log(_user()))
    del numbered[1]
    report = verify_stream(numbered, ANCHOR)
    assert report.finding is not None and report.finding.reason == "gap: sequence 2 missing"


def test_malformed_bytes_are_injected() -> None:
    wires = [*_log(_user(), n=1), b"\xc1garbage", canonical.pack({"id": 1})]
    report = verify_stream(_numbered(wires), ANCHOR)
    assert report.ok
    assert [i.reason.split(":")[0] for i in report.injected] == ["malformed", "malformed"]


def test_an_envelope_without_prev_is_malformed_not_a_crash() -> None:
    user = _user()
    wires = _log(user, n=1)
    fields = canonical.unpack(
        user.signer.seal(SpecSubmitted(spec_yaml="x"), aggregate_id="sbx_p").wire
    )
    del fields["prev"]
    report = verify_stream(_numbered([*wires, canonical.pack(fields)]), ANCHOR)
    assert report.ok
    assert [i.reason for i in report.injected] == ["malformed: invalid envelope field prev"]


def _relink_from(wires: list[bytes], index: int) -> None:
    """Alter event ``index`` and re-link every later one (without the key: signatures fail)."""
    env = decode(wires[index])
    wires[index] = encode(env.model_copy(update={"payload": {**env.payload, "exit_code": 9}}))
    for j in range(index + 1, len(wires)):
        later = decode(wires[j])
        wires[j] = encode(later.model_copy(update={"prev": envelope_hash(wires[j - 1])}))


def test_forged_events_in_a_long_chain_are_set_aside_before_the_end() -> None:
    agent, wires = _agent_log(n=SIGNATURE_EVERY + 50)
    _relink_from(wires, 10)
    real = SandboxExited(exit_code=0, reason="ok", duration_s=1.0)
    wires.append(agent.signer.seal(real, aggregate_id="sbx_z").wire)
    verifier = Verifier(ANCHOR)
    finding = None
    for seq, wire in _numbered(wires):
        finding = verifier.feed(seq, wire)
        if finding is not None:
            break
    # The producer's genuine last event links to bytes the log no longer holds: tampering,
    # named at the first altered event.
    assert finding is not None and finding.stream_seq == 11, finding
    assert verifier.report.events == 10


def test_signature_interval_must_be_positive_and_a_full_check_agrees() -> None:
    with pytest.raises(ValueError, match="signature_every must be >= 1, got 0"):
        Verifier(ANCHOR, 0)
    _, wires = _agent_log(n=5)
    env = decode(wires[3])
    wires[3] = encode(env.model_copy(update={"payload": {**env.payload, "exit_code": 7}}))
    lazy = verify_stream(_numbered(wires), ANCHOR)
    full = verify_stream(_numbered(wires), ANCHOR, signature_every=1)
    assert lazy.finding is not None and full.finding is not None
    assert lazy.finding.stream_seq == full.finding.stream_seq == 4


def test_a_forgery_on_a_fresh_chain_citing_an_injected_cause_is_not_tampering() -> None:
    """Two injected messages (one citing the other as its cause, claiming a certified
    producer's key on a new chain) must not make verification fail: the forgery's claims are
    set aside with it."""
    user, policy = _user(), certified(ROOT, "policy")
    policy_reg = policy.registration()
    junk = Signer("user-x", SigningKey.generate()).seal(
        SpecSubmitted(spec_yaml="x"), aggregate_id="sbx_j"
    )
    fake = Signer("policy", SigningKey.generate()).seal(
        SpecValidated(name="x", spec_digest="d", plan=minimal_plan()),
        aggregate_id="sbx_j",
        causation=junk.envelope,
    )
    forged = encode(decode(fake.wire).model_copy(update={"key_id": policy.signer.key_id}))
    wires = [*_log(user, n=1), policy_reg, junk.wire, forged]
    report = verify_stream(_numbered(wires), ANCHOR)
    assert report.ok, report.finding
    assert {i.stream_seq for i in report.injected} == {4, 5}


def test_a_message_posing_as_another_kind_is_malformed() -> None:
    user = _user()
    wires = _log(user, n=1)
    stop = decode(user.signer.seal(SpecSubmitted(spec_yaml="x"), aggregate_id="sbx_a").wire)
    posed = encode(stop.model_copy(update={"aggregate": "zzz"}))
    report = verify_stream(_numbered([*wires, posed]), ANCHOR)
    assert report.ok
    assert report.injected[0].reason.startswith("malformed: aggregate 'zzz'")


def test_a_replayed_placement_is_injected_and_the_new_node_is_not_blamed() -> None:
    """The first ``sandbox.scheduled`` (to n1) copied into the log after the sandbox moved to
    n2: verify lists the copy as injected, and n2's later event is no tampering (the copy is
    not taken for the latest placement); n1 speaking afterwards is listed as injected."""
    from dsec_core.events import SandboxScheduled

    user = _user()
    scheduler = certified(ROOT, "scheduler")
    n1, n2 = certified(ROOT, "nodeagent", node_id="n1"), certified(ROOT, "nodeagent", node_id="n2")
    sid = "sbx_moved"

    def sealed(producer: Producer, payload: object) -> bytes:
        return producer.signer.seal(payload, aggregate_id=sid, tenant="default").wire  # type: ignore[arg-type]

    wires = [p.registration() for p in (user, scheduler, n1, n2)]
    first = sealed(scheduler, SandboxScheduled(node_id="n1"))
    wires += [
        user.signer.seal(SpecSubmitted(spec_yaml="x"), aggregate_id=sid).wire,
        first,
        sealed(scheduler, SandboxScheduled(node_id="n2", attempt=2, previous_node="n1")),
        first,  # the replay, at seq 8
        sealed(n2, SandboxExited(exit_code=0, reason="ok", duration_s=1.0)),
    ]
    report = verify_stream(_numbered(wires), ANCHOR)
    assert report.ok, report.finding
    assert [i.stream_seq for i in report.injected] == [8]
    stale = sealed(n1, SandboxExited(exit_code=0, reason="ok", duration_s=1.0))
    report = verify_stream(_numbered([*wires, stale]), ANCHOR)
    assert report.ok, report.finding  # nobody may act on it: listed, not tampering
    assert [(i.stream_seq, i.reason) for i in report.injected][1:] == [
        (10, "unauthorized: node agent of 'n1' spoke for a sandbox of node 'n2'")
    ]


def test_the_types_the_verifier_names_are_the_models_types() -> None:
    """The verifier names a few types by literal (it does not load their models)."""
    from dsec_core import audit
    from dsec_core.events import EventRejected, SpecSubmitted, UnitMigrated, UnitMigrationFailed

    assert audit._EVENT_REJECTED == EventRejected.TYPE
    assert audit._SPEC_SUBMITTED == SpecSubmitted.TYPE
    assert audit._SANDBOX == SpecSubmitted.AGGREGATE
    assert audit._UNIT_MIGRATED == UnitMigrated.TYPE
    assert audit._UNIT_MIGRATION_FAILED == UnitMigrationFailed.TYPE
