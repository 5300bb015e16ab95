"""Egress enforcement in the kernel, as a sandboxed process sees it.

Each test puts a fresh client process in a fresh cgroup v2 directory with the programs attached
(the client writes its own pid into ``cgroup.procs`` before any network call), then asserts what
the process observes — answers, NXDOMAIN, EPERM — and the verdict events the agent receives.
Loopback only: the DNS zone, the echo servers and every destination live in 127.0.0.0/8 or ::1.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib: reach the fixture
from dns_zone_server import ZoneServer, start_test_dns

from dsec_nodeagent.dns.policy import DnsBounds
from dsec_nodeagent.dns.proxy import proxy_port_range
from dsec_nodeagent.ebpf import (
    EgressController,
    EgressPlan,
    EgressRule,
    RateLimit,
    Verdict,
    VerdictEvent,
    libbpf,
)
from dsec_nodeagent.ebpf.kernel import ATTACH_TYPES, FOLLOWERS
from dsec_nodeagent.ebpf.metrics import EgressCollector

pytestmark = pytest.mark.kernel

CGROUP2 = Path("/sys/fs/cgroup/unified")
SANDBOX_SOCKETS = 256  # each test's cgroup: IP sockets it may hold (small, to reach it quickly)
FAKE_RESOLVER = "127.0.0.99"  # nothing listens here: answers prove the redirect

# The sandboxed client: joins the cgroup, then runs JSON actions and prints JSON results.
CLIENT = r"""
import ctypes, errno, json, os, socket, sys, time
import dns.message, dns.query, dns.rcode

cgroup, actions = sys.argv[1], json.loads(sys.argv[2])
FAKE = "127.0.0.99"
with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
held = {}
libc = ctypes.CDLL(None, use_errno=True)
UNSPEC = (ctypes.c_ubyte * 16)()  # sa_family 0: AF_UNSPEC (connect() with it disconnects)

def listener():
    lsn = socket.socket()
    lsn.bind(("127.0.0.1", 0))
    lsn.listen(4)
    return lsn

def family(host):
    return socket.AF_INET6 if ":" in host else socket.AF_INET

def tcp(host, port):
    s = socket.socket(family(host), socket.SOCK_STREAM)
    s.settimeout(5)
    try:
        s.connect((host, port))
    except BaseException:
        s.close()
        raise
    return s

def echo(s):
    s.sendall(b"ping")
    return "ok" if s.recv(16) == b"ping" else "bad echo"

def libc_connect(host, port):
    class sockaddr_in(ctypes.Structure):
        _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16),
                    ("addr", ctypes.c_uint8 * 4), ("zero", ctypes.c_uint8 * 8)]
    fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
    sa = sockaddr_in(socket.AF_INET, socket.htons(port),
                     (ctypes.c_uint8 * 4)(*socket.inet_aton(host)))
    rc = libc.connect(fd, ctypes.byref(sa), ctypes.sizeof(sa))
    err = ctypes.get_errno()
    libc.close(fd)
    return "ok" if rc == 0 else errno.errorcode[err]

def resolve(a):
    q = dns.message.make_query(a["name"], a.get("type", "A"))
    server, proto = a.get("server", "127.0.0.99"), a.get("proto", "udp")
    timeout = a.get("timeout", 3)
    if proto == "udp":
        r = dns.query.udp(q, server, port=53, timeout=timeout)
    elif proto == "tcp":
        r = dns.query.tcp(q, server, port=53, timeout=timeout)
    else:
        r, _ = dns.query.udp_with_fallback(q, server, port=53, timeout=timeout)
    addrs = [rd.address for rr in r.answer if rr.rdtype in (1, 28) for rd in rr]
    return {"rcode": dns.rcode.to_text(r.rcode()), "addresses": addrs,
            "truncated": bool(r.flags & 0x0200)}

def run(a):
    op = a["op"]
    try:
        if op == "connect":
            s = tcp(a["host"], a["port"])
            try:
                return echo(s)
            finally:
                s.close()
        if op == "hold":
            held[a["id"]] = tcp(a["host"], a["port"])
            return "ok"
        if op == "use":
            return echo(held[a["id"]])
        if op == "burst":
            return [run({"op": "connect", "host": a["host"], "port": a["port"]})
                    for _ in range(a["count"])]
        if op == "libc_connect":
            return libc_connect(a["host"], a["port"])
        if op == "fastopen":
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.sendto(b"x", socket.MSG_FASTOPEN, (a["host"], a["port"]))
            finally:
                s.close()
            return "ok"
        if op == "udp_sendto":
            s = socket.socket(family(a["host"]), socket.SOCK_DGRAM)
            try:
                s.sendto(b"x", (a["host"], a["port"]))
            finally:
                s.close()
            return "ok"
        if op == "udp_replies":  # one datagram to a peer, then what comes back until "end"
            s = socket.socket(family(a["host"]), socket.SOCK_DGRAM)
            try:
                s.settimeout(a["wait"])
                if s.family == socket.AF_INET6:  # ICMP errors onto the error queue, if it may
                    s.setsockopt(socket.IPPROTO_IPV6, 25, 1)  # IPV6_RECVERR
                else:
                    s.setsockopt(socket.IPPROTO_IP, 11, 1)  # IP_RECVERR
                s.sendto(b"ping", (a["host"], a["port"]))
                with open(a["port_file"] + ".tmp", "w") as f:
                    f.write(str(s.getsockname()[1]))
                os.rename(a["port_file"] + ".tmp", a["port_file"])
                got = []
                a["got"] = got
                while not got or got[-1][0] != "end":
                    data, source = s.recvfrom(64)
                    got.append([data.decode(), source[0], source[1]])
                s.setblocking(False)  # (a timeout would wait for POLLIN first)
                try:
                    queued = s.recvmsg(2048, 1024, socket.MSG_ERRQUEUE)
                    got.append(["errqueue", queued[0].decode(errors="replace"), 0])
                except BlockingIOError:
                    pass
                return got
            except socket.timeout:
                return ["timeout", a.get("got")]
            finally:
                s.close()
        if op == "listen_unbound":  # listen() with no bind(): the kernel binds every address
            s = socket.socket(socket.AF_INET6 if a.get("v6") else socket.AF_INET)
            try:
                s.listen(4)
                with open(a["port_file"] + ".tmp", "w") as f:
                    f.write(str(s.getsockname()[1]))
                os.rename(a["port_file"] + ".tmp", a["port_file"])
                s.settimeout(a["wait"])
                conn, peer = s.accept()
                conn.close()
                return [s.getsockname()[0], peer[0]]
            except socket.timeout:
                return "timeout"
            finally:
                s.close()
        if op == "bind":
            kind = socket.SOCK_DGRAM if a.get("udp") else socket.SOCK_STREAM
            s = socket.socket(family(a["host"]), kind)
            try:
                s.bind((a["host"], a["port"]))
                return list(s.getsockname()[:2])
            finally:
                s.close()
        if op == "churn":  # connect and close, its own side first (TIME_WAIT), until refused
            made, refused = 0, None
            while refused is None and made < a["most"]:
                try:
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM, a.get("proto", 0))
                except OSError as e:
                    refused = errno.errorcode.get(e.errno, str(e))
                    break
                try:
                    s.connect((a["host"], a["port"]))
                    if a.get("half"):  # shutdown, then the peer's FIN: TIME_WAIT before close
                        s.shutdown(socket.SHUT_WR)
                    if a.get("half") or a.get("eof"):  # (eof: the peer closes first)
                        while s.recv(64):
                            pass
                    made += 1
                except OSError as e:
                    refused = "connect " + errno.errorcode.get(e.errno, str(e))
                finally:
                    s.close()
            return {"made": made, "refused": refused}
        if op == "listen_churn":  # a listener, an accepted socket closed first (TIME_WAIT)
            made, refused = 0, None
            while refused is None and made < a["most"]:
                try:
                    lsn = listener()
                    c = socket.socket()
                except OSError as e:
                    refused = errno.errorcode.get(e.errno, str(e))
                    break
                c.connect(lsn.getsockname())
                x, _ = lsn.accept()
                x.close()  # its connection (on the listener's port) holds it a minute
                while c.recv(64):
                    pass
                c.close()
                lsn.close()
                made += 1
            return {"made": made, "refused": refused}
        if op == "cycles":  # connect(AF_UNSPEC) and again: a socket, an accepted one
            lsn = listener()
            c = socket.socket()
            c.connect(lsn.getsockname())
            accepted, _ = lsn.accept()
            done = []
            for s in (socket.socket(), accepted):
                n = 0
                for _ in range(a["n"]):
                    if libc.connect(s.fileno(), UNSPEC, 16) != 0:
                        break
                    try:
                        s.connect((a["host"], a["port"]))
                    except OSError:
                        break
                    n += 1
                libc.connect(s.fileno(), UNSPEC, 16)
                done.append(n)
            for s in (accepted, c, lsn):
                s.close()
            return done
        if op == "rebind_accepted":  # accept, connect(AF_UNSPEC), bind the accepted socket
            lsn = listener()
            c = socket.socket()
            kept, refused = [], None
            while refused is None and len(kept) < a["most"]:
                try:
                    c.connect(lsn.getsockname())
                except OSError as e:  # (the bound reached: no connect again either)
                    refused = errno.errorcode.get(e.errno, str(e))
                    break
                x, _ = lsn.accept()
                libc.connect(x.fileno(), UNSPEC, 16)  # a reset: no TIME_WAIT on either side
                libc.connect(c.fileno(), UNSPEC, 16)
                try:
                    x.bind(("127.0.0.1", 0))
                    kept.append(x)
                except OSError as e:
                    refused = errno.errorcode.get(e.errno, str(e))
                    x.close()
            for s in (*kept, c, lsn):
                s.close()
            return {"made": len(kept), "refused": refused}
        if op == "serve_close_first":  # accept n connections, close each first
            lsn = socket.socket()
            lsn.bind(("127.0.0.1", 0))
            lsn.listen(128)
            with open(a["port_file"] + ".tmp", "w") as f:
                f.write(str(lsn.getsockname()[1]))
            os.rename(a["port_file"] + ".tmp", a["port_file"])
            lsn.settimeout(a["wait"])
            for _ in range(a["n"]):
                x, _ = lsn.accept()
                x.close()
            lsn.close()
            return a["n"]
        if op == "socket":
            try:
                socket.socket(socket.AF_INET, socket.SOCK_STREAM, a.get("proto", 0)).close()
                return "ok"
            except OSError as e:
                return errno.errorcode.get(e.errno, str(e))
        if op == "stuck":  # connections whose FIN waits behind unsent data; then it exits
            for _ in range(a["n"]):
                s = socket.socket()
                s.connect((a["host"], a["port"]))
                s.setblocking(False)
                try:
                    while True:
                        s.send(b"x" * 65536)
                except BlockingIOError:
                    held[len(held)] = s
            return len(held)
        if op == "reconnect":  # one socket: connect, TIME_WAIT, connect(AF_UNSPEC), again
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            made, refused = 0, None
            while refused is None and made < a["most"]:
                try:
                    s.connect((a["host"], a["port"]))
                except OSError as e:
                    refused = errno.errorcode.get(e.errno, str(e))
                    break
                s.shutdown(socket.SHUT_WR)
                while s.recv(64):
                    pass
                made += 1
                if libc.connect(s.fileno(), UNSPEC, 16) != 0:
                    refused = "unspec " + errno.errorcode.get(ctypes.get_errno(), "?")
            s.close()
            return {"made": made, "refused": refused}
        if op == "socket_budget":  # IP sockets until refused; then 16 closed and 16 again
            socks, refused = [], None
            while refused is None and len(socks) < a["most"]:
                kind = socket.SOCK_DGRAM if len(socks) % 2 else socket.SOCK_STREAM
                try:
                    s = socket.socket(socket.AF_INET6 if len(socks) % 3 == 0 else
                                      socket.AF_INET, kind)
                    s.bind(("::1" if s.family == socket.AF_INET6 else "127.0.0.1", 0))
                    socks.append(s)
                except OSError as e:
                    refused = errno.errorcode.get(e.errno, str(e))
            for s in socks[:16]:
                s.close()
            again = 0
            for _ in range(16):
                try:
                    socks.append(socket.socket(socket.AF_INET, socket.SOCK_STREAM)); again += 1
                except OSError:
                    pass
            try:
                socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                after = "ok"
            except OSError as e:
                after = errno.errorcode.get(e.errno, str(e))
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # not an IP socket
            unix.close()
            for s in socks:
                s.close()
            return {"held": len(socks) - again, "refused": refused, "again": again,
                    "after": after}
        if op == "resolve":
            return resolve(a)
        if op == "getaddrinfo":
            infos = socket.getaddrinfo(a["host"], a["port"], socket.AF_INET, socket.SOCK_STREAM)
            return sorted({i[4][0] for i in infos})
        if op == "udp_peer":
            s = socket.socket(family(a["host"]), socket.SOCK_DGRAM)
            try:
                s.connect((a["host"], 53))
                return list(s.getpeername()[:2])
            finally:
                s.close()
        if op == "dns_after_churn":
            # A query, then (before its answer is read) as many DNS sockets as the node-wide
            # table of original destinations once held: where does the answer seem to come from?
            q = dns.message.make_query(a["name"], "A")
            s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            s.settimeout(5)
            s.sendto(q.to_wire(), (FAKE, 53))
            for _ in range(a["sockets"]):
                other = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                other.sendto(b"x", (FAKE, 53))
                other.close()
            data, source = s.recvfrom(4096)
            s.close()
            return [source[0], source[1], dns.rcode.to_text(dns.message.from_wire(data).rcode())]
        if op == "until_denied":
            deadline = time.monotonic() + a["deadline"]
            attempts = 0
            while time.monotonic() < deadline:
                attempts += 1
                result = run({"op": "connect", "host": a["host"], "port": a["port"]})
                if result != "ok":
                    return {"result": result, "attempts": attempts}
                time.sleep(0.2)
            return {"result": "still allowed", "attempts": attempts}
        return "unknown op " + op
    except socket.gaierror as e:
        return "gaierror:" + str(e.args[0])
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e)) if e.errno else type(e).__name__
    except Exception as e:
        return type(e).__name__

