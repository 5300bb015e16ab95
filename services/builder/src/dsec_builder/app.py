"""Wiring of the builder service: resolution and environment builds on the bus."""

from __future__ import annotations

import dataclasses

from dsec_core import events
from dsec_core.service import RetryPolicy, Service
from dsec_core.settings import Settings

from dsec_builder.handlers import BuilderHandlers

RESOLVE_TIMEOUT_S = 900.0
"""The longest one resolution attempt may run (uv's own limit is 180 s a run; a blocked spec
also has its alternatives probed)."""
BUILD_TIMEOUT_S = 1800.0
"""The longest one build attempt may run (each download is limited to 600 s)."""


def create_service(settings: Settings | None = None) -> Service:
    """Build the builder: ``spec.validated`` → ``deps.*``; ``deps.resolved`` → ``env.built``."""
    service = Service("builder", settings)
    handlers = BuilderHandlers(service.settings)
    # Resolution and builds are slow and network-bound: fewer, longer-spaced attempts. The
    # runtime keeps the message alive while a long build runs, and cancels an attempt that
    # outruns every limit inside it (uv runs 180 s at most, a download 600 s): a hung attempt
    # gives its worker back.
    slow = RetryPolicy(max_attempts=3, base_delay_s=2.0, max_delay_s=20.0)
    resolving = dataclasses.replace(slow, attempt_timeout_s=RESOLVE_TIMEOUT_S)
    building = dataclasses.replace(slow, attempt_timeout_s=BUILD_TIMEOUT_S)
    # Each request is independent: four at once (the batch FastStream ran at once before, in
    # stream order; deliveries are now verified and held 16 at a time), the tenants taking
    # turns and sharing the four max-min, one tenant running at most three of them,
    # so one tenant's backlog of builds holds another's by at most the builds already running,
    # and never by four slow builds of one tenant.
    service.handles(
        events.SpecValidated,
        retry=resolving,
        batch=16,
        workers=4,
        answers=(events.DepsResolved, events.DepsConflict, events.SandboxFailed),
    )(handlers.on_validated)
    service.handles(
        events.DepsResolved,
        retry=building,
        batch=16,
        workers=4,
        answers=(events.EnvBuilt, events.SandboxFailed),
    )(handlers.on_resolved)
    service.on_start.append(handlers.sweep)
    service.on_stop.append(handlers.close)
    return service
