"""How many MessagePack objects a buffer holds, counted without making them.

Decoding makes a Python object per MessagePack object, whatever its size: 64 MiB of one-byte
empty arrays is 64 million lists (~4.6 GiB, ~20 s). The state keeper counts a frame from a
sandbox before it decodes it, and refuses one over :data:`MAX_FRAME_OBJECTS`; the SDK counts
its records to cut a checkpoint into frames within that bound.

:func:`count` runs the C scan (``_msgcount.c``, without the GIL on large buffers) when the
extension was built, else :func:`count_py`, its pure-Python twin (the same answers: the tests
hold them equal). Either costs time in the number of objects, not bytes: a string, binary or
extension value's bytes are skipped.
"""

from __future__ import annotations

import struct
from typing import Any, Final

MAX_FRAME_OBJECTS: Final = 1 << 20
"""The most MessagePack objects a frame from an agent to its keeper may hold (an array or a map
counts itself and each key and element): ~70 MB of Python objects at worst once decoded."""

_msgcount: Any
try:
    from dsec_sdk.state import _msgcount  # type: ignore[attr-defined,no-redef]
except ImportError:  # (no C compiler at install: the pure-Python twin)
    _msgcount = None
_count_c: Any = None if _msgcount is None else _msgcount.count

ACCELERATED: Final = _count_c is not None

_BE: Final = {1: struct.Struct(">B"), 2: struct.Struct(">H"), 4: struct.Struct(">I")}


MAX_DEPTH: Final = 1024
"""The deepest nesting msgpack decodes (deeper is its ``StackError``): the count refuses it too."""


def count(buf: bytes | bytearray | memoryview, limit: int, *, strict: bool = False) -> int:
    """The objects of the first MessagePack value in ``buf``, or ``limit + 1`` as soon as there
    are more than ``limit``. ValueError: the value is cut short, holds the unused type byte
    0xc1, or is nested deeper than :data:`MAX_DEPTH`; with ``strict`` (what the keeper takes
    from an agent), a map key is not a str or bin (their Python hashes are salted; an int's or a
    timestamp's are not, and a map of keys made to collide costs the square of its size to
    build), or a value is an extension type (a timestamp hashes as a tuple wherever it ends up
    in a dict, and an ext decodes to two or three Python objects). Bytes after the first value
    are not read."""
    if _count_c is not None:
        result: int = _count_c(buf, limit, strict=strict)
        return result
    return count_py(buf, limit, strict=strict)


def _is_str_or_bin(b: int) -> bool:
    return 0xA0 <= b <= 0xBF or 0xD9 <= b <= 0xDB or 0xC4 <= b <= 0xC6


def count_py(buf: bytes | bytearray | memoryview, limit: int, *, strict: bool = False) -> int:
    """:func:`count` in Python (where the C extension is missing)."""
    data = bytes(buf)
    end = len(data)
    pos = 0
    pending = 1
    found = 0
    stack: list[list[int]] = []  # open containers: [elements left, is a map]
    while pending:
        if pos >= end:
            raise ValueError(f"MessagePack cut short after {found} objects")
        while stack and stack[-1][0] == 0:
            stack.pop()
        is_key = False
        if stack:
            top = stack[-1]
            is_key = bool(top[1]) and top[0] % 2 == 0
            top[0] -= 1
        b = data[pos]
        pos += 1
        pending -= 1
        found += 1
        if found > limit:
            return found
        if is_key and strict and not _is_str_or_bin(b):
            raise ValueError(f"a map key that is not a string at object {found}")
        if strict and (0xC7 <= b <= 0xC9 or 0xD4 <= b <= 0xD8):
            raise ValueError(f"an extension type (a timestamp...) at object {found}")
        skip = items = width = 0
        container = is_map = False
        if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):
            pass
        elif b <= 0x8F:
            items, container, is_map = 2 * (b & 0x0F), True, True
        elif b <= 0x9F:
            items, container = b & 0x0F, True
        elif b <= 0xBF:
            skip = b & 0x1F
        elif b == 0xC1:
            raise ValueError(f"MessagePack type byte 0xc1 (unused) at object {found}")
        elif b <= 0xC6:  # bin 8/16/32
            width = 1 << (b - 0xC4)
        elif b <= 0xC9:  # ext 8/16/32: length, then a type byte
            width, skip = 1 << (b - 0xC7), 1
        elif b <= 0xCB:  # float 32/64
            skip = 4 if b == 0xCA else 8
        elif b <= 0xD3:  # uint/int 8..64
            skip = 1 << ((b - 0xCC) & 3)
        elif b <= 0xD8:  # fixext 1..16: a type byte, then the data
            skip = 1 + (1 << (b - 0xD4))
        elif b <= 0xDB:  # str 8/16/32
            width = 1 << (b - 0xD9)
        else:  # array 16/32, map 16/32
            size = 2 if b in (0xDC, 0xDE) else 4
            if end - pos < size:
                raise ValueError(f"MessagePack cut short after {found} objects")
            (items,) = _BE[size].unpack_from(data, pos)
            pos += size
            container = True
            if b >= 0xDE:
                items, is_map = items * 2, True
        if width:
            if end - pos < width:
                raise ValueError(f"MessagePack cut short after {found} objects")
            (length,) = _BE[width].unpack_from(data, pos)
            pos += width
            skip += length
        if skip > end - pos:
            raise ValueError(f"MessagePack cut short after {found} objects")
        pos += skip
        if container:
            if len(stack) + 1 > MAX_DEPTH:  # (an empty one counts too, as msgpack's stack does)
                raise ValueError(f"nested deeper than {MAX_DEPTH} at object {found}")
            if items:
                stack.append([items, int(is_map)])
        pending += items
        if pending > end - pos:  # (each object still to read takes a byte at least)
            raise ValueError(f"MessagePack cut short after {found} objects")
    return found