print(json.dumps([run(a) for a in actions]))
"""

# A node agent in its own process: attaches one sandbox, says "ready", then waits to be killed.
AGENT = r"""
import asyncio, json, sys
from pathlib import Path
from dsec_nodeagent.ebpf import EgressController, EgressPlan

async def main():
    pin, state, upstream, sandboxes = sys.argv[1:5]
    ctl = EgressController(dns_upstream=upstream, pin_dir=Path(pin), state_dir=Path(state))
    await ctl.start()
    for cgroup, plan in json.loads(sandboxes):
        await ctl.attach(Path(cgroup), EgressPlan.model_validate(plan))
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def run_client(
    cgroup: Path, actions: list[dict[str, Any]], resolv_conf: Path | None = None
) -> list[Any]:
    """Run the client in ``cgroup``; with ``resolv_conf``, glibc sees that file (mount ns)."""
    argv = [sys.executable, "-c", CLIENT, str(cgroup), json.dumps(actions)]
    if resolv_conf is not None:
        script = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
        argv = ["unshare", "--mount", "sh", "-c", script, str(resolv_conf), *argv]
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), 90)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode == 0, err.decode()
    result: list[Any] = json.loads(out)
    return result


class Echo:
    """TCP echo servers on loopback addresses, one free port per address."""

    def __init__(self) -> None:
        self.servers: dict[tuple[str, int], asyncio.Server] = {}

    async def serve(self, host: str, port: int = 0) -> int:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(ConnectionError):
                data = await reader.read(16)
                writer.write(data)
                await writer.drain()
            writer.close()

        server = await asyncio.start_server(handle, host, port)
        bound = server.sockets[0].getsockname()[1]
        self.servers[(host, bound)] = server
        return int(bound)

    async def close(self) -> None:
        for server in self.servers.values():
            server.close()
            await server.wait_closed()


@pytest.fixture(scope="session")
async def zone() -> AsyncIterator[ZoneServer]:
    server = await start_test_dns()
    yield server
    await server.close()


@pytest.fixture(scope="session")
async def egress(zone: ZoneServer) -> AsyncIterator[EgressController]:
    tag = f"test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    ctl = EgressController(
        dns_upstream=zone.address,
        pin_dir=Path(f"/sys/fs/bpf/dsec-{tag}/egress"),
        state_dir=Path(f"/run/dsec-{tag}/egress"),
        ttl_grace_s=0.0,
        extra_doh_addresses=("127.0.0.40",),
        dns_bounds=DnsBounds(sandbox_quota=64),  # small, so a flood test fills it quickly
        max_sandbox_sockets=SANDBOX_SOCKETS,
    )
    await ctl.start()
    yield ctl
    await ctl.uninstall()
    for path in (Path(f"/sys/fs/bpf/dsec-{tag}"), Path(f"/run/dsec-{tag}")):
        with contextlib.suppress(FileNotFoundError):
            _rmtree(path)
    assert not Path(f"/sys/fs/bpf/dsec-{tag}/egress").exists()


def _rmtree(path: Path) -> None:
    for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    path.rmdir()


@pytest.fixture(scope="session")
async def echo() -> AsyncIterator[Echo]:
    servers = Echo()
    yield servers
    await servers.close()


@pytest.fixture
def cgroup() -> Iterator[Path]:
    path = CGROUP2 / f"dsec-egress-test-{uuid.uuid4().hex[:10]}"
    path.mkdir()
    yield path
    _kill_members(path)
    path.rmdir()


def _kill_members(path: Path) -> None:
    for pid in (path / "cgroup.procs").read_text().split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)


@contextlib.asynccontextmanager
async def attached(
    egress: EgressController, cgroup: Path, plan: EgressPlan
) -> AsyncIterator[list[VerdictEvent]]:
    """Attach ``plan``; yield the list that receives this cgroup's verdict events; detach."""
    events: list[VerdictEvent] = []
    sandbox = await egress.attach(cgroup, plan)

    def collect(event: VerdictEvent) -> None:
        if event.cgroup_id == sandbox.cgroup_id:
            events.append(event)

    egress.add_listener(collect)
    try:
        yield events
    finally:
        egress.drain_events()
        egress.remove_listener(collect)
        await egress.detach(cgroup)
        # (the socket followers stay until the cgroup goes: its sockets still closing)
        assert egress.kernel.attached_count(cgroup) == len(FOLLOWERS)
        assert not list(egress.kernel.host_entries(sandbox.cgroup_id))
        assert sandbox.cgroup_id not in egress.kernel.sandbox_ids()
        assert not [c for c in egress.counters() if c.cgroup_id == sandbox.cgroup_id]


def denials(events: list[VerdictEvent]) -> set[tuple[str, str, int, str | None]]:
    return {(e.verdict.name, e.address, e.port, e.rule_id) for e in events if e.denied}


