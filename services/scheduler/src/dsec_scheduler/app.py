"""Wiring of the scheduler service.

Placement of compute units on GPUs arrives with its own issue. Today the scheduler hosts the
read-model projector (specs and sandboxes in Postgres), because the scheduler is the service
that will read "what runs where" from those tables.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from dsec_core.projections import Projector
from dsec_core.service import Service
from dsec_core.settings import Settings

log = logging.getLogger(__name__)


def create_service(settings: Settings | None = None) -> Service:
    """Build the scheduler service with the projector attached."""
    service = Service("scheduler", settings)
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []

    async def start_projector() -> None:
        dsn = service.settings.endpoint("postgres_dsn")
        if not dsn:
            log.warning("no DSEC_POSTGRES_DSN: read models are not projected")
            return
        assert service.nc is not None
        projector = Projector(service.nc.jetstream(), str(dsn), gate=service.gate)
        tasks.append(asyncio.create_task(projector.run(stop), name="projector"))

    async def stop_projector() -> None:
        stop.set()
        for task in tasks:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(task, timeout=5)

    service.on_start.append(start_projector)
    service.on_stop.append(stop_projector)
    return service
