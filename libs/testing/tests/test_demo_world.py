"""The demo world: its DNS, search API, tracker and seeding behave as the demo relies on."""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.message
import dns.rcode
import pytest
from cryptography import x509
from dsec_core.settings import Settings
from dsec_testing import S3Info, VaultInfo
from dsec_testing.demo_world import (
    API_ADDRESS,
    API_HOST,
    BUCKET,
    CA_KEY,
    QUERIES_KEY,
    TRACKER_ADDRESS,
    WORLD_FILE,
    DemoWorld,
    WorldError,
    WorldInfo,
    main,
    make_pki,
    parse_limit,
    search,
    seed,
)


@dataclass
class Running:
    world: DemoWorld
    info: WorldInfo


@pytest.fixture
async def running(tmp_path: Path) -> AsyncIterator[Running]:
    world = DemoWorld(tmp_path / "world", https_port=0, api_key="wsk_test-key")
    info = await world.start()
    try:
        yield Running(world, info)
    finally:
        await world.close()


async def ask(info: WorldInfo, name: str, rdtype: str = "A") -> dns.message.Message:
    host, port = info.dns.split(":")
    return await dns.asyncquery.udp(dns.message.make_query(name, rdtype), host, port=int(port))


async def get(
    running: Running, target: str, key: str | None, *, hostname: str = API_HOST
) -> tuple[int, Any]:
    """One HTTPS request to the API, verified against the world's CA for ``hostname``."""
    context = ssl.create_default_context(cafile=str(running.info.ca))
    reader, writer = await asyncio.open_connection(
        API_ADDRESS, running.world.https_port, ssl=context, server_hostname=hostname
    )
    auth = f"Authorization: Bearer {key}\r\n" if key is not None else ""
    writer.write(
        f"GET {target} HTTP/1.1\r\nHost: {API_HOST}\r\n{auth}Connection: close\r\n\r\n".encode()
    )
    raw = await reader.read()
    writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.unit
def test_search_ranks_by_shared_words_and_honours_the_limit() -> None:
    answer = search("how does landlock restrict files", 2)
    assert answer["query"] == "how does landlock restrict files"
    titles = [r["title"] for r in answer["results"]]
    assert titles == ["Landlock: unprivileged access control", "What is a sandbox?"]


@pytest.mark.unit
@pytest.mark.parametrize("raw", ["0", "11", "-1", "two", ""])
def test_limit_out_of_range_names_the_valid_range(raw: str) -> None:
    with pytest.raises(ValueError, match="limit must be an integer from 1 to 10"):
        parse_limit(raw)
    assert parse_limit(None) == 5 and parse_limit("10") == 10


@pytest.mark.unit
def test_server_certificate_is_issued_by_the_ca_for_the_api_name() -> None:
    pki = make_pki(API_HOST, API_ADDRESS)
    ca = x509.load_pem_x509_certificate(pki.ca_pem)
    cert = x509.load_pem_x509_certificate(pki.cert_pem)
    cert.verify_directly_issued_by(ca)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [API_HOST]
    assert "PRIVATE KEY" not in repr(pki)


@pytest.mark.unit
def test_world_file_errors_say_what_is_wrong(tmp_path: Path) -> None:
    with pytest.raises(WorldError, match="does not exist: is the demo world running"):
        WorldInfo.load(tmp_path / WORLD_FILE)
    (tmp_path / WORLD_FILE).write_text('{"dns": "x"}')
    with pytest.raises(WorldError, match="is not a demo world file"):
        WorldInfo.load(tmp_path / WORLD_FILE)


@pytest.mark.unit
def test_seed_without_a_running_world_exits_1_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["seed", "--dir", str(tmp_path)]) == 1
    assert "is the demo world running?" in capsys.readouterr().err


@pytest.mark.integration
async def test_dns_names_the_api_and_the_tracker_and_nothing_else(running: Running) -> None:
    api = await ask(running.info, API_HOST)
    assert [rr.address for rr in api.answer[0]] == [API_ADDRESS]
    tracker = await ask(running.info, "tracker.websearch.test")
    assert [rr.address for rr in tracker.answer[0]] == [TRACKER_ADDRESS]
    assert (await ask(running.info, "nope.websearch.test")).rcode() == dns.rcode.NXDOMAIN
    assert (await ask(running.info, "example.com")).rcode() == dns.rcode.REFUSED


@pytest.mark.integration
async def test_api_answers_only_with_the_key_over_tls_for_its_name(running: Running) -> None:
    status, body = await get(running, "/v1/search?q=ebpf+hooks&limit=2", "wsk_test-key")
    assert status == 200 and len(body["results"]) == 2
    assert body["results"][0]["title"] == "eBPF cgroup socket hooks"
    assert await get(running, "/v1/search?q=x", "wrong") == (
        401,
        {"error": "missing or wrong API key"},
    )
    assert (await get(running, "/v1/search?q=x", None))[0] == 401
    status, body = await get(running, "/v1/search?q=x&limit=50", "wsk_test-key")
    assert status == 400 and "limit must be" in body["error"]
    with pytest.raises(ssl.SSLCertVerificationError):
        await get(running, "/v1/search?q=x", "wsk_test-key", hostname="other.websearch.test")


