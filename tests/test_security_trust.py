"""Attacks on the bus, as an attacker with a plain nats-py client would try them: every consumer
verifies before it acts, answers what it refuses with ``security.event_rejected``, and
``dsec audit verify`` tells injected-and-ignored messages from tampering.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
from dsec_core import canonical, identity
from dsec_core.envelope import decode, encode
from dsec_core.events import (
    KeyRegistered,
    SandboxExited,
    SandboxStopRequested,
    SpecSubmitted,
    SpecValidated,
)
from dsec_core.ids import new_sandbox_id
from dsec_core.signing import Signer
from dsec_core.subjects import STREAM, filter_for, subject_for
from dsec_testing import trust
from dsec_testing.plans import minimal_plan
from nacl.signing import SigningKey
from nats.js import JetStreamContext

pytestmark = [pytest.mark.e2e]

VALIDATED = SpecValidated(name="x", spec_digest="d", plan=minimal_plan())
# What a forger would want a plan to say: any destination.
ANY_EGRESS = "security_policy:\n  network:\n    egress:\n      - {cidr: 0.0.0.0/0, ports: [443]}\n"

GOOD_SPEC = """\
version: "1.2"
name: trust-probe
base: dsec/python311:latest
entrypoint: [python, -c, "print('hi')"]
"""

BAD_SPEC = """\
version: "1.2"
name: Not_A_Valid_Name
base: dsec/python311:latest
"""


@pytest.fixture
async def js(nats_url: str) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_url)
    yield nc.jetstream()
    await nc.close()


async def _events(
    js: JetStreamContext, subject: str, start: int = 1
) -> list[tuple[int, dict[str, Any]]]:
    """Every message on ``subject`` so far, from stream seq ``start`` on: (stream seq, raw
    envelope fields or {})."""
    out: list[tuple[int, dict[str, Any]]] = []
    seq = start
    while True:
        try:
            msg = await js.get_msg(STREAM, seq=seq, subject=subject, next=True)
        except Exception:  # NotFoundError: nothing more on that subject
            return out
        try:
            fields = canonical.unpack(msg.data)
        except Exception:
            fields = {}
        out.append((msg.seq, fields if isinstance(fields, dict) else {}))
        seq = msg.seq + 1


async def _rejections(js: JetStreamContext, seq: int, timeout: float = 20.0) -> list[dict]:
    """The ``security.event_rejected`` answers to the message at ``seq`` (waits for one)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [  # (an answer comes after what it answers: the session's earlier are skipped)
            f["payload"]
            for _, f in await _events(js, filter_for("security.event_rejected"), start=seq)
            if f.get("payload", {}).get("stream_seq") == seq
        ]
        if found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.1)


async def _answers_of(js: JetStreamContext, seq: int, consumer: str) -> list[dict]:
    """The answers of one consumer to the message at ``seq`` (waits for one)."""
    deadline = time.monotonic() + 20.0
    while True:
        found = [a for a in await _rejections(js, seq) if a["consumer"] == consumer]
        if found or time.monotonic() > deadline:
            return found
        await asyncio.sleep(0.1)


