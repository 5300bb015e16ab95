"""Hand-made ELF files for the discovery tests: the headers a loader reads, nothing else.

``mkelf(needed, runpath=..., rpath=..., interp=...)`` returns the bytes of a shared object (or,
``etype=2``, a program) of the given class (``cls``: 1 or 2), byte order (``data``: 1 little,
2 big) and machine, whose only segments are one ``PT_LOAD`` over the whole file, ``PT_DYNAMIC``
and, with ``interp``, ``PT_INTERP``.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence


def mkelf(
    needed: Sequence[str] = (),
    runpath: str | None = None,
    rpath: str | None = None,
    interp: str | None = None,
    cls: int = 2,
    data: int = 1,
    machine: int = 62,
    etype: int = 3,
) -> bytes:
    end = "<" if data == 1 else ">"
    wide = cls == 2
    ehsize, phentsize = (64, 56) if wide else (52, 32)
    strtab = bytearray(b"\0")
    offsets: dict[str, int] = {}

    def string(text: str) -> int:
        if text not in offsets:
            offsets[text] = len(strtab)
            strtab.extend(text.encode() + b"\0")
        return offsets[text]

    dyn = [(1, string(n)) for n in needed]
    if runpath is not None:
        dyn.append((29, string(runpath)))
    if rpath is not None:
        dyn.append((15, string(rpath)))
    nph = 2 + (interp is not None)
    phoff = ehsize
    dynoff = phoff + nph * phentsize
    entry = 16 if wide else 8
    strtaboff = dynoff + (len(dyn) + 2) * entry
    dyn = [(5, strtaboff), *dyn, (0, 0)]
    interpoff = strtaboff + len(strtab)
    body_interp = (interp.encode() + b"\0") if interp else b""
    total = interpoff + len(body_interp)
    ident = b"\x7fELF" + bytes([cls, data, 1, 0]) + bytes(8)
    head_fmt, ph_fmt, dyn_fmt = (
        ("HHIQQQIHHHHHH", "IIQQQQQQ", "qQ") if wide else ("HHIIIIIHHHHHH", "IIIIIIII", "iI")
    )
    fields = (etype, machine, 1, 0, phoff, 0, 0, ehsize, phentsize, nph, 64 if wide else 40, 0, 0)
    head = ident + struct.pack(end + head_fmt, *fields)

    def ph(kind: int, off: int, size: int) -> bytes:
        if wide:  # type, flags, offset, vaddr, paddr, filesz, memsz, align
            return struct.pack(end + ph_fmt, kind, 4, off, off, off, size, size, 8)
        return struct.pack(end + ph_fmt, kind, off, off, off, size, size, 4, 4)

    def de(tag: int, value: int) -> bytes:
        return struct.pack(end + dyn_fmt, tag, value)

    phs = ph(1, 0, total) + ph(2, dynoff, len(dyn) * entry)
    if interp is not None:
        phs += ph(3, interpoff, len(body_interp))
    out = head + phs + b"".join(de(t, v) for t, v in dyn) + bytes(strtab) + body_interp
    assert len(out) == total
    return out
