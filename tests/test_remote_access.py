"""``dsec sandbox logs|exec`` through the bus: a real node agent runs the sandbox, the CLI asks
from a home of its own (no access to the node's files), and an attacker on the bus reads and
publishes what it likes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import nats
import pytest
from dsec_cli.main import app
from dsec_core import remote
from dsec_testing import trust
from nacl.public import PrivateKey
from nacl.signing import SigningKey
from typer.testing import CliRunner

pytestmark = [pytest.mark.e2e]

SECRET_LINE = "only-the-tenant-reads-only-the-tenant-reads-4b1d"
ERR_LINE = "err-line-err-line"
# The spec itself is in the log (readable on the bus): the lines are computed, not written in it.
SPEC = """\
version: "1.2"
name: remote-logs
base: dsec/python311:latest
entrypoint: [python, -u, -c, "import sys, time; print('only-the-tenant-reads-' * 2 + '4b1d'); \
print('err-line-' + 'err-line', file=sys.stderr); time.sleep(120)"]
"""


def _dsec(env: dict[str, str], *args: str, stdin: str = "") -> tuple[int, str, str]:
    """Run ``dsec ARGS`` as a user on another machine would: its own home (the node's files
    are not there), the stack's NATS, the user's credential."""

    def call() -> tuple[int, str, str]:
        result = CliRunner().invoke(app, list(args), env=env, input=stdin, catch_exceptions=False)
        return result.exit_code, result.stdout, result.stderr

    with ThreadPoolExecutor(max_workers=1) as pool:  # the CLI runs its own event loop
        return pool.submit(call).result()


@pytest.fixture(scope="module")
def running(services_module: Any, stack_env: dict[str, str], tmp_path_factory: Any) -> str:
    """A sandbox of tenant ``default`` that has printed its lines and keeps running."""
    spec = tmp_path_factory.mktemp("spec") / "dsec.yaml"
    spec.write_text(SPEC)
    code, out, err = _dsec(
        stack_env, "submit", str(spec), "--wait", "ready", "--stall", "90", "--json"
    )
    assert code == 0, out + err
    import json

    return str(json.loads(out.strip().splitlines()[-1])["sandbox_id"])


@pytest.fixture(scope="module")
def services_module(dsec_stack: Any) -> Any:
    from dsec_testing.stack import ServiceRunner

    runner = ServiceRunner(dsec_stack)
    runner.start("policy", "builder", "nodeagent")
    try:
        yield runner
    finally:
        runner.close()


@pytest.fixture
def user_env(stack_env: dict[str, str], tmp_path: Any) -> dict[str, str]:
    return {**stack_env, "DSEC_HOME": str(tmp_path / "elsewhere")}


@pytest.fixture
async def eavesdropper(nats_url: str) -> AsyncIterator[list[bytes]]:
    """Everything published on inboxes and remote subjects while the test runs."""
    nc = await nats.connect(nats_url)
    seen: list[bytes] = []

    async def keep(msg: Any) -> None:
        seen.append(bytes(msg.data))

    await nc.subscribe("_INBOX.>", cb=keep)
    await nc.subscribe("dsec_rpc.>", cb=keep)
    await nc.flush()
    yield seen
    await nc.close()


async def test_logs_of_a_running_sandbox_reach_its_tenant_encrypted(
    running: str, user_env: dict[str, str], eavesdropper: list[bytes]
) -> None:
    code, out, err = await asyncio.to_thread(_dsec, user_env, "sandbox", "logs", running)

    assert code == 0, err
    assert SECRET_LINE in out and ERR_LINE not in out
    code, out, err = await asyncio.to_thread(
        _dsec, user_env, "sandbox", "logs", running, "--stderr"
    )
    assert code == 0 and ERR_LINE in out, err
    assert len(eavesdropper) >= 4  # two requests, hellos, output frames, ends
    assert not any(SECRET_LINE.encode() in data for data in eavesdropper)
    assert not any(ERR_LINE.encode() in data for data in eavesdropper)


async def test_exec_streams_stdin_and_output_and_returns_the_exit_code(
    running: str, user_env: dict[str, str], eavesdropper: list[bytes]
) -> None:
    program = (
        "import sys; print(sys.stdin.read().upper()); print('to-err', file=sys.stderr); sys.exit(7)"
    )
    started = time.monotonic()
    code, out, err = await asyncio.to_thread(
        _dsec, user_env, "sandbox", "exec", running, "--", "python", "-c", program,
        stdin="quiet words\n",
    )  # fmt: skip

    assert code == 7, err
    assert "QUIET WORDS" in out and "to-err" in err
    assert time.monotonic() - started < 15
    assert not any(b"quiet words" in data or b"QUIET" in data for data in eavesdropper)


async def _ask(
    nc: Any, node: str, data: bytes, inbox: str, kind: str = "logs"
) -> remote.NodeAnswer:
    sub = await nc.subscribe(inbox)
    await nc.publish(remote.request_subject(node, kind), data, reply=inbox)
    try:
        while True:  # skip the encrypted frames of a session this inbox already has
            msg = await sub.next_msg(timeout=10)
            try:
                return remote.parse_answer(msg.data)
            except remote.RemoteError:
                continue
    finally:
        await sub.unsubscribe()


async def _user(js: Any, home: Any, tenant: str) -> tuple[SigningKey, Any]:
    """A user key of ``tenant`` certified by the stack's root, registered in the log."""
    from dsec_core import identity
    from dsec_core.bus import EventPublisher
    from dsec_core.signing import Signer

    key, cert = identity.issue_user(trust.stack_root(home), f"u{time.monotonic_ns()}", tenant)
    await EventPublisher(
        js, Signer(cert.subject, key, tenant=tenant), certificate=cert
    ).register_key()
    return key, cert


