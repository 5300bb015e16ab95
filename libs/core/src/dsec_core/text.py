"""Text a sandbox (or any untrusted source) wrote, made safe to store and to print.

One rule everywhere (node agent before signing, CLI before printing): control characters are
shown, never executed. C0 controls (newline, carriage return, escape, ...), DEL, C1 controls
and the Unicode bidirectional overrides/isolates become visible escapes (``\\x1b``, ``\\n``,
``\\u202e``); everything else is kept. ``bound`` also cuts the text to a length.
"""

from __future__ import annotations

import json
import re
from typing import Any

_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# C0, DEL, C1, and the bidi embeddings/overrides/isolates and marks that reorder what is shown.
_UNSAFE = re.compile(
    "[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\ufeff\u2028\u2029]"
)


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape_controls(text: str) -> str:
    """``text`` with every control and bidi-override character replaced by a visible escape."""
    return _UNSAFE.sub(_escape, text)


def bound(text: str, limit: int) -> str:
    """Escaped ``text``, at most ``limit`` characters (an ellipsis marks a cut)."""
    safe = escape_controls(text)
    if len(safe) <= limit:
        return safe
    return safe[: max(limit - 1, 0)] + "…"


def untrusted_json(data: bytes | str) -> Any:
    """``json.loads`` for bytes from outside (an object in the bucket, a file a sandbox wrote):
    anything malformed is a ``ValueError``, JSON nested past the parser's stack (``[`` a few
    thousand times, which raises ``RecursionError``) included."""
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
