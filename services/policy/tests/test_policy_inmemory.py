"""The policy service's handler driven through FastStream's in-memory broker, behind the real
trust gate (``dsec_testing.inmemory``): no server, the same wiring as in production."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsec_core.events import BundleRef, SpecSubmitted
from dsec_core.settings import Settings
from dsec_testing.inmemory import in_memory

from dsec_policy.app import create_service

pytestmark = pytest.mark.unit

SPEC = 'version: "1.2"\nname: agent\nbase: python:3.11\n'


async def test_a_submitted_spec_is_validated_with_its_plan(tmp_path: Path) -> None:
    egress = "security_policy:\n  network:\n    egress:\n      - {domain: pypi.org}\n"
    submitted = SpecSubmitted(spec_yaml=SPEC + egress, filename="agent.yaml")
    async with in_memory(create_service(Settings(home=tmp_path))) as bus:
        sent = await bus.send("user", submitted, "sbx_ok", tenant="acme")
        (answer,) = bus.caused_by(sent)
    assert answer.type == "spec.validated" and answer.producer == "policy"
    assert answer.payload["name"] == "agent"
    plan = answer.decoded().plan  # type: ignore[attr-defined]
    assert plan.tenant == "acme" and answer.tenant == "acme"  # the submitter's, not the YAML's
    assert (plan.spec_file, plan.egress[0].domain, plan.egress[0].spec_line) == (
        "agent.yaml",
        "pypi.org",
        7,
    )


async def test_a_task_topology_is_validated_with_its_units(tmp_path: Path) -> None:
    topology = (
        "tasks:\n  - name: embed\n    compute_unit: {gpu_type: a100, min_memory: 64GB}\n"
        "  - name: infer\n    compute_unit: {gpu_type: h100, fp16_throughput: 2000 TFLOPS}\n"
        "communication:\n  - {from: embed, to: infer, protocol: nvlink-p2p}\n"
    )
    submitted = SpecSubmitted(spec_yaml=topology, filename="rag.yaml")
    async with in_memory(create_service(Settings(home=tmp_path))) as bus:
        sent = await bus.send("user", submitted, "sbx_topo")
        (answer,) = bus.caused_by(sent)
    assert answer.type == "spec.validated", answer.payload
    assert answer.payload["name"] == "rag"  # no name: the file's
    plan = answer.decoded().plan  # type: ignore[attr-defined]
    assert [(u.name, u.gpu_models, u.gpus) for u in plan.topology.units] == [
        ("embed", ("A100-80GB",), 1),
        ("infer", ("H100",), 3),
    ]
    assert [(e.src, e.dst, e.protocol) for e in plan.topology.edges] == [
        ("embed", "infer", "nvlink-p2p")
    ]


async def test_a_bad_spec_is_rejected_with_its_line(tmp_path: Path) -> None:
    async with in_memory(create_service(Settings(home=tmp_path))) as bus:
        sent = await bus.send("user", SpecSubmitted(spec_yaml=SPEC + "nme: x\n"), "sbx_bad")
        (answer,) = bus.caused_by(sent)
    assert answer.type == "spec.rejected"
    (error,) = answer.payload["errors"]
    assert error["line"] == 4 and "nme" in error["message"]


async def test_a_submission_no_user_signed_is_refused_before_the_handler(tmp_path: Path) -> None:
    """A builder may not submit specs: the gate answers security.event_rejected, the handler
    never sees it; the same bytes again at a new stream position are a replay."""
    async with in_memory(create_service(Settings(home=tmp_path))) as bus:
        forged = await bus.send("builder", SpecSubmitted(spec_yaml=SPEC), "sbx_forged")
        assert bus.caused_by(forged) == []
        genuine = await bus.send("user", SpecSubmitted(spec_yaml=SPEC), "sbx_genuine")
        wire = bus.log.records[bus.log.seq_of_id(genuine.id) - 1][2]
        await bus.deliver(wire, genuine.subject, again=True)
        rejected = [(e.payload["reason"], e.payload["event_id"]) for e in bus.rejections()]
    assert rejected == [("unauthorized", forged.id), ("replayed", genuine.id)]
    assert len(bus.caused_by(genuine)) == 1  # validated once, not twice


async def test_a_hand_over_only_from_a_sandbox_of_the_same_tenant(tmp_path: Path) -> None:
    async with in_memory(create_service(Settings(home=tmp_path))) as bus:
        await bus.send("user", SpecSubmitted(spec_yaml=SPEC), "sbx_old", tenant="acme")
        own = SpecSubmitted(spec_yaml=SPEC, handover_from="sbx_old")
        (mine,) = bus.caused_by(await bus.send("user", own, "sbx_new", tenant="acme"))
        theirs = SpecSubmitted(spec_yaml=SPEC, filename="steal.yaml", handover_from="sbx_old")
        (stolen,) = bus.caused_by(await bus.send("user", theirs, "sbx_steal", tenant="umbrella"))
        nobody = SpecSubmitted(spec_yaml=SPEC, handover_from="sbx_nobody")
        (missing,) = bus.caused_by(await bus.send("user", nobody, "sbx_lost", tenant="acme"))
    assert mine.type == "spec.validated"
    assert stolen.type == "spec.rejected"
    (error,) = stolen.payload["errors"]
    assert error["rule_id"] == "handover.tenant" and error["path"] == "handover_from"
    assert error["file"] == "steal.yaml"
    # another tenant's sandbox reads exactly like no sandbox at all
    assert (
        error["message"]
        == "handover_from: no sandbox 'sbx_old' of tenant 'umbrella' to hand over from"
    )
    assert missing.type == "spec.rejected"
    assert "no sandbox 'sbx_nobody' of tenant 'acme'" in missing.payload["errors"][0]["message"]


@pytest.mark.parametrize(
    "key",
    [
        "bundles/acme/" + "a" * 64 + ".tar.zst",  # another tenant's, copied off the bus
        "bundles/" + "a" * 64 + ".tar.zst",  # stored before bundles were kept per tenant
        "bundles/evil/../acme/" + "a" * 64 + ".tar.zst",
        "snapshots/x",
    ],
)
async def test_a_code_bundle_of_another_tenant_is_refused_before_it_is_read(
    tmp_path: Path, key: str
) -> None:
    """A bundle reference is on the bus for anyone to copy; before, tenant evil submitting
    acme's reference got acme's code validated and unpacked into evil's sandbox."""
    ref = BundleRef(digest="a" * 64, object_key=key, size=10, files=1)
    submitted = SpecSubmitted(spec_yaml=SPEC, filename="agent.yaml", code=ref)
    async with in_memory(create_service(Settings(home=tmp_path))) as bus:
        sent = await bus.send("user", submitted, "sbx_copy", tenant="evil")
        (answer,) = bus.caused_by(sent)
    assert answer.type == "spec.rejected"
    (error,) = answer.payload["errors"]
    assert error["rule_id"] == "code.tenant" and "evil" in error["message"], error
