"""What the state keeper's tests share: an agent's end of a state socket, speaking the wire
(``dsec_sdk.state.wire``) as the broker's ``state`` op would hand it, and the keeper's settings
on the test stack (used by ``test_state_keeper.py`` and ``tests/test_attacks_state_plane.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path
from typing import Any

from dsec_core.settings import Settings
from dsec_sdk.state import wire


class FakeAgent:
    """The agent's end of a state socket (async wire frames; ``raw`` for any bytes at all)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> FakeAgent:
        self.sock.setblocking(False)
        self.reader, self.writer = await asyncio.open_unix_connection(
            sock=self.sock, limit=wire.MAX_FRAME + 4
        )
        return self

    async def raw(self, data: bytes) -> None:
        assert self.writer is not None
        self.writer.write(data)
        await self.writer.drain()

    async def send(self, frame: dict[str, Any]) -> None:
        await self.raw(wire.encode(frame))

    async def recv(self) -> dict[str, Any]:
        assert self.reader is not None
        frame = await asyncio.wait_for(wire.read_frame(self.reader), 60)
        assert frame is not None, "the keeper closed the socket"
        return frame

    async def hello(self, agent: str, group: str, *, handover: bool = False) -> dict[str, Any]:
        await self.send(
            {"op": "hello", "v": 1, "agent": agent, "group": group, "handover": handover}
        )
        return await self.recv()

    async def fetch(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        await self.send({"op": "fetch"})
        records: list[dict[str, Any]] = []
        while True:
            frame = await self.recv()
            if frame["op"] != "records":
                return records, frame
            records.extend(frame["records"])

    async def checkpoint(
        self, seq: int, records: list[dict[str, Any]], *, final: bool = False
    ) -> dict[str, Any]:
        await self.send(
            {
                "op": "checkpoint",
                "seq": seq,
                "records": records,
                "pause_ms": 0.5,
                "tiers": ["hot", "warm", "cold"],
                "final": final,
            }
        )
        return await self.recv()

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            with contextlib.suppress(Exception):
                await self.writer.wait_closed()


def keeper_settings(home: Path, nats_url: str, s3: Any, vault: Any, node_id: str) -> Settings:
    """A node agent's settings on the test stack (its NATS, S3 and OpenBao)."""
    return Settings(
        home=home,
        nats_url=nats_url,
        s3_endpoint=s3.endpoint,
        s3_access_key=s3.access_key,
        s3_secret_key=s3.secret_key,
        s3_bucket=s3.bucket,
        vault_addr=vault.addr,
        vault_token=vault.token,
        node_id=node_id,
    )