async def _wait_type(js: JetStreamContext, event_type: str, sid: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = await _events(js, subject_for(event_type, sid))
        if found:
            return found
        await asyncio.sleep(0.1)
    return []


async def _raw(js: JetStreamContext, subject: str, data: bytes) -> int:
    ack = await js.publish(subject, data, headers={"Nats-Msg-Id": uuid.uuid4().hex})
    return ack.seq


async def _quiet(js: JetStreamContext, subject: str, seconds: float = 1.5) -> bool:
    """True when nothing arrives on ``subject`` within ``seconds`` after everything before
    it was handled (the caller waited for the rejection first)."""
    await asyncio.sleep(seconds)
    return not await _events(js, subject)


async def test_forged_and_unauthorized_specs_are_refused_and_verify_tells_the_story(
    services, js, dsec_stack, dsec_cli, stack_env
) -> None:
    services.start("policy", "builder")
    home = dsec_stack.home

    # 1. bytes that are no envelope
    sid = new_sandbox_id()
    garbage = await _raw(js, subject_for("spec.submitted", sid), b"\x93not an envelope")
    (answer,) = await _rejections(js, garbage)
    assert answer["reason"] == "malformed" and answer["consumer"] == "policy-spec-submitted"

    # 2. a producer that registered its own key ("policy-replica"): no certificate, no trust
    rogue = Signer("policy-replica", SigningKey.generate())
    reg = KeyRegistered(
        producer=rogue.producer, key_id=rogue.key_id, public_key=rogue.public_raw.hex()
    )
    await _raw(
        js, subject_for(reg.TYPE, rogue.key_id), rogue.seal(reg, aggregate_id=rogue.key_id).wire
    )
    forged = rogue.seal(
        SpecValidated(name="x", spec_digest="d", plan=minimal_plan(body=ANY_EGRESS)),
        aggregate_id=sid,
    )
    seq_forged = await _raw(js, forged.subject, forged.wire)
    (answer,) = await _rejections(js, seq_forged)
    assert answer["reason"] == "uncertified-key", answer
    assert answer["consumer"] == "builder-spec-validated"

    # 3. a certified producer emitting a type it may not: the builder "submitting" a spec
    builder_like = await trust.publisher(js, home, "builder", subject="builder")
    wrong = await builder_like.publish(
        SpecSubmitted(spec_yaml=GOOD_SPEC), aggregate_id=new_sandbox_id()
    )
    (answer,) = await _rejections(js, wrong.stream_seq)
    assert answer["reason"] == "unauthorized" and "may not emit spec.submitted" in answer["detail"]

    # 4. a genuine submission is validated; its bytes replayed under a new message id are not
    user = await trust.publisher(js, home, "user")
    good_sid = new_sandbox_id()
    genuine = await user.publish(SpecSubmitted(spec_yaml=BAD_SPEC), aggregate_id=good_sid)
    assert await _wait_type(js, "spec.rejected", good_sid)
    replayed = await _raw(js, genuine.sealed.subject, genuine.sealed.wire)
    (answer,) = await _rejections(js, replayed)
    assert answer["reason"] == "replayed", answer
    assert len(await _events(js, subject_for("spec.rejected", good_sid))) == 1

    # 5. after the real rejection, a spec.validated with a random signature claiming the
    #    policy service's key: the builder never builds it
    policy_key = identity.read_cert(identity.TrustPaths(home).cert("policy")).key_id
    template = decode(genuine.sealed.wire)
    fake = template.model_copy(
        update={
            "id": str(uuid.uuid4()),
            "type": "spec.validated",
            "subject": subject_for("spec.validated", good_sid),
            "producer": "policy",
            "key_id": policy_key,
            "payload": SpecValidated(name="x", spec_digest="d", plan=minimal_plan()).model_dump(
                mode="json"
            ),
            "sig": "ab" * 64,
        }
    )
    seq_fake = await _raw(js, fake.subject, encode(fake))
    (answer,) = await _rejections(js, seq_fake)
    assert answer["reason"] == "bad-signature", answer
    assert await _quiet(js, subject_for("deps.resolved", good_sid))

    # verify: the trail is intact; each injected message is listed with the refusal that
    # answered it
    result = dsec_cli("audit", "verify", "--json", env=stack_env)
    report = result.last_json()
    assert result.exit_code == 0, result.output
    injected = {i["seq"]: i for i in report["injected"]}
    for seq in (garbage, seq_forged, wrong.stream_seq, replayed, seq_fake):
        assert seq in injected, (seq, report["injected"])
        assert injected[seq]["answered_by"], injected[seq]
    assert injected[replayed]["reason"].startswith("replayed")
    human = dsec_cli("audit", "verify", env=stack_env)
    assert "injected and ignored" in human.output

    # the refusals are counted on /metrics
    metrics = (
        urllib.request.urlopen(services.url("builder") + "/metrics", timeout=5).read().decode()
    )
    assert 'dsec_events_rejected_total{reason="uncertified-key",service="builder"' in metrics


async def test_only_the_owning_tenant_may_stop_a_sandbox(
    services, js, dsec_stack, dsec_cli, stack_env, tmp_path
) -> None:
    services.start("policy", "builder", "nodeagent")
    # periodic snapshots: the snapshot service then consumes sandbox.ready / sandbox.exited
    services.start("snapshot", env={"DSEC_SNAPSHOT_INTERVAL_S": "600"})
    home = dsec_stack.home
    spec = GOOD_SPEC.replace("print('hi')", "import time; time.sleep(60)").replace(
        "trust-probe", "long-runner"
    )
    spec_file = tmp_path / "dsec.yaml"
    spec_file.write_text(spec)
    result = dsec_cli(
        "submit", str(spec_file), "--wait", "ready", "--stall", "90", "--json", env=stack_env
    )
    assert result.exit_code == 0, result.output
    sid = result.last_json()["sandbox_id"]

    # another tenant's user, properly certified, asks to stop it
    other = await trust.publisher(js, home, "user", tenant="team-b")
    stop = await other.publish(SandboxStopRequested(requested_by="eve"), aggregate_id=sid)
    answers = await _answers_of(js, stop.stream_seq, "nodeagent-node-1-sandbox-stop_requested")
    assert [a["reason"] for a in answers] == ["cross-tenant"], answers

    # an unsigned stop (a raw envelope without a valid signature)
    fake = decode(stop.sealed.wire).model_copy(
        update={"id": str(uuid.uuid4()), "tenant": "default", "sig": "00" * 64}
    )
    seq_fake = await _raw(js, fake.subject, encode(fake))
    (answer,) = await _answers_of(js, seq_fake, "nodeagent-node-1-sandbox-stop_requested")
    assert answer["reason"] in {"bad-signature", "unknown-key"}, answer
    assert not await _events(js, subject_for("sandbox.exited", sid))

    # the owner stops it
    stopped = dsec_cli("sandbox", "stop", sid, "--grace", "1", env=stack_env)
    assert stopped.exit_code == 0, stopped.output
    exited = await _wait_type(js, "sandbox.exited", sid)
    assert exited and exited[0][1]["payload"]["reason"] == "stopped"

    # the node agent of another node claims it ended: it is not placed there
    elsewhere = await trust.publisher(js, home, "nodeagent", node_id="n2", acts_for="default")
    claim = await elsewhere.publish(
        SandboxExited(exit_code=0, reason="ok", duration_s=1.0), aggregate_id=sid
    )
    (answer,) = await _answers_of(js, claim.stream_seq, "snapshot-sandbox-exited")
    assert answer["reason"] == "wrong-node", answer
    assert "scheduled on 'node-1', not on 'n2'" in answer["detail"]
    verify = dsec_cli("audit", "verify", "--json", env=stack_env)
    assert verify.exit_code == 0, verify.output


def test_every_service_starts_on_its_own_certificate_and_nats_rights(services) -> None:
    """Each service signs with a key the stack's root certified and connects with its own NATS
    identity (its durable consumers and their replay-bucket keys only)."""
    services.start("policy", "builder", "snapshot", "scheduler", "nodeagent")
    for name in ("policy", "builder", "snapshot", "scheduler", "nodeagent"):
        health = urllib.request.urlopen(services.url(name) + "/healthz", timeout=5).read()
        assert b'"status": "ok"' in health, (name, health)