def rule(rule_id: str, **fields: Any) -> EgressRule:
    """A rule; domain rules allow internal targets by default: every test address is loopback,
    and DNS answers pointing at loopback are refused unless a rule allows internal targets."""
    if "domain" in fields:
        fields.setdefault("allow_internal_only", True)
    return EgressRule(id=rule_id, **fields)


async def test_allowed_name_resolves_and_connects_everything_else_is_refused(
    egress: EgressController, echo: Echo, cgroup: Path
) -> None:
    port = await echo.serve("127.0.0.10")
    other_port = await echo.serve("127.0.0.10")
    denied_port = await echo.serve("127.0.0.20", port)
    v6_port = await echo.serve("::1")
    plan = EgressPlan(
        sandbox_id="sbx-basic", rules=(rule("egress[0]", domain="allowed.test", ports=(port,)),)
    )
    async with attached(egress, cgroup, plan) as events:
        results = await run_client(
            cgroup,
            [
                {"op": "resolve", "name": "allowed.test"},
                {"op": "connect", "host": "127.0.0.10", "port": port},
                {"op": "resolve", "name": "denied.test"},
                {"op": "connect", "host": "127.0.0.20", "port": denied_port},
                {"op": "connect", "host": "127.0.0.10", "port": other_port},
                {"op": "connect", "host": "::1", "port": v6_port},
                {"op": "connect", "host": "::ffff:127.0.0.20", "port": denied_port},
                {"op": "connect", "host": "::ffff:127.0.0.10", "port": port},
                {"op": "libc_connect", "host": "127.0.0.20", "port": denied_port},
                {"op": "libc_connect", "host": "127.0.0.10", "port": port},
                {"op": "fastopen", "host": "127.0.0.20", "port": denied_port},
                {"op": "udp_sendto", "host": "127.0.0.20", "port": 5353},
                {"op": "udp_sendto", "host": "::1", "port": 5353},
            ],
        )
        egress.drain_events()
        counts = {
            (c.rule_id, c.verdict): c.count
            for c in egress.counters()
            if c.sandbox_id == "sbx-basic"
        }
        node_wide: dict[tuple[str, str], int] = {}
        for c in egress.counters():  # the node's sums: no series per sandbox
            key = (c.rule_id or "-", c.verdict.label)
            node_wide[key] = node_wide.get(key, 0) + c.count
        samples = [s for fam in EgressCollector(egress).collect() for s in fam.samples]
        assert all(set(s.labels) == {"rule", "verdict"} for s in samples)
        scraped = {(s.labels["rule"], s.labels["verdict"]): s.value for s in samples}
    assert results == [
        {"rcode": "NOERROR", "addresses": ["127.0.0.10"], "truncated": False},
        "ok",
        {"rcode": "NXDOMAIN", "addresses": [], "truncated": False},
        "EPERM",  # direct IP of a name the sandbox may not resolve
        "EPERM",  # allowed address, another port
        "EPERM",  # IPv6
        "EPERM",  # v4-mapped IPv6 of a denied address
        "ok",  # v4-mapped IPv6 of the allowed address: the IPv4 rule applies
        "EPERM",  # raw libc connect (invisible to Python audit hooks)
        "ok",
        "EPERM",  # TCP Fast Open: sendto(MSG_FASTOPEN) connects too
        "EPERM",  # unconnected UDP
        "EPERM",
    ]
    refused = sorted((e.hook.name, e.protocol, e.address, e.port) for e in events if e.denied)
    assert refused == sorted(
        [
            ("CONNECT4", "tcp", "127.0.0.20", denied_port),
            ("CONNECT4", "tcp", "127.0.0.10", other_port),
            ("CONNECT6", "tcp", "::1", v6_port),
            ("CONNECT6", "tcp", "127.0.0.20", denied_port),  # v4-mapped, judged as IPv4
            ("CONNECT4", "tcp", "127.0.0.20", denied_port),  # libc
            ("CONNECT4", "tcp", "127.0.0.20", denied_port),  # fast open
            ("SENDMSG4", "udp", "127.0.0.20", 5353),
            ("SENDMSG6", "udp", "::1", 5353),
        ]
    )
    refusal = next(e for e in events if e.denied and e.port == v6_port)
    assert refusal.sandbox_id == "sbx-basic"
    assert refusal.verdict is Verdict.DENY_NO_RULE
    assert "denied: no egress rule allows" in refusal.message()
    assert counts[("egress[0]", Verdict.ALLOW)] == 3
    assert counts[(None, Verdict.DENY_NO_RULE)] == 8
    assert counts[(None, Verdict.REDIRECT_DNS)] == 2
    assert scraped == node_wide
    assert scraped[("egress[0]", "allow")] >= 3
    assert scraped[("-", "deny_no_rule")] >= 8


async def test_dns_is_forced_to_the_proxy_whatever_resolver_the_code_names(
    egress: EgressController, echo: Echo, cgroup: Path, tmp_path: Path
) -> None:
    port = await echo.serve("127.0.0.10")
    await echo.serve("::1", port)
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(f"nameserver {FAKE_RESOLVER}\noptions attempts:1 timeout:3\n")
    plan = EgressPlan(
        sandbox_id="sbx-dns",
        rules=(
            rule("egress[0]", domain="allowed.test", ports=(port,)),
            rule("egress[1]", domain="big.test", ports=(port,)),
        ),
    )
    async with attached(egress, cgroup, plan):
        results = await run_client(
            cgroup,
            [
                {"op": "getaddrinfo", "host": "allowed.test", "port": port},  # glibc: connected UDP
                {"op": "connect", "host": "127.0.0.10", "port": port},
                {"op": "getaddrinfo", "host": "denied.test", "port": port},
                {"op": "resolve", "name": "allowed.test", "server": "127.0.0.53", "proto": "tcp"},
                {"op": "resolve", "name": "allowed.test", "server": "::1"},
                {"op": "resolve", "name": "allowed.test", "server": "::ffff:127.0.0.77"},
                {"op": "resolve", "name": "big.test", "proto": "udp"},
                {"op": "resolve", "name": "big.test", "proto": "auto"},
                {"op": "udp_peer", "host": FAKE_RESOLVER},
                {"op": "udp_peer", "host": "::1"},
                {"op": "resolve", "name": "allowed.test", "type": "AAAA"},
                {"op": "connect", "host": "::1", "port": port},  # opened by the AAAA answer
            ],
            resolv_conf=resolv,
        )
    assert results[0] == ["127.0.0.10"]
    assert results[1] == "ok"
    assert results[2] == "gaierror:-2"  # EAI_NONAME: NXDOMAIN
    for answer in results[3:6]:
        assert answer == {"rcode": "NOERROR", "addresses": ["127.0.0.10"], "truncated": False}
    assert results[6]["truncated"] is True  # 32 records (the answer bound) exceed 512 bytes
    assert len(results[7]["addresses"]) == 32  # the client retried over TCP, redirected too
    assert results[8] == [FAKE_RESOLVER, 53]  # getpeername shows what the code asked for
    assert results[9] == ["::1", 53]
    assert results[10]["addresses"] == ["::1"]
    assert results[11] == "ok"


async def test_a_dns_answer_keeps_its_source_however_many_dns_sockets_come_after(
    egress: EgressController, echo: Echo, cgroup: Path
) -> None:
    """The address a DNS query went to is kept with its socket: 70,000 DNS sockets made
    after it (more than the node-wide table of 65,536 that held them before, where such a
    churn evicted every neighbour's entry) do not make its answer seem to come from the proxy,
    which resolvers drop as a spoof."""
    port = await echo.serve("127.0.0.10")
    plan = EgressPlan(
        sandbox_id="sbx-churn", rules=(rule("egress[0]", domain="allowed.test", ports=(port,)),)
    )
    async with attached(egress, cgroup, plan):
        (answer,) = await run_client(
            cgroup, [{"op": "dns_after_churn", "name": "allowed.test", "sockets": 70_000}]
        )
    assert answer == [FAKE_RESOLVER, 53, "NOERROR"], answer


async def test_bad_input_is_refused_and_leaves_nothing(
    egress: EgressController, cgroup: Path, tmp_path: Path
) -> None:
    plan = EgressPlan(sandbox_id="sbx-bad")
    with pytest.raises(ValueError, match=f"cgroup_path {tmp_path}: not a cgroup v2 directory"):
        await egress.attach(tmp_path, plan)
    sandbox = await egress.attach(cgroup, plan)
    try:
        with pytest.raises(ValueError, match=r"already attached \(sandbox sbx-bad\)"):
            await egress.attach(cgroup, plan.model_copy(update={"sandbox_id": "other"}))
        assert egress.kernel.attached_count(cgroup) == len(ATTACH_TYPES)
        assert [s.sandbox_id for s in egress.sandboxes()] == ["sbx-bad"]
    finally:
        await egress.detach(cgroup)
    assert egress.kernel.attached_count(cgroup) == len(FOLLOWERS)  # (they go with the cgroup)
    assert egress.proxy.port_of(sandbox.cgroup_id) is None
    assert not (egress.state_dir / f"{sandbox.cgroup_id}.json").exists()


