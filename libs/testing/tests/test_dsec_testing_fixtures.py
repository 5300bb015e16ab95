"""The ``dsec_testing`` fixtures start real servers that behave like real servers."""

from __future__ import annotations

import asyncio
import glob
import io
import json
import urllib.request
from pathlib import Path

import asyncpg
import hvac.exceptions
import nats
import psutil
import pytest
from dsec_cli.stack import ServiceSpec, StartFailed
from dsec_core.settings import Settings
from dsec_testing import NatsRestarter, S3Info, ServiceRunner, VaultInfo
from minio.error import S3Error

pytestmark = pytest.mark.integration

FAKESVC = "dsec_testing.fakesvc"


async def test_nats_has_jetstream(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="FIXTURE", subjects=["fixture.>"])
        ack = await js.publish("fixture.a", b"hello")
        msg = await js.get_msg("FIXTURE", ack.seq)
        assert msg.data == b"hello"
    finally:
        await nc.close()


async def test_postgres_needs_the_password(postgres_dsn: str) -> None:
    conn = await asyncpg.connect(postgres_dsn)
    try:
        await conn.execute("CREATE TABLE IF NOT EXISTS fixture_rows (v int)")
        await conn.execute("INSERT INTO fixture_rows VALUES (42)")
        assert await conn.fetchval("SELECT max(v) FROM fixture_rows") == 42
        assert await conn.fetchval("SELECT current_database()") == "dsec"
    finally:
        await conn.close()
    wrong = postgres_dsn.replace("dsec:", "dsec:wrong", 1)
    with pytest.raises(
        asyncpg.InvalidPasswordError, match='password authentication failed for user "dsec"'
    ):
        await asyncpg.connect(wrong)


def test_s3_stores_objects_and_checks_signatures(s3: S3Info) -> None:
    client = s3.client()
    assert client.bucket_exists(s3.bucket)
    client.put_object(s3.bucket, "fixture/x.txt", io.BytesIO(b"abc"), 3)
    resp = client.get_object(s3.bucket, "fixture/x.txt")
    try:
        assert resp.read() == b"abc"
    finally:
        resp.close()
        resp.release_conn()
    forged = S3Info(s3.endpoint, s3.access_key, "not-the-secret", s3.bucket)
    with pytest.raises(S3Error) as info:
        forged.client().list_buckets()
    assert info.value.code == "SignatureDoesNotMatch"


def test_vault_kv_and_token_auth(vault: VaultInfo) -> None:
    client = vault.client()
    client.secrets.kv.v2.create_or_update_secret(path="fixture", secret={"k": "v"})
    read = client.secrets.kv.v2.read_secret_version(path="fixture", raise_on_deleted_version=True)
    assert read["data"]["data"] == {"k": "v"}
    intruder = VaultInfo(vault.addr, "not-a-token").client()
    with pytest.raises(hvac.exceptions.Forbidden):
        intruder.secrets.kv.v2.read_secret_version(path="fixture", raise_on_deleted_version=True)


