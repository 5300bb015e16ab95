"""Fixtures shared by the service runtime's tests."""

from __future__ import annotations

import faststream.nats.message as messages
import pytest


@pytest.fixture
def nacked(monkeypatch: pytest.MonkeyPatch) -> list[tuple[bytes, float | None]]:
    """Every NAK a service sends: the message's bytes and the delay asked for."""
    seen: list[tuple[bytes, float | None]] = []
    nack = messages.NatsMessage.nack

    async def counted(self: messages.NatsMessage, delay: float | None = None) -> None:
        seen.append((self.raw_message.data, delay))
        await nack(self, delay=delay)

    monkeypatch.setattr(messages.NatsMessage, "nack", counted)
    return seen
