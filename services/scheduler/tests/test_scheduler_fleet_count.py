"""What the fleet counts as held, judged incrementally (only the sandboxes something changed
for), equals a count of every sandbox from scratch, after any sequence of events: sandbox
lifecycles, ``unit.placed`` of several attempts, node reports that do or do not name a
sandbox, nodes lost (their last word later than the fold knew), cordoned or not joined yet,
assumed placements expiring as the clock moves on or steps back, decisions applied
tentatively then withdrawn or confirmed, migrations started, ended and failed."""

from __future__ import annotations

import itertools
import random
from datetime import UTC, datetime
from typing import Any

import pytest
from dsec_core.events import GpuInfo, NodeInventory, Resources

from dsec_scheduler.domain import ASSUMED_S, GIB, SchedulerState, Seen
from dsec_scheduler.gangs import UnitHeld, held_from_resources

NODES = ("n0", "n1", "n2")
_ids = itertools.count()


def _inventory() -> dict[str, Any]:
    gpus = [
        GpuInfo(index=i, uuid=f"GPU-{i}", model="h100", memory_total_bytes=80 * GIB)
        for i in range(4)
    ]
    return NodeInventory(cpus=16, memory_bytes=64 * GIB, gpus=gpus).model_dump(mode="json")


def _recount(state: SchedulerState, now: float) -> tuple[dict[str, list[Resources]], list[Any]]:
    """Every sandbox counted from scratch, as the fleet was counted before it was judged
    incrementally (no side effect on the state)."""
    held: dict[str, list[Resources]] = {}
    units: list[UnitHeld] = []
    for sbx in state.sandboxes.values():
        node_id = sbx.holds
        if node_id is None or sbx.resources is None:
            continue
        if sbx.placed_at + ASSUMED_S <= now:
            node = state.nodes.get(node_id)
            known = not (
                node is None or node.reported is None or node.last_seen < sbx.placed_at + ASSUMED_S
            )
            if known and sbx.sandbox_id not in node.reported:  # type: ignore[union-attr]
                continue
        placed = state._placed_now(sbx)
        if not placed:
            held.setdefault(node_id, []).append(sbx.resources)
            units.append(held_from_resources(sbx.sandbox_id, sbx.tenant, node_id, sbx.resources))
        for unit in placed:
            held.setdefault(unit.node_id, []).append(unit.resources())
            units.append(unit)
    for reserved in state.migrations.reservations(set(state.sandboxes)):
        held.setdefault(reserved.node_id, []).append(reserved.resources())
        units.append(reserved)
    return held, units


