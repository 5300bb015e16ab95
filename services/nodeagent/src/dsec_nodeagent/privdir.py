"""A directory of the node agent's own in a place every user may write (``/dev/shm``).

Names there can be predicted (node ids and migration ids are on the bus), so another local
user may have made the entry first, as a directory of theirs or a link, to read or swap what
the node agent would put in it. :func:`own_directory` makes sure the entry is a directory of
this process's uid, mode ``0700``, made by it: running as root it removes a planted entry
(never following a link) and makes its own, a few times if raced; otherwise it refuses.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
from pathlib import Path

log = logging.getLogger(__name__)


class UnsafeDirectory(OSError):
    """The entry is not this process's own directory and could not be made so."""


def own_directory(path: Path, attempts: int = 4) -> None:
    """Make ``path`` a ``0700`` directory of this process's uid (see the module docstring)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for attempt in range(attempts):
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        st = os.lstat(path)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            os.chmod(path, 0o700)
            return
        kind = "a directory" if stat.S_ISDIR(st.st_mode) else "not a directory"
        if os.geteuid() != 0 or attempt == attempts - 1:
            raise UnsafeDirectory(
                f"{path} is {kind} of uid {st.st_uid}, not this node agent's (uid "
                f"{os.geteuid()}): another user may have made it to read or replace what the "
                "node agent keeps there; remove it and try again"
            )
        log.warning(
            "%s was %s of uid %d, not ours: removed (someone may have planted it)",
            path,
            kind,
            st.st_uid,
        )
        if stat.S_ISDIR(st.st_mode):
            shutil.rmtree(path, ignore_errors=True)  # fd-based: follows no link
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
