"""An evaluation agent for the snapshot part of the DSec demo.

It reads its decision threshold from ``config.txt`` next to it and reports it twice a second, so
a change of its code while it runs (and a rollback) shows in ``dsec sandbox logs``. It stops by
itself after two minutes.
"""

import pathlib
import time

HERE = pathlib.Path(__file__).resolve().parent
DEADLINE = time.monotonic() + 120

while time.monotonic() < DEADLINE:
    threshold = (HERE / "config.txt").read_text().strip()
    print(f"evaluating with threshold {threshold}", flush=True)
    time.sleep(0.5)
