"""`dsec audit verify` on a real stream: intact logs pass; each forgery is named.

Each test gets a private NATS server (its own stream), because a forged event stays in the
log forever — that is the point of the log.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from dsec_core import canonical
from dsec_core.bus import EventPublisher, ensure_stream
from dsec_core.events import SandboxExited, SpecSubmitted
from dsec_core.signing import Signer
from dsec_testing import trust
from dsec_testing.stack import StackFixture
from nacl.signing import SigningKey
from nats.js import JetStreamContext

pytestmark = pytest.mark.integration


@pytest.fixture
def private_home(tmp_path: Path) -> Path:
    return tmp_path / "home"


@pytest.fixture
def private_nats(private_home: Path) -> Iterator[str]:
    fixture = StackFixture(private_home)
    try:
        yield fixture.nats_url
    finally:
        fixture.close()


@pytest.fixture
async def js(private_nats: str) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(private_nats)
    js = nc.jetstream()
    await ensure_stream(js)
    yield js
    await nc.close()


async def _legit(js: JetStreamContext, home: Path, tenant: str = "default") -> EventPublisher:
    publisher = await trust.publisher(js, home, "user", tenant=tenant, subject=f"user-{tenant}")
    for i in range(3):
        await publisher.publish(SpecSubmitted(spec_yaml=f"v{i}"), aggregate_id=f"sbx_{tenant}_{i}")
    return publisher


async def _agent(js: JetStreamContext, home: Path) -> EventPublisher:
    """A node agent's publisher: a service, whose broken chain is tampering."""
    return await trust.publisher(js, home, "nodeagent", node_id="n1")


def _verify(dsec_cli, url: str, home: Path, tmp_path: Path) -> tuple[int, dict]:
    anchor = bytes(trust.stack_root(home).verify_key).hex()
    env = {"DSEC_NATS_URL": url, "DSEC_HOME": str(tmp_path / "cli"), "DSEC_TRUST_ROOT": anchor}
    result = dsec_cli("audit", "verify", "--json", env=env)
    return result.exit_code, result.last_json()


async def _raw_publish(js: JetStreamContext, subject: str, wire: bytes) -> int:
    ack = await js.publish(subject, wire, headers={"Nats-Msg-Id": uuid.uuid4().hex})
    return ack.seq


async def test_intact_log_verifies(js, private_nats, private_home, dsec_cli, tmp_path) -> None:
    await _legit(js, private_home, "alpha")
    await _legit(js, private_home, "beta")
    code, result = _verify(dsec_cli, private_nats, private_home, tmp_path)
    assert code == 0, result
    assert result["ok"] and result["events"] == 8 and result["injected"] == []
    assert result["producers"] == ["user-alpha", "user-beta"]


async def test_event_signed_with_an_uncertified_key_is_listed_as_injected(
    js, private_nats, private_home, dsec_cli, tmp_path, verifier_kind
) -> None:
    await _legit(js, private_home)
    impostor = Signer("user-default", SigningKey.generate(), tenant="default")
    forged = impostor.seal(
        SandboxExited(exit_code=0, reason="ok", duration_s=1), aggregate_id="sbx_default_0"
    )
    seq = await _raw_publish(js, forged.subject, forged.wire)
    code, result = _verify(dsec_cli, private_nats, private_home, tmp_path)
    assert code == 0, result
    (injected,) = result["injected"]
    assert injected["seq"] == seq and injected["id"] == forged.id
    assert injected["reason"].startswith("unknown-key")
    human = dsec_cli(
        "audit",
        "verify",
        env={
            "DSEC_NATS_URL": private_nats,
            "DSEC_HOME": str(tmp_path / "cli"),
            "DSEC_TRUST_ROOT": bytes(trust.stack_root(private_home).verify_key).hex(),
        },
    )
    assert "1 foreign message(s) injected and ignored" in human.output


async def test_altered_payload_is_named_once_its_successor_arrives(
    js, private_nats, private_home, dsec_cli, tmp_path, verifier_kind
) -> None:
    publisher = await _agent(js, private_home)
    real = publisher.signer.seal(
        SandboxExited(exit_code=1, reason="error", duration_s=1), aggregate_id="sbx_a0"
    )
    fields = canonical.unpack(real.wire)
    fields["payload"]["exit_code"] = 0  # someone rewrites a failure into a success
    seq = await _raw_publish(js, real.subject, canonical.pack(fields))
    later = SandboxExited(exit_code=0, reason="ok", duration_s=2)
    await publisher.publish(later, aggregate_id="sbx_a9")
    code, result = _verify(dsec_cli, private_nats, private_home, tmp_path)
    assert code == 1
    assert result["first_bad"]["seq"] == seq
    assert "this event was altered" in result["first_bad"]["reason"]