def _request(key: SigningKey, cert: Any, sid: str, inbox: str, **over: Any) -> bytes:
    fields: dict[str, Any] = {
        "kind": "logs",
        "sandbox_id": sid,
        "node_id": "node-1",
        "tenant": cert.tenant,
        "producer": cert.subject,
        "key_id": cert.key_id,
        "reply_to": inbox,
        "client_key": bytes(PrivateKey.generate().public_key),
        "args": {"stream": "stdout", "follow": False},
    }
    fields.update(over)
    return remote.sign_request(key, **fields)


async def test_other_tenants_forgeries_and_replays_are_refused(
    running: str, nats_url: str, dsec_stack: Any
) -> None:
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    try:
        key, cert = await _user(js, dsec_stack.home, "team-b")  # a real, certified user
        inbox = nc.new_inbox()
        answer = await _ask(nc, "node-1", _request(key, cert, running, inbox), inbox)
        assert answer.kind == "refused" and answer.fields["reason"] == "cross-tenant"

        # a request by a key the operator never certified, then a genuine one altered
        rogue = SigningKey.generate()
        inbox = nc.new_inbox()
        answer = await _ask(nc, "node-1", _request(rogue, cert, running, inbox), inbox)
        assert answer.fields["reason"] == "bad-signature", answer.fields

        key, cert = await _user(js, dsec_stack.home, "default")
        inbox = nc.new_inbox()
        genuine = _request(key, cert, running, inbox)
        from dsec_core import canonical

        fields = canonical.unpack(genuine)
        fields["args"] = {"stream": "stderr", "follow": True}
        answer = await _ask(nc, "node-1", canonical.pack(fields), inbox)
        assert answer.fields["reason"] == "bad-signature"

        unsigned = canonical.pack(
            {k: v for k, v in canonical.unpack(genuine).items() if k != "sig"}
        )
        answer = await _ask(nc, "node-1", unsigned, inbox)
        assert answer.fields["reason"] == "malformed"

        # the genuine request is served once; the same bytes again are a replay
        inbox = nc.new_inbox()
        genuine = _request(key, cert, running, inbox)
        assert (await _ask(nc, "node-1", genuine, inbox)).kind == "hello"
        answer = await _ask(nc, "node-1", genuine, inbox)
        assert answer.kind == "refused" and answer.fields["reason"] == "replayed"

        # an exec of a sandbox that is not on that node
        inbox = nc.new_inbox()
        request = _request(
            key, cert, "sbx_nosuchsandbox", inbox, kind="exec", args={"argv": ["id"]}
        )
        answer = await _ask(nc, "node-1", request, inbox, kind="exec")
        assert answer.fields["reason"] == "not-found"
    finally:
        await nc.close()


def test_another_tenants_user_gets_a_clear_refusal_from_the_cli(
    running: str, user_env: dict[str, str], dsec_stack: Any, tmp_path: Any
) -> None:
    from dsec_core import identity

    root = trust.stack_root(dsec_stack.home)
    key, cert = identity.issue_user(root, "eve", "team-b")
    cred = tmp_path / "eve.cred.json"
    cred.write_text(identity.credential_json(key, cert))
    code, out, err = _dsec({**user_env, "DSEC_CREDENTIAL": str(cred)}, "sandbox", "logs", running)
    assert code == 1 and "refused: cross-tenant" in err, err
    assert SECRET_LINE not in out


FOLLOWED = """\
version: "1.2"
name: remote-follow
base: dsec/python311:latest
entrypoint: [python, -u, -c, "import time; print('first-' + 'line'); time.sleep(3); \\
print('last-' + 'line')"]
"""


