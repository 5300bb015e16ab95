"""Wiring of the nodeagent service: its handlers on the bus."""

from __future__ import annotations

from dsec_core.service import Service
from dsec_core.settings import Settings


def create_service(settings: Settings | None = None) -> Service:
    """Build the nodeagent service with its handlers registered."""
    return Service("nodeagent", settings)