async def test_broken_chain_is_named(js, private_nats, private_home, dsec_cli, tmp_path) -> None:
    publisher = await _agent(js, private_home)
    exited = SandboxExited(exit_code=0, reason="ok", duration_s=1)
    for i in range(3):
        await publisher.publish(exited, aggregate_id=f"sbx_b{i}")
    publisher.signer.seal(exited, aggregate_id="sbx_7")  # withheld from the log
    after = publisher.signer.seal(exited, aggregate_id="sbx_8")
    seq = await _raw_publish(js, after.subject, after.wire)
    code, result = _verify(dsec_cli, private_nats, private_home, tmp_path)
    assert code == 1
    assert result["first_bad"]["seq"] == seq
    assert "broken: expected position 4, found 5" in result["first_bad"]["reason"]


async def test_replayed_old_event_is_listed_as_injected(
    js, private_nats, private_home, dsec_cli, tmp_path
) -> None:
    publisher = await _legit(js, private_home)
    old = await publisher.publish(SpecSubmitted(spec_yaml="once"), aggregate_id="sbx_once")
    seq = await _raw_publish(js, old.sealed.subject, old.sealed.wire)
    code, result = _verify(dsec_cli, private_nats, private_home, tmp_path)
    assert code == 0, result
    (injected,) = result["injected"]
    assert injected["seq"] == seq
    assert f"copy of the event at seq {old.stream_seq}" in injected["reason"]


async def test_replay_filters_by_sandbox_and_type(
    js, private_nats, private_home, dsec_cli, tmp_path
) -> None:
    await _legit(js, private_home)
    env = {"DSEC_NATS_URL": private_nats, "DSEC_HOME": str(tmp_path / "cli")}
    result = dsec_cli("audit", "replay", "--sandbox", "sbx_default_1", "--json", env=env)
    rows = [line for line in result.output.splitlines() if line.startswith("{")]
    assert result.exit_code == 0
    assert len(rows) == 1 and '"aggregate_id":"sbx_default_1"' in rows[0]
    result = dsec_cli("audit", "replay", "--type", "audit.key_registered", "--json", env=env)
    assert result.output.count('"type":"audit.key_registered"') == 1
    bad = dsec_cli("audit", "replay", "--type", "sandbox.explode", env=env)
    assert bad.exit_code == 2 and "is not an event type" in bad.output


def test_unreachable_bus_exits_3_and_says_what_to_do(dsec_cli, tmp_path) -> None:
    result = dsec_cli(
        "audit", "verify", env={"DSEC_NATS_URL": "nats://127.0.0.1:1", "DSEC_HOME": str(tmp_path)}
    )
    assert result.exit_code == 3
    assert "cannot reach NATS at nats://127.0.0.1:1" in result.output
    assert "dsec up" in result.output


async def test_events_tail_follows_and_filters(
    js, private_nats, private_home, dsec_cli, tmp_path
) -> None:
    await _legit(js, private_home)
    env = {"DSEC_NATS_URL": private_nats, "DSEC_HOME": str(tmp_path / "cli")}
    result = dsec_cli(
        "events", "tail", "--all", "--type", "spec.submitted", "-n", "2", "--json", env=env
    )
    rows = [line for line in result.output.splitlines() if line.startswith("{")]
    assert result.exit_code == 0
    assert len(rows) == 2 and all('"type":"spec.submitted"' in r for r in rows)
    one = dsec_cli("events", "tail", "--all", "--sandbox", "sbx_default_2", "-n", "1", env=env)
    assert "spec.submitted" in one.output and "sbx_default_2" in one.output


def test_events_schema_documents_every_event(dsec_cli, tmp_path) -> None:
    from dsec_core.events import EVENT_TYPES

    out = tmp_path / "asyncapi.json"
    result = dsec_cli("events", "schema", "--out", str(out), env={"DSEC_HOME": str(tmp_path)})
    assert result.exit_code == 0
    import json

    doc = json.loads(out.read_text())
    assert doc["asyncapi"].startswith("3.")
    assert set(doc["channels"]) == set(EVENT_TYPES)
    assert doc["channels"]["sandbox.ready"]["address"] == "dsec.sandbox.{sandbox_id}.ready"
    assert "SandboxExited" in doc["components"]["schemas"]
