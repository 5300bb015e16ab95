"""`dsec nats stream --replicas N`: the operator creates the event stream at the replication its
NATS cluster gives it (the Kubernetes Job asks R3 of its three servers)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from dsec_core.subjects import STREAM
from dsec_testing.stack import StackFixture

pytestmark = pytest.mark.integration


@pytest.fixture
def private_nats(tmp_path: Path) -> Iterator[str]:
    fixture = StackFixture(tmp_path / "operator")
    try:
        yield fixture.nats_url
    finally:
        fixture.close()


async def _replicas(url: str) -> int:
    nc = await nats.connect(url)
    try:
        return int((await nc.jetstream().stream_info(STREAM)).config.num_replicas)
    finally:
        await nc.close()


async def test_replicas_reach_the_server(private_nats, dsec_cli, tmp_path) -> None:
    env = {"DSEC_NATS_URL": private_nats, "DSEC_HOME": str(tmp_path / "cli")}
    # One server cannot hold three copies: the server's refusal shows the flag reached it.
    refused = dsec_cli("nats", "stream", "--replicas", "3", "--json", env=env)
    assert refused.exit_code != 0
    assert "could not create or update" in refused.output
    created = dsec_cli("nats", "stream", "--replicas", "1", "--json", env=env)
    assert created.exit_code == 0, created.output
    assert created.last_json() == {"stream": STREAM, "problems": [], "limits": {}}
    assert await _replicas(private_nats) == 1
    bad = dsec_cli("nats", "stream", "--replicas", "0", env=env)
    assert bad.exit_code == 2 and "--replicas" in bad.output
