"""The cluster settings a node agent applies are the operator's newest: any user may publish on
``cluster.config_set``'s subject (the operator's local CLI connects as a user), so a copy of an
older genuine setting, stored again, must change nothing."""

from __future__ import annotations

from pathlib import Path

import pytest
from dsec_core.events import ClusterConfigSet
from dsec_core.gpuhealth import CONFIG_ID
from dsec_core.settings import Settings
from dsec_core.subjects import subject_for
from dsec_testing.inmemory import MemoryLog, memory_gate, register_keys
from dsec_testing.trust import certified, stack_root

from dsec_nodeagent.gpunode import GpuNode

pytestmark = pytest.mark.unit


async def test_a_copy_of_an_older_setting_does_not_turn_mig_off(tmp_path: Path) -> None:
    """The operator turned MIG on (hardware isolation of the tenants sharing a GPU) and raised
    the temperature threshold; a user stored the bytes of the operator's older setting again,
    and every node agent went back to it (MIG off, the old threshold)."""
    root, log = stack_root(tmp_path), MemoryLog()
    operator = certified(root, "operator", subject="operator")
    await register_keys(log, operator)
    subject = subject_for(ClusterConfigSet.TYPE, CONFIG_ID)
    old = operator.signer.seal(
        ClusterConfigSet(key="gpu.temperature_c", value="40", config={"gpu.temperature_c": "40"}),
        aggregate_id=CONFIG_ID,
    )
    await log.publish(subject, old.wire)
    new = operator.signer.seal(
        ClusterConfigSet(
            key="gpu.mig",
            value="on",
            previous="off",
            config={"gpu.temperature_c": "90", "gpu.mig": "on"},
        ),
        aggregate_id=CONFIG_ID,
    )
    await log.publish(subject, new.wire)
    gate = memory_gate(root, log)
    node = GpuNode(Settings(home=tmp_path), lambda *_: None, lambda: gate)  # type: ignore[arg-type]
    config = await node.refresh_config()
    assert config.get("gpu.mig") is True and config.get("gpu.temperature_c") == 90

    await log.publish(subject, old.wire, headers={"Nats-Msg-Id": "stored-again"})
    config = await node.refresh_config()
    assert config.get("gpu.mig") is True and config.get("gpu.temperature_c") == 90
