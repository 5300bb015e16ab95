"""The fleet's reactions without a bus: placements (verified by the gate), their end, moves,
stops and losses, and scripted steps. The gate and the publisher are stand-ins that record."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from dsec_core import canonical, events
from dsec_core.envelope import Envelope, utcnow
from dsec_core.trust import Refusal, unpack_fields
from nacl.signing import SigningKey

from dsec_fleetsim.fleet import Fleet, Options, placement_types
from dsec_fleetsim.identities import certify
from dsec_fleetsim.inventory import uniform
from dsec_fleetsim.migration import model
from dsec_fleetsim.script import parse_script

pytestmark = pytest.mark.unit


class FakeGate:
    """Admits what the scheduler signed (here: what the test says it did)."""

    def __init__(self) -> None:
        self.refuse: set[str] = set()

    async def admit(self, data: bytes, **_: Any) -> Envelope | Refusal:
        env = Envelope.model_validate(unpack_fields(data))
        if env.aggregate_id in self.refuse:
            return Refusal("unauthorized", "role 'policy' may not emit", env.id, env.type, "policy")
        return env

    async def tenant_of(self, sandbox_id: str) -> str:
        return "default"


def _fleet(**options: Any) -> tuple[Fleet, list[tuple[str, str, events.Payload]]]:
    plans = uniform(3, gpus=8, gpu_model="H100")
    root, secret = SigningKey.generate(), b"s" * 32
    idents = {p.node_id: certify(root, secret, p.node_id) for p in plans}
    fleet = Fleet(plans, idents, None, FakeGate(), Options(**options))  # type: ignore[arg-type]
    sent: list[tuple[str, str, events.Payload]] = []

    async def publish(node: Any, payload: events.Payload, **kw: Any) -> bool:
        sent.append((node.node_id, kw["aggregate_id"], payload))
        return True

    fleet._publish = publish  # type: ignore[method-assign]
    return fleet, sent


def _wire(event_type: str, sid: str, payload: events.Payload, seq: int = 1) -> bytes:
    env = Envelope(
        id=f"00000000-0000-7000-8000-{seq:012d}",
        type=event_type,
        subject=f"dsec.sandbox.{sid}.x",
        aggregate="sandbox",
        aggregate_id=sid,
        time=utcnow(),
        producer="scheduler",
        tenant="default",
        correlation_id="c",
        schema_version=payload.VERSION,
        payload=payload.model_dump(mode="json"),
        key_id="k",
        chain="c",
        chain_seq=0,
        prev=None,
        sig="00",
    )
    return canonical.pack(canonical.canonicalize(env.model_dump(mode="json")))


async def _on(
    fleet: Fleet, event_type: str, sid: str, payload: events.Payload, seq: int = 1
) -> None:
    await fleet._on_event(event_type, seq, _wire(event_type, sid, payload, seq))


def _scheduled(node: str, gpus: int = 2, attempt: int = 1) -> events.SandboxScheduled:
    return events.SandboxScheduled(
        node_id=node, attempt=attempt, resources=events.Resources(cpus=4, gpus=gpus)
    )


async def test_a_placement_runs_then_exits_ok() -> None:
    fleet, sent = _fleet(run_for_s=0.0)
    await _on(fleet, "sandbox.scheduled", "sbx_a", _scheduled("sim-1"))
    node = fleet.nodes["sim-1"]
    # the lifecycle only: the sandbox's resources come with its units' unit.placed
    assert node.units["sbx_a"].gpu_indices == () and fleet.where == {"sbx_a": "sim-1"}
    assert node.heartbeat(fleet.now()).sandboxes == ["sbx_a"]
    assert [(n, a, p.TYPE) for n, a, p in sent] == [("sim-1", "sbx_a", "sandbox.ready")]
    await _on(fleet, "sandbox.scheduled", "sbx_b", _scheduled("other-node"), seq=2)
    assert "sbx_b" not in fleet.where  # another node's: nothing done
    task = asyncio.create_task(fleet._end_units())
    await asyncio.sleep(0.5)
    task.cancel()
    await asyncio.sleep(0)
    assert node.units == {} and sent[-1][2].TYPE == "sandbox.exited"
    exited = sent[-1][2]
    assert isinstance(exited, events.SandboxExited)
    assert (exited.reason, exited.exit_code) == ("ok", 0)


async def test_a_refused_placement_is_counted_and_never_run() -> None:
    fleet, sent = _fleet()
    fleet.gate.refuse.add("sbx_forged")  # type: ignore[attr-defined]
    await _on(fleet, "sandbox.scheduled", "sbx_forged", _scheduled("sim-0"))
    assert fleet.stats.refused == 1 and fleet.nodes["sim-0"].units == {}
    [(node, durable, answer)] = sent  # answered once, by the node it names, as its consumer
    assert (node, durable) == ("sim-0", "nodeagent-sim-0-sandbox-scheduled")
    assert isinstance(answer, events.EventRejected)
    assert (answer.reason, answer.producer, answer.stream_seq) == ("unauthorized", "policy", 1)
    assert "sbx_forged" in fleet.stats.last_refusals[0]
    assert "unauthorized" in fleet.stats.last_refusals[0]


async def test_a_moved_stopped_or_lost_unit_leaves_its_node() -> None:
    fleet, sent = _fleet()
    await _on(fleet, "sandbox.scheduled", "sbx_m", _scheduled("sim-0"))
    await _on(fleet, "sandbox.scheduled", "sbx_m", _scheduled("sim-2", attempt=2), seq=2)
    assert "sbx_m" not in fleet.nodes["sim-0"].units and "sbx_m" in fleet.nodes["sim-2"].units
    await _on(fleet, "sandbox.scheduled", "sbx_m", _scheduled("sim-0", attempt=1), seq=3)
    assert fleet.where["sbx_m"] == "sim-2"  # an older placement never moves it back
    await _on(fleet, "sandbox.stop_requested", "sbx_m", events.SandboxStopRequested(), seq=4)
    stopped = sent[-1][2]
    assert isinstance(stopped, events.SandboxExited) and stopped.reason == "stopped"
    await _on(fleet, "sandbox.scheduled", "sbx_l", _scheduled("sim-1"), seq=5)
    lost = events.UnitLost(node_id="sim-1", reason="node lost", action="reschedule", attempt=1)
    await _on(fleet, "unit.lost", "sbx_l", lost, seq=6)
    assert fleet.nodes["sim-1"].units == {} and sent[-1][2].TYPE == "sandbox.ready"  # silent


async def test_scripted_steps_change_what_the_nodes_report() -> None:
    fleet, _ = _fleet()
    steps = parse_script(
        "- {at: 0, node: sim-0, crash: true}\n"
        "- {at: 0, node: 'sim-*', gpu: all, xid: 31}\n"
        "- {at: 0, node: sim-2, run_for: 7}\n"
        "- {at: 1, node: sim-0, recover: true}\n",
        ids=list(fleet.nodes),
    )
    for step in steps[:3]:
        for node_id in step.nodes(list(fleet.nodes)):
            await fleet.apply(step, fleet.nodes[node_id])
    assert not fleet.nodes["sim-0"].alive and fleet.nodes["sim-2"].run_for_s == 7
    assert fleet.nodes["sim-1"].heartbeat(0).inventory.gpus[5].xid_errors == 1
    fleet.nodes["sim-0"].seq = 9
    chain = fleet.publishers["sim-0"].signer.chain
    await fleet.apply(steps[3], fleet.nodes["sim-0"])
    node = fleet.nodes["sim-0"]
    assert node.alive and not node.joined and node.seq == 0  # joins again, from seq 1
    assert fleet.publishers["sim-0"].signer.chain != chain  # a new process: a new chain


def test_both_placement_events_are_followed() -> None:
    assert placement_types() == ["sandbox.scheduled", "unit.placed"]


async def test_units_of_one_sandbox_placed_on_several_nodes_each_run_there() -> None:
    fleet, sent = _fleet()

    def placed(unit: str, node: str, gpus: list[int], seq: int) -> Envelope:
        env = Envelope.model_validate(
            unpack_fields(_wire("sandbox.scheduled", "sbx_g", _scheduled(node), seq))
        )
        payload = {"sandbox_id": "sbx_g", "unit": unit, "node_id": node, "gpu_indices": gpus,
                   "cpu_millicores": 8000, "memory_bytes": 64 << 30, "attempt": 1}  # fmt: skip
        return env.model_copy(update={"type": "unit.placed", "payload": payload})

    await fleet._on_placed(placed("trainer-0", "sim-0", [0, 1, 2, 3], 1))
    await fleet._on_placed(placed("trainer-1", "sim-1", [4, 5, 6, 7], 2))
    assert fleet.nodes["sim-0"].units["sbx_g/trainer-0"].gpu_indices == (0, 1, 2, 3)
    beat = fleet.nodes["sim-1"].heartbeat(0.0)
    assert beat.sandboxes == ["sbx_g"] and beat.inventory.cpus_allocated == 8.0
    assert sent == []  # no sandbox.ready: the lifecycle belongs to sandbox.scheduled's node
    await _on(fleet, "sandbox.stop_requested", "sbx_g", events.SandboxStopRequested(), seq=3)
    assert fleet.nodes["sim-0"].units == {} and fleet.nodes["sim-1"].units == {}
    assert fleet.sandboxes == {} and fleet.where == {}


async def test_a_replayed_old_unit_lost_never_drops_a_later_placement_on_the_same_node() -> None:
    """Attack: the genuine bytes of attempt 1's ``unit.lost`` (node sim-1) published again
    after the sandbox was placed back on sim-1 (attempt 2): the node keeps running it."""
    fleet, _ = _fleet()

    def placed(attempt: int, seq: int) -> bytes:
        payload = {"sandbox_id": "sbx_r", "unit": "main", "node_id": "sim-1", "gpu_indices": [0],
                   "gpu_milli": 1000, "cpu_millicores": 2000, "memory_bytes": 1 << 30,
                   "attempt": attempt}  # fmt: skip
        env = Envelope.model_validate(
            unpack_fields(_wire("sandbox.scheduled", "sbx_r", _scheduled("sim-1"), seq))
        )
        env = env.model_copy(update={"type": "unit.placed", "payload": payload})
        return canonical.pack(canonical.canonicalize(env.model_dump(mode="json")))

    await fleet._on_event("unit.placed", 1, placed(1, 1))
    await _on(fleet, "sandbox.scheduled", "sbx_r", _scheduled("sim-1"), seq=2)
    lost = events.UnitLost(node_id="sim-1", reason="node lost", action="reschedule", attempt=1)
    await _on(fleet, "unit.lost", "sbx_r", lost, seq=3)
    assert fleet.nodes["sim-1"].units == {}
    await fleet._on_event("unit.placed", 4, placed(2, 4))
    await _on(fleet, "sandbox.scheduled", "sbx_r", _scheduled("sim-1", attempt=2), seq=5)
    assert set(fleet.nodes["sim-1"].units) == {"sbx_r", "sbx_r/main"}
    await _on(fleet, "unit.lost", "sbx_r", lost, seq=6)  # the replay
    assert set(fleet.nodes["sim-1"].units) == {"sbx_r", "sbx_r/main"}
    assert fleet.nodes["sim-1"].heartbeat(0.0).sandboxes == ["sbx_r"]
    now = events.UnitLost(node_id="sim-1", reason="drained", action="reschedule", attempt=2)
    await _on(fleet, "unit.lost", "sbx_r", now, seq=7)  # the genuine loss of attempt 2
    assert fleet.nodes["sim-1"].units == {}


def _placed_main(sid: str, node: str, gpus: list[int], seq: int) -> bytes:
    payload = {"sandbox_id": sid, "unit": "main", "node_id": node, "gpu_indices": gpus,
               "gpu_milli": 1000, "cpu_millicores": 2000, "memory_bytes": 1 << 30,
               "attempt": 1}  # fmt: skip
    wire = _wire("sandbox.scheduled", sid, _scheduled(node), seq)
    env = Envelope.model_validate(unpack_fields(wire))
    env = env.model_copy(update={"type": "unit.placed", "payload": payload})
    return canonical.pack(canonical.canonicalize(env.model_dump(mode="json")))


def _started(to_node: str, path: str = "criu", mid: str = "m1") -> events.UnitMigrationStarted:
    return events.UnitMigrationStarted(
        migration_id=mid, from_node="sim-0", to_node=to_node, from_gpus=[0], to_gpus=[1],
        reason="gpu_degraded", path=path,  # type: ignore[arg-type]
    )  # fmt: skip


async def _settle(fleet: Fleet) -> None:
    while fleet._tasks:
        await asyncio.wait(fleet._tasks, timeout=10)


async def test_a_migration_moves_the_unit_and_the_target_reports_it() -> None:
    fleet, sent = _fleet()
    await fleet._on_event("unit.placed", 1, _placed_main("sbx_v", "sim-0", [0], 1))
    await _on(fleet, "sandbox.scheduled", "sbx_v", _scheduled("sim-0"), seq=2)
    await _on(fleet, "unit.migration_started", "sbx_v", _started("sim-2"), seq=3)
    await _settle(fleet)
    assert fleet.nodes["sim-0"].units == {}
    assert set(fleet.nodes["sim-2"].units) == {"sbx_v", "sbx_v/main"}
    assert fleet.nodes["sim-2"].units["sbx_v/main"].gpu_indices == (1,)  # its GPU there
    assert fleet.nodes["sim-2"].heartbeat(0.0).sandboxes == ["sbx_v"]
    node, sid, done = sent[-1]
    assert (node, sid) == ("sim-2", "sbx_v") and isinstance(done, events.UnitMigrated)
    assert (done.migration_id, done.from_node, done.to_node) == ("m1", "sim-0", "sim-2")
    assert done.interruption_ms >= model("criu", 1 << 30).freeze_ms  # the freeze was slept
    assert done.bytes_moved > 1 << 30 and done.precopy_rounds == 3
    await _on(fleet, "unit.migration_started", "sbx_v", _started("sim-2"), seq=4)  # replayed
    await _settle(fleet)
    assert sum(isinstance(p, events.UnitMigrated) for _, _, p in sent) == 1
    await _on(fleet, "sandbox.stop_requested", "sbx_v", events.SandboxStopRequested(), seq=5)
    assert sent[-1][0] == "sim-2" and isinstance(sent[-1][2], events.SandboxExited)


async def test_a_target_not_simulated_here_is_refused_by_the_source() -> None:
    fleet, sent = _fleet()
    await fleet._on_event("unit.placed", 1, _placed_main("sbx_w", "sim-0", [0], 1))
    await _on(fleet, "unit.migration_started", "sbx_w", _started("real-node", "handover"), seq=2)
    await _settle(fleet)
    node, _, failed = sent[-1]
    assert node == "sim-0" and isinstance(failed, events.UnitMigrationFailed)
    assert (failed.stage, failed.still_running) == ("transfer", True)
    assert "sbx_w/main" in fleet.nodes["sim-0"].units  # it stays


def test_the_model_of_each_path() -> None:
    criu, handover, restart = (model(p, 8 << 30) for p in ("criu", "handover", "restart"))
    assert handover.freeze_ms < criu.freeze_ms < restart.freeze_ms
    assert handover.bytes_moved <= (64 << 20) and criu.bytes_moved > 8 << 30


async def test_stop_returns_when_a_loop_lost_its_first_cancellation() -> None:
    fleet, _ = _fleet()
    lost: list[int] = []

    async def stubborn() -> None:
        # What a loop does when Python 3.11's wait_for swallows the cancellation that raced
        # its result: it goes on as if nothing happened.
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                if not lost:
                    lost.append(1)
                    continue
                raise

    fleet._loop(stubborn(), "stubborn")
    await asyncio.sleep(0)
    loop = asyncio.get_running_loop()
    began = loop.time()
    await asyncio.wait_for(fleet.stop(), 10)
    assert loop.time() - began < 5  # (before: it waited for the loop, forever)
    assert lost == [1] and all(t.done() for t in fleet._loops)
