"""The CLI is a client of the bus and the read models: importing any of its modules (or the
fixtures a user's tests use) loads no service package. Lazy imports inside functions are
caught by the ruff ban (TID251 in libs/cli/pyproject.toml)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SERVICES = (
    "dsec_policy",
    "dsec_builder",
    "dsec_snapshot",
    "dsec_scheduler",
    "dsec_nodeagent",
    "dsec_fleetsim",
)

PROBE = """
import importlib, json, pkgutil, sys
import dsec_cli, dsec_testing
names = []
for package in (dsec_cli, dsec_testing):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
        names.append(info.name)
services = sorted(m for m in sys.modules if m.split(".")[0] in SERVICES)
print(json.dumps({"imported": names, "services": services}))
""".replace("SERVICES", repr(SERVICES))


def test_no_cli_module_imports_a_service() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert "dsec_cli.commands.sandbox" in found["imported"]  # the probe did import the CLI
    assert "dsec_cli.remote" in found["imported"] and "dsec_testing.stack" in found["imported"]
    assert found["services"] == []
