"""What ``dsec audit verify`` reports, without the verifier.

The report's types (:class:`VerifyReport`, :class:`Finding`, :class:`Injected`) and the
verifier's settings live here, apart from :mod:`dsec_core.audit`, whose verifier needs the
event models, identities and signatures: a third of a second of imports. ``dsec audit verify``
reads the stream in a process that never loads them, while its forked verifier loads them on
the other core (:mod:`dsec_core.audit_worker`); the report it sends back unpickles with this
module alone. :mod:`dsec_core.audit` re-exports every name.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

# A chain's newest signature is checked at least this often (and every chain's at the end).
SIGNATURE_EVERY = 256


def c_path_wanted() -> bool:
    """Whether the verifier's C path (``dsec_core/_auditfast.c``: its common case) may be used
    where built: ``DSEC_AUDIT_PURE_PYTHON`` unset or a no. (The same reading as the SDK's
    ``DSEC_IPC_PURE_PYTHON``, which cannot share it: importing the ``dsec_core`` package would
    cost an agent's start-up ~30 ms.)

    Raises:
        ValueError: ``DSEC_AUDIT_PURE_PYTHON`` is neither a yes nor a no.
    """
    raw = os.environ.get("DSEC_AUDIT_PURE_PYTHON", "")
    value = raw.strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return True
    if value in ("1", "true", "yes", "on"):
        return False
    raise ValueError(
        f"DSEC_AUDIT_PURE_PYTHON={raw!r} is invalid: use 1/true/yes/on (the verifier's Python "
        "path alone) or 0/false/no/off or unset (its C path when built)"
    )


@dataclass(frozen=True)
class Finding:
    """The first event that shows tampering, and why."""

    stream_seq: int
    event_id: str | None
    event_type: str | None
    producer: str | None
    reason: str


@dataclass
class Injected:
    """A foreign message nobody may act on: listed, with the refusals that answered it."""

    stream_seq: int
    event_id: str | None
    event_type: str | None
    producer: str | None
    reason: str
    answered_by: list[int] = field(default_factory=list)


@dataclass
class VerifyReport:
    """Result of a verification run."""

    events: int = 0
    producers: set[str] = field(default_factory=set)
    chains: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    finding: Finding | None = None
    injected: list[Injected] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when the trail was not tampered with (injected-and-ignored messages allowed)."""
        return self.finding is None


@contextmanager
def fewer_collections(threshold: int = 50_000) -> Iterator[None]:
    """Run the cyclic garbage collector less often while a log is verified (process-wide,
    restored after). Each event allocates a few dicts that reference counting frees (no cycles),
    yet at the default threshold (700 allocations) a collection runs every hundred events or
    so: a fifth of the verifier's time."""
    before = gc.get_threshold()
    gc.set_threshold(max(threshold, before[0]), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)
