"""Junk stored ahead of a sandbox's submission (any user may store messages on its subject)
hides neither the submission nor the tenant it binds the sandbox to."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from dsec_core import events
from dsec_core.audit import Verifier
from dsec_core.envelope import Envelope
from dsec_core.ids import new_sandbox_id
from dsec_core.settings import Settings
from dsec_core.subjects import subject_for
from dsec_core.trust import Refusal, unpack_fields
from dsec_testing import trust
from dsec_testing.inmemory import MemoryLog, memory_gate, register_keys
from dsec_testing.trust import certified, pipeline, stack_root

pytestmark = pytest.mark.unit
SPEC = 'version: "1.2"\nname: agent\nbase: python:3.11\nentrypoint: [python, a.py]\n'


async def test_junk_ahead_of_a_submission_does_not_unbind_the_sandbox_from_its_tenant(
    tmp_path: Path,
) -> None:
    """``Gate._first_submission`` reads only the first 32 messages of a sandbox's
    ``spec.submitted`` subject, junk included (``scan_seq``'s default limit). A user publishes
    32 non-envelopes there (its role may publish that subject), then its genuine submission:
    every consumer's gate says the sandbox has *no* tenant. The node agent then stamps its own
    events about the sandbox ``system`` (``outlet_for``: ``tenant_of`` -> None -> the signer's
    tenant), while ``dsec audit verify`` (which reads the whole subject) knows the sandbox's
    tenant and reports the node agent's event as tampering: "a service acted across tenants",
    exit 1, for ever. Also: the cross-tenant and aggregate-exists checks are off for it."""
    from dsec_nodeagent.app import outlet_for

    root, log = stack_root(tmp_path), MemoryLog()
    world = await pipeline(log, tmp_path, node_id="n1")  # type: ignore[arg-type]
    user = certified(root, "user", tenant="evil")
    other = certified(root, "user", tenant="acme")
    await register_keys(log, user, other)
    sid = new_sandbox_id()
    for _ in range(32):  # not envelopes: refused by every reader, but counted
        await log.publish(subject_for("spec.submitted", sid), b"\xc1junk")
    submitted = user.signer.seal(events.SpecSubmitted(spec_yaml=SPEC), aggregate_id=sid)
    await log.publish(submitted.subject, submitted.wire)
    # the sandbox runs on n1 (its genuine placement)
    await world.scheduler.publish(
        events.SandboxScheduled(node_id="n1"), aggregate_id=sid, tenant="evil"
    )

    gate = memory_gate(root, log)
    tenant = await gate.tenant_of(sid)

    # the node agent publishes an event of the sandbox outside a handler (a violation, a
    # checkpoint, its own exit): the real outlet of the node agent
    # (a node agent's own key: its signer's tenant is "system", as the service runtime's)
    nodeagent = await trust.publisher(log, tmp_path, "nodeagent", node_id="n1")  # type: ignore[arg-type]
    service = SimpleNamespace(gate=gate, publisher=nodeagent)
    outlet = outlet_for(Settings(home=tmp_path), service)  # type: ignore[arg-type]
    exited = events.SandboxExited(exit_code=0, reason="ok", duration_s=1.0)
    await outlet.lifecycle(exited, sid, None)
    stamped = Envelope.model_validate(unpack_fields(log.records[-1][2]))
    assert stamped.type == "sandbox.exited"

    verifier = Verifier(bytes(root.verify_key), signature_every=1)
    for seq, _, data in log.records:
        verifier.feed(seq, data)
    report = verifier.finish()

    # another tenant's request about it passes the gate
    stop = other.signer.seal(events.SandboxStopRequested(requested_by="x"), aggregate_id=sid)
    stop_seq = (await log.publish(stop.subject, stop.wire)).seq
    cross = await gate.admit(stop.wire, stream_seq=stop_seq)

    # secure behaviour: junk never hides the sandbox's tenant
    problems = []
    if tenant != "evil":
        problems.append(f"tenant_of({sid}) = {tenant!r}")
    if stamped.tenant != "evil":
        problems.append(f"the node agent stamped its sandbox.exited {stamped.tenant!r}")
    if not (isinstance(cross, Refusal) and cross.reason == "cross-tenant"):
        problems.append(f"tenant acme's stop of it admitted: {cross!r:.120}")
    if report.finding is not None:
        problems.append(f"audit verify: TAMPERING: {report.finding}")
    assert not problems, "\n".join(problems)


async def test_junk_on_a_subject_is_read_once_not_for_every_event(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every message of a submission's (or a key registration's) subject is read, so junk never
    hides one; each only once per consumer: 300 junk messages stored on the subject of a
    sandbox never submitted were read again for every cheap event about it. The sandbox's
    submission, stored after the junk and after the reads, is still found."""
    root, log = stack_root(tmp_path), MemoryLog()
    user = certified(root, "user", tenant="evil")
    await register_keys(log, user)
    sid = new_sandbox_id()
    for _ in range(300):
        await log.publish(subject_for("spec.submitted", sid), b"\xc1junk")
    for _ in range(300):  # and on the registration subject of a key never registered
        await log.publish(subject_for("audit.key_registered", "00112233aabbccdd"), b"\xc1junk")
    gate = memory_gate(root, log)
    reads = 0
    get_msg = log.get_msg

    async def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal reads
        reads += 1
        return await get_msg(*args, **kwargs)

    monkeypatch.setattr(log, "get_msg", counted)
    assert await gate.tenant_of(sid) is None
    assert isinstance(await gate.keys.certificate("00112233aabbccdd"), str)
    first = reads
    assert first >= 600
    for _ in range(20):
        assert await gate.tenant_of(sid) is None
        assert isinstance(await gate.keys.certificate("00112233aabbccdd"), str)
    assert reads - first <= 2 * 20  # one read each: nothing new after the last one read
    submitted = user.signer.seal(events.SpecSubmitted(spec_yaml=SPEC), aggregate_id=sid)
    await log.publish(submitted.subject, submitted.wire)
    assert await gate.tenant_of(sid) == "evil"
