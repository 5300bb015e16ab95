"""The client against a real NATS (and the real policy service where a spec must be judged):
what a Python user observes — typed errors, verified events, forgeries skipped, the sync twin."""

from __future__ import annotations

import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats
import pytest
from dsec_client import (
    DSec,
    DSecSync,
    InvalidInput,
    NotFound,
    SpecRejected,
    Stalled,
    Timeout,
    Unreachable,
)
from dsec_core.events import SandboxReady, SpecSubmitted
from dsec_core.settings import Settings
from dsec_core.signing import Signer
from dsec_testing import trust
from nacl.signing import SigningKey

pytestmark = pytest.mark.integration

BAD_SPEC = """\
version: "1.2"
name: client-bad
base: python:3.11
resources: {cpu: 1, memory: lots}
"""


@pytest.fixture
def user_env(stack_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """This process as a user of the test stack (NATS as ``user-default``, a certified key,
    the operator root as trust anchor), as after ``dsec login``."""
    for name, value in stack_env.items():
        monkeypatch.setenv(name, value)
    return stack_env


async def test_an_unreachable_bus_is_one_typed_error(tmp_path: Path) -> None:
    with pytest.raises(Unreachable, match=r"cannot reach NATS at nats://127\.0\.0\.1:1 "):
        async with DSec(Settings(nats_url="nats://u:secret@127.0.0.1:1", home=tmp_path)):
            pass


async def test_a_rejected_spec_raises_with_its_located_errors(user_env: Any, services: Any) -> None:
    services.start("policy")
    async with DSec() as d:
        sb = await d.submit(BAD_SPEC)
        with pytest.raises(SpecRejected) as raised:
            await sb.wait("ready", timeout=120)
        assert raised.value.state == "rejected" and sb.state == "rejected"
        assert raised.value.EXIT == 1
        located = [e for e in raised.value.errors if e.get("line") == 4]
        assert located and "memory" in str(located[0]).lower(), raised.value.errors
        seen = [ev async for ev in sb.events()]  # ends at the terminal event
        assert [ev.type for ev in seen] == ["spec.submitted", "spec.rejected"]
        assert all(ev.verified for ev in seen)
        assert seen[1].producer == "policy" and seen[1].payload.TYPE == "spec.rejected"
        # Attached later, its history is read in one batch: it ends where it ended.
        with pytest.raises(SpecRejected) as replayed:
            await d.sandbox(sb.id).wait("ready", timeout=60)
        assert replayed.value.event.type == "spec.rejected"
        assert replayed.value.event.seq == seen[1].seq


async def test_a_chain_nobody_handles_stalls_and_attaching_finds_it(user_env: Any) -> None:
    async with DSec() as d:
        sb = await d.submit({"version": "1.2", "name": "client-stall", "base": "python:3.11"})
        with pytest.raises(Stalled) as raised:
            await sb.wait("ready", stall=1, timeout=60)
        assert raised.value.last_event == "spec.submitted" and raised.value.EXIT == 4
        again = d.sandbox(sb.id)
        assert await again.ended() is None
        first = await anext(again.events())
        assert first.type == "spec.submitted" and first.data["submitted_by"]
        assert isinstance(first.payload, SpecSubmitted)
        with pytest.raises(Timeout):  # no snapshot service answers here
            await again.snapshot("v1", timeout=1)


async def test_unknown_and_invalid_sandboxes(user_env: Any) -> None:
    async with DSec() as d:
        with pytest.raises(InvalidInput):
            d.sandbox("not an id!")
        with pytest.raises(NotFound, match="sbx_nope"):
            await d.sandbox("sbx_nope").stop()
        with pytest.raises(InvalidInput, match="not an event type"):
            await anext(d.events(type="sandbox.nope"))


async def test_forged_events_are_skipped_and_said(user_env: Any, nats_url: str) -> None:
    """An attacker with publish rights writes a ``sandbox.ready`` signed by an uncertified key
    on a real sandbox's subject: the client never hands it over, and says so."""
    warnings: list[str] = []
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        async with DSec(on_warning=warnings.append) as d:
            sb = await d.submit(BAD_SPEC.replace("client-bad", "client-forged"))
            forger = Signer("nodeagent", SigningKey.generate())
            forged = forger.seal(
                SandboxReady(node_id="n-evil", pid=1, cgroup="/x"), aggregate_id=sb.id
            )
            await js.publish(forged.subject, forged.wire, headers={"Nats-Msg-Id": forged.id})
            genuine = await trust.publisher(js, Path(user_env["DSEC_HOME"]), "user")
            marker = uuid.uuid4().hex
            await genuine.publish(
                SpecSubmitted(spec_yaml=f"# {marker}\n", filename="x.yaml"),
                aggregate_id=f"sbx_{marker[:12]}",
            )
            seen = []
            async for ev in d.events(sandbox=sb.id, since="start"):
                seen.append(ev)
                if ev.type == "spec.submitted":
                    break
            assert [ev.type for ev in seen] == ["spec.submitted"]
            assert any("unauthentic sandbox.ready" in w for w in warnings), warnings
            # Any subscriber: by type, from an age; the genuine event is there, verified.
            async for ev in d.events(type="spec.submitted", since=timedelta(minutes=5)):
                if ev.aggregate_id == f"sbx_{marker[:12]}":
                    assert ev.verified and marker in ev.data["spec_yaml"]
                    break
    finally:
        await nc.close()


def test_the_sync_twin(user_env: Any, services: Any) -> None:
    services.start("policy")
    with DSecSync() as d:
        sb = d.submit(BAD_SPEC.replace("client-bad", "client-sync"))
        with pytest.raises(SpecRejected):
            sb.wait("validated", timeout=120)
        assert [ev.type for ev in sb.events()] == ["spec.submitted", "spec.rejected"]
        assert sb.stop() is None  # already ended: left alone
        assert d.sandbox(sb.id).ended() is not None
