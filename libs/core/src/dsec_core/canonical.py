"""Canonical MessagePack bytes: the exact bytes that are signed and hashed.

Dict keys are sorted recursively, tuples become lists, datetimes are RFC 3339 UTC strings, so the
same logical value always yields the same bytes whatever the producer's insertion order.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import msgpack


def canonicalize(value: Any) -> Any:
    """Return ``value`` with dict keys sorted and non-msgpack scalars normalized."""
    if isinstance(value, dict):
        return {str(k): canonicalize(value[k]) for k in sorted(value, key=str)}
    if isinstance(value, list | tuple):
        return [canonicalize(v) for v in value]
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def pack(value: Any) -> bytes:
    """Pack an already canonical structure (no sorting)."""
    out: bytes = msgpack.packb(value, use_bin_type=True)
    return out


def unpack(data: bytes) -> Any:
    """Unpack MessagePack bytes (strict: raw strings must be valid UTF-8)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


def canonical_bytes(value: Any) -> bytes:
    """Canonicalize then pack ``value``."""
    return pack(canonicalize(value))