def test_follow_streams_until_the_sandbox_exits(
    services_module: Any, stack_env: dict[str, str], user_env: dict[str, str], tmp_path: Any
) -> None:
    spec = tmp_path / "dsec.yaml"
    spec.write_text(FOLLOWED)
    code, out, err = _dsec(stack_env, "submit", str(spec), "--wait", "ready", "--json")
    assert code == 0, out + err
    import json

    sid = json.loads(out.strip().splitlines()[-1])["sandbox_id"]
    started = time.monotonic()
    code, out, err = _dsec(user_env, "sandbox", "logs", "-f", sid)

    assert code == 0, err
    assert out.splitlines() == ["first-line", "last-line"]
    assert time.monotonic() - started < 20  # it ended with the sandbox, not at a timeout


def _sessions(services_module: Any) -> float:
    import urllib.request

    text = urllib.request.urlopen(services_module.url("nodeagent") + "/metrics", timeout=5).read()
    for line in text.decode().splitlines():
        if line.startswith("dsec_remote_sessions "):
            return float(line.split()[1])
    raise AssertionError("no dsec_remote_sessions in /metrics")


def test_ctrl_c_ends_the_follow_on_the_node(
    running: str, services_module: Any, user_env: dict[str, str]
) -> None:
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    dsec = str(Path(sys.executable).parent / "dsec")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")} | user_env
    proc = subprocess.Popen(
        [dsec, "sandbox", "logs", "-f", running],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline().decode()  # the sandbox keeps running: -f keeps going
        assert SECRET_LINE in first
        deadline = time.monotonic() + 5  # the gauge is scraped from the node's /metrics
        while _sessions(services_module) < 1:
            assert time.monotonic() < deadline, "the node does not count the follow"
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(10) == 0
        deadline = time.monotonic() + 3  # well before the 10 s keep-alive timeout
        while _sessions(services_module) > 0:
            assert time.monotonic() < deadline, "the node still serves the follow"
            time.sleep(0.1)
    finally:
        proc.kill()
        proc.wait()


async def test_forged_and_replayed_frames_on_the_bus_do_not_break_a_session(
    running: str, user_env: dict[str, str], nats_url: str, dsec_stack: Any
) -> None:
    """Someone reading the bus sees each request (its id, its inbox) and publishes at once:
    garbage and a hello signed by the node agent of another node on the inbox, frames that do
    not decrypt on the input subject under the request's id, and every genuine frame of both
    ends again (replays). The session runs to its end as if nobody had: the CLI believes only
    node-1's signed hello, each end drops what does not decrypt or comes again."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    node2 = await trust.publisher(js, dsec_stack.home, "nodeagent", node_id="node-2")
    input_subject = remote.request_subject("node-1", "input")
    sent: list[str] = []
    tasks: list[asyncio.Task[None]] = []

    async def flood(rid: str, inbox: str) -> None:
        seen_in: list[bytes] = []
        seen_out: list[bytes] = []

        async def keep(into: list[bytes]) -> Any:
            async def cb(msg: Any) -> None:
                into.append(bytes(msg.data))

            return cb

        subs = [
            await nc.subscribe(inbox, cb=await keep(seen_out)),
            await nc.subscribe(input_subject, cb=await keep(seen_in)),
        ]
        try:
            for _ in range(30):
                await nc.publish(inbox, b"\x93garbage")
                await nc.publish(input_subject, remote.input_message(rid, b"x" * 64))
                for data in seen_in[-3:]:
                    await nc.publish(input_subject, data)
                for data in seen_out[-3:]:
                    await nc.publish(inbox, data)
                sent.append(rid)
                await asyncio.sleep(0.1)
        finally:
            for sub in subs:
                await sub.unsubscribe()

    async def on_request(msg: Any) -> None:
        request = remote.parse_request(msg.data, "exec")
        await nc.publish(request.reply_to, b"not an answer")
        hello, _ = remote.hello(
            node2.signer.endorse, node2.signer.key_id, request, PrivateKey.generate()
        )
        await nc.publish(request.reply_to, hello)
        tasks.append(asyncio.create_task(flood(request.id, request.reply_to)))

    await nc.subscribe(remote.request_subject("node-1", "exec"), cb=on_request)
    await nc.flush()
    program = "import sys, time; time.sleep(2); print(sys.stdin.read().upper()); sys.exit(7)"
    try:
        code, out, err = await asyncio.to_thread(
            _dsec, user_env, "sandbox", "exec", running, "--", "python", "-c", program,
            stdin="still mine\n",
        )  # fmt: skip
    finally:
        for task in tasks:
            task.cancel()
        await nc.close()
    assert code == 7, out + err
    assert "STILL MINE" in out
    assert len(sent) >= 10  # the forgeries were on the bus while the session ran
