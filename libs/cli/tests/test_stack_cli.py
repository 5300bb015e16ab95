"""``dsec up`` / ``status`` / ``down`` against real servers, run as a user runs them."""

from __future__ import annotations

import io
import json
import os
import socket
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import nats
import pytest
from dsec_cli.stack.adapters.probes import minio_client
from dsec_testing import S3Info, VaultInfo
from dsec_testing.helpers import listening, processes_under, read_stack_state, recorded_ports
from dsec_testing.helpers import run_dsec as _run_dsec
from dsec_testing.helpers import run_dsec_inproc as _run_dsec_inproc

FAKESVC = Path(__file__).resolve().parent / "fakesvc"  # `python -m dsec_fakesvc` lives here


def dsec(*args: str, home: Path, env: dict[str, str] | None = None) -> Any:
    return _run_dsec(*args, home=home, env={"PYTHONPATH": str(FAKESVC), **(env or {})})


def dsec_inproc(*args: str, home: Path, env: dict[str, str] | None = None) -> Any:
    return _run_dsec_inproc(*args, home=home, env=env)


state = read_stack_state

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module", autouse=True)
def _shared_bytecode(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Let the ``dsec`` processes (and the services they start) share compiled bytecode, so only
    the first one pays for compiling every module (PYTHONDONTWRITEBYTECODE may be set here)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPYCACHEPREFIX", str(tmp_path_factory.mktemp("pycache")))
        mp.delenv("PYTHONDONTWRITEBYTECODE", raising=False)
        yield


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    """A stack home that is brought down after the test, whatever happened in it."""
    path = tmp_path / "home"
    yield path
    if (path / "stack.json").exists():
        dsec_inproc("down", home=path)


def _operator_url(st: dict[str, Any]) -> str:
    """The embedded NATS as its operator (stack.json keeps the password, mode 0600)."""
    password = st["servers"]["nats"]["credentials"]["operator_password"]
    return str(st["nats_url"]).replace("nats://", f"nats://operator:{password}@", 1)


async def _write_data(st: dict[str, Any]) -> None:
    nc = await nats.connect(_operator_url(st))
    try:
        js = nc.jetstream()
        await js.add_stream(name="STACKTEST", subjects=["stacktest.>"])
        ack = await js.publish("stacktest.one", b"survives down/up")
        assert ack.seq == 1
    finally:
        await nc.close()
    conn = await asyncpg.connect(str(st["postgres_dsn"]))
    try:
        await conn.execute("CREATE TABLE kept (v text)")
        await conn.execute("INSERT INTO kept VALUES ('survives down/up')")
    finally:
        await conn.close()
    client = minio_client(
        str(st["s3_endpoint"]), str(st["s3_access_key"]), str(st["s3_secret_key"])
    )
    body = b"survives down/up"
    client.put_object("dsec", "kept/object.txt", io.BytesIO(body), len(body))


async def _read_data(st: dict[str, Any]) -> tuple[bytes, str, bytes]:
    nc = await nats.connect(_operator_url(st))
    try:
        msg = await nc.jetstream().get_msg("STACKTEST", 1)
        nats_data = msg.data or b""
    finally:
        await nc.close()
    conn = await asyncpg.connect(str(st["postgres_dsn"]))
    try:
        row = await conn.fetchval("SELECT v FROM kept")
    finally:
        await conn.close()
    client = minio_client(
        str(st["s3_endpoint"]), str(st["s3_access_key"]), str(st["s3_secret_key"])
    )
    resp = client.get_object("dsec", "kept/object.txt")
    try:
        obj = resp.read()
    finally:
        resp.close()
        resp.release_conn()
    return nats_data, str(row), obj


def _secrets(st: dict[str, object]) -> list[str]:
    passwords = [
        str(st[key]).split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
        for key in ("postgres_dsn", "postgres_read_dsn")
    ]
    return [*passwords, str(st["s3_secret_key"]), str(st["vault_token"])]


async def test_up_status_down_keeps_data_and_leaves_nothing_running(home: Path) -> None:

    up = dsec("up", "--json", "-s", "fakesvc", home=home)
    assert up.returncode == 0, up.stderr
    report = json.loads(up.stdout.strip().splitlines()[-1])
    assert report["healthy"] is True
    assert {n: s["state"] for n, s in report["servers"].items()} == {
        "nats": "running",
        "postgres": "running",
        "s3": "running",
        "vault": "running",
        "prometheus": "running",
    }
    assert report["services"]["fakesvc"]["state"] == "running"
    st = state(home)
    assert stat.S_IMODE(os.stat(home / "stack.json").st_mode) == 0o600
    assert set(st) == {
        "nats_url", "postgres_dsn", "postgres_read_dsn", "s3_endpoint", "s3_access_key",
        "s3_secret_key", "vault_addr", "vault_token", "prometheus_url", "nodes", "servers",
        "services",
    }  # fmt: skip
    assert st["postgres_dsn"].startswith("postgresql://dsec:")
    assert st["postgres_read_dsn"].startswith("postgresql://dsec_reader:")
    for name in ("nats", "postgres", "s3", "vault", "prometheus"):
        assert (home / "logs" / f"{name}.log").exists()

    status = dsec_inproc("status", "--json", home=home)
    assert status.exit_code == 0, status.stdout + status.stderr
    table = dsec_inproc("status", home=home)
    assert table.exit_code == 0
    assert "fakesvc" in table.stdout and "running" in table.stdout

    # Secrets live only in stack.json: not in any output, not in any log.
    logs = "".join(p.read_text(errors="replace") for p in (home / "logs").iterdir())
    for secret in _secrets(st):
        for text in (up.stdout, up.stderr, status.stdout, table.stdout, logs):
            assert secret not in text

    # A service that is not importable (yet): up exits 1 with its log, the rest keeps running.
    broken = dsec("up", "--json", "-s", "fakesvc", "-s", "nosuchsvc", home=home)
    assert broken.returncode == 1
    assert "nosuchsvc: exited with status 1" in broken.stderr
    assert "No module named dsec_nosuchsvc" in broken.stderr  # the tail of its log
    assert json.loads(broken.stdout)["failures"] == {"nosuchsvc": "exited with status 1"}
    report = json.loads(dsec_inproc("status", "--json", home=home).stdout)
    assert report["services"]["nosuchsvc"]["state"] == "stopped"
    assert report["services"]["fakesvc"]["state"] == "running"
    assert report["servers"]["nats"]["state"] == "running"

    await _write_data(st)

    down = dsec_inproc("down", home=home)
    assert down.exit_code == 0, down.stderr
    assert (home / "run" / "fakesvc.stopped").read_text() == "stop sandboxes"
    assert not (home / "run" / "stack-down").exists()
    assert processes_under(home) == []
    assert listening(recorded_ports(home)) == []
    assert dsec_inproc("status", home=home).exit_code == 1  # stopped, not healthy
    assert dsec_inproc("down", home=home).exit_code == 0  # idempotent

    again = dsec("up", "--json", "-s", "fakesvc", home=home)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout.strip().splitlines()[-1])["healthy"] is True
    st2 = state(home)
    assert st2["nats_url"] == st["nats_url"]  # same ports, same endpoints
    assert st2["postgres_dsn"] == st["postgres_dsn"]
    assert await _read_data(st2) == (
        b"survives down/up",
        "survives down/up",
        b"survives down/up",
    )

    # A saved port taken by another process: clear error, nothing left running.
    assert dsec_inproc("down", "--keep-sandboxes", home=home).exit_code == 0
    assert (home / "run" / "fakesvc.stopped").read_text() == "keep sandboxes"
    nats_port = st2["servers"]["nats"]["ports"][0]
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", nats_port))
        squatter.listen()
        blocked = dsec_inproc("up", "--no-services", home=home)
    assert blocked.exit_code == 1
    assert f"nats: port 127.0.0.1:{nats_port}" in blocked.stderr
    assert "is in use" in blocked.stderr
    assert processes_under(home) == []
    assert all(rec["pid"] is None for rec in state(home)["servers"].values())


