"""Wiring of the node agent: sandboxes, their egress policy and their IPC broker on the bus."""

from __future__ import annotations

from dsec_core.events import Payload
from dsec_core.service import RetryPolicy, Service
from dsec_core.settings import Settings
from dsec_core.trust import Gate

from dsec_nodeagent.agent import NodeAgent
from dsec_nodeagent.communication import CommunicationPlane
from dsec_nodeagent.egress import Egress


def create_service(settings: Settings | None = None) -> Service:
    """Build the node agent: ``env.built`` → sandbox; ``sandbox.stop_requested`` → stop."""
    service = Service("nodeagent", settings)

    async def publish(payload: Payload, aggregate_id: str, event_id: str | None) -> None:
        # Not a handler's output: the event still belongs to the sandbox's tenant.
        assert service.publisher is not None and service.gate is not None
        tenant = None
        if payload.AGGREGATE == "sandbox":
            tenant = await service.gate.tenant_of(aggregate_id)
        await service.publisher.publish(
            payload, aggregate_id=aggregate_id, event_id=event_id, tenant=tenant
        )

    def gate() -> Gate:
        assert service.gate is not None
        return service.gate

    egress = Egress(service.settings, publish)
    comms = CommunicationPlane(service.settings)
    agent = NodeAgent(
        service.settings,
        publish,
        gate,
        before_start=egress.attach,
        on_stopped=egress.detach,
        ipc_socket=comms.socket_path,
    )
    comms.attach(agent.manager)
    retry = RetryPolicy(max_attempts=3, base_delay_s=1.0)
    service.handles("env.built", retry=retry, batch=4)(agent.on_env_built)
    service.handles("sandbox.stop_requested")(agent.on_stop_requested)
    # The broker listens before sandboxes are re-adopted (they are shown its new socket then)
    # and stops after the node agent stops watching them.
    service.on_start.extend([egress.start, comms.start, agent.start])
    service.on_stop.extend([agent.shutdown, comms.stop, egress.close])
    return service
