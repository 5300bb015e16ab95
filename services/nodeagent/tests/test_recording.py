"""Record and replay on the node (docs/experiments.md).

HTTP: the TLS proxy records the requests to a recorded host against a real local HTTPS server
that counts its hits, then a replaying proxy answers the same requests byte for byte with the
server never hit again, and a request the recording lacks is a 502 ``X-DSec-Replay: miss``.
Storage: recordings in the stack's S3, sealed with the tenants' keys from its OpenBao: a
tenant reads its own, another tenant's id is not found, and an object copied under another
tenant's prefix does not open.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.server
import json
import shutil
import socket
import ssl
import sys
import tempfile
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import BinaryIO, ClassVar

import pytest
from dsec_core import events
from dsec_core.layout import NodeLayout
from dsec_core.objectstore import ensure_bucket, get_bytes, put_bytes
from dsec_core.spec.plan import PlanEgressRule
from dsec_sdk.recording import (
    ENV_RECORD,
    ENV_REPLAY,
    Entry,
    Recorder,
    Replayer,
    ReplayMiss,
    http_key,
    read_entries,
    tool_key,
)
from dsec_testing.plans import minimal_plan
from dsec_testing.stack import S3Info, VaultInfo

from dsec_nodeagent.recording import Recordings, ReplayUnavailable
from dsec_nodeagent.recording.store import (
    KEY_PATH,
    RecordingCorrupt,
    RecordingNotFound,
    RecordingStore,
)
from dsec_nodeagent.sandbox.plan import kept_dir
from dsec_nodeagent.state.sealing import TenantKeys
from dsec_nodeagent.tlsproxy import CertAuthority, ProxyRule, SandboxProxy

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the harness
from _nodeagent_harness import NodeAgentHarness

pytestmark = pytest.mark.integration

HOST = "localhost"
OWN_CGROUP = Path("/sys/fs/cgroup") / Path("/proc/self/cgroup").read_text().split("::")[-1].strip(
    "/\n"
)


class _Counting(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hits: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        asked = self.rfile.read(length)
        type(self).hits.append(self.path)
        status = 404 if self.path == "/missing" else 200
        body = b'{"answer": "' + asked + b'", "n": ' + str(len(type(self).hits)).encode() + b"}"
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def upstream_ca(tmp_path: Path) -> Path:
    return tmp_path / "upstream-ca.pem"


@pytest.fixture
def upstream(tmp_path: Path, upstream_ca: Path) -> Iterator[tuple[int, ssl.SSLContext, list[str]]]:
    """A counting HTTPS server for ``localhost``, a context trusting it, and its hits."""
    ca = CertAuthority("upstream", tmp_path)
    upstream_ca.write_bytes(ca.pem)
    hits: ClassVar[list[str]] = []
    handler = type("Handler", (_Counting,), {"hits": hits})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    server.socket = ca.server_context(HOST).wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield (
            int(server.server_address[1]),
            ssl.create_default_context(cadata=ca.pem.decode()),
            hits,
        )
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _rule(port: int) -> ProxyRule:
    plan = PlanEgressRule(
        kind="domain", domain=HOST, ports=(port,), internal_only=True, tls_proxy=True
    )
    return ProxyRule("egress[0]", plan)


@contextlib.asynccontextmanager
async def serving(proxy: SandboxProxy) -> AsyncIterator[int]:
    proxy.cgroup = OWN_CGROUP
    port = await proxy.start()
    try:
        yield port
    finally:
        await proxy.close()


def _posts(proxy_port: int, port: int, ca: CertAuthority, paths: list[str]) -> list[bytes]:
    """POST each path (body: the path) through one tunnel; the raw responses."""
    raw = socket.create_connection(("127.0.0.1", proxy_port), timeout=10)
    raw.sendall(f"CONNECT {HOST}:{port} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
    answer = b""
    while b"\r\n\r\n" not in answer:
        answer += raw.recv(4096)
    assert answer.startswith(b"HTTP/1.1 200"), answer
    tls = ssl.create_default_context(cadata=ca.pem.decode()).wrap_socket(raw, server_hostname=HOST)
    reader = tls.makefile("rb")
    out = []
    for path in paths:
        body = path.encode()
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer secret-{len(out)}\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        tls.sendall(head.encode() + body)
        out.append(_read(reader))
    tls.close()
    return out


def _read(reader: BinaryIO) -> bytes:
    head = b""
    length = 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        head += line
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + b"\r\n" + reader.read(length)


async def test_http_is_recorded_then_replayed_byte_for_byte_with_zero_live_calls(
    upstream: tuple[int, ssl.SSLContext, list[str]], tmp_path: Path
) -> None:
    port, trust, hits = upstream
    ca = CertAuthority("sbx-rec", tmp_path)
    recording = tmp_path / "http.jsonl"
    proxy = SandboxProxy("sbx-rec", [_rule(port)], ca, lambda r, t: None, upstream=trust)
    proxy.recording = (Recorder(recording), frozenset({HOST}))
    async with serving(proxy) as proxy_port:
        live = await asyncio.to_thread(_posts, proxy_port, port, ca, ["/ask", "/missing", "/ask"])
    assert hits == ["/ask", "/missing", "/ask"]
    assert [r.split(b" ")[1] for r in live] == [b"200", b"404", b"200"]
    entries = read_entries(recording)
    assert [e.failed for e in entries] == [False, True, False]  # a 404 is a failed call
    assert [e.seq for e in entries] == [0, 0, 1]  # the same request twice: two answers, in order

    (tmp_path / "replay").mkdir()
    ca2 = CertAuthority("sbx-replay", tmp_path / "replay")
    replaying = SandboxProxy("sbx-replay", [_rule(port)], ca2, lambda r, t: None, upstream=trust)
    replaying.recording = (Replayer(entries), frozenset({HOST}))
    async with serving(replaying) as proxy_port:
        replayed = await asyncio.to_thread(
            _posts, proxy_port, port, ca2, ["/ask", "/missing", "/ask", "/never-recorded"]
        )
    assert replayed[:3] == live  # byte for byte, the different Authorization notwithstanding
    assert replayed[3].startswith(b"HTTP/1.1 502")
    assert b"X-DSec-Replay: miss" in replayed[3]
    assert b"no recorded answer for http call POST /never-recorded localhost:" in replayed[3]
    assert hits == ["/ask", "/missing", "/ask"]  # zero live calls while replaying


@pytest.fixture
def store(s3: S3Info, vault: VaultInfo) -> RecordingStore:
    client = s3.client()
    ensure_bucket(client, s3.bucket)
    return RecordingStore(client, s3.bucket, TenantKeys(vault.addr, vault.token, path=KEY_PATH))


async def test_a_recording_is_per_tenant_content_addressed_and_sealed(
    store: RecordingStore,
) -> None:
    entries = [
        Entry(tool_key("researcher", "lookup", {"q": "memfd"}), b"\x92\x00\xa4fine"),
        Entry(tool_key("researcher", "lookup", {"q": "boom"}), b"\x92\x01\x94", failed=True),
    ]
    saved = await store.save("acme", entries)
    assert saved.recording_id == f"rec_{saved.root_hash[:32]}"
    assert (saved.calls, saved.tool_calls, saved.failed_calls) == (2, 2, 1)
    again = await store.save("acme", entries)
    assert again.recording_id == saved.recording_id and again.new_objects == 0  # deduplicated

    root, loaded = await store.load("acme", saved.recording_id)
    assert root == saved.root_hash
    assert [(e.key, e.response, e.failed) for e in loaded] == [
        (e.key, e.response, e.failed) for e in entries
    ]

    with pytest.raises(RecordingNotFound, match=r"no recording rec_\w+ for tenant 'globex'"):
        await store.load("globex", saved.recording_id)
    # an operator (or a bug) copying acme's objects under globex's prefix gives globex nothing
    manifest = f"recordings/acme/manifests/{saved.recording_id}"
    sealed = await get_bytes(store.store, store.bucket, manifest)
    await put_bytes(
        store.store, store.bucket, f"recordings/globex/manifests/{saved.recording_id}", sealed
    )
    with pytest.raises(RecordingCorrupt, match="does not authenticate"):
        await store.load("globex", saved.recording_id)
    assert b"memfd" not in sealed  # encrypted at rest


PROXIED = (
    "security_policy:\n  network:\n    egress:\n"
    "      - {domain: api.example.com, tls_proxy: true, rate_limit: {requests: 10, period_s: 1}}\n"
)


async def test_a_sandbox_records_its_tools_and_the_proxy_its_http_then_another_replays(
    store: RecordingStore, tmp_path: Path
) -> None:
    recordings = Recordings(NodeLayout.of(tmp_path), store)
    plan = minimal_plan(
        "rec", PROXIED + "record: {tools: true, http: [api.example.com]}\n"
    ).model_copy(update={"tenant": "acme"})
    prepared = await recordings.prepare("sbx_rec1", plan)
    assert prepared is not None and prepared.http is not None
    assert prepared.env == {ENV_RECORD: "/dsec/recording/calls.jsonl"}
    # one of its write_allowed paths (on its disk quota), no directory of the host's mounted
    assert prepared.mounts == [] and prepared.write == ["/dsec/recording"]
    kept = kept_dir(NodeLayout.of(tmp_path).sandbox("sbx_rec1").root, "/dsec/recording")
    kept.mkdir(parents=True)  # (what the sandbox's manager makes)
    # what the sandbox wrote through the SDK, plus an HTTP call it forged in its own file
    sandbox_file = kept / "calls.jsonl"
    Recorder(sandbox_file).call_sync(tool_key("records", "users", {}), lambda: b"\x92\x00\x90")
    forged = http_key("GET", "api.example.com", 443, "/forged", [], b"")
    Recorder(sandbox_file).call_sync(forged, lambda: b"forged")
    proxy_layer, hosts = prepared.http
    assert isinstance(proxy_layer, Recorder) and hosts == {"api.example.com"}
    real = http_key("POST", "api.example.com", 443, "/v1", [], b"{}")
    proxy_layer.call_sync(real, lambda: b"real")

    saved = await recordings.finish("sbx_rec1")
    assert saved is not None
    assert (saved.calls, saved.tool_calls, saved.http_calls) == (2, 1, 1)  # forged one dropped
    assert not (tmp_path / "sandboxes" / "sbx_rec1" / "recording").exists()

    replay = minimal_plan("rep", PROXIED + f"replay: {saved.recording_id}\n").model_copy(
        update={"tenant": "acme"}
    )
    again = await recordings.prepare("sbx_rep1", replay)
    assert again is not None and again.http is not None
    assert again.env == {ENV_REPLAY: "/dsec/replay/calls.jsonl"}
    assert (again.mounts[0].target, again.mounts[0].read_only) == ("/dsec/replay", True)
    shown = read_entries(again.mounts[0].source / "calls.jsonl")
    assert [e.key.kind for e in shown] == ["tool"]
    replayer, replay_hosts = again.http
    assert isinstance(replayer, Replayer) and "api.example.com" in replay_hosts
    assert replayer.answer(real) == b"real"
    with pytest.raises(ReplayMiss):
        replayer.answer(forged)
    recordings.forget("sbx_rep1")

    other = replay.model_copy(update={"tenant": "globex"})
    with pytest.raises(ReplayUnavailable, match="for tenant 'globex'"):
        await recordings.prepare("sbx_rep2", other)


HTTP_AGENT = """
import json, urllib.error, urllib.request
out = []
for path in {paths!r}:
    request = urllib.request.Request(
        "https://localhost:{port}" + path, data=path.encode(),
        headers={{"Content-Type": "application/json", "Authorization": "Bearer k-" + path}},
    )
    try:  # urllib honours HTTPS_PROXY and SSL_CERT_FILE: through the sandbox's proxy
        with urllib.request.urlopen(request, timeout=20) as answer:
            out.append([answer.status, answer.read().decode(), None])
    except urllib.error.HTTPError as exc:
        out.append([exc.code, exc.read().decode()[:300], exc.headers.get("X-DSec-Replay")])
