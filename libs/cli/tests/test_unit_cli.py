"""`dsec unit`: a migration's row from its events (the first terminal event decides) and the
line a person reads; bad input is refused before anything is published."""

from __future__ import annotations

import pytest
from dsec_cli.commands.unit import describe, outcome
from dsec_cli.main import app
from typer.testing import CliRunner

pytestmark = pytest.mark.unit

STARTED = {"unit": "main", "migration_id": "m1", "from_node": "a", "to_node": "b",
           "from_gpus": [2], "to_gpus": [0], "reason": "gpu_degraded", "path": "criu"}  # fmt: skip


def test_a_migration_row_and_its_line() -> None:
    moved = {**STARTED, "interruption_ms": 31.4, "bytes_moved": 8 << 30}
    row = outcome([("unit.migration_started", STARTED), ("unit.migrated", moved)])
    assert (row["outcome"], row["from_node"], row["to_node"], row["path"]) == (
        "migrated", "a", "b", "criu"
    )  # fmt: skip
    assert describe(row) == (
        "unit main moved a (GPU 2) → b (GPU 0) by criu: interrupted 31.4 ms, 8.0 GiB moved"
    )
    late = ("unit.migration_failed", {**STARTED, "reason": "late", "stage": "timeout"})
    assert outcome([("unit.migration_started", STARTED), ("unit.migrated", moved), late]) == row
    refused = {"unit": "main", "migration_id": "m2", "from_node": "a", "to_node": "cpu-0",
               "reason": "cpu-0 cannot take unit main: 0/1 nodes: 1 no GPU", "stage": "choose",
               "still_running": True}  # fmt: skip
    row = outcome([("unit.migration_failed", refused)])
    assert (row["outcome"], row["stage"], row["still_running"]) == ("failed", "choose", True)
    assert describe(row).endswith("— it still runs on a") and "no GPU" in describe(row)


def test_bad_input_is_refused_before_anything_is_published() -> None:
    out = CliRunner().invoke(app, ["unit", "migrate", "not a sandbox!", "--json"])
    assert out.exit_code == 2 and "bad_input" in out.output
    out = CliRunner().invoke(app, ["unit", "migrations", "--limit", "0", "--json"])
    assert out.exit_code == 2 and "--limit" in out.output
