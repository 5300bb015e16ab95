"""``dsec-client`` installs without the services' dependencies (``dsec-core[service]``): in a
Python where FastStream, asyncpg, aiohttp, Prometheus' client and hvac cannot be imported,
``import dsec_client`` works, a client is made and the modules it needs to submit, follow,
verify and talk to node agents load. It imports neither the CLI nor any service."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SERVICE_EXTRA = ("faststream", "asyncpg", "aiohttp", "prometheus_client", "hvac")
NOT_BELOW = (
    "dsec_cli",
    "dsec_testing",
    "dsec_policy",
    "dsec_builder",
    "dsec_snapshot",
    "dsec_scheduler",
    "dsec_nodeagent",
    "dsec_fleetsim",
)

PROBE = """
import importlib.abc, json, sys

BLOCKED = BLOCKED_NAMES

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"blocked: {name}", name=name)
        return None

sys.meta_path.insert(0, Refuse())
import dsec_client
from dsec_client import DSec, DSecSync
from dsec_core.settings import Settings

# What the client loads when it works (lazily, inside its methods): the bus, the trust gate,
# the NATS client, the code bundle and the object store.
for name in ("dsec_core.bus", "dsec_core.trust", "dsec_core.natsclient", "dsec_core.codebundle",
             "dsec_core.objectstore", "dsec_core.remote", "nats", "nats.js", "minio"):
    importlib.import_module(name)
client = DSec(Settings(nats_url="nats://127.0.0.1:1"))
sync = DSecSync(Settings(nats_url="nats://127.0.0.1:1"))
sync.close()
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
""".replace("BLOCKED_NAMES", repr(SERVICE_EXTRA))


def test_client_imports_and_constructs_without_the_service_extra() -> None:
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert "dsec_client" in loaded and "nats" in loaded
    assert loaded.isdisjoint(SERVICE_EXTRA)
    assert loaded.isdisjoint(NOT_BELOW)


def test_the_blocker_does_block() -> None:
    """The probe's finder really refuses what it names (else the test above proves nothing)."""
    probe = PROBE.replace("import dsec_client\n", "import dsec_client\nimport faststream\n", 1)
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode != 0 and "blocked: faststream" in done.stderr


def test_dsec_core_declares_the_service_extra() -> None:
    """The services' dependencies are an extra of dsec-core, not its requirements."""
    from importlib.metadata import requires

    reqs = requires("dsec-core") or []
    base = [r for r in reqs if "extra ==" not in r]
    extra = [r for r in reqs if "extra ==" in r and "service" in r]
    names = {r.split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip() for r in base}
    assert names.isdisjoint({"faststream", "asyncpg", "aiohttp", "prometheus-client", "hvac"})
    assert any(r.startswith("faststream") for r in extra)
    assert any(r.startswith("asyncpg") for r in extra)
