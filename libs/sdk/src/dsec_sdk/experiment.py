"""What an agent under ``dsec experiment run`` uses (docs/experiments.md).

from dsec_sdk.experiment import inputs, result, trial

for item in inputs():                 # a dataset's rows (none when replaying a recording)
    ...
result("u1", {"label": "risky"})      # one line the experiment scores: DSEC_RESULT {...}
trial()                               # ("a", 2): this run's variant and repeat
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

RESULT_PREFIX: Final = "DSEC_RESULT "
ENV_TRIAL: Final = "DSEC_TRIAL"
ENV_INPUTS: Final = "DSEC_EXPERIMENT_INPUTS"


def result(input_id: str, output: Any) -> None:
    """Report this run's ``output`` for input ``input_id`` (JSON-serialisable) on stdout."""
    line = json.dumps({"input": str(input_id), "output": output}, separators=(",", ":"))
    sys.stdout.write(RESULT_PREFIX + line + "\n")
    sys.stdout.flush()


def trial() -> tuple[str, int] | None:
    """``(variant, repeat)`` of this run under an experiment, else ``None``."""
    raw = os.environ.get(ENV_TRIAL, "")
    variant, sep, repeat = raw.rpartition(":")
    if not sep or not repeat.isdigit():
        return None
    return variant, int(repeat)


def inputs() -> Iterator[dict[str, Any]]:
    """The rows of the experiment's dataset (JSON lines), if it runs over one."""
    path = os.environ.get(ENV_INPUTS)
    if not path:
        return
    with Path(path).open() as rows:
        for line in rows:
            if line.strip():
                yield json.loads(line)