async def test_rate_limit_cuts_a_burst_at_the_bucket_size(
    egress: EgressController, echo: Echo, cgroup: Path
) -> None:
    port = await echo.serve("127.0.0.30")
    plan = EgressPlan(
        sandbox_id="sbx-rate",
        log_allowed=True,
        rules=(
            rule(
                "egress[0]",
                cidr="127.0.0.30/32",
                ports=(port,),
                rate_limit=RateLimit(count=5, per_seconds=3600),
            ),
        ),
    )
    async with attached(egress, cgroup, plan) as events:
        (burst,) = await run_client(
            cgroup, [{"op": "burst", "host": "127.0.0.30", "port": port, "count": 8}]
        )
        egress.drain_events()
    assert burst == ["ok"] * 5 + ["EPERM"] * 3
    assert [e.verdict for e in events] == [Verdict.ALLOW] * 5 + [Verdict.DENY_RATE_LIMIT] * 3
    limited = [e for e in events if e.verdict is Verdict.DENY_RATE_LIMIT]
    assert len(limited) == 3
    assert {e.rule_id for e in limited} == {"egress[0]"}
    assert "rate limit of rule egress[0] exceeded" in limited[0].message()


async def test_ttl_expiry_stops_new_connects_but_not_open_ones(
    egress: EgressController, echo: Echo, cgroup: Path
) -> None:
    port = await echo.serve("127.0.0.11")
    plan = EgressPlan(
        sandbox_id="sbx-ttl",
        rules=(
            rule("egress[0]", domain="short.test", ports=(port,)),  # TTL 2 s in the zone
        ),
    )
    async with attached(egress, cgroup, plan) as events:
        results = await run_client(
            cgroup,
            [
                {"op": "resolve", "name": "short.test"},
                {"op": "hold", "id": "open", "host": "127.0.0.11", "port": port},
                {"op": "until_denied", "host": "127.0.0.11", "port": port, "deadline": 20},
                {"op": "use", "id": "open"},
            ],
        )
        egress.drain_events()
        cgid = os.stat(cgroup).st_ino
        assert [a for a, *_ in egress.kernel.host_entries(cgid)] == [ip_address("127.0.0.11")]
        assert egress.kernel.sweep(time.monotonic_ns()) >= 1
        assert list(egress.kernel.host_entries(cgid)) == []
    assert results[0]["addresses"] == ["127.0.0.11"]
    assert results[1] == "ok"
    assert results[2]["result"] == "EPERM"
    assert results[3] == "ok"  # the connection opened before expiry still works
    assert ("DENY_EXPIRED", "127.0.0.11", port, "egress[0]") in denials(events)


async def test_cidr_internal_only_dot_and_doh(
    egress: EgressController, echo: Echo, cgroup: Path
) -> None:
    port = await echo.serve("127.0.0.21")
    doh = await echo.serve("127.0.0.40", 443)
    doh_exact = EgressPlan(
        sandbox_id="sbx-doh-exact", rules=(rule("egress[0]", cidr="127.0.0.40/32", ports=(443,)),)
    )
    plan = EgressPlan(
        sandbox_id="sbx-cidr",
        rules=(
            rule("egress[0]", cidr="0.0.0.0/0", allow_internal_only=True),  # every port
        ),
    )
    async with attached(egress, cgroup, plan) as events:
        results = await run_client(
            cgroup,
            [
                {"op": "connect", "host": "127.0.0.21", "port": port},
                {
                    "op": "libc_connect",
                    "host": "127.0.0.21",
                    "port": 853,
                },  # DoT needs port 853 named
                {
                    "op": "libc_connect",
                    "host": "127.0.0.40",
                    "port": doh,
                },  # DoH resolver via a range
            ],
        )
        egress.drain_events()
    assert results == ["ok", "EPERM", "EPERM"]
    assert ("DENY_NO_RULE", "127.0.0.21", 853, None) in denials(events)
    assert ("DENY_DOH", "127.0.0.40", 443, "egress[0]") in denials(events)
    async with attached(egress, cgroup, doh_exact):
        assert await run_client(cgroup, [{"op": "connect", "host": "127.0.0.40", "port": doh}]) == [
            "ok"
        ]


async def test_dns_passthrough_resolves_but_does_not_open(
    egress: EgressController, echo: Echo, cgroup: Path
) -> None:
    port = await echo.serve("127.0.0.10")
    denied_port = await echo.serve("127.0.0.20", port)
    plan = EgressPlan(
        sandbox_id="sbx-pass",
        dns_passthrough=True,
        rules=(rule("egress[0]", domain="allowed.test", ports=(port,)),),
    )
    async with attached(egress, cgroup, plan):
        results = await run_client(
            cgroup,
            [
                {"op": "resolve", "name": "denied.test"},
                {"op": "connect", "host": "127.0.0.20", "port": denied_port},
            ],
        )
    assert results == [
        {"rcode": "NOERROR", "addresses": ["127.0.0.20"], "truncated": False},
        "EPERM",
    ]


async def test_programs_stay_when_the_agent_dies_and_a_new_agent_adopts_them(
    zone: ZoneServer, echo: Echo, cgroup: Path, tmp_path: Path
) -> None:
    port = await echo.serve("127.0.0.10")
    denied_port = await echo.serve("127.0.0.20", port)
    tag = f"restart-{uuid.uuid4().hex[:8]}"
    pin, state = Path(f"/sys/fs/bpf/dsec-{tag}/egress"), tmp_path / "state"
    plan = EgressPlan(
        sandbox_id="sbx-restart",
        rules=(
            rule("egress[0]", domain="allowed.test", ports=(port,)),
            rule("egress[1]", cidr="127.0.0.10/32", ports=(port,)),
        ),
    )
    doomed = CGROUP2 / f"dsec-egress-test-{uuid.uuid4().hex[:10]}"
    doomed.mkdir()
    doomed_id = os.stat(doomed).st_ino
    gone = plan.model_copy(update={"sandbox_id": "sbx-gone"})
    sandboxes = [
        (str(cgroup), plan.model_dump(mode="json")),
        (str(doomed), gone.model_dump(mode="json")),
    ]
    agent = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        AGENT,
        str(pin),
        str(state),
        zone.address,
        json.dumps(sandboxes),
        stdout=asyncio.subprocess.PIPE,
    )
    successor: EgressController | None = None
    try:
        assert agent.stdout is not None
        line = await asyncio.wait_for(agent.stdout.readline(), 60)
        assert line.strip() == b"ready"
        agent.kill()  # SIGKILL: no cleanup
        await agent.wait()
        fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
        try:  # the dead agent's programs, still attached
            before = [p for t in ATTACH_TYPES.values() for p in libbpf.attached_prog_ids(fd, t)]
        finally:
            os.close(fd)
        doomed.rmdir()  # this sandbox ends while no agent runs
        # as an agent from before the bind and ingress programs left it: the successor adds them
        fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for name in ("ingress", "bind4"):
                for prog_id in libbpf.attached_prog_ids(fd, ATTACH_TYPES[name]):
                    libbpf.detach_prog_id(fd, ATTACH_TYPES[name], prog_id)
        finally:
            os.close(fd)

        orphaned = await run_client(
            cgroup,
            [
                {"op": "connect", "host": "127.0.0.10", "port": port},
                {"op": "connect", "host": "127.0.0.20", "port": denied_port},
                {"op": "resolve", "name": "allowed.test", "timeout": 1},
            ],
        )
        assert orphaned[:2] == ["ok", "EPERM"]  # fail-closed: policy still enforced
        assert orphaned[2] in ("ECONNREFUSED", "Timeout")  # and DNS is not open either

        successor = EgressController(dns_upstream=zone.address, pin_dir=pin, state_dir=state)
        await successor.start()
        report = await successor.reconcile()
        assert report.adopted == ("sbx-restart",)
        assert report.removed == (doomed_id,)
        assert doomed_id not in successor.kernel.sandbox_ids()
        adopted = await run_client(
            cgroup,
            [
                {"op": "resolve", "name": "allowed.test"},
                {"op": "connect", "host": "127.0.0.20", "port": denied_port},
            ],
        )
        assert adopted[0]["addresses"] == ["127.0.0.10"]
        assert adopted[1] == "EPERM"
        assert successor.kernel.attached_count(cgroup) == len(ATTACH_TYPES)
        # every program is now the successor's own version, replaced in place (an upgraded
        # agent's fixes reach the sandboxes already running), and its predecessor's are gone
        own = successor.kernel.own_program_ids()
        assert successor.kernel.attached_ids(cgroup) == own and len(own) == len(ATTACH_TYPES)
        assert not own & set(before)
        await successor.detach(cgroup)
        assert successor.kernel.attached_count(cgroup) == len(FOLLOWERS)
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
        if doomed.exists():
            doomed.rmdir()
        if successor is not None:
            await successor.uninstall()
        else:
            with contextlib.suppress(FileNotFoundError):
                _rmtree(pin.parent)
    assert not pin.exists()


async def test_a_nested_cgroup_inherits_its_sandbox_policy(
    egress: EgressController, echo: Echo, cgroup: Path
) -> None:
    port = await echo.serve("127.0.0.10")
    denied_port = await echo.serve("127.0.0.20", port)
    plan = EgressPlan(
        sandbox_id="sbx-nested", rules=(rule("egress[0]", domain="allowed.test", ports=(port,)),)
    )
    async with attached(egress, cgroup, plan) as events:
        child = cgroup / "exec-1"
        child.mkdir()
        try:
            results = await run_client(
                child,
                [
                    {"op": "resolve", "name": "allowed.test"},
                    {"op": "connect", "host": "127.0.0.10", "port": port},
                    {"op": "connect", "host": "127.0.0.20", "port": denied_port},
                ],
            )
        finally:
            child.rmdir()
        egress.drain_events()
    assert results[0]["addresses"] == ["127.0.0.10"]
    assert results[1:] == ["ok", "EPERM"]
    assert [(e.sandbox_id, e.port) for e in events if e.denied] == [("sbx-nested", denied_port)]


