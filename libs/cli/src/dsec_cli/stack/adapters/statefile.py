"""``$DSEC_HOME/stack.json``: read, write atomically with mode 0600, and an exclusive lock so two
``dsec up``/``down`` never interleave."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from dsec_cli.stack.adapters.servers import write_private
from dsec_cli.stack.domain import StackState, parse_state

STATE_FILE = "stack.json"


def state_path(home: Path) -> Path:
    return home / STATE_FILE


def load_state(home: Path) -> StackState | None:
    """The saved state, or ``None`` when the stack was never started here.

    Raises:
        StackStateError: the file exists but is not a valid state.
    """
    path = state_path(home)
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    return parse_state(text, str(path))


def save_state(home: Path, state: StackState) -> None:
    """Write the state atomically (temp + rename), mode 0600: it holds secrets."""
    home.mkdir(parents=True, exist_ok=True)
    write_private(state_path(home), state.to_json())


@contextlib.contextmanager
def locked(home: Path) -> Iterator[None]:
    """Hold ``<home>/.stack.lock`` exclusively (blocks while another ``dsec`` holds it)."""
    home.mkdir(parents=True, exist_ok=True)
    fd = os.open(home / ".stack.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