async def test_external_servers_are_used_not_started(
    home: Path, nats_url: str, postgres_dsn: str, s3: S3Info, vault: VaultInfo
) -> None:
    env = {
        "DSEC_NATS_URL": nats_url,
        "DSEC_POSTGRES_DSN": postgres_dsn,
        "DSEC_S3_ENDPOINT": s3.endpoint,
        "DSEC_S3_ACCESS_KEY": s3.access_key,
        "DSEC_S3_SECRET_KEY": s3.secret_key,
        "DSEC_VAULT_ADDR": vault.addr,
        "DSEC_VAULT_TOKEN": vault.token,
    }
    up = dsec("up", "--json", "--no-services", home=home, env=env)
    assert up.returncode == 0, up.stderr
    st = state(home)
    assert (st["nats_url"], st["postgres_dsn"], st["s3_endpoint"], st["vault_addr"]) == (
        nats_url,
        postgres_dsn,
        s3.endpoint,
        vault.addr,
    )
    for name in ("nats", "postgres", "s3", "vault"):
        assert st["servers"][name]["external"] is True
        assert st["servers"][name]["pid"] is None
        assert not (home / "data" / name).exists()
    report = json.loads(dsec_inproc("status", "--json", home=home, env=env).stdout)
    assert {n: s["state"] for n, s in report["servers"].items()} == {
        "nats": "external",
        "postgres": "external",
        "s3": "external",
        "vault": "external",
        "prometheus": "running",
    }
    assert vault.token not in json.dumps(report)
    password = urlsplit(postgres_dsn).password
    assert password and password not in json.dumps(report)
    assert dsec_inproc("down", home=home, env=env).exit_code == 0
    assert processes_under(home) == []
    assert await _nats_answers(nats_url)  # the external server was left alone


