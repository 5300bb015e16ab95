"""Wiring of the node agent: sandboxes, their egress policy and their IPC broker on the bus."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from dsec_core import events
from dsec_core.events import Payload
from dsec_core.identity import SYSTEM_TENANT
from dsec_core.service import RetryPolicy, Service
from dsec_core.settings import Settings
from dsec_core.trust import Gate

from dsec_nodeagent import leftovers
from dsec_nodeagent.agent import NodeAgent
from dsec_nodeagent.communication import CommunicationPlane
from dsec_nodeagent.ebpf.controller import EgressController
from dsec_nodeagent.egress import Egress
from dsec_nodeagent.gpunode import GpuNode
from dsec_nodeagent.heartbeat import Heartbeat
from dsec_nodeagent.inventory import Inventory
from dsec_nodeagent.migration.node import Migrations
from dsec_nodeagent.outlet import EventOutlet
from dsec_nodeagent.refusals import RefusalGate
from dsec_nodeagent.remote_access import RemoteAccess
from dsec_nodeagent.snapshots import NodeSnapshots
from dsec_nodeagent.state import wiring as state_wiring
from dsec_nodeagent.state.keeper import StateKeeper
from dsec_nodeagent.toolwatch import ToolWatch

LAUNCH_WORKERS = 4
"""Launches one node agent runs at once (one tenant at most three of them): what a fetched
batch of four ran before, without its barrier."""


def outlet_for(settings: Settings, service: Service) -> EventOutlet:
    """Lifecycle events first; refusals through the per-sandbox gate (the settings' bounds)."""

    async def publish(payload: Payload, aggregate_id: str, event_id: str | None) -> None:
        # Not a handler's output: the event still belongs to the sandbox's tenant.
        assert service.publisher is not None and service.gate is not None
        tenant = None
        if payload.AGGREGATE == "sandbox":
            tenant = await service.gate.tenant_of(aggregate_id)
        await service.publisher.publish(
            payload, aggregate_id=aggregate_id, event_id=event_id, tenant=tenant
        )

    gate = RefusalGate(
        burst=settings.policy_event_burst,
        window_s=60.0,
        flood_limit=settings.policy_flood_limit,
    )
    return EventOutlet(publish, gate, interval_s=settings.policy_summary_interval_s)


def handle_launches(service: Service, agent: NodeAgent, retry: RetryPolicy) -> None:
    """Register the node agent's launches (``sandbox.scheduled``, its node's durable).

    They run on workers, the tenants taking turns (a fair handler): one slow launch (a cold
    multi-GB environment, a large mount) holds no other launch of this node, as a fetched
    batch did until it all ended. Another node's launch is acked before it is held, so it
    counts against no tenant's bound here; a launch the runtime would end itself (its tenant
    full, every attempt crashed) is first checked to be the sandbox's latest placement here,
    so a late copy of an old placement never ends the sandbox where it runs now."""
    node_id = service.settings.node_id
    service.handles(
        events.SandboxScheduled,
        retry=retry,
        batch=16,
        workers=LAUNCH_WORKERS,
        scope="node",
        select=lambda _envelope, event: event.node_id == node_id,
        confirm=agent.still_placed_here,
        answers=(events.SandboxReady, events.SandboxFailed),
    )(agent.on_scheduled)


@dataclass(frozen=True)
class Wired:
    """The node agent's service and the parts tests and benchmarks look at."""

    service: Service
    agent: NodeAgent
    outlet: EventOutlet
    egress: Egress
    heartbeat: Heartbeat
    keeper: StateKeeper | None = None
    migrations: Migrations | None = None


def heartbeat_for(service: Service, agent: NodeAgent, gpus: GpuNode | None = None) -> Heartbeat:
    """``node.joined`` and ``node.heartbeat`` of this node, signed by the node agent's key."""
    settings, manager = service.settings, agent.manager

    def running_groups() -> list[dict[str, Path]]:
        found = (manager.get(sandbox_id) for sandbox_id in manager.running())
        return [sandbox.cgroup.dirs for sandbox in found if sandbox is not None]

    async def publish(payload: Payload, aggregate_id: str) -> None:
        assert service.publisher is not None
        await service.publisher.publish(payload, aggregate_id=aggregate_id, tenant=SYSTEM_TENANT)

    return Heartbeat(
        settings.node_id,
        service.version,
        settings.heartbeat_s,
        Inventory(settings, running_groups, calls=gpus.nvml if gpus is not None else None),
        publish,
        sandboxes=manager.running,
        problems=service.problems,
        connected=lambda: service.nc is not None and service.nc.is_connected,
        health=gpus.health if gpus is not None else None,
    )


def create_service(settings: Settings | None = None) -> Service:
    """Build the node agent: ``sandbox.scheduled`` (for this node) → sandbox;
    ``sandbox.stop_requested`` → stop; ``unit.lost`` → a stale copy fenced off; snapshot
    requests of its own sandboxes → ``snapshot.taken|restored|failed``."""
    return wire(settings).service


def wire(
    settings: Settings | None = None, *, egress_controller: EgressController | None = None
) -> Wired:
    """The node agent and its parts. ``egress_controller``: one with its own pin and state
    directories (tests and benchmarks that run beside a node agent of the machine)."""
    service = Service("nodeagent", settings)

    def gate() -> Gate:
        assert service.gate is not None
        return service.gate

    outlet = outlet_for(service.settings, service)
    egress = Egress(service.settings, outlet, egress_controller)
    comms = CommunicationPlane(service.settings)
    agent = NodeAgent(
        service.settings,
        outlet,
        gate,
        before_start=egress.attach,
        on_stopped=egress.detach,
        ipc_socket=comms.socket_path,
    )
    if service.settings.policy_flood_stop:
        outlet.on_flood = agent.flooded
    comms.attach(agent.manager)
    # The state plane (docs/state.md): agents reach their keeper through the broker's `state`
    # op; its events are lifecycle events of the sandbox.
    keeper = StateKeeper(
        service.settings,
        lambda payload, aggregate_id: outlet.lifecycle(payload, aggregate_id, None),
        registered_only=True,
    )
    comms.state_keeper = keeper
    agent.state_keeper = keeper
    # Tools at run time (docs/tools.md): the SDK's call reports over the broker become the
    # dsec_tool_* metrics and tool.degraded/tool.recovered, lifecycle events of the sandbox.
    toolwatch = ToolWatch(
        service.settings.node_id,
        lambda payload, aggregate_id: outlet.lifecycle(payload, aggregate_id, None),
    )
    agent.toolwatch = toolwatch
    comms.tool_reports = toolwatch.report
    retry = RetryPolicy(max_attempts=3, base_delay_s=1.0)
    # Per-node durables (nodeagent-<node>-<type>): every node sees each event, and acts only on
    # those of sandboxes placed on it.
    handle_launches(service, agent, retry)
    service.handles(events.SandboxStopRequested, scope="node")(agent.on_stop_requested)
    # fencing is this node's own cleanup: a failure is logged, never a sandbox.failed for a
    # sandbox that now belongs to another node
    service.handles(events.UnitLost, scope="node", on_exhausted=lambda *_: [])(agent.on_unit_lost)
    agent.start_from_snapshot = NodeSnapshots(service).start_from  # snapshots of its sandboxes
    # migrations (docs/migration.md): the source moves the unit, the target resumes it; a
    # failure the runtime gives up on is this node's unit.migration_failed, never sandbox.failed
    migrations = Migrations(service, agent).attach()
    migrations.broker = lambda: comms.broker
    service.handles(events.UnitMigrationStarted, scope="node", on_exhausted=migrations.exhausted)(
        migrations.on_started
    )

    def expect_handover(new_sandbox: str, old_sandbox: str) -> None:
        if comms.broker is not None:  # a standby for the old one's tool name (hand-over)
            comms.broker.expect_handover(new_sandbox, old_sandbox)

    def forget_handover(new_sandbox: str) -> None:
        if comms.broker is not None:
            comms.broker.forget_handover(new_sandbox)

    agent.expect_handover = expect_handover
    agent.forget_handover = forget_handover
    # Hand-overs (`dsec sandbox upgrade`): the keeper streams, freezes, switches the broker.
    state_wiring.install(keeper, agent, lambda: comms.broker)
    # The broker listens before sandboxes are re-adopted (they are shown its new socket then)
    # and stops after the node agent stops watching them.
    agent.proxies.forbidden = egress.is_stack  # the proxy's upstreams: never the stack
    # GPU slices, their memory quota watch and the GPUs' health (docs/gpu.md)
    gpus = GpuNode(
        service.settings,
        lambda payload, aggregate_id: outlet.lifecycle(payload, aggregate_id, None),
        gate,
    )
    gpus.stop_unit = agent.stop_over_gpu_memory
    agent.gpus = gpus
    heartbeat = heartbeat_for(service, agent, gpus)  # joins after the sandboxes were reconciled

    async def sweep_leftovers() -> None:  # of other homes' node agents, long gone
        mine = service.settings.egress_dirs()[1].parent.name
        await asyncio.to_thread(leftovers.sweep, mine)

    service.on_start.extend(
        [
            sweep_leftovers, outlet.start, egress.start, keeper.start, comms.start, gpus.start,
            agent.start, heartbeat.start,
        ]
    )  # fmt: skip
    service.on_stop.extend(
        [
            heartbeat.stop,
            agent.shutdown,
            gpus.stop,
            comms.stop,
            keeper.stop,
            toolwatch.close,
            egress.close,
            outlet.stop,
        ]
    )
    RemoteAccess(service, agent.manager).attach()  # `dsec sandbox logs|exec` over the bus
    return Wired(service, agent, outlet, egress, heartbeat, keeper, migrations)
