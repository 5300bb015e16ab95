"""Wiring of the builder service: resolution and environment builds on the bus."""

from __future__ import annotations

from dsec_core import events
from dsec_core.service import RetryPolicy, Service
from dsec_core.settings import Settings

from dsec_builder.handlers import BuilderHandlers


def create_service(settings: Settings | None = None) -> Service:
    """Build the builder: ``spec.validated`` → ``deps.*``; ``deps.resolved`` → ``env.built``."""
    service = Service("builder", settings)
    handlers = BuilderHandlers(service.settings)
    # Resolution and builds are slow and network-bound: fewer, longer-spaced attempts. The
    # runtime keeps the message alive while a long build runs.
    slow = RetryPolicy(max_attempts=3, base_delay_s=2.0, max_delay_s=20.0)
    # Each request is independent: four at once (the batch FastStream ran at once before, in
    # stream order), the tenants taking turns, so one tenant's backlog of builds holds
    # another's by at most the builds already running.
    service.handles(
        events.SpecValidated,
        retry=slow,
        batch=4,
        workers=4,
        answers=(events.DepsResolved, events.DepsConflict, events.SandboxFailed),
    )(handlers.on_validated)
    service.handles(
        events.DepsResolved,
        retry=slow,
        batch=4,
        workers=4,
        answers=(events.EnvBuilt, events.SandboxFailed),
    )(handlers.on_resolved)
    service.on_stop.append(handlers.close)
    return service
