"""The node's presence on the bus: ``node.joined`` once per start, then ``node.heartbeat``.

Each beat is one signed publish (aggregate id = the node id) of the inventory, the running
sandboxes and the service's problems (its health checks, plus GPU fields that failed to read).
A beat is skipped, not queued, while the bus is unreachable: the scheduler learns from the gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable

from dsec_core.events import MAX_PROBLEMS, GpuInfo, NodeHeartbeat, NodeJoined, Payload
from dsec_core.subjects import InvalidSubjectToken, subject_for

from dsec_nodeagent.inventory import Inventory

log = logging.getLogger(__name__)

Publish = Callable[[Payload, str], Awaitable[None]]
"""Publishes a payload with the given aggregate id (the node's publisher, signed)."""
Health = Callable[[list[GpuInfo]], Awaitable[list[Payload]]]
"""The GPU health events the inventory's GPUs call for (``gpunode.GpuNode.health``)."""


class Heartbeat:
    """Announces the node and beats every ``interval_s`` until :meth:`stop`."""

    def __init__(
        self,
        node_id: str,
        version: str,
        interval_s: float,
        inventory: Inventory,
        publish: Publish,
        *,
        sandboxes: Callable[[], list[str]],
        problems: Callable[[], list[str]],
        connected: Callable[[], bool] = lambda: True,
        health: Health | None = None,
    ) -> None:
        self.node_id = node_id
        self.version = version
        self.interval_s = interval_s
        self.inventory = inventory
        self._publish = publish
        self._sandboxes = sandboxes
        self._problems = problems
        self._connected = connected
        self._health = health
        self.seq = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Publish ``node.joined`` and start beating (call after the sandboxes were
        reconciled, so the first beat lists the re-adopted ones).

        Raises:
            InvalidSubjectToken: ``DSEC_NODE_ID`` cannot name the node's subjects.
            InventoryError: wrong labels or declared inventory (the field named).
        """
        try:
            subject_for(NodeJoined.TYPE, self.node_id)
        except InvalidSubjectToken:
            raise InvalidSubjectToken(
                f"DSEC_NODE_ID {self.node_id!r}: letters, digits, '_' and '-' only "
                "(it is one token of the node's subjects)"
            ) from None
        await self.inventory.start()
        inventory, _ = await self.inventory.read()
        joined = NodeJoined(
            node_id=self.node_id,
            hostname=socket.gethostname(),
            version=self.version,
            inventory=inventory,
            heartbeat_s=self.interval_s,
        )
        await self._publish(joined, self.node_id)
        log.info(
            "node %s joined: %.1f CPUs, %d bytes of memory, GPUs %s",
            self.node_id,
            inventory.cpus,
            inventory.memory_bytes,
            inventory.gpu_probe,
        )
        self._task = asyncio.create_task(self._run(), name="heartbeat")

    async def stop(self) -> None:
        """Stop beating; shut NVML down."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.inventory.close()

    async def beat(self) -> NodeHeartbeat:
        """Read the inventory and publish one heartbeat."""
        inventory, gpu_problems = await self.inventory.read()
        self.seq += 1
        heartbeat = NodeHeartbeat(
            node_id=self.node_id,
            seq=self.seq,
            inventory=inventory,
            sandboxes=self._sandboxes(),
            problems=[p[:500] for p in [*self._problems(), *gpu_problems][:MAX_PROBLEMS]],
            heartbeat_s=self.interval_s,
        )
        await self._publish(heartbeat, self.node_id)
        if self._health is not None:  # gpu.degraded / gpu.recovered / link.congested
            try:
                for event in await self._health(list(inventory.gpus)):
                    await self._publish(event, self.node_id)
            except Exception:  # a health check must never cost the node its heartbeat
                log.exception("GPU health check failed")
        return heartbeat

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            next_at += self.interval_s
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            if not self._connected():
                continue  # skipped, not queued: the gap is the signal
            try:
                await self.beat()
            except Exception:  # a beat must never take the node agent down
                log.exception("heartbeat %d failed", self.seq)
            if loop.time() > next_at + self.interval_s:
                next_at = loop.time()  # a slow beat: do not burst to catch up