print(json.dumps(out), flush=True)
"""


@pytest.fixture
def short_home() -> Iterator[Path]:
    """A short home: the sandboxes' socket paths must fit in AF_UNIX's 108 bytes."""
    path = Path(tempfile.mkdtemp(prefix="dre-", dir="/tmp"))
    yield path / "home"
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.kernel
async def test_a_sandbox_records_its_http_calls_and_a_replaying_one_never_reaches_the_host(
    upstream: tuple[int, ssl.SSLContext, list[str]],
    upstream_ca: Path,
    short_home: Path,
    nats_url: str,
    s3: S3Info,
    vault: VaultInfo,
) -> None:
    """A real sandbox POSTs twice to a recorded host (an LLM endpoint, say) through its proxy:
    recorded, recording.saved. A second sandbox replays: the same answers, in order, the host
    not hit once more, and a request the recording lacks is a 502 miss."""
    port, _, hits = upstream
    egress = (
        f"{{domain: localhost, ports: [{port}], rate_limit: 100requests/min, tls_proxy: true, "
        "allow_internal_only: true}"
    )
    settings = {"tls_proxy_upstream_ca": upstream_ca, **s3.settings(), **vault.settings()}
    async with NodeAgentHarness(short_home, nats_url, **settings) as h:
        sid = await h.submit(
            "recorder",
            HTTP_AGENT.format(paths=["/chat", "/chat"], port=port),
            egress=egress,
            extra="record: {tools: false, http: [localhost]}\n",
        )
        exited = await h.wait_for(sid, "sandbox.exited")
        out, err = (p.read_text() for p in h.agent.manager.log_paths(sid))
        assert exited.payload["reason"] == "ok", err[-3000:]
        live = json.loads(out.splitlines()[-1])
        assert [status for status, _, _ in live] == [200, 200]
        assert hits == ["/chat", "/chat"]
        saved = (await h.wait_for(sid, "recording.saved")).payload
        assert (saved["http_calls"], saved["tool_calls"]) == (2, 0)

        replaying = await h.submit(
            "replayer",
            HTTP_AGENT.format(paths=["/chat", "/chat", "/other"], port=port),
            egress=egress,
            extra=f"replay: {saved['recording_id']}\n",
        )
        exited = await h.wait_for(replaying, "sandbox.exited")
        out, err = (p.read_text() for p in h.agent.manager.log_paths(replaying))
        assert exited.payload["reason"] == "ok", err[-3000:]
        replayed = json.loads(out.splitlines()[-1])
    assert replayed[:2] == live  # n=1 then n=2: in the recorded order, byte for byte
    status, body, marker = replayed[2]
    assert (status, marker) == (502, "miss")
    assert "no recorded answer for http call POST /other" in body
    assert hits == ["/chat", "/chat"]  # the replaying sandbox never reached the host


TOOL_RECORDER = """
import os, sys, time
from dsec_sdk.recording import Recorder, tool_key
from pathlib import Path
recorder = Recorder(Path(os.environ["DSEC_RECORD_FILE"]))
recorder.call_sync(tool_key("records", "users", {"n": 1}), lambda: b"\\x92\\x00\\x90")
print("recorded one", flush=True)
while not os.path.exists("/dsec/recording/again"):  # the new node agent runs: go on
    time.sleep(0.05)
