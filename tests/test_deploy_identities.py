"""The compose file's `identities` job, run as written (its paths moved under a temporary
directory): a root key created once, each service given only its own certified key, certificate
and NATS seed, and the same identity after a redeploy, which a real service start and
`dsec audit verify` accept."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
import yaml
from dsec_core import identity
from dsec_core.bus import ensure_stream
from dsec_core.events import SpecRejected
from dsec_core.service import Service
from dsec_core.settings import Settings
from dsec_testing.stack import StackFixture

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def _identities_job(tmp: Path, dsec_cli_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run the job's script from docker-compose.yml with its volumes mapped under ``tmp``."""
    job = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["identities"]
    script = job["command"][0].replace("$$", "$")
    for inside, outside in (
        ("/var/lib/dsec-operator", tmp / "dsec-root"),
        ("/out/", f"{tmp / 'dsec-identities'}/"),
        ("/in/nats", tmp / "nats"),
    ):
        script = script.replace(inside, str(outside))
    env = {
        **dsec_cli_env,
        **job["environment"],
        "DSEC_HOME": str(tmp / "dsec-root"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    return subprocess.run(
        ["/bin/sh", "-euc", script], env=env, capture_output=True, text=True, timeout=120
    )


@pytest.fixture
def private_nats(tmp_path: Path) -> Iterator[str]:
    fixture = StackFixture(tmp_path / "stack")
    try:
        yield fixture.nats_url
    finally:
        fixture.close()


def _container_home(tmp: Path, service: str, n: int) -> Path:
    """A fresh container's DSEC_HOME with the job's read-only subpaths mounted in."""
    home = tmp / f"{service}-container-{n}"
    home.mkdir()
    shutil.copytree(tmp / "dsec-identities" / service / "keys", home / "keys")
    shutil.copytree(tmp / "dsec-identities" / "public" / "trust", home / "trust")
    return home


@pytest.mark.skipif(os.geteuid() != 0, reason="the job hands files to uid 10001 (root only)")
async def test_identities_are_created_once_and_survive_a_redeploy(
    tmp_path, private_nats, dsec_cli
) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")}
    made = dsec_cli("nats", "credentials", str(tmp_path / "nats"), "--json")
    assert made.exit_code == 0, made.output
    first = _identities_job(tmp_path, clean)
    assert first.returncode == 0, first.stderr
    out = tmp_path / "dsec-identities"
    root_key = (tmp_path / "dsec-root" / "trust" / "root.key").read_bytes()
    for role in identity.SERVICE_ROLES:
        files = sorted(p.name for p in (out / role).rglob("*") if p.is_file())
        assert files == sorted([f"{role}.key", f"{role}.cert.json", f"{role}.nk"]), role
        for f in (out / role).rglob("*"):
            assert f.stat().st_uid == 10001, f
            if f.is_file():
                assert f.stat().st_mode & 0o077 == 0, f
    assert sorted(p.name for p in (out / "public" / "trust").iterdir()) == ["root.pub"]
    assert not any(p.name == "root.key" for p in out.rglob("*"))  # the root key stays put
    key_before = (out / "policy" / "keys" / "policy.key").read_bytes()

    nc = await nats.connect(private_nats)
    await ensure_stream(nc.jetstream())
    await nc.close()
    key_ids = []
    for n in range(2):
        if n:  # a redeploy: the job runs again, the container is new
            again = _identities_job(tmp_path, clean)
            assert again.returncode == 0, again.stderr
        home = _container_home(tmp_path, "policy", n)
        svc = Service("policy", Settings(home=home, nats_url=private_nats, stream_check_s=60))
        await svc.start()
        try:
            assert svc.publisher is not None
            key_ids.append(svc.publisher.signer.key_id)
            await svc.publisher.publish(
                SpecRejected(errors=[{"msg": "x"}]), aggregate_id=f"sbx_{n}"
            )
        finally:
            await svc.stop()
    assert key_ids[0] == key_ids[1]
    assert (out / "policy" / "keys" / "policy.key").read_bytes() == key_before
    assert (tmp_path / "dsec-root" / "trust" / "root.key").read_bytes() == root_key
    anchor = (out / "public" / "trust" / "root.pub").read_text().strip()
    cli_env = {"DSEC_NATS_URL": private_nats, "DSEC_HOME": str(tmp_path / "cli")}
    verify = dsec_cli("audit", "verify", "--json", env={**cli_env, "DSEC_TRUST_ROOT": anchor})
    assert verify.exit_code == 0, verify.output
    result = verify.last_json()
    assert result["ok"] and result["producers"] == ["policy"] and result["chains"] == 2, result
