"""Shared-memory channels: memfd rings, eventfd wake-ups, MessagePack frames, the broker protocol.

Agent code uses :class:`dsec_sdk.DSecClient`; this package is the machinery under it (and what the
node agent's broker builds on).
"""

from dsec_sdk.ipc.channel import (
    DEFAULT_CAPACITY,
    DEFAULT_MAX_PAYLOAD,
    CallerEnd,
    ChannelFds,
    ServerEnd,
    create_channel,
    new_eventfd,
)
from dsec_sdk.ipc.ring import Ring

__all__ = [
    "DEFAULT_CAPACITY",
    "DEFAULT_MAX_PAYLOAD",
    "CallerEnd",
    "ChannelFds",
    "Ring",
    "ServerEnd",
    "create_channel",
    "new_eventfd",
]
