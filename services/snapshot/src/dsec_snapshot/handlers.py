"""The snapshot service's share of snapshot requests: sandboxes that run nowhere.

A request about a sandbox that runs (or is scheduled) on a node is the node agent's: this
service acks it and does nothing (:func:`dsec_snapstore.sandboxes.acting_node`). For a sandbox
that runs nowhere it takes the snapshot from the submitted code bundle in S3, and answers a
rollback with the reason it cannot be done.
"""

from __future__ import annotations

from collections.abc import Callable

from dsec_core.layout import NodeLayout
from dsec_core.settings import Settings
from dsec_core.trust import Gate
from dsec_snapstore.requests import SnapshotRequests, taken_event
from nats.js import JetStreamContext

__all__ = ["SnapshotRequests", "service_requests", "taken_event"]


def service_requests(
    settings: Settings, js: Callable[[], JetStreamContext], gate: Callable[[], Gate]
) -> SnapshotRequests:
    """The snapshot service's requests: no node, scratch space in its own layout directory."""
    layout = NodeLayout.of(settings.home)
    return SnapshotRequests(
        settings,
        js,
        gate,
        scratch=layout.snapshot / "code",
        cache_dir=layout.snapshot / "cache",
        signer="snapshot",
    )