async def _nats_answers(url: str) -> bool:
    nc = await nats.connect(url)
    try:
        return nc.is_connected
    finally:
        await nc.close()


def test_status_of_a_home_never_started_exits_3(tmp_path: Path) -> None:
    result = dsec_inproc("status", home=tmp_path / "nothing")
    assert result.exit_code == 3
    assert "never started" in result.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"DSEC_S3_ENDPOINT": "s3.example:9000"}, "DSEC_S3_ACCESS_KEY and DSEC_S3_SECRET_KEY"),
        ({"DSEC_NATS_URL": "http://127.0.0.1:4222"}, "DSEC_NATS_URL='http://127.0.0.1:4222'"),
        ({"DSEC_VAULT_ADDR": "http://127.0.0.1:8200"}, "DSEC_VAULT_TOKEN is not"),
    ],
)
def test_malformed_external_endpoint_is_bad_input(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    result = dsec_inproc("up", home=tmp_path / "home", env=env)
    assert result.exit_code == 2
    assert message in result.stderr
    assert not (tmp_path / "home" / "stack.json").exists()


def test_corrupt_state_file_is_named(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "stack.json").write_text("{not json")
    result = dsec_inproc("status", home=home)
    assert result.exit_code == 2
    assert f"{home}/stack.json: not valid JSON" in result.stderr


def test_up_nodes_starts_a_nats_cluster_and_keeps_it_until_down(home: Path) -> None:
    assert dsec_inproc("up", "--nodes", "9", home=home).exit_code == 2  # more than 5: named
    up = dsec_inproc("up", "--nodes", "3", "--no-services", "--json", home=home)
    assert up.exit_code == 0, up.stderr
    servers = json.loads(up.stdout.strip().splitlines()[-1])["servers"]
    assert [n for n in servers if n.startswith("nats")] == ["nats", "nats-2", "nats-3"]
    assert all(servers[n]["state"] == "running" for n in ("nats", "nats-2", "nats-3"))
    st = state(home)
    urls = str(st["nats_url"]).split(",")
    assert st["nodes"] == 3 and len(set(urls)) == 3
    again = dsec_inproc("up", "--nodes", "1", "--no-services", home=home)
    assert again.exit_code == 2
    assert "runs with 3 node(s); run `dsec down` before `dsec up --nodes 1`" in again.stderr
    assert dsec_inproc("up", "--no-services", home=home).exit_code == 0  # as it was started
    assert state(home)["nodes"] == 3
    down = dsec_inproc("down", home=home)
    assert down.exit_code == 0 and "nats-3" in down.stdout
    assert listening([int(u.rsplit(":", 1)[1]) for u in urls]) == []
    single = dsec_inproc("up", "--nodes", "1", "--no-services", home=home)
    assert single.exit_code == 2  # its log lives on three servers: never silently a fresh one
    assert "written by a stack of 3 node(s)" in single.stderr
    assert "another DSEC_HOME" in single.stderr