async def test_the_stacks_servers_are_denied_whatever_the_rules_say(
    egress: EgressController, echo: Echo, cgroup: Path, stack_env: dict[str, str]
) -> None:
    # The real stack's endpoints, as the node agent reads them (settings + stack.json).
    from dsec_core.settings import Settings
    from dsec_core.stackinfo import stack_endpoints

    from dsec_nodeagent.egress import violation
    from dsec_nodeagent.stackdeny import deny_entries, local_addresses

    settings = Settings(**{k[5:].lower(): v for k, v in stack_env.items() if k.startswith("DSEC_")})
    endpoints = stack_endpoints(settings)
    nats_port = next(port for what, _, port in endpoints if what == "NATS")
    # every port the stack's servers listen on, SeaweedFS's gRPC (+10000) included
    denied_ports = {p for _, _, p in endpoints}
    for name, server in settings.stack_state.get("servers", {}).items():
        if server.get("external") or server.get("absent"):
            continue
        assert set(server["listening"]) >= set(server["ports"]), name
        assert denied_ports >= set(server["listening"]), name
    seaweed = settings.stack_state["servers"]["s3"]
    assert {p + 10000 for p in seaweed["ports"]} <= set(seaweed["listening"])
    other = await echo.serve("127.0.0.1")
    plan = EgressPlan(
        sandbox_id="sbx-stack",
        rules=(
            rule("egress[0]", cidr="127.0.0.0/8", ports=(nats_port, other)),
            rule("egress[1]", domain="*", ports=(nats_port,)),
        ),
    )
    assert await egress.set_stack_deny(deny_entries(endpoints, local_addresses())) >= len(endpoints)
    try:
        async with attached(egress, cgroup, plan) as events:
            results = await run_client(
                cgroup,
                [
                    {"op": "libc_connect", "host": "127.0.0.1", "port": nats_port},
                    {"op": "libc_connect", "host": "127.0.0.7", "port": nats_port},
                    {"op": "connect", "host": "127.0.0.1", "port": other},
                    # its port taken while a server restarts: refused (else EADDRINUSE)
                    {"op": "bind", "host": "127.0.0.1", "port": nats_port},
                ],
            )
            egress.drain_events()
    finally:
        await egress.set_stack_deny([])
    assert results == ["EPERM", "EPERM", "ok", "EPERM"]
    stack = [e for e in events if e.verdict is Verdict.DENY_STACK]
    assert {(e.address, e.port, e.hook.name) for e in stack} == {
        ("127.0.0.1", nats_port, "CONNECT4"),
        ("127.0.0.7", nats_port, "CONNECT4"),
        ("127.0.0.1", nats_port, "BIND4"),
    }
    event = violation(stack[0])
    assert (event.layer, event.action, event.rule_id) == ("kernel", "deny", "system.egress")
    assert "the DSec stack's own servers" in event.message


@contextlib.contextmanager
def dns_refusals(egress: EgressController) -> Iterator[list[tuple[str, str, str, str]]]:
    """(sandbox, name, rule id, reason) of every question the proxy refuses meanwhile."""
    seen: list[tuple[str, str, str, str]] = []
    before = egress.proxy.on_denied

    def on_denied(sid: str, name: str, rdtype: str, *, rule_id: str, reason: str) -> None:
        seen.append((sid, name, rule_id, reason))

    egress.proxy.on_denied = on_denied
    try:
        yield seen
    finally:
        egress.proxy.on_denied = before


async def test_a_flooding_sandbox_fills_only_its_own_quota(
    egress: EgressController, echo: Echo, cgroup: Path
) -> None:
    port = await echo.serve("127.0.0.10")
    victim_cgroup = CGROUP2 / f"dsec-egress-test-{uuid.uuid4().hex[:10]}"
    victim_cgroup.mkdir()
    attacker = EgressPlan(
        sandbox_id="sbx-flood",
        rules=tuple(
            rule(f"egress[{i}]", domain=name, ports=(port,))
            for i, name in enumerate(("big.test", "big2.test", "big3.test"))
        ),
    )
    victim = EgressPlan(
        sandbox_id="sbx-victim", rules=(rule("egress[0]", domain="allowed.test", ports=(port,)),)
    )
    try:
        with dns_refusals(egress) as refused:
            async with attached(egress, cgroup, attacker), attached(egress, victim_cgroup, victim):
                flood = await run_client(
                    cgroup,
                    [
                        {"op": "resolve", "name": name, "proto": "tcp"}
                        for name in ("big.test", "big2.test", "big3.test")
                    ],
                )
                (answer, connected) = await run_client(
                    victim_cgroup,
                    [
                        {"op": "resolve", "name": "allowed.test"},
                        {"op": "connect", "host": "127.0.0.10", "port": port},
                    ],
                )
                held = len(list(egress.kernel.host_entries(os.stat(cgroup).st_ino)))
    finally:
        _kill_members(victim_cgroup)
        victim_cgroup.rmdir()
    assert [len(r["addresses"]) for r in flood] == [32, 32, 0]  # 64 = the quota
    assert flood[2]["rcode"] == "SERVFAIL"
    assert held == 64
    assert answer == {"rcode": "NOERROR", "addresses": ["127.0.0.10"], "truncated": False}
    assert connected == "ok"
    assert [(sid, name, rule_id) for sid, name, rule_id, _ in refused] == [
        ("sbx-flood", "big3.test", "dns.quota")
    ]


async def test_a_rebinding_answer_opens_nothing(
    egress: EgressController, echo: Echo, cgroup: Path
) -> None:
    port = await echo.serve("127.0.0.1")  # a host service on loopback
    plan = EgressPlan(
        sandbox_id="sbx-rebind",
        rules=(rule("egress[0]", domain="rebind.test", ports=(port,), allow_internal_only=False),),
    )
    with dns_refusals(egress) as refused:
        async with attached(egress, cgroup, plan) as events:
            answer, connected = await run_client(
                cgroup,
                [
                    {"op": "resolve", "name": "rebind.test"},
                    {"op": "connect", "host": "127.0.0.1", "port": port},
                ],
            )
            egress.drain_events()
    assert answer == {"rcode": "NOERROR", "addresses": [], "truncated": False}
    assert connected == "EPERM"
    assert denials(events) == {("DENY_NO_RULE", "127.0.0.1", port, None)}
    assert [(name, rule_id) for _, name, rule_id, _ in refused] == [
        ("rebind.test", "dns.rebinding")
    ]
    assert "127.0.0.1 is loopback" in refused[0][3]


async def test_a_sandbox_listens_on_loopback_only(egress: EgressController, cgroup: Path) -> None:
    """A sandbox shares the host's network: before, it could listen on any of the host's
    addresses (taking connections from anywhere, past its egress rules). A wildcard bind is
    now a loopback one; a bind to another address is refused and reported."""
    from dsec_nodeagent.egress import violation

    plan = EgressPlan(sandbox_id="sbx-bind", rules=())
    async with attached(egress, cgroup, plan) as events:
        (own,) = [s for s in egress.sandboxes() if s.sandbox_id == "sbx-bind"]
        ports = proxy_port_range()
        assert ports is not None and ports[0] <= own.dns_port <= ports[1]  # above the ephemeral
        wildcard4, wildcard6, udp, elsewhere, mapped, proxy, unused = await run_client(
            cgroup,
            [
                {"op": "bind", "host": "0.0.0.0", "port": 0},
                {"op": "bind", "host": "::", "port": 0},
                {"op": "bind", "host": "0.0.0.0", "port": 0, "udp": True},
                {"op": "bind", "host": "192.0.2.1", "port": 0},  # (else EADDRNOTAVAIL)
                {"op": "bind", "host": "::ffff:192.0.2.1", "port": 0},
                # a DNS proxy listener's port (any sandbox's): free on 127.0.0.2, and on
                # 127.0.0.1 while the node agent restarts
                {"op": "bind", "host": "127.0.0.2", "port": own.dns_port, "udp": True},
                # any port of the proxies' range, used or not: no bind tells which are used
                {"op": "bind", "host": "127.0.0.1", "port": ports[1], "udp": True},
            ],
        )
        egress.drain_events()
    assert (wildcard4[0], wildcard6[0], udp[0]) == ("127.0.0.1", "::1", "127.0.0.1")
    assert (elsewhere, mapped, proxy, unused) == ("EPERM", "EPERM", "EPERM", "EPERM")
    # a bind to port 0 never lands in the proxies' range (above the kernel's ephemeral ports)
    assert not ports[0] <= wildcard4[1] <= ports[1]
    refused = [e for e in events if e.verdict is Verdict.DENY_BIND]
    assert [(e.hook.name, e.address) for e in refused] == [
        ("BIND4", "192.0.2.1"),
        ("BIND6", "192.0.2.1"),
    ]
    assert violation(refused[0]).rule_id == "system.bind"
    assert "listens on loopback only" in refused[0].message()


