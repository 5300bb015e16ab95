"""Canonical MessagePack bytes: the exact bytes that are signed and hashed.

Dict keys are sorted recursively, tuples become lists, datetimes are RFC 3339 UTC strings, so the
same logical value always yields the same bytes whatever the producer's insertion order.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import blake3
import msgpack
import msgspec


class Canonical(dict[str, Any]):
    """A mapping already in canonical form (string keys in sorted order, every value canonical):
    :func:`canonicalize` returns it as is instead of walking it again. For a producer that signs
    the same large sub-structure over and over (a simulated node's GPUs in each heartbeat); who
    builds one vouches that it is canonical (``Canonical(canonicalize(x))``)."""

    __slots__ = ()


def canonicalize(value: Any) -> Any:
    """Return ``value`` with dict keys sorted and non-msgpack scalars normalized."""
    if isinstance(value, dict):
        if type(value) is Canonical:
            return value
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


_SORTED = msgspec.msgpack.Encoder(order="sorted")


def pack_json(value: Any) -> bytes:
    """Canonical bytes of a JSON-mode structure (what ``model_dump(mode="json")`` returns:
    string keys; str, int, float, bool, None, list, tuple, dict values; ``Raw`` pre-encoded
    canonical bytes), in one C call.

    Equal byte for byte to :func:`canonical_bytes` for such values: msgspec writes every
    integer, string, array and map in its smallest form, floats as ``float 64``, and sorts
    map keys by code point (= their UTF-8 bytes); ``libs/core/tests/test_canonical_fast.py``
    checks it on generated values and every event type. Not for other values (datetimes,
    bytes, non-string keys): :func:`canonical_bytes` normalizes those, this does not.
    """
    out: bytes = _SORTED.encode(value)
    return out


Raw = msgspec.Raw
"""Already canonical bytes to embed in :func:`pack_json` as they are (a signed payload)."""


def unpack(data: bytes) -> Any:
    """Unpack MessagePack bytes (strict: raw strings must be valid UTF-8)."""
    return msgpack.unpackb(data, raw=False, strict_map_key=True)


def canonical_bytes(value: Any) -> bytes:
    """Canonicalize then pack ``value``."""
    return pack(canonicalize(value))


def envelope_hash(wire: bytes) -> str:
    """Return the chain hash of an envelope's wire bytes (BLAKE3, hex): each envelope's
    ``prev`` is its predecessor's. (Here, not in :mod:`dsec_core.signing`, which re-exports
    it: a reader of the stream hashes without loading the event models.)"""
    return blake3.blake3(wire).hexdigest()
