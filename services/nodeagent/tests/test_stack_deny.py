"""Which (address, port) pairs the kernel denies to every sandbox: the stack's own servers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dsec_core.settings import Settings
from dsec_core.stackinfo import stack_endpoints

from dsec_nodeagent.stackdeny import deny_entries, local_addresses

pytestmark = pytest.mark.unit


def test_endpoints_come_from_settings_and_stack_json(tmp_path: Path) -> None:
    (tmp_path / "stack.json").write_text(
        json.dumps(
            {
                "nats_url": "nats://127.0.0.1:4333",
                "postgres_dsn": "postgresql://dsec:pw@127.0.0.1:5544/dsec",
                "s3_endpoint": "127.0.0.1:8444",
                "vault_addr": "http://127.0.0.1:8299",
                "prometheus_url": "http://127.0.0.1:9191",
                "servers": {"s3": {"endpoint": "127.0.0.1:8444", "ports": [8444, 9444, 18444]}},
                "services": {"nodeagent": {"metrics_port": 9555}},
            }
        )
    )
    settings = Settings(home=tmp_path, nats_url="nats://10.0.0.5:4222,nats://10.0.0.6:4222")
    found = {(host, port) for _, host, port in stack_endpoints(settings)}
    assert {("10.0.0.5", 4222), ("10.0.0.6", 4222)} <= found  # the setting wins over stack.json
    assert ("127.0.0.1", 4333) not in found
    assert {("127.0.0.1", p) for p in (5544, 8444, 8299, 9191, 9444, 18444, 9555)} <= found


def test_every_port_a_server_listens_on_is_an_endpoint(tmp_path: Path) -> None:
    """SeaweedFS serves gRPC at each port + 10000 and OpenBao its cluster port at + 1; before,
    only the base ports were denied, and a sandbox could be granted the filer's gRPC (every
    object of the system bucket)."""
    (tmp_path / "stack.json").write_text(
        json.dumps(
            {
                "servers": {
                    "s3": {"endpoint": "127.0.0.1:8444", "ports": [8444, 8888],
                           "listening": [8444, 18444, 8888, 18888]},
                    "vault": {"endpoint": "http://127.0.0.1:8200", "ports": [8200],
                              "listening": [8200, 8201]},
                },
            }
        )
    )  # fmt: skip
    found = {(h, p) for _, h, p in stack_endpoints(Settings(home=tmp_path))}
    assert {("127.0.0.1", p) for p in (8444, 18444, 8888, 18888, 8200, 8201)} <= found


def test_a_local_server_is_denied_on_every_local_address() -> None:
    entries = deny_entries(
        [("NATS", "127.0.0.1", 4222), ("S3", "localhost", 8333), ("db", "db.internal", 5432)],
        local=["127.0.0.1", "::1", "192.0.2.2"],
        resolver=lambda host: ["10.1.2.3"] if host == "db.internal" else [],
    )
    assert {("127.0.0.1", 4222), ("::1", 4222), ("192.0.2.2", 4222)} <= entries
    assert ("192.0.2.2", 8333) in entries
    assert ("10.1.2.3", 5432) in entries and ("127.0.0.1", 5432) not in entries


def test_local_addresses_include_loopback() -> None:
    assert {"127.0.0.1", "::1"} <= local_addresses()