async def test_a_socket_listening_without_a_bind_takes_no_connection_from_outside(
    egress: EgressController, cgroup: Path, tmp_path: Path
) -> None:
    """listen() on a socket never bound is bound by the kernel to every address, and no bind
    hook runs: such a server took connections from anywhere. The ingress program drops a
    connection request to a sandbox's socket from anything but loopback."""
    from dsec_nodeagent.stackdeny import local_addresses

    found = local_addresses()
    outside4 = sorted(a for a in found if ":" not in a and not a.startswith("127."))
    outside6 = sorted(a for a in found if ":" in a and a != "::1" and not a.startswith("fe80"))
    assert outside4 and outside6, "this test needs the host to have IPv4 and IPv6 addresses"
    plan = EgressPlan(sandbox_id="sbx-listen", rules=())
    async with attached(egress, cgroup, plan):
        for v6, outside, wildcard, local in (
            (False, outside4[0], "0.0.0.0", "127.0.0.1"),
            (True, outside6[0], "::", "::1"),  # a dual-stack socket
        ):
            port_file = tmp_path / f"port-{v6}"
            action = {"op": "listen_unbound", "port_file": str(port_file), "wait": 20, "v6": v6}
            served = asyncio.create_task(run_client(cgroup, [action]))
            deadline = time.monotonic() + 20
            while not port_file.exists():
                assert time.monotonic() < deadline and not served.done(), "it never listened"
                await asyncio.sleep(0.02)
            port = int(port_file.read_text())
            with pytest.raises(TimeoutError):  # the SYN is dropped: no answer, no RST
                await asyncio.wait_for(asyncio.open_connection(outside, port), 1.5)
            _, writer = await asyncio.open_connection(local, port)  # the node itself: taken
            writer.close()
            (taken,) = await served
            assert taken == [wildcard, local]


async def test_a_tcp_grant_does_not_open_udp(
    egress: EgressController, echo: Echo, cgroup: Path
) -> None:
    port = await echo.serve("127.0.0.30")
    plan = EgressPlan(
        sandbox_id="sbx-proto",
        rules=(
            rule("egress[0]", cidr="127.0.0.30/32", ports=(port,)),  # tcp (the default)
            rule(
                "egress[1]",
                cidr="127.0.0.31/32",
                ports=(port,),
                protocols=("udp",),
                rate_limit=RateLimit(count=2, per_seconds=3600),  # datagrams sent with sendto
            ),
            rule("egress[2]", domain="allowed.test", ports=(port,)),  # tcp, from DNS
        ),
    )
    async with attached(egress, cgroup, plan) as events:
        results = await run_client(
            cgroup,
            [
                {"op": "connect", "host": "127.0.0.30", "port": port},
                {"op": "udp_sendto", "host": "127.0.0.30", "port": port},
                {"op": "resolve", "name": "allowed.test"},
                {"op": "udp_sendto", "host": "127.0.0.10", "port": port},
                *[{"op": "udp_sendto", "host": "127.0.0.31", "port": port}] * 3,
            ],
        )
        egress.drain_events()
    assert results[:2] == ["ok", "EPERM"]
    assert results[3:] == ["EPERM", "ok", "ok", "EPERM"]
    assert denials(events) == {
        ("DENY_PROTOCOL", "127.0.0.30", port, "egress[0]"),
        ("DENY_PROTOCOL", "127.0.0.10", port, "egress[2]"),
        ("DENY_RATE_LIMIT", "127.0.0.31", port, "egress[1]"),
    }
    refused = next(e for e in events if e.verdict is Verdict.DENY_PROTOCOL)
    assert refused.protocol == "udp"
    assert "does not open udp" in refused.message()


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total = sum(int.from_bytes(data[i : i + 2], "big") for i in range(0, len(data), 2))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def _icmp_port_unreachable(address: str, port: int, payload: bytes) -> None:
    """An ICMP port-unreachable, from the host's own address, quoting a datagram the socket at
    ``address``:``port`` seemingly sent to 192.0.2.1/2001:db8::1:9 with ``payload``."""
    import socket
    import struct

    udp = struct.pack("!HHHH", port, 9, 8 + len(payload), 0) + payload
    if ":" not in address:
        inner = struct.pack(
            "!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0,
            socket.inet_aton(address), socket.inet_aton("192.0.2.1"),
        ) + udp  # fmt: skip
        body = b"\0\0\0\0" + inner
        icmp = struct.pack("!BBH", 3, 3, _checksum(struct.pack("!BBH", 3, 3, 0) + body)) + body
        with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as raw:
            raw.sendto(icmp, (address, 0))
        return
    inner = struct.pack(
        "!IHBB16s16s", 6 << 28, len(udp), 17, 64,
        socket.inet_pton(socket.AF_INET6, address),
        socket.inet_pton(socket.AF_INET6, "2001:db8::1"),
    ) + udp  # fmt: skip
    icmp = struct.pack("!BBHI", 1, 4, 0, 0) + inner  # (the kernel sums ICMPv6 itself)
    with socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6) as raw:
        raw.sendto(icmp, (address, 0))


async def test_an_unconnected_udp_socket_takes_datagrams_only_from_its_peers(
    egress: EgressController, cgroup: Path, tmp_path: Path
) -> None:
    """A UDP socket never bound is bound by the kernel to every address at its first sendto (no
    bind hook runs), so it took datagrams from any host and port: an inbound channel past every
    egress rule. From outside loopback only its allowed peers' datagrams reach it now."""
    import socket

    from dsec_nodeagent.stackdeny import local_addresses

    found = local_addresses()
    outside4 = sorted(a for a in found if ":" not in a and not a.startswith("127."))
    outside6 = sorted(a for a in found if ":" in a and a != "::1" and not a.startswith("fe80"))
    assert outside4 and outside6, "this test needs the host to have IPv4 and IPv6 addresses"
    for outside, kind, local in (
        (outside4[0], socket.AF_INET, "127.0.0.1"),
        (outside6[0], socket.AF_INET6, "::1"),
    ):
        peer = socket.socket(kind, socket.SOCK_DGRAM)
        stranger = socket.socket(kind, socket.SOCK_DGRAM)  # same host, another port
        neighbour = socket.socket(kind, socket.SOCK_DGRAM)  # loopback: the node itself
        try:
            peer.bind((outside, 0))
            stranger.bind((outside, 0))
            neighbour.bind((local, 0))
            peer.settimeout(20)
            port = peer.getsockname()[1]
            width = "/32" if kind == socket.AF_INET else "/128"
            plan = EgressPlan(
                sandbox_id="sbx-udp-in",
                rules=(rule("egress[0]", cidr=outside + width, ports=(port,), protocols=("udp",)),),
            )
            port_file = tmp_path / f"udp-{kind}"
            action = {
                "op": "udp_replies", "host": outside, "port": port,
                "port_file": str(port_file), "wait": 20,
            }  # fmt: skip
            async with attached(egress, cgroup, plan):
                received = asyncio.create_task(run_client(cgroup, [action]))
                data, client = await asyncio.to_thread(peer.recvfrom, 64)
                assert data == b"ping"
                deadline = time.monotonic() + 20
                while not port_file.exists():  # (written right after the sendto)
                    assert time.monotonic() < deadline and not received.done()
                    await asyncio.sleep(0.02)
                sandbox_port = int(port_file.read_text())
                _icmp_port_unreachable(outside, sandbox_port, b"COVERT")
                stranger.sendto(b"stranger", (outside, sandbox_port))
                neighbour.sendto(b"loopback", (local, sandbox_port))
                peer.sendto(b"reply", client)
                peer.sendto(b"end", client)
                (got,) = await received
            # datagrams queue in the order they came: a stranger's would show before "reply";
            # and the ICMP error quoting the socket, from a stranger, queued nothing
            assert [g[0] for g in got] == ["loopback", "reply", "end"], got
            assert {(g[1], g[2]) for g in got if g[0] != "loopback"} == {(outside, port)}
        finally:
            for s in (peer, stranger, neighbour):
                s.close()


async def test_a_sandbox_holds_at_most_its_share_of_the_hosts_ports(
    egress: EgressController, cgroup: Path
) -> None:
    """A sandbox shares the host's network: each socket it binds takes one of the host's ports,
    and one sandbox binding every ephemeral port left the node (root included) none to connect
    or send from. Its IP sockets are counted: past its bound socket() fails EPERM, and each
    closed one gives its place back; the node's own sockets are not counted."""
    from dsec_nodeagent.egress import violation

    plan = EgressPlan(sandbox_id="sbx-sockets", rules=())
    async with attached(egress, cgroup, plan) as events:
        (budget,) = await run_client(cgroup, [{"op": "socket_budget", "most": 4 * SANDBOX_SOCKETS}])
        # the node meanwhile: no bound of its own (the cgroup's client has ended by now, and
        # every socket it held was given back: a second client gets the whole bound again)
        node = [socket.socket() for _ in range(2 * SANDBOX_SOCKETS)]
        for s in node:
            s.close()
        (again,) = await run_client(cgroup, [{"op": "socket_budget", "most": 4 * SANDBOX_SOCKETS}])
        egress.drain_events()
    assert budget == {"held": SANDBOX_SOCKETS, "refused": "EPERM", "again": 16, "after": "EPERM"}
    assert again == budget
    refused = [e for e in events if e.verdict is Verdict.DENY_SOCKETS]
    assert refused and {e.hook.name for e in refused} == {"SOCKET"}
    assert violation(refused[0]).rule_id == "system.sockets"
    assert "holds as many IP sockets as it may" in refused[0].message()


