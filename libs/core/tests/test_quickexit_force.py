"""A stopped service whose abandoned work still runs in another thread leaves anyway
(``quickexit.leave(force=True)``), its exit handlers run and its output flushed."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import atexit, threading, time
from dsec_core import quickexit
threading.Thread(target=time.sleep, args=(60,)).start()  # not a daemon: exit would wait
atexit.register(lambda: print("exit handlers ran"))
print("stopped", end="")
quickexit.leave(0)  # another thread runs: returns
print(", leaving")
quickexit.leave(0, force=True)
print("never")
"""


def test_a_forced_leave_ends_the_process_with_other_threads_running() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "stopped, leaving\nexit handlers ran\n"
