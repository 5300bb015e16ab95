"""End a process without the interpreter's teardown.

Python's own shutdown frees every module and object one by one: about 0.1 s for the CLI once
the event models are loaded, and about 0.2 s for a service (nats-py, FastStream, the event
models, a node agent's kernel layers) — longer than some commands take, and most of the time a
stack's ``dsec down`` spends waiting for each service to exit after it stopped cleanly.
:func:`leave` does what that shutdown does that anyone can observe (the ``atexit`` handlers,
flushing the output) and ends the process, when nothing else can still be writing: only the
calling thread runs. Otherwise it returns, and the caller exits the usual way.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import Any


def leave(code: Any, *, force: bool = False) -> None:
    """End the process with ``code`` as ``SystemExit(code)`` would, skipping the interpreter's
    teardown, when only this thread runs; else return (the caller raises or returns).
    ``force``: end it even while other threads run (a stopped service whose abandoned work
    would keep it alive)."""
    if threading.active_count() > 1 and not force:
        return
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code
    else:
        print(code, file=sys.stderr)
        status = 1
    atexit._run_exitfuncs()  # (logging's shutdown among them: its handlers are flushed)
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            # A reader that went away (`dsec events tail | head`) or a closed stream: as
            # Python's own exit does, the lost output makes the status 120 unless it failed.
            status = status or 120
    os._exit(status)