class _Run:
    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.state = SchedulerState(lost_after_s=15)
        self.now = 1_000_000.0
        self.attempts: dict[str, int] = {}  # every sandbox built so far (a few end early)
        self.migrations: list[tuple[str, str]] = []  # (migration id, sandbox)

    def seen(self, type_: str, agg: str, payload: dict[str, Any]) -> Seen:
        return Seen(f"ev{next(_ids)}", type_, agg, "acme", payload, self.now, self.now)

    def node_event(self) -> Seen:
        rng, node_id = self.rng, self.rng.choice((*NODES, "n_unjoined"))
        kind = rng.choice(
            ("node.joined", "node.heartbeat", "node.heartbeat", "node.lost", "node.cordoned")
        )
        payload: dict[str, Any] = {"node_id": node_id, "inventory": _inventory()}
        if kind == "node.heartbeat":
            payload["sandboxes"] = sorted(s for s in self.attempts if rng.random() < 0.5)
        elif kind == "node.lost":  # (its last word: before, at, or after what the fold knows)
            last = datetime.fromtimestamp(self.now - rng.choice((0, 20, 200)), UTC)
            payload = {"node_id": node_id, "silent_s": 20.0, "last_seen": last.isoformat()}
        elif kind == "node.cordoned":
            payload = {"node_id": node_id, "cordoned": rng.random() < 0.5,
                       "draining": rng.random() < 0.3}  # fmt: skip
        return Seen(f"ev{next(_ids)}", kind, node_id, "system", payload, self.now, self.now)

    def sandbox_event(self) -> Seen:
        rng = self.rng
        if not self.attempts or rng.random() < 0.08:
            sid = f"sbx_{next(_ids)}"
            self.attempts[sid] = 1
            return self.seen("env.built", sid, {})
        sid = rng.choice(list(self.attempts)[-8:])  # (the latest few: most still live)
        node = rng.choice(NODES)
        resources = Resources(cpus=1, memory_bytes=GIB, gpus=rng.choice((0, 1)))
        attempt = self.attempts[sid] + rng.choice((0, 0, 1, -1))
        kind = rng.choices(
            ("env.built", "unit.placed", "sandbox.scheduled", "sandbox.ready", "unit.lost",
             "sandbox.exited", "sandbox.pending", "sandbox.failed"),
            weights=(1, 6, 6, 3, 2, 1, 2, 1),
        )[0]  # fmt: skip
        payload: dict[str, Any] = {}
        if kind == "unit.placed":
            payload = {
                "sandbox_id": sid, "unit": rng.choice(("main", "main", "side")), "node_id": node,
                "gpu_indices": [rng.randrange(4)], "gpu_milli": rng.choice((500, 1000)),
                "cpu_millicores": 1000, "memory_bytes": GIB, "attempt": max(1, attempt),
            }  # fmt: skip
        elif kind == "sandbox.scheduled":
            payload = {"node_id": node, "resources": resources.model_dump(mode="json")}
        elif kind == "sandbox.ready":
            payload = {"node_id": node}
        elif kind == "unit.lost":
            payload = {"node_id": node, "reason": "x", "action": rng.choice(("reschedule", "fail")),
                       "attempt": self.attempts[sid]}  # fmt: skip
            self.attempts[sid] += 1
        elif kind == "sandbox.exited":
            payload = {"exit_code": 0, "reason": "ok", "duration_s": 1.0}
        elif kind == "sandbox.pending":
            payload = {"reason": "x", "resources": resources.model_dump(mode="json"),
                       "attempt": self.attempts[sid]}  # fmt: skip
        elif kind == "sandbox.failed":
            payload = {"stage": "t", "reason": "x"}
        return self.seen(kind, sid, payload)

    def migration_event(self) -> Seen:
        rng = self.rng
        if self.migrations and rng.random() < 0.6:
            mid, sid = rng.choice(self.migrations)
            kind = rng.choice(("unit.migrated", "unit.migration_failed"))
        else:
            mid, sid = f"m{next(_ids)}", rng.choice(list(self.attempts)[-8:] or ["sbx_none"])
            self.migrations.append((mid, sid))
            kind = "unit.migration_started"
        source, target = rng.sample(NODES, 2)
        payload = {"unit": "main", "migration_id": mid, "from_node": source, "to_node": target,
                   "from_gpus": [0], "to_gpus": [rng.randrange(4)], "reason": "drain",
                   "path": "criu", "interruption_ms": 1.0}  # fmt: skip
        return self.seen(kind, sid, payload)

    def step(self) -> None:
        rng, state = self.rng, self.state
        roll = rng.random()
        if roll < 0.1:  # the clock moves on, or steps back (NTP)
            self.now += rng.choice((ASSUMED_S + 1, ASSUMED_S / 2, 30.0, -ASSUMED_S / 2))
            return
        if roll < 0.35:
            event = self.node_event()
        elif roll < 0.45:
            event = self.migration_event()
        else:
            event = self.sandbox_event()
        self.now += rng.random()
        if rng.random() < 0.2:  # a decision: applied at once, then withdrawn or confirmed
            state.tentative(event)
            if rng.random() < 0.5:
                state.withdraw(event.id)
            else:
                state.apply(event)
        else:
            state.apply(event)


@pytest.mark.parametrize("seed", range(40))
def test_the_incremental_count_equals_a_count_from_scratch(seed: int) -> None:
    run = _Run(seed)
    held_somewhere = 0
    for _ in range(300):
        run.step()
        fleet = run.state.fleet(run.now)
        held, units = _recount(run.state, run.now)
        assert list(fleet.units) == units
        assert {n: list(r) for n, r in fleet.allocations.items()} == held
        held_somewhere += bool(units)
    assert held_somewhere > 5  # (the run did place sandboxes: the test is not vacuous)