@pytest.mark.integration
async def test_tracker_reports_every_connection(
    running: Running, capsys: pytest.CaptureFixture[str]
) -> None:
    _, writer = await asyncio.open_connection(TRACKER_ADDRESS, running.world.https_port)
    writer.close()
    for _ in range(100):  # the server side runs on the same loop: let it accept
        if running.world.tracker_connections:
            break
        await asyncio.sleep(0.01)
    assert running.world.tracker_connections == 1
    assert "tracker: connection from 127.0.0.1:" in capsys.readouterr().out


@pytest.mark.integration
async def test_world_files_appear_when_ready_and_go_at_close(tmp_path: Path) -> None:
    directory = tmp_path / "w"
    world = DemoWorld(directory, https_port=0)
    info = await world.start()
    assert WorldInfo.load(directory / WORLD_FILE) == info
    assert (directory / WORLD_FILE).stat().st_mode & 0o077 == 0  # it holds the key
    assert info.ca.read_bytes().startswith(b"-----BEGIN CERTIFICATE-----")
    assert sorted(p.name for p in directory.iterdir()) == ["ca.pem", WORLD_FILE]
    await world.close()
    assert not directory.exists()


@pytest.mark.integration
async def test_a_taken_port_is_a_clear_error_and_nothing_is_left(
    running: Running, tmp_path: Path
) -> None:
    other = DemoWorld(tmp_path / "other", https_port=running.world.https_port)
    with pytest.raises(WorldError, match=f"cannot listen on {API_ADDRESS}:"):
        await other.start()
    assert not (tmp_path / "other").exists()


@pytest.mark.integration
async def test_seed_puts_the_key_in_openbao_and_queries_and_ca_in_s3(
    running: Running, vault: VaultInfo, s3: S3Info, tmp_path: Path
) -> None:
    # As after `dsec up`: the endpoints come from DSEC_HOME/stack.json, not the environment.
    endpoints = {
        "vault_addr": vault.addr,
        "vault_token": vault.token,
        "s3_endpoint": s3.endpoint,
        "s3_access_key": s3.access_key,
        "s3_secret_key": s3.secret_key,
    }
    (tmp_path / "stack.json").write_text(json.dumps(endpoints))
    settings = Settings(home=tmp_path, **dict.fromkeys(endpoints))
    report = await asyncio.to_thread(seed, running.info, settings, "q1\nq2\n")
    assert report.secret == "vault://secret/default/agent-tools/websearch#key"
    stored = vault.client().secrets.kv.v2.read_secret_version(
        path="default/agent-tools/websearch", raise_on_deleted_version=True
    )
    assert stored["data"]["data"] == {"key": "wsk_test-key"}
    store = s3.client()
    assert store.get_object(BUCKET, QUERIES_KEY).read() == b"q1\nq2\n"
    assert store.get_object(BUCKET, CA_KEY).read() == running.info.ca.read_bytes()


@pytest.mark.integration
async def test_seed_without_vault_says_how_to_configure_it(
    running: Running, tmp_path: Path
) -> None:
    with pytest.raises(WorldError, match=r"run `dsec up`.*DSEC_VAULT_ADDR"):
        seed(running.info, Settings(home=tmp_path, vault_addr=None, vault_token=None))
    with pytest.raises(WorldError, match="cannot write vault://"):
        seed(
            running.info, Settings(home=tmp_path, vault_addr="http://127.0.0.1:9", vault_token="t")
        )


@pytest.mark.unit
async def test_faults_set_through_the_admin_fail_the_next_requests_once_each(
    running: Running,
) -> None:
    """The flaky-search scene: `faults 429 401x2 503` through the world's admin endpoint."""
    assert running.info.admin.startswith("127.0.0.1:")
    from dsec_testing.demo_world import main, parse_faults

    assert parse_faults(["timeout", "401x2"]) == ["timeout", "401", "401"]
    with pytest.raises(ValueError, match="fault '418'"):
        parse_faults(["418"])
    code = await asyncio.to_thread(
        main, ["faults", "--dir", str(running.world.directory), "429", "401x2", "503"]
    )
    assert code == 0
    key = "wsk_test-key"
    assert await get(running, "/v1/search?q=x", key) == (429, {"error": "rate limit exceeded"})
    assert await get(running, "/v1/search?q=x", key) == (401, {"error": "API key expired"})
    assert (await get(running, "/v1/search?q=x", key))[0] == 401
    assert (await get(running, "/v1/search?q=x", key))[0] == 503
    assert (await get(running, "/v1/search?q=ebpf", key))[0] == 200  # the faults are spent
