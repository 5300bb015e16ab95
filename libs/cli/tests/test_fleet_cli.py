"""``dsec fleet simulate``: its input checks and a measured run (no bus needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dsec_cli.main import app
from dsec_core import identity
from typer.testing import CliRunner

pytestmark = pytest.mark.unit

runner = CliRunner()


def test_exactly_one_inventory_source_is_asked_for(tmp_path: Path) -> None:
    result = runner.invoke(app, ["fleet", "simulate"], env={"DSEC_HOME": str(tmp_path)})
    assert result.exit_code == 2
    assert "give exactly one of --nodes-csv FILE, --inventory FILE, --nodes N" in result.output


def test_without_the_stacks_fleetsim_identity_it_says_how_to_get_one(tmp_path: Path) -> None:
    result = runner.invoke(
        app, ["fleet", "simulate", "--nodes", "2"], env={"DSEC_HOME": str(tmp_path)}
    )
    assert result.exit_code == 2
    assert "no NATS identity for the simulated fleet" in result.output
    assert "dsec down && dsec up" in result.output


def test_a_bad_inventory_is_located_by_the_simulation(tmp_path: Path) -> None:
    csv = tmp_path / "nodes.csv"
    csv.write_text("sn,cpu_milli,memory_mib,gpu,model\nn1,64000,1024,2,Z9\n")
    identity.ensure_root(identity.TrustPaths(tmp_path))
    result = runner.invoke(
        app,
        ["fleet", "simulate", "--nodes-csv", str(csv), "--measure"],
        env={"DSEC_HOME": str(tmp_path)},
    )
    assert result.exit_code == 2, result.output


def test_measure_reports_the_signing_cost_and_stream_size(tmp_path: Path) -> None:
    identity.ensure_root(identity.TrustPaths(tmp_path))
    result = runner.invoke(
        app,
        ["fleet", "simulate", "--nodes", "20", "--gpus", "8", "--measure", "--json"],
        env={"DSEC_HOME": str(tmp_path)},
    )
    assert result.exit_code == 0, result.output
    line = json.loads(result.output.strip().splitlines()[-1])
    assert line["event"] == "measured" and line["nodes"] == 20
    assert line["sign_us_per_heartbeat"] > 0 and line["bytes_per_heartbeat"] > 1000
    assert line["stream_mib_per_node_hour"] > 0
