"""What one simulated node reports: GPUs as NVML shows them, NVLink groups, scripted health,
running units; and the identity that signs it (certified for its node only)."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsec_core import authz, canonical, identity
from dsec_core.events import NodeHeartbeat
from dsec_core.trust import shape_problem

from dsec_fleetsim.identities import NoRoot, certify, fleet_secret, root_key
from dsec_fleetsim.inventory import NodePlan
from dsec_fleetsim.node import IDLE_C, SimNode, Unit
from dsec_fleetsim.script import parse_script

pytestmark = pytest.mark.unit

H100 = NodePlan("sim-0", 128.0, 1 << 40, "H100", 8)


def _node(plan: NodePlan = H100) -> SimNode:
    return SimNode(plan, 5.0, "0.1.0")


def test_a_whole_8_gpu_nvlink_node_is_one_nvlink_group() -> None:
    beat = _node().heartbeat(0.0)
    gpus = beat.inventory.gpus
    assert [g.uuid for g in gpus] == [f"GPU-sim-0-{i}" for i in range(8)]
    assert all(g.model == "H100" and g.memory_total_bytes == 80 << 30 for g in gpus)
    assert all(set(g.topology.values()) == {"NVLINK"} and len(g.topology) == 7 for g in gpus)
    assert all(len(g.nvlinks) == 18 and all(link.active for link in g.nvlinks) for g in gpus)
    assert beat.inventory.gpu_probe == "nvml" and beat.problems == [] and beat.seq == 1
    plain = NodeHeartbeat.model_validate(beat.model_dump(mode="json"))
    assert plain.model_dump() == beat.model_dump()


def _plain_bytes(beat: NodeHeartbeat) -> bytes:
    """What the signer signs for the plain event (no cached canonical forms)."""
    plain = NodeHeartbeat(**{k: getattr(beat, k) for k in NodeHeartbeat.model_fields})
    return canonical.pack(canonical.canonicalize(plain.model_dump(mode="json")))


@pytest.mark.parametrize(
    "plan",
    [H100, NodePlan("t", 32.0, 1 << 37, "T4", 4), NodePlan("c", 8.0, 1 << 34), NodePlan(
        "m", 192.0, 1 << 41, "MI300X", 8, {"zone": "a"})],
)  # fmt: skip
def test_a_prepared_heartbeat_signs_the_bytes_of_the_plain_event(plan: NodePlan) -> None:
    node = _node(plan)
    states = [node.heartbeat(0.0)]
    if node.gpus:
        node.units["sbx_1"] = Unit("sbx_1", 4.0, 16 << 30, (0,), started=0.0, until=9.0)
        node.heat(len(node.gpus) - 1, 90.0, 10.0, now=0.0)
        node.xid(0, 48)
        states += [node.heartbeat(t) for t in (3.0, 3.0, 7.0, 20.0)]
        node.xid(1, 79)
        states.append(node.heartbeat(21.0))
    for beat in states:
        assert canonical.pack(canonical.canonicalize(beat.model_dump(mode="json"))) == (
            _plain_bytes(beat)
        )


def test_pcie_gpus_are_no_nvlink_group() -> None:
    gpus = _node(NodePlan("t", 32.0, 1 << 37, "T4", 4)).heartbeat(0.0).inventory.gpus
    assert gpus[0].topology == {"GPU-t-1": "NODE", "GPU-t-2": "SYSTEM", "GPU-t-3": "SYSTEM"}
    assert all(g.nvlinks == [] for g in gpus)
    two_p100 = _node(NodePlan("p", 32.0, 1 << 37, "P100", 2)).heartbeat(0.0).inventory.gpus
    assert "NVLINK" not in two_p100[0].topology.values()  # not a whole 8-GPU board


def test_a_gpu_heats_up_along_its_ramp_and_xids_are_counted() -> None:
    node = _node()
    steps = parse_script(
        "- {at: 10, node: sim-0, gpu: 2, temperature: 92, over: 30}\n"
        "- {at: 20, node: sim-0, gpu: 5, xid: 48}\n"
    )
    node.heat(2, float(steps[0].temperature or 0), steps[0].over, now=10.0)
    node.xid(5, 48)
    node.xid(5, 48)
    assert node.heartbeat(10.0).inventory.gpus[2].temperature_c == IDLE_C
    assert node.heartbeat(25.0).inventory.gpus[2].temperature_c == 63.0
    late = node.heartbeat(60.0)
    assert late.inventory.gpus[2].temperature_c == 92.0
    assert late.inventory.gpus[5].xid_errors == 2 and late.problems == []  # counted, still there


def test_xid_79_takes_the_gpu_off_the_bus_as_nvml_would() -> None:
    node = _node()
    node.xid(3, 79)
    beat = node.heartbeat(1.0)
    assert [g.index for g in beat.inventory.gpus] == [0, 1, 2, 4, 5, 6, 7]
    assert beat.problems == [
        "GPU 3: name: GPU is lost",
        "GPU 3 (GPU-sim-0-3): no name or memory reported; not offered",
    ]
    assert 3 not in node.free_gpus()
    node.restart()  # a recovered node agent: counters since start, the GPU back
    again = node.heartbeat(2.0)
    assert len(again.inventory.gpus) == 8 and again.seq == 1 and again.problems == []


def test_a_running_unit_is_listed_and_granted() -> None:
    node = _node()
    node.units["sbx_1"] = Unit("sbx_1", 4.0, 16 << 30, (0, 1), started=0.0, until=300.0)
    beat = node.heartbeat(1.0)
    assert beat.sandboxes == ["sbx_1"]
    inv = beat.inventory
    assert (inv.cpus_allocated, inv.memory_allocated_bytes) == (4.0, 16 << 30)
    assert [g.utilization_pct for g in inv.gpus[:3]] == [97.0, 97.0, 0.0]
    assert node.free_gpus() == [2, 3, 4, 5, 6, 7]


def test_each_node_signs_as_its_own_certified_node_agent(tmp_path: Path) -> None:
    paths = identity.TrustPaths(tmp_path)
    root = identity.ensure_root(paths)
    assert bytes(root_key(tmp_path)) == bytes(root)
    secret = fleet_secret(tmp_path)
    assert (tmp_path / "fleetsim" / "seed").stat().st_mode & 0o777 == 0o600
    one, again = certify(root, secret, "sim-1"), certify(root, secret, "sim-1")
    assert one.cert.key_id == again.cert.key_id  # the same key across restarts
    identity.check(one.cert, bytes(root.verify_key))
    assert (one.cert.subject, one.cert.role, one.cert.node_id) == (
        "nodeagent-sim-1",
        "nodeagent",
        "sim-1",
    )
    node = _node(NodePlan("sim-1", 8.0, 1 << 34))
    sealed = one.signer().seal(node.heartbeat(0.0), aggregate_id="sim-1", tenant="system")
    assert shape_problem(sealed.fields) is None
    assert authz.refusal(sealed.fields, one.cert) is None
    other = _node(NodePlan("sim-2", 8.0, 1 << 34))
    posing = one.signer().seal(other.heartbeat(0.0), aggregate_id="sim-2", tenant="system")
    assert "may not speak for node 'sim-2'" in str(authz.refusal(posing.fields, one.cert))


def test_without_the_root_key_it_says_only_the_operator_can(tmp_path: Path) -> None:
    with pytest.raises(NoRoot, match="only the operator can certify simulated nodes"):
        root_key(tmp_path)


def test_scripted_health_becomes_gpu_and_link_events() -> None:
    from dsec_core.events import GpuDegraded, GpuRecovered, LinkCongested
    from dsec_core.gpuhealth import Thresholds

    node = _node()
    t = Thresholds(recover_after_s=10)
    assert node.health_events(0, t) == [] and node.tracker is None  # untouched: no cost
    node.heat(2, 92, 0, 1)
    node.xid(5, 48, count=3)
    node.health[4].nvlink_utilization = 96
    out = node.health_events(2, t)
    assert {(type(e).__name__, e.gpu_index) for e in out} == {
        ("GpuDegraded", 2), ("GpuDegraded", 5),
    } | {("LinkCongested", 4)}  # fmt: skip
    heat = next(e for e in out if isinstance(e, GpuDegraded) and e.gpu_index == 2)
    assert (heat.signal, heat.value, heat.source) == ("temperature", 92, "simulated")
    burst = next(e for e in out if isinstance(e, GpuDegraded) and e.gpu_index == 5)
    assert (burst.signal, burst.value) == ("xid", 3)
    links = [e for e in out if isinstance(e, LinkCongested)]
    assert len(links) == 18 and links[0].action == "warn"  # every active H100 link
    node.heal(2)
    node.heal(5)
    assert [type(e) for e in node.health_events(3, t)] == [GpuRecovered]  # 2; 5 waits 10 s
    assert [(type(e), e.gpu_index) for e in node.health_events(13, t)] == [(GpuRecovered, 5)]


def test_new_script_verbs_parse_and_need_a_gpu() -> None:
    steps = parse_script(
        "steps:\n"
        "  - {at: 1, node: sim-0, gpu: 0, xid: 48, count: 3}\n"
        "  - {at: 2, node: sim-0, gpu: 1, throttle: [hw_thermal]}\n"
        "  - {at: 3, node: sim-0, gpu: all, heal: true}\n"
        "  - {at: 4, node: sim-0, gpu: 0, nvlink_errors: 500}\n",
        "s.yaml",
        ["sim-0"],
    )
    assert [s.action for s in steps] == ["xid", "throttle", "heal", "nvlink_errors"]
    assert steps[0].count == 3 and steps[1].throttle == ["hw_thermal"]
    with pytest.raises(Exception, match=r"steps\[0\]: Value error, heal needs gpu"):
        parse_script("steps:\n  - {at: 1, node: sim-0, heal: true}\n", "s.yaml", ["sim-0"])
    with pytest.raises(Exception, match=r"steps\[0\].throttle\[0\]: Input should be 'gpu_idle'"):
        parse_script("steps:\n  - {at: 1, node: sim-0, gpu: 0, throttle: [hot]}\n", "s.yaml")


def test_a_gpu_fallen_off_the_bus_is_degraded_lost() -> None:
    from dsec_core.events import GpuDegraded
    from dsec_core.gpuhealth import Thresholds

    node = _node()
    node.xid(3, 79)
    out = [e for e in node.health_events(1, Thresholds()) if isinstance(e, GpuDegraded)]
    assert [(e.gpu_index, e.signal, e.gpu_uuid) for e in out] == [(3, "lost", "GPU-sim-0-3")]