async def test_a_sandbox_reaches_no_neighbours_dns_proxy_whatever_its_rules(
    egress: EgressController, cgroup: Path
) -> None:
    """Each sandbox's DNS proxy listener charges the questions it gets to its sandbox: a
    neighbour whose rules open loopback (every port, UDP and TCP) sent to it directly, spent its
    query budget (its own lookups then REFUSED) and could probe which names it may resolve.
    Another sandbox's proxy port is refused whatever the rules say; its own is reached through
    the port-53 redirect, as before."""
    victim_cgroup = CGROUP2 / f"dsec-egress-test-{uuid.uuid4().hex[:10]}"
    victim_cgroup.mkdir()
    wide = EgressPlan(
        sandbox_id="sbx-wide",
        rules=(
            rule("egress[0]", cidr="127.0.0.0/8", protocols=("tcp", "udp")),
            rule("egress[1]", domain="allowed.test"),
        ),
    )
    try:
        async with (
            attached(egress, victim_cgroup, EgressPlan(sandbox_id="sbx-victim", rules=())),
            attached(egress, cgroup, wide) as events,
        ):
            (victim,) = [s for s in egress.sandboxes() if s.sandbox_id == "sbx-victim"]
            (own,) = [s for s in egress.sandboxes() if s.sandbox_id == "sbx-wide"]
            results = await run_client(
                cgroup,
                [
                    {"op": "udp_sendto", "host": "127.0.0.1", "port": victim.dns_port},
                    {"op": "udp_sendto", "host": "::1", "port": victim.dns_port},
                    {"op": "connect", "host": "127.0.0.1", "port": victim.dns_port},
                    {"op": "resolve", "name": "allowed.test"},  # its own, by the redirect
                ],
            )
            egress.drain_events()
    finally:
        _kill_members(victim_cgroup)
        victim_cgroup.rmdir()
    assert results[:3] == ["EPERM", "EPERM", "EPERM"], results
    assert results[3]["rcode"] == "NOERROR", results
    assert own.dns_port != victim.dns_port
    refused = {(e.verdict.name, e.port) for e in events if e.denied}
    assert refused == {("DENY_STACK", victim.dns_port)}


async def test_a_sandbox_reaches_no_neighbours_private_listener_whatever_its_rules(
    egress: EgressController, cgroup: Path, echo: Echo
) -> None:
    """A sandbox's HTTPS proxy listens on a loopback port of the node agent's: a neighbour whose
    rules open loopback connected to it, and the proxy spent its time telling those
    connections from its sandbox's (its bound on connections not yet told apart refused the
    sandbox's own in a flood). Such a port is private to its sandbox in the kernel: refused to
    every other, whatever its rules; its own sandbox reaches it through its rule."""
    port = await echo.serve("127.0.0.1")
    owner_cgroup = CGROUP2 / f"dsec-egress-test-{uuid.uuid4().hex[:10]}"
    owner_cgroup.mkdir()
    own = EgressPlan(
        sandbox_id="sbx-owner",
        rules=(rule("egress[0]", cidr="127.0.0.1/32", ports=(port,)),),
        private_ports=(port,),
    )
    wide = EgressPlan(
        sandbox_id="sbx-wide-loopback", rules=(rule("egress[0]", cidr="127.0.0.0/8"),)
    )
    try:
        async with (
            attached(egress, owner_cgroup, own),
            attached(egress, cgroup, wide) as events,
        ):
            neighbour = await run_client(
                cgroup,
                [
                    {"op": "connect", "host": "127.0.0.1", "port": port},
                    {"op": "connect", "host": "::ffff:127.0.0.1", "port": port},
                ],
            )
            owner = await run_client(
                owner_cgroup, [{"op": "connect", "host": "127.0.0.1", "port": port}]
            )
            echo.servers.pop(("127.0.0.1", port)).close()  # the listener goes (an agent restart)
            bound = await run_client(cgroup, [{"op": "bind", "host": "127.0.0.1", "port": port}])
            egress.drain_events()
        after = await _reserved_ports(egress)
    finally:
        _kill_members(owner_cgroup)
        owner_cgroup.rmdir()
    assert neighbour == ["EPERM", "EPERM"], neighbour
    assert owner == ["ok"], owner
    assert bound == ["EPERM"], bound  # (bound, it would take the owner's connections)
    assert {(e.verdict.name, e.port) for e in events if e.denied} == {("DENY_STACK", port)}
    assert port not in after  # (its sandbox detached: the port is anyone's again)


async def test_a_sandbox_adopted_after_a_restart_loses_the_way_to_its_gone_proxy(
    zone: ZoneServer, echo: Echo
) -> None:
    """The HTTPS proxy goes with the node agent that ran it. Its sandbox, adopted by the next
    agent, kept its grant to the proxy's port, whose reservation was gone: a neighbour that
    bound that port took the sandbox's proxy traffic (its requests, headers and all). The
    adopted sandbox loses the grant (it fails closed), and no sandbox binds another's
    private port while it is reserved."""
    tag = f"test-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    pin, state = Path(f"/sys/fs/bpf/dsec-{tag}/egress"), Path(f"/run/dsec-{tag}/egress")
    port = await echo.serve("127.0.0.1")
    owner_cgroup = CGROUP2 / f"dsec-egress-test-{uuid.uuid4().hex[:10]}"
    owner_cgroup.mkdir()
    first = EgressController(dns_upstream=zone.address, pin_dir=pin, state_dir=state)
    successor: EgressController | None = None
    try:
        await first.start()
        plan = EgressPlan(
            sandbox_id="sbx-owner",
            rules=(rule("egress[0]", cidr="127.0.0.1/32", ports=(port,)),),
            private_ports=(port,),
        )
        await first.attach(owner_cgroup, plan)
        before = await run_client(
            owner_cgroup, [{"op": "connect", "host": "127.0.0.1", "port": port}]
        )
        await first.close()  # the agent dies: programs and pins stay
        successor = EgressController(dns_upstream=zone.address, pin_dir=pin, state_dir=state)
        await successor.start()
        report = await successor.reconcile()
        after = await run_client(
            owner_cgroup, [{"op": "connect", "host": "127.0.0.1", "port": port}]
        )
        (adopted,) = successor.sandboxes()
    finally:
        _kill_members(owner_cgroup)
        if successor is not None:
            await successor.uninstall()
        else:
            await first.uninstall()
        owner_cgroup.rmdir()
    assert before == ["ok"] and report.adopted == ("sbx-owner",)
    assert after == ["EPERM"], after  # fails closed: no grant to a port that is anyone's
    assert adopted.plan.private_ports == () and adopted.plan.rules == ()


async def _reserved_ports(egress: EgressController) -> set[int]:
    return {int(k.value) for k in egress.kernel._table("private_ports")}


def _ports_toward(host: str, port: int) -> int:
    """How many of the host's TCP sockets toward ``host:port`` hold a port: connected,
    closing (FIN_WAIT1/2, CLOSING, LAST_ACK) or in TIME_WAIT."""
    want = f"{socket.htonl(int(ip_address(host))):08X}:{port:04X}"
    rows = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(1 for r in rows if r.split()[2] == want and r.split()[3] != "07")


async def test_sockets_closed_into_time_wait_count_until_their_ports_are_free(
    egress: EgressController, cgroup: Path, echo: Echo
) -> None:
    """A TCP connection its own side closes keeps its port for a minute (TIME_WAIT) after its
    release: connecting and closing in a loop, a sandbox held every ephemeral port toward one
    destination with one live socket. Those count until the kernel frees them: a burst too,
    for the whole minute (a pile that drained linearly let about a twelfth of the bound back
    every 5 s while every port was still held)."""
    port = await echo.serve("127.0.0.30")
    plan = EgressPlan(
        sandbox_id="sbx-churn", rules=(rule("egress[0]", cidr="127.0.0.30/32", ports=(port,)),)
    )
    churn_once = {"op": "churn", "host": "127.0.0.30", "port": port, "most": 8 * SANDBOX_SOCKETS}
    async with attached(egress, cgroup, plan):
        (churn,) = await run_client(cgroup, [churn_once])
        await asyncio.sleep(5)  # (the time a linear drain gives back a twelfth of the bound)
        (later,) = await run_client(cgroup, [churn_once])
        held = _ports_toward("127.0.0.30", port)
        egress.drain_events()
    # never more than one live socket: the lingering ones are what it is refused for
    assert churn["refused"] == "EPERM", churn
    assert SANDBOX_SOCKETS - 16 <= churn["made"] <= SANDBOX_SOCKETS + 4, churn
    assert later == {"made": 0, "refused": "EPERM"}, later
    assert held >= churn["made"] - 4, held  # (what the kernel still holds: the bound's worth)


async def _until_refused(
    egress: EgressController, cgroup: Path, echo: Echo, host: str, op: str, **extra: Any
) -> tuple[dict[str, Any], int, list[VerdictEvent]]:
    """Run ``op`` toward an echo server on ``host`` (a rule opens it) until a refusal; return
    its result, the server's port and the sandbox's verdict events."""
    port = await echo.serve(host)
    plan = EgressPlan(
        sandbox_id=f"sbx-{op}-{host}", rules=(rule("egress[0]", cidr=f"{host}/32", ports=(port,)),)
    )
    action = {"op": op, "host": host, "port": port, "most": 4 * SANDBOX_SOCKETS, **extra}
    async with attached(egress, cgroup, plan) as events:
        (result,) = await run_client(cgroup, [action])
        egress.drain_events()
    assert result["refused"] == "EPERM", result
    assert SANDBOX_SOCKETS - 16 <= result["made"] <= SANDBOX_SOCKETS + 4, result
    return result, port, events


def _live(egress: EgressController, key: int) -> int | None:
    """The live count of a sandbox (its cgroup id) or of the node (0), read as signed."""
    leaf = egress.kernel._table("sock_use").get(ctypes.c_uint64(key))
    return None if leaf is None else ctypes.c_int64(leaf.live).value