def test_stack_env_is_what_settings_read(
    stack_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in stack_env.items():
        monkeypatch.setenv(key, value)
    settings = Settings()
    assert settings.nats_url == stack_env["DSEC_NATS_URL"]
    assert settings.postgres_dsn == stack_env["DSEC_POSTGRES_DSN"]
    assert settings.s3_endpoint == stack_env["DSEC_S3_ENDPOINT"]
    assert settings.vault_token == stack_env["DSEC_VAULT_TOKEN"]
    assert settings.home.is_dir()
    assert settings.stack_state["nats_url"] == stack_env["DSEC_NATS_URL"]
    # NATS as the local tenant's user, the identity the CLI has after `dsec up`
    assert settings.nats_nkey_seed is not None and settings.nats_nkey_seed.name == "user-default.nk"
    assert set(stack_env) == {
        "DSEC_HOME", "DSEC_NATS_URL", "DSEC_POSTGRES_DSN", "DSEC_S3_ENDPOINT",
        "DSEC_S3_ACCESS_KEY", "DSEC_S3_SECRET_KEY", "DSEC_VAULT_ADDR", "DSEC_VAULT_TOKEN",
        "DSEC_S3_BUCKET", "DSEC_NATS_NKEY_SEED", "DSEC_TRUST_ROOT", "DSEC_CREDENTIAL",
        "DSEC_METRICS_HOST",
    }  # fmt: skip
    assert settings.trust_root is not None and len(bytes.fromhex(settings.trust_root)) == 32
    assert settings.metrics_host == "127.0.0.1"  # a 0.0.0.0 in the shell never leaks in


async def test_nats_restart_keeps_acknowledged_messages(
    nats_url: str, nats_restart: NatsRestarter
) -> None:
    nc = await nats.connect(nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.05)
    try:
        js = nc.jetstream()
        await js.add_stream(name="RESTART", subjects=["restart.>"])
        acked = [await js.publish("restart.x", f"m{i}".encode()) for i in range(20)]
        await nats_restart.arestart(kill=True)  # a crash: SIGKILL, same port, same store
        assert nats_restart.count == 1

        async def published_after_restart() -> int:
            while True:
                try:
                    return (await js.publish("restart.x", b"after", timeout=1)).seq
                except (nats.errors.TimeoutError, nats.js.errors.NoStreamResponseError):
                    await asyncio.sleep(0.05)  # reconnecting

        seq_after = await asyncio.wait_for(published_after_restart(), timeout=20)
        assert seq_after == acked[-1].seq + 1
        for ack in acked:
            msg = await js.get_msg("RESTART", ack.seq)
            assert msg.data == f"m{ack.seq - 1}".encode()
    finally:
        await nc.close()


def test_services_start_kill_restart(services: ServiceRunner, stack_env: dict[str, str]) -> None:
    spec = ServiceSpec("fake", module=FAKESVC)
    services.start(spec, env={"FAKESVC_NAME": "fake"})
    health = json.loads(urllib.request.urlopen(services.url("fake") + "/healthz").read())
    assert health == {"status": "ok", "service": "fake", "version": "0.0.1"}
    first = services.pid("fake")
    assert first is not None

    services.kill("fake")
    assert services.pid("fake") is None
    assert not psutil.pid_exists(first)  # really gone (and reaped), not just forgotten
    services.restart("fake")
    second = services.pid("fake")
    assert second is not None and second != first
    assert psutil.Process(second).cmdline()[-2:] == ["-m", FAKESVC]
    assert "serving on" in services.log("fake")


def test_service_that_crashes_is_reported_with_its_log(services: ServiceRunner) -> None:
    with pytest.raises(StartFailed) as info:
        services.start(ServiceSpec("crashy", module=FAKESVC), env={"FAKESVC_MODE": "crash"})
    reason, log_tail = info.value.failures["crashy"]
    assert reason == "exited with status 3"
    assert "crashing on purpose" in log_tail


def test_a_discarded_stack_leaves_no_process_port_or_socket(tmp_path: Path) -> None:
    """``discard`` kills the object store instead of waiting for its shutdown, and still leaves
    nothing behind: no process, no listening port, none of the sockets weed makes in /tmp."""
    from dsec_testing.stack import StackFixture

    fixture = StackFixture(tmp_path / "home")
    try:
        fixture.ensure("nats", "s3")
        s3 = fixture.stack.server("s3")
        pids = [p for p in (s3.pid, fixture.stack.server("nats").pid) if p is not None]
        ports = [*s3.all_ports(), *fixture.stack.server("nats").all_ports()]
    finally:
        fixture.discard()
    assert pids and not any(psutil.pid_exists(p) for p in pids)
    listening = {c.laddr.port for c in psutil.net_connections() if c.status == psutil.CONN_LISTEN}
    assert not listening & set(ports)
    assert not [p for port in ports for p in glob.glob(f"/tmp/seaweedfs-*-{port}.sock")]
