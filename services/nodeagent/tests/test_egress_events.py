"""How the node agent's egress layer reports DNS refusals and which addresses it protects."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from dsec_core import events
from dsec_core.settings import Settings

from dsec_nodeagent.egress import Egress, stack_addresses
from dsec_nodeagent.outlet import EventOutlet
from dsec_nodeagent.refusals import RefusalGate

pytestmark = pytest.mark.unit


def test_the_stack_servers_addresses_are_protected(tmp_path: Path) -> None:
    settings = Settings(
        home=tmp_path,
        nats_url="nats://10.9.8.7:4222",
        postgres_dsn="postgresql://user:pw@10.9.8.8:5432/dsec",
        s3_endpoint="10.9.8.9:8333",
        vault_addr="http://[fd00::5]:8200",
    )
    assert set(stack_addresses(settings)) == {"10.9.8.7", "10.9.8.8", "10.9.8.9", "fd00::5"}


async def test_a_dns_refusal_becomes_a_violation_with_its_rule_id(tmp_path: Path) -> None:
    published: list[tuple[Any, str]] = []

    async def publish(payload: Any, sandbox_id: str, _: Any) -> None:
        published.append((payload, sandbox_id))

    outlet = EventOutlet(publish, RefusalGate())
    await outlet.start()
    egress = Egress(Settings(home=tmp_path, dns_upstream="127.0.0.1:53"), outlet)
    egress._on_dns_denied(
        "sbx-1", "txt.test", "TXT", rule_id="dns.qtype", reason="record type TXT (class IN)"
    )
    egress._on_dns_denied("sbx-1", "evil.test", "A", rule_id="default-deny", reason="no rule")
    await outlet.drain()
    await outlet.stop()
    ((qtype, sid), (deny, _)) = published
    assert isinstance(qtype, events.PolicyViolation) and sid == "sbx-1"
    assert (qtype.rule_id, qtype.operation, qtype.target) == ("dns.qtype", "dns", "txt.test/TXT")
    assert qtype.message == "the node's DNS proxy refused txt.test/TXT: record type TXT (class IN)"
    assert deny.rule_id == "default-deny" and "matches no egress rule" in deny.message