async def _until(check: Any, timeout: float = 20.0) -> None:
    """Wait until ``check()`` holds (the kernel ends connections on its own time)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_an_accepted_connection_closed_first_counts_for_its_listeners_port(
    egress: EgressController, cgroup: Path
) -> None:
    """An accepted connection holds its listener's port, after the listener's close too, and a
    minute more in TIME_WAIT when its side closes first: a listener per cycle (bind port 0,
    accept, close the accepted socket first) took a fresh ephemeral port of the host's each
    time, uncounted (accepted sockets were not followed), 1,024 in 0.03 s. They count now."""
    plan = EgressPlan(sandbox_id="sbx-listeners", rules=(rule("egress[0]", cidr="127.0.0.1/32"),))
    async with attached(egress, cgroup, plan):
        (churn,) = await run_client(cgroup, [{"op": "listen_churn", "most": 4 * SANDBOX_SOCKETS}])
        egress.drain_events()
    assert churn["refused"] == "EPERM", churn
    assert SANDBOX_SOCKETS // 2 - 16 <= churn["made"] <= SANDBOX_SOCKETS + 4, churn


async def test_connections_made_again_on_one_socket_leave_its_count_where_it_was(
    egress: EgressController, cgroup: Path, echo: Echo
) -> None:
    """Connecting one socket again and again (``connect(AF_UNSPEC)`` between): an MPTCP
    socket's subflow, or an accepted socket, gave its place back at each connection's end but
    took it only once, so the sandbox's count and the node's went below zero (read as none:
    no bound held any more, for every sandbox of the node). Each connection takes its place
    and gives it back once."""
    port = await echo.serve("127.0.0.34")
    plan = EgressPlan(
        sandbox_id="sbx-cycles",
        rules=(
            rule("egress[0]", cidr="127.0.0.34/32", ports=(port,)),
            rule("egress[1]", cidr="127.0.0.1/32"),
        ),
    )
    async with attached(egress, cgroup, plan) as _:
        sandbox = next(s for s in egress.sandboxes() if s.sandbox_id == "sbx-cycles")
        (cycles,) = await run_client(
            cgroup, [{"op": "cycles", "host": "127.0.0.34", "port": port, "n": 60}]
        )
        await _until(
            lambda: (
                _live(egress, sandbox.cgroup_id) == 0 or (_live(egress, sandbox.cgroup_id) or 0) < 0
            )
        )
        live = _live(egress, sandbox.cgroup_id)
        egress.drain_events()
    assert cycles == [60, 60], cycles
    assert live == 0, live


async def test_a_detached_sandboxs_closing_connections_give_the_node_its_places_back() -> None:
    """A sandbox exits with connections still closing (their FIN behind unsent data, the peer
    not reading), and is detached. Those connections end later: detached, the programs that
    follow them were gone, so the node's count kept their places for good (a few sandbox
    lifetimes would fill the node's budget: every sandbox refused). They stay on the cgroup
    until it goes."""
    pin = Path(f"/sys/fs/bpf/dsec-test-{os.getpid()}-{uuid.uuid4().hex[:6]}/egress")
    ctl = EgressController(
        dns_upstream="127.0.0.1", pin_dir=pin, max_sandbox_sockets=SANDBOX_SOCKETS
    )
    await ctl.start()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    server.bind(("127.0.0.36", 0))
    server.listen(64)
    port = server.getsockname()[1]
    path = CGROUP2 / f"dsec-egress-test-{uuid.uuid4().hex[:10]}"
    path.mkdir()
    try:
        plan = EgressPlan(
            sandbox_id="sbx-stuck", rules=(rule("egress[0]", cidr="127.0.0.36/32", ports=(port,)),)
        )
        await ctl.attach(path, plan)
        (stuck,) = await run_client(
            path, [{"op": "stuck", "host": "127.0.0.36", "port": port, "n": 20}]
        )
        assert stuck == 20
        assert _live(ctl, 0) == 20  # (the client has exited: its connections still closing)
        await ctl.detach(path)
        _kill_members(path)
        path.rmdir()
        server.close()  # the peer resets them: each connection ends now
        await _until(lambda: _ports_toward("127.0.0.36", port) == 0)
        assert _live(ctl, 0) == 0
    finally:
        server.close()
        if path.exists():
            _kill_members(path)
            path.rmdir()
        await ctl.uninstall()


async def test_an_mptcp_socket_is_refused_in_the_kernel_too(
    egress: EgressController, cgroup: Path
) -> None:
    """An MPTCP connection is made by the kernel's own sockets under the sandbox's (subflows:
    shared cookies, accepted ones no hook sees), past the count of the host's ports a sandbox
    holds. seccomp refuses the protocol; the socket program refuses it behind that."""
    plan = EgressPlan(sandbox_id="sbx-mptcp", rules=())
    async with attached(egress, cgroup, plan):
        got = await run_client(cgroup, [{"op": "socket", "proto": 262}, {"op": "socket"}])
        egress.drain_events()
    assert got == ["EPERM", "ok"], got


async def test_an_accepted_socket_taking_a_port_of_its_own_is_counted(
    egress: EgressController, cgroup: Path
) -> None:
    """An accepted socket disconnected (``connect(AF_UNSPEC)``) and bound again takes a port of
    its own, though no ``socket()`` made it: 2,048 such were held against a bound of 256, none
    counted. It takes a place, within the bound, before it binds (or connects, or listens)."""
    plan = EgressPlan(sandbox_id="sbx-rebind", rules=(rule("egress[0]", cidr="127.0.0.1/32"),))
    async with attached(egress, cgroup, plan):
        (got,) = await run_client(cgroup, [{"op": "rebind_accepted", "most": 4 * SANDBOX_SOCKETS}])
        egress.drain_events()
    assert got["refused"] == "EPERM", got
    assert SANDBOX_SOCKETS - 16 <= got["made"] <= SANDBOX_SOCKETS, got


async def test_connections_a_neighbour_makes_to_a_sandboxs_server_count_as_one_port(
    egress: EgressController, cgroup: Path, tmp_path: Path
) -> None:
    """A sandbox's server that closes first (as HTTP servers do) leaves each accepted
    connection in TIME_WAIT, all on its one listening port. Counted per connection, a
    neighbour connecting in a loop put the server's sandbox, then the node, past their bounds
    in about a second (every sandbox of the node refused): a listener and its connections are
    one port, held a minute more after the last."""
    server_cgroup = CGROUP2 / f"dsec-egress-test-{uuid.uuid4().hex[:10]}"
    server_cgroup.mkdir()
    n, port_file = 3 * SANDBOX_SOCKETS, tmp_path / "port"
    try:
        async with attached(egress, server_cgroup, EgressPlan(sandbox_id="sbx-server", rules=())):
            (server,) = [s for s in egress.sandboxes() if s.sandbox_id == "sbx-server"]
            action = {"op": "serve_close_first", "port_file": str(port_file), "n": n, "wait": 60}
            served = asyncio.create_task(run_client(server_cgroup, [action]))
            await _until(lambda: port_file.exists() or served.done())
            port = int(port_file.read_text())
            client = EgressPlan(
                sandbox_id="sbx-caller", rules=(rule("egress[0]", cidr="127.0.0.1/32"),)
            )
            async with attached(egress, cgroup, client):
                (churn,) = await run_client(
                    cgroup,
                    [{"op": "churn", "host": "127.0.0.1", "port": port, "most": n, "eof": True}],
                )
            assert await served == [n]
            leaf = egress.kernel._table("sock_use").get(ctypes.c_uint64(server.cgroup_id))
            now = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 4_000_000_000
            lingering = sum(
                int(leaf.closed[i]) for i in range(16) if (now - int(leaf.slot[i])) % 2**32 < 16
            )
            after = await run_client(server_cgroup, [{"op": "socket"}])
            egress.drain_events()
    finally:
        _kill_members(server_cgroup)
        server_cgroup.rmdir()
    assert churn == {"made": n, "refused": None}, churn
    assert ctypes.c_int64(leaf.live).value == 0 and lingering == 1, (leaf.live, lingering)
    assert after == ["ok"]


async def test_a_connection_in_time_wait_before_its_close_counts_too(
    egress: EgressController, cgroup: Path, echo: Echo
) -> None:
    """A connection reaches TIME_WAIT before its socket is closed when the sandbox shuts its
    side first and the peer answers with its FIN: counted at the release's state, it was not
    counted at all (the socket's state is CLOSE by then), so shutdown-then-close took every
    port. Each connection is followed to its end instead, whatever order things happen in."""
    churn, port, _ = await _until_refused(egress, cgroup, echo, "127.0.0.31", "churn", half=True)
    assert _ports_toward("127.0.0.31", port) >= churn["made"] - 4


async def test_one_socket_connected_again_and_again_counts_each_connection(
    egress: EgressController, cgroup: Path, echo: Echo
) -> None:
    """``connect(AF_UNSPEC)`` frees a TCP socket to connect again, to a new port each time while
    the last connection's stays in TIME_WAIT: one socket, created once (past the only check a
    bound on socket() makes), took a port per cycle. A connect() again is refused like a new
    socket once the sandbox's bound is reached; the refusal is a violation of its own."""
    _, port, events = await _until_refused(egress, cgroup, echo, "127.0.0.32", "reconnect")
    refused = [e for e in events if e.verdict is Verdict.DENY_SOCKETS]
    assert refused and {e.hook.name for e in refused} == {"CONNECT4"}, refused
    assert refused[0].port == port
    assert "TIME_WAIT" in refused[0].message()
