"""NATS authorization of the embedded stack: who may connect, publish, and change the stream."""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import nats
import pytest
from dsec_cli.stack import StartFailed
from dsec_cli.stack.adapters.natsauth import create_stream
from dsec_core import natsperms
from dsec_core.natsperms import inbox_prefix
from dsec_core.settings import Settings
from dsec_core.subjects import STREAM
from dsec_testing.stack import StackFixture
from nats.aio.client import Client as NATS
from nats.js.api import StreamConfig

pytestmark = pytest.mark.integration


class Violations:
    """Errors the server sent to a client (permission violations arrive asynchronously)."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def callback(self) -> Callable[[Exception], Awaitable[None]]:
        async def on_error(exc: Exception) -> None:
            self.errors.append(str(exc))

        return on_error

    async def wait_for(self, text: str, timeout: float = 5.0) -> str:
        deadline = asyncio.get_running_loop().time() + timeout
        while asyncio.get_running_loop().time() < deadline:
            for err in self.errors:
                if text.lower() in err.lower():  # nats-py lower-cases the server's -ERR
                    return err
            await asyncio.sleep(0.02)
        raise AssertionError(f"no violation mentioning {text!r}; got {self.errors}")


@asynccontextmanager
async def as_identity(
    dsec_stack: StackFixture, identity: str
) -> AsyncIterator[tuple[NATS, Violations]]:
    seen = Violations()
    nc = await nats.connect(
        dsec_stack.nats_plain_url,
        nkeys_seed=str(dsec_stack.nats_seed(identity)),
        inbox_prefix=inbox_prefix(identity),
        error_cb=seen.callback(),
        max_reconnect_attempts=0,
    )
    try:
        yield nc, seen
    finally:
        await nc.close()


async def _last_seq(nats_url: str, subject: str) -> int | None:
    nc = await nats.connect(nats_url)
    try:
        try:
            return (await nc.jetstream().get_last_msg(STREAM, subject)).seq
        except nats.js.errors.NotFoundError:
            return None
    finally:
        await nc.close()


async def test_unauthenticated_client_cannot_connect(dsec_stack: StackFixture) -> None:
    with pytest.raises(Exception, match=r"[Aa]uthorization"):
        await nats.connect(
            dsec_stack.nats_plain_url, max_reconnect_attempts=0, allow_reconnect=False
        )


async def test_service_cannot_update_the_stream(dsec_stack: StackFixture, nats_url: str) -> None:
    async with as_identity(dsec_stack, "policy") as (nc, seen):
        js = nc.jetstream(timeout=1.0)
        config = (await js.stream_info(STREAM)).config  # reading is allowed
        assert config.deny_delete and config.deny_purge
        weakened = StreamConfig.from_response(config.as_dict())
        weakened.max_msgs = 10
        with pytest.raises(nats.errors.TimeoutError):  # the server drops the request
            await js.update_stream(weakened)
        err = await seen.wait_for(f"$JS.API.STREAM.UPDATE.{STREAM}")
        assert "permissions violation" in err
        with pytest.raises(nats.errors.TimeoutError):
            await js.purge_stream(STREAM)
        await seen.wait_for(f"$JS.API.STREAM.PURGE.{STREAM}")
    admin = await nats.connect(nats_url)
    try:
        assert (await admin.jetstream().stream_info(STREAM)).config.max_msgs in (None, -1)
    finally:
        await admin.close()


async def test_policy_cannot_publish_a_builder_event(
    dsec_stack: StackFixture, nats_url: str
) -> None:
    sandbox = f"sbx_{uuid.uuid4().hex[:10]}"
    forged = f"dsec.sandbox.{sandbox}.env.built"
    async with as_identity(dsec_stack, "policy") as (nc, seen):
        js = nc.jetstream(timeout=1.0)
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish(forged, b"forged")
        err = await seen.wait_for(forged)
        assert "permissions violation for publish" in err
        # Its own event type goes through (a garbage body still lands: the policy may publish
        # on that subject; the authorization table of events judges the content).
        ack = await js.publish(f"dsec.sandbox.{sandbox}.spec.validated", b"x")
        assert ack.stream == STREAM
    assert await _last_seq(nats_url, forged) is None


async def test_user_submits_but_cannot_validate(dsec_stack: StackFixture, nats_url: str) -> None:
    sandbox = f"sbx_{uuid.uuid4().hex[:10]}"
    async with as_identity(dsec_stack, "user-default") as (nc, seen):
        js = nc.jetstream(timeout=1.0)
        ack = await js.publish(f"dsec.sandbox.{sandbox}.spec.submitted", b"x")
        assert ack.seq > 0
        forged = f"dsec.sandbox.{sandbox}.spec.validated"
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish(forged, b"forged")
        await seen.wait_for(forged)
        # Nor may it pull from a service's durable consumer (it would steal its work).
        with pytest.raises(nats.errors.TimeoutError):
            await nc.request(
                f"$JS.API.CONSUMER.MSG.NEXT.{STREAM}.policy-spec-submitted", b"1", timeout=1.0
            )
        await seen.wait_for("policy-spec-submitted")
    assert await _last_seq(nats_url, forged) is None


def test_credentials_are_private(dsec_stack: StackFixture) -> None:
    seed = dsec_stack.nats_seed("builder")
    assert seed.read_text().startswith("SU")
    assert seed.stat().st_mode & 0o777 == 0o600
    conf = Path(dsec_stack.home) / "run" / "nats.conf"
    assert conf.stat().st_mode & 0o777 == 0o600
    text = conf.read_text()
    import nkeys

    public = nkeys.from_seed(bytearray(seed.read_bytes().strip())).public_key.decode()
    assert public in text and seed.read_text().strip() not in text  # public key only
    assert "$2a$" in text  # the operator password only as a bcrypt hash


async def test_service_refuses_a_weakened_stream_and_the_operator_restores_it(
    dsec_stack: StackFixture, nats_url: str, services: Any
) -> None:
    admin = await nats.connect(nats_url)
    js = admin.jetstream()
    try:
        config = (await js.stream_info(STREAM)).config
        config.max_msgs = 10_000_000  # a limit that would one day discard history
        await js.update_stream(config)
        with pytest.raises(StartFailed) as failed:
            await asyncio.to_thread(services.start, "policy", timeout=30)
        _reason, log_tail = failed.value.failures["policy"]
        assert "policy refuses to start: stream DSEC_EVENTS is weakened" in log_tail
        assert "max_msgs=10000000 with discard=old would lose events" in log_tail
    finally:
        await asyncio.to_thread(create_stream, nats_url)  # what `dsec up` does as operator
        restored = (await js.stream_info(STREAM)).config
        await admin.close()
    assert restored.max_msgs in (None, -1) and restored.deny_purge and restored.deny_delete


async def test_deploy_config_enforces_the_same_roles(tmp_path: Path) -> None:
    """deploy/nats/nats-server.conf with `dsec nats credentials` output, on a real server."""
    from dsec_cli.stack.adapters.natsauth import write_deploy_credentials
    from dsec_cli.stack.adapters.procs import allocate_ports, poll_until, port_listening
    from dsec_cli.stack.adapters.servers import NatsServer

    creds = tmp_path / "creds"
    write_deploy_credentials(creds, ["default"])
    env = dict(os.environ)
    for line in (creds / "nats-server.env").read_text().splitlines():
        key, _, value = line.partition("=")
        env[key] = value.strip("'")
    port, monitor = allocate_ports(2)
    conf = Path(__file__).parents[1] / "deploy" / "nats" / "nats-server.conf"
    binary = NatsServer.default_binary()
    assert binary is not None
    argv = [str(binary), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor)]
    proc = subprocess.Popen(
        [*argv, "-js", "-sd", str(tmp_path / "js")], env=env, stderr=subprocess.PIPE
    )
    try:
        assert poll_until(lambda: port_listening(port), time.monotonic() + 10), "no nats"
        url = f"nats://127.0.0.1:{port}"
        password = (creds / "operator.password").read_text().strip()
        await asyncio.to_thread(create_stream, f"nats://operator:{password}@127.0.0.1:{port}")
        seen = Violations()
        nc = await nats.connect(
            url,
            nkeys_seed=str(creds / "builder.nk"),
            inbox_prefix=inbox_prefix("builder"),
            error_cb=seen.callback(),
        )
        try:
            js = nc.jetstream(timeout=1.0)
            assert (await js.publish("dsec.sandbox.s1.env.built", b"x")).seq == 1
            with pytest.raises(nats.errors.TimeoutError):
                await js.publish("dsec.sandbox.s1.spec.validated", b"forged")
            await seen.wait_for("dsec.sandbox.s1.spec.validated")
            with pytest.raises(nats.errors.TimeoutError):  # only node agents keep state
                await js.publish("dsec_state.t.g.a", b"forged")
            await seen.wait_for("dsec_state.t.g.a")
        finally:
            await nc.close()
        # the state keeper: publishes sealed deltas and reads them back by subject; a warm
        # snapshot's rollup replaces older ones; the purge API stays the operator's
        nc = await nats.connect(
            url,
            nkeys_seed=str(creds / "nodeagent.nk"),
            inbox_prefix=inbox_prefix("nodeagent"),
            error_cb=seen.callback(),
        )
        try:
            js = nc.jetstream(timeout=1.0)
            ack = await js.publish("dsec_state.t.g.a", b"sealed", headers={"Dsec-State-Seq": "1"})
            assert ack.stream == "DSEC_STATE"
            got = await js.get_msg("DSEC_STATE", subject="dsec_state.t.g.a")
            assert got.data == b"sealed"
            marker = {"Nats-Rollup": "sub", "Dsec-State-Seq": "1", "Dsec-Warm": "1"}
            assert (await js.publish("dsec_state.t.g.a", b"", headers=marker)).seq == 2
            assert (await js.stream_info("DSEC_STATE")).state.messages == 1
            with pytest.raises(nats.errors.TimeoutError):
                await js.purge_stream("DSEC_STATE")
            await seen.wait_for("$JS.API.STREAM.PURGE.DSEC_STATE")
        finally:
            await nc.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize("name", natsperms.SERVICES)
def test_each_service_consumes_only_durables_its_role_allows(name: str, tmp_path: Path) -> None:
    """The permissions table and the services' handlers agree (a new handler needs a row)."""
    import importlib

    app = importlib.import_module(f"dsec_{name}.app")
    settings = Settings(home=tmp_path, snapshot_interval_s=60.0)  # periodic handlers too
    service = app.create_service(settings)
    assert service.durables
    role = natsperms.TABLE[name]
    assert set(service.durables) <= {*role.durables, *role.node_durables(settings.node_id)}


