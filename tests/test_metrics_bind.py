"""Where a service's ``/metrics`` and ``/healthz`` listen (``DSEC_METRICS_HOST``): loopback by
default (the embedded stack), every address in a container, where Prometheus scrapes and
Kubernetes probes from outside the process's own loopback."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import nats
import psutil
import pytest
from dsec_core.bus import ensure_stream
from dsec_core.metrics import MetricsServer
from dsec_core.service import Service
from dsec_core.settings import Settings
from dsec_testing import trust
from dsec_testing.stack import StackFixture


def _outside_address() -> str:
    """An IPv4 address of this machine that is not loopback (what a scraper outside uses)."""
    for addresses in psutil.net_if_addrs().values():
        for a in addresses:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    pytest.skip("this machine has no non-loopback IPv4 address")


async def _healthz(host: str, port: int) -> int:
    timeout = aiohttp.ClientTimeout(total=5)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(f"http://{host}:{port}/healthz") as response,
    ):
        return response.status


async def _refused(host: str, port: int) -> bool:
    try:
        await _healthz(host, port)
    except aiohttp.ClientConnectorError:
        return True
    return False


@pytest.mark.unit
def test_the_setting_defaults_to_loopback_and_reads_the_environment(monkeypatch) -> None:
    monkeypatch.delenv("DSEC_METRICS_HOST", raising=False)
    assert Settings().metrics_host == "127.0.0.1"
    monkeypatch.setenv("DSEC_METRICS_HOST", "0.0.0.0")
    assert Settings().metrics_host == "0.0.0.0"


@pytest.mark.unit
async def test_loopback_is_not_reachable_from_outside_and_all_addresses_are() -> None:
    outside = _outside_address()
    local = MetricsServer("probe", "0", lambda: True)
    port = await local.start(0)
    try:
        assert await _healthz("127.0.0.1", port) == 200
        assert await _refused(outside, port)
    finally:
        await local.stop()
    everywhere = MetricsServer("probe", "0", lambda: True)
    port = await everywhere.start(0, "0.0.0.0")
    try:
        assert await _healthz(outside, port) == 200
        assert await _healthz("127.0.0.1", port) == 200
    finally:
        await everywhere.stop()


@pytest.fixture
def private_nats(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    home = tmp_path / "operator"
    fixture = StackFixture(home)
    try:
        yield home, fixture.nats_url
    finally:
        fixture.close()


@pytest.mark.integration
async def test_a_service_serves_health_on_the_configured_address(private_nats, dsec_cli) -> None:
    """A real service start (NATS, its certified key): the container setting reaches it."""
    home, url = private_nats
    trust.stack_root(home)  # the operator's root key, which certifies the service's key
    env = {"DSEC_HOME": str(home), "DSEC_NATS_URL": url}
    issued = dsec_cli("admin", "issue-service", "policy", "--home", str(home), env=env)
    assert issued.exit_code == 0, issued.output
    nc = await nats.connect(url)
    await ensure_stream(nc.jetstream())
    await nc.close()
    outside = _outside_address()
    with contextlib.closing(socket.socket()) as s:
        s.bind(("0.0.0.0", 0))
        port = s.getsockname()[1]
    settings = Settings(home=home, nats_url=url, metrics_host="0.0.0.0", metrics_port=port)
    svc = Service("policy", settings)
    await svc.start()
    try:
        assert await _healthz(outside, port) == 200
    finally:
        await svc.stop()
    default = Service("policy", Settings(home=home, nats_url=url))
    await default.start()
    try:
        port = default.metrics.port
        assert await _healthz("127.0.0.1", port) == 200
        assert await _refused(outside, port)
    finally:
        await default.stop()
