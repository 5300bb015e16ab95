"""Snapshots and rollbacks of the sandboxes this node runs.

The node agent is the only writer of its sandboxes' code dirs, so it is the one that reads them
for a snapshot and rewrites them for a rollback. Every node agent consumes
``snapshot.requested`` and ``snapshot.restore_requested`` through its own durables
(``nodeagent-<node>-snapshot-requested``, ...); only the node that owns the sandbox
(:func:`dsec_snapstore.sandboxes.acting_node`) acts, the others ack and skip. It publishes
``snapshot.taken`` / ``snapshot.restored`` / ``snapshot.failed`` itself, with manifests signed
by its own certified key. A sandbox started with ``spec.submitted.start_from_snapshot`` gets the
snapshot's code in its code dir before it starts (:meth:`NodeSnapshots.start_from`).
"""

from __future__ import annotations

from pathlib import Path

from dsec_core import events
from dsec_core.envelope import Envelope
from dsec_core.layout import NodeLayout
from dsec_core.service import HANDLING_SEQ, RetryPolicy, Service
from dsec_core.trust import Gate
from dsec_snapstore.requests import Refused, SnapshotRequests, snapshot_failed
from nats.js import JetStreamContext

SNAPSHOT_WORKERS = 4
"""Snapshots (and, apart, rollbacks) a node agent runs at once; one tenant at most three."""


class SnapshotStartRefused(Exception):
    """A sandbox cannot start from the snapshot it names (the reason is the message)."""


class NodeSnapshots:
    """The node agent's share of snapshot work, wired onto its service."""

    def __init__(self, service: Service) -> None:
        self.layout = NodeLayout.of(service.settings.home)

        def js() -> JetStreamContext:
            assert service.nc is not None
            return service.nc.jetstream()

        def gate() -> Gate:
            assert service.gate is not None
            return service.gate

        self.gate = gate
        self.node_id = service.settings.node_id
        self.requests = SnapshotRequests(
            service.settings,
            js,
            gate,
            node_id=self.node_id,
            code_dir_of=self.code_dir,
            cache_dir=self.layout.snapshot_cache,
            signer=service.name,
            store_required=False,
        )
        # S3 or Vault hiccups: a few quick retries (a rollback is wanted within seconds).
        retry = RetryPolicy(max_attempts=4, base_delay_s=0.5, max_delay_s=4.0, ack_wait_s=60.0)
        # On workers, the tenants taking turns (a fair handler): one tenant's large snapshot or
        # rollback holds no other request of this node but its own tenant's beyond its share,
        # as a fetched batch of four did until it all ended. Whose a request is (the node its
        # sandbox runs on) is known only from the sandbox's lifecycle, so every node holds
        # every request until its handler has read it; a request the runtime would end itself
        # (its tenant full here, every attempt crashed) is first checked to be this node's,
        # so no node ends a request of a sandbox that runs on another.
        for event_type, handler, answer in (
            ("snapshot.requested", self.requests.on_requested, events.SnapshotTaken),
            ("snapshot.restore_requested", self.requests.on_restore_requested,
             events.SnapshotRestored),
        ):  # fmt: skip
            service.handles(
                event_type,
                retry=retry,
                batch=16,
                workers=SNAPSHOT_WORKERS,
                on_exhausted=snapshot_failed,
                scope="node",
                confirm=self.acts_for,
                answers=(answer, events.SnapshotFailed),
            )(handler)
        service.on_start.append(self.requests.start)
        service.on_stop.append(self.requests.close)

    async def acts_for(self, envelope: Envelope, _request: object) -> bool:
        """Whether this node acts for the request's sandbox now; asked before the runtime ends
        a request the handler never saw. Read from the sandbox's lifecycle events alone (a few
        per sandbox, each type bounded), not its whole history: a tenant's own requests and
        their answers, which it can multiply, cost nothing here."""
        # as of the request's place in the log, as the handlers decide (HANDLING_SEQ: set by
        # the runtime while it asks)
        state = await self.gate().lifecycle(envelope.aggregate_id, upto=HANDLING_SEQ.get())
        if state.node_id is not None:  # placed by the scheduler: the fold says (acting_node)
            return state.node_id == self.node_id and state.owned_by(self.node_id)
        _, owner, _ = await self.requests.facts(envelope.aggregate_id)  # started without one
        return self.requests.mine(owner)

    def code_dir(self, sandbox_id: str) -> Path:
        """Where this node keeps a sandbox's code copy."""
        return self.layout.sandbox(sandbox_id).code

    async def start_from(
        self, sandbox_id: str, snapshot: str, tenant: str, max_size: int
    ) -> tuple[Path, events.SnapshotRestored]:
        """Restore ``snapshot``'s code into the new sandbox's code dir (absent, or holding the
        bundle the user checked against the snapshot); return the dir and ``snapshot.restored``.

        Raises:
            SnapshotStartRefused: another tenant's, unknown or altered snapshot, or too large.
        """
        code_dir = self.code_dir(sandbox_id)
        try:
            restored = await self.requests.restore_for_start(
                sandbox_id, snapshot, tenant, code_dir, max_size
            )
        except Refused as exc:
            raise SnapshotStartRefused(str(exc)) from None
        return code_dir, restored
