"""Migrations on the simulated fleet: a modelled move of a running unit between two nodes.

On ``unit.migration_started`` (signed by the scheduler, checked by the trust gate) for a unit a
simulated node runs, that node (the source) and the target carry the move out as node agents
would, with a model of the time each stage takes instead of real pages:

* ``criu``: pre-copy rounds (the unit keeps running) copy its memory at :data:`LINK_BPS`; then
  the freeze: the pages dirtied during the last round (:data:`DIRTY_FRACTION` of its memory)
  are dumped and sent, and the process tree is restored (:data:`RESTORE_MS`);
* ``handover``: the state plane's hand-over: the final delta (:data:`DIRTY_FRACTION` of the
  agent's state, at most :data:`STATE_MAX_BYTES`) and the switch (:data:`SWITCH_MS`);
* ``restart``: the unit starts afresh on the target (:data:`START_MS`).

The interruption is *measured* in the simulation (from the freeze on the source to the unit
running on the target, the modelled freeze slept for real), so it includes what the simulated
node's own work costs; ``stages_ms`` carries the modelled parts. The target then publishes
``unit.migrated`` signed by its own node-agent key; a target that is not simulated here, or not
alive, makes the source publish ``unit.migration_failed`` (the unit stays). A
``unit.migration_failed`` that arrives first (the scheduler's timeout) aborts the move.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

LINK_BPS = 12.5e9
"""Node-to-node bandwidth of the model (100 Gb/s)."""
DIRTY_FRACTION = 0.01
"""Share of a unit's memory dirtied during the last pre-copy round (and of an agent's state in
its final delta)."""
PRECOPY_ROUNDS = 3
RESTORE_MS = 25.0
"""CRIU restore of the process tree on the target (modelled)."""
SWITCH_MS = 2.0
"""The hand-over's switch: the new version takes the agent's name (modelled)."""
STATE_MAX_BYTES = 64 * 2**20
"""The state plane's state of an agent counted in the model (its journal, not its memory)."""
START_MS = 400.0
"""A stateless unit starting afresh (modelled)."""
PRECOPY_SLEEP_MAX_S = 1.0
"""Pre-copy is slept at most this long (the model's figure is reported in ``stages_ms``)."""
FREEZE_SLEEP_MAX_S = 2.0


@dataclass(frozen=True)
class Plan:
    """What the model says one move costs."""

    path: str
    precopy_ms: float
    freeze_ms: float
    bytes_moved: int
    rounds: int

    def stages(self) -> dict[str, float]:
        return {"precopy_modelled": round(self.precopy_ms, 3), "freeze_modelled": self.freeze_ms}


def model(path: str, memory_bytes: int) -> Plan:
    """The modelled cost of moving a unit of ``memory_bytes`` by ``path``."""
    memory = max(0, memory_bytes)
    if path == "handover":
        delta = min(memory, STATE_MAX_BYTES) * DIRTY_FRACTION
        freeze = SWITCH_MS + delta / LINK_BPS * 1000
        return Plan(path, 0.0, round(freeze, 3), int(delta), 0)
    if path == "restart":
        return Plan(path, 0.0, START_MS, 0, 0)
    dirty = memory * DIRTY_FRACTION
    precopy = memory * (1 + DIRTY_FRACTION * (PRECOPY_ROUNDS - 1)) / LINK_BPS * 1000
    freeze = dirty / LINK_BPS * 1000 + RESTORE_MS
    moved = int(memory * (1 + DIRTY_FRACTION * (PRECOPY_ROUNDS - 1)) + dirty)
    return Plan(path, round(precopy, 3), round(freeze, 3), moved, PRECOPY_ROUNDS)


def keys_of(sandbox_id: str, unit: str, where: Mapping[str, str], node_id: str) -> list[str]:
    """The simulated placements a unit is on ``node_id``: ``<sandbox>/<unit>`` (its
    ``unit.placed``), and for ``main`` the sandbox's own (its ``sandbox.scheduled``)."""
    keys = [f"{sandbox_id}/{unit}"]
    if unit == "main":
        keys.append(sandbox_id)
    return [k for k in keys if where.get(k) == node_id]


async def carry_out(plan: Plan, aborted: Any, migration_id: str) -> tuple[float, float] | None:
    """Sleep the modelled pre-copy, then the freeze; (freeze start, resume) monotonic times, or
    None when the migration was aborted before the freeze."""
    await asyncio.sleep(min(plan.precopy_ms / 1000, PRECOPY_SLEEP_MAX_S))
    if migration_id in aborted:
        return None
    frozen = time.monotonic()
    await asyncio.sleep(min(plan.freeze_ms / 1000, FREEZE_SLEEP_MAX_S))
    return frozen, time.monotonic()


def moved_unit(unit: Any, to_gpus: tuple[int, ...], own_gpus: bool) -> Any:
    """The unit as it runs on the target (its GPUs there; the sandbox's lifecycle placement
    holds none)."""
    return replace(unit, gpu_indices=to_gpus if own_gpus else unit.gpu_indices)