def test_a_nats_without_authorization_is_unhealthy(tmp_path: Path) -> None:
    """A server left running by an older dsec (no credentials asked) is restarted by `dsec up`."""
    from dsec_cli.stack.adapters.probes import ProbeError
    from dsec_cli.stack.adapters.procs import allocate_ports, poll_until
    from dsec_cli.stack.adapters.servers import NatsServer

    port, monitor = allocate_ports(2)
    srv = NatsServer(tmp_path, ports=[port, monitor])
    argv = [str(srv.binary), "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor), "-js"]
    proc = subprocess.Popen([*argv, "-sd", str(tmp_path / "js")], stderr=subprocess.DEVNULL)
    try:
        healthz = f"http://127.0.0.1:{monitor}/healthz?js-enabled-only=true"
        assert poll_until(lambda: _answers(healthz), time.monotonic() + 10), "no nats"
        with pytest.raises(ProbeError, match="running without authorization"):
            srv.probe()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _answers(url: str) -> bool:
    from dsec_cli.stack.adapters.probes import ProbeError, http_ok

    try:
        http_ok(url, 1.0)
    except ProbeError:
        return False
    return True


def _cert(name: str, issuer: tuple[Any, Any] | None, *, ca: bool = False) -> tuple[Any, Any]:
    """A key and certificate for ``name`` (self-signed when ``issuer`` is None)."""
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    signer_key, signer_cert = issuer if issuer else (key, None)
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(signer_cert.subject if signer_cert else subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=1))
        .not_valid_after(now + dt.timedelta(hours=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        san = x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        builder = builder.add_extension(san, critical=False)
    return key, builder.sign(signer_key, hashes.SHA256())


def _write_pem(path: Path, key: Any, cert: Any) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization

    cert_path, key_path = path.with_suffix(".crt"), path.with_suffix(".key")
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


async def test_tls_settings_reach_a_server_that_requires_client_certificates(
    tmp_path: Path,
) -> None:
    from dsec_cli.stack.adapters.procs import allocate_ports, poll_until
    from dsec_cli.stack.adapters.servers import NatsServer
    from dsec_core.natsclient import connect

    ca = _cert("dsec test CA", None, ca=True)
    ca_crt, _ = _write_pem(tmp_path / "ca", *ca)
    srv_crt, srv_key = _write_pem(tmp_path / "server", *_cert("127.0.0.1", ca))
    cli_crt, cli_key = _write_pem(tmp_path / "client", *_cert("dsec-client", ca))
    port, monitor = allocate_ports(2)
    binary = NatsServer.default_binary()
    assert binary is not None
    proc = subprocess.Popen(
        [str(binary), "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor), "--tlsverify",
         "--tlscert", str(srv_crt), "--tlskey", str(srv_key), "--tlscacert", str(ca_crt)],
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        healthz = f"http://127.0.0.1:{monitor}/healthz"
        assert poll_until(lambda: _answers(healthz), time.monotonic() + 10), "no nats"
        url = f"tls://127.0.0.1:{port}"
        settings = Settings(
            nats_url=url, nats_tls_ca=ca_crt, nats_tls_cert=cli_crt, nats_tls_key=cli_key
        )
        nc = await connect(settings, "tls-test", max_reconnect_attempts=0)
        try:
            assert nc.is_connected and nc.connected_url is not None
            assert nc.connected_url.scheme == "tls"
        finally:
            await nc.close()
        without_cert = Settings(nats_url=url, nats_tls_ca=ca_crt)
        # TLS 1.3: the server's "certificate required" alert arrives after the handshake,
        # so the refusal shows as a connection that never completes.
        with pytest.raises((TimeoutError, OSError, nats.errors.Error)):
            await asyncio.wait_for(
                connect(without_cert, "tls-test", allow_reconnect=False, connect_timeout=2), 5
            )
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def test_a_running_service_reports_a_stream_weakened_later(
    nats_url: str, services: Any
) -> None:
    import json
    import urllib.error
    import urllib.request

    await asyncio.to_thread(services.start, "policy", env={"DSEC_STREAM_CHECK_S": "0.2"})
    url = services.url("policy") + "/healthz"

    def status() -> str:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return str(json.loads(resp.read())["status"])
        except urllib.error.HTTPError as err:
            return str(json.loads(err.read())["status"])

    async def becomes(wanted: str) -> None:
        deadline = time.monotonic() + 10
        while (got := await asyncio.to_thread(status)) != wanted:
            assert time.monotonic() < deadline, f"healthz stayed {got!r}, expected {wanted!r}"
            await asyncio.sleep(0.1)

    await becomes("ok")
    admin = await nats.connect(nats_url)
    try:
        config = (await admin.jetstream().stream_info(STREAM)).config
        config.max_bytes = 1 << 30
        await admin.jetstream().update_stream(config)
        await becomes("unhealthy")
    finally:
        await asyncio.to_thread(create_stream, nats_url)
        await admin.close()
    await becomes("ok")
    assert "max_bytes=1073741824 with discard=old would lose events" in services.log("policy")