recorder.call_sync(tool_key("records", "users", {"n": 2}), lambda: b"\\x92\\x01\\x90")
print("recorded two", flush=True)
time.sleep(600)
"""


async def _recording(harness: NodeAgentHarness, name: str, code: str) -> str:
    """A sandbox running ``code`` that records its tool calls; its id."""
    return await harness.submit(
        name, code, "{domain: allowed.test, ports: [443]}", extra="record: {tools: true}\n"
    )


@pytest.mark.kernel
async def test_a_recording_sandbox_that_outlives_its_node_agent_keeps_its_recording(
    short_home: Path, nats_url: str, s3: S3Info, vault: VaultInfo
) -> None:
    """The node agent restarts while a sandbox records (an upgrade, a crash): the sandbox
    runs on, and at its exit the new node agent saves every call it recorded, before and
    after the restart; before, the recording was silently lost."""
    settings = {**s3.settings(), **vault.settings()}
    async with NodeAgentHarness(short_home, nats_url, **settings) as first:
        sid = await _recording(first, "outlives", TOOL_RECORDER)
        await first.wait_for(sid, "sandbox.ready")
        stdout, stderr = first.agent.manager.log_paths(sid)
        deadline = asyncio.get_running_loop().time() + 60
        while "recorded one" not in stdout.read_text():
            assert asyncio.get_running_loop().time() < deadline, stderr.read_text()[-3000:]
            await asyncio.sleep(0.05)
        await first.stop_agent()  # a node agent restart: the sandbox keeps running
        second = NodeAgentHarness(short_home, nats_url, **settings)
        async with second:
            assert second.agent.manager.get(sid) is not None
            shown = kept_dir(NodeLayout.of(short_home).sandbox(sid).root, "/dsec/recording")
            (shown / "again").write_text("go")  # /dsec/recording/again in the sandbox
            while "recorded two" not in stdout.read_text():
                assert asyncio.get_running_loop().time() < deadline + 60, "no second call"
                await asyncio.sleep(0.05)
            await second.upstream.user.publish(
                events.SandboxStopRequested(requested_by="test"), aggregate_id=sid
            )
            saved = (await second.wait_for(sid, "recording.saved")).payload
            exited = await second.wait_for(sid, "sandbox.exited")
    assert exited.payload["reason"] == "stopped"
    assert (saved["tool_calls"], saved["http_calls"]) == (2, 0)


FILLER = """
import errno, os
path = "/dsec/recording/fill"
try:
    with open(path, "wb") as out:
        for _ in range(400):  # 400 MiB, past the sandbox's disk quota (256 MiB by default)
            out.write(b"x" * (1 << 20))
            out.flush()
    print("wrote 400 MiB", flush=True)
except OSError as exc:
    print("refused", errno.errorcode.get(exc.errno), os.path.getsize(path) >> 20, flush=True)
"""


@pytest.mark.kernel
async def test_a_recording_sandbox_cannot_fill_the_nodes_disk_through_its_calls_directory(
    short_home: Path, nats_url: str, s3: S3Info, vault: VaultInfo
) -> None:
    """The directory a recording sandbox writes its tool calls into is on its disk quota, like
    its other outputs: writing 400 MiB there stops at the quota (ENOSPC), never on the host's
    disk, which every sandbox of the node shares."""
    settings = {**s3.settings(), **vault.settings()}
    async with NodeAgentHarness(short_home, nats_url, **settings) as h:
        sid = await _recording(h, "filler", FILLER)
        exited = await h.wait_for(sid, "sandbox.exited")
        stdout, stderr = (p.read_text() for p in h.agent.manager.log_paths(sid))
    words = stdout.split()
    assert words[:2] == ["refused", "ENOSPC"], (stdout, stderr[-2000:], exited.payload)
    assert int(words[2]) <= 256  # MiB: what the quota holds at most
