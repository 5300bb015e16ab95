"""How the node agent plugs the hand-over (:mod:`dsec_nodeagent.state.handover`) into its
sandboxes, its IPC broker and the bus: the hooks a hand-over calls, and what a hand-over's new
sandbox gets at launch (``DSEC_STATE_HANDOVER_FROM``, the broker's standby permission, its
registration with the keeper)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from dsec_core.events import StateHandedOver
from dsec_core.ids import derive_event_id

from dsec_nodeagent.ipc.registry import AgentKey
from dsec_nodeagent.sandbox.models import ExitReason
from dsec_nodeagent.state.handover import HandOverHooks, hand_over
from dsec_nodeagent.state.keeper import SandboxState, StateKeeper, StateSession

if TYPE_CHECKING:
    from dsec_nodeagent.agent import NodeAgent
    from dsec_nodeagent.ipc.broker import Broker

log = logging.getLogger(__name__)

ENV_HANDOVER_FROM = "DSEC_STATE_HANDOVER_FROM"
"""Set in a hand-over's new sandbox: the sandbox whose state and tool name it takes over."""


def hooks_for(agent: NodeAgent, broker: Callable[[], Broker | None]) -> HandOverHooks:
    """The hand-over's hooks on this node: the broker switch (and its undo), stopping the old
    sandbox (``handed_over``) or the new one (a failed hand-over), ``state.handed_over``."""

    async def switch(frm: SandboxState, to: SandboxState) -> int:
        current = broker()
        if current is None:
            return 0
        return current.switch(AgentKey(to.group, to.agent, to.tenant), to.sandbox_id)

    async def release(frm: SandboxState, to: SandboxState) -> int:
        current = broker()
        if current is None:
            return 0
        return current.release(AgentKey(frm.group, frm.agent, frm.tenant), frm.sandbox_id)

    async def stop_old(sandbox_id: str) -> None:
        # It is frozen: a SIGTERM would wait for a thaw; SIGKILL the cgroup at once.
        await agent.manager.stop(sandbox_id, reason=ExitReason.HANDED_OVER, grace_s=0.0)

    async def stop_new(sandbox_id: str, why: str) -> None:
        log.warning("%s: hand-over failed (%s); stopping the new version", sandbox_id, why)
        await agent.manager.stop(sandbox_id, reason=ExitReason.ERROR, grace_s=2.0)

    async def publish(sandbox_id: str, event: StateHandedOver) -> None:
        await agent.outlet.lifecycle(
            event, sandbox_id, derive_event_id(sandbox_id, "state.handed_over")
        )

    def cgroup_of(sandbox_id: str) -> str | None:
        running = agent.manager.get(sandbox_id)
        return running.ready.cgroup_path if running is not None else None

    def done(sandbox_id: str) -> None:
        current = broker()
        if current is not None:
            current.forget_handover(sandbox_id)

    return HandOverHooks(
        switch=switch,
        release=release,
        stop_old=stop_old,
        stop_new=stop_new,
        publish=publish,
        cgroup_of=cgroup_of,
        done=done,
    )


def install(keeper: StateKeeper, agent: NodeAgent, broker: Callable[[], Broker | None]) -> None:
    """Serve hand-overs on this node (``keeper.handover``)."""
    hooks = hooks_for(agent, broker)

    async def serve(keeper: StateKeeper, old: StateSession, new: StateSession) -> None:
        await hand_over(keeper, old, new, hooks=hooks)

    keeper.handover = serve
