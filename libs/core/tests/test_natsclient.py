"""A command a person waits on learns at once that nothing listens at the NATS URL."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import pytest
from dsec_core.natsclient import NatsSettingsError, connect, refused_everywhere
from dsec_core.settings import Settings

pytestmark = pytest.mark.unit


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed once this returns: nothing listens


async def test_only_a_url_whose_every_server_refuses_is_refused() -> None:
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    listening = server.sockets[0].getsockname()[1]
    closed = _closed_port()
    try:
        assert await refused_everywhere(f"nats://127.0.0.1:{closed}")
        assert await refused_everywhere(f"nats://u:p@127.0.0.1:{closed},127.0.0.1:{closed}")
        assert not await refused_everywhere(f"nats://127.0.0.1:{listening}")
        assert not await refused_everywhere(
            f"nats://127.0.0.1:{closed},nats://127.0.0.1:{listening}"
        )  # one server up: nats-py connects to it
        with pytest.raises(NatsSettingsError, match="notaport") as bad:  # said at once
            await refused_everywhere("nats://u:s3cret@127.0.0.1:notaport")
        assert "s3cret" not in str(bad.value)
        why = await refused_everywhere(f"nats://127.0.0.1:{closed},nats://no-such-host.invalid")
        assert why == f"nothing listens at 127.0.0.1:{closed}; no such host 'no-such-host.invalid'"
    finally:
        server.close()
        await server.wait_closed()


async def test_fail_fast_raises_connection_refused_instead_of_retrying(tmp_path: Path) -> None:
    settings = Settings(nats_url=f"nats://127.0.0.1:{_closed_port()}", home=tmp_path)
    with pytest.raises(ConnectionRefusedError, match=r"nothing listens at 127\.0\.0\.1:"):
        await connect(settings, "test", fail_fast=True, max_reconnect_attempts=3)


async def test_the_port_probed_is_the_one_nats_py_connects_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A WebSocket URL without a port is port 80 (443 for wss) to nats-py, not 4222: probing
    # 4222, where nothing listens, called a working server unreachable.
    probed: list[tuple[str, int]] = []

    async def refuse(host: str, port: int, **_: object) -> None:
        probed.append((host, port))
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(asyncio, "open_connection", refuse)
    for url in ("ws://nats.example", "wss://u:p@nats.example", "tls://nats.example", "h"):
        await refused_everywhere(url)
    assert probed == [
        ("nats.example", 80),
        ("nats.example", 443),
        ("nats.example", 4222),
        ("h", 4222),
    ]
