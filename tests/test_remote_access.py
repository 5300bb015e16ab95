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

    sandbox_id = str(json.loads(out.strip().splitlines()[-1])["sandbox_id"])
    # `ready` is the process started; its interpreter may still be starting (a loaded machine):
    # wait until it has printed both lines, as the tests below expect.
    deadline = time.monotonic() + 90
    while True:
        _, printed, _ = _dsec(stack_env, "sandbox", "logs", sandbox_id)
        _, printed_err, _ = _dsec(stack_env, "sandbox", "logs", sandbox_id, "--stderr")
        if SECRET_LINE in printed and ERR_LINE in printed_err:
            return sandbox_id
        assert time.monotonic() < deadline, f"{sandbox_id} printed {printed!r} {printed_err!r}"
        time.sleep(0.2)


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

        # a copy out of the sandbox by the other tenant's user, signed by a real key
        key_b, cert_b = await _user(js, dsec_stack.home, "team-b")
        inbox = nc.new_inbox()
        request = _request(
            key_b, cert_b, running, inbox, kind="cp", args={"op": "get", "path": "/tmp"}
        )
        answer = await _ask(nc, "node-1", request, inbox, kind="cp")
        assert answer.kind == "refused" and answer.fields["reason"] == "cross-tenant"

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


def test_one_tenant_holds_a_quarter_of_the_nodes_sessions_at_most(
    running: str, services_module: Any, user_env: dict[str, str]
) -> None:
    """One tenant's users could hold all 16 sessions of a node agent (a `logs -f` lives as long
    as its client does): every other tenant's logs and execs on that node were `busy`. Now a
    tenant has 4 at once at most; its fifth is refused `busy`, saying so."""
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    dsec = str(Path(sys.executable).parent / "dsec")
    env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")} | user_env
    follows = [
        subprocess.Popen(
            [dsec, "sandbox", "logs", "-f", running],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
        )
        for _ in range(remote.MAX_SESSIONS_PER_TENANT)
    ]
    try:
        for proc in follows:
            assert proc.stdout is not None
            assert SECRET_LINE in proc.stdout.readline().decode()  # each one's session runs
        assert _sessions(services_module) == remote.MAX_SESSIONS_PER_TENANT
        code, out, err = _dsec(user_env, "sandbox", "logs", running)
        assert code == 1, out + err
        assert "busy" in err and "the most one tenant may" in err, err
        assert _sessions(services_module) < remote.MAX_SESSIONS  # the node had room for others
    finally:
        for proc in follows:
            proc.send_signal(signal.SIGINT)
        for proc in follows:
            try:
                proc.wait(10)
            finally:
                proc.kill()
    deadline = time.monotonic() + 5  # (ended by the clients, not by the keep-alive timeout)
    while _sessions(services_module) > 0:
        assert time.monotonic() < deadline, "the node still serves the follows"
        time.sleep(0.1)


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

    async def flood(rh: bytes, inbox: str) -> None:
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
                await nc.publish(input_subject, remote.input_message(rh, b"x" * 64))
                for data in seen_in[-3:]:
                    await nc.publish(input_subject, data)
                for data in seen_out[-3:]:
                    await nc.publish(inbox, data)
                sent.append(rh.hex())
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
        tasks.append(asyncio.create_task(flood(request.hash, request.reply_to)))

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


# ----------------------------------------------------------------------------- exec --tty


class _Terminal:
    """The user's terminal: ``dsec`` runs on one side of a pseudo-terminal, the test types on
    the other and reads what the user would see."""

    def __init__(self, args: list[str], env: dict[str, str], rows: int = 33, cols: int = 101):
        import fcntl
        import os
        import subprocess
        import sys
        import termios
        from pathlib import Path

        self.master, self.side = os.openpty()
        self.resize(rows, cols)
        self.before = termios.tcgetattr(self.side)
        dsec = str(Path(sys.executable).parent / "dsec")
        env = {k: v for k, v in os.environ.items() if not k.startswith("DSEC_")} | env
        self.proc = subprocess.Popen(
            [dsec, *args], stdin=self.side, stdout=self.side, stderr=self.side,
            env={**env, "TERM": "xterm-256color"}, start_new_session=True,
        )  # fmt: skip
        self.seen = b""
        self._fcntl = fcntl

    def resize(self, rows: int, cols: int) -> None:
        import fcntl
        import struct
        import termios

        fcntl.ioctl(self.side, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def expect(self, text: bytes, timeout: float = 30) -> None:
        import os
        import select

        deadline = time.monotonic() + timeout
        while text not in self.seen:
            left = deadline - time.monotonic()
            assert left > 0, f"{text!r} never shown; the terminal shows {self.seen[-2000:]!r}"
            ready, _, _ = select.select([self.master], [], [], min(left, 0.5))
            if ready:
                self.seen += os.read(self.master, 65536)

    def type(self, data: bytes) -> None:
        import os

        os.write(self.master, data)

    def close(self) -> None:
        import os

        self.proc.kill()
        self.proc.wait()
        os.close(self.master)
        os.close(self.side)


def test_exec_with_a_tty_gives_the_command_a_terminal_and_restores_this_one(
    running: str, user_env: dict[str, str]
) -> None:
    import termios

    program = (
        "import os, sys; print('tty', os.isatty(0), os.isatty(1), os.isatty(2), "
        "*os.get_terminal_size(), os.environ['TERM']); "
        "name = input('name? '); print('hello', name.upper()); sys.exit(5)"
    )
    term = _Terminal(["sandbox", "exec", "-it", running, "--", "python", "-c", program], user_env)
    try:
        term.expect(b"tty True True True 101 33 xterm-256color")
        term.expect(b"name? ")
        term.type(b"alice\r")  # raw mode here: the sandbox's terminal turns \r into a line
        term.expect(b"hello ALICE")
        assert term.proc.wait(20) == 5
        assert termios.tcgetattr(term.side) == term.before  # raw mode undone
    finally:
        term.close()


def test_tty_resize_ctrl_c_and_ctrl_d_reach_the_command(
    running: str, user_env: dict[str, str]
) -> None:
    import signal

    program = (
        "import os, signal, time; "
        "signal.signal(signal.SIGWINCH, lambda *a: print('size', *os.get_terminal_size(), "
        "flush=True)); print('ready', flush=True); time.sleep(60)"
    )
    term = _Terminal(["sandbox", "exec", "-t", running, "--", "python", "-c", program], user_env)
    try:
        term.expect(b"ready")
        term.resize(40, 120)
        term.proc.send_signal(signal.SIGWINCH)  # what the kernel sends the foreground job
        term.expect(b"size 120 40")
        term.type(b"\x03")  # Ctrl-C: the sandbox's terminal interrupts the command
        term.expect(b"KeyboardInterrupt")
        assert term.proc.wait(20) == 130
    finally:
        term.close()

    program = "import sys; [print('got', line.strip().upper(), flush=True) for line in sys.stdin]"
    term = _Terminal(["sandbox", "exec", "-t", running, "--", "python", "-c", program], user_env)
    try:
        term.type(b"first\r")
        term.expect(b"got FIRST")
        term.type(b"\x04")  # Ctrl-D: end of input for the command, which then ends
        assert term.proc.wait(20) == 0
    finally:
        term.close()


# ----------------------------------------------------------------------------- cp


def test_cp_puts_and_gets_a_tree_encrypted(
    running: str, user_env: dict[str, str], tmp_path: Any, eavesdropper: list[bytes]
) -> None:
    import json
    import os

    local = tmp_path / "payload"
    (local / "sub").mkdir(parents=True)
    marker = "copied-in-confidence-" + os.urandom(4).hex()
    (local / "a.txt").write_text(marker)
    blob = os.urandom(1_500_000)  # 46 frames: more than the window the node acknowledges
    (local / "sub" / "b.bin").write_bytes(blob)
    (tmp_path / "secret").write_text("not to be sent")
    (local / "link").symlink_to(tmp_path / "secret")

    code, out, err = _dsec(user_env, "sandbox", "cp", str(local), f"{running}:/tmp", "--json")
    assert code == 0, out + err
    put = json.loads(out)
    assert (put["files"], put["bytes"], put["skipped"]) == (4, len(marker) + len(blob), ["link"])

    check = (
        "print(open('/tmp/payload/a.txt').read(), len(open('/tmp/payload/sub/b.bin','rb').read()))"
    )
    code, out, err = _dsec(user_env, "sandbox", "exec", running, "--", "python", "-c", check)
    assert code == 0 and f"{marker} {len(blob)}" in out, err

    back = tmp_path / "back"
    code, out, err = _dsec(
        user_env, "sandbox", "cp", f"{running}:/tmp/payload", str(back), "--json"
    )
    assert code == 0, out + err
    got = json.loads(out)
    assert (got["files"], got["bytes"]) == (4, len(marker) + len(blob))
    assert (back / "a.txt").read_text() == marker
    assert (back / "sub" / "b.bin").read_bytes() == blob
    assert not (back / "link").exists()

    # one file, into an existing local directory
    code, out, err = _dsec(
        user_env, "sandbox", "cp", f"{running}:/tmp/payload/a.txt", str(back / "sub")
    )
    assert code == 0 and "1 files" in out, out + err
    assert (back / "sub" / "a.txt").read_text() == marker
    assert not any(marker.encode() in data for data in eavesdropper)
    assert not any(blob[1000:1064] in data for data in eavesdropper)


def test_cp_stays_inside_the_sandbox_writable_dirs(
    running: str, user_env: dict[str, str], tmp_path: Any
) -> None:
    setup = (
        "import os; os.makedirs('/tmp/jail', exist_ok=True); "
        "[os.path.lexists(p) or os.symlink(t, p) for p, t in "
        "[('/tmp/pw', '/etc/passwd'), ('/tmp/etc', '/etc'), ('/tmp/jail/up', '/tmp')]]"
    )
    code, out, err = _dsec(user_env, "sandbox", "exec", running, "--", "python", "-c", setup)
    assert code == 0, out + err
    local = tmp_path / "f.txt"
    local.write_text("x")
    dest = tmp_path / "got"

    refused = [  # (args, exit code, what the error says)
        ([f"{running}:/etc/passwd", str(dest)], 2, "not-allowed"),
        ([str(local), f"{running}:/workspace/code"], 2, "may write"),
        ([str(local), f"{running}:/etc"], 2, "/tmp"),
        ([f"{running}:/tmp/../etc/passwd", str(dest)], 2, "'..'"),
        ([f"{running}:/tmp/pw", str(dest)], 1, "symlink; not followed"),
        ([f"{running}:/tmp/etc/passwd", str(dest)], 1, "not followed"),
        ([str(local), f"{running}:/tmp/etc/x"], 1, "not followed"),
        ([str(local), f"{running}:/tmp/pw"], 1, "symlink; not followed"),
        ([str(local), str(dest)], 2, "SANDBOX_ID:/path"),
    ]
    for args, expected_code, expected in refused:
        code, out, err = _dsec(user_env, "sandbox", "cp", *args)
        assert (code, expected in err) == (expected_code, True), (args, out, err)
    assert not dest.exists()
    # a directory with a link to / inside: the link is skipped, not followed
    code, out, err = _dsec(user_env, "sandbox", "cp", f"{running}:/tmp/jail", str(dest), "--json")
    assert code == 0, out + err
    assert __import__("json").loads(out)["skipped"] == ["up"]
    assert sorted(p.name for p in dest.iterdir()) == []


def test_another_tenants_user_cannot_copy(
    running: str, user_env: dict[str, str], dsec_stack: Any, tmp_path: Any
) -> None:
    from dsec_core import identity

    root = trust.stack_root(dsec_stack.home)
    key, cert = identity.issue_user(root, "mallory", "team-b")
    cred = tmp_path / "mallory.cred.json"
    cred.write_text(identity.credential_json(key, cert))
    env = {**user_env, "DSEC_CREDENTIAL": str(cred)}
    local = tmp_path / "evil.txt"
    local.write_text("planted")
    for args in ([f"{running}:/tmp", str(tmp_path / "loot")], [str(local), f"{running}:/tmp"]):
        code, _, err = _dsec(env, "sandbox", "cp", *args)
        assert code == 1 and "refused: cross-tenant" in err, (args, err)
    assert not (tmp_path / "loot").exists()
